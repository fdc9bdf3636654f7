"""Tile sizes: one frozen dataclass, and the defaults by head dimension."""

from __future__ import annotations

from dataclasses import dataclass


from . import validate


@dataclass(frozen=True)
class TileSizes:
    """Tile shape of the kernel: ``block_q`` query rows by ``block_k`` keys."""

    block_q: int = 256
    block_k: int = 256

    def __post_init__(self):
        validate.positive_int(self.block_q, "block_q")
        validate.positive_int(self.block_k, "block_k")


DEFAULT_TILES = TileSizes()
#: The forward's tiles for heads of ``D >= 128``: a ``(512, 128) @ (128, 512)`` score product
#: runs closer to BLAS's peak, and four times fewer tiles mean less per-tile Python work.
#: Measured on a 2-core Xeon, default workers, interleaved medians of 3 (256x256 -> 512x512):
#: (1, 4, 8192, 128) causal 1.43 -> 1.24 s, full 2.64 -> 2.06 s; (2, 16, 2048, 128) causal
#: 0.89 -> 0.89 s, full 1.46 -> 1.32 s.  At D = 64 the larger tiles lost: (1, 8, 4096, 64)
#: causal 0.43 -> 0.55 s (the causal diagonal's wasted half grows with the tile).
LARGE_HEAD_TILES = TileSizes(512, 512)


def default_tiles(d: int) -> TileSizes:
    """The forward's default tiles for head dimension ``d``: `DEFAULT_TILES`, or
    `LARGE_HEAD_TILES` from ``d = 128`` on."""
    return LARGE_HEAD_TILES if d >= 128 else DEFAULT_TILES
