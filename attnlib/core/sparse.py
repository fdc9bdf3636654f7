"""Top-k sparse keys (``gather_kv_indices``): each query row sees only the keys its list names.

DeepSeek's sparse attention, FlashMLA's ``indices`` and FlashAttention 4's
``gather_kv_indices`` give every query row (per batch entry, and per kv head or shared by
them) a list of ``topk`` key positions; ``-1`` or an out-of-range entry selects nothing and a
repeat counts once.  `Selection` holds the lists sorted and deduplicated, one row per
``(batch entry, kv head, query)``::

    keys[b, h', i] = (j_1 < j_2 < ... < j_c, Sk, ..., Sk)     c = counts[b, h', i]

and serves every kernel from them: the dense reference (`Selection.dense`), the tiles' classes
(`Selection.block_mask`), a tile's listed pairs (`Selection.tile`, by binary search in the
lists) and any index grid (`Selection.__call__`, a FlexAttention ``mask_mod``, on numpy or
torch).  `gathered` is the forward whose cost follows the listed keys: each query tile
gathers its rows' keys, up to ``block_k`` of them at a time, into the online softmax, one row
per batch of the matmul, so that ``s = q_i k_{j(i, t)}`` and ``acc += p v_{j(i, t)}``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

from . import hooks, problem, validate
from .arrays import _is_torch_tensor, as_numpy
from .masks import FULL, PARTIAL, SKIP

#: The largest gathered chunk, in float64 elements of ``(rows, keys, D)``, per kv head: 2 MiB
#: ran 1.4 s where 8 MiB ran 2.0 s and 256 KiB 2.5 s (8 heads, 1024 x 1024 of 8192 keys, D 64).
GATHER_ELEMENTS = 1 << 18
#: The gathered forward is taken when its pairs, times this, are fewer than the dense tiles':
#: a gathered pair moves its key and value (memory-bound), measured 10-32x a dense tile's pair.
GATHER_COST = 12


@dataclass(frozen=True, eq=False)
class Selection:
    """The listed keys of every ``(batch entry, kv head or 1, query row)``: ``keys (B, H', Sq,
    T)`` int64, each row ascending and padded with ``Sk``, and ``counts (B, H', Sq)``; ``H'``
    is ``Hk`` for per-head lists, else 1.  ``group`` query heads read one kv head's list."""

    keys: np.ndarray
    counts: np.ndarray
    sk: int
    group: int

    @classmethod
    def parse(cls, indices, pb: "problem.Problem") -> "Selection | None":
        """The checked lists of ``indices`` for the problem ``pb`` (None stays None)."""
        if indices is None:
            return None
        x = np.asarray(as_numpy(indices, "gather_kv_indices"))
        if x.dtype == bool or not np.issubdtype(x.dtype, np.integer):
            raise TypeError(f"gather_kv_indices must hold integers, got dtype {x.dtype}")
        nb = len(pb.batch)
        shared, per_head = pb.batch + (pb.sq,), pb.batch + (pb.hk, pb.sq)
        if x.ndim == nb + 2 and x.shape[:-1] == shared:
            x = x.reshape((math.prod(pb.batch), 1, pb.sq, x.shape[-1]))
        elif x.ndim == nb + 3 and x.shape[:-1] == per_head:
            x = x.reshape((math.prod(pb.batch), pb.hk, pb.sq, x.shape[-1]))
        else:
            raise ValueError(f"gather_kv_indices must have shape {shared + ('topk',)} (batch axes, Sq, "
                             f"topk: shared by the heads) or {per_head + ('topk',)} (per kv head), got "
                             f"{x.shape}")
        validate.check_allocation(24 * x.size, f"gather_kv_indices' sorted lists ({x.size} entries)")
        keys = x.astype(np.int64)  # a copy: the input is never written
        keys[(keys < 0) | (keys >= pb.sk)] = pb.sk  # selects nothing: sorts last
        keys.sort(axis=-1)
        repeat = np.zeros(keys.shape, dtype=bool)
        repeat[..., 1:] = keys[..., 1:] == keys[..., :-1]
        keys[repeat] = pb.sk  # a set: the first of equal entries stays
        keys.sort(axis=-1)
        counts = np.count_nonzero(keys < pb.sk, axis=-1)
        width = int(counts.max()) if counts.size else 0
        return cls(np.ascontiguousarray(keys[..., :width]), counts, pb.sk, pb.group)

    @property
    def per_head(self) -> bool:
        return self.keys.shape[1] > 1

    def _row(self, b, h):
        """The list row of query heads ``h`` of batch entries ``b`` (broadcast arrays)."""
        hh = h // self.group if self.per_head else 0 * h
        b = b if self.keys.shape[0] > 1 else 0 * b
        return b * self.keys.shape[1] + hh

    @property
    def _codes(self) -> np.ndarray:
        """Every list entry as one ascending int64 code, ``row * (Sk + 1) + key``."""
        codes = self.__dict__.get("_codes_made")
        if codes is None:
            sq, width = self.keys.shape[2], self.keys.shape[3]
            rows = np.arange(self.keys.shape[0] * self.keys.shape[1] * sq, dtype=np.int64)
            codes = (rows[:, None] * (self.sk + 1) + self.keys.reshape(rows.size, width)).ravel()  # width 0: no entry
            self.__dict__["_codes_made"] = codes  # frozen: a cache, made once
        return codes

    def __call__(self, b, h, q_idx, kv_idx):
        """``mask_mod(b, h, q_idx, kv_idx)``: is key ``kv_idx`` in query ``q_idx``'s list?
        Broadcast index arrays (numpy, or torch tensors on any device)."""
        if _is_torch_tensor(kv_idx):
            from .device import _torch
            torch, dev = _torch(), str(kv_idx.device)
            cache = self.__dict__.setdefault("_device_codes", {})
            if dev not in cache:
                cache[dev] = torch.as_tensor(self._codes, device=dev)
            codes, search = cache[dev], lambda codes, code: torch.searchsorted(codes, code.contiguous())
        else:
            b, h, q_idx, kv_idx = (np.asarray(x) for x in (b, h, q_idx, kv_idx))
            codes, search = self._codes, np.searchsorted
        code = (self._row(b, h) * self.keys.shape[2] + q_idx) * (self.sk + 1) + kv_idx
        if not len(codes):
            return code != code  # nothing listed: all False, an array of code's kind and shape
        pos = search(codes, code).clip(max=len(codes) - 1)
        return (codes[pos] == code) & (kv_idx >= 0) & (kv_idx < self.sk)

    def tile(self, b, h, rows, k0: int, k1: int, keys_first: bool = False) -> np.ndarray:
        """``(*lead, len(rows), k1 - k0)`` (keys first: the last two axes swapped): the listed
        pairs of queries ``rows`` and keys ``[k0, k1)`` for the heads ``b, h (*lead,)``, found
        by two binary searches per row in the sorted lists: ``O(rows log n + listed)``."""
        b, h = np.broadcast_arrays(np.asarray(b), np.asarray(h))
        rows = np.asarray(rows, dtype=np.int64)
        sq, c = self.keys.shape[2], k1 - k0
        base = ((self._row(b, h)[..., None] * sq + rows) * (self.sk + 1)).ravel()  # (heads * r,)
        codes = self._codes
        lo, hi = np.searchsorted(codes, base + k0), np.searchsorted(codes, base + k1)
        n = hi - lo
        out = np.zeros(b.shape + (rows.size, c), dtype=bool)
        flat = out.reshape(-1, c)
        if n.sum():
            which = np.repeat(np.arange(n.size), n)  # each listed pair's (head, row)
            first = np.repeat(lo - np.cumsum(n) + n, n)  # its row's first entry, less its rank
            at = first + np.arange(which.size)
            flat[which, codes[at] - base[which] - k0] = True
        return np.swapaxes(out, -1, -2) if keys_first else out

    def dense(self, batch: tuple, hk: int, rows=None) -> np.ndarray:
        """The lists as a boolean ``(*batch, H', 1, Sq, Sk)`` mask (the dense reference's);
        ``rows``: those query rows only (``Sq`` of them)."""
        keys = self.keys if rows is None else self.keys[:, :, rows, :]
        nb, nh, sq, width = keys.shape
        validate.check_allocation(nb * nh * sq * (self.sk + 1), f"the top-k mask of {sq} x {self.sk} pairs")
        mask = np.zeros((nb, nh, sq, self.sk + 1), dtype=bool)  # column Sk: the padding's
        np.put_along_axis(mask, keys, True, axis=-1)
        return mask[..., :self.sk].reshape(batch + (nh, 1, sq, self.sk))

    def tile_counts(self, block_q: int, block_k: int) -> np.ndarray:
        """Listed pairs per ``(B, H', query tile, key tile)``, int64: ``O(Sq topk)`` (kept for
        the last tile sizes asked: the block mask and `prefer_gather` both read it)."""
        cached = self.__dict__.get("_tile_counts_made")
        if cached is not None and cached[0] == (block_q, block_k):
            return cached[1]
        nb, nh, sq, width = self.keys.shape
        nq, nk = -(-sq // block_q), -(-self.sk // block_k)
        validate.check_allocation(8 * nb * nh * nq * nk, f"top-k tile counts of {nq} x {nk} tiles")
        a = (np.arange(sq) // block_q)[:, None]  # each row's query tile
        cell = ((np.arange(nb * nh).reshape(nb, nh, 1, 1) * nq + a) * nk + self.keys // block_k)
        counts = np.bincount(cell[self.keys < self.sk], minlength=nb * nh * nq * nk).reshape(nb, nh, nq, nk)
        counts.flags.writeable = False
        self.__dict__["_tile_counts_made"] = ((block_q, block_k), counts)
        return counts

    def block_mask(self, pb: "problem.Problem", tiles):
        """`flex.BlockMask` of the lists over the ``tiles``: SKIP where no row of the query tile
        lists a key of the key tile, FULL where every pair is listed; its ``mask_mod`` is this."""
        from .flex import BlockMask
        bq, bk = tiles.block_q, tiles.block_k
        counts = self.tile_counts(bq, bk)
        rows = np.minimum(bq, pb.sq - np.arange(counts.shape[2]) * bq)[:, None]
        cols = np.minimum(bk, pb.sk - np.arange(counts.shape[3]) * bk)[None, :]
        kinds = np.where(counts == 0, SKIP, np.where(counts == rows * cols, FULL, PARTIAL)).astype(np.int8)
        if self.per_head:  # one list per kv head: the same classes for each of its query heads
            kinds = np.repeat(kinds, self.group, axis=1)
        return BlockMask(kinds, bq, bk, pb.sq, pb.sk, self)

    def dense_pairs(self, block_q: int, block_k: int) -> int:
        """The pairs the dense tiles with this selection would compute (its non-SKIP tiles)."""
        counts = self.tile_counts(block_q, block_k)
        nq, nk = counts.shape[2:]
        rows = np.minimum(block_q, self.keys.shape[2] - np.arange(nq) * block_q)[:, None]
        cols = np.minimum(block_k, self.sk - np.arange(nk) * block_k)[None, :]
        return int(((counts > 0) * rows * cols).sum())

    def prefer_gather(self, block_q: int, block_k: int) -> bool:
        """Whether the gathered forward computes fewer pairs (weighted by `GATHER_COST`)."""
        return GATHER_COST * int(self.counts.sum()) < self.dense_pairs(block_q, block_k)


class _TileRescales:
    """The rescale events of gathered rows by the dense tiles' rule (`docs/semantics.md`,
    "The tiled kernel"): per key tile in ascending order, a row whose running max is finite
    and is passed by more than ``tau`` by the tile's max counts once.  The gathered chunks
    do not end on key tiles, so a row's last tile of a chunk is held (``tile``, ``top``) until
    a later tile or the end shows it complete."""

    def __init__(self, g, r, dtype, sink, tau):
        self.m = np.full((g, r), -np.inf, dtype=dtype)  # the running max, as the dense state's
        if sink is not None:
            self.m[...] = np.asarray(sink, dtype=dtype)[:, None]
        self.tile = np.full(r, -1, dtype=np.int64)  # each row's held tile (-1: none)
        self.top = np.full((g, r), -np.inf, dtype=dtype)  # its max so far
        self.tau = tau

    def _close(self, rows, events):
        """Apply the rule to the held tiles of ``rows`` (bool ``(r,)``): ``events (g, n_k)``."""
        moves = (self.top > self.m + self.tau) & rows
        hit = moves & np.isfinite(self.m)
        for h in range(hit.shape[0]):
            np.add.at(events[h], self.tile[hit[h]], 1)
        self.m = np.where(moves, self.top, self.m)
        self.tile = np.where(rows, -1, self.tile)
        self.top = np.where(rows, -np.inf, self.top)

    def absorb(self, s, tiles, events):
        """One chunk: scores ``s (g, r, t)`` (``-inf`` hidden) of keys in key tiles ``tiles (r, t)``
        (ascending per row; -1 for no key)."""
        for t in np.unique(tiles[tiles >= 0]):
            here = tiles == t  # (r, t)
            rows = here.any(axis=-1)
            self._close(rows & (self.tile >= 0) & (self.tile != t), events)  # an earlier tile is complete
            self.tile = np.where(rows, t, self.tile)
            self.top = np.maximum(self.top, np.where(here[None], s, -np.inf).max(axis=-1))

    def finish(self, events):
        self._close(self.tile >= 0, events)


def in_bhsd(indices, layout: str, q_shape: tuple):
    """Top-k lists in attnlib's order: per kv head ``(..., Hk, Sq, topk)``, from ``"bshd"``'s
    ``(..., Sq, Hk, topk)`` (FlashMLA's); shared lists ``(..., Sq, topk)``, one axis fewer than
    ``q`` (of shape ``q_shape``, in ``layout``), are the same in both (a view; None stays None).
    A ValueError, in the layout's own order, for per-head lists whose ``Sq`` is not ``q``'s."""
    if indices is None or layout != "bshd" or len(q_shape) < 3 or np.ndim(indices) != len(q_shape):
        return indices
    shape, sq = np.shape(indices), q_shape[-3]
    if shape[-3] != sq:
        raise ValueError(f"gather_kv_indices per kv head in layout bshd must have shape "
                         f"{tuple(q_shape[:-3]) + (sq, 'Hk', 'topk')} (batch axes, Sq, Hk, topk), got {shape}")
    return np.swapaxes(np.asarray(indices), -2, -3)


def gathered(q, k, v, pb, setup, sel: Selection, *, workers=1, count_rescales=False, max_scores=False,
             lse_parts=False):
    """The forward over the listed keys: ``(out, lse, rescales, kinds, maxes)`` as `tiled.run_keys`
    (``lse_parts``: ``lse`` as its ``(m, log l)`` parts, ``(..., sq, 2)``, for a merge).

    ``q (*batch, hk, g, sq, d)``, ``k, v (*batch, hk, 1, sk, .)`` (`problem.parse`).  One work
    item per (batch entry, kv head, query tile): its ``g`` query heads' rows, each row a batch
    of the matmuls, gather the row's listed keys and values (ascending, up to ``block_k`` and at
    most `GATHER_ELEMENTS` per chunk), mask the pairs the other rules hide and feed them to
    `OnlineSoftmax` as one tile; the rescales are counted per key tile, as the dense tiles'
    (`_TileRescales`)."""
    from .parallel import run_tiles
    scores_of = hooks.get("tile_scores")  # the declared step (`attnlib.core.hooks`), as the tiles'
    tiles, prec = setup.tiles, setup.prec
    bq, bk = tiles.block_q, tiles.block_k
    nb = math.prod(pb.batch)
    g, d, dv, sq = pb.group, pb.d, pb.dv, pb.sq
    q4, k4, v4 = (x.reshape((nb,) + x.shape[len(pb.batch):]) for x in (q, k, v))  # views
    out = np.empty((nb, pb.hk, g, sq, dv))
    lse = np.empty((nb, pb.hk, g, sq) + ((2,) if lse_parts else ()))
    maxes = np.full((nb, pb.hk, g, sq), -np.inf) if max_scores else None
    n_q, n_k = -(-sq // bq), -(-pb.sk // bk)
    rescales = kinds = None
    if count_rescales:
        rescales = np.zeros((nb, pb.hk, g, n_q, n_k), dtype=np.int64)
        kinds = np.empty((nb, n_q, n_k), dtype=np.int8)
    specs, mods = setup.specs, setup.mods
    from .flex import Mods, index_grids, score_values
    low = not prec.is_float64
    v_exp = problem.value_exponent(setup.v_max, pb.sk, prec.accumulate)
    v_scale = math.ldexp(1.0, -v_exp)
    items = [(e, hk, a) for e in range(nb) for hk in range(pb.hk) for a in range(n_q)]
    index_of = dict(enumerate(np.ndindex(pb.batch)))  # entry e (C order) -> its batch index

    def item(n):
        e, hk, a = items[n]
        spec = specs[()] if () in specs else specs[index_of[e]]
        q0, q1 = a * bq, min(sq, (a + 1) * bq)
        r = q1 - q0
        row = e * sel.keys.shape[1] + (hk if sel.per_head else 0)
        keys = sel.keys.reshape(-1, sq, sel.keys.shape[3])[row, q0:q1]  # (r, T)
        width = int(sel.counts.reshape(-1, sq)[row, q0:q1].max(initial=0))  # the longest list here
        b_grid, h_grid = index_grids(pb, index_of[e])
        heads = Mods(*mods, b_grid[hk], h_grid[hk]) if mods is not None else None
        if kinds is not None and hk == 0:  # the classes over all heads, as the dense tiles'
            builtin = spec.tile_kind(q0, q1, *spec.key_tiles(bk))
            kinds[e, a] = Mods(*mods, b_grid, h_grid).tile_kinds(a, builtin)
        slopes, sink = (None if x is None else np.broadcast_to(x, pb.batch + (pb.hk, g)).reshape(nb, pb.hk, g)[e, hk]
                        for x in (setup.slopes, setup.sink))
        if low:
            q_i = prec.round(q4[e, hk, :, q0:q1, :])[:, :, None, :]  # (g, r, 1, d)
            dtype = prec.accumulate
        else:
            with np.errstate(over="ignore") if setup.check else contextlib.nullcontext():
                q_i = q4[e, hk, :, q0:q1, :].astype(np.float64)[:, :, None, :] * pb.scale
            dtype = np.float64
        state = hooks.get("state").empty((g, r, 1), dv, dtype,
                                         sink=None if sink is None else sink[:, None, None])
        mx_i = None if maxes is None else np.full((g, r, 1), -np.inf, dtype=dtype)
        i = np.arange(q0, q1)
        step = max(1, min(bk, GATHER_ELEMENTS // max(1, r * max(d, dv))))
        counter = None if rescales is None else _TileRescales(g, r, dtype, sink, setup.tau)
        for t0 in range(0, width, step):
            j = keys[:, t0:t0 + step]  # (r, t), ascending per row; Sk: nothing listed
            listed = j < pb.sk
            j = np.where(listed, j, 0)
            vis = listed & spec.visible_at(i[:, None], j)  # (r, t): the other rules AND the list
            k_j, v_j = k4[e, hk, 0][j], v4[e, hk, 0][j]  # (r, t, d), (r, t, dv): the gather
            if low:
                k_j, v_j = prec.round(k_j), prec.round(v_j)
            if v_scale != 1.0:  # exact: a power of two
                v_j = v_j * v_scale
            vis3 = vis[:, None, :]  # (r, 1, t), as s's (g, r, 1, t)
            s, _ = scores_of(q_i, k_j, spec, i, None, PARTIAL, setup.cap, None, post_scale=pb.scale if low else None,
                             check=setup.check, vis=vis3, mods=None)
            if heads is not None and heads.score_mod is not None:  # score_mod on the gathered pairs
                s[...] = np.where(vis3, score_values(heads.score_mod, s, heads.b[:, None, None, None],
                                                     heads.h[:, None, None, None], i[:, None, None],
                                                     j[:, None, :]), -np.inf)
            if slopes is not None:  # ALiBi after masking: -inf stays -inf
                dist = np.abs(i[:, None] + spec.offset - j).astype(np.float64)[:, None, :]
                s -= slopes[:, None, None, None] * dist
            if mx_i is not None:  # max_scores: before update overwrites s
                np.maximum(mx_i, s.max(axis=-1), out=mx_i)
            if counter is not None:  # before update overwrites s
                counter.absorb(s[:, :, 0, :], np.where(listed, j // bk, -1), rescales[e, hk, :, a])
            state.update(s, v_j[None], threshold=setup.tau, overwrite_s=True,
                         round_p=prec.round_p if low else None, visible=np.broadcast_to(vis3, s.shape))
        if counter is not None:
            counter.finish(rescales[e, hk, :, a])
        o_i, lse_i = state.finalize_parts() if lse_parts else state.finalize()
        out[e, hk, :, q0:q1] = problem.unscale_values(o_i[:, :, 0], v_exp, setup.v_max)
        lse[e, hk, :, q0:q1] = lse_i[:, :, 0]
        if mx_i is not None:
            maxes[e, hk, :, q0:q1] = mx_i[:, :, 0]

    if nb and items:
        run_tiles(item, range(len(items)), workers)
    shape = pb.batch + (pb.hk, g)
    return (out.reshape(shape + (sq, dv)), lse.reshape(shape + (sq,) + lse.shape[4:]),
            None if rescales is None else rescales.reshape(shape + (n_q, n_k)),
            None if kinds is None else kinds.reshape(pb.batch + (n_q, n_k)),
            None if maxes is None else maxes.reshape(shape + (sq,)))


__all__ = ["Selection", "gathered", "in_bhsd", "GATHER_COST", "GATHER_ELEMENTS"]
