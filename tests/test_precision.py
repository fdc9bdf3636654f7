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


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_rounding_by_bits_is_the_cast_bit_for_bit(name):
    """`Precision.round` of float32 to bfloat16 and float16 works on the bits (a third of the casts'
    time; numpy's float16 cast took 50 ns an entry on softmax weights among its subnormals): the
    casts' results, NaN as NaN, no floating-point flag raised.  Every float32 was checked once (a
    ten-minute run); here the boundaries of each range, signs, zeros, infinities, NaNs (signalling
    ones among small values in one slice), and a random draw of bit patterns."""
    rng = np.random.default_rng(11)
    edges = [np.float32(x).view(np.uint32) for x in (65504.0, 65520.0, 65536.0, 2.0 ** -14, 2.0 ** -24,
                                                       2.0 ** -25, 3.3895314e38, 2.0 ** -126, 2.0 ** -133)]
    near = np.concatenate([(np.int64(e) + np.arange(-2000, 2000)) for e in edges])
    exponents = (np.arange(90, 150, dtype=np.int64) << 23)[:, None] + rng.integers(0, 1 << 23, (60, 2000))
    pats = np.concatenate([near, exponents.ravel(), rng.integers(0, 1 << 32, 400_000),
                           [0, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7F80FFFF]])
    pats = np.concatenate([pats, pats | 0x80000000]).astype(np.uint32)
    x = rng.permutation(pats).view(np.float32).reshape(4, -1)[:, ::-1]  # strided: copied, then sliced
    prec = precision(name)
    with np.errstate(all="raise"):
        got = prec.round(x)
    with np.errstate(all="ignore"):
        want = x.astype(prec.compute).astype(np.float32)
    assert got.dtype == np.float32 and not np.shares_memory(got, x)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(got.view(np.uint32)[finite], want.view(np.uint32)[finite])
    # 0-d and empty arrays (the cast's path, and no slice at all)
    assert prec.round(np.float32(1 + 2.0 ** -9)) == np.float32(1 + 2.0 ** -9).astype(prec.compute)
    assert prec.round(np.zeros((0, 3), np.float32)).shape == (0, 3)
