"""Injected defects: small, realistic bugs in the tiled kernel, to measure a gate's power.

A verdict is only as good as the smallest real bug it catches.  Each `Defect` here is a
context manager that swaps one piece of the tiled kernel (`attnlib.tiled`,
`attnlib.online` and the tile masks of `attnlib.masks.MaskSpec.tile_visible`, never the
dense reference, which uses `MaskSpec.visible`) for a subtly wrong copy while it is active::

    with DEFECTS["exp_1e-11x"].active():
        out, lse = attnlib.attention(q, k, v, return_lse=True)   # the defective kernel

The equivalence report runs every defect through the same gate as the real kernel and
tabulates which ones it catches.  They range from "off in the 12th digit" (a perturbed
``exp``, a matmul off by a relative 1e-12, an LSE shifted by 1e-12) to the classic
structural bugs (a forgotten rescale, an off-by-one causal mask, a dropped key tile).
Patching is process-wide while active: not for use with other threads running attnlib.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from . import backward, tiled
from .masks import MaskSpec
from .online import OnlineSoftmax, _shift


def _mutated_update(exp=np.exp, alpha_l=True, alpha_acc=1.0, pv_factor=1.0, round_p=None,
                    skip_below=None):
    """A copy of `OnlineSoftmax.update` (eager rule, float64) with hooks for one mutation.

    ``exp``: the exponential used for ``alpha`` and ``p``; ``alpha_l``: a factor on the
    ``alpha`` that rescales ``l`` (False: never rescaled); ``alpha_acc``: a factor on the
    ``alpha`` that rescales ``acc`` (0: never rescaled); ``pv_factor``: a factor on ``p @ v``; ``round_p``: rounds ``p`` everywhere;
    ``skip_below``: a tile whose max is more than this far below every row's running max
    is skipped (a speculative block-sparse shortcut).
    """

    def update(self, s, v, keys_first=False, **_):  # other options (buffers, threshold 0) unused
        # A copy of the tile, in rows-first layout: (..., rows, bk).
        s = np.array(np.swapaxes(s, -1, -2) if keys_first else s, dtype=self.acc.dtype)
        if skip_below is not None and np.all(s.max(axis=-1) < self.m - skip_below):
            return np.zeros(self.m.shape, dtype=bool)
        m_new = np.maximum(self.m, s.max(axis=-1))
        rescaled = np.isfinite(self.m) & (m_new > self.m)
        shift = _shift(m_new)
        alpha = exp(self.m - shift)
        p = exp(s - shift[..., None])
        if round_p is not None:
            p = round_p(p)
        if alpha_l is not False:
            self.l *= alpha * (1.0 if alpha_l is True else alpha_l)
        self.l += p.sum(axis=-1)
        if alpha_acc:
            self.acc *= (alpha * alpha_acc)[..., None]
        self.acc += (p @ v) * pv_factor
        self.m = m_new
        return rescaled

    return update


def _exp_times(rel):
    """``exp(x) * (1 + rel * x)``: an exp whose relative error grows with ``|x|``."""
    def exp(x):
        with np.errstate(invalid="ignore"):  # -inf * rel: the weight is 0 either way
            return np.exp(x) * np.where(np.isfinite(x), 1 + rel * x, 1.0)
    return exp


def _scores_times(factor):
    """`tiled.tile_scores` whose ``q k^T`` product is off by a relative ``factor - 1``."""
    real = tiled.tile_scores

    def tile_scores(q_i, k_j, *args, **kwargs):
        return real(q_i * factor, k_j, *args, **kwargs)
    return tile_scores


def _off_by_one_mask():
    """`MaskSpec.tile_visible` (the PARTIAL tiles' mask) with the key index shifted by one."""
    real = MaskSpec.tile_visible

    def tile_visible(self, rows, k0, k1, *args, **kwargs):
        return real(self, rows, k0 - 1, k1 - 1, *args, **kwargs)
    return tile_visible


def _window_edge():
    """`MaskSpec.tile_visible` whose sliding window reaches one key further left."""
    real = MaskSpec.tile_visible

    def tile_visible(self, *args, **kwargs):
        if self.left is not None:
            self = replace(self, window=(self.left + 1, self.right))
        return real(self, *args, **kwargs)
    return tile_visible


def _ignore_visible():
    """`OnlineSoftmax.update` that takes ``exp`` of every score, as a kernel with no mask
    of its own in the softmax does (the mask lives in the scores alone)."""
    real = OnlineSoftmax.update

    def update(self, s, v, *, visible=None, **kwargs):
        return real(self, s, v, **kwargs)
    return update


def _alibi_signed():
    """`tiled.tile_scores` that adds ALiBi with the signed ``i + o - j``, not its absolute value."""
    real = tiled.tile_scores

    def tile_scores(q_i, k_j, spec, rows, cols, kind, cap=None, slopes=None, **kwargs):
        s, th = real(q_i, k_j, spec, rows, cols, kind, cap, None, **kwargs)
        if slopes is not None:  # -inf stays -inf
            signed = rows[:, None] + spec.offset - cols[None, :]  # (bq, bk)
            s -= slopes[..., None, None] * (signed.T if kwargs.get("keys_first") else signed)
        return s, th
    return tile_scores


def _softcap_after_mask():
    """`tiled.tile_scores` that caps after masking: an invisible pair gets ``-cap``, not ``-inf``."""
    real = tiled.tile_scores

    def tile_scores(q_i, k_j, spec, rows, cols, kind, cap=None, slopes=None, **kwargs):
        s, th = real(q_i, k_j, spec, rows, cols, kind, None, slopes, **kwargs)
        if cap is not None:
            np.multiply(np.tanh(s / cap), cap, out=s)
        return s, th
    return tile_scores


def _drop_last_tile():
    """`tiled.absorb` that leaves out each query tile's last key tile when it has several."""
    real = tiled.absorb

    def absorb(state, q_i, k, v, spec, q0, k0s, k1s, kinds, *args, **kwargs):
        if len(k0s) > 1:
            k0s, k1s, kinds = k0s[:-1], k1s[:-1], kinds[:-1]
        events = real(state, q_i, k, v, spec, q0, k0s, k1s, kinds, *args, **kwargs)
        if events is not None:  # keep the stats' shape: the dropped tile counts no events
            events = np.concatenate([events, np.zeros(events.shape[:-1] + (1,), events.dtype)], -1)
        return events
    return absorb


def _lse_plus(shift):
    """`OnlineSoftmax.finalize` whose ``lse`` is off by ``shift``."""
    real = OnlineSoftmax.finalize

    def finalize(self):
        out, lse = real(self)
        return out, lse + shift
    return finalize


def _sink_weight_dropped():
    """`OnlineSoftmax.empty` whose sink sets the running max but adds no weight: ``l``
    starts at 0, not ``exp(sink - m) = 1`` (the sink missing from the denominator)."""
    real = OnlineSoftmax.empty.__func__

    def empty(cls, rows_shape, dv, dtype=np.float64, keys_first=False, sink=None):
        state = real(cls, rows_shape, dv, dtype, keys_first, sink)
        if sink is not None:
            state.l[...] = 0.0
        return state
    return classmethod(empty)


class _SinkFirstTileUnscaled(OnlineSoftmax):
    """A state whose first update leaves the sink's weight as it was: a kernel that skips
    the rescale on its first tile, when the state "is still empty" (it is not, with a sink)."""

    __slots__ = ("fresh",)

    def update(self, s, v, **kwargs):
        l0, m0 = self.l.copy(), self.m.copy()
        rescaled = OnlineSoftmax.update(self, s, v, **kwargs)
        if self.fresh:  # undo alpha on the initial l: l = l0 + sum p instead of alpha l0 + sum p
            self.l += l0 * (1.0 - np.exp(m0 - _shift(self.m)))
            self.fresh = False
        return rescaled


def _sink_first_tile_unscaled():
    real = OnlineSoftmax.empty.__func__

    def empty(cls, rows_shape, dv, dtype=np.float64, keys_first=False, sink=None):
        state = real(cls, rows_shape, dv, dtype, keys_first, sink)
        if sink is None:
            return state
        bad = _SinkFirstTileUnscaled(state.m, state.l, state.acc)
        bad.fresh = True
        return bad
    return classmethod(empty)


@dataclass(frozen=True)
class Defect:
    """One injected bug: its name, what it does, and ``(owner, attribute, factory)`` patches."""

    name: str
    description: str
    patches: tuple  # ((object, attribute name, zero-argument factory of the replacement), ...)

    @contextlib.contextmanager
    def active(self):
        """Swap the defective pieces in; the originals come back on exit, even on error."""
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in self.patches]
        try:
            for owner, attr, make in self.patches:
                setattr(owner, attr, make())
            yield self
        finally:
            for owner, attr, original in reversed(saved):
                setattr(owner, attr, original)


