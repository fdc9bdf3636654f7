"""``intermediate_dtype``: the weights ``p`` rounded to another type before ``p @ v``
(docs/semantics.md, "Block-scaled and quantized inputs").  The softmax-first emulation against
FlashAttention's test reference ``attention_ref(..., upcast, reorder_ops=True,
intermediate_dtype=)`` (transcribed below, masks left out), the tiled kernel on numpy and torch,
and the check: a kernel in the format passes at every magnitude, wrong ones fail, the normalised
weights rounded to fp8 named."""

import math

import numpy as np
import pytest

import attnlib
from attnlib.check import check_kernel
from attnlib.check.shapes import UnusableInput
from attnlib.core import problem
from attnlib.core.options import Options
from attnlib.core.reference import dense_attention

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")


def fa_attention_ref(q, k, v, upcast, intermediate_dtype):
    """FlashAttention's ``attention_ref`` without masks, ``reorder_ops=True``: bshd torch tensors."""
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    scores = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(q.shape[-1]))
    attention = torch.softmax(scores, dim=-1).to(v.dtype)
    attention = attention.to(intermediate_dtype).to(attention.dtype)
    return torch.einsum("bhts,bshd->bthd", attention, v).to(dtype_og)


@pytest.mark.parametrize("sq, sk, dtype, upcast, inter", [
    (64, 256, "bfloat16", False, "float8_e4m3fn"), (64, 1024, "bfloat16", False, "float8_e4m3fn"),
    (33, 300, "float32", True, "float8_e4m3fn"), (64, 512, "float32", True, "bfloat16"),
    (17, 512, "float16", False, "float8_e5m2"), (1, 200, "bfloat16", False, "float8_e5m2")])
def test_softmax_first_equals_flash_attentions_reference(sq, sk, dtype, upcast, inter):
    g = torch.Generator().manual_seed(sk + sq)
    q, k, v = (torch.randn(2, n, 4, 64, generator=g).to(getattr(torch, dtype)) for n in (sq, sk, sk))
    fa = fa_attention_ref(q, k, v, upcast, getattr(torch, inter)).double()
    prec = problem.precision("float32" if upcast else dtype, inter)
    ours = dense_attention(*(x.double().transpose(1, 2).numpy() for x in (q, k, v)), Options.parse(),
                           compute_dtype=prec, orders=("softmax_first",))
    ours = torch.from_numpy(np.asarray(ours, dtype=np.float64)).transpose(1, 2)
    diff = (ours - fa).abs()
    pv = (torch.softmax(torch.einsum("bthd,bshd->bhts", q.double(), k.double()) / 8, -1)
          @ v.double().abs().transpose(1, 2)).transpose(1, 2)
    # Only the float32 sums' order differs (BLAS's against torch's, which depends on the CPU: an
    # AVX2 EPYC gave 13% of float32 entries identical, an Intel Xeon 99%): it moves an entry by
    # a few float32 ulps of P @ |V|, or flips one weight's rounding to the intermediate type, at
    # most eps_p * (P @ |V|): with 512 weights a row near 1% of the entries for bfloat16 (0.6% on
    # the EPYC), against >= 99.8% outside 4 ulps for p left unrounded or rounded to another type.
    # In a 16-bit compute type the sums' order is hidden by its rounding.
    assert (diff <= float(ml_dtypes.finfo(prec.p_type).eps) * pv).all()
    if upcast:
        assert (diff <= 4 * float(np.finfo(np.float32).eps) * pv).double().mean() >= 0.97
    else:
        assert (diff == 0).double().mean() >= 0.99


def test_tiled_kernel_rounds_p_on_numpy_and_torch_alike():
    q, k, v = attnlib.random_qkv(40, 300, 32, seed=3)
    plain = attnlib.attention(q, k, v, compute_dtype="bfloat16", block_k=64).astype(np.float64)
    for inter in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        o = attnlib.attention(q, k, v, compute_dtype="bfloat16", intermediate_dtype=inter, block_k=64)
        ot = attnlib.attention(*(torch.from_numpy(x) for x in (q, k, v)), compute_dtype="bfloat16",
                               intermediate_dtype=inter, block_k=64)
        o = o.astype(np.float64)
        # the same roundings but the float32 sums' order (BLAS's and torch's): an output ulp apart
        assert np.abs(o - ot.double().numpy()).max() <= float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps) * np.abs(o).max()
        assert np.array_equal(o, plain) == (inter == "bfloat16")  # bfloat16 p: bfloat16's own


