"""The tiled attention kernel: FlashAttention's forward pass in numpy, in float64.

The Python loop runs over ``(query tile, key tile)`` pairs; every batch and head is
processed at once inside a tile by broadcasting matmul.  Working memory is a few
``(..., block_q, block_k)`` and ``(..., block_q, Dv)`` arrays, independent of ``Sq`` and
``Sk``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _args
from .masks import PARTIAL, SKIP, MaskSpec
from .online import OnlineSoftmax


@dataclass(frozen=True)
class TileSizes:
    """Tile shape of the kernel: ``block_q`` query rows by ``block_k`` keys."""

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self):
        _args.positive_int(self.block_q, "block_q")
        _args.positive_int(self.block_k, "block_k")


DEFAULT_TILES = TileSizes()


@dataclass(frozen=True)
class AttentionStats:
    """What the kernel did, tile by tile (the contract's "Stats").

    Attributes
    ----------
    block_q, block_k : int
        Tile sizes used; tile ``(a, b)`` starts at ``(q0, k0) = (a*block_q, b*block_k)``.
    tile_kind : ndarray of int8, shape ``(..., n_q_tiles, n_k_tiles)``
        ``0 = SKIP, 1 = PARTIAL, 2 = FULL``; leading axes are the batch axes.
    rescales : ndarray of int64, shape ``(..., Hq, n_q_tiles, n_k_tiles)``
        Rescale events per tile and head: query rows whose running max was finite and
        strictly grew in that tile.  For 2-D inputs ``(n_q_tiles, n_k_tiles)``, as ``out``
        has no head axis then.
    rescale_counts : dict
        ``{(q0, k0): events}`` summed over batch and heads, for every processed tile.
    processed_tiles, skipped_tiles, total_rescales : int
        Totals over all (batch, head, tile) triples.
    """

    block_q: int
    block_k: int
    tile_kind: np.ndarray = field(repr=False)
    rescales: np.ndarray = field(repr=False)
    rescale_counts: dict = field(repr=False)
    processed_tiles: int
    skipped_tiles: int
    total_rescales: int


def attention(q, k, v, *, causal=False, causal_align="bottom_right", scale=None,
              block_q=None, block_k=None, return_lse=False, return_stats=False,
              check_finite=True):
    """Exact attention computed tile by tile with the online softmax.

    Equal to `reference_attention` up to float64 rounding, in memory independent of the
    sequence lengths.

    Parameters
    ----------
    q : array_like, shape ``(..., Hq, Sq, D)`` or ``(Sq, D)``
    k : array_like, shape ``(..., Hk, Sk, D)`` or ``(Sk, D)``
    v : array_like, shape ``(..., Hk, Sk, Dv)`` or ``(Sk, Dv)``
        Real floating arrays (computed in float64); equal leading (batch) axes;
        ``Hq % Hk == 0``: query head ``h`` reads kv head ``h // (Hq // Hk)`` (GQA, and
        MQA when ``Hk == 1``).  ``Dv`` may differ from ``D``; ``Sq`` or ``Sk`` may be 0.
    causal : bool
        Query ``i`` sees key ``j`` only if ``j <= i + o``.
    causal_align : {"bottom_right", "top_left"}
        ``o = Sk - Sq`` (default; FlashAttention >= 2.1) or ``o = 0`` (torch SDPA
        ``is_causal``).  For ``Sq = 2, Sk = 5``::

            bottom_right      top_left
            1 1 1 1 0         1 0 0 0 0
            1 1 1 1 1         1 1 0 0 0

    scale : float, optional
        Score scale, ``1/sqrt(D)`` by default.
    block_q, block_k : int, optional
        Tile sizes (default `DEFAULT_TILES`); the last tiles may be ragged.
    return_lse : bool
        Also return ``lse: (..., Hq, Sq)``.
    return_stats : bool
        Also return an `AttentionStats` (costs ``O(Hq * n_q_tiles * n_k_tiles)`` memory).
    check_finite : bool
        Refuse inputs holding NaN or inf (checked in chunks, within the memory bound).

    Returns
    -------
    out : ndarray, shape ``(..., Hq, Sq, Dv)``, float64
    lse : ndarray, shape ``(..., Hq, Sq)``, if ``return_lse``
    stats : AttentionStats, if ``return_stats``

    Notes
    -----
    Each query tile carries an `OnlineSoftmax` state ``(m_i, l_i, acc)`` over its key
    tiles in ascending order.  Tiles are classified in closed form: SKIP tiles are never
    touched, FULL tiles do no mask work, PARTIAL tiles set their invisible scores to
    ``-inf``.  Rows with no visible key give ``out = 0`` and ``lse = -inf``; no step
    divides by zero, overflows or forms ``inf - inf``, so the call runs clean under
    ``np.errstate(divide="raise", over="raise", invalid="raise")``.

    References
    ----------
    T. Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
    IO-Awareness", NeurIPS 2022; T. Dao, "FlashAttention-2", 2023.

    Examples
    --------
    >>> import numpy as np, attnlib
    >>> q, k, v = attnlib.random_qkv(300, 500, 64, seed=0)
    >>> out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True)
    >>> attnlib.attention_errors(out, q, k, v, causal=True).rel_error < 1e-12
    True
    """
    tiles = TileSizes(
        DEFAULT_TILES.block_q if block_q is None else block_q,
        DEFAULT_TILES.block_k if block_k is None else block_k,
    )
    causal = _args.flag(causal, "causal")
    return_lse = _args.flag(return_lse, "return_lse")
    return_stats = _args.flag(return_stats, "return_stats")
    q5, k5, v5, pb = _args.parse(q, k, v, scale=scale, check_finite_inputs=check_finite)
    mask = MaskSpec(pb.sq, pb.sk, causal, causal_align)
    out, lse, rescales, kinds = _forward(q5, k5, v5, pb.scale, mask, tiles, return_stats)

    result = [pb.merge_heads(out, 2)]
    if return_lse:
        result.append(pb.merge_heads(lse, 1))
    if return_stats:
        result.append(_stats(rescales, kinds, pb, tiles))
    return result[0] if len(result) == 1 else tuple(result)


def _forward(q, k, v, scale, mask, tiles, count_rescales):
    """The kernel on grouped views ``q: (*lead, sq, d)``, ``k, v: (*lead', sk, .)``."""
    bq, bk = tiles.block_q, tiles.block_k
    lead, sq, sk, dv = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
    out = np.empty(lead + (sq, dv))
    lse = np.empty(lead + (sq,))
    k_starts = np.arange(0, sk, bk)  # (n_k_tiles,)
    k_ends = np.minimum(k_starts + bk, sk)
    n_q_tiles = -(-sq // bq)
    # The whole tile map and the per-tile counts are kept only when stats are asked for:
    # they grow as (Sq / block_q) * (Sk / block_k).
    kinds = rescales = None
    if count_rescales:
        kinds = np.empty((n_q_tiles, k_starts.size), dtype=np.int8)
        rescales = np.zeros(lead + kinds.shape, dtype=np.int64)

    for a in range(n_q_tiles):
        q0, q1 = a * bq, min(sq, (a + 1) * bq)
        row_kinds = mask.tile_kind(q0, q1, k_starts, k_ends)  # (n_k_tiles,), closed form
        if count_rescales:
            kinds[a] = row_kinds
        # The scale is applied once per query tile: a (..., bq, d) copy, never all of q.
        q_i = q[..., q0:q1, :].astype(np.float64) * scale  # (..., bq, d)
        state = OnlineSoftmax.empty(lead + (q1 - q0,), dv)
        # SKIP tiles are never touched; the rest in ascending key order (the rescale counts
        # depend on it).
        for b in np.flatnonzero(row_kinds != SKIP):
            k0, k1 = k_starts[b], k_ends[b]
            k_j = k[..., k0:k1, :].astype(np.float64, copy=False)  # (..., bk, d)
            v_j = v[..., k0:k1, :].astype(np.float64, copy=False)  # (..., bk, dv)
            s = np.matmul(q_i, np.swapaxes(k_j, -1, -2))  # (..., bq, bk)
            if row_kinds[b] == PARTIAL:
                hidden = ~mask.visible(np.arange(q0, q1), np.arange(k0, k1))  # (bq, bk)
                s[..., hidden] = -np.inf
            rescaled = state.update(s, v_j)  # (..., bq)
            if count_rescales:
                rescales[..., a, b] = rescaled.sum(axis=-1)
        out[..., q0:q1, :], lse[..., q0:q1] = state.finalize()
    return out, lse, rescales, kinds


def _stats(rescales, kinds, pb, tiles) -> AttentionStats:
    heads = int(np.prod(pb.batch, dtype=np.int64)) * pb.hq
    # (*batch, hk, g, nq, nk) -> (*batch, hq, nq, nk), or (nq, nk) for 2-D inputs as for out.
    rescales = pb.merge_heads(rescales, 2)
    per_tile = rescales.sum(axis=tuple(range(rescales.ndim - 2)))  # (nq, nk)
    processed = np.argwhere(kinds != SKIP)
    n_processed = len(processed)
    return AttentionStats(
        block_q=tiles.block_q,
        block_k=tiles.block_k,
        tile_kind=np.broadcast_to(kinds, pb.batch + kinds.shape).copy(),
        rescales=rescales,
        rescale_counts={
            (int(a) * tiles.block_q, int(b) * tiles.block_k): int(per_tile[a, b])
            for a, b in processed
        },
        processed_tiles=n_processed * heads,
        skipped_tiles=(kinds.size - n_processed) * heads,
        total_rescales=int(rescales.sum()),
    )


__all__ = ["attention", "AttentionStats", "TileSizes", "DEFAULT_TILES"]
