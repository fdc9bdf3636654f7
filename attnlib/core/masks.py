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
    j >= kv_start                                   left-padded keys (positions from kv_start)
    floor((j - s) / C) == floor((i + o - s) / C)    chunks of C (s = kv_start)
    j < s + N  exempts a key from the window's left bound (N sink tokens)

Causal alignment, ``Sq = 2``, ``Sk = 5`` (1 = visible)::

    bottom_right (o = Sk - Sq = 3)     top_left (o = 0)
        1 1 1 1 0                          1 0 0 0 0
        1 1 1 1 1                          1 1 0 0 0

With ``Sq > Sk`` and ``bottom_right`` the first ``Sq - Sk`` rows see no key at all:
their output is 0 and their ``lse`` is ``-inf``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from . import hooks, validate

#: Tile classes of the contract.
SKIP, PARTIAL, FULL = 0, 1, 2
TILE_KIND_NAMES = {SKIP: "SKIP", PARTIAL: "PARTIAL", FULL: "FULL"}

#: The most bytes of band masks a `MaskSpec.tile_visible` cache keeps (a few 256 x 256
#: masks, or two at 512 x 512, cover a causal run or a sliding window).
BAND_CACHE_BYTES = 1 << 20
#: Most documents in one tile for which `MaskSpec.tile_visible` fills rectangles.
MAX_RECTANGLES = 32


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """The visibility rule of one batch entry (or of all, when it does not depend on it).

    ``sq, sk`` are the array extents; ``q_len, kv_len`` the actual lengths (default: the
    extents); ``window = (left, right)`` with ``None`` for an unbounded side;
    ``q_segments (sq,)`` and ``kv_segments (sk,)`` document ids, or None; ``kv_start``
    the first valid key (left padding) and the origin of key positions (negative in a
    piece that starts past it); ``chunk`` the attention chunk ``C`` or None;
    ``sink_tokens`` the ``N`` first keys exempt from the window's left bound.
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
    #: An explicit ``o`` in place of the one ``causal_align`` gives: the rule of a piece
    #: of a larger problem, in the piece's own positions (see `piece`).
    align_offset: int | None = None
    kv_start: int = 0
    chunk: int | None = None
    sink_tokens: int = 0

    def __post_init__(self):
        validate.causal_align(self.causal_align)

    @property
    def rows(self) -> int:
        return self.sq if self.q_len is None else self.q_len

    @property
    def keys(self) -> int:
        return self.sk if self.kv_len is None else self.kv_len

    @property
    def key_lo(self) -> int:
        """The first valid key (``kv_start``, or 0 in a piece that starts past it)."""
        return max(self.kv_start, 0)

    @property
    def sink_end(self) -> int:
        """Keys ``j < sink_end`` are exempt from the window's left bound (the sink tokens)."""
        return self.kv_start + self.sink_tokens

    def sinks_from(self, k0: int) -> bool:
        """Whether keys from ``k0`` on include sink tokens exempt from a left bound (a tile
        there is not a pure band)."""
        return bool(self.sink_tokens) and self.left is not None and k0 < self.sink_end

    @property
    def offset(self) -> int:
        """The alignment offset ``o``: ``kv_len - q_len`` for bottom_right, ``kv_start`` for
        top_left (query 0 at the first valid key)."""
        if self.align_offset is not None:
            return self.align_offset
        return self.keys - self.rows if self.causal_align == "bottom_right" else self.kv_start

    def piece(self, q0: int, q1: int, k0: int, k1: int) -> "MaskSpec":
        """The rule of queries ``[q0, q1)`` against keys ``[k0, k1)``, in the piece's own
        positions ``i' = i - q0``, ``j' = j - k0``: ``piece(...).visible(i', j') ==
        visible(i, j)``.

        With ``j <= i + o`` equivalent to ``j' <= i' + (o + q0 - k0)``, the piece keeps
        every rule with the offset ``o + q0 - k0``, its lengths clipped to the piece and
        its slice of the document ids.  A piece of a problem is a problem of its own, so
        pieces can be computed anywhere (split-KV, a cluster) by the one kernel.
        """
        return MaskSpec(
            q1 - q0, k1 - k0, self.causal, self.causal_align, self.window,
            q_len=min(max(self.rows - q0, 0), q1 - q0), kv_len=min(max(self.keys - k0, 0), k1 - k0),
            q_segments=None if self.q_segments is None else self.q_segments[q0:q1],
            kv_segments=None if self.kv_segments is None else self.kv_segments[k0:k1],
            align_offset=self.offset + q0 - k0, kv_start=self.kv_start - k0, chunk=self.chunk,
            sink_tokens=self.sink_tokens)

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

    def visible(self, i, j, keys_first: bool = False) -> np.ndarray:
        """Boolean ``(len(i), len(j))``: may query ``i`` see key ``j``?  ``keys_first``: the
        transposed grid ``(len(j), len(i))``.  Only the rules in force are evaluated (a
        causal tile costs one comparison)."""
        i, j = np.asarray(i), np.asarray(j)
        if keys_first:
            return self.visible_at(i[None, :], j[:, None])
        return self.visible_at(i[:, None], j[None, :])

    def visible_at(self, i, j) -> np.ndarray:
        """Boolean, the broadcast shape of the index arrays ``i`` and ``j``: may query
        ``i`` see key ``j``, pair by pair (`visible` on a grid; a gathered key list)."""
        i, j = np.asarray(i), np.asarray(j)
        shape = np.broadcast_shapes(i.shape, j.shape)
        vis = None

        def both(rule):
            return rule if vis is None else vis & rule

        if i.size and i.max() >= self.rows:
            vis = both(i < self.rows)
        if j.size and (j.max() >= self.keys or j.min() < self.key_lo):
            vis = both((j < self.keys) & (j >= self.key_lo))
        o = self.offset
        if self.left is not None:
            rule = j >= i + o - self.left
            vis = both(rule | (j < self.sink_end) if self.sink_tokens else rule)
        if self.right is not None:
            vis = both(j <= i + o + self.right)
        if self.chunk is not None:
            vis = both(self._chunk_of(j) == self._chunk_of(i + o))
        if self.q_segments is not None:
            vis = both(self.q_segments[i] == self.kv_segments[j])
        if vis is None or vis.shape != shape:
            vis = np.broadcast_to(True if vis is None else vis, shape).copy()
        return vis

    def tile_visible(self, rows, k0: int, k1: int, keys_first: bool = False, *,
                     contiguous: bool = False, cache: dict | None = None) -> np.ndarray:
        """`visible` for one tile, queries ``rows`` against keys ``[k0, k1)``: the same
        values, built faster.  Do not write to the result (it may be a cached array).

        `visible` evaluates each rule as a broadcast comparison, about 1 ns per pair at
        256 x 256 (measured): as long as the tile's ``exp``.  Here:

        - The band rules (causal, window) depend on ``j - i - o`` only.  On a tile of
          ``contiguous`` rows (``rows[t] = rows[0] + t``) that is ``(k0 - rows[0] - o) +
          (col - row)`` within the tile, so the band mask is built once per diagonal
          offset and tile shape and kept in ``cache`` (a dict the caller keeps, one per
          thread, holding at most `BAND_CACHE_BYTES`): a causal run or a sliding window
          has one or two such masks.  A band that covers the whole tile costs nothing.
        - Padding is evaluated only on a tile that crosses a length.
        - Document ids that ascend along the rows and along the keys (packed sequences)
          make the tile a few rectangles, one per shared document, filled by slicing.
        """
        rows = np.asarray(rows)
        cols = np.arange(k0, k1)
        shape = (cols.size, rows.size) if keys_first else (rows.size, cols.size)
        vis = self._band(rows, cols, keys_first, contiguous, cache)  # None: no band rule acts

        def both(rule):
            return rule if vis is None else vis & rule

        last = (int(rows[-1]) if contiguous else int(rows.max())) if rows.size else -1  # the tile's last row
        if last >= self.rows:
            vis = both(self._grid(rows < self.rows, np.ones(cols.size, bool), keys_first))
        if cols.size and (k1 > self.keys or k0 < self.key_lo):
            vis = both(self._grid(np.ones(rows.size, bool), (cols < self.keys) & (cols >= self.key_lo), keys_first))
        if self.chunk is not None and rows.size and cols.size:
            vis = both(self._grid(self._chunk_of(rows + self.offset), self._chunk_of(cols), keys_first, np.equal))
        if self.q_segments is not None:
            vis = both(self._documents(rows, cols, keys_first))
        return np.ones(shape, dtype=bool) if vis is None else vis

    def _chunk_of(self, pos):
        """The chunk of key position ``pos`` (``floor((pos - kv_start) / C)``; numpy's floor)."""
        return (np.asarray(pos) - self.kv_start) // self.chunk

    @staticmethod
    def _grid(row_x, col_x, keys_first, op=np.bitwise_and):
        """``op(row_x, col_x)`` over the tile's pairs (``&``, or ``==`` of ids), laid out as the tile."""
        return op(col_x[:, None], row_x[None, :]) if keys_first else op(row_x[:, None], col_x[None, :])

    def _band(self, rows, cols, keys_first, contiguous, cache):
        """The band rules' mask of a tile, None where they hide nothing (see `tile_visible`)."""
        if not self.banded or not rows.size or not cols.size:
            return None
        o, left, right = self.offset, self.left, self.right
        # j - i - o over the tile lies in [lo, hi]; the band is [-left, right].
        first, last = (rows[0], rows[-1]) if contiguous else (rows.min(), rows.max())
        lo, hi = cols[0] - last - o, cols[-1] - first - o
        if (left is None or lo >= -left) and (right is None or hi <= right):
            return None  # (sink tokens only add pairs to a band that hides none)
        if not contiguous or cache is None or self.sinks_from(cols[0]):  # sink tokens: not a pure band
            return self._band_grid(rows, cols, keys_first)
        key = (int(cols[0] - rows[0] - o), left, right, rows.size, cols.size, keys_first)
        if key not in cache:
            if sum(a.nbytes for a in cache.values()) + rows.size * cols.size > BAND_CACHE_BYTES:
                cache.clear()
            band = self._band_grid(rows, cols, keys_first)
            band.flags.writeable = False
            cache[key] = band
        return cache[key]

    def _band_grid(self, rows, cols, keys_first):
        i, j = (rows[None, :], cols[:, None]) if keys_first else (rows[:, None], cols[None, :])
        o, band = self.offset, None
        if self.left is not None:
            band = j >= i + o - self.left
            if self.sinks_from(cols[0]):  # the sink tokens: exempt from it
                band = band | (j < self.sink_end)
        if self.right is not None:
            rule = j <= i + o + self.right
            band = rule if band is None else band & rule
        return band

    def _documents(self, rows, cols, keys_first):
        """``q_segments[i] == kv_segments[j]`` over a tile."""
        blocks = self.document_blocks(rows, cols)
        if blocks is not None:  # ascending ids: filled as rectangles by slicing
            shape = (cols.size, rows.size) if keys_first else (rows.size, cols.size)
            vis = np.zeros(shape, dtype=bool)
            for r0, r1, c0, c1 in blocks:
                at = (slice(r0, r1), slice(c0, c1))
                vis[at[::-1] if keys_first else at] = True
            return vis
        return self._grid(self.q_segments[rows], self.kv_segments[cols], keys_first, np.equal)

    def document_blocks(self, rows, cols):
        """A tile's documents as rectangles, when its ids ascend along the rows and along
        the keys (packed sequences): ``[(r0, r1, c0, c1)]``, rows ``rows[r0:r1]`` and keys
        ``cols[c0:c1]`` of one shared document, disjoint in rows, in the tile's own
        coordinates; every pair outside them is invisible.  None when the ids do not
        ascend, or when the tile holds more than `MAX_RECTANGLES` documents.
        """
        q_ids, kv_ids = self.q_segments[rows], self.kv_segments[cols]
        if not (np.all(q_ids[1:] >= q_ids[:-1]) and np.all(kv_ids[1:] >= kv_ids[:-1])):
            return None
        if not q_ids.size or not kv_ids.size:
            return []
        # Each document is a run of rows and a run of keys.
        r = np.concatenate([[0], np.flatnonzero(q_ids[1:] != q_ids[:-1]) + 1, [q_ids.size]])
        if r.size - 1 > MAX_RECTANGLES:
            return None
        ids = q_ids[r[:-1]]
        c0 = np.searchsorted(kv_ids, ids, side="left")
        c1 = np.searchsorted(kv_ids, ids, side="right")
        return [(int(a), int(b), int(c), int(d)) for a, b, c, d in zip(r[:-1], r[1:], c0, c1) if d > c]

    @functools.cached_property
    def without_documents(self) -> "MaskSpec":
        """This rule with its document ids dropped: what holds inside one document's block
        (`document_blocks`)."""
        return replace(self, q_segments=None, kv_segments=None)

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
        lo = np.maximum(k0, self.key_lo)  # the first valid key of each tile
        none |= c1 <= lo
        every &= k0 >= self.key_lo
        if self.right is not None:  # the tile's first valid key past the last row's reach
            none |= lo > (r1 - 1) + o + self.right
            every &= k1 - 1 <= q0 + o + self.right
        if self.left is not None:  # keys before sink_end (none without sink tokens) are exempt
            none |= (c1 - 1 < q0 + o - self.left) & (lo >= self.sink_end)
            every &= (k1 <= self.sink_end) | (np.maximum(k0, self.sink_end) >= (q1 - 1) + o - self.left)
        if self.chunk is not None:
            # Chunks are monotone in the position: the rows' chunks [a0, a1] and the keys'
            # [b0, b1] must meet; all visible if every row and key lies in one chunk.
            a0, a1 = self._chunk_of(q0 + o), self._chunk_of(r1 - 1 + o)
            b0, b1 = self._chunk_of(lo), self._chunk_of(c1 - 1)
            none |= (a1 < b0) | (b1 < a0)
            every &= ((self._chunk_of(q1 - 1 + o) == a0) & (self._chunk_of(k0) == a0)
                      & (self._chunk_of(k1 - 1) == a0))
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

    def any_visible(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether any query in ``[q0, q1)`` sees any key in ``[k0, k1)``: exact, where
        `tile_kind` may call a tile PARTIAL that has no visible pair (documents, chunks and
        sink tokens combined with the other rules).

        Costs ``O((q1 - q0 + k1 - k0) log(k1 - k0))``, never a ``(q1 - q0, k1 - k0)`` mask:
        each row sees one interval of keys (its band, chunk and the padding met), and with
        sink tokens a second (the sink tokens its right bound and chunk allow); with
        documents each interval is looked up among the keys of the row's own document,
        sorted by (document, position).
        """
        ranges = None
        if self.q_segments is not None and k1 > k0:  # the ids of keys [k0, k1) only
            ids = self.kv_segments[k0:k1]
            ranges = (ids.min(), ids.max())
        kind = self.tile_kind(q0, q1, k0, k1, ranges)
        if kind == SKIP:
            return False
        intervals = self.chunk is not None or (self.sink_tokens and self.left is not None)
        if kind == FULL or (self.q_segments is None and not intervals):
            return True  # plain bands are contiguous: the closed form is exact
        i = np.arange(q0, min(q1, self.rows))
        first, last = max(k0, self.key_lo), min(k1, self.keys) - 1
        if not i.size or first > last:
            return False
        o = self.offset
        top = np.full(i.size, last) if self.right is None else np.minimum(i + o + self.right, last)
        bottom = np.full(i.size, first)
        if self.chunk is not None:  # the row's chunk [start, start + C)
            start = self.kv_start + self._chunk_of(i + o) * self.chunk
            bottom, top = np.maximum(bottom, start), np.minimum(top, start + self.chunk - 1)
        spans = [(bottom if self.left is None else np.maximum(bottom, i + o - self.left), top)]
        if self.sink_tokens and self.left is not None:
            spans.append((bottom, np.minimum(top, self.sink_end - 1)))
        if self.q_segments is None:
            return any(bool(np.any(lo <= hi)) for lo, hi in spans)
        j = np.arange(first, last + 1)
        ids, code = np.unique(np.concatenate([self.q_segments[i], self.kv_segments[j]]), return_inverse=True)
        q_code, kv_code = code[:i.size], code[i.size:]
        width = j.size + 1
        keyed = np.sort(kv_code * width + (j - first))  # (document, position) as one sortable int
        for lo, hi in spans:
            ok = lo <= hi
            a = np.searchsorted(keyed, q_code * width + (lo - first), side="left")
            b = np.searchsorted(keyed, q_code * width + (hi - first), side="right")
            if np.any(ok & (b > a)):
                return True
        return False

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


def sink_tokens(sink_token_length, window) -> int:
    """`MaskSpec.sink_tokens` of ``sink_token_length`` under ``window`` (checked): none
    without a left bound, which is all they are exempt from."""
    n = validate.count(sink_token_length, "sink_token_length")
    return n if window[0] is not None else 0


def mask_specs(batch: tuple, sq: int, sk: int, *, causal=False, causal_align="bottom_right",
               window=None, q_lengths=None, kv_lengths=None, q_segment_ids=None,
               kv_segment_ids=None, key_leftpad=None, attention_chunk=None, sink_token_length=0) -> dict:
    """Check the masking arguments and return ``{batch index: MaskSpec}``.

    When nothing depends on the batch the result is ``{(): spec}``, one rule for every
    batch entry (processed together); otherwise one spec per batch index.
    """
    causal = validate.flag(causal, "causal")
    causal_align = validate.causal_align(causal_align)
    win = validate.window(window, limit=sq + sk)  # wider sides bound nothing: None
    q_len = validate.lengths(q_lengths, "q_lengths", batch, sq, "Sq")
    kv_len = validate.lengths(kv_lengths, "kv_lengths", batch, sk, "Sk")
    leftpad = validate.lengths(key_leftpad, "key_leftpad", batch, sk, "Sk")
    if leftpad is not None:
        end = np.broadcast_to(sk if kv_len is None else kv_len, leftpad.shape)
        if (leftpad > end).any():
            at = tuple(int(x) for x in np.argwhere(leftpad > end)[0])
            raise ValueError(f"key_leftpad must not exceed the end of the keys (kv_lengths, default Sk): "
                             f"entry {at} has key_leftpad {int(leftpad[at])} > {int(end[at])}")
    q_ids, kv_ids = validate.segment_ids(q_segment_ids, kv_segment_ids, batch, sq, sk)
    chunk = validate.chunk(attention_chunk)
    common = dict(sq=sq, sk=sk, causal=causal, causal_align=causal_align, window=win, chunk=chunk,
                  sink_tokens=min(sink_tokens(sink_token_length, win), sk))
    if q_len is None and kv_len is None and q_ids is None and leftpad is None:
        return {(): MaskSpec(**common)}
    return {
        idx: MaskSpec(
            **common,
            q_len=None if q_len is None else int(q_len[idx]),
            kv_len=None if kv_len is None else int(kv_len[idx]),
            q_segments=None if q_ids is None else q_ids[idx],
            kv_segments=None if kv_ids is None else kv_ids[idx],
            kv_start=0 if leftpad is None else int(leftpad[idx]),
        )
        for idx in np.ndindex(*batch)
    }


hooks.declare("tile_visible", MaskSpec.tile_visible)  # the PARTIAL tiles' mask, replaceable (`hooks`)
