"""`attnlib.compat.pytorch`: SDPA and FlexAttention exact in float64 against torch's own
(the math backend and FlexAttention's eager path, float64, CPU) to 1e-13 of ``P @ |V|``; the
assert twins pass torch itself in low precision and fail wrong kernels; bad arguments are
refused by name."""

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention import flex_attention as fa

from attnlib.compat import pytorch as P

# FlexAttention's eager path is the reference here; its advice to compile is not for us.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
F64 = torch.float64
TOL = 1e-13


def rnd(gen, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def torch_sdpa(q, k, v, *args, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, *args, **kw)


def torch_flex(q, k, v, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fa.flex_attention(q, k, v, **kw)


def assert_exact(got, want, size):
    """``|got - want| <= 1e-13 (P @ |V|)`` on every entry (so exactly 0 on rows with no key)."""
    got = got if torch.is_tensor(got) else torch.from_numpy(np.asarray(got))
    assert got.dtype == F64 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    err = (got - want).abs()
    assert bool(torch.all(err <= TOL * size)), float((err / size.clamp_min(1e-300)).max())


def assert_stat(got, want):
    """A row statistic (lse, max_scores) within 1e-13 of its size; -inf rows exactly."""
    got = got if torch.is_tensor(got) else torch.from_numpy(np.asarray(got))
    assert got.dtype == F64 and got.shape == want.shape
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf])
    assert bool(torch.all((got[~inf] - want[~inf]).abs() <= TOL * (1 + want[~inf].abs())))


def check_sdpa(q, k, v, *args, **kw):
    """attnlib's SDPA against torch's math backend, and against itself on numpy inputs."""
    want = torch_sdpa(q, k, v, *args, **kw)
    size = torch_sdpa(q, k, v.abs(), *args, **kw)
    got = P.scaled_dot_product_attention(q, k, v, *args, **kw)
    assert torch.is_tensor(got)
    assert_exact(got, want, size)
    return want


# ----------------------------------------------------------------------------- SDPA exact

@pytest.mark.parametrize("L,S", [(5, 9), (9, 5), (1, 7), (7, 1), (8, 8), (33, 70), (70, 33)])
def test_sdpa_causal_is_top_left(L, S):
    gen = torch.Generator().manual_seed(L * 100 + S)
    for d, (hq, hk), scale in [(16, (2, 2), None), (64, (4, 2), 0.3), (128, (3, 1), None), (32, (4, 4), -0.7)]:
        q, k, v = rnd(gen, 2, hq, L, d), rnd(gen, 2, hk, S, d), rnd(gen, 2, hk, S, d)
        check_sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=hq != hk)
    # top-left: with L > S every row sees key 0; with L < S the last S - L keys are seen by none
    q, k, v = rnd(gen, 1, 1, L, 16), rnd(gen, 1, 1, S, 16), torch.eye(S, dtype=F64)[None, None]
    out = P.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.all(out[..., torch.arange(L)[:, None] < torch.arange(S)] == 0)
    assert torch.all(out[..., :, 0] > 0)


def masks(gen, N, H, L, S):
    """SDPA masks of several broadcast shapes, each with fully masked rows."""
    shapes = [(L, S), (1, S), (L, 1), (1, 1, L, S), (N, 1, L, S), (N, H, L, S), (H, 1, S), (H, L, S), (1, H, L, 1)]
    for shape in shapes:
        keep = torch.rand(shape, generator=gen) > 0.3
        if shape[-2] > 1:
            keep[..., 1, :] = False  # a fully masked row
        bias = torch.where(keep, rnd(gen, *shape), -torch.inf)
        yield keep, bias


def test_sdpa_bool_and_float_masks_of_every_broadcast_shape():
    gen = torch.Generator().manual_seed(1)
    for N, H, L, S, d in [(2, 3, 6, 11, 16), (1, 2, 13, 4, 64), (3, 1, 1, 9, 32)]:
        q, k, v = rnd(gen, N, H, L, d), rnd(gen, N, H, S, d), rnd(gen, N, H, S, d)
        for keep, bias in masks(gen, N, H, L, S):
            check_sdpa(q, k, v, keep)
            check_sdpa(q, k, v, attn_mask=bias, scale=0.2)
            if L > 1 and keep.shape[-2] > 1:  # a fully masked row is 0, as the math backend gives
                assert torch.all(P.scaled_dot_product_attention(q, k, v, keep)[..., 1, :] == 0)


