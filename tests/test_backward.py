"""Gradients: the dense reference against finite differences, the tiled backward against it."""

import numpy as np
import pytest

import attnlib
from attnlib import (BOUND, attention, attention_backward, attention_vjp, gradient_errors, random_qkv,
                     reference_attention, reference_attention_backward, reference_scores)
from attnlib.evidence.memory import CAP_BYTES, peak_memory

EPS = np.finfo(np.float64).eps

FEATURES = [
    dict(),
    dict(causal=True),
    dict(causal=True, causal_align="top_left"),
    dict(window=(1, 2)),
    dict(causal=True, softcap=2.0),
    dict(alibi_slopes=[0.3, 0.7]),
    dict(kv_lengths=[3], q_lengths=[2], causal=True),
    dict(q_segment_ids=[[0, 0, 1]], kv_segment_ids=[[0, 1, 1, 1]], softcap=3.0, alibi_slopes=[0.2, 0.5]),
]


def loss(q, k, v, dout, **kw):
    return float(np.sum(reference_attention(q, k, v, **kw) * dout))


@pytest.mark.parametrize("kw", FEATURES)
def test_dense_gradient_matches_central_differences(kw):
    # 1 batch entry, 2 query heads sharing 1 kv head (GQA), Sq = 3, Sk = 4, D = 3, Dv = 2.
    q, k, v = random_qkv(3, 4, 3, 2, batch=(1,), heads=2, kv_heads=1, seed=5)
    dout = np.random.default_rng(6).standard_normal((1, 2, 3, 2))
    grads = reference_attention_backward(q, k, v, dout, **kw)
    h = 1e-6
    for x, g in zip((q, k, v), grads):
        fd = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            orig = x[idx]
            x[idx] = orig + h
            up = loss(q, k, v, dout, **kw)
            x[idx] = orig - h
            down = loss(q, k, v, dout, **kw)
            x[idx] = orig
            fd[idx] = (up - down) / (2 * h)
        scale = max(np.abs(g).max(), 1e-3)
        # Central differences err by h**2 times the third derivative (~1e-12) plus the loss's
        # rounding over h, eps * |loss| / h (~1e-9): measured at most 1.9e-9 here, so 1e-8
        # (1e-6 would pass a gradient wrong by 1e-7 relative).
        assert np.abs(fd - g).max() / scale < 1e-8, (kw, np.abs(fd - g).max())


def largest_logit(q, k, **kw):
    """``max(1, max |s|)`` over the visible scores: float64 rounds each logit by about
    ``eps * |s|``, which moves its softmax weight by as much, relatively."""
    s = reference_scores(q, k, **kw)
    visible = np.abs(s[np.isfinite(s)])
    return max(1.0, float(visible.max())) if visible.size else 1.0


def run_backward(q, k, v, dout, block_q=32, block_k=48, **kw):
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        out, lse = attention(q, k, v, return_lse=True, **kw)
        grads = attention_backward(q, k, v, out, lse, dout, block_q=block_q, block_k=block_k, **kw)
        errors = gradient_errors(grads, q, k, v, dout, **kw)
    worst = max(errors["dq"], errors["dk"], errors["dv"])
    assert worst < BOUND, (kw, errors)
    # BOUND is the contract; float64 rounding justifies far less, a few eps per unit of the
    # largest logit (measured: at most 2.4 eps * max|s| over this file), so a gradient wrong
    # by 1e-12 relative, which BOUND lets through, fails here.
    assert worst < 32 * EPS * largest_logit(q, k, **kw), (kw, errors)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == np.float64
    return grads, errors


