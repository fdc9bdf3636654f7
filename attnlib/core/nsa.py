"""Native sparse attention (NSA; Yuan et al., 2025): three attentions of the same queries, a
compressed cache, the keys of the top-n selected blocks and a sliding window, each its own
softmax, summed with per-head gates (`docs/semantics.md`, "Native sparse attention").

Each branch is `attention` of its keys: the compressed blocks' pooled keys and values under a
``mask_mod`` (a block is seen once it has ended), the selected blocks' keys as
``gather_kv_indices`` (causal), the window as the built-in mask; so each is exact and tiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import validate
from .arrays import as_numpy

BRANCHES = ("compressed", "selected", "window")


@dataclass(frozen=True)
class NSA:
    """NSA's sizes: ``block_size`` (l) and ``stride`` (s) of the compressed blocks,
    ``select_block_size`` (l') and ``top_n`` of the selection (``initial_blocks`` and
    ``local_blocks`` always taken), ``window`` keys of the sliding window, ``pool`` the
    compression ``(..., l, D) -> (..., D)`` (None: the mean)."""

    block_size: int = 32
    stride: int = 16
    select_block_size: int = 64
    top_n: int = 16
    window: int = 512
    initial_blocks: int = 1
    local_blocks: int = 2
    pool: object = None

    def __post_init__(self):
        for name in ("block_size", "stride", "select_block_size", "window"):
            validate.positive_int(getattr(self, name), name)
        for name in ("top_n", "initial_blocks", "local_blocks"):
            validate.count(getattr(self, name), name)
        if self.block_size % self.stride or self.select_block_size % self.stride:
            raise ValueError(f"block_size ({self.block_size}) and select_block_size ({self.select_block_size}) "
                             f"must be multiples of stride ({self.stride}), as NSA's selection scores assume")
        if self.pool is not None and not callable(self.pool):
            raise TypeError(f"pool must be a function (..., l, D) -> (..., D), got {type(self.pool).__name__}")

    def compressed(self, k, v):
        """``(k_cmp, v_cmp)``: each block's pooled keys and values, ``(..., Hk, n_cmp, D)``."""
        sk = k.shape[-2]
        n = 0 if sk < self.block_size else (sk - self.block_size) // self.stride + 1
        starts = np.arange(n) * self.stride
        at = starts[:, None] + np.arange(self.block_size)  # (n, l)
        pool = self.pool or (lambda x: x.mean(axis=-2))
        out = []
        for x, name in ((k, "k"), (v, "v")):
            blocks = np.asarray(x)[..., at, :] if n else np.zeros(x.shape[:-2] + (0, self.block_size, x.shape[-1]))
            pooled = np.asarray(pool(blocks), dtype=np.float64)
            if pooled.shape != blocks.shape[:-2] + (blocks.shape[-1],):
                raise ValueError(f"pool must map the blocks {blocks.shape} to {blocks.shape[:-2] + (blocks.shape[-1],)} "
                                 f"(the block axis, -2, pooled), got {pooled.shape} for {name}")
            out.append(pooled)
        return out[0], out[1]

    def compressed_mod(self, sq: int, sk: int):
        """``mask_mod`` of the compressed branch: block ``j`` seen from ``t = i + sk - sq`` once
        it has ended, ``j s + l - 1 <= t``."""
        offset, l, s = sk - sq, self.block_size, self.stride

        def ended(b, h, q_idx, kv_idx):
            return np.asarray(kv_idx) * s + l - 1 <= np.asarray(q_idx) + offset

        return ended

    def importance(self, p_cmp, group: int) -> np.ndarray:
        """``(..., Hk, Sq, n_slc)``: each selection block's importance, the compressed weights
        ``p_cmp (..., Hq, Sq, n_cmp)`` of the compressed blocks that overlap its keys, each counted
        once, summed, and over the query heads of each kv head's group."""
        spans = self.overlaps(p_cmp.shape[-1])
        total = np.zeros(p_cmp.shape[:-1] + (len(spans),))
        for j, (lo, hi) in enumerate(spans):
            if hi > lo:
                total[..., j] = p_cmp[..., lo:hi].sum(-1)
        hq = total.shape[-3]
        return total.reshape(total.shape[:-3] + (hq // group, group) + total.shape[-2:]).sum(-3)

    def overlaps(self, n_cmp: int) -> list:
        """``[(lo, hi)]`` per selection block: the compressed blocks ``lo .. hi - 1`` that overlap
        its keys (block ``c`` covers ``[c s, c s + l)``, selection block ``j`` ``[j l', (j + 1) l')``)."""
        l, s, ls = self.block_size, self.stride, self.select_block_size
        n_slc = -(-((n_cmp - 1) * s + l) // ls) if n_cmp else 0
        return [(max(0, (j * ls - l) // s + 1), min(n_cmp, ((j + 1) * ls - 1) // s + 1)) for j in range(n_slc)]

    def forced_and_reach(self, sq: int, sk: int) -> tuple:
        """``(forced (Sq, n_slc), reach (Sq,))``: the blocks each query always takes (the
        ``initial_blocks`` first, the ``local_blocks`` last it reaches) and how many it reaches."""
        n_slc = -(-sk // self.select_block_size)
        t = np.arange(sq) + sk - sq  # each query's position
        reach = np.where(t >= 0, t // self.select_block_size + 1, 0)  # blocks 0 .. reach - 1
        j = np.arange(n_slc)
        return (j[None, :] < self.initial_blocks) | (j[None, :] >= reach[:, None] - self.local_blocks), reach

    def select(self, importance, sq: int, sk: int) -> np.ndarray:
        """``(..., Hk, Sq, top_n)`` selected block indices (-1: none): per query and kv head,
        the ``initial_blocks`` first and ``local_blocks`` last blocks it reaches, then the most
        important, ties to the earlier block; never a block past the query."""
        n_slc = -(-sk // self.select_block_size)
        forced, reach = self.forced_and_reach(sq, sk)
        j = np.arange(n_slc)
        score = np.zeros(importance.shape[:-1] + (n_slc,))
        score[..., :importance.shape[-1]] = importance[..., :n_slc]
        score = np.where(forced, np.inf, score)
        score = np.where(j[None, :] < reach[:, None], score, -np.inf)
        order = np.argsort(-score, axis=-1, kind="stable")[..., :self.top_n]
        chosen = np.take_along_axis(score, order, axis=-1)
        picked = np.where(chosen > -np.inf, order, -1)
        if picked.shape[-1] < self.top_n:  # fewer blocks than top_n
            pad = np.full(picked.shape[:-1] + (self.top_n - picked.shape[-1],), -1)
            picked = np.concatenate([picked, pad], axis=-1)
        return picked

    def keys_of(self, selected, sk: int) -> np.ndarray:
        """The selected blocks' key indices, ``(..., Hk, Sq, top_n * l')`` (-1 where none)."""
        selected = np.asarray(selected, dtype=np.int64)
        keys = selected[..., None] * self.select_block_size + np.arange(self.select_block_size)
        keys = np.where((selected[..., None] >= 0) & (keys < sk), keys, -1)
        return keys.reshape(keys.shape[:-2] + (-1,))


def nsa_attention(q, k, v, gates, nsa: NSA | None = None, *, selected=None, scale=None, return_branches=False,
                  workers=None):
    """NSA's output ``sum_b g_b o_b`` over the compressed, selected and window branches.

    ``q (..., Hq, Sq, D)``, ``k (..., Hk, Sk, D)``, ``v (..., Hk, Sk, Dv)`` (numpy, float64),
    ``gates (..., Hq, Sq, 3)``; ``nsa`` the sizes (`NSA`); ``selected`` the blocks a kernel
    selected, ``(..., Hk, Sq, top_n)`` (None: selected here from the compressed branch's
    weights).  With ``return_branches``: ``(out, {"compressed": o, "selected": o, "window": o,
    "blocks": selected})``."""
    from .tiled import attention

    nsa = nsa or NSA()
    q, k, v = (np.asarray(as_numpy(x, n), dtype=np.float64) for x, n in zip((q, k, v), "qkv"))
    gates = np.asarray(as_numpy(gates, "gates"), dtype=np.float64)
    if gates.shape != q.shape[:-1] + (3,):
        raise ValueError(f"gates must have shape {q.shape[:-1] + (3,)} (compressed, selected, window per query "
                         f"and head), got {gates.shape}")
    sk = k.shape[-2]
    o_cmp, ours = compressed_and_selection(q, k, v, nsa, scale=scale, workers=workers)
    selected = ours if selected is None else checked_selection(selected, k.shape, q.shape[-2], nsa)
    o_slc = attention(q, k, v, gather_kv_indices=nsa.keys_of(selected, sk), causal=True, scale=scale, workers=workers)
    o_win = attention(q, k, v, causal=True, window=(nsa.window - 1, 0), scale=scale, workers=workers)
    out = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win
    if return_branches:
        return out, dict(compressed=o_cmp, selected=o_slc, window=o_win, blocks=selected)
    return out


def compressed_and_selection(q, k, v, nsa: NSA, *, scale=None, workers=None, return_importance=False):
    """``(o_cmp, selected)``: the compressed branch's output and the blocks selected from its
    weights (`NSA.select`), from one pass over the compressed keys (float64 numpy arrays); with
    ``return_importance`` also the importances ``(..., Hk, Sq, n_slc)`` and each row's compressed
    score size ``sigma_i + |lse_i|`` ``(..., Hk, Sq)``, the largest over the group's heads (what a
    kernel's rounding of the importances scales with: `attnlib.check.check_nsa`)."""
    from .tiled import attention

    sq, sk = q.shape[-2], k.shape[-2]
    group = q.shape[-3] // k.shape[-3]
    k_cmp, v_cmp = nsa.compressed(k, v)
    o_cmp, lse_cmp = attention(q, k_cmp, v_cmp, mask_mod=nsa.compressed_mod(sq, sk), scale=scale, return_lse=True,
                               workers=workers)
    if k_cmp.shape[-2]:
        scale_ = scale if scale is not None else 1.0 / np.sqrt(q.shape[-1])
        p_cmp, sigma = _weights(q, k_cmp, lse_cmp, nsa.compressed_mod(sq, sk), scale_, group)
    else:
        p_cmp, sigma = np.zeros(q.shape[:-1] + (0,)), np.zeros(q.shape[:-1])
    importance = nsa.importance(p_cmp, group)
    selected = nsa.select(importance, sq, sk)
    if not return_importance:
        return o_cmp, selected
    size = sigma + np.abs(np.where(np.isfinite(lse_cmp), lse_cmp, 0.0))  # (..., Hq, Sq)
    size = size.reshape(size.shape[:-2] + (size.shape[-2] // group, group, sq)).max(-2)
    return o_cmp, selected, importance, size


def checked_selection(selected, k_shape, sq: int, nsa: NSA) -> np.ndarray:
    """A kernel's own ``selected`` blocks, checked: integers of shape ``(..., Hk, Sq, top_n)`` in
    ``[-1, n_blocks)``; a ValueError naming it otherwise."""
    selected = np.asarray(as_numpy(selected, "selected"))
    want = tuple(k_shape[:-2]) + (sq, nsa.top_n)
    n_slc = -(-k_shape[-2] // nsa.select_block_size)
    if selected.shape != want or not np.issubdtype(selected.dtype, np.integer):
        raise ValueError(f"selected must be integer block indices of shape {want} (..., Hk, Sq, top_n), got "
                         f"{selected.dtype} {selected.shape}")
    if selected.size and (selected.min() < -1 or selected.max() >= n_slc):
        raise ValueError(f"selected must hold block indices in [0, {n_slc}) or -1 (none), got "
                         f"{selected.min()} .. {selected.max()}")
    return selected


def _weights(q, k_cmp, lse, mask_mod, scale, group) -> tuple:
    """``(p_cmp (..., Hq, Sq, n_cmp), sigma (..., Hq, Sq))``: the compressed branch's softmax
    weights, ``exp(s - lse)`` (0 where hidden), and each row's ``max_j |scale| sum_c |q_ic k_jc|``
    over its visible compressed keys, a query tile of rows at a time (``n_cmp`` is ``Sk / stride``)."""
    sq = q.shape[-2]
    kk = np.repeat(k_cmp, group, axis=-3)
    out = np.zeros(q.shape[:-1] + (k_cmp.shape[-2],))
    sigma = np.zeros(q.shape[:-1])
    cols = np.arange(k_cmp.shape[-2])
    for r0 in range(0, sq, 256):
        rows = np.arange(r0, min(sq, r0 + 256))
        s = scale * (q[..., rows, :] @ np.swapaxes(kk, -1, -2))
        seen = np.broadcast_to(mask_mod(0, 0, rows[:, None], cols[None, :]), s.shape)
        shift = np.where(np.isfinite(lse[..., rows]), lse[..., rows], 0.0)[..., None]
        with np.errstate(under="ignore", over="ignore"):
            out[..., rows, :] = np.where(seen, np.exp(np.where(seen, s - shift, -np.inf)), 0.0)
        size = abs(scale) * (np.abs(q[..., rows, :]) @ np.swapaxes(np.abs(kk), -1, -2))
        sigma[..., rows] = np.max(np.where(seen, size, 0.0), axis=-1, initial=0.0)
    return out, sigma


__all__ = ["NSA", "nsa_attention", "BRANCHES"]
