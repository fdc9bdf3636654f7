"""Edge cases of issue 13: concurrency of process-wide settings, empty gradients, huge
windows, lazy rescaling in low precision, overflowing scores and unclear errors."""

import sys
import threading

import numpy as np
import pytest

import attnlib
from attnlib.core import parallel
from attnlib.core import problem
from attnlib.core.backward import attention_backward, attention_vjp, reference_attention_backward

import threadpoolctl


def _blas_threads():
    return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]


# -- 1. process-wide settings under concurrency ------------------------------------------------


def _overlapping_calls():
    """A enters the guard, then B, then A leaves first: the order that leaked."""
    b_in, a_out = threading.Event(), threading.Event()
    errors = []

    def a_tile(_):
        assert b_in.wait(10)

    def b_tile(_):
        b_in.set()
        assert a_out.wait(10)

    def run(fn, after=None):
        try:
            parallel.run_tiles(fn, range(2), 2)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        if after is not None:
            after.set()

    threads = [threading.Thread(target=run, args=(a_tile, a_out))]
    threads[0].start()
    threads.append(threading.Thread(target=run, args=(b_tile,)))
    threads[1].start()
    for t in threads:
        t.join(20)
    assert not errors and not any(t.is_alive() for t in threads)


def test_overlapping_parallel_calls_restore_process_settings():
    old_interval = sys.getswitchinterval()
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        blas = _blas_threads()
        sys.setswitchinterval(0.004)
        try:
            _overlapping_calls()
            assert sys.getswitchinterval() == pytest.approx(0.004)
            assert _blas_threads() == blas
        finally:
            sys.setswitchinterval(old_interval)


