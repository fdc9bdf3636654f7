"""The task plan: which (entry, heads, query block, key range) pieces exist, and how
each query block's pieces merge.

A piece is a problem of its own (`MaskSpec.piece`), so a task runs the tiled kernel on it
with ``return_lse``; the pieces of one query block then merge exactly by log-sum-exp
(`merge_attention`), as split-KV does on one machine and Flash-Decoding and Ring Attention
do across devices.  A SKIP piece (the causal upper triangle, outside a window, past a
length, between documents) never becomes a task, so the task count follows the visible
area; the merge order is fixed by key range, so the result is the same bits whichever
worker runs what.

Pieces and tiles, ``Sq = Sk = 3 * B``, causal, one entry and head group::

    key range ->  0  1  2
    q block 0     P  .  .        P = PARTIAL piece (a task)
    q block 1     F  P  .        F = FULL piece (a task)
    q block 2     F  F  P        . = SKIP: no task
    6 piece tasks; 2 merge tasks: block 1 (2 pieces), block 2 (3 pieces)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.masks import PARTIAL, SKIP

#: Partial results merged by one merge task (the running result and the next pieces, by
#: key range): a worker holds at most this many per query block, however long the key axis.
MERGE_FANIN = 4


@dataclass(frozen=True)
class Piece:
    """Queries ``[q0, q1)`` of batch ``entry`` and kv heads ``[h0, h1)`` against keys ``[k0, k1)``."""

    entry: tuple
    h0: int
    h1: int
    q0: int
    q1: int
    k0: int
    k1: int
    kind: int  # PARTIAL or FULL

    @property
    def label(self) -> str:
        where = f"batch entry {self.entry}, " if self.entry else ""
        return (f"{where}kv heads [{self.h0}, {self.h1}), query rows [{self.q0}, {self.q1}), "
                f"keys [{self.k0}, {self.k1})")


@dataclass(frozen=True)
class Block:
    """One output block: queries ``[q0, q1)`` of ``entry`` and kv heads ``[h0, h1)``, and
    its pieces in ascending key order (none: every row sees nothing, ``out = 0``,
    ``lse = -inf``)."""

    entry: tuple
    h0: int
    h1: int
    q0: int
    q1: int
    pieces: tuple


def make_plan(batch: tuple, hk: int, sq: int, sk: int, specs: dict, block_q: int, kv_block: int,
              heads_per_task: int) -> list:
    """Every output `Block` with its pieces, in C order of (entry, heads, query block).

    ``specs`` is `mask_specs`' dict: ``{(): spec}`` when the mask does not depend on the
    batch entry, else one spec per entry.  Tile classes come from the closed form
    (`MaskSpec.tile_kind`), so planning costs a few integers per piece, never a mask.

    A piece never reaches past a length: its keys end at the entry's ``kv_len`` and its
    query rows at its ``q_len`` (those values are read by no task, so a NaN there goes
    unnoticed, as the contract says).  A query block cut by ``q_len`` becomes two blocks:
    the rows before it, with the pieces, and the rows past it, with none (``out = 0``,
    ``lse = -inf`` or the sink, written without a task).  No visible pair at all (``Sq``,
    ``Sk`` or a batch axis of 0, every length 0, a mask that hides everything): no piece.
    """
    k_starts = np.arange(0, sk, kv_block)
    k_ends = np.minimum(k_starts + kv_block, sk)
    blocks = []
    for entry in np.ndindex(*batch):
        spec = specs[()] if () in specs else specs[entry]
        ranges = spec.kv_ranges(k_starts)
        k_stops = np.minimum(k_ends, spec.keys)  # keys past kv_len: read by no piece
        for q0 in range(0, sq, block_q):
            q1 = min(sq, q0 + block_q)
            q_stop = min(q1, max(q0, spec.rows))  # rows past q_len: read by no piece
            # The classes of the pieces as clipped: the same SKIPs (tile_kind clips to the
            # lengths itself), and FULL where only the lengths made a range PARTIAL.
            kinds = spec.tile_kind(q0, q_stop, k_starts, k_stops, ranges) if k_starts.size else \
                np.zeros(0, np.int8)
            kinds = np.atleast_1d(kinds)
            candidates = np.flatnonzero(kinds != SKIP)
            if spec.q_segments is not None:  # PARTIAL may hide no pair at all: ask exactly
                candidates = [t for t in candidates if kinds[t] != PARTIAL or
                              spec.any_visible(q0, q_stop, int(k_starts[t]), int(k_stops[t]))]
            for h0 in range(0, hk, heads_per_task):
                h1 = min(hk, h0 + heads_per_task)
                pieces = tuple(Piece(entry, h0, h1, q0, q_stop, int(k_starts[t]), int(k_stops[t]),
                                     int(kinds[t])) for t in candidates)
                stop = q_stop if pieces else q1
                blocks.append(Block(entry, h0, h1, q0, stop, pieces))
                if stop < q1:
                    blocks.append(Block(entry, h0, h1, stop, q1, ()))
    return blocks


def merge_groups(n: int, fanin: int = MERGE_FANIN) -> list:
    """The merges of ``n`` partials in key order: a list of groups of indices, each merged
    into the running result of the groups before it.

    The first group is the first ``fanin`` partials; each later one, the next ``fanin - 1``
    partials merged with the running result (a left-deep tree)::

        n = 8, fanin = 4:   [0 1 2 3] -> a,   [a 4 5 6] -> b,   [b 7] -> result

    A worker then holds at most the running result and ``fanin - 1`` partials per query
    block, however long the key axis: memory flat in ``n``.  (A balanced tree would hold
    ``fanin - 1`` partials per level, ``log n`` levels; measured, a worker's peak grew 2.7x
    from n = 4096 to 32768 with one.)  Empty for ``n <= 1``.
    """
    if n <= 1:
        return []
    return [list(range(min(n, fanin)))] + [list(range(i, min(n, i + fanin - 1))) for i in range(fanin, n, fanin - 1)]


def count_tasks(blocks: list) -> dict:
    """``{"pieces", "merges", "blocks", "empty_blocks"}``: the task counts of a plan."""
    pieces = sum(len(b.pieces) for b in blocks)
    merges = sum(len(merge_groups(len(b.pieces))) for b in blocks)
    return {"pieces": pieces, "merges": merges, "blocks": len(blocks),
            "empty_blocks": sum(1 for b in blocks if not b.pieces)}
