"""The extended-precision oracle: agrees with float64 where float64 is exact enough, not where it is not."""

import numpy as np
import pytest

import attnlib
from attnlib import ORACLE_PRECISION, adversarial_qkv, attention, oracle_attention, random_qkv, reference_attention

EPS = np.finfo(np.float64).eps


def test_precision_is_reported():
    assert ORACLE_PRECISION["mantissa_bits"] >= 64
    assert oracle_attention(*random_qkv(3, 4, 2, seed=0)).dtype == np.longdouble


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
        assert 100 * EPS < err < 1e4 * 1e4 * EPS  # far above eps, within eps * |logit|
    # On ordinary logits the same inputs' structure gives float64 results within a few eps.
    q2, k2, v2 = random_qkv(256, d=64, seed=2)
    assert float(np.abs(reference_attention(q2, k2, v2, causal=True)
                     - oracle_attention(q2, k2, v2, causal=True)).max()) < 20 * EPS
