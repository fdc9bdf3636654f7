"""attnlib.testing.assert_attention_close and check_kernel on what a kernel's test suite holds:
torch tensors (any float type, with grad, strided views), DLPack and __array__ objects, and
attention sinks.  torch is a test dependency (pinned in the test extra)."""

import numpy as np
import pytest
import torch

import attnlib
from attnlib import check
from attnlib.core.arrays import as_numpy
from attnlib.testing import assert_attention_close

sdpa = torch.nn.functional.scaled_dot_product_attention
B, H, S, D = 2, 4, 96, 32
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def qkv(dtype, seed=0, shape=(B, H, S, D), kv_heads=H):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    kv = (shape[0], kv_heads) + shape[2:]
    k = torch.randn(kv, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(kv, generator=g, dtype=torch.float64).to(dtype)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sdpa_outputs_pass_as_torch_tensors(dtype):
    q, k, v = qkv(dtype)
    out = sdpa(q, k, v, is_causal=True)  # requires grad: read through detach
    assert_attention_close(out, q, k, v, layout="bhsd", causal=True, causal_align="top_left")
    # FlashAttention's layout, as strided views of the same tensors
    assert_attention_close(out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           causal=True, causal_align="top_left")
    # GQA, unmasked, with the LSE and a scale of its own
    q, k, v = qkv(dtype, seed=1, kv_heads=2)
    out = sdpa(q, k, v, scale=0.3, enable_gqa=True)
    assert_attention_close(out, q, k, v, layout="bhsd", scale=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_off_by_one_causal_kernel_raises_with_the_diagnosis(dtype):
    q, k, v = qkv(dtype, seed=2)
    mask = torch.ones(S, S, dtype=torch.bool).tril(diagonal=1)  # one key too many
    out = sdpa(q, k, v, attn_mask=mask)
    with pytest.raises(AssertionError) as info:
        assert_attention_close(out, q, k, v, layout="bhsd", causal=True, causal_align="top_left")
    text = str(info.value)
    assert "out: FAIL" in text and "diagnosis:" in text and "causal mask" in text


def test_the_check_keeps_the_stored_type_of_torch_tensors():
    """bfloat16 tensors are judged as a bfloat16 kernel (the rule's precision), bit for bit."""
    q, k, v = qkv(torch.bfloat16)
    out = sdpa(q, k, v)
    result = check.check_kernel(q, k, v, out, layout="bhsd")
    assert result.passed and result.dtype == "bfloat16"
    exact = as_numpy(q, "q")
    assert exact.dtype.name == "bfloat16"
    assert np.array_equal(exact.astype(np.float64), q.detach().double().numpy())
    for name in ("float8_e4m3fn", "float8_e5m2"):
        x = torch.randn(5).to(getattr(torch, name))
        y = as_numpy(x, "x")
        assert y.dtype.name == name and np.array_equal(y.astype(np.float64), x.double().numpy())


class OnlyArray:
    """Anything with __array__ (a framework array numpy knows nothing else about)."""

    def __init__(self, x):
        self.x = x

    def __array__(self, dtype=None, copy=None):
        return self.x


class OnlyDLPack:
    def __init__(self, x):
        self.x = x

    def __dlpack__(self, **kw):
        return self.x.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.x.__dlpack_device__()


def test_dlpack_and_array_objects_and_refusals():
    q, k, v = (x.detach().numpy() for x in qkv(torch.float32))
    out = attnlib.attention(q, k, v, compute_dtype="float32")
    assert_attention_close(OnlyArray(out), OnlyDLPack(q), OnlyArray(k), OnlyDLPack(v), layout="bhsd")
    with pytest.raises(check.UnusableInput, match="q: expected an array"):
        check.check_kernel(object(), k, v, out, layout="bhsd")
    with pytest.raises(check.UnusableInput, match="expected a floating-point array, got int64"):
        check.check_kernel(torch.ones(B, H, S, D, dtype=torch.int64), k, v, out, layout="bhsd")


def sink_kernel(q, k, v, sinks, *, scale_the_sink=False):
    """A torch kernel with attention sinks, in q's dtype: the scores with one more column,
    softmax, that column dropped; the bug scales the sink like a score."""
    scale = q.shape[-1] ** -0.5
    acc = torch.promote_types(q.dtype, torch.float32)  # the softmax in float32 at least
    s = (q @ k.transpose(-1, -2)).to(acc) * scale
    sink = sinks.to(acc) * (scale if scale_the_sink else 1.0)
    z = torch.cat([s, sink[None, :, None, None].expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(z, dim=-1)[..., :-1].to(q.dtype)
    return p @ v


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_a_sink_kernel_passes_and_a_scaled_sink_fails(dtype):
    q, k, v = qkv(dtype, seed=3)
    sinks = torch.tensor([2.0, -1.0, 4.0, 0.5], dtype=torch.float32)
    out = sink_kernel(q, k, v, sinks)
    assert_attention_close(out, q, k, v, layout="bhsd", sinks=sinks)
    with pytest.raises(AssertionError, match="out: FAIL"):
        assert_attention_close(out, q, k, v, layout="bhsd")  # the sinks forgotten
    bad = sink_kernel(q, k, v, sinks, scale_the_sink=True)
    with pytest.raises(AssertionError, match="out: FAIL"):
        assert_attention_close(bad, q, k, v, layout="bhsd", sinks=sinks)


def test_float64_sink_lse_rows_without_keys(tmp_path, capsys):
    """float64: the gate's bound with the sink as one more term; rows with no key have lse =
    sink (and out 0).  The CLI reads the sinks from a file."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 2, 50, 4, 16))  # bshd
    sinks = rng.standard_normal(4)
    kv_lengths = np.array([0, 30])
    qh, kh, vh = (np.swapaxes(x, 1, 2) for x in (q, k, v))
    out, lse = attnlib.attention(qh, kh, vh, causal=True, kv_lengths=kv_lengths, sinks=sinks,
                                 return_lse=True, block_k=8)
    out = np.swapaxes(out, 1, 2)
    result = check.check_kernel(q, k, v, out, lse=lse, causal=True, kv_lengths=kv_lengths, sinks=sinks)
    assert result.passed and result.lse.passed
    wrong = lse.copy()
    wrong[0] = -np.inf  # the no-key rows' lse without the sink
    assert check.check_kernel(q, k, v, out, lse=wrong, causal=True, kv_lengths=kv_lengths,
                              sinks=sinks).lse.passed is False
    for name, x in dict(q=q, k=k, v=v, out=out, sinks=sinks).items():
        np.save(tmp_path / f"{name}.npy", x)
    argv = [a for n in ("q", "k", "v", "out") for a in (f"--{n}", str(tmp_path / f"{n}.npy"))]
    argv += ["--causal", "--kv-lengths", "0", "30"]
    assert check.main(argv + ["--sinks", str(tmp_path / "sinks.npy")]) == 0
    assert check.main(argv) == 1  # the same output judged without its sinks
    np.save(tmp_path / "bad.npy", np.zeros(3))
    assert check.main(argv + ["--sinks", str(tmp_path / "bad.npy")]) == 2
    assert "sinks must have shape" in capsys.readouterr().err


def _save(tmp_path, **arrays):
    argv = []
    for name, x in arrays.items():
        np.save(tmp_path / f"{name}.npy", x)
        argv += [f"--{name.replace('_', '-')}", str(tmp_path / f"{name}.npy")]
    return argv


@pytest.mark.slow
def test_varlen_kernels_are_judged_per_sequence(tmp_path, capsys):
    rng = np.random.default_rng(4)
    lens_q, lens_k = [37, 0, 64, 1], [37, 70, 64, 90]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], 2, 16)).astype(np.float32) for _ in range(2))
    used = np.array([30, 70, 64, 0])
    sinks = rng.standard_normal((4, 4))
    out, lse = attnlib.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=used, causal=True, sinks=sinks,
                                        return_lse=True, compute_dtype="float32", block_k=16)
    options = dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used, causal=True, sinks=sinks)
    result = check.check_kernel(q, k, v, out, lse=lse, **options)
    assert result.passed and result.lse.passed
    # One sequence attended top-left: named, by sequence.
    bad = attnlib.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=used, causal=True, causal_align="top_left",
                                   sinks=sinks, compute_dtype="float32")
    with pytest.raises(AssertionError, match="causal alignment top_left instead of bottom_right"):
        assert_attention_close(bad, q, k, v, **options)
    files = _save(tmp_path, q=q, k=k, v=v, out=out, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used,
                  sinks=sinks) + ["--causal"]
    argv = files + ["--layout", "thd"]
    assert check.main(argv) == 0
    np.save(tmp_path / "out.npy", bad)
    assert check.main(argv) == 1
    capsys.readouterr()
    assert check.main(files) == 2  # the varlen offsets without --layout thd
    assert "layout='thd'" in capsys.readouterr().err
    np.save(tmp_path / "cu_seqlens_q.npy", cu_q.astype(np.float32))
    assert check.main(argv) == 2 and "not an integer type" in capsys.readouterr().err


def test_paged_kernels_are_judged_against_the_contiguous_keys(tmp_path):
    rng = np.random.default_rng(5)
    kc, vc = rng.standard_normal((2, 30, 16, 2, 16))
    lens = np.array([50, 0, 100])
    table = np.full((3, 8), -1)
    perm = rng.permutation(30)
    table[0, :4], table[2, :7] = perm[:4], perm[4:11]
    q = rng.standard_normal((3, 5, 4, 16))  # bshd
    out = np.swapaxes(attnlib.attention(np.swapaxes(q, 1, 2), kc, vc, block_table=table, cache_seqlens=lens,
                                        causal=True), 1, 2)
    assert_attention_close(out, q, kc, vc, block_table=table, cache_seqlens=lens, causal=True)
    shifted = table.copy()
    shifted[2, 1:7] = table[2, :6]  # a kernel that reads page j - 1 from the second page on
    bad = np.swapaxes(attnlib.attention(np.swapaxes(q, 1, 2), kc, vc, block_table=shifted, cache_seqlens=lens,
                                        causal=True), 1, 2)
    with pytest.raises(AssertionError, match="out: FAIL"):
        assert_attention_close(bad, q, kc, vc, block_table=table, cache_seqlens=lens, causal=True)
    argv = _save(tmp_path, q=q, k=kc, v=vc, out=out, block_table=table, cache_seqlens=lens) + ["--causal"]
    assert check.main(argv) == 0


def test_varlen_check_ignores_keys_past_seqused():
    """FlashAttention never reads keys past seqused_k: whatever they hold, the check does not either."""
    rng = np.random.default_rng(6)
    cu = np.array([0, 40, 90])
    q, k, v = (rng.standard_normal((90, 2, 8)) for _ in range(3))
    used = np.array([30, 50])
    out = attnlib.attention_varlen(q, k, v, cu, cu, seqused_k=used, causal=True)
    k[35], v[36] = np.nan, np.inf  # inside sequence 0, past its 30 used keys
    result = check.check_kernel(q, k, v, out, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_k=used,
                                causal=True)
    assert result.passed and "varlen (thd)" in check.format_text(result)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sink_gradients_are_judged(dtype):
    """dq, dk, dv and dsinks of a torch kernel with sinks (autograd) pass; dsinks with the
    wrong sign, or computed without the sink in the denominator, fail."""
    q, k, v = qkv(dtype, seed=7, shape=(2, 4, 48, 16))
    sinks = torch.tensor([1.5, -0.5, 0.0, 3.0], dtype=dtype, requires_grad=True)
    out = sink_kernel(q, k, v, sinks)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(dtype)
    dq, dk, dv, dsinks = torch.autograd.grad(out, (q, k, v, sinks), dout)
    grads = dict(dout=dout, dq=dq, dk=dk, dv=dv)
    result = check.check_kernel(q, k, v, out, layout="bhsd", sinks=sinks, dsinks=dsinks, **grads)
    assert result.passed and set(result.grads) == {"dq", "dk", "dv", "dsinks"}
    assert all(g.passed for g in result.grads.values())
    with pytest.raises(AssertionError, match="dsinks"):
        assert_attention_close(out, q, k, v, layout="bhsd", sinks=sinks, dsinks=-dsinks, **grads)
    with pytest.raises(check.UnusableInput, match="dsinks was given without sinks"):
        check.check_kernel(q, k, v, out, layout="bhsd", dsinks=dsinks, **grads)


def test_padded_query_rows_must_be_zero():
    q, k, v = (x.detach().numpy() for x in qkv(torch.float32, seed=9))
    q_lengths = np.array([96, 50])
    out = attnlib.attention(q, k, v, causal=True, q_lengths=q_lengths, compute_dtype="float32")
    assert_attention_close(out, q, k, v, layout="bhsd", causal=True, q_lengths=q_lengths)
    bad = out.copy()
    bad[1, :, 70] = 1e-3  # a padded row written
    with pytest.raises(AssertionError, match="out: FAIL"):
        assert_attention_close(bad, q, k, v, layout="bhsd", causal=True, q_lengths=q_lengths)
