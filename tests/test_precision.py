"""Low compute precisions: rounded inputs and weights, float32 state; FlashAttention's test rule."""

import numpy as np
import pytest

from attnlib import attention, oracle_attention, random_qkv, reference_attention
from attnlib.core.problem import precision

DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window=(40, None), softcap=20.0)])
@pytest.mark.parametrize("n, logit_scale", [(200, 1.0), (600, 3.0)])
def test_flash_attention_rule(dtype, kw, n, logit_scale, strict):
    # max|tiled - oracle| <= 2 * max|naive same-precision dense - oracle| + eps(dtype)
    q, k, v = random_qkv(n, n, 64, batch=(1,), heads=2, seed=n)
    q, k = q * np.sqrt(logit_scale), k * np.sqrt(logit_scale)
    oracle = oracle_attention(q, k, v, **kw)
    tiled = attention(q, k, v, compute_dtype=dtype, block_q=64, block_k=64, **kw)
    naive = reference_attention(q, k, v, compute_dtype=dtype, **kw)
    prec = precision(dtype)
    assert tiled.dtype == naive.dtype == prec.compute
    tiled_err = float(np.abs(tiled.astype(np.float64) - oracle).max())
    naive_err = float(np.abs(naive.astype(np.float64) - oracle).max())
    assert tiled_err <= 2 * naive_err + prec.eps, (tiled_err, naive_err)
    # The precision really was lowered in both: most entries differ from the correctly
    # rounded result (measured: at least 55%), as a float64 computation cast to the dtype at
    # the end would not (nor would it fail "naive_err > 10 float64 eps", the old check).
    rounded = oracle.astype(prec.compute)
    assert np.mean(naive != rounded) > 0.25 and np.mean(tiled != rounded) > 0.25


def test_float32_state_and_lse():
    q, k, v = random_qkv(100, 120, 16, seed=3)
    out, lse, stats = attention(q, k, v, causal=True, compute_dtype="float16", return_lse=True,
                                return_stats=True, block_q=32, block_k=32)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref_lse = reference_attention(q, k, v, causal=True, return_lse=True)[1]
    # q and k rounded to float16 move the logits, hence lse, by about eps16 * |s| (measured:
    # 3.2e-4 = 0.33 eps16 here); rtol=1e-2 (~0.05 absolute) passed a bfloat16-rounded lse.
    eps16 = float(np.finfo(np.float16).eps)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=2 * eps16)
    assert stats.total_rescales > 0


def test_float64_compute_dtype_is_the_default():
    q, k, v = random_qkv(50, 60, 8, seed=4)
    a = attention(q, k, v, causal=True)
    assert a.tobytes() == attention(q, k, v, causal=True, compute_dtype="float64").tobytes()
    assert a.tobytes() == attention(q, k, v, causal=True, compute_dtype=np.float64).tobytes()


def test_bad_compute_dtype():
    q, k, v = random_qkv(5, 5, 4, seed=0)
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        attention(q, k, v, compute_dtype="int8")