@pytest.mark.slow
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("sq, sk", [(130, 130), (70, 200), (200, 70)])
def test_tiled_gradients_match_dense(align, sq, sk):
    rng = np.random.default_rng(sq + sk)
    q, k, v = random_qkv(sq, sk, 16, 24, batch=(2,), heads=4, kv_heads=2, seed=sq)
    dout = rng.standard_normal((2, 4, sq, 24))
    slopes = 2.0 ** -np.arange(1, 5)
    for kw in (dict(), dict(causal=True), dict(causal=True, window=(40, None)), dict(window=(10, 30)),
               dict(causal=True, kv_lengths=[sk, 0], q_lengths=[sq // 2, sq]),
               dict(softcap=5.0), dict(causal=True, alibi_slopes=slopes),
               dict(q_segment_ids=np.sort(rng.integers(0, 3, (2, sq))),
                    kv_segment_ids=np.sort(rng.integers(0, 3, (2, sk))), causal=True)):
        run_backward(q, k, v, dout, causal_align=align, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("case", attnlib.random_cases(12, seed=5, max_len=1024), ids=str)
def test_tiled_gradients_random_shapes(case):
    q, k, v = case.qkv()
    dout = np.random.default_rng(case.seed).standard_normal(q.shape[:-1] + (case.dv,))
    run_backward(q, k, v, dout, **case.mask_kwargs(), **case.tile_kwargs())


def test_mqa_and_two_dimensional_inputs():
    q, k, v = random_qkv(50, 60, 8, 5, heads=4, kv_heads=1, seed=2)
    run_backward(q, k, v, np.ones((4, 50, 5)), causal=True)
    q2, k2, v2 = random_qkv(50, 60, 8, 5, seed=3)
    (dq, dk, dv), _ = run_backward(q2, k2, v2, np.ones((50, 5)), causal=True)
    assert dq.shape == (50, 8) and dk.shape == (60, 8) and dv.shape == (60, 5)


def test_rows_and_entries_without_keys_have_zero_gradients(strict):
    q, k, v = random_qkv(20, 6, 8, batch=(2,), heads=2, seed=4)
    dout = np.ones((2, 2, 20, 8))
    kw = dict(causal=True, kv_lengths=[6, 0])  # bottom_right: rows < 14 of entry 0 see nothing
    out, lse = attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv = attention_backward(q, k, v, out, lse, dout, block_q=8, block_k=4, **kw)
    assert np.all(dq[1] == 0) and np.all(dk[1] == 0) and np.all(dv[1] == 0)
    assert np.all(dq[0, :, :14] == 0)
    ref = reference_attention_backward(q, k, v, dout, **kw)
    assert np.all(ref[0][1] == 0) and np.all(ref[0][0, :, :14] == 0)
    assert np.all(ref[1][1] == 0) and np.all(ref[2][1] == 0)


@pytest.mark.slow
def test_adversarial_gradients(strict):
    for family in attnlib.FAMILIES:
        q, k, v = attnlib.adversarial_qkv(family, 2048, d=64, block_k=64, seed=0)
        dout = np.random.default_rng(1).standard_normal((2048, 64))
        _, errors = run_backward(q, k, v, dout, block_q=64, block_k=64, causal=True)
        if family == "growing":
            # One key takes all the weight (the others are exp(-156) smaller): dp - D cancels,
            # the true dq is ~1e-119, and the normwise ratio is rounding noise over ~0; the
            # componentwise error, against what each entry sums, is not fooled.
            assert errors["dq_normwise"] > 1.0 > BOUND > errors["dq"]


def test_gradient_sizes_bound_the_gradients():
    q, k, v = random_qkv(30, 40, 8, heads=2, seed=9)
    dout = np.random.default_rng(10).standard_normal((2, 30, 8))
    grads, sizes = reference_attention_backward(q, k, v, dout, causal=True, softcap=3.0, return_abs=True)
    for g, a in zip(grads, sizes):
        assert g.shape == a.shape and np.all(np.abs(g) <= a + 1e-15)


def test_vjp_is_forward_then_backward():
    q, k, v = random_qkv(40, 50, 8, seed=7)
    dout = np.random.default_rng(8).standard_normal((40, 8))
    out, grads = attention_vjp(q, k, v, dout, causal=True, window=(10, None), block_q=16, block_k=16)
    o2, lse = attention(q, k, v, causal=True, window=(10, None), block_q=16, block_k=16, return_lse=True)
    np.testing.assert_array_equal(out, o2)
    for a, b in zip(grads, attention_backward(q, k, v, o2, lse, dout, causal=True, window=(10, None),
                                              block_q=16, block_k=16)):
        np.testing.assert_array_equal(a, b)


def test_backward_validation():
    q, k, v = random_qkv(5, 6, 4, heads=2, seed=0)
    out, lse = attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"dout must have shape \(2, 5, 4\), got \(2, 5, 3\)"):
        attention_backward(q, k, v, out, lse, np.ones((2, 5, 3)))
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 5\)"):
        attention_backward(q, k, v, out, lse[:, :4], out)
    bad = lse.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="lse must be finite or -inf"):
        attention_backward(q, k, v, out, bad, out)
    with pytest.raises(ValueError, match="dout contains NaN"):
        attention_backward(q, k, v, out, lse, np.full(out.shape, np.inf))
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['kv_splits'\]"):
        attention_backward(q, k, v, out, lse, out, kv_splits=2)
    with pytest.raises(ValueError, match="dout must have shape"):
        reference_attention_backward(q, k, v, np.ones((5, 4)))


@pytest.mark.slow
def test_backward_memory_under_the_cap_that_dense_exceeds():
    tiled = peak_memory("tiled_backward", 4096, d=64, causal=True)
    dense = peak_memory("dense_backward", 4096, d=64, causal=True)
    assert tiled["working_bytes"] < CAP_BYTES < dense["working_bytes"]
    assert tiled["output_bytes"] == 3 * 4096 * 64 * 8  # dq, dk, dv


def test_low_precision_out_and_dout_are_read_exactly():
    """D = rowsum(dout * out) is summed in float64 whatever the inputs' type (it was summed in
    float32 for float32 out and dout: 1.6e-8 relative error in dq, found in issue 45)."""
    q, k, v = attnlib.random_qkv(300, 300, 64, seed=0)
    out, lse = attnlib.attention(q, k, v, return_lse=True)
    dout = attnlib.random_qkv(300, 1, 64, seed=1)[0]
    o32, d32 = out.astype(np.float32), dout.astype(np.float32)
    want = attnlib.attention_backward(q, k, v, o32.astype(np.float64), lse, d32.astype(np.float64))
    got = attnlib.attention_backward(q, k, v, o32, lse, d32)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