def test_sdpa_masks_with_gqa_and_low_precision_masks():
    gen = torch.Generator().manual_seed(2)
    q, k, v = rnd(gen, 2, 6, 10, 32), rnd(gen, 2, 2, 12, 32), rnd(gen, 2, 2, 12, 24)  # Ev != E
    keep = torch.rand(2, 6, 10, 12, generator=gen) > 0.5
    keep[1, 4, 3] = False
    check_sdpa(q, k, v, keep, enable_gqa=True)
    check_sdpa(q, k, v, torch.where(keep, rnd(gen, 6, 10, 12), -torch.inf), enable_gqa=True)
    check_sdpa(q, k, v, rnd(gen, 10, 12).float(), enable_gqa=True)  # a float32 mask, read as stored


def test_sdpa_leading_axes_and_torch_broadcasting():
    gen = torch.Generator().manual_seed(3)
    cases = [  # (q, k, v shapes, keywords): torch's matmuls broadcast every axis before (L, E)
        ((2, 3, 4, 5, 16), (2, 3, 4, 7, 16), (2, 3, 4, 7, 16), dict(is_causal=True)),  # 5-D
        ((2, 3, 4, 5, 16), (2, 3, 2, 7, 16), (2, 3, 2, 7, 8), dict(enable_gqa=True)),
        ((4, 5, 16), (4, 7, 16), (4, 7, 16), dict(is_causal=True)),  # 3-D: (H, L, E)
        ((6, 16), (9, 16), (9, 16), dict(is_causal=True)),  # 2-D: one head
        ((2, 3, 5, 16), (1, 3, 7, 16), (1, 3, 7, 16), {}),  # batch broadcast
        ((1, 3, 5, 16), (2, 3, 7, 16), (2, 3, 7, 16), {}),  # the other way
        ((2, 4, 5, 16), (4, 7, 16), (4, 7, 16), {}),  # key with fewer dims
        ((2, 4, 5, 16), (2, 1, 7, 16), (2, 1, 7, 16), {}),  # one kv head, no GQA: broadcast
        ((2, 1, 5, 16), (2, 4, 7, 16), (2, 4, 7, 16), {}),  # one query head against four
        ((2, 4, 5, 16), (2, 1, 7, 16), (2, 4, 7, 16), {}),  # key and value heads broadcast
        ((2, 4, 5, 16), (2, 2, 7, 16), (2, 1, 7, 16), dict(enable_gqa=True)),  # Hk != Hv
        ((2, 4, 5, 16), (1, 2, 7, 16), (1, 2, 7, 16), dict(enable_gqa=True, is_causal=True)),
        ((2, 1, 4, 5, 16), (1, 3, 4, 7, 16), (1, 3, 4, 7, 16), dict(scale=0.5)),
    ]
    for qs, ks, vs, kw in cases:
        q, k, v = rnd(gen, *qs), rnd(gen, *ks), rnd(gen, *vs)
        want = check_sdpa(q, k, v, **kw)
        L, S = qs[-2], ks[-2]
        if "is_causal" not in kw:
            for keep, bias in masks(gen, 1, want.shape[-3] if want.ndim > 2 else 1, L, S):
                if keep.ndim <= want.ndim:
                    check_sdpa(q, k, v, keep, **kw)
                    check_sdpa(q, k, v, bias, **kw)
    q, k = rnd(gen, 2, 3, 4, 5, 16), rnd(gen, 2, 3, 4, 7, 16)
    check_sdpa(q, k, k, torch.rand(3, 1, 5, 7, generator=gen) > 0.4)  # a mask on the middle batch axis


def test_sdpa_numpy_in_numpy_out_and_inputs_untouched():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((2, 4, 6, 32)), rng.standard_normal((2, 2, 9, 32)), rng.standard_normal((2, 2, 9, 32))
    keep = rng.random((6, 9)) > 0.4
    keep[2] = False
    copies = [x.copy() for x in (q, k, v, keep)]
    out = P.scaled_dot_product_attention(q, k, v, keep, enable_gqa=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    want = torch_sdpa(tq, tk, tv, torch.from_numpy(keep), enable_gqa=True)
    assert_exact(out, want, torch_sdpa(tq, tk, tv.abs(), torch.from_numpy(keep), enable_gqa=True))
    out = P.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1, enable_gqa=True)
    assert_exact(out, torch_sdpa(tq, tk, tv, is_causal=True, scale=0.1, enable_gqa=True),
                 torch_sdpa(tq, tk, tv.abs(), is_causal=True, scale=0.1, enable_gqa=True))
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v, keep), copies))


