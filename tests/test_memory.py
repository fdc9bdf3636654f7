"""Peak memory, traced exactly (tracemalloc), each call in a fresh process after a warm-up."""

import pytest

from attnlib.memory import CAP_BYTES, peak_memory


@pytest.fixture(scope="module")
def peaks():
    return {
        ("tiled", 4096): peak_memory("tiled", 4096, d=64, causal=True),
        ("dense", 4096): peak_memory("dense", 4096, d=64, causal=True),
        ("tiled", 16384): peak_memory("tiled", 16384, d=64, causal=True),
        # Small tiles: anything kept per tile (a tile map, counts) would show up here.
        ("small tiles", 4096): peak_memory("tiled", 4096, d=64, block_q=32, block_k=32),
        ("small tiles", 16384): peak_memory("tiled", 16384, d=64, block_q=32, block_k=32),
    }


def test_tiled_stays_under_the_cap_that_dense_exceeds(peaks):
    tiled, dense = peaks["tiled", 4096], peaks["dense", 4096]
    assert tiled["working_bytes"] < CAP_BYTES < dense["working_bytes"]
    # The dense path holds at least one (Sq, Sk) float64 matrix.
    assert dense["working_bytes"] >= 4096 * 4096 * 8


def test_tiled_working_memory_does_not_grow_with_n(peaks):
    small, large = peaks["tiled", 4096], peaks["tiled", 16384]
    assert large["working_bytes"] <= 1.10 * small["working_bytes"]
    # The output itself is counted in the peak, and grows as it must.
    assert large["output_bytes"] == 4 * small["output_bytes"]


def test_only_key_tile_bookkeeping_grows_with_n(peaks):
    # With 32 x 32 tiles a per-tile map would grow by (16384/32)**2 - (4096/32)**2 entries
    # (megabytes); what may grow is a few integers per key tile for the closed-form tile
    # classes of one query tile.
    small, large = peaks["small tiles", 4096], peaks["small tiles", 16384]
    extra_key_tiles = 16384 // 32 - 4096 // 32
    assert large["working_bytes"] - small["working_bytes"] <= 128 * extra_key_tiles


def test_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path must be one of"):
        peak_memory("sparse", 16)
