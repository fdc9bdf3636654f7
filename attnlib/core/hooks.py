"""The kernels' declared, replaceable steps: the only seams through which code outside the
core (`attnlib.evidence.defects`) may change what a kernel computes.

Every kernel path looks its steps up here, by name, when it runs::

    state = hooks.get("state").empty(rows_shape, dv)          # the forward, the stream
    events = hooks.get("absorb")(state, q_i, k, v, spec, ...)  # one query tile's key tiles

and a caller swaps one for a while::

    with hooks.replaced(tile_scores=my_tile_scores):
        attnlib.attention(q, k, v)      # every path that forms scores uses my_tile_scores

So a function that moves, or a path that imports it by name, cannot silently escape a
replacement: the paths name the step, not the function.  Without a replacement each step
is its default, found with one dict lookup (per query tile, or per call); the defaults'
arithmetic is untouched.

The steps (`STEPS`) and who calls them:

``"state"``
    The online-softmax state class: its ``empty``, ``update`` and ``finalize`` (or
    ``finalize_parts``).  Created by the forward (and so varlen) and the stream (and so the
    paged cache), once per query tile.  A replacement is a subclass of
    `attnlib.core.online.OnlineSoftmax` (a class, since a state is created, updated and
    finalized: one object carries all three).
``"tile_scores"``
    `attnlib.core.tiles.tile_scores`, one tile's scores in the contract's order; called by
    `absorb` (forward, stream, paged, varlen) and by the backward, which recomputes them.
``"tile_visible"``
    `attnlib.core.masks.MaskSpec.tile_visible`, the mask of a PARTIAL tile, called as
    ``tile_visible(spec, rows, k0, k1, keys_first, contiguous=, cache=)`` by `absorb` and by
    the backward (FULL tiles need no mask; the dense reference uses `MaskSpec.visible`).
``"absorb"``
    `attnlib.core.tiles.absorb`, the key-tile loop of one query tile; called by the forward
    (once per query tile and key range) and the stream (once per query tile and chunk).
``"backward"``
    The backward's stage edits, ``edit(stage, x, **where) -> x`` (identity by default),
    called at these stages of `attnlib.core.backward.attention_backward`: ``"delta"``
    (``D``, per row), ``"ds"`` (a tile's ``ds``), ``"dq_tile"`` / ``"dk_tile"`` /
    ``"dv_tile"`` (a tile's ``ds @ k_j``, ``ds^T q_i``, ``p^T dout_i``; a None ``dq_tile``
    drops it; ``where``: ``a``, ``b``, and ``last`` for ``dq_tile``: whether ``b`` is the
    last visible key tile of query tile ``a``) and ``"grads"`` (the finished
    ``(dq, dk, dv[, dsinks])``).  One function for all stages: the backward's
    intermediates have no function of their own to replace.  While it is the default
    (`keep`) the backward makes no call at all.

A replacement is process-wide while it is in force (the worker threads of a call see it):
not for use while other threads run attnlib calls that must not see it.
"""

from __future__ import annotations

import contextlib
import importlib
import threading

#: The declared steps: name -> what it is (see the module docstring for who calls each).
STEPS = {
    "state": "the online-softmax state class (empty, update, finalize) of the forward paths",
    "tile_scores": "one tile's scores in the contract's order (tiles.tile_scores)",
    "tile_visible": "the mask of a PARTIAL tile (MaskSpec.tile_visible, called with the spec first)",
    "absorb": "the key-tile loop of one query tile (tiles.absorb)",
    "backward": "the backward's stage edits, edit(stage, x, **where) -> x; identity by default",
}


def keep(stage, x, **where):
    """The default ``"backward"`` step: every stage's value as it is."""
    return x


#: Where each default lives: (module of attnlib.core, attribute path); resolved on first use,
#: since those modules import this one.
_DEFAULT_AT = {
    "state": ("online", "OnlineSoftmax"),
    "tile_scores": ("tiles", "tile_scores"),
    "tile_visible": ("masks", "MaskSpec.tile_visible"),
    "absorb": ("tiles", "absorb"),
}

_defaults: dict = {}
_current: dict = {}  # every step's object in force, filled with the defaults on first use
_lock = threading.Lock()


def _resolve() -> None:
    with _lock:
        if _defaults:
            return
        found = {"backward": keep}
        for name, (module, path) in _DEFAULT_AT.items():
            obj = importlib.import_module(f"{__package__}.{module}")
            for attr in path.split("."):
                obj = getattr(obj, attr)
            found[name] = obj
        _current.update(found)
        _defaults.update(found)


def _checked(name: str) -> str:
    if name not in STEPS:
        raise ValueError(f"{name!r} is not a declared step; the steps are {', '.join(STEPS)}")
    if not _defaults:
        _resolve()
    return name


def get(name: str):
    """The step ``name`` in force: its replacement, or its default.

    Raises
    ------
    ValueError
        If ``name`` is not one of `STEPS`.
    """
    try:
        return _current[name]
    except KeyError:  # the first lookup, or an unknown name
        return _current[_checked(name)]


def default(name: str):
    """The default of step ``name`` (what `get` returns when nothing replaces it)."""
    return _defaults[_checked(name)]


def replacements() -> dict:
    """``{name: replacement}`` of the steps replaced now (empty: the kernels as shipped)."""
    if not _defaults:
        _resolve()
    return {name: obj for name, obj in _current.items() if obj is not _defaults[name]}


@contextlib.contextmanager
def replaced(**steps):
    """Replace steps while the block runs: ``with replaced(absorb=f, tile_scores=g): ...``.

    Each previous object (a default, or an outer block's replacement: blocks nest) comes
    back on exit, even on error.  ``"state"`` takes a subclass of the default state
    class, the others a callable with the default's signature.

    Raises
    ------
    ValueError
        If a name is not one of `STEPS`.
    TypeError
        If a replacement is of the wrong kind.

    Examples
    --------
    >>> import attnlib
    >>> from attnlib.core import hooks
    >>> calls = []
    >>> def absorb(*args, **kwargs):  # the default, counted
    ...     calls.append(1)
    ...     return hooks.default("absorb")(*args, **kwargs)
    >>> q, k, v = attnlib.random_qkv(64, 64, 8, seed=0)
    >>> with hooks.replaced(absorb=absorb):
    ...     out = attnlib.attention(q, k, v, block_q=32)
    >>> len(calls), hooks.get("absorb") is hooks.default("absorb")
    (2, True)
    """
    for name, obj in steps.items():
        _checked(name)
        if name == "state":
            if not (isinstance(obj, type) and issubclass(obj, _defaults["state"])):
                raise TypeError(f"the 'state' step takes a subclass of {_defaults['state'].__name__}, "
                                f"got {obj!r}")
        elif not callable(obj):
            raise TypeError(f"the {name!r} step takes a callable, got {obj!r}")
    saved = {name: _current[name] for name in steps}
    _current.update(steps)
    try:
        yield
    finally:
        _current.update(saved)


__all__ = ["STEPS", "get", "default", "replaced", "replacements", "keep"]
