"""Parallel tiles are bit-identical to serial; the benchmark machinery runs (no timing asserts)."""

import numpy as np
import pytest

import threading

from attnlib import attention, attention_backward, bench, random_qkv
from attnlib.backward import _Turns
from attnlib.tiled import Aborted, run_tiles


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


@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window=(40, 10)),
                                dict(kv_lengths=[300, 17], causal=True, softcap=20.0),
                                dict(q_segment_ids=np.repeat([[0, 1, 2]], 2, axis=0).repeat(100, axis=1),
                                     kv_segment_ids=np.repeat([[0, 1, 2]], 2, axis=0).repeat(100, axis=1))])
@pytest.mark.parametrize("workers", [2, -1])
def test_backward_workers_are_bit_identical_to_serial(kw, workers):
    q, k, v = random_qkv(300, 300, 16, batch=(2,), heads=4, kv_heads=2, seed=1)
    dout = random_qkv(300, 1, 16, batch=(2,), heads=4, seed=2)[0]
    out, lse = attention(q, k, v, return_lse=True, **kw)
    serial = attention_backward(q, k, v, out, lse, dout, block_q=32, block_k=48, **kw)
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        parallel = attention_backward(q, k, v, out, lse, dout, block_q=32, block_k=48,
                                      workers=workers, **kw)
    for a, b in zip(serial, parallel):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_workers(bad):
    q, k, v = random_qkv(10, 10, 4, seed=0)
    with pytest.raises(ValueError, match="workers must be a positive integer or -1"):
        attention(q, k, v, workers=bad)
    with pytest.raises(ValueError, match="workers must be a positive integer or -1"):
        attention_backward(q, k, v, q, q[:, 0], q, workers=bad)


def test_worker_threads_keep_the_callers_floating_point_mode():
    # numpy's error state is per thread; without carrying it over, strict mode would only
    # warn inside the workers.
    def overflow(_):
        np.float64(1e308) * np.float64(10.0)

    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        run_tiles(overflow, range(4), workers=2)


def test_a_failing_worker_is_reported_and_waiting_ones_let_go():
    # Tile 0 fails before its turn at query tile 0; tile 1 waits for that turn and must be
    # released (Aborted) rather than hang, and the original error is the one raised.
    turns = _Turns(np.array([[0, 1]]), threaded=True)

    def key_tile(b):
        try:
            if b == 0:
                raise ZeroDivisionError("tile 0")
            with turns.turn(0, b):
                pass
        except BaseException:
            turns.abort()
            raise

    caught = []

    def call():
        try:
            run_tiles(key_tile, [1, 0], workers=2)
        except BaseException as e:  # noqa: BLE001 -- inspected below
            caught.append(e)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert len(caught) == 1 and isinstance(caught[0], ZeroDivisionError)
    with pytest.raises(Aborted):
        with turns.turn(0, 1):
            pass


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
    backward = bench.backward_implementations(workers=(1, 2), include_torch=False)
    rows = bench.time_cases([bench.BenchCase(1, 2, 256)], backward, repeats=1)
    assert set(backward) == {"tiled w=1", "tiled w=2", "dense numpy"}
    assert all(rows[0][n] > 0 for n in backward)
    sweep = bench.tile_sweep(bench.BenchCase(1, 1, 256), sizes=(32, 64), repeats=1)
    assert np.array(sweep["seconds"]).shape == (2, 2)
