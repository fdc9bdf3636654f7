"""Peak memory, traced exactly (tracemalloc), and RSS by kind, each call in a fresh process
after a warm-up."""

import pytest

from attnlib.evidence import memory
from attnlib import random_qkv
from attnlib.evidence.memory import CAP_BYTES, peak_memory, rss_growth

STRICT = {"divide": "raise", "over": "raise", "invalid": "raise"}
SMALL_TILES = (2048, 4096)  # n at 32 x 32 tiles: a per-tile map would grow by 12288 entries
DECODE_KEYS = 131072  # a 128 MiB memmapped cache: 1% of it is 1.28 MiB


@pytest.fixture(scope="module")
def peaks():
    return {
        ("tiled", 4096): peak_memory("tiled", 4096, d=64, causal=True),
        ("dense", 4096): peak_memory("dense", 4096, d=64, causal=True),
        ("tiled", 16384): peak_memory("tiled", 16384, d=64, causal=True),
        # Small tiles: anything kept per tile (a tile map, counts) would show up here.
        # Not causal: every tile is visited, so bookkeeping per visited tile grows as a full map.
        **{("small tiles", n): peak_memory("tiled", n, d=64, block_q=32, block_k=32, causal=False)
           for n in SMALL_TILES},
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
    # With 32 x 32 tiles a per-tile map would grow by (4096/32)**2 - (2048/32)**2 entries
    # (a byte each at least: 12 KiB, beyond the 8 KiB allowed); what may grow is a few
    # integers per key tile for the closed-form tile classes of one query tile (3,112 B measured).
    # (8192 against 4096, causal, 48 KiB against 16 KiB, took 6.6 s of fresh processes.)
    small, large = (peaks["small tiles", n] for n in SMALL_TILES)
    extra_key_tiles = (SMALL_TILES[1] - SMALL_TILES[0]) // 32
    assert large["working_bytes"] - small["working_bytes"] <= 128 * extra_key_tiles


def test_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path must be one of"):
        peak_memory("sparse", 16)


@pytest.fixture(scope="module")
def decode():
    kw = dict(d=64, causal=True, block_k=512)
    return peak_memory("stream", 1, DECODE_KEYS, **kw), rss_growth("stream", 1, DECODE_KEYS, **kw)


@pytest.fixture(scope="module")
def decode_twice_as_long():
    return rss_growth("stream", 1, 2 * DECODE_KEYS, d=64, causal=True, block_k=512)


def test_measurement_processes_run_numpy_in_strict_mode(peaks, decode):
    for result in (peaks["tiled", 4096], peaks["dense", 4096], *decode):
        assert {k: result["numpy_errors"][k] for k in STRICT} == STRICT, result["path"]


def test_decode_traced_and_rss_side_by_side(decode, decode_twice_as_long):
    traced, rss = decode
    cache = 2 * DECODE_KEYS * 64 * 8
    assert traced["cache_bytes"] == rss["cache_bytes"] == cache
    assert traced["working_bytes"] < min(CAP_BYTES, cache / 100)
    if memory.rss_split() is None:
        assert rss["anon_bytes"] is None and rss["rss_split"].startswith("not measured")
        pytest.skip("no RssAnon/RssFile in /proc/self/status here")
    assert rss["rss_split"] == memory.PROC_STATUS
    # What the process allocates stays small and does not grow with the cache; what grows is
    # the memmapped cache's pages.  (The anonymous level itself, about 1.3-1.8 MB here, moves
    # with the heap the fresh process starts from, e.g. how much of attnlib it imported.)
    assert 0 <= rss["anon_bytes"] < CAP_BYTES
    longer = decode_twice_as_long
    assert longer["cache_bytes"] == 2 * cache
    assert longer["anon_bytes"] - rss["anon_bytes"] < cache / 100  # < 1% of the cache it added
    # One causal decode query at the end reads every key: the whole cache is mapped in.
    assert 0.95 * cache <= rss["file_bytes"] <= 1.05 * cache
    # memory_profiler's total RSS counts those file-backed pages too.
    assert rss["rss_bytes"] >= 0.95 * cache
    assert len(rss["split_t"]) == len(rss["anon"]) == len(rss["file"]) >= 2
    assert max(rss["anon"]) == rss["anon_bytes"] and max(rss["file"]) == rss["file_bytes"]


def test_rss_split_degrades_to_not_measured_without_proc(monkeypatch):
    monkeypatch.setattr(memory, "PROC_STATUS", "/nonexistent/status")
    assert memory.rss_split() is None
    case = dict(tool="rss", path="tiled", causal=True, block_q=None, block_k=None, interval=0.01)
    result, peak, samples, extra = memory._rss(case, *random_qkv(64, 64, 16, seed=0))
    assert result[0].shape == (64, 16) and samples
    assert extra["anon_bytes"] is None and extra["file_bytes"] is None
    assert extra["rss_split"].startswith("not measured") and extra["anon"] == []