def test_many_threads_running_parallel_attention_restore_process_settings():
    q, k, v = attnlib.random_qkv(256, 256, 16, seed=0)
    expected = attnlib.attention(q, k, v, block_q=32, block_k=32)
    old_interval = sys.getswitchinterval()
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        blas = _blas_threads()
        sys.setswitchinterval(0.004)
        start = threading.Barrier(4)
        results, errors = [], []

        def call():
            try:
                start.wait(10)
                for _ in range(3):
                    results.append(attnlib.attention(q, k, v, block_q=32, block_k=32, workers=2))
            except BaseException as e:  # pragma: no cover
                errors.append(e)

        threads = [threading.Thread(target=call) for _ in range(4)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors and len(results) == 12
            assert all(r.tobytes() == expected.tobytes() for r in results)
            assert sys.getswitchinterval() == pytest.approx(0.004)
            assert _blas_threads() == blas
        finally:
            sys.setswitchinterval(old_interval)


def test_guard_applies_settings_while_held():
    old_interval = sys.getswitchinterval()
    with parallel._parallel_settings():
        assert sys.getswitchinterval() <= 1e-5
        with parallel._parallel_settings():  # nested: still applied
            assert sys.getswitchinterval() <= 1e-5
        assert sys.getswitchinterval() <= 1e-5
    assert sys.getswitchinterval() == old_interval


# -- 2. gradients with no query or no key --------------------------------------------------------


@pytest.mark.parametrize("shape_q, shape_k", [
    ((0, 4), (7, 4)), ((7, 4), (0, 4)), ((0, 4), (0, 4)),
    ((2, 3, 0, 4), (2, 1, 5, 4)), ((2, 2, 6, 4), (2, 1, 0, 4)),
])
def test_backward_with_empty_sequences(shape_q, shape_k, strict):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal(shape_q), rng.standard_normal(shape_k)
    v = rng.standard_normal(shape_k[:-1] + (3,))
    dout = rng.standard_normal(shape_q[:-1] + (3,))
    out, lse = attnlib.attention(q, k, v, return_lse=True, causal=True)
    dq, dk, dv = attention_backward(q, k, v, out, lse, dout, causal=True, workers=2)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    # No query means no loss through k and v; no key means no path to q.
    for g in (dq, dk, dv):
        assert g.dtype == np.float64 and not g.any()
    out2, grads = attention_vjp(q, k, v, dout, causal=True)
    assert out2.shape == out.shape
    for g, ref in zip(grads, reference_attention_backward(q, k, v, dout, causal=True)):
        assert g.shape == ref.shape and not g.any()


# -- 3. huge windows ----------------------------------------------------------------------------


@pytest.mark.parametrize("window", [(None, sys.maxsize), (sys.maxsize, None), (10**30, None),
                                    (None, 10**30), (10**30, 2**63), (np.int64(2**63 - 1), None),
                                    (np.uint64(2**64 - 1), np.uint64(2**64 - 1))])
def test_huge_window_equals_no_window(window, strict):
    q, k, v = attnlib.random_qkv(37, 53, 8, seed=1)
    for causal in (False, True):
        plain = attnlib.attention(q, k, v, causal=causal, block_q=16, block_k=16)
        wide = attnlib.attention(q, k, v, causal=causal, window=window, block_q=16, block_k=16)
        np.testing.assert_array_equal(wide, plain)
        np.testing.assert_array_equal(
            attnlib.reference_attention(q, k, v, causal=causal, window=window),
            attnlib.reference_attention(q, k, v, causal=causal))
    chunks = [(k[:20], v[:20]), (k[20:], v[20:])]
    np.testing.assert_allclose(
        attnlib.attention_stream(q, chunks, window=window, total_keys=53),
        attnlib.attention(q, k, v), rtol=0, atol=1e-13)


@pytest.mark.parametrize("window", [(-1, None), (None, -(10**30)), (-sys.maxsize, 3)])
def test_negative_window_is_refused(window):
    q, k, v = attnlib.random_qkv(4, 5, 8, seed=1)
    with pytest.raises(ValueError, match="window (left|right) must be a non-negative integer"):
        attnlib.attention(q, k, v, window=window)


# -- 4. lazy rescaling in low precision ---------------------------------------------------------


@pytest.mark.parametrize("dtype, tau", [("float32", 100.0), ("bfloat16", 100.0), ("float32", 88.0),
                                        ("float16", 12.0), ("float16", 100.0)])
def test_lazy_rescaling_in_low_precision_does_not_overflow(dtype, tau, strict):
    pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(2)
    # Rising scores: each key tile's max is far above the last, so a stale max stays far below.
    q = np.ones((1, 8, 4))
    k = np.tile(np.linspace(0, 40, 256)[:, None], (1, 4))[None]
    v = rng.standard_normal((1, 256, 4))
    eager = attnlib.attention(q, k, v, block_k=16, compute_dtype=dtype, scale=1.0)
    lazy = attnlib.attention(q, k, v, block_k=16, compute_dtype=dtype, scale=1.0,
                             rescale_threshold=tau)
    assert np.isfinite(lazy.astype(np.float64)).all()
    ref = attnlib.reference_attention(q, k, v, scale=1.0)
    eps = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 5e-3}[dtype]
    np.testing.assert_allclose(lazy.astype(np.float64), ref, atol=20 * eps)
    np.testing.assert_allclose(eager.astype(np.float64), ref, atol=20 * eps)


@pytest.mark.parametrize("dtype, tau, plateau, v_scale", [
    ("float32", 100.0, 85.0, 1e3),  # 4032 weights e^85 * 1e3: l and acc overflow float32
    ("float32", 100.0, 60.0, 1e20),  # e^60 * 1e20 * 4032 overflows acc only
    ("bfloat16", 100.0, 85.0, 1.0),
    ("float16", 12.0, 11.5, 1.0),  # p = e^11.5 ~ 98715 > 65504: inf once rounded
])
def test_lazy_rescaling_on_a_plateau_does_not_overflow(dtype, tau, plateau, v_scale, strict):
    pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    # The first key tile sets the max at 0; every later key scores `plateau`, within tau of
    # it, so a lazy row keeps the stale max and sums weights exp(plateau).
    q = np.zeros((2, 4))
    q[:, 0] = 1.0
    k = np.zeros((4096, 4))
    k[64:, 0] = plateau
    v = rng.standard_normal((4096, 2)) * v_scale
    kw = dict(compute_dtype=dtype, block_k=64, scale=1.0)
    out = attnlib.attention(q, k, v, rescale_threshold=tau, **kw).astype(np.float64)
    assert np.isfinite(out).all()
    eager = attnlib.attention(q, k, v, **kw).astype(np.float64)
    np.testing.assert_allclose(out, eager, rtol=0, atol=1e-2 * np.abs(eager).max())


