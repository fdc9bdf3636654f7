"""Lazy rescaling (FlashAttention-4): a stale max until the row max grows by more than tau."""

import numpy as np
import pytest

import attnlib
from attnlib import (BOUND, FAMILIES, OnlineSoftmax, adversarial_qkv, attention, attention_errors,
                     random_qkv, reference_rescales, reference_scores, reference_with_abs, rel_error)

EPS = np.finfo(np.float64).eps


@pytest.mark.slow
@pytest.mark.parametrize("tau", [0.0, 1.0, 8.0, 20.0])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window=(100, None), softcap=30.0)])
def test_lazy_equals_eager(tau, kw, strict):
    q, k, v = random_qkv(600, 700, 32, batch=(2,), heads=2, seed=int(tau))
    q, k = 3 * q, 3 * k  # logits of order 10: many candidate maxima per row
    eager, eager_lse = attention(q, k, v, block_q=64, block_k=32, return_lse=True, **kw)
    lazy, lazy_lse, stats = attention(q, k, v, block_q=64, block_k=32, rescale_threshold=tau,
                                      return_lse=True, return_stats=True, **kw)
    # Against the dense reference: logits of order 10 put float64's own rounding at ~100 eps
    # (measured: at most 126 eps, lazy or eager alike).
    assert attention_errors(lazy, q, k, v, **kw).rel_error < 1e-13
    # Lazy differs from eager only in the reference point of its exponents, so only in the
    # last bits (measured: at most 4.6 eps * max|v| for out, 1.1 eps for lse).
    np.testing.assert_allclose(lazy, eager, rtol=0, atol=32 * EPS * np.abs(v).max())
    np.testing.assert_allclose(lazy_lse, eager_lse, rtol=8 * EPS)
    # The kernel's applied rescales equal an independent count with the same threshold.
    s = reference_scores(q, k, **kw)
    np.testing.assert_array_equal(stats.rescales, reference_rescales(s, 64, 32, threshold=tau))


@pytest.mark.slow
def test_lazy_rescales_less_on_random_inputs():
    q, k, v = random_qkv(2048, d=64, seed=0)
    counts = {tau: attention(q, k, v, causal=True, block_q=64, block_k=64, rescale_threshold=tau,
                             return_stats=True)[1].total_rescales for tau in (0.0, 1.0, 8.0)}
    assert counts[0.0] > counts[1.0] > counts[8.0]
    assert counts[8.0] == 0  # scaled normal logits never grow by e^8 after the first tile


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tau", [8.0, 20.0, 100.0])
def test_lazy_rescaling_is_safe_on_adversarial_families(family, tau, strict):
    q, k, v = adversarial_qkv(family, 1024, d=64, block_k=64, seed=0)
    out, stats = attention(q, k, v, causal=True, block_q=64, block_k=64, rescale_threshold=tau,
                           return_stats=True)
    ref, ref_abs = reference_with_abs(q, k, v, causal=True)
    assert rel_error(out, ref, ref_abs) < BOUND
    # Against the eager kernel on the same tiles (the same logits, bit for bit), a stale max
    # changes only the last bits: measured 0 where one key takes all the weight, at most
    # 2.4 eps where it is spread; BOUND alone would pass a lazy path wrong by 1e-10.
    eager = attention(q, k, v, causal=True, block_q=64, block_k=64)
    assert rel_error(out, eager, ref_abs) < 16 * EPS
    if family == "growing":  # each tile's max grows by 1e4 / 16 = 625 > tau: every one applied
        assert stats.total_rescales == attnlib.max_rescales(1024, 1024, 64, 64, causal=True).sum()


def test_stale_max_weights_are_bounded():
    st = OnlineSoftmax.empty((1,), 1)
    st.update(np.array([[0.0, 1.0]]), np.ones((2, 1)), threshold=8.0)
    assert st.m[0] == 1.0
    st.update(np.array([[8.5]]), np.ones((1, 1)), threshold=8.0)  # 8.5 - 1 < 8: stale max kept
    assert st.m[0] == 1.0 and st.l[0] == pytest.approx(1 + np.exp(-1) + np.exp(7.5))
    assert st.update(np.array([[9.5]]), np.ones((1, 1)), threshold=8.0)[0]  # 8.5 > 8: moved
    assert st.m[0] == 9.5


@pytest.mark.parametrize("bad, exc", [(-1.0, ValueError), (101.0, ValueError), (float("nan"), ValueError),
                                      ("8", TypeError)])
def test_bad_threshold(bad, exc):
    q, k, v = random_qkv(10, 10, 4, seed=0)
    with pytest.raises(exc, match="rescale_threshold must be"):
        attention(q, k, v, rescale_threshold=bad)
