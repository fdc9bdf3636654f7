"""Parallel query tiles are bit-identical to serial; the benchmark machinery runs (no timing asserts)."""

import numpy as np
import pytest

from attnlib import attention, bench, random_qkv


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window=(50, None)),
                                dict(kv_lengths=[300, 17], causal=True, softcap=20.0),
                                dict(alibi_slopes=[0.1, 0.2, 0.3, 0.4], kv_splits=3)])
@pytest.mark.parametrize("workers", [2, 3, -1])
def test_workers_are_bit_identical_to_serial(kw, workers):
    q, k, v = random_qkv(300, 300, 16, batch=(2,), heads=4, kv_heads=2, seed=1)
    serial = attention(q, k, v, block_q=32, block_k=64, return_lse=True, return_stats=True, **kw)
    parallel = attention(q, k, v, block_q=32, block_k=64, return_lse=True, return_stats=True,
                         workers=workers, **kw)
    for a, b in zip(serial[:2], parallel[:2]):
        assert a.tobytes() == b.tobytes()
    np.testing.assert_array_equal(serial[2].rescales, parallel[2].rescales)
    np.testing.assert_array_equal(serial[2].tile_kind, parallel[2].tile_kind)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_workers(bad):
    q, k, v = random_qkv(10, 10, 4, seed=0)
    with pytest.raises(ValueError, match="workers must be a positive integer or -1"):
        attention(q, k, v, workers=bad)


def test_benchmark_machinery_runs():
    rates = bench.machine_rates(workers=2, size=256)
    assert rates["matmul_gflops"] > 0 and rates["exp_gps"] > 0
    impls = bench.implementations(workers=(1, 2), include_torch=False)
    assert set(impls) == {"tiled w=1", "tiled w=2", "dense numpy"}
    case = bench.BenchCase(1, 2, 256)
    rows = bench.time_cases([case], impls, repeats=1)
    assert rows[0]["case"] == "(1, 2, 256, 64) causal" and all(rows[0][n] > 0 for n in impls)
    # Two heads, two matmuls of 2 n^2 d flops each, halved by the causal mask.
    assert case.flops == 2 * (2 * 2 * 256 * 256 * 64) / 2 and case.exps == 2 * 256 * 256 / 2
    assert bench.roofline_seconds(case, rates) > 0
    sweep = bench.tile_sweep(bench.BenchCase(1, 1, 256), sizes=(32, 64), repeats=1)
    assert np.array(sweep["seconds"]).shape == (2, 2)
