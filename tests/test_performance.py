"""Parallel tiles are bit-identical to serial; the benchmark machinery runs (no timing asserts)."""

import numpy as np
import pytest

import threading

from attnlib.core import validate
from attnlib import attention, attention_backward, attention_stream, bench, random_qkv
from attnlib.core import hooks, tiles
from attnlib.core.parallel import _MIN_UNITS, _UNIT_BYTES, Aborted, Turns, run_tiles, work_units


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window=(50, None)),
                                dict(kv_lengths=[300, 17], causal=True, softcap=20.0),
                                dict(alibi_slopes=[0.1, 0.2, 0.3, 0.4], kv_splits=3)])
@pytest.mark.parametrize("workers", [2, 3, -1])
def test_workers_are_bit_identical_to_serial(kw, workers, all_cpus):
    q, k, v = random_qkv(300, 300, 16, batch=(2,), heads=4, kv_heads=2, seed=1)
    serial = attention(q, k, v, block_q=32, block_k=64, return_lse=True, return_stats=True,
                       workers=1, **kw)
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
def test_backward_workers_are_bit_identical_to_serial(kw, workers, all_cpus):
    q, k, v = random_qkv(300, 300, 16, batch=(2,), heads=4, kv_heads=2, seed=1)
    dout = random_qkv(300, 1, 16, batch=(2,), heads=4, seed=2)[0]
    out, lse = attention(q, k, v, return_lse=True, **kw)
    serial = attention_backward(q, k, v, out, lse, dout, block_q=32, block_k=48, workers=1, **kw)
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        parallel = attention_backward(q, k, v, out, lse, dout, block_q=32, block_k=48,
                                      workers=workers, **kw)
    for a, b in zip(serial, parallel):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("sq, kw", [(1, dict()), (1, dict(kv_lengths=[300, 7, 0])), (5, dict(causal=True)),
                                    (40, dict(window=(20, 3)))])
def test_head_blocks_are_bit_identical_to_serial(sq, kw, all_cpus):
    # Decode-like shapes put many heads in one unit and split them into several units
    # (at least `_MIN_UNITS`); GQA heads share a kv head across units.
    q, k, v = random_qkv(sq, 300, 16, batch=(3,), heads=8, kv_heads=2, seed=3)
    serial = attention(q, k, v, block_k=64, return_lse=True, return_stats=True, workers=1, **kw)
    for workers in (2, 5, None):
        parallel = attention(q, k, v, block_k=64, return_lse=True, return_stats=True,
                             workers=workers, **kw)
        for a, b in zip(serial[:2], parallel[:2]):
            assert a.tobytes() == b.tobytes()
        np.testing.assert_array_equal(serial[2].rescales, parallel[2].rescales)


@pytest.mark.parametrize("lead, rows, keys, n_q_tiles", [
    ((1, 1, 1), 256, 256, 16), ((2, 8, 1), 256, 256, 4), ((3, 2, 4), 1, 300, 1),
    ((4, 32, 1), 1, 4096, 1), ((2, 2, 16), 256, 256, 1), ((), 7, 7, 1), ((5,), 64, 64, 2)])
