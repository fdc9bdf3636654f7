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
arithmetic is untouched.  The steps are the one kernel's, whatever the arrays: numpy's on the
host, torch tensors on their device (`attnlib.core.backend`), so a replacement reaches both;
a replacement written for both uses the arrays' backend (the state's ``xp``, or the ``xp``
keyword of ``tile_scores``) for what numpy and torch spell differently.

The steps (`STEPS`) and who calls them:

``"state"``
    The online-softmax state class: its ``empty``, ``update`` and ``finalize`` (or
    ``finalize_parts``).  Created by the forward (and so varlen) and the stream (and so the
    paged cache), once per query tile.  A replacement is a subclass of
    `attnlib.core.online.OnlineSoftmax` (a class, since a state is created, updated and
    finalized: one object carries all three).  A tile computed by document blocks updates
    each block's rows through `OnlineSoftmax.rows` (a shallow copy whose ``m``, ``l``,
    ``acc`` are views of those rows) and `OnlineSoftmax.put_rows`: a replacement's own
    attributes are the state's, not per row, and come back after each block.
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
``"document_blocks"``
    `attnlib.core.tiles.document_blocks`, called by `absorb` as ``(spec, q0, rows, k0, k1)``
    for each PARTIAL tile of contiguous rows without mods: the blocks ``(r0, r1, c0, c1)``
    (relative to the tile) of its queries and keys that share a document, computed one at a
    time, or None: the tile is computed whole and masked.
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
import itertools
import threading

#: The declared steps: name -> what it is (see the module docstring for who calls each).
STEPS = {
    "state": "the online-softmax state class (empty, update, finalize) of the forward paths",
    "tile_scores": "one tile's scores in the contract's order (tiles.tile_scores)",
    "tile_visible": "the mask of a PARTIAL tile (MaskSpec.tile_visible, called with the spec first)",
    "absorb": "the key-tile loop of one query tile (tiles.absorb)",
    "document_blocks": "a packed-documents tile's document blocks, or None: whole (tiles.document_blocks)",
    "backward": "the backward's stage edits, edit(stage, x, **where) -> x; identity by default",
}


def keep(stage, x, **where):
    """The default ``"backward"`` step: every stage's value as it is."""
    return x


# The defaults are declared by the modules that define them (`declare`, at their import:
# online, masks and tiles), so that this module imports none of them: no cycle.
_defaults: dict = {"backward": keep}
_active: dict = {}  # name -> [(token, replacement), ...] in the order they came in force
_current: dict = {"backward": keep}  # every step's object in force: the last active, or the default
_lock = threading.Lock()
_tokens = itertools.count()


def declare(name: str, default) -> None:
    """Record ``default`` as step ``name``'s default (called once, by its defining module)."""
    _checked(name, declaring=True)
    with _lock:
        _defaults[name] = default
        _current.setdefault(name, default)


def _checked(name: str, declaring: bool = False) -> str:
    if name not in STEPS:
        raise ValueError(f"{name!r} is not a declared step; the steps are {', '.join(STEPS)}")
    if not declaring and name not in _defaults:  # declared by its module on import; every kernel imports tiles
        raise LookupError(f"step {name!r} has no default yet: import attnlib.core.tiles, which "
                          "declares every step")
    return name


def get(name: str):
    """The step ``name`` in force: its latest replacement still active, or its default.

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
    with _lock:
        return {name: entries[-1][1] for name, entries in _active.items() if entries}


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
    token = next(_tokens)
    with _lock:
        for name, obj in steps.items():
            _active.setdefault(name, []).append((token, obj))
            _current[name] = obj
    try:
        yield
    finally:
        # Remove this block's entries, wherever they are: blocks in other threads may end in
        # any order, and each step falls back to the latest one still active, or its default.
        with _lock:
            for name in steps:
                entries = [e for e in _active[name] if e[0] != token]
                _active[name] = entries
                _current[name] = entries[-1][1] if entries else _defaults[name]


__all__ = ["STEPS", "get", "default", "declare", "replaced", "replacements", "keep"]
