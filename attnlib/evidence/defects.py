"""Injected defects: small, realistic bugs in the tiled kernels, to measure a gate's power.

A verdict is only as good as the smallest real bug it catches.  Each `Defect` replaces one
or more of the kernels' declared steps (`attnlib.core.hooks`: the online-softmax state, a
tile's scores, a PARTIAL tile's mask, a query tile's key-tile loop, a packed-documents
tile's document blocks, the backward's stage edits) with a subtly wrong copy while it is active, never the dense reference (which uses
none of them)::

    with DEFECTS["exp_1e-11x"].active():
        out, lse = attnlib.attention(q, k, v, return_lse=True)   # the defective kernel

Every kernel path calls its steps through the registry, so a defect reaches each path that
runs the step it replaces; `Defect.paths` names them (of `PATHS`), and the test suite
checks that the defect changes the result, and fails the gate, on each of them and
changes nothing elsewhere.

The equivalence report runs every defect of `DEFECTS` through the same gate as the real
kernel and tabulates which ones it catches; the gradients report does the same with
`BACKWARD_DEFECTS`.  They range from "off in the 12th digit" (a perturbed ``exp``, a
matmul off by a relative 1e-12, an LSE shifted by 1e-12) to the classic structural bugs (a
forgotten rescale, an off-by-one causal mask, a dropped key tile).  A replacement is
process-wide while active: not for use with other threads running attnlib.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np

from ..core import hooks
from ..core.backend import NUMPY
from ..core.online import _shift, lse_of

#: The kernel paths a defect may reach: `attnlib.attention`, `attnlib.attention_stream`,
#: `attnlib.attention` with a paged cache, `attnlib.attention_varlen` and
#: `attnlib.attention_backward`.
PATHS = ("forward", "stream", "paged", "varlen", "backward")

#: The paths that run each step (the forward's steps reach varlen through the forward, and
#: the paged cache through the stream).
STEP_PATHS = {
    "state": ("forward", "stream", "paged", "varlen"),
    "tile_scores": PATHS,
    "tile_visible": PATHS,
    "absorb": ("forward", "stream", "paged", "varlen"),
    "document_blocks": ("forward", "stream", "paged", "varlen"),
    "backward": ("backward",),
}


def _state(name, **members):
    """A subclass of the state class in force (`hooks.get("state")`) with ``members``."""
    base = hooks.get("state")
    return type(name, (base,), {"__slots__": (), **members})


def _mutated_update(exp=None, alpha_l=True, alpha_acc=1.0, pv_factor=1.0, p_rounding=None,
                    skip_below=None):
    """A state whose ``update`` is `OnlineSoftmax.update`'s steps, in its order and layout,
    with one mutation: with every mutation neutral it gives the real update's bits (so a
    defect changes a result only through its mutation, not through arithmetic of its own).

    ``exp``: the exponential used for ``alpha`` and ``p`` (``exp(x, xp)``; None: the
    backend's own), written, like every defect, against the arrays' backend
    (`attnlib.core.backend`), so that it reaches numpy and torch alike; ``alpha_l``: a factor on the
    ``alpha`` that rescales ``l`` (False: never rescaled); ``alpha_acc``: a factor on the
    ``alpha`` that rescales ``acc`` (0: never rescaled); ``pv_factor``: a factor on
    ``p @ v``; ``p_rounding``: rounds ``p`` everywhere (``l`` too); ``skip_below``: a tile whose
    max is more than this far below every row's running max is skipped (a speculative
    block-sparse shortcut).
    """

    def update(self, s, v, *, threshold=0.0, overwrite_s=False, pv=None, round_p=None, keys_first=False,
               visible=None, count=True):
        xp = self.xp
        if not overwrite_s:  # a copy in the state's type (lists too)
            s = xp.copy(xp.from_host(s, self.acc.dtype))
        m_tile = xp.amax(s, -2 if keys_first else -1)  # (..., rows)
        if skip_below is not None and bool((m_tile < self.m - skip_below).all()):
            return xp.zeros(tuple(self.m.shape), dtype=bool) if count else None
        m_new = xp.where(m_tile > self.m + threshold, m_tile, self.m) if threshold else xp.maximum(self.m, m_tile)
        rescaled = xp.isfinite(self.m) & (m_new > self.m) if count else None
        shift = _shift(m_new, xp)
        with xp.overflow_ok():
            alpha = xp.exp(self.m - shift) if exp is None else exp(self.m - shift, xp)
            s -= shift[..., None, :] if keys_first else shift[..., None]
        if exp is not None:
            p = exp(s, xp)
        else:
            p = xp.exp(s, out=s) if visible is None else xp.exp_visible_(s, visible)
        if p_rounding is not None:
            p = p_rounding(p, xp)
        if alpha_l is not False:
            self.l *= alpha if alpha_l is True else alpha * alpha_l
        self.l += xp.key_sum(p, keys_first)
        if alpha_acc:
            self.acc *= (alpha if alpha_acc == 1.0 else alpha * alpha_acc)[..., None]
        if round_p is not None:  # the kernel's own low precision: l summed the unrounded p
            p = round_p(p)
        if keys_first:
            pv_ = xp.swapaxes(xp.matmul(xp.swapaxes(v, -1, -2), p, out=pv), -1, -2)
        else:
            pv_ = xp.matmul(p, v, out=pv)
        self.acc += pv_ if pv_factor == 1.0 else pv_ * pv_factor
        self.m = m_new
        return rescaled

    return _state("MutatedUpdate", update=update)


def _exp_times(rel):
    """``exp(x) * (1 + rel * x)``: an exp whose relative error grows with ``|x|``."""
    def exp(x, xp):
        return xp.exp(x) * xp.where(xp.isfinite(x), 1 + rel * x, 1.0)  # -inf: the weight is 0 either way
    return exp


def _scores_times(factor):
    """`tiles.tile_scores` whose ``q k^T`` product is off by a relative ``factor - 1``."""
    real = hooks.get("tile_scores")

    def tile_scores(q_i, k_j, *args, **kwargs):
        return real(q_i * factor, k_j, *args, **kwargs)
    return tile_scores


def _off_by_one_mask():
    """`MaskSpec.tile_visible` (the PARTIAL tiles' mask) with the key index shifted by one."""
    real = hooks.get("tile_visible")

    def tile_visible(self, rows, k0, k1, *args, **kwargs):
        return real(self, rows, k0 - 1, k1 - 1, *args, **kwargs)
    return tile_visible


def _documents_off_by_one():
    """`tiles.document_blocks` with the key index shifted by one, as `_off_by_one_mask` does
    to the masks: a key belongs to the block of the document of the key before it."""
    real = hooks.get("document_blocks")

    def document_blocks(spec, q0, rows, k0, k1):
        return real(spec, q0, rows, k0 - 1, k1 - 1)  # blocks relative to the tile, so j is j - 1's
    return document_blocks


def _window_edge():
    """`MaskSpec.tile_visible` whose sliding window reaches one key further left."""
    real = hooks.get("tile_visible")

    def tile_visible(self, *args, **kwargs):
        if self.left is not None:
            self = replace(self, window=(self.left + 1, self.right))
        return real(self, *args, **kwargs)
    return tile_visible


def _ignore_visible():
    """A state whose ``update`` takes ``exp`` of every score, as a kernel with no mask of its
    own in the softmax does (the mask lives in the scores alone)."""
    base = hooks.get("state")

    def update(self, s, v, *, visible=None, **kwargs):
        return base.update(self, s, v, **kwargs)
    return _state("IgnoreVisible", update=update)


def _alibi_signed():
    """`tiles.tile_scores` that adds ALiBi with the signed ``i + o - j``, not its absolute value."""
    real = hooks.get("tile_scores")

    def tile_scores(q_i, k_j, spec, rows, cols, kind, cap=None, slopes=None, **kwargs):
        s, th = real(q_i, k_j, spec, rows, cols, kind, cap, None, **kwargs)
        if slopes is not None:  # -inf stays -inf
            signed = (np.asarray(rows)[:, None] + spec.offset - np.asarray(cols)[None, :]).astype(np.float64)
            xp = kwargs.get("xp", NUMPY)
            s -= slopes[..., None, None] * xp.from_host(signed.T if kwargs.get("keys_first") else signed)
        return s, th
    return tile_scores


def _softcap_after_mask():
    """`tiles.tile_scores` that caps after masking: an invisible pair gets ``-cap``, not
    ``-inf`` (and so keeps no ``tanh`` of the scores before the cap for the backward)."""
    real = hooks.get("tile_scores")

    def tile_scores(q_i, k_j, spec, rows, cols, kind, cap=None, slopes=None, **kwargs):
        s, th = real(q_i, k_j, spec, rows, cols, kind, None, slopes, **kwargs)
        if cap is not None:  # -inf / cap is -inf, whose tanh is -1: -cap
            s /= cap
            s = kwargs.get("xp", NUMPY).tanh_(s)
            s *= cap
        return s, th
    return tile_scores


def _drop_last_tile():
    """`tiles.absorb` that leaves out each query tile's last key tile when it has several."""
    real = hooks.get("absorb")

    def absorb(state, q_i, k, v, spec, q0, k0s, k1s, kinds, *args, **kwargs):
        if len(k0s) > 1:
            k0s, k1s, kinds = k0s[:-1], k1s[:-1], kinds[:-1]
        events = real(state, q_i, k, v, spec, q0, k0s, k1s, kinds, *args, **kwargs)
        if events is not None:  # keep the stats' shape: the dropped tile counts no events
            xp = state.xp
            events = xp.concat([events, xp.zeros(tuple(events.shape[:-1]) + (1,), events.dtype)], -1)
        return events
    return absorb


def _lse_plus(shift):
    """A state whose ``lse`` (``finalize``, and split-KV's ``finalize_parts``) is off by ``shift``."""
    base = hooks.get("state")

    def finalize(self):  # the lse off by shift, rounded as before: (m + log l) + shift
        out, parts = base.finalize_parts(self)
        return out, lse_of(parts, self.xp) + shift

    def finalize_parts(self):  # split-KV's partials, merged later: log l off by shift (-inf stays)
        out, parts = base.finalize_parts(self)
        parts[..., 1] += shift
        return out, parts
    return _state("LsePlus", finalize=finalize, finalize_parts=finalize_parts)


def _sink_weight_dropped():
    """A state whose ``empty`` sink sets the running max but adds no weight: ``l`` starts at
    0, not ``exp(sink - m) = 1`` (the sink missing from the denominator)."""
    real = hooks.get("state").empty.__func__

    def empty(cls, rows_shape, dv, dtype=np.float64, keys_first=False, sink=None, xp=NUMPY):
        state = real(cls, rows_shape, dv, dtype, keys_first, sink, xp)
        if sink is not None:
            state.l[...] = 0.0
        return state
    return _state("SinkWeightDropped", empty=classmethod(empty))


def _sink_first_tile_unscaled():
    """A state whose first update leaves the sink's weight as it was: a kernel that skips the
    rescale on its first tile, when the state "is still empty" (it is not, with a sink)."""
    base = hooks.get("state")

    def empty(cls, rows_shape, dv, dtype=np.float64, keys_first=False, sink=None, xp=NUMPY):
        state = base.empty.__func__(cls, rows_shape, dv, dtype, keys_first, sink, xp)
        state.fresh = sink is not None  # without a sink the first update is right
        return state

    def update(self, s, v, **kwargs):
        xp = self.xp
        l0, m0 = xp.copy(self.l), xp.copy(self.m)
        rescaled = base.update(self, s, v, **kwargs)
        if self.fresh:  # undo alpha on the initial l: l = l0 + sum p instead of alpha l0 + sum p
            self.l += l0 * (1.0 - xp.exp(m0 - _shift(self.m, xp)))
            self.fresh = False
        return rescaled

    return type("SinkFirstTileUnscaled", (base,),
                {"__slots__": ("fresh",), "empty": classmethod(empty), "update": update})


@dataclass(frozen=True, eq=False)
class Defect:
    """One injected bug.

    Attributes
    ----------
    name, description : str
    replaces : mapping
        ``{step: factory}``: each `attnlib.core.hooks.STEPS` name the defect replaces, with
        a zero-argument factory of the replacement (called on `active`, so it wraps the
        step then in force).
    paths : tuple of str
        The subset of `PATHS` the defect reaches, where it changes the result (each is
        tested: caught there by the gate, and nothing changed on the other paths).
    """

    name: str
    description: str
    replaces: Mapping[str, Callable] = field(repr=False)
    paths: tuple = ()

    def __post_init__(self):
        unknown = set(self.replaces) - set(hooks.STEPS)
        if unknown:
            raise ValueError(f"defect {self.name}: {sorted(unknown)} are not declared steps of "
                             f"attnlib.core.hooks ({', '.join(hooks.STEPS)})")
        paths = tuple(self.paths)
        reached = {p for step in self.replaces for p in STEP_PATHS[step]}
        if not set(paths) <= reached:
            raise ValueError(f"defect {self.name}: paths {sorted(set(paths) - reached)} run none of "
                             f"its steps {sorted(self.replaces)}")
        object.__setattr__(self, "replaces", MappingProxyType(dict(self.replaces)))
        object.__setattr__(self, "paths", tuple(p for p in PATHS if p in paths))

    @contextlib.contextmanager
    def active(self):
        """The defective steps in force; the previous ones come back on exit, even on error."""
        with hooks.replaced(**{step: make() for step, make in self.replaces.items()}):
            yield self


#: Paths of the defects of the online-softmax state: every forward path, never the backward
#: (which recomputes ``p`` from the saved ``lse`` and keeps no state).
_STATE_PATHS = ("forward", "stream", "paged", "varlen")


def _update(name, description, **mutation) -> Defect:
    return Defect(name, description, {"state": lambda: _mutated_update(**mutation)}, _STATE_PATHS)


def _f32(p, xp):
    return xp.astype(xp.astype(p, np.float32), np.float64)


DEFECTS: dict[str, Defect] = {d.name: d for d in (
    _update("exp_1e-11x", "every exp(x) the kernel takes is off by a relative 1e-11 * x",
            exp=_exp_times(1e-11)),
    _update("exp_1e-12x", "every exp(x) off by a relative 1e-12 * x", exp=_exp_times(1e-12)),
    # The scores are recomputed by the backward too: p = exp(s - lse) there, off alike.
    Defect("qk_matmul_3e-12", "the score matmul q k^T off by a relative 3e-12",
           {"tile_scores": lambda: _scores_times(1 + 3e-12)}, PATHS),
    _update("pv_matmul_3e-12", "the p @ v matmul off by a relative 3e-12", pv_factor=1 + 3e-12),
    _update("pv_matmul_1e-12", "the p @ v matmul off by a relative 1e-12", pv_factor=1 + 1e-12),
    Defect("lse_1e-11", "lse = m + log(l) off by 1e-11", {"state": lambda: _lse_plus(1e-11)}, _STATE_PATHS),
    Defect("lse_1e-12", "lse off by 1e-12", {"state": lambda: _lse_plus(1e-12)}, _STATE_PATHS),
    _update("rescale_acc_1e-12", "acc rescaled by alpha * (1 + 1e-12) (l by alpha)", alpha_acc=1 + 1e-12),
    _update("rescale_l_1e-12", "l rescaled by alpha * (1 + 1e-12) (acc by alpha)", alpha_l=1 + 1e-12),
    _update("no_l_rescale", "the running sum l is never rescaled by alpha", alpha_l=False),
    _update("no_acc_rescale", "the accumulator acc is never rescaled by alpha", alpha_acc=0.0),
    _update("p_float32", "the weights p are rounded to float32 (a precision leak)", p_rounding=_f32),
    Defect("off_by_one_mask", "PARTIAL tiles mask with key index j - 1: one key too many",
           {"tile_visible": _off_by_one_mask, "document_blocks": _documents_off_by_one}, PATHS),
    # Not "paged": its key tiles are its chunks, so each absorb sees a single key tile.
    Defect("drop_last_tile", "each query tile skips its last visible key tile",
           {"absorb": _drop_last_tile}, ("forward", "stream", "varlen")),
    _update("skip_far_tiles", "a key tile more than 20 below every row's running max is skipped",
            skip_below=20.0),
    Defect("window_edge", "the sliding window reaches one key too far left",
           {"tile_visible": _window_edge}, PATHS),
    Defect("alibi_signed", "ALiBi uses the signed i + o - j instead of |i + o - j|",
           {"tile_scores": _alibi_signed}, PATHS),
    # The backward, which keeps no state, sees the capped scores (which lose the softcap's
    # derivative, and the -inf only matters for an exp the backward does not take).  A tile
    # computed by document blocks never forms two documents' pairs: only the pairs masked
    # inside a block (causal, window) can get -cap there.
    Defect("softcap_after_mask", "the softcap is applied after masking (-inf becomes -cap)",
           {"tile_scores": _softcap_after_mask, "state": _ignore_visible}, PATHS),
    Defect("sink_weight_dropped", "the sink sets the running max but adds no weight to l",
           {"state": _sink_weight_dropped}, _STATE_PATHS),
    Defect("sink_first_tile_unscaled", "the sink's weight is not rescaled when the first tile raises the max",
           {"state": _sink_first_tile_unscaled}, _STATE_PATHS),
)}


def _backward(name, description, **edits) -> Defect:
    """A defect of the tiled backward's step ``"backward"``: ``edits[stage](x, **where)`` at its
    stages, the others as they are."""
    def make():
        real = hooks.get("backward")

        def edit(stage, x, **where):
            x, step = real(stage, x, **where), edits.get(stage)
            return x if step is None or x is None else step(x, **where)  # None: a dropped dq tile
        return edit
    return Defect(name, description, {"backward": make}, ("backward",))


def _times(factor):
    return lambda x, **_: x * factor


def _dv_one_key_off(grads, xp=NUMPY, **_):
    dq, dk, dv, *rest = grads
    return (dq, dk, xp.concat([dv[..., -1:, :], dv[..., :-1, :]], -2), *rest)  # key j's dv written at j + 1


def _dsinks_sign(grads, **_):
    return grads[:3] + tuple(-g for g in grads[3:])


def _dq_drop_last(x, last=False, **_):
    return None if last else x


#: Defects of the tiled backward (`attnlib.attention_backward`), for the gradients report.
BACKWARD_DEFECTS: dict[str, Defect] = {d.name: d for d in (
    _backward("bwd_matmul_3e-12", "the backward's three matmuls (ds k, ds^T q, p^T dout) off by a relative 3e-12",
              dq_tile=_times(1 + 3e-12), dk_tile=_times(1 + 3e-12), dv_tile=_times(1 + 3e-12)),
    _backward("ds_1e-11", "ds = p (dp - D) off by a relative 1e-11", ds=_times(1 + 1e-11)),
    _backward("delta_1e-11", "D = rowsum(dout * out) off by a relative 1e-11", delta=_times(1 + 1e-11)),
    _backward("dv_one_key_off", "dv written one key off (key j's gradient at j + 1)", grads=_dv_one_key_off),
    _backward("dq_drops_last_tile", "dq leaves out each query tile's last visible key tile", dq_tile=_dq_drop_last),
    _backward("dsinks_sign", "dsinks with the wrong sign", grads=_dsinks_sign),
)}


def run_with(defect: Defect | None, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` with ``defect`` active (None: the real kernel)."""
    with (defect.active() if defect is not None else contextlib.nullcontext()):
        return fn(*args, **kwargs)


__all__ = ["Defect", "DEFECTS", "BACKWARD_DEFECTS", "PATHS", "STEP_PATHS", "run_with"]
