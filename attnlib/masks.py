"""Which keys each query sees, pair by pair and tile by tile.

`MaskSpec.visible` is the contract's definition, evaluated on index vectors; the dense
reference applies it to the whole ``(Sq, Sk)`` grid and the tiled kernel to one tile.
`MaskSpec.tile_kind` classifies tiles in closed form from the mask geometry (window bounds,
lengths, segment id ranges), never from an ``n x n`` mask.

Query ``i`` sees key ``j`` when all of these hold (``o`` is the alignment offset,
``Sk - Sq`` for bottom_right, ``0`` for top_left, with the actual lengths when padded)::

    i < q_len,  j < kv_len                          padding
    j <= i + o                                      causal
    i + o - left <= j <= i + o + right              window (None: unbounded side;
                                                    causal forces right = 0)
    q_segments[i] == kv_segments[j]                 documents

Causal alignment, ``Sq = 2``, ``Sk = 5`` (1 = visible)::

    bottom_right (o = Sk - Sq = 3)     top_left (o = 0)
        1 1 1 1 0                          1 0 0 0 0
        1 1 1 1 1                          1 1 0 0 0

With ``Sq > Sk`` and ``bottom_right`` the first ``Sq - Sk`` rows see no key at all:
their output is 0 and their ``lse`` is ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _args

#: Tile classes of the contract.
SKIP, PARTIAL, FULL = 0, 1, 2
TILE_KIND_NAMES = {SKIP: "SKIP", PARTIAL: "PARTIAL", FULL: "FULL"}


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """The visibility rule of one batch entry (or of all, when it does not depend on it).

    ``sq, sk`` are the array extents; ``q_len, kv_len`` the actual lengths (default: the
    extents); ``window = (left, right)`` with ``None`` for an unbounded side;
    ``q_segments (sq,)`` and ``kv_segments (sk,)`` document ids, or None.
    """

    sq: int
    sk: int
    causal: bool = False
    causal_align: str = "bottom_right"
    window: tuple = (None, None)
    q_len: int | None = None
    kv_len: int | None = None
    q_segments: np.ndarray | None = None
    kv_segments: np.ndarray | None = None

    def __post_init__(self):
        _args.causal_align(self.causal_align)

    @property
    def rows(self) -> int:
        return self.sq if self.q_len is None else self.q_len

    @property
    def keys(self) -> int:
        return self.sk if self.kv_len is None else self.kv_len

    @property
    def offset(self) -> int:
        """The alignment offset ``o``: ``kv_len - q_len`` for bottom_right, ``0`` for top_left."""
        return self.keys - self.rows if self.causal_align == "bottom_right" else 0

    @property
    def left(self):
        return self.window[0]

    @property
    def right(self):
        return 0 if self.causal else self.window[1]

    @property
    def banded(self) -> bool:
        """Whether a row sees a diagonal band rather than every key (causal or window)."""
        return self.left is not None or self.right is not None

    @property
    def by_position(self) -> bool:
        """Whether visibility depends on positions at all (else every pair is visible)."""
        return (self.banded or self.rows < self.sq or self.keys < self.sk
                or self.q_segments is not None)

    def visible(self, i, j, keys_first: bool = False) -> np.ndarray:
        """Boolean ``(len(i), len(j))``: may query ``i`` see key ``j``?  ``keys_first``: the
        transposed grid ``(len(j), len(i))``.  Only the rules in force are evaluated (a
        causal tile costs one comparison)."""
        i, j = np.asarray(i), np.asarray(j)
        shape = (j.size, i.size) if keys_first else (i.size, j.size)
        i, j = (i[None, :], j[:, None]) if keys_first else (i[:, None], j[None, :])
        vis = None

        def both(rule):
            return rule if vis is None else vis & rule

        if i.size and i.max() >= self.rows:
            vis = both(i < self.rows)
        if j.size and j.max() >= self.keys:
            vis = both(j < self.keys)
        o = self.offset
        if self.left is not None:
            vis = both(j >= i + o - self.left)
        if self.right is not None:
            vis = both(j <= i + o + self.right)
        if self.q_segments is not None:
            vis = both(self.q_segments[i] == self.kv_segments[j])
        if vis is None or vis.shape != shape:
            vis = np.broadcast_to(True if vis is None else vis, shape).copy()
        return vis

    def distance(self, i, j) -> np.ndarray:
        """``|i + o - j|``, ``(len(i), len(j))``: the ALiBi distance of each pair."""
        return np.abs(np.asarray(i)[:, None] + self.offset - np.asarray(j)[None, :]).astype(np.float64)

    def tile_kind(self, q0, q1, k0, k1, kv_ranges=None):
        """SKIP, PARTIAL or FULL for queries ``[q0, q1)`` against keys ``[k0, k1)``.

        Works elementwise on broadcastable integer arrays of key tile bounds (and of query
        tile bounds when there are no segments).  With segments, ``kv_ranges`` are the
        key tiles' segment id ranges from `kv_ranges`, and ``q0, q1`` are scalars.
        """
        q0, q1, k0, k1 = (np.asarray(x) for x in (q0, q1, k0, k1))
        r1 = np.minimum(q1, self.rows)  # rows past q_len see nothing
        c1 = np.minimum(k1, self.keys)  # keys past kv_len are seen by none
        none = (r1 <= q0) | (c1 <= k0)
        every = (r1 == q1) & (c1 == k1)
        o = self.offset
        # Row i sees the band [i + o - left, i + o + right], which moves right with i, and
        # the bands of consecutive rows overlap, so the extreme rows decide: nothing is
        # visible if the tile's keys lie past the last row's reach or before the first
        # row's; everything if every row's band covers all of the tile's keys.
        if self.right is not None:
            none |= k0 > (r1 - 1) + o + self.right
            every &= k1 - 1 <= q0 + o + self.right
        if self.left is not None:
            none |= c1 - 1 < q0 + o - self.left
            every &= k0 >= (q1 - 1) + o - self.left
        if self.q_segments is not None:
            # From the id ranges: disjoint ranges share no id; one id on both sides is
            # all-visible; anything else is PARTIAL (possibly with no visible pair).
            q_ids = self.q_segments[int(q0):int(q1)]
            q_min, q_max = (q_ids.min(), q_ids.max()) if q_ids.size else (0, -1)
            kv_min, kv_max = kv_ranges
            none |= (q_max < kv_min) | (kv_max < q_min)
            every &= (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min)
        kind = np.where(none, SKIP, np.where(every, FULL, PARTIAL)).astype(np.int8)
        return kind[()]

    def kv_ranges(self, k_starts):
        """``(kv_min, kv_max)``: the segment id range of each key tile (None without segments)."""
        if self.q_segments is None:
            return None
        if self.kv_segments.size == 0:
            return np.zeros(0, self.kv_segments.dtype), np.zeros(0, self.kv_segments.dtype)
        return (np.minimum.reduceat(self.kv_segments, k_starts),
                np.maximum.reduceat(self.kv_segments, k_starts))

    def key_tiles(self, block_k: int):
        """``(starts, ends, kv_ranges)`` of the key tiles: what `tile_kind` takes for them."""
        starts = np.arange(0, self.sk, block_k)  # (n_k_tiles,)
        ends = np.minimum(starts + block_k, self.sk)
        return starts, ends, self.kv_ranges(starts)

    def tile_kinds(self, block_q: int, block_k: int) -> np.ndarray:
        """``(n_q_tiles, n_k_tiles)`` int8 map of `tile_kind` over the whole grid."""
        k0, k1, ranges = self.key_tiles(block_k)
        kinds = np.empty((-(-self.sq // block_q), k0.size), dtype=np.int8)
        for a, q0 in enumerate(range(0, self.sq, block_q)):
            kinds[a] = self.tile_kind(q0, min(q0 + block_q, self.sq), k0, k1, ranges)
        return kinds


def mask_specs(batch: tuple, sq: int, sk: int, *, causal=False, causal_align="bottom_right",
               window=None, q_lengths=None, kv_lengths=None, q_segment_ids=None,
               kv_segment_ids=None) -> dict:
    """Check the masking arguments and return ``{batch index: MaskSpec}``.

    When nothing depends on the batch the result is ``{(): spec}``, one rule for every
    batch entry (processed together); otherwise one spec per batch index.
    """
    causal = _args.flag(causal, "causal")
    causal_align = _args.causal_align(causal_align)
    win = _args.window(window, limit=sq + sk)  # wider sides bound nothing: None
    q_len = _args.lengths(q_lengths, "q_lengths", batch, sq, "Sq")
    kv_len = _args.lengths(kv_lengths, "kv_lengths", batch, sk, "Sk")
    q_ids, kv_ids = _args.segment_ids(q_segment_ids, kv_segment_ids, batch, sq, sk)
    common = dict(sq=sq, sk=sk, causal=causal, causal_align=causal_align, window=win)
    if q_len is None and kv_len is None and q_ids is None:
        return {(): MaskSpec(**common)}
    return {
        idx: MaskSpec(
            **common,
            q_len=None if q_len is None else int(q_len[idx]),
            kv_len=None if kv_len is None else int(kv_len[idx]),
            q_segments=None if q_ids is None else q_ids[idx],
            kv_segments=None if kv_ids is None else kv_ids[idx],
        )
        for idx in np.ndindex(*batch)
    }