def test_sdpa_empty_sequences():
    gen = torch.Generator().manual_seed(5)
    q, k = rnd(gen, 2, 2, 4, 16), rnd(gen, 2, 2, 0, 16)
    assert torch.equal(P.scaled_dot_product_attention(q, k, k, is_causal=True), torch_sdpa(q, k, k, is_causal=True))
    assert P.scaled_dot_product_attention(k, q, q).shape == (2, 2, 0, 16)


# ----------------------------------------------------------------------------- FlexAttention exact

H = 4
SLOPES = torch.tensor([2.0 ** -(h + 1) * 1.3 for h in range(8)], dtype=F64)  # float64: not 0.1 * int
TABLE = torch.tensor(np.random.default_rng(6).standard_normal((8, 129)) * 0.5)


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (q_idx - kv_idx).abs()


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def relative_bias(score, b, h, q_idx, kv_idx):  # a bucketed relative position table per head
    return score + TABLE[h, (kv_idx - q_idx).clamp(-64, 64) + 64]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 9)


DOCS = torch.tensor(np.array([np.repeat([0, 1, 2, 3], [20, 25, 17, 18]), np.repeat([0, 1, 2, 3], [5, 40, 30, 5])]))
KV_DOCS = torch.tensor(np.array([np.repeat([0, 1, 3, 4], [30, 20, 30, 16]), np.repeat([1, 2, 3, 5], [10, 40, 30, 16])]))


def documents(b, h, q_idx, kv_idx):  # query documents 2 (entry 0) and 0 (entry 1) see no key
    return DOCS[b, q_idx] == KV_DOCS[b, kv_idx]


def per_head(b, h, q_idx, kv_idx):  # head 3 sees nothing of the first 8 queries
    return (q_idx >= kv_idx) & ((h != 3) | (q_idx >= 8))


def dense_stats(q, k, score_mod, mask_mod, scale, L, S):
    """lse and max_scores by hand: FlexAttention's definition on the dense grid."""
    B, Hq = q.shape[:2]
    kk = k.repeat_interleave(Hq // k.shape[1], dim=1).expand(B, -1, -1, -1)
    s = scale * q @ kk.transpose(-2, -1)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(Hq).view(1, Hq, 1, 1)
    i, j = torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    if mask_mod is not None:
        s = torch.where(torch.broadcast_to(mask_mod(b, h, i, j), s.shape), s, -torch.inf)
    lse = torch.logsumexp(s, -1)
    return lse, s.max(-1).values


def dense_flex(q, k, v, score_mod, mask_mod, scale=None):
    """FlexAttention's definition, dense, in q's type (GQA by repeat_interleave)."""
    B, Hq, L, E = q.shape
    S = k.shape[-2]
    g = Hq // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (E ** -0.5 if scale is None else scale) * q @ k.transpose(-2, -1)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(Hq).view(1, Hq, 1, 1)
    i, j = torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)
    s = score_mod(s, b, h, i, j).to(q.dtype)
    s = torch.where(torch.broadcast_to(mask_mod(b, h, i, j), s.shape), s, -torch.inf)
    return torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ v


FLEX_CASES = [  # (B, Bkv, Hq, Hkv, L, S, d, score_mod, mask_mod, mask B/H, scale)
    (2, 2, 4, 4, 64, 64, 16, alibi, causal, (None, None), None),
    (2, 2, 4, 2, 80, 96, 32, softcap, documents, (2, None), None),
    (1, 1, 4, 1, 96, 80, 64, relative_bias, sliding, (None, None), 0.2),
    (2, 2, 4, 4, 40, 72, 128, None, per_head, (None, 4), None),
    (2, 1, 4, 4, 80, 96, 16, alibi, documents, (2, None), None),  # keys shared by the batch
    (2, 2, 8, 2, 48, 48, 32, relative_bias, None, None, -0.3),
    (1, 1, 4, 4, 130, 70, 16, softcap, causal, (None, None), None),
]