@pytest.mark.parametrize("kw, words", [
    (dict(intermediate_dtype="bfloat16"), "below float64"),
    (dict(compute_dtype="bfloat16", intermediate_dtype="float32"), "at least"),
    (dict(compute_dtype="float8_e4m3fn", intermediate_dtype="float8_e5m2"), "float8_e4m3fn"),
    (dict(compute_dtype="bfloat16", intermediate_dtype="int8"), "must be one of")])
def test_bad_intermediate_dtype_is_named(kw, words):
    q, k, v = attnlib.random_qkv(4, 8, 8, seed=0)
    for fn in (attnlib.attention, attnlib.reference_attention):
        with pytest.raises(ValueError, match=f"intermediate_dtype.*{words}|{words}.*intermediate_dtype"):
            fn(q, k, v, **kw)


def test_no_backward_with_an_intermediate_type():
    q, k, v = attnlib.random_qkv(8, 16, 8, seed=0)
    with pytest.raises(UnusableInput, match="intermediate_dtype"):
        check_kernel(q, k, v, q, layout="bhsd", dtype="bfloat16", intermediate_dtype="float8_e4m3fn",
                     dout=q, dq=q, dk=k, dv=v)


@pytest.mark.parametrize("sq, sk", [(1, 700), (48, 512)])
@pytest.mark.parametrize("inter", ["float8_e4m3fn", "float8_e5m2", "bfloat16"])
def test_the_check_passes_a_kernel_in_the_format_and_fails_wrong_ones(sq, sk, inter):
    bf = ml_dtypes.bfloat16
    for magnitude in (1e-2, 1e2):  # (the mix-ups of the check-rule report run 1e-2, 1, 1e2)
        q, k, v = attnlib.random_qkv(sq, sk, 64, seed=sk, batch=(2,), heads=4, kv_heads=2)
        q, k, v = (x.astype(bf) for x in (q, k, v * magnitude))
        good = attnlib.attention(q, k, v, compute_dtype="bfloat16", intermediate_dtype=inter, causal=True)
        c = check_kernel(q, k, v, good, layout="bhsd", intermediate_dtype=inter, causal=True)
        assert c.passed and c.out.ratio < 0.8, (magnitude, c.out.ratio)
        # scaled by what the format resolves (measured: x1.1 passes an fp8 p, x1.5 an e5m2 one, at 0.5)
        factor = {"bfloat16": 1.1, "float8_e4m3fn": 1.5, "float8_e5m2": 2.0}[inter]
        for wrong in (np.zeros_like(good), (good.astype(np.float64) * factor).astype(bf),
                      attnlib.attention(q, k, v, compute_dtype="bfloat16", intermediate_dtype=inter, causal=True,
                                        causal_align="top_left")):
            assert not check_kernel(q, k, v, wrong, layout="bhsd", intermediate_dtype=inter, causal=True).passed


def test_normalised_fp8_weights_fail_at_long_rows_named():
    bf = ml_dtypes.bfloat16
    q, k, v = (x.astype(bf) for x in attnlib.random_qkv(64, 1024, 64, seed=1))
    prec = problem.precision("bfloat16", "float8_e4m3fn")
    fa = dense_attention(q, k, v, Options.parse(), compute_dtype=prec, orders=("softmax_first",))
    c = check_kernel(q, k, v, fa, layout="bhsd", intermediate_dtype="float8_e4m3fn")
    assert not c.passed
    assert "normalised weights" in c.diagnosis[0]



def test_p_rounded_twice_fails_at_long_rows_named():
    """p = exp(s - m) rounded to fp8 for p @ v, divided by l, and rounded again (float32 scores)."""
    f8, bf = ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16
    q, k, v = (x.astype(bf).astype(np.float64) for x in attnlib.random_qkv(32, 1024, 64, seed=2))
    s = (q @ np.swapaxes(k, -1, -2) / 8).astype(np.float32)
    e = np.exp(s - s.max(-1, keepdims=True))
    w = (e.astype(f8).astype(np.float32) / e.sum(-1, keepdims=True)).astype(bf).astype(f8).astype(np.float32)
    out = (w @ v.astype(np.float32)).astype(bf)
    c = check_kernel(q.astype(bf), k.astype(bf), v.astype(bf), out, layout="bhsd", intermediate_dtype="float8_e4m3fn")
    assert not c.passed and "rounded to float8_e4m3fn twice" in c.diagnosis[0]
