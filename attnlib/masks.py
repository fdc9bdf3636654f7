"""Which keys each query sees, pair by pair and tile by tile.

`MaskSpec.visible` is the contract's definition, evaluated on index vectors; the dense
reference applies it to the whole ``(Sq, Sk)`` grid and the tiled kernel to one tile.
`MaskSpec.tile_kind` classifies a tile in closed form from the mask geometry (two
comparisons), never from an ``n x n`` mask.

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


@dataclass(frozen=True)
class MaskSpec:
    """The visibility rule of one call: ``j <= i + offset`` when causal, else everything."""

    sq: int
    sk: int
    causal: bool = False
    causal_align: str = "bottom_right"

    def __post_init__(self):
        _args.causal_align(self.causal_align)

    @property
    def offset(self) -> int:
        """The alignment offset ``o``: ``Sk - Sq`` for bottom_right, ``0`` for top_left."""
        return self.sk - self.sq if self.causal_align == "bottom_right" else 0

    def visible(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Boolean ``(len(i), len(j))``: may query ``i`` see key ``j``?"""
        i = np.asarray(i)[:, None]
        j = np.asarray(j)[None, :]
        if not self.causal:
            return np.ones((i.shape[0], j.shape[1]), dtype=bool)
        return j <= i + self.offset

    def tile_kind(self, q0, q1, k0, k1):
        """SKIP, PARTIAL or FULL for queries ``[q0, q1)`` against keys ``[k0, k1)``.

        Works elementwise on broadcastable integer arrays of tile bounds as well.
        """
        if not self.causal:
            return np.full(np.broadcast(q0, k0).shape, FULL, dtype=np.int8)[()]
        o = self.offset
        # Visible pairs satisfy j - i <= o, so a tile's extreme pairs decide it:
        # none visible if its smallest key is past the last row's reach,
        # all visible if its largest key is within the first row's reach.
        none = np.asarray(k0) > np.asarray(q1) - 1 + o
        every = np.asarray(k1) - 1 <= np.asarray(q0) + o
        return np.where(none, SKIP, np.where(every, FULL, PARTIAL)).astype(np.int8)[()]

    def tile_kinds(self, block_q: int, block_k: int) -> np.ndarray:
        """``(n_q_tiles, n_k_tiles)`` int8 map of `tile_kind` over the whole grid."""
        q0 = np.arange(0, self.sq, block_q)[:, None]
        k0 = np.arange(0, self.sk, block_k)[None, :]
        q1 = np.minimum(q0 + block_q, self.sq)
        k1 = np.minimum(k0 + block_k, self.sk)
        return np.broadcast_to(self.tile_kind(q0, q1, k0, k1), (q0.size, k0.size)).copy()