@pytest.mark.parametrize("case", range(len(FLEX_CASES)))
def test_flex_attention_equals_eager_flex_attention(case):
    B, Bkv, Hq, Hkv, L, S, d, score_mod, mask_mod, mask_bh, scale = FLEX_CASES[case]
    gen = torch.Generator().manual_seed(case)
    q, k, v = rnd(gen, B, Hq, L, d), rnd(gen, Bkv, Hkv, S, d), rnd(gen, Bkv, Hkv, S, d)
    bm = None if mask_mod is None else fa.create_block_mask(mask_mod, *mask_bh, L, S, device="cpu")
    kw = dict(score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=Hq != Hkv)
    want, aux = torch_flex(q, k, v, return_aux=fa.AuxRequest(lse=True), **kw)
    size = torch_flex(q, k, v.abs(), **kw)
    got = P.flex_attention(q, k, v, **kw)
    assert_exact(got, want, size)
    out, got_aux = P.flex_attention(q, k, v, return_aux=fa.AuxRequest(lse=True, max_scores=True), **kw)
    assert isinstance(got_aux, fa.AuxOutput)
    assert_exact(out, want, size)
    assert_stat(got_aux.lse, aux.lse)
    lse, max_scores = dense_stats(q, k, score_mod, mask_mod, d ** -0.5 if scale is None else scale, L, S)
    assert_stat(got_aux.lse, lse)
    assert_stat(got_aux.max_scores, max_scores)
    if mask_mod in (documents, per_head):  # fully masked rows: out 0, lse and max -inf
        empty = torch.isinf(aux.lse)
        assert empty.any() and torch.equal(torch.isinf(got_aux.lse), empty)
        assert torch.all(out[empty] == 0) and torch.all(got_aux.max_scores[empty] == -torch.inf)
    out, lse_only = P.flex_attention(q, k, v, return_aux=fa.AuxRequest(max_scores=False, lse=True), **kw)
    assert lse_only.max_scores is None and torch.equal(lse_only.lse, got_aux.lse)
    out, nothing = P.flex_attention(q, k, v, return_aux=fa.AuxRequest(), **kw)
    assert nothing == fa.AuxOutput(None, None) and torch.equal(out, got)
    with pytest.warns(FutureWarning, match="return_lse is deprecated"):
        out2, lse2 = P.flex_attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(out2, out) and torch.equal(lse2, got_aux.lse)


def test_flex_attention_numpy_in_numpy_out():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 4, 64, 32)) for _ in range(3))
    bm = fa.create_block_mask(sliding, None, None, 64, 64, device="cpu")
    out = P.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    want, aux = torch_flex(tq, tk, tv, score_mod=alibi, block_mask=bm, return_aux=fa.AuxRequest(lse=True))
    assert_exact(out, want, torch_flex(tq, tk, tv.abs(), score_mod=alibi, block_mask=bm))
    with pytest.warns(FutureWarning):
        out, lse = P.flex_attention(q, k, v, score_mod=alibi, block_mask=bm, return_lse=True)
    assert isinstance(lse, np.ndarray) and lse.shape == (2, 4, 64)
    assert_stat(lse, aux.lse)
    out, got = P.flex_attention(q, k, v, score_mod=alibi, block_mask=bm, return_aux=fa.AuxRequest(lse=True))
    assert isinstance(got, fa.AuxOutput) and isinstance(got.lse, np.ndarray) and got.max_scores is None