def _update(**mutation) -> tuple:
    return ((OnlineSoftmax, "update", lambda: _mutated_update(**mutation)),)


def _f32(p):
    return p.astype(np.float32).astype(np.float64)


DEFECTS: dict[str, Defect] = {d.name: d for d in (
    Defect("exp_1e-11x", "every exp(x) the kernel takes is off by a relative 1e-11 * x",
           _update(exp=_exp_times(1e-11))),
    Defect("exp_1e-12x", "every exp(x) off by a relative 1e-12 * x",
           _update(exp=_exp_times(1e-12))),
    Defect("qk_matmul_3e-12", "the score matmul q k^T off by a relative 3e-12",
           ((tiled, "tile_scores", lambda: _scores_times(1 + 3e-12)),)),
    Defect("pv_matmul_3e-12", "the p @ v matmul off by a relative 3e-12",
           _update(pv_factor=1 + 3e-12)),
    Defect("pv_matmul_1e-12", "the p @ v matmul off by a relative 1e-12",
           _update(pv_factor=1 + 1e-12)),
    Defect("lse_1e-11", "lse = m + log(l) off by 1e-11",
           ((OnlineSoftmax, "finalize", lambda: _lse_plus(1e-11)),)),
    Defect("lse_1e-12", "lse off by 1e-12",
           ((OnlineSoftmax, "finalize", lambda: _lse_plus(1e-12)),)),
    Defect("rescale_acc_1e-12", "acc rescaled by alpha * (1 + 1e-12) (l by alpha)",
           _update(alpha_acc=1 + 1e-12)),
    Defect("rescale_l_1e-12", "l rescaled by alpha * (1 + 1e-12) (acc by alpha)",
           _update(alpha_l=1 + 1e-12)),
    Defect("no_l_rescale", "the running sum l is never rescaled by alpha",
           _update(alpha_l=False)),
    Defect("no_acc_rescale", "the accumulator acc is never rescaled by alpha",
           _update(alpha_acc=0.0)),
    Defect("p_float32", "the weights p are rounded to float32 (a precision leak)",
           _update(round_p=_f32)),
    Defect("off_by_one_mask", "PARTIAL tiles mask with key index j - 1: one key too many",
           ((MaskSpec, "tile_visible", _off_by_one_mask),)),
    Defect("drop_last_tile", "each query tile skips its last visible key tile",
           ((tiled, "absorb", _drop_last_tile),)),
    Defect("skip_far_tiles", "a key tile more than 20 below every row's running max is skipped",
           _update(skip_below=20.0)),
    Defect("window_edge", "the sliding window reaches one key too far left",
           ((MaskSpec, "tile_visible", _window_edge),)),
    Defect("alibi_signed", "ALiBi uses the signed i + o - j instead of |i + o - j|",
           ((tiled, "tile_scores", _alibi_signed),)),
    Defect("softcap_after_mask", "the softcap is applied after masking (-inf becomes -cap)",
           ((tiled, "tile_scores", _softcap_after_mask), (OnlineSoftmax, "update", _ignore_visible))),
    Defect("sink_weight_dropped", "the sink sets the running max but adds no weight to l",
           ((OnlineSoftmax, "empty", _sink_weight_dropped),)),
    Defect("sink_first_tile_unscaled", "the sink's weight is not rescaled when the first tile raises the max",
           ((OnlineSoftmax, "empty", _sink_first_tile_unscaled),)),
)}