def test_effective_threshold_is_bounded_by_precision():
    eff = problem.safe_threshold
    assert eff(100.0, "float64", n_keys=1000, v_max=1.0) == 100.0
    assert eff(100.0, "float32", n_keys=1000, v_max=1.0) < np.log(np.finfo(np.float32).max)
    assert eff(100.0, "float16", n_keys=1, v_max=1.0) < np.log(np.finfo(np.float16).max)
    assert eff(5.0, "float16", n_keys=1, v_max=1.0) == 5.0
    assert eff(0.0, "float32", n_keys=10**6, v_max=1e38) == 0.0
    assert eff(50.0, "float32", n_keys=10**6, v_max=1e38) == 0.0


# -- 5. scores that overflow --------------------------------------------------------------------


@pytest.mark.parametrize("errstate", ["strict", "default"])
@pytest.mark.parametrize("fn", ["attention", "reference_attention", "stream", "backward",
                                "reference_backward", "float32"])
def test_overflowing_scores_are_refused(fn, errstate):
    q, k, v = attnlib.random_qkv(9, 11, 8, seed=4)
    if fn == "float32":
        q, k = q * 1e25, k * 1e25
    else:
        q, k = q * 1e160, k * 1e160
    calls = {
        "attention": lambda: attnlib.attention(q, k, v, block_q=4, block_k=4),
        "float32": lambda: attnlib.attention(q, k, v, compute_dtype="float32"),
        "reference_attention": lambda: attnlib.reference_attention(q, k, v),
        "stream": lambda: attnlib.attention_stream(q, [(k, v)]),
        "backward": lambda: attention_backward(q, k, v, np.zeros((9, 8)), np.zeros(9),
                                               np.ones((9, 8))),
        "reference_backward": lambda: reference_attention_backward(q, k, v, np.ones((9, 8))),
    }
    state = dict(divide="raise", over="raise", invalid="raise") if errstate == "strict" else {}
    with np.errstate(**state), pytest.raises(ValueError, match=r"scores overflow.*\bq\b.*\bk\b"):
        calls[fn]()


def test_large_but_safe_inputs_still_work(strict):
    q, k, v = attnlib.random_qkv(9, 11, 8, seed=4)
    out = attnlib.attention(q * 1e150, k * 1e-150, v)
    np.testing.assert_allclose(out, attnlib.reference_attention(q * 1e150, k * 1e-150, v),
                               rtol=1e-12, atol=1e-14)


def test_overflow_only_where_masked_is_harmless(strict):
    # Key 10 overflows against every query, but a window hides it from all of them.
    q, k, v = attnlib.random_qkv(9, 11, 8, seed=4)
    q, k = q * 1e150, k.copy() * 1e-150
    k[10] = np.sign(q[0]) * 1e160
    kw = dict(window=(3, 0), causal_align="top_left")
    out = attnlib.attention(q, k, v, block_q=4, block_k=4, **kw)
    np.testing.assert_allclose(out, attnlib.reference_attention(q, k, v, **kw), rtol=1e-12, atol=1e-14)


def test_softcap_gradient_with_overflow_only_where_masked(strict):
    """The dense gradient's softcap derivative took tanh of every product, masked ones
    included: an overflow there raised FloatingPointError under strict mode."""
    q, k, v = attnlib.random_qkv(40, d=8, seed=0)
    q, k = q.copy(), k.copy()
    q[:3] *= 1e160  # rows 0-2 see keys 0-2 only (causal) ...
    k[30:] *= 1e160  # ... and these keys are hidden from them
    dout = np.ones((40, 8))
    dense = reference_attention_backward(q, k, v, dout, causal=True, softcap=30.0)
    out, lse = attnlib.attention(q, k, v, causal=True, softcap=30.0, return_lse=True)
    tiled_grads = attention_backward(q, k, v, out, lse, dout, causal=True, softcap=30.0)
    for a, b in zip(dense, tiled_grads):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12 * np.abs(a).max())