def test_flex_attention_block_lists_decide_as_in_the_fused_kernels():
    """A block mask made for entry 0 only (B=None) of a mask that depends on the entry: the
    fused kernels keep its FULL blocks whole in every entry (the eager path applies mask_mod
    everywhere instead); the reference keeps what the kernels keep."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (rnd(gen, 2, 2, 256, 16) for _ in range(3))
    docs = torch.tensor([[0] * 256, [0] * 100 + [1] * 156])

    def doc_causal(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    bm = fa.create_block_mask(doc_causal, None, None, 256, 256, device="cpu")
    got = P.flex_attention(q, k, v, block_mask=bm)
    # the kernels' mask, by hand: blocks of 128, the FULL ones (below the diagonal) kept whole
    i, j = torch.arange(256).view(-1, 1), torch.arange(256).view(1, -1)
    full = (i // 128) > (j // 128)
    keep = full | (doc_causal(torch.arange(2).view(2, 1, 1, 1), 0, i, j) & ((i // 128) == (j // 128)))
    want = torch_sdpa(q, k, v, keep)
    assert_exact(got, want, torch_sdpa(q, k, v.abs(), keep))
    eager = torch_flex(q, k, v, block_mask=bm)  # differs in entry 1 only
    assert torch.allclose(eager[0], got[0], rtol=0, atol=1e-13) and not torch.allclose(eager[1], got[1])


# ----------------------------------------------------------------------------- the twins: pass

LOW = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_assert_sdpa_close_passes_torch_sdpa_in_low_precision(dtype):
    gen = torch.Generator().manual_seed(9)
    cases = [
        ((2, 4, 24, 64), (2, 2, 40, 64), dict(is_causal=True, enable_gqa=True)),
        ((2, 4, 40, 32), (2, 4, 24, 32), dict(is_causal=True, scale=0.3)),
        ((2, 3, 2, 16, 32), (2, 3, 2, 20, 32), dict(mask="bool")),
        ((2, 4, 16, 64), (2, 4, 33, 64), dict(mask="float")),
    ]
    for qs, ks, kw in cases:
        q, k, v = rnd(gen, *qs, dtype=dtype), rnd(gen, *ks, dtype=dtype), rnd(gen, *ks, dtype=dtype)
        mask = kw.pop("mask", None)
        if mask is not None:
            keep = torch.rand(qs[-3], qs[-2], ks[-2], generator=gen) > 0.3
            keep[0, 3] = False
            mask = keep if mask == "bool" else torch.where(keep, rnd(gen, *keep.shape), -torch.inf).to(dtype)
        for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
            if backend == SDPBackend.FLASH_ATTENTION and (mask is not None or kw.get("scale") or len(qs) != 4
                                                          or dtype == torch.float16):
                continue
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, mask, **kw)
            P.assert_sdpa_close(out, q, k, v, mask, **kw)


def test_assert_sdpa_close_judges_gradients_of_5d_inputs_and_float_masks():
    gen = torch.Generator().manual_seed(10)
    q, k, v = (rnd(gen, 2, 2, 3, 12, 32, dtype=torch.float32).requires_grad_() for _ in range(3))
    bias = torch.where(torch.rand(12, 12, generator=gen) > 0.2, rnd(gen, 12, 12), -torch.inf).float()
    out = torch_sdpa(q, k, v, bias)
    dout = rnd(gen, *out.shape, dtype=torch.float32)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    P.assert_sdpa_close(out.detach(), q.detach(), k.detach(), v.detach(), bias, dout=dout, dq=dq, dk=dk, dv=dv)
    with pytest.raises(AssertionError, match="dq"):
        P.assert_sdpa_close(out.detach(), q.detach(), k.detach(), v.detach(), bias, dout=dout, dq=dq * 1.01,
                            dk=dk, dv=dv)


def test_assert_flex_attention_close_passes_flex_attention():
    gen = torch.Generator().manual_seed(11)
    q, k, v = rnd(gen, 2, 4, 80, 32, dtype=torch.float32), rnd(gen, 2, 2, 96, 32, dtype=torch.float32), \
        rnd(gen, 2, 2, 96, 32, dtype=torch.float32)
    bm = fa.create_block_mask(documents, 2, None, 80, 96, device="cpu")
    kw = dict(score_mod=alibi, block_mask=bm, enable_gqa=True)
    result = torch_flex(q, k, v, return_aux=fa.AuxRequest(lse=True), **kw)
    P.assert_flex_attention_close(result, q, k, v, return_aux=fa.AuxRequest(lse=True), **kw)
    P.assert_flex_attention_close(result[0], q, k, v, **kw)
    P.assert_flex_attention_close((result[0], result[1].lse), q, k, v, return_lse=True, kernel_options={}, **kw)
    # max_scores (torch computes none on the CPU): attnlib's own, rounded to float32, passes
    ref, aux = P.flex_attention(q, k, v, return_aux=fa.AuxRequest(max_scores=True), **kw)
    P.assert_flex_attention_close((ref.float(), fa.AuxOutput(max_scores=aux.max_scores.float())), q, k, v,
                                  return_aux=fa.AuxRequest(max_scores=True), **kw)
    # gradients, score_mod's derivative by torch autograd (FlexAttention has no CPU backward:
    # its definition written out in float32, with torch's autograd)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = dense_flex(qg, kg, vg, alibi, documents)
    dout = rnd(gen, *out.shape, dtype=torch.float32)
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
    P.assert_flex_attention_close(out.detach(), q, k, v, dout=dout, dq=dq, dk=dk, dv=dv, **kw)
    with pytest.raises(AssertionError):
        P.assert_flex_attention_close(out.detach(), q, k, v, dout=dout, dq=dq, dk=dk, dv=dv,
                                      score_mod_grad=lambda s, b, h, i, j: 2 + 0 * s, **kw)


# ----------------------------------------------------------------------------- the twins: fail

def kernel(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False, defect=None):
    """SDPA in float32, written out, with one named defect."""
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = E ** -0.5 if scale is None else scale
    if defect == "scale 1/d":
        scale = 1.0 / E
    if enable_gqa:
        g = q.shape[-3] // k.shape[-3]
        heads = torch.arange(q.shape[-3])
        idx = heads % k.shape[-3] if defect == "gqa round robin" else heads // g
        k, v = k[..., idx, :, :], v[..., idx, :, :]
    s = scale * q.float() @ k.float().transpose(-2, -1)
    if is_causal:
        diag = {"causal +1": 1, "causal -1": -1, "bottom right": S - L}.get(defect, 0)
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(diag), -torch.inf)
    if mask is not None and defect != "mask ignored":
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, -torch.inf)
        else:
            s = s + mask.float() * (2 if defect == "float mask twice" else 1)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return (p @ v.float()).to(q.dtype)


DEFECTS = [  # (defect, L, S, Hq, Hk, mask kind, keywords)
    ("causal +1", 24, 40, 4, 4, None, dict(is_causal=True)),
    ("causal -1", 40, 24, 4, 4, None, dict(is_causal=True)),
    ("bottom right", 24, 40, 4, 4, None, dict(is_causal=True)),
    ("bottom right", 40, 24, 4, 4, None, dict(is_causal=True)),
    ("scale 1/d", 32, 32, 4, 4, None, {}),
    ("mask ignored", 32, 40, 4, 4, "bool", {}),
    ("float mask twice", 32, 40, 4, 4, "float", {}),
    ("gqa round robin", 32, 40, 4, 2, None, dict(enable_gqa=True)),
]


@pytest.mark.parametrize("defect,L,S,hq,hk,mask,kw", DEFECTS, ids=[d[0] + f" {d[1]}x{d[2]}" for d in DEFECTS])
def test_assert_sdpa_close_fails_wrong_kernels(defect, L, S, hq, hk, mask, kw):
    gen = torch.Generator().manual_seed(12)
    q, k, v = (rnd(gen, 2, h, n, 64, dtype=torch.bfloat16) for h, n in ((hq, L), (hk, S), (hk, S)))
    if mask is not None:
        keep = torch.rand(L, S, generator=gen) > 0.3
        mask = keep if mask == "bool" else torch.where(keep, rnd(gen, L, S) * 2, -torch.inf).bfloat16()
    P.assert_sdpa_close(kernel(q, k, v, mask, **kw), q, k, v, mask, **kw)  # the kernel, right
    with pytest.raises(AssertionError, match="not close"):
        P.assert_sdpa_close(kernel(q, k, v, mask, defect=defect, **kw), q, k, v, mask, **kw)


def test_assert_flex_attention_close_fails_wrong_kernels():
    gen = torch.Generator().manual_seed(13)
    q, k, v = (rnd(gen, 2, h, 64, 32, dtype=torch.float32) for h in (4, 2, 2))
    bm = fa.create_block_mask(sliding, None, None, 64, 64, device="cpu")
    kw = dict(score_mod=relative_bias, block_mask=bm, enable_gqa=True)
    out, aux = torch_flex(q, k, v, return_aux=fa.AuxRequest(lse=True), **kw)
    req = fa.AuxRequest(lse=True)
    P.assert_flex_attention_close((out, aux), q, k, v, return_aux=req, **kw)
    wrong = {
        "lse in base 2": (out, fa.AuxOutput(lse=aux.lse / math.log(2))),
        "block mask ignored": torch_flex(q, k, v, score_mod=relative_bias, enable_gqa=True, return_aux=req),
        "score_mod ignored": torch_flex(q, k, v, block_mask=bm, enable_gqa=True, return_aux=req),
        "scale 1/d": torch_flex(q, k, v, scale=1 / 32, return_aux=req, **kw),
        "gqa round robin": torch_flex(q, k[:, [0, 1, 0, 1]], v[:, [0, 1, 0, 1]], score_mod=relative_bias,
                                      block_mask=bm, return_aux=req),
    }
    for name, result in wrong.items():
        with pytest.raises(AssertionError, match="not close"):
            P.assert_flex_attention_close(result, q, k, v, return_aux=req, **kw)
    # a result without what the call asks for
    with pytest.raises(AssertionError, match="AuxOutput.lse"):
        P.assert_flex_attention_close((out, fa.AuxOutput()), q, k, v, return_aux=req, **kw)
    with pytest.raises(AssertionError, match=r"returns \(out, lse\)"):
        P.assert_flex_attention_close(out, q, k, v, return_lse=True, **kw)
    with pytest.raises(AssertionError, match="as for return_aux"):
        P.assert_flex_attention_close((out, aux), q, k, v, return_lse=True, **kw)
    with pytest.raises(AssertionError, match="out alone"):
        P.assert_flex_attention_close((out, aux), q, k, v, **kw)


# ----------------------------------------------------------------------------- errors

def test_bad_sdpa_arguments_are_refused_by_name():
    gen = torch.Generator().manual_seed(14)
    q, k, v = rnd(gen, 2, 4, 5, 16), rnd(gen, 2, 2, 7, 16), rnd(gen, 2, 2, 7, 16)
    sdpa = P.scaled_dot_product_attention
    bad = [
        (ValueError, "dropout", lambda: sdpa(q, k, v, dropout_p=0.1, enable_gqa=True)),
        (ValueError, "dropout_p", lambda: sdpa(q, k, v, dropout_p=1.5, enable_gqa=True)),
        (ValueError, "is_causal", lambda: sdpa(q, k, v, torch.ones(5, 7, dtype=torch.bool), is_causal=True,
                                               enable_gqa=True)),
        (ValueError, "enable_gqa", lambda: sdpa(q, k, v)),
        (ValueError, "divide", lambda: sdpa(q, rnd(gen, 2, 3, 7, 16), rnd(gen, 2, 3, 7, 16), enable_gqa=True)),
        (ValueError, "embedding dim", lambda: sdpa(q, rnd(gen, 2, 4, 7, 8), rnd(gen, 2, 4, 7, 8))),
        (ValueError, "sequence length", lambda: sdpa(q, k, rnd(gen, 2, 2, 6, 16), enable_gqa=True)),
        (ValueError, "batch dims", lambda: sdpa(q, rnd(gen, 3, 4, 7, 16), rnd(gen, 3, 4, 7, 16))),
        (ValueError, "at least 2-D", lambda: sdpa(rnd(gen, 16), rnd(gen, 16), rnd(gen, 16))),
        (ValueError, "attn_mask", lambda: sdpa(q, k, v, torch.ones(3, 4, 5, 7, dtype=torch.bool), enable_gqa=True)),
        (ValueError, "attn_mask", lambda: sdpa(q, k, v, torch.ones(2, 2, 4, 5, 7, dtype=torch.bool),
                                               enable_gqa=True)),
        (ValueError, "NaN or \\+inf", lambda: sdpa(q, k, v, torch.full((5, 7), torch.inf, dtype=F64),
                                                  enable_gqa=True)),
        (TypeError, "attn_mask", lambda: sdpa(q, k, v, torch.ones(5, 7, dtype=torch.int64), enable_gqa=True)),
        (TypeError, "query", lambda: sdpa(q.long(), k, v, enable_gqa=True)),
        (TypeError, "is_causal", lambda: sdpa(q, k, v, is_causal=1, enable_gqa=True)),
        (TypeError, "enable_gqa", lambda: sdpa(q, k, v, enable_gqa="yes")),
        (TypeError, "scale", lambda: sdpa(q, k, v, scale="0.5", enable_gqa=True)),
        (ValueError, "scale", lambda: sdpa(q, k, v, scale=math.inf, enable_gqa=True)),
        (TypeError, "positional", lambda: sdpa(q, k, v, None, 0.0, False, 0.5)),  # scale keyword-only
    ]
    for kind, match, call in bad:
        with pytest.raises(kind, match=match):
            call()
    out = torch_sdpa(q, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="dropout"):
        P.assert_sdpa_close(out, q, k, v, dropout_p=0.5, enable_gqa=True)
    with pytest.raises(TypeError, match="causal_align"):
        P.assert_sdpa_close(out, q, k, v, enable_gqa=True, causal_align="bottom_right")
    qb = rnd(gen, 2, 4, 5, 16)
    kb = rnd(gen, 1, 4, 7, 16)
    ob = torch_sdpa(qb, kb, kb)
    with pytest.raises(ValueError, match="broadcast"):
        P.assert_sdpa_close(ob, qb, kb, kb, dout=ob, dq=qb, dk=kb, dv=kb)
    q5 = rnd(gen, 2, 3, 4, 5, 16)
    with pytest.raises(ValueError, match="out has shape"):
        P.assert_sdpa_close(rnd(gen, 2, 3, 4, 5, 8), q5, q5, q5)


def test_bad_flex_attention_arguments_are_refused_by_name():
    gen = torch.Generator().manual_seed(15)
    q, k, v = rnd(gen, 2, 4, 64, 16), rnd(gen, 2, 2, 64, 16), rnd(gen, 2, 2, 64, 16)
    bm = fa.create_block_mask(causal, None, None, 64, 64, device="cpu")
    flex = P.flex_attention
    bad = [
        (ValueError, "same number of heads", lambda: flex(q, k, v)),
        (ValueError, "multiple of kv heads", lambda: flex(q, rnd(gen, 2, 3, 64, 16), rnd(gen, 2, 3, 64, 16),
                                                          enable_gqa=True)),
        (ValueError, "4-D", lambda: flex(q[0], k[0], v[0], enable_gqa=True)),
        (ValueError, "both return_lse and return_aux", lambda: flex(q, k, v, enable_gqa=True, return_lse=True,
                                                                   return_aux=fa.AuxRequest(lse=True))),
        (TypeError, "AuxRequest", lambda: flex(q, k, v, enable_gqa=True, return_aux={"lse": True})),
        (TypeError, "kernel_options", lambda: flex(q, k, v, enable_gqa=True, kernel_options=3)),
        (TypeError, "score_mod", lambda: flex(q, k, v, enable_gqa=True, score_mod=3)),
        (TypeError, "block_mask", lambda: flex(q, k, v, enable_gqa=True, block_mask=np.ones((64, 64), bool))),
        (ValueError, "lengths", lambda: flex(q[:, :, :32], k, v, enable_gqa=True, block_mask=bm)),
        (ValueError, "non-none block_mask", lambda: flex(q, k[:1], v[:1], enable_gqa=True)),
        (ValueError, "B_block_mask=1", lambda: flex(q, k[:1], v[:1], enable_gqa=True, block_mask=bm)),
        (ValueError, "embedding dim", lambda: flex(q, k[..., :8], v, enable_gqa=True)),
        (ValueError, "must agree", lambda: flex(q, k, v[:, :1], enable_gqa=True)),
        (ValueError, "heads", lambda: flex(q, k, v, enable_gqa=True,
                                           block_mask=fa.create_block_mask(causal, None, 2, 64, 64, device="cpu"))),
    ]
    for kind, match, call in bad:
        with pytest.raises(kind, match=match):
            call()
    assert flex(q, k, v, enable_gqa=True, kernel_options={"BLOCK_M": 32}).shape == (2, 4, 64, 16)  # ignored
    out = torch_flex(q, k, v, enable_gqa=True)
    for key in ("lse", "lse_base", "mask_mod", "layout"):
        with pytest.raises(TypeError, match=key):
            P.assert_flex_attention_close(out, q, k, v, enable_gqa=True, **{key: None})
    b3 = fa.create_block_mask(causal, 2, None, 64, 64, device="cpu")
    with pytest.raises(ValueError, match="shared by the batch"):
        P.assert_flex_attention_close(out, q, k[:1], v[:1], enable_gqa=True, block_mask=b3, dout=out, dq=q,
                                      dk=k[:1], dv=v[:1])


@pytest.mark.slow
def test_flex_attention_follows_the_compiled_kernel_and_its_twin_passes_it():
    """torch.compile's FlexAttention kernel (CPU, float32: it takes no float64) on a block mask
    made for entry 0 of a mask that depends on the entry: the reference keeps what it keeps, and
    the twin passes it (it fails the eager result, which applies mask_mod everywhere)."""
    gen = torch.Generator().manual_seed(16)
    q, k, v = (rnd(gen, 2, 2, 256, 16, dtype=torch.float32) for _ in range(3))
    docs = torch.tensor([[0] * 256, [0] * 100 + [1] * 156])

    def doc_causal(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    bm = fa.create_block_mask(doc_causal, None, None, 256, 256, device="cpu")
    compiled = torch.compile(fa.flex_attention, fullgraph=True, dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compiled(q, k, v, block_mask=bm, score_mod=softcap)
    P.assert_flex_attention_close(out, q, k, v, block_mask=bm, score_mod=softcap)
    with pytest.raises(AssertionError, match="not close"):
        P.assert_flex_attention_close(torch_flex(q, k, v, block_mask=bm, score_mod=softcap), q, k, v,
                                      block_mask=bm, score_mod=softcap)
