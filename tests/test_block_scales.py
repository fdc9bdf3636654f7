"""Block-scaled and quantized inputs (docs/semantics.md, "Block-scaled and quantized inputs"):
MXFP8/MXFP4 (E8M0 scales per 32 of the head dim), NVFP4 (E4M3 scales per 16 and a float32 per
tensor), SageAttention's int8 blocks with K smoothing; the oracle dequantises exactly, the check
passes a kernel computing on them and names the mistakes."""

import numpy as np
import pytest

import attnlib
from attnlib.check import UnusableInput, check_kernel

ml_dtypes = pytest.importorskip("ml_dtypes")

B, H, S, D = 1, 2, 128, 64


def mx(x, elem, top, block=32):
    """OCP microscaling: per ``block`` of the head dim a power-of-two (E8M0) scale, the elements
    in ``elem`` (saturated at ``top``)."""
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    e = np.floor(np.log2(np.abs(xb).max(-1, keepdims=True))) - np.floor(np.log2(top))
    elements = np.clip(xb / 2.0 ** e, -top, top).astype(elem)
    return elements.reshape(x.shape), (2.0 ** e[..., 0]).astype(ml_dtypes.float8_e8m0fnu)


def dequantised(elements, *scales, block=32):
    out = elements.astype(np.float64)
    for s in scales:
        s = np.asarray(s, dtype=np.float64)
        out = out * (np.repeat(s, block, -1) if s.ndim == out.ndim else s)
    return out


@pytest.mark.parametrize("elem,top", [(ml_dtypes.float8_e4m3fn, 448.0), (ml_dtypes.float8_e5m2, 57344.0),
                                      (ml_dtypes.float4_e2m1fn, 6.0)])
