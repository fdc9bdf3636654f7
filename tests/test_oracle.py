"""The extended-precision oracle: agrees with float64 where float64 is exact enough, not where it is not."""

import numpy as np
import pytest

import attnlib
from attnlib import ORACLE_PRECISION, adversarial_qkv, attention, oracle_attention, random_qkv, reference_attention

EPS = np.finfo(np.float64).eps


def test_precision_is_reported():
    assert ORACLE_PRECISION["mantissa_bits"] >= 64
    expected = np.longdouble if ORACLE_PRECISION["method"] == "longdouble" else np.float64
    assert oracle_attention(*random_qkv(3, 4, 2, seed=0)).dtype == expected
    assert oracle_attention(*random_qkv(3, 4, 2, seed=0), method="decimal").dtype == np.float64


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(5, 3), softcap=4.0, alibi_slopes=[0.3, 0.1, 0.2, 0.05]),
                                dict(kv_lengths=[20, 0], causal=True, causal_align="top_left"),
                                dict(q_segment_ids=[[0] * 10 + [1] * 10] * 2, kv_segment_ids=[[0] * 5 + [2] * 20] * 2)])
def test_decimal_oracle_agrees_with_long_double(kw):
    # Two independent extended-precision computations: the decimal one is rounded once to
    # float64, so they agree to half an ulp of the result plus long double's own error.
    q, k, v = random_qkv(20, 25, 8, batch=(2,), heads=4, kv_heads=2, seed=1)
    dec, dec_lse = oracle_attention(q, k, v, method="decimal", return_lse=True, **kw)
    ld, ld_lse = oracle_attention(q, k, v, method="longdouble", return_lse=True, **kw)
    assert np.abs(dec - ld).max() <= EPS * np.maximum(1, np.abs(ld)).max()
    fin = np.isfinite(ld_lse)
    np.testing.assert_array_equal(np.isneginf(dec_lse), ~fin)
    assert np.abs(dec_lse[fin] - ld_lse[fin]).max() <= 2 * EPS * np.abs(ld_lse[fin]).max()
    assert not fin.all() or "kv_lengths" not in kw  # the empty batch entry is exercised


def test_decimal_oracle_where_float64_loses_digits():
    q, k, v = adversarial_qkv("negative", 64, d=16, block_k=16, seed=2)
    dec = oracle_attention(q, k, v, causal=True, method="decimal")
    ld = oracle_attention(q, k, v, causal=True, method="longdouble")
    dense = reference_attention(q, k, v, causal=True)
    # Long double (64 bits) rounds logits of 1e4 to ~1e-15 absolute: a few float64 eps.
    assert np.abs(dec - ld).max() < 20 * EPS
    assert np.abs(dense - dec).max() > 1000 * EPS


def test_oracle_refusals(monkeypatch):
    q, k, v = random_qkv(4, 4, 2, seed=0)
    with pytest.raises(ValueError, match="method must be"):
        oracle_attention(q, k, v, method="mpmath")
    big = random_qkv(128, 128, 512, seed=0)
    with pytest.raises(ValueError, match="exceeds its limit"):
        oracle_attention(*big, method="decimal")
    monkeypatch.setattr(attnlib.core.oracle, "_LONGDOUBLE_BITS", 53)
    with pytest.raises(ValueError, match="use method='decimal'"):
        oracle_attention(q, k, v, method="longdouble")


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(5, 3), softcap=4.0, alibi_slopes=[0.3, 0.1]),
                                dict(kv_lengths=[20, 0], causal=True, causal_align="top_left")])
def test_oracle_agrees_with_float64_on_ordinary_inputs(kw):
    q, k, v = random_qkv(40, 50, 16, batch=(2,), heads=2, seed=1)
    out, lse = oracle_attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = reference_attention(q, k, v, return_lse=True, **kw)
    assert float(np.abs(ref - out).max()) < 20 * EPS
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~fin)
    assert float(np.abs(ref_lse[fin] - lse[fin]).max()) < 20 * EPS * max(1, np.abs(ref_lse[fin]).max())


def test_float64_loses_digits_where_the_oracle_does_not():
    # Logits near -1e4 with O(1) spread: float64 rounds each score to ~1.8e-12 absolute,
    # which moves the softmax weights by that much relatively; long double does not.
    q, k, v = adversarial_qkv("negative", 256, d=64, block_k=64, seed=2)
    oracle = oracle_attention(q, k, v, causal=True)
    dense = reference_attention(q, k, v, causal=True)
    tiled = attention(q, k, v, causal=True, block_q=64, block_k=64)
    for float64_result in (dense, tiled):
        err = float(np.abs(float64_result - oracle).max())
        # Far above eps, and within a few eps * |logit| (1e4) times the values (measured:
        # 0.87 eps * 1e4 * max|v|; the old upper bound, eps * 1e8, was 1e4 times looser).
        assert 100 * EPS < err < 8 * EPS * 1e4 * np.abs(v).max()
    # On ordinary logits the same inputs' structure gives float64 results within a few eps.
    q2, k2, v2 = random_qkv(256, d=64, seed=2)
    assert float(np.abs(reference_attention(q2, k2, v2, causal=True)
                     - oracle_attention(q2, k2, v2, causal=True)).max()) < 20 * EPS