@pytest.mark.parametrize("fn", ["attention", "reference_attention", "reference_backward"])
@pytest.mark.parametrize("where", ["q", "v"])
def test_finite_inputs_beyond_float16_are_refused(fn, where, strict):
    """float64 values beyond 65504 round to inf in float16: NaN output before."""
    q, k, v = attnlib.random_qkv(9, 11, 8, seed=4)
    q, v = (q * 1e5, v) if where == "q" else (q, v * 1e5)
    calls = {
        "attention": lambda: attnlib.attention(q, k, v, compute_dtype="float16"),
        "reference_attention": lambda: attnlib.reference_attention(q, k, v, compute_dtype="float16"),
        "reference_backward": lambda: reference_attention_backward(q, k, v, np.ones((9, 8)),
                                                                   compute_dtype="float16"),
    }
    with pytest.raises(ValueError, match=rf"^{where} holds .*beyond float16's range"):
        calls[fn]()
    # bfloat16 has float32's range: the same values are fine there.
    assert np.isfinite(attnlib.attention(q, k, v, compute_dtype="bfloat16").astype(np.float64)).all()


def test_alibi_biases_beyond_range_are_refused(strict):
    q, k, v = attnlib.random_qkv(40, d=8, seed=0)
    with pytest.raises(ValueError, match=r"alibi_slopes up to 1e\+307"):
        attnlib.attention(q, k, v, alibi_slopes=[1e307])
    for fn in (attnlib.attention, attnlib.reference_attention):  # float32 keeps the scores
        with pytest.raises(ValueError, match="alibi_slopes.*float32"):
            fn(q, k, v, alibi_slopes=[1e37], compute_dtype="float32")
    assert np.isfinite(attnlib.attention(q, k, v, alibi_slopes=[1e30])).all()
    assert np.isfinite(attnlib.reference_attention(q, k, v, alibi_slopes=[1e37])).all()  # float64's range


# -- 6. clearer errors --------------------------------------------------------------------------


def test_bad_compute_dtype_message():
    q, k, v = attnlib.random_qkv(4, 5, 8, seed=1)
    for bad in (5, object(), "int8", np.int32):
        with pytest.raises((TypeError, ValueError),
                           match="compute_dtype must be one of None, 'float64', 'float32', "
                                 "'float16', 'bfloat16', 'float8_e4m3fn', got"):
            attnlib.attention(q, k, v, compute_dtype=bad)
    np.testing.assert_array_equal(attnlib.attention(q, k, v, compute_dtype=np.float32),
                                  attnlib.attention(q, k, v, compute_dtype="float32"))


def test_stream_needs_iterable_chunks():
    q = attnlib.random_qkv(4, 5, 8, seed=1)[0]
    for bad in (None, 3):
        with pytest.raises(TypeError, match="kv_chunks"):
            attnlib.attention_stream(q, bad)


@pytest.mark.parametrize("outs, lses", [
    (["a"], ["b"]), ([np.ones((2, 3))], ["b"]), ([np.ones((2, 3)) * 1j], [np.zeros(2)]),
    ([np.ones((2, 3))], [np.zeros(2, dtype=complex)]), ([np.ones((2, 3), dtype=int)], [np.zeros(2)]),
    ([None], [np.zeros(2)]),
])
def test_merge_attention_needs_real_floating_arrays(outs, lses):
    with pytest.raises(TypeError, match=r"(outs|lses)\[0\] must .*real floating"):
        attnlib.merge_attention(outs, lses)


def test_merge_attention_still_takes_lists_of_floats():
    out, lse = attnlib.merge_attention([[[1.0, 2.0]], [[3.0, 4.0]]], [[0.0], [0.0]])
    np.testing.assert_allclose(out, [[2.0, 3.0]])
    np.testing.assert_allclose(lse, [np.log(2.0)])


def test_bfloat16_inputs_are_accepted(strict):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in attnlib.random_qkv(6, 7, 8, seed=1))
    as64 = [x.astype(np.float64) for x in (q, k, v)]
    out = attnlib.attention(q, k, v)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, attnlib.attention(*as64))
    np.testing.assert_array_equal(attnlib.reference_attention(q, k, v),
                                  attnlib.reference_attention(*as64))
    np.testing.assert_array_equal(attnlib.attention_stream(q, [(k, v)]),
                                  attnlib.attention_stream(as64[0], [(as64[1], as64[2])]))
    bad = np.ones((6, 8), dtype=ml_dtypes.int4) if hasattr(ml_dtypes, "int4") else np.ones((6, 8), int)
    with pytest.raises(TypeError, match="q must have a real floating dtype"):
        attnlib.attention(bad, as64[1], as64[2])
