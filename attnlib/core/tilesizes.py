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


#: Score tiles of this many bytes on a GPU (all heads of a query tile at once): large enough
#: that the ~25 launches a tile takes are a small part of its time (8 heads: 2048 x 2048
#: tiles, 17 GFLOP of products each), a few of them well within 4 GiB.
GPU_TILE_BYTES = 1 << 28
#: The CPU's tiles: torch's (MKL's) products gain from larger tiles than numpy's at every
#: head size.  Measured on a 2-core Xeon, 2 threads, medians of 3 interleaved, torch time
#: over numpy's default kernel at 256 -> 512: (1, 1, 4096, 64) 1.13 -> 0.82x, causal 1.16 ->
#: 0.96x; (1, 8, 4096, 64) 0.90 -> 0.80x, causal 1.06 -> 0.90x.
CPU_TILES = TileSizes(512, 512)
#: The CPU's tiles under documents or a window narrower than `NARROW`: fewer wasted pairs.
#: (1, 1, 16384, 64) causal, medians of 3: a 256-key window 0.27 s at 512 x 512, 0.16 s at
#: 256 x 256 (numpy's kernel 0.15 s); 16 documents 0.59 and 0.38 s (numpy 0.33 s).
CPU_MASK_TILES = TileSizes(256, 256)
NARROW = 1024


def device_tiles(dev, heads: int, opts=None, *, spec=None) -> TileSizes:
    """The default tiles on ``dev``: on the CPU `CPU_TILES` (`CPU_MASK_TILES` under
    documents or a narrow window, read from ``opts`` or a piece's mask ``spec``), on a GPU
    square tiles of up to 4096 whose ``heads * block_q * block_k`` float64 scores fit
    `GPU_TILE_BYTES`."""
    if dev.type == "cpu":
        if spec is not None:
            window, documents = tuple(spec.window), spec.q_segments is not None
        else:
            window = (None, None) if opts is None or opts.window is None else tuple(opts.window)
            documents = opts is not None and opts.q_segment_ids is not None
        narrow = any(w is not None and 0 <= w < NARROW for w in window)
        return CPU_MASK_TILES if narrow or documents else CPU_TILES
    side = 4096
    while side > 256 and heads * side * side * 8 > GPU_TILE_BYTES:
        side //= 2
    return TileSizes(side, side)
