"""What a tiled kernel did, tile by tile: the contract's "Stats" (`return_stats=True`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .masks import SKIP


@dataclass(frozen=True)
class AttentionStats:
    """What the kernel did, tile by tile (the contract's "Stats").

    Attributes
    ----------
    block_q, block_k : int
        Tile sizes used; tile ``(a, b)`` starts at ``(q0, k0) = (a*block_q, b*block_k)``.
    tile_kind : ndarray of int8, shape ``(..., n_q_tiles, n_k_tiles)``
        ``0 = SKIP, 1 = PARTIAL, 2 = FULL``; leading axes are the batch axes (the same map
        for every entry unless padding or segments differ between them).
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


def tile_stats(rescales, kinds, pb, tiles) -> AttentionStats:
    """Stats from the per-tile counts ``(*batch, hk, g, nq, nk)`` and map ``(*batch, nq, nk)``."""
    # (*batch, hk, g, nq, nk) -> (*batch, hq, nq, nk), or (nq, nk) for 2-D inputs as for out.
    rescales = pb.merge_heads(rescales, 2)
    per_tile = rescales.sum(axis=tuple(range(rescales.ndim - 2)))  # (nq, nk)
    processed = kinds != SKIP  # (*batch, nq, nk)
    anywhere = processed.any(axis=tuple(range(processed.ndim - 2)))  # (nq, nk)
    n_processed = int(np.count_nonzero(processed))
    return AttentionStats(
        block_q=tiles.block_q, block_k=tiles.block_k, tile_kind=kinds, rescales=rescales,
        rescale_counts={(int(a) * tiles.block_q, int(b) * tiles.block_k): int(per_tile[a, b])
                        for a, b in np.argwhere(anywhere)},
        processed_tiles=n_processed * pb.hq, skipped_tiles=(kinds.size - n_processed) * pb.hq,
        total_rescales=int(rescales.sum()))


def results(pb, tiles, out, lse, rescales, kinds, *, return_lse: bool, return_stats: bool, max_scores=None):
    """A forward's return value in the caller's layout: ``out``, then ``lse``, ``max_scores``
    (when given) and the stats as asked (``rescales``: the per-tile counts summed over the key
    ranges, host numpy)."""
    result = [pb.merge_heads(out, 2)]
    if return_lse:
        result.append(pb.merge_heads(lse, 1))
    if max_scores is not None:
        result.append(pb.merge_heads(max_scores, 1))
    if return_stats:
        result.append(tile_stats(rescales, kinds, pb, tiles))
    return result[0] if len(result) == 1 else tuple(result)


__all__ = ["AttentionStats", "tile_stats", "results"]
