"""Block-sparse index lists as the peers lay them out, made into a `BlockMask` whose tile classes
come from the lists (`docs/semantics.md`, "Block-sparse lists"): FlexAttention's
``BlockMask.from_kv_blocks`` and FlashAttention 4's block sparsity (counts and indices per query
block, partial and full), and FlashInfer's BSR (``indptr``/``indices`` over block rows, an
optional dense mask per listed block).  The cost follows the lists: no function is evaluated
over every pair to classify the tiles.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import validate
from .arrays import as_numpy
from .flex import BlockMask, _check_callable, _ints, _map_mod, blocks_map
from .masks import FULL, PARTIAL, SKIP


def _pair(x, name: str) -> tuple[int, int]:
    """An int, or a pair of them: ``(rows, cols)``."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        x = (x, x)
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"{name} must be an int or a pair of ints, got {x!r}")
    return validate.positive_int(x[0], name), validate.positive_int(x[1], name)


def block_mask_from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
                              block_size=128, mask_mod=None, seq_lengths=None) -> BlockMask:
    """A `BlockMask` from FlexAttention's block lists (``BlockMask.from_kv_blocks``; FlashAttention
    4's ``mask_block_cnt``/``mask_block_idx`` and ``full_block_cnt``/``full_block_idx`` are the
    same lists).

    Parameters
    ----------
    kv_num_blocks, kv_indices : array of int
        ``(B, H, n_q_blocks)`` counts and ``(B, H, n_q_blocks, max_blocks)`` key-block indices
        of the partial blocks (``mask_mod`` decides pair by pair there; without one, every pair
        is visible); B or H 1: shared by the batch entries or heads.  Entries past a count are
        never read.
    full_kv_num_blocks, full_kv_indices : array of int, optional
        The same for the full blocks (every pair visible, no ``mask_mod`` call).
    block_size : int or (int, int)
        ``(block_q, block_k)``: the blocks, and the kernel's tiles.
    mask_mod : callable, optional
        ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on the partial blocks (`attnlib.core.flex`).
    seq_lengths : (int, int), optional
        ``(Sq, Sk)``; default ``n_q_blocks * block_q`` and ``max_blocks * block_k``.

    Returns
    -------
    BlockMask
        Tile classes from the lists: FULL where listed full, PARTIAL where listed partial (FULL
        without a ``mask_mod``), SKIP elsewhere; its ``mask_mod`` the pairs the lists make visible.
    """
    _check_callable(mask_mod, "mask_mod")
    bq, bk = _pair(block_size, "block_size")
    shape = np.shape(as_numpy(kv_indices, "kv_indices"))
    if seq_lengths is None:
        if len(shape) != 4:
            raise ValueError(f"kv_indices must be (B, H, n_q_blocks, max_blocks), got {shape}")
        seq_lengths = (shape[2] * bq, shape[3] * bk)
    sq, sk = (validate.count(n, "seq_lengths") for n in _pair_lengths(seq_lengths))
    nq, nk = -(-sq // bq), -(-sk // bk)
    partial = blocks_map(kv_num_blocks, kv_indices, nq, nk)
    full = blocks_map(full_kv_num_blocks, full_kv_indices, nq, nk, ("full_kv_num_blocks", "full_kv_indices"))
    kinds = _kinds(full, partial, FULL if mask_mod is None else PARTIAL)
    return BlockMask(kinds, bq, bk, sq, sk, _map_mod(full, partial, bq, bk, mask_mod))


def block_mask_from_bsr(indptr, indices, R, C, M, N, mask=None) -> BlockMask:
    """A `BlockMask` from FlashInfer's block-sparse rows (``BlockSparseAttentionWrapper.plan``):
    block row ``a`` (query rows ``a R ..``) attends to the key blocks ``indices[indptr[a]:indptr[a
    + 1]]`` (keys ``j C ..``), every pair, or where ``mask[t]`` holds (``(nnz, R, C)`` boolean, the
    ``t``-th listed block); ``M`` query rows and ``N`` keys, shared by the heads and batch entries."""
    R, C = validate.positive_int(R, "R"), validate.positive_int(C, "C")
    sq, sk = validate.count(M, "M"), validate.count(N, "N")
    nq, nk = -(-sq // R), -(-sk // C)
    indptr, indices = _ints(indptr, "indptr"), _ints(indices, "indices")
    if indptr.shape != (nq + 1,) or indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != indices.size \
            or indices.ndim != 1:
        raise ValueError(f"indptr must be {nq + 1} non-decreasing offsets from 0 to len(indices) = {indices.size} "
                         f"(M = {sq} rows in blocks of R = {R}), got shape {indptr.shape}")
    if indices.size and (indices.min() < 0 or indices.max() >= nk):
        raise ValueError(f"indices must list key blocks in [0, {nk}) (N = {sk} in blocks of C = {C}), "
                         f"got {indices.min()} .. {indices.max()}")
    validate.check_allocation(nq * nk * 9, f"a block map of {nq} x {nk} blocks")
    rows = np.repeat(np.arange(nq), np.diff(indptr))
    codes = rows * nk + indices
    if np.unique(codes).size != codes.size:
        twice = int(np.flatnonzero(np.bincount(codes) > 1)[0])
        raise ValueError(f"indices lists a block twice in one block row (row {twice // nk}, key block {twice % nk}): "
                         "each block once, its mask saying which of its pairs are visible")
    position = np.full((nq, nk), -1, dtype=np.int64)  # which listed block each is (-1: none)
    position[rows, indices] = np.arange(indices.size)
    listed = (position >= 0)[None, None]
    if mask is None:
        return BlockMask(_kinds(listed, listed & False, FULL), R, C, sq, sk,
                         _map_mod(listed, listed & False, R, C, None))
    mask = np.asarray(as_numpy(mask, "mask"))
    if mask.dtype != bool or mask.shape != (indices.size, R, C):
        raise ValueError(f"mask must be boolean (nnz, R, C) = {(indices.size, R, C)}, got {mask.dtype} {mask.shape}")
    # each listed block's class from its own mask, cut to the sequence (the last blocks may be short)
    r_in = np.arange(R) < (sq - rows * R)[:, None]  # (nnz, R)
    c_in = np.arange(C) < (sk - indices * C)[:, None]  # (nnz, C)
    inside = r_in[:, :, None] & c_in[:, None, :]
    some, every = (mask & inside).any(axis=(1, 2)), (mask | ~inside).all(axis=(1, 2))
    block_kind = np.where(every, FULL, np.where(some, PARTIAL, SKIP)).astype(np.int8)
    kinds = np.full((1, 1, nq, nk), SKIP, dtype=np.int8)
    kinds[0, 0, rows, indices] = block_kind

    def bsr(b, h, q_idx, kv_idx):
        q_idx, kv_idx = np.asarray(q_idx), np.asarray(kv_idx)
        t = position[q_idx // R, kv_idx // C]
        return (t >= 0) & mask[np.maximum(t, 0), q_idx % R, kv_idx % C]

    return BlockMask(kinds, R, C, sq, sk, bsr)


def _pair_lengths(x):
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"seq_lengths must be a pair (Sq, Sk), got {x!r}")
    return x


def _kinds(full, partial, partial_kind) -> np.ndarray:
    """``(B, H, nq, nk)`` classes: FULL where listed full, ``partial_kind`` where listed partial, else SKIP."""
    full, partial = np.broadcast_arrays(full, partial)
    return np.where(full, FULL, np.where(partial, partial_kind, SKIP)).astype(np.int8)


__all__ = ["block_mask_from_kv_blocks", "block_mask_from_bsr"]