def test_microscaled_inputs_are_attended_as_their_values(elem, top):
    rng = np.random.default_rng(0)
    (qe, qs), (ke, ks), (ve, vs) = (mx(rng.standard_normal((B, H, S, D)), elem, top) for _ in range(3))
    values = [dequantised(e, s) for e, s in ((qe, qs), (ke, ks), (ve, vs))]
    out = attnlib.attention(qe, ke, ve, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
    assert np.array_equal(out, attnlib.attention(*values, causal=True))
    ref = attnlib.reference_attention(qe, ke, ve, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
    assert np.abs(ref - out).max() < 1e-14
    kernel = attnlib.attention(*values, causal=True, compute_dtype="bfloat16").astype(np.float32)
    scales = dict(q_descale=qs, k_descale=ks, v_descale=vs)
    assert check_kernel(qe, ke, ve, kernel, causal=True, layout="bhsd", dtype="bfloat16", **scales).passed
    bshd = lambda x: np.swapaxes(x, 1, 2)  # noqa: E731
    assert check_kernel(bshd(qe), bshd(ke), bshd(ve), bshd(kernel), causal=True, dtype="bfloat16",
                        **{n: bshd(x) for n, x in scales.items()}).passed


def test_block_scale_mistakes_fail_and_are_named():
    rng = np.random.default_rng(1)
    (qe, qs), (ke, ks), (ve, vs) = (mx(rng.standard_normal((B, H, S, D)), ml_dtypes.float8_e4m3fn, 448.0)
                                    for _ in range(3))
    q, k = dequantised(qe, qs), dequantised(ke, ks)
    as_e4m3 = vs.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scales = dict(q_descale=qs, k_descale=ks, v_descale=vs)
    for words, wrong_vs in (("blocks read one block off", np.roll(vs.astype(np.float64), -1, axis=-1)),
                            ("E8M0 scales read as E4M3", as_e4m3),
                            ("one scale for the tensor", np.full(vs.shape, vs.astype(np.float64).flat[0])),
                            # element c given scale c // 16 (the last past the end): per 16, scales 0, 1, 1, 1
                            ("read as blocks of 16", vs.astype(np.float64)[..., [0, 1, 1, 1]]),
                            ("read as blocks of 64", vs.astype(np.float64)[..., :1])):
        block = D // np.shape(wrong_vs)[-1]
        kernel = attnlib.attention(q, k, dequantised(ve, wrong_vs, block=block), causal=True, compute_dtype="bfloat16")
        verdict = check_kernel(qe, ke, ve, kernel.astype(np.float32), causal=True, layout="bhsd", dtype="bfloat16",
                               **scales)
        assert not verdict.passed and any(words in d for d in verdict.diagnosis), (words, verdict.diagnosis)


def test_nvfp4_two_level_scales():
    rng = np.random.default_rng(2)

    def nvfp4(x):
        tensor = np.float32(np.abs(x).max() / (6 * 448))
        xb = x.reshape(x.shape[:-1] + (D // 16, 16))
        block = (np.abs(xb).max(-1) / 6 / tensor).astype(ml_dtypes.float8_e4m3fn)
        elements = np.clip(xb / (block.astype(np.float64)[..., None] * tensor), -6, 6).astype(ml_dtypes.float4_e2m1fn)
        return elements.reshape(x.shape), block, np.array(tensor)

    (qe, qb, qt), (ke, kb, kt), (ve, vb, vt) = (nvfp4(rng.standard_normal((B, H, S, D))) for _ in range(3))
    values = [dequantised(e, b, t, block=16) for e, b, t in ((qe, qb, qt), (ke, kb, kt), (ve, vb, vt))]
    scales = dict(q_descale=(qb, qt), k_descale=(kb, kt), v_descale=(vb, vt))
    assert np.array_equal(attnlib.attention(qe, ke, ve, causal=True, **scales), attnlib.attention(*values, causal=True))
    kernel = attnlib.attention(*values, causal=True, compute_dtype="bfloat16").astype(np.float32)
    assert check_kernel(qe, ke, ve, kernel, causal=True, layout="bhsd", dtype="bfloat16", **scales).passed
    missing = attnlib.attention(*values[:2], dequantised(ve, vb, block=16), causal=True, compute_dtype="bfloat16")
    verdict = check_kernel(qe, ke, ve, missing.astype(np.float32), causal=True, layout="bhsd", dtype="bfloat16",
                           **scales)
    assert not verdict.passed and any("factor 1 of 2 left out" in d for d in verdict.diagnosis)


def test_sage_int8_blocks_and_k_smoothing():
    rng = np.random.default_rng(3)
    q, v = rng.standard_normal((B, H, S, D)), rng.standard_normal((B, H, S, D)).astype(np.float32)
    k = rng.standard_normal((B, H, S, D)) + 3.0  # a shared offset: what smoothing removes
    mean = k.mean(-2, keepdims=True)

    def int8_blocks(x, block=64):  # one scale per block of tokens, (B, H, S / block, 1)
        xb = x.reshape(B, H, S // block, block, D)
        scale = (np.abs(xb).max((-1, -2), keepdims=True) / 127)[..., 0, 0][..., None].astype(np.float32)
        return np.round(xb / scale[..., None]).astype(np.int8).reshape(x.shape), scale

    (qi, qs), (ki, ks) = int8_blocks(q), int8_blocks(k - mean)
    qd = qi * np.repeat(qs.astype(np.float64), 64, -2)
    kd = ki * np.repeat(ks.astype(np.float64), 64, -2)
    out, smoothed_lse = attnlib.attention(qd, kd, v, causal=True, return_lse=True)
    true_lse = attnlib.attention(qd, kd + mean, v, causal=True, return_lse=True)[1]
    assert np.abs(out - attnlib.attention(qd, kd + mean, v, causal=True)).max() < 1e-14  # softmax unchanged
    told = dict(causal=True, layout="bhsd", q_descale=qs, k_descale=ks, dtype="float32", k_mean=mean.astype(np.float32))
    assert check_kernel(qi, ki, v, out.astype(np.float32), lse=true_lse.astype(np.float32), **told).passed
    wrong = check_kernel(qi, ki, v, out.astype(np.float32), lse=smoothed_lse.astype(np.float32), **told)
    assert wrong.out.passed and not wrong.lse.passed
    assert any("k_mean) not added back" in n for n in wrong.lse.notes)
    scaled = dict(q_descale=qs, k_descale=ks)  # attention takes the int8 values with their scales too
    assert np.abs(attnlib.attention(qi, ki, v, causal=True, **scaled) - attnlib.attention(qd, kd, v, causal=True)).max() == 0
    with pytest.raises(UnusableInput, match="expected a floating-point array, got int8"):
        check_kernel(qi, ki, v, out, layout="bhsd", dtype="float32")  # int8 without its scale


def test_block_scales_that_do_not_fit_are_refused():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((B, H, S, D)) for _ in range(3))
    with pytest.raises(ValueError, match="is no block scale of the data"):
        attnlib.attention(q, k, v, v_descale=np.ones((B, H, S, 9)))  # 9 blocks cannot cover 64
    with pytest.raises(ValueError, match="block-scaled descales .* not taken by attnlib.distributed"):
        attnlib.distributed.attention(q, k, v, v_descale=np.ones((B, H, S, 2)))