def _backward_hook(**edits):
    """A `~attnlib.backward.DEFECT_HOOK` applying ``edits[stage](x, **where)`` at its stages."""
    def hook(stage, x, **where):
        edit = edits.get(stage)
        return x if edit is None else edit(x, **where)
    return lambda: hook


def _backward(**edits) -> tuple:
    return ((backward, "DEFECT_HOOK", _backward_hook(**edits)),)


def _times(factor):
    return lambda x, **_: x * factor


def _dv_one_key_off(grads):
    dq, dk, dv, *rest = grads
    return (dq, dk, np.roll(dv, 1, axis=-2), *rest)  # key j's dv written at j + 1


def _dsinks_sign(grads):
    return grads[:3] + tuple(-g for g in grads[3:])


#: Defects of the tiled backward (`attnlib.attention_backward`), for the gradients report.
BACKWARD_DEFECTS: dict[str, Defect] = {d.name: d for d in (
    Defect("bwd_matmul_3e-12", "the backward's three matmuls (ds k, ds^T q, p^T dout) off by a relative 3e-12",
           _backward(dq_tile=_times(1 + 3e-12), dk_tile=_times(1 + 3e-12), dv_tile=_times(1 + 3e-12))),
    Defect("ds_1e-11", "ds = p (dp - D) off by a relative 1e-11",
           _backward(ds=_times(1 + 1e-11))),
    Defect("delta_1e-11", "D = rowsum(dout * out) off by a relative 1e-11",
           _backward(delta=_times(1 + 1e-11))),
    Defect("dv_one_key_off", "dv written one key off (key j's gradient at j + 1)",
           _backward(grads=_dv_one_key_off)),
    Defect("dq_drops_last_tile", "dq leaves out each query tile's last visible key tile",
           _backward(dq_tile=lambda x, last=False, **_: None if last else x)),
    Defect("dsinks_sign", "dsinks with the wrong sign",
           _backward(grads=_dsinks_sign)),
)}


def run_with(defect: Defect | None, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` with ``defect`` active (None: the real kernel)."""
    with (defect.active() if defect is not None else contextlib.nullcontext()):
        return fn(*args, **kwargs)


__all__ = ["Defect", "DEFECTS", "BACKWARD_DEFECTS", "run_with"]