def test_work_units_cover_every_head_once(lead, rows, keys, n_q_tiles):
    units = work_units(lead, rows, keys, n_q_tiles)
    seen = np.zeros(lead, dtype=int)
    for u in units:
        seen[u] += 1
        heads = seen[u].size
        assert heads == 1 or heads * 8 * rows * keys <= _UNIT_BYTES  # within the byte budget
    assert (seen == 1).all()
    smallest = -(-_UNIT_BYTES // (8 * 8 * rows * keys))  # heads of the smallest worthwhile tile
    if np.prod(lead) * n_q_tiles >= _MIN_UNITS and np.prod(lead) > smallest:
        # Enough units for the threads, unless that would leave too little work in each.
        assert len(units) * n_q_tiles >= _MIN_UNITS or max(seen[u].size for u in units) >= smallest


def test_default_is_every_available_cpu_and_bit_identical(all_cpus):
    assert validate.workers(None) == validate.workers(-1) == validate.available_cpus() >= 1
    q, k, v = random_qkv(200, 200, 16, heads=3, seed=0)
    for fn in (lambda **w: attention(q, k, v, causal=True, block_q=32, **w),
               lambda **w: attention_stream(q, ((k[..., i:i + 64, :], v[..., i:i + 64, :])
                                                for i in range(0, 200, 64)), causal=True, total_keys=200,
                                            block_q=32, **w)):
        assert fn().tobytes() == fn(workers=1).tobytes()


def test_blas_is_held_to_one_thread_even_with_one_worker():
    # A multithreaded BLAS on tile-sized matmuls only costs: under load it was 25x slower.
    import threadpoolctl

    seen = []
    real = tiles.absorb

    def absorb(*args, **kwargs):
        seen.append({i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"})
        return real(*args, **kwargs)

    q, k, v = random_qkv(64, 64, 8, seed=0)
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"), hooks.replaced(absorb=absorb):
        for workers in (1, 2):
            attention(q, k, v, block_q=16, workers=workers)
    assert seen and all(s == {1} for s in seen)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_workers(bad):
    q, k, v = random_qkv(10, 10, 4, seed=0)
    with pytest.raises(ValueError, match="workers must be a positive integer, -1 or None"):
        attention(q, k, v, workers=bad)
    with pytest.raises(ValueError, match="workers must be a positive integer, -1 or None"):
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
    turns = Turns(np.array([[0, 1]]), threaded=True)

    def key_tile(b):
        try:
            if b == 0:
                raise ZeroDivisionError("tile 0")
            with turns.turn((), 0, b):
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
        with turns.turn((), 0, 1):
            pass


def test_benchmark_machinery_runs():
    rates = bench.tile_rates(workers=2, d=16, seconds=0.01, repeats=1)
    assert rates["qk_gflops"] > 0 and rates["pv_gflops"] > 0 and rates["exp_gps"] > 0
    impls = bench.implementations(workers=(1, 2), include_torch=False)
    assert set(impls) == {"attnlib", "attnlib w=1", "attnlib w=2", "dense numpy"}
    case = bench.BenchCase(1, 2, 256, d=16)
    rows = bench.time_cases([case], impls, repeats=1)
    assert rows[0]["case"] == "(1, 2, 256, 16) causal" and all(rows[0][n] > 0 for n in impls)
    # Two heads, n (n + 1) / 2 visible pairs each, two matmuls of 2 d flops per pair.
    assert case.pairs == 2 * 256 * 257 / 2 and case.flops == case.pairs * 4 * 16
    assert bench.BenchCase(1, 1, 8, causal=False).pairs == 64
    assert bench.roofline_seconds(case, rates) > 0
    backward = bench.backward_implementations(workers=(1,), include_torch=False)
    rows = bench.time_cases([case], backward, repeats=1)
    assert set(backward) == {"attnlib", "attnlib w=1", "dense numpy"}
    assert all(rows[0][n] > 0 for n in backward)
    sweep = bench.tile_sweep(bench.BenchCase(1, 1, 256), sizes=(32, 64), repeats=1)
    assert np.array(sweep["seconds"]).shape == (2, 2)


def test_phase_breakdown_accounts_for_the_measured_time():
    result = bench.phase_breakdown(bench.BenchCase(1, 2, 512, d=16), repeats=1)
    names = [p["phase"] for p in result["phases"]]
    assert names[:-1] == list(bench.phases.PHASES) and names[-1].startswith("rest")
    assert result["tiles"] == {"FULL": 2 * 1, "PARTIAL": 2 * 2}  # 256-tiles of a causal 512
    # The phases and the rest add up to the measured serial time, by construction.
    assert sum(p["seconds"] for p in result["phases"]) == pytest.approx(result["measured_serial"])
    assert all(p["seconds"] > 0 for p in result["phases"][:-1] if p["phase"] != "mask (PARTIAL tiles)")


def test_mask_cases_match_attnlib_and_torch_masks():
    # The explicit masks given to torch are built from the contract's rules, independently of
    # attnlib's tile classes: attnlib with its options equals the dense reference under them.
    for case in bench.mask_cases(96, decode_batch=3):
        q, k, v = bench.masks._inputs(case)
        vis = case.visible()
        assert vis.shape == (case.b, 1, case.sq, case.sk) and vis.any()
        out = attention(q, k, v, **case.options)
        g = case.hq // case.hk
        kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.where(vis, q @ np.swapaxes(kk, -1, -2) / np.sqrt(case.d), -np.inf)
        seen = vis.any(axis=-1, keepdims=True)
        p = np.exp(s - np.where(seen, s.max(axis=-1, keepdims=True), 0.0))
        dense = np.where(seen, p @ vv / np.where(seen, p.sum(axis=-1, keepdims=True), 1.0), 0.0)
        np.testing.assert_allclose(out, dense, rtol=0, atol=1e-13)
    rows = bench.time_masks(bench.mask_cases(64, decode_batch=2), repeats=1, include_torch=False)
    assert [r["case"] for r in rows] == [c.name for c in bench.mask_cases(64)] and all(r["attnlib"] > 0 for r in rows)
    # The case's dense / visible pairs, counted: a causal window of 256 over 64 keys is causal.
    assert rows[0]["dense / visible pairs"] == 64 * 64 / (64 * 65 / 2)


def test_load_benchmark_runs():
    result = bench.under_load(bench.BenchCase(1, 1, 128), repeats=1, settle=0.0)
    assert result["quiet"] > 0 and result["loaded"] > 0 and result["slowdown"] > 0


def test_entries_with_masks_of_their_own_share_the_threads_buffers():
    # Padding gives every batch entry its own plan; their units run on one pool, and each
    # thread keeps one set of tile buffers for all of them (not one per entry and thread).
    import tracemalloc

    peaks = {}
    for b in (4, 32):
        q, k, v = random_qkv(256, d=64, batch=(b,), heads=8, seed=0)
        attention(q, k, v, kv_lengths=np.full(b, 200), workers=2)
        tracemalloc.start()
        out = attention(q, k, v, kv_lengths=np.full(b, 200), workers=2)
        peaks[b] = tracemalloc.get_traced_memory()[1] - out.nbytes
        tracemalloc.stop()
    # 28 more entries: a few kilobytes of plan each, not a tile's megabyte per thread.
    assert peaks[32] - peaks[4] < 28 * 64 * 1024, peaks


def test_a_view_with_the_same_start_and_size_is_not_mistaken_for_another():
    # X[:4] and X[::2] start at the same address and hold as many numbers: the max|x| that
    # check_finite keeps for the overflow bound must not pass from one to the other.
    X = np.ones((8, 4))
    X[1] = 1e150
    k = np.ones((4, 4))
    k[3] = 1e158
    with pytest.raises(ValueError, match="scores overflow"):
        attention(X[:4], k, X[::2], workers=1)
