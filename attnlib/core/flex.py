"""Programmable attention: FlexAttention's ``mask_mod`` and ``score_mod``, exact, tile by tile.

PyTorch FlexAttention's conventions::

    mask_mod(b, h, q_idx, kv_idx) -> bool            may query q_idx see key kv_idx?
    score_mod(score, b, h, q_idx, kv_idx) -> score    the modified score

called here on numpy arrays: integer index arrays (absolute positions; ``b`` the batch entry
in C order over the batch axes, ``h`` the query head) that broadcast against one tile's
scores, so a function written with numpy ufuncs (``np.where``, ``&``, ``abs``) runs once per
tile, vectorised.  ``score`` is the scaled product ``scale * q.k`` (after the built-in
softcap, if given); the order is score_mod, then every mask (the built-in ones AND
``mask_mod``) sets ``-inf``, then the built-in ALiBi.

A `BlockMask` classifies every ``(b, h, query tile, key tile)`` as SKIP (no visible pair),
FULL (every pair visible) or PARTIAL from evaluating ``mask_mod`` tile by tile
(`create_block_mask`: one ``(B, H, block_q, block_k)`` boolean tile at a time, so its memory
is bounded; its cost is one ``mask_mod`` evaluation per pair, no matmul).  The kernels never
touch a tile that is SKIP for every head they process together, and evaluate ``mask_mod``
only on PARTIAL tiles.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import weakref
from dataclasses import dataclass, field

import numpy as np

from . import validate
from .arrays import _is_torch_tensor, as_numpy
from .device import float64_default
from .masks import FULL, PARTIAL, SKIP
from .tilesizes import DEFAULT_TILES


@dataclass(frozen=True)
class BlockMask:
    """Tile classes of a ``mask_mod``: ``kinds (B, H, n_q_tiles, n_k_tiles)`` int8 (SKIP 0,
    PARTIAL 1, FULL 2), ``B`` or ``H`` 1 when the mask does not depend on them; the tiles
    are ``block_q x block_k`` over ``Sq x Sk``.  Made by `create_block_mask`; give it to
    `attention` (its tiles then are the kernel's) to reuse it across calls."""

    kinds: np.ndarray = field(repr=False)
    block_q: int
    block_k: int
    sq: int
    sk: int
    mask_mod: object = field(repr=False, compare=False)

    @property
    def shape(self) -> tuple:
        return self.kinds.shape

    def sparsity(self) -> float:
        """The share of (b, h, tile) triples that are SKIP."""
        return float(np.mean(self.kinds == SKIP)) if self.kinds.size else 0.0

    def for_heads(self, b, h, a: int) -> np.ndarray:
        """``(n_k_tiles,)`` classes of query tile ``a`` for the heads ``(b, h)`` (broadcast
        index arrays) processed together: SKIP where SKIP for all of them, FULL where FULL
        for all, else PARTIAL."""
        bb, hh = (x.ravel() * (n > 1) for x, n in zip(np.broadcast_arrays(b, h), self.kinds.shape))  # size 1: index 0
        rows = self.kinds[bb, hh, a]  # (heads, n_k_tiles); all over no heads: SKIP
        return np.where(np.all(rows == SKIP, axis=0), SKIP,
                        np.where(np.all(rows == FULL, axis=0), FULL, PARTIAL)).astype(np.int8)


def intersect_kinds(builtin: np.ndarray, mod: np.ndarray) -> np.ndarray:
    """Classes of the AND of two masks: SKIP if either is, FULL if both are, else PARTIAL."""
    return np.where((builtin == SKIP) | (mod == SKIP), SKIP,
                    np.where((builtin == FULL) & (mod == FULL), FULL, PARTIAL)).astype(np.int8)


def _check_callable(fn, name):
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be callable as FlexAttention's, got {type(fn).__name__}")


#: The functions found to be written with torch operations (see `_call`): called with
#: tensors from then on, as `from_torch` would.
_TORCH_WRITTEN = weakref.WeakKeyDictionary()


def _call(fn, args, name):
    """``fn(*args)`` as numpy: a function written for FlexAttention with torch operations
    (one that raises on numpy arrays, or returns a tensor: numpy and torch operands mixed)
    is called again with tensors, through `from_torch`, and remembered.  One that raises both
    ways raises its own exception, the one from the numpy call (never replaced: the tensor
    call's error is its context, and a note names `from_torch` where Python takes notes)."""
    torch_fn = _TORCH_WRITTEN.get(fn) if _weakrefable(fn) else None
    if torch_fn is not None:
        return torch_fn(*args)
    try:
        out = fn(*args)
    except Exception as e:  # noqa: BLE001 - retried with tensors below, else re-raised
        if "torch" not in sys.modules or _torch_source(fn) is not None:
            raise
        failure = e
    else:
        if not _is_torch_tensor(out):
            return out
        if _torch_source(fn) is not None:  # already called with tensors (from_torch): read it
            return out.detach().cpu().numpy()
        failure = None
    torch_fn = from_torch(fn)
    try:
        out = torch_fn(*args)
    except Exception as e:  # noqa: BLE001 - the function's own exception goes on
        if failure is None:
            raise
        if hasattr(failure, "add_note"):  # Python 3.11+
            failure.add_note(f"attnlib called {name} on numpy index arrays, where it raised this, and again "
                             f"on torch tensors, where it raised {type(e).__name__}: {e} (see "
                             "attnlib.core.flex; a function written with torch ops: attnlib.core.flex.from_torch)")
        raise failure  # its context: the tensor call's error, ``e``
    if _weakrefable(fn):
        _TORCH_WRITTEN[fn] = torch_fn
    return out


def _weakrefable(fn) -> bool:
    try:
        weakref.ref(fn)
        return True
    except TypeError:
        return False


def mask_values(mask_mod, b, h, q_idx, kv_idx, shape) -> np.ndarray:
    """``mask_mod`` on broadcast index arrays, as a boolean array of ``shape``; a clear
    error when it returns something else."""
    arr = np.asarray(_call(mask_mod, (b, h, q_idx, kv_idx), "mask_mod"))
    if arr.dtype != np.bool_:
        raise TypeError(f"mask_mod must return booleans (as FlexAttention's), got dtype {arr.dtype}")
    try:
        return np.broadcast_to(arr, shape)
    except ValueError:
        raise ValueError(f"mask_mod returned shape {arr.shape}, which does not broadcast to the tile's "
                         f"{shape}: write it with elementwise operations on its index arguments") from None


def score_values(score_mod, s, b, h, q_idx, kv_idx, name="score_mod") -> np.ndarray:
    """``score_mod`` (or its derivative, ``name``) on one tile's scores ``s`` (never
    modified), as an array of ``s.shape``."""
    out = np.asarray(_call(score_mod, (s.copy(), b, h, q_idx, kv_idx), name))
    if out.dtype == np.bool_ or not (np.issubdtype(out.dtype, np.floating) or np.issubdtype(out.dtype, np.integer)):
        raise TypeError(f"{name} must return numbers, got dtype {out.dtype}")
    try:
        return np.broadcast_to(out, s.shape)
    except ValueError:
        raise ValueError(f"{name} returned shape {out.shape}, which does not broadcast to the tile's "
                         f"{s.shape}") from None


def check_elementwise(mask_mod, score_mod, sq: int, sk: int) -> None:
    """ValueError when a mod is not elementwise: FlexAttention calls it on one score at a
    time, attnlib on a tile of them, so a reduction (``s - s.mean()``, ``q_idx.max()``,
    ``cumsum``) would silently give another result, one that depends on the tiling.  Probed
    once a call: the mod on a corner of up to ``4 x 4`` of the grid must agree with it on
    its first and its last ``2 x 2`` part (positive scores, floating-point errors ignored:
    a mod such as ``sqrt(s)`` may be valid only on the scores the problem has)."""
    r, c = min(sq, 4), min(sk, 4)
    if r < 2 or c < 2:
        return
    b = h = np.zeros((1, 1, 1, 1), dtype=np.int64)
    i, j = np.arange(r).reshape(1, 1, r, 1), np.arange(c).reshape(1, 1, 1, c)
    s = np.linspace(0.25, 2.5, r * c).reshape(1, 1, r, c)  # distinct scores

    def mask(rows, cols):
        return mask_values(mask_mod, b, h, i[..., rows, :], j[..., cols],
                           (1, 1, rows.stop - rows.start, cols.stop - cols.start))

    def score(rows, cols):
        return score_values(score_mod, s[..., rows, cols], b, h, i[..., rows, :], j[..., cols])

    every = (slice(0, r), slice(0, c))
    parts = ((slice(0, 2), slice(0, 2)), (slice(r - 2, r), slice(c - 2, c)))
    with np.errstate(all="ignore"):
        for name, fn, at in (("mask_mod", mask_mod, mask), ("score_mod", score_mod, score)):
            if fn is None:
                continue
            whole = np.asarray(at(*every), dtype=np.float64)
            for rows, cols in parts:
                part = np.asarray(at(rows, cols), dtype=np.float64)
                if not np.allclose(whole[..., rows, cols], part, rtol=1e-12, atol=0.0, equal_nan=True):
                    raise ValueError(f"{name} is not elementwise: on a 2 x 2 part of a tile it gives other "
                                     "values than on the whole tile (a reduction such as s.mean(), "
                                     "q_idx.max() or cumsum?); FlexAttention applies it to one score at a "
                                     "time, so write it with elementwise operations only")


def _same_function(f, g) -> bool:
    """Whether two mask_mods are one function (or `from_torch` wrappers of one)."""
    return f is g or (_torch_source(f) or f) is (_torch_source(g) or g)


def _torch_source(fn):
    """The function `from_torch` wrapped into ``fn``, or None (``fn`` is no such wrapper:
    ``functools.wraps`` also sets ``__wrapped__``, so that attribute alone does not say)."""
    return getattr(fn, "_attnlib_torch_source", None)


def as_block_mask(block_mask):
    """``block_mask`` as an attnlib `BlockMask`; None stays None.

    A FlexAttention ``torch.nn.attention.flex_attention.BlockMask`` is taken for the mask
    it gives FlexAttention: a pair is visible in its FULL blocks, and in its PARTIAL blocks
    where its ``mask_mod`` (a torch function, called through `from_torch`) says so; its
    block sizes become the tiles.  The classes are then computed again from that mask
    (`create_block_mask`), not taken from torch's lists, so a hand-made block mask whose
    lists disagree with its ``mask_mod`` is still judged by what it computes.
    """
    if block_mask is None or isinstance(block_mask, BlockMask):
        return block_mask
    kind = type(block_mask)
    if not (kind.__name__ == "BlockMask" and kind.__module__.startswith("torch")):
        raise TypeError(f"block_mask must be a BlockMask from attnlib.create_block_mask (or FlexAttention's), "
                        f"got {kind.__name__}")
    sq, sk = (int(n) for n in block_mask.seq_lengths)
    bq, bk = (int(n) for n in block_mask.BLOCK_SIZE)
    nq_blocks, nk_blocks = -(-sq // bq), -(-sk // bk)
    try:
        full = blocks_map(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nq_blocks, nk_blocks,
                          ("full_kv_num_blocks", "full_kv_indices"))
        partial = blocks_map(block_mask.kv_num_blocks, block_mask.kv_indices, nq_blocks, nk_blocks)
    except ValueError as e:
        raise ValueError(f"block_mask's block lists do not fit its {nq_blocks} x {nk_blocks} blocks of seq_lengths "
                         f"and BLOCK_SIZE: {e}") from None
    mod = block_mask.mask_mod
    mod = None if getattr(mod, "__name__", "") == "noop_mask" else from_torch(mod)
    nb, nh = max(full.shape[0], partial.shape[0]), max(full.shape[1], partial.shape[1])
    # FlexAttention's mask: FULL blocks, or PARTIAL ones AND mask_mod.  Not the same function as
    # its mask_mod (the lists decide too): given with that mask_mod, both apply (`visible_mod`).
    return create_block_mask(_map_mod(full, partial, bq, bk, mod), nb if nb > 1 else None, nh if nh > 1 else None,
                             sq, sk, bq, bk)


def _ints(x, name: str) -> np.ndarray:
    """An integer array (numpy or torch) as int64, or a TypeError naming it."""
    a = np.asarray(as_numpy(x, name))
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def blocks_map(counts, indices, n_q_blocks: int, n_k_blocks: int, names=("kv_num_blocks", "kv_indices")) -> np.ndarray:
    """Counts ``(B, H, nq)`` and indices ``(B, H, nq, max_blocks)`` as a ``(B, H, n_q_blocks,
    n_k_blocks)`` boolean map of the listed blocks (entries past a count never read); None: no block."""
    if counts is None and indices is None:
        return np.zeros((1, 1, n_q_blocks, n_k_blocks), dtype=bool)
    if counts is None or indices is None:
        raise ValueError(f"{names[0]} and {names[1]} go together: give both or neither")
    counts, indices = _ints(counts, names[0]), _ints(indices, names[1])
    if counts.ndim != 3 or indices.ndim != 4 or indices.shape[:3] != counts.shape:
        raise ValueError(f"{names[0]} must be (B, H, n_q_blocks) and {names[1]} (B, H, n_q_blocks, max_blocks), "
                         f"got {counts.shape} and {indices.shape}")
    if counts.shape[2] < n_q_blocks:
        raise ValueError(f"{names[0]} lists {counts.shape[2]} query blocks, the sequence has {n_q_blocks}")
    if counts.size and (counts.min() < 0 or counts.max() > indices.shape[-1]):
        raise ValueError(f"{names[0]} must lie in [0, {indices.shape[-1]}] (the lists' length), "
                         f"got {counts.min()} .. {counts.max()}")
    counts, indices = counts[:, :, :n_q_blocks], indices[:, :, :n_q_blocks]
    used = np.arange(indices.shape[-1]) < counts[..., None]
    listed = indices[used]
    if listed.size and (listed.min() < 0 or listed.max() >= n_k_blocks):
        raise ValueError(f"{names[1]} must list key blocks in [0, {n_k_blocks}), got {listed.min()} .. {listed.max()}")
    validate.check_allocation(counts.size * n_k_blocks, f"a block map of {counts.shape} x {n_k_blocks} blocks")
    dense = np.zeros(counts.shape + (n_k_blocks,), dtype=bool)
    where = np.nonzero(used)
    dense[where[:-1] + (listed,)] = True  # (b, h, a) of each used slot, and its key block
    return dense


def _map_mod(full, partial, bq, bk, mask_mod, flip=True):
    """The pairs the lists make visible: a block listed full, or partial where ``mask_mod`` holds
    (maps ``(B, H, nq, nk)``, each B and H 1 where shared).  Square maps of square blocks carry
    the lists read transposed (query and key blocks exchanged, ``mask_mod`` kept) in
    ``_attnlib_neighbours``: a wrong kernel's mask the check's diagnosis tries."""
    def at(m, b, h, q_idx, kv_idx):
        return m[(np.asarray(b) if m.shape[0] > 1 else 0, np.asarray(h) if m.shape[1] > 1 else 0,
                  np.asarray(q_idx) // bq, np.asarray(kv_idx) // bk)]

    def listed(b, h, q_idx, kv_idx):
        in_partial = at(partial, b, h, q_idx, kv_idx)
        if mask_mod is not None:
            shape = np.broadcast_shapes(np.shape(b), np.shape(h), np.shape(q_idx), np.shape(kv_idx))
            in_partial = in_partial & mask_values(mask_mod, b, h, q_idx, kv_idx, shape)
        return at(full, b, h, q_idx, kv_idx) | in_partial

    if flip and bq == bk and full.shape[-1] == full.shape[-2] and partial.shape[-1] == partial.shape[-2]:
        listed._attnlib_neighbours = [(_map_mod(np.swapaxes(full, -1, -2), np.swapaxes(partial, -1, -2), bq, bk,
                                                mask_mod, flip=False),
                                       "the block lists transposed (query and key blocks exchanged)")]
    return listed


def visible_mod(mask_mod, block_mask):
    """The one ``mask_mod`` that a call's ``mask_mod`` and ``block_mask`` give together:
    the block mask's own (``block_mask`` alone, or made from this ``mask_mod``), or both
    ANDed when they are different functions; None when neither is given."""
    block_mask = as_block_mask(block_mask)
    if block_mask is None:
        return mask_mod
    if mask_mod is None or _same_function(mask_mod, block_mask.mask_mod):
        return block_mask.mask_mod
    return and_mods(mask_mod, block_mask.mask_mod)


def and_mods(f, g):
    """The ``mask_mod`` of the pairs both ``f`` and ``g`` make visible."""
    def both(b, h, q_idx, kv_idx):
        shape = np.broadcast_shapes(np.shape(b), np.shape(h), np.shape(q_idx), np.shape(kv_idx))
        return mask_values(f, b, h, q_idx, kv_idx, shape) & mask_values(g, b, h, q_idx, kv_idx, shape)

    return both


def create_block_mask(mask_mod, B, H, Sq, Sk, block_q=None, block_k=None) -> BlockMask:
    """The tile classes of ``mask_mod`` (FlexAttention's ``create_block_mask``, in numpy).

    Parameters
    ----------
    mask_mod : callable ``(b, h, q_idx, kv_idx) -> bool``
        Called with integer arrays of shapes ``(B, 1, 1, 1)``, ``(1, H, 1, 1)``,
        ``(1, 1, block_q, 1)`` and ``(1, 1, 1, block_k)`` per tile.
    B, H : int or None
        Batch entries and query heads the mask depends on; None: it does not (evaluated at
        ``b = 0`` / ``h = 0`` and used for all).
    Sq, Sk : int
    block_q, block_k : int, optional
        Tile sizes (default the kernel's, 256).

    Returns
    -------
    BlockMask

    Notes
    -----
    Cost: ``mask_mod`` once on every ``(b, h, i, j)``, a tile at a time; memory: one
    ``(B, H, block_q, block_k)`` boolean tile and the map.
    """
    _check_callable(mask_mod, "mask_mod")
    if mask_mod is None:
        raise TypeError("create_block_mask needs a mask_mod")
    nb = 1 if B is None else validate.positive_int(B, "B")
    nh = 1 if H is None else validate.positive_int(H, "H")
    sq, sk = validate.count(Sq, "Sq"), validate.count(Sk, "Sk")
    bq = validate.positive_int(DEFAULT_TILES.block_q if block_q is None else block_q, "block_q")
    bk = validate.positive_int(DEFAULT_TILES.block_k if block_k is None else block_k, "block_k")
    nq, nk = -(-sq // bq), -(-sk // bk)
    validate.check_allocation(nb * nh * nq * nk, f"a block mask of {nb} x {nh} x {nq} x {nk} tiles "
                           f"(block_q={bq}, block_k={bk})")
    kinds = np.empty((nb, nh, nq, nk), dtype=np.int8)
    b = np.arange(nb).reshape(nb, 1, 1, 1)
    h = np.arange(nh).reshape(1, nh, 1, 1)
    for a in range(nq):
        rows = np.arange(a * bq, min(sq, (a + 1) * bq)).reshape(1, 1, -1, 1)
        for t in range(nk):
            cols = np.arange(t * bk, min(sk, (t + 1) * bk)).reshape(1, 1, 1, -1)
            m = mask_values(mask_mod, b, h, rows, cols, (nb, nh, rows.shape[2], cols.shape[3]))
            some, every = m.any(axis=(2, 3)), m.all(axis=(2, 3))
            kinds[:, :, a, t] = np.where(every, FULL, np.where(some, PARTIAL, SKIP))
    return BlockMask(kinds, bq, bk, sq, sk, mask_mod)


@dataclass
class Mods:
    """What the kernels carry of the programmable options for one batch entry (or all):
    the functions, the block mask, and the ``(b, h)`` index of every head they process."""

    mask_mod: object
    score_mod: object
    block_mask: BlockMask | None
    b: np.ndarray  # (*lead,) int64: each head's batch entry
    h: np.ndarray  # (*lead,) int64: each head's query head

    def unit(self, unit) -> "Mods":
        """The heads of a work unit (an index into ``lead``)."""
        return Mods(self.mask_mod, self.score_mod, self.block_mask, self.b[unit], self.h[unit])

    def tile_kinds(self, a: int, builtin: np.ndarray) -> np.ndarray:
        """Query tile ``a``'s classes: the built-in masks' AND the block mask's over these heads."""
        if self.block_mask is None:
            return builtin if self.mask_mod is None else \
                np.where(builtin == SKIP, SKIP, PARTIAL).astype(np.int8)
        return intersect_kinds(builtin, self.block_mask.for_heads(self.b, self.h, a))

    def grids(self, rows, cols, keys_first=False):
        """``(b, h, q_idx, kv_idx)`` broadcasting to the tile ``(*lead, rows, cols)`` (or
        ``(*lead, cols, rows)`` keys first)."""
        b, h = self.b[..., None, None], self.h[..., None, None]
        rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
        if keys_first:
            return b, h, rows[None, :], cols[:, None]
        return b, h, rows[:, None], cols[None, :]

    def scores(self, fn, s, rows, cols, keys_first=False, xp=None, name="score_mod"):
        """``fn`` (``score_mod``, or its derivative ``name``) over the tile's scores ``s``, an
        array of ``xp``'s (`attnlib.core.backend`; None: numpy): called on the host's index
        arrays, or on a device's tensors as FlexAttention calls it (`torch_backend.Torch.score_values`)."""
        grids = self.grids(rows, cols, keys_first)
        if xp is None or xp.name == "numpy":
            return score_values(fn, s, *grids, name=name)
        return xp.score_values(fn, s, grids, name)

    def visible(self, vis, rows, cols, keys_first=False, xp=None):
        """The tile's visibility: the built-in ``vis`` (None: all visible) AND ``mask_mod``;
        ``xp``'s arrays (`attnlib.core.backend`; None: numpy), ``mask_mod`` called on a
        device's tensors as FlexAttention calls it (`torch_backend.Torch.mask_values`)."""
        if self.mask_mod is None:
            return vis
        shape = self.b.shape + ((len(cols), len(rows)) if keys_first else (len(rows), len(cols)))
        tile = getattr(self.mask_mod, "tile", None)  # top-k lists (`sparse.Selection`): by search
        on_host = xp is None or xp.name == "numpy"
        if tile is not None and len(cols):
            m = tile(self.b, self.h, rows, int(cols[0]), int(cols[-1]) + 1, keys_first)
            m = m if on_host else xp.mask(m)
        elif on_host:
            m = mask_values(self.mask_mod, *self.grids(rows, cols, keys_first), shape)
        else:
            m = xp.mask_values(self.mask_mod, self.grids(rows, cols, keys_first), shape)
        return m if vis is None else m & vis


def mods_for(mask_mod, score_mod, block_mask, pb, sq, sk, tiles):
    """Checked options: None when none is given, else ``(mask_mod, score_mod, block_mask)``
    with a block mask made when only ``mask_mod`` is given; the tiles must match it.

    A ``mask_mod`` that is not the block mask's own is ANDed with it (`visible_mod`): the
    block mask's SKIP tiles stay SKIP, its FULL tiles become PARTIAL (``mask_mod`` may
    hide pairs there), so no tile drops either function.
    """
    _check_callable(mask_mod, "mask_mod")
    _check_callable(score_mod, "score_mod")
    if mask_mod is None and score_mod is None and block_mask is None:
        return None
    check_elementwise(mask_mod, score_mod, sq, sk)
    block_mask, nb = as_block_mask(block_mask), math.prod(pb.batch)
    if block_mask is not None:
        if (block_mask.sq, block_mask.sk) != (sq, sk):
            raise ValueError(f"block_mask is for Sq={block_mask.sq}, Sk={block_mask.sk}, the inputs have "
                             f"Sq={sq}, Sk={sk}")
        if block_mask.kinds.shape[0] not in (1, nb) or block_mask.kinds.shape[1] not in (1, pb.hq):
            raise ValueError(f"block_mask has B={block_mask.kinds.shape[0]}, H={block_mask.kinds.shape[1]}; "
                             f"the inputs have {nb} batch entries and {pb.hq} query heads (or use None: 1)")
        if (tiles.block_q, tiles.block_k) != (block_mask.block_q, block_mask.block_k):
            raise ValueError(f"block_mask has {block_mask.block_q} x {block_mask.block_k} tiles, the call asks "
                             f"for {tiles.block_q} x {tiles.block_k}: leave block_q/block_k out to use its")
        both = visible_mod(mask_mod, block_mask)
        if both is not block_mask.mask_mod:  # another mask_mod: no tile is FULL for both
            block_mask = dataclasses.replace(
                block_mask, kinds=np.where(block_mask.kinds == FULL, PARTIAL, block_mask.kinds).astype(np.int8),
                mask_mod=both)
        mask_mod = both
    elif mask_mod is not None:
        block_mask = create_block_mask(mask_mod, nb if nb > 1 else None, pb.hq, sq, sk, tiles.block_q, tiles.block_k)
    return mask_mod, score_mod, block_mask


def index_grids(pb, idx):
    """``(b, h)`` of every grouped head ``(*batch_sel, hk, g)`` of batch selection ``idx``."""
    batch = pb.batch
    flat = np.arange(math.prod(batch), dtype=np.int64).reshape(batch) if batch else np.zeros((), np.int64)
    b = flat[idx] if idx else flat
    lead = np.shape(b) + (pb.hk, pb.group)
    h = np.arange(pb.hq, dtype=np.int64).reshape(pb.hk, pb.group)
    return np.broadcast_to(np.asarray(b)[..., None, None], lead), np.broadcast_to(h, lead)


def from_torch(fn):
    """A ``mask_mod`` or ``score_mod`` written for FlexAttention with torch operations, as
    one attnlib calls: its numpy arguments go in as torch tensors (sharing memory, no copy)
    and the result comes back as numpy.  torch is imported only here; the function is
    unchanged, so it still runs under ``torch.compile`` for the kernel it came from.

    >>> import numpy as np
    >>> causal = from_torch(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    >>> causal(0, 0, np.arange(3)[:, None], np.arange(3)[None, :]).sum()
    np.int64(6)
    """
    import torch

    if not callable(fn):
        raise TypeError(f"from_torch needs a callable, got {type(fn).__name__}")

    def as_tensor(x):
        # A writable, contiguous array (the broadcast index grids are read-only views).
        if isinstance(x, torch.Tensor):  # already one (the device kernels' index tensors)
            return x
        return torch.from_numpy(np.require(x, requirements=("C", "W"))) if isinstance(x, np.ndarray) \
            else torch.tensor(x)

    def wrapped(*args):
        with float64_default():  # Python floats times index tensors in float64, as numpy computes them
            out = fn(*(as_tensor(a) for a in args))
        return out.detach().cpu().numpy() if isinstance(out, torch.Tensor) else np.asarray(out)

    wrapped.__name__ = getattr(fn, "__name__", "mod")
    wrapped.__wrapped__ = fn
    wrapped._attnlib_torch_source = fn  # see `_torch_source`
    return wrapped


def tensor_mods(attn_mask=None, attn_bias=None, *, batch=(), heads: int, sq: int, sk: int) -> dict:
    """A boolean mask or an additive bias tensor as FlexAttention's mods (`docs/semantics.md`,
    "Mask and bias tensors"): ``{"mask_mod", "score_mod", "score_mod_grad"}`` for those given,
    to pass to any entry point that takes mods (tiled like every ``mask_mod``).

    ``attn_mask`` (bool, True: the pair takes part; PyTorch SDPA's) and ``attn_bias`` (float,
    added to the score after the scale and softcap; ``-inf`` masks; SDPA's float ``attn_mask``,
    FlashAttention's ``attn_bias``) each broadcast to ``batch + (heads, sq, sk)``; read
    exactly (torch tensors included), never copied beyond that, never written.  Cost: the
    tensor itself is ``Sq x Sk`` per head and entry it varies over; a ``mask_mod`` is the
    long-context way.

    >>> import numpy as np
    >>> m = tensor_mods(attn_bias=np.array([[0.0, -np.inf]]), heads=1, sq=1, sk=2)
    >>> m["score_mod"](np.ones((1, 1, 1, 2)), 0, 0, np.zeros((1, 1)), np.arange(2)[None])
    array([[[[  1., -inf]]]])
    """
    from .arrays import as_float_array, as_numpy

    shape = tuple(batch) + (validate.positive_int(heads, "heads"), int(sq), int(sk))

    def grid(x, name):
        try:
            return np.broadcast_to(x, shape)
        except ValueError:
            raise ValueError(f"{name} of shape {tuple(np.shape(x))} does not broadcast to "
                             f"(batch..., heads, Sq, Sk) = {shape}") from None

    def at(g, b, h, q_idx, kv_idx):
        lead = np.unravel_index(np.asarray(b, np.int64), tuple(batch)) if batch else ()
        return g[(*lead, np.asarray(h, np.int64), np.asarray(q_idx, np.int64), np.asarray(kv_idx, np.int64))]

    mods = {}
    if attn_mask is not None:
        m = np.asarray(as_numpy(attn_mask, "attn_mask"))
        if m.dtype != np.bool_:
            raise TypeError(f"attn_mask must be boolean (True: the pair takes part), got {m.dtype}; "
                            "an additive float mask is attn_bias")
        keep = grid(m, "attn_mask")
        mods["mask_mod"] = lambda b, h, q_idx, kv_idx: at(keep, b, h, q_idx, kv_idx)
    if attn_bias is not None:
        x = np.asarray(as_float_array(attn_bias, "attn_bias"), np.float64)
        if np.isnan(x).any() or np.isposinf(x).any():
            raise ValueError("attn_bias holds NaN or +inf: a bias is finite, or -inf for a masked pair")
        bias = grid(x, "attn_bias")
        mods["score_mod"] = lambda s, b, h, q_idx, kv_idx: np.asarray(s) + at(bias, b, h, q_idx, kv_idx)
        mods["score_mod_grad"] = lambda s, b, h, q_idx, kv_idx: np.ones_like(s)
    return mods


__all__ = ["BlockMask", "create_block_mask", "from_torch", "tensor_mods"]
