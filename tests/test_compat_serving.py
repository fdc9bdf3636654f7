"""attnlib.compat.vllm and attnlib.compat.flashinfer: the drop-in float64 references of vLLM's
``ref_paged_attn`` and FlashInfer's prefill/decode calls, and their assert twins.

(a) Equality, to 1e-13 of ``P @ |V|``, with dense float64 constructions written here from the
peers' own definitions: vLLM's ``ref_paged_attn`` (tests/kernels/attention/test_flash_attn.py)
transcribed in torch, and FlashInfer's masks, window, soft cap, ALiBi (variants.cuh,
flashinfer/utils.py get_alibi_slopes) and RoPE (pos_enc.cuh vec_apply_llama_rope, prefill.cuh
compute_rope_freq) in torch; (b) the twins pass those definitions computed in float32 and
bfloat16 and fail named defects; (c) clear errors on bad arguments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attnlib.compat import flashinfer as fi  # noqa: E402
from attnlib.compat.vllm import assert_ref_paged_attn_close, ref_paged_attn  # noqa: E402

LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------
# vLLM's ref_paged_attn, transcribed (computed in `dtype`; masked rows NaN as in vLLM)


def vllm_ref(query, key_cache, value_cache, query_lens, kv_lens, block_tables, scale, sliding_window=None,
             soft_cap=None, dtype=torch.float64, top_left=False, absolute=False):
    num_seqs = len(query_lens)
    block_tables = block_tables.cpu().numpy()
    _, block_size, num_kv_heads, head_size = key_cache.shape
    outputs = []
    start_idx = 0
    for i in range(num_seqs):
        query_len, kv_len = int(query_lens[i]), int(kv_lens[i])
        q = query[start_idx:start_idx + query_len].to(dtype)
        q = q * scale  # vLLM: q *= scale, in place on the caller's query
        num_kv_blocks = (kv_len + block_size - 1) // block_size
        block_indices = block_tables[i, :num_kv_blocks]
        k = key_cache[block_indices].to(dtype).reshape(-1, num_kv_heads, head_size)[:kv_len]
        v = value_cache[block_indices].to(dtype).reshape(-1, num_kv_heads, value_cache.shape[-1])[:kv_len]
        if absolute:
            v = v.abs()
        if q.shape[1] != k.shape[1]:
            k = torch.repeat_interleave(k, q.shape[1] // k.shape[1], dim=1)
            v = torch.repeat_interleave(v, q.shape[1] // v.shape[1], dim=1)
        attn = torch.einsum("qhd,khd->hqk", q, k).to(torch.float64 if dtype == torch.float64 else torch.float32)
        empty_mask = torch.ones(query_len, kv_len)
        mask = torch.triu(empty_mask, diagonal=(1 if top_left else kv_len - query_len + 1)).bool()
        if sliding_window is not None:
            sliding_window_mask = torch.triu(empty_mask, diagonal=kv_len - (query_len + sliding_window) + 1).bool() \
                .logical_not()
            mask |= sliding_window_mask
        if soft_cap is not None:
            attn = soft_cap * torch.tanh(attn / soft_cap)
        attn.masked_fill_(mask, float("-inf"))
        attn = torch.softmax(attn, dim=-1).to(v.dtype)
        out = torch.einsum("hqk,khd->qhd", attn, v)
        outputs.append(out)
        start_idx += query_len
    return torch.cat(outputs, dim=0)


def paged_case(seed, *, num_seqs, block_size, hq, hk, d, dv=None, over=False, dtype=torch.float64):
    """Random vLLM-style inputs: ragged queries, a shuffled block pool; ``over``: some sequence
    with query_len > kv_len."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    dv = dv or d
    kv_lens = rng.integers(1, 40, num_seqs)
    query_lens = np.minimum(rng.integers(1, 12, num_seqs), kv_lens)
    if over:
        query_lens[0] = kv_lens[0] + rng.integers(1, 4)
    max_blocks = int(-(-kv_lens.max() // block_size)) + 1
    num_blocks = num_seqs * max_blocks + 3
    table = torch.as_tensor(rng.permutation(num_blocks)[:num_seqs * max_blocks].reshape(num_seqs, max_blocks),
                            dtype=torch.int32)
    query = torch.randn(int(query_lens.sum()), hq, d, generator=g, dtype=torch.float64).to(dtype)
    kc = torch.randn(num_blocks, block_size, hk, d, generator=g, dtype=torch.float64).to(dtype)
    vc = torch.randn(num_blocks, block_size, hk, dv, generator=g, dtype=torch.float64).to(dtype)
    return query, kc, vc, [int(x) for x in query_lens], torch.as_tensor(kv_lens, dtype=torch.int32), table


def close_to(ours, ref, pabs, tol=1e-13):
    """|ours - ref| <= tol * P@|V| entry by entry (rows with no key: both 0)."""
    ours, ref, pabs = (torch.as_tensor(x, dtype=torch.float64) for x in (ours, ref, pabs))
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert torch.isfinite(ours).all()
    err = (ours - ref).abs()
    bound = tol * pabs + 1e-300
    assert (err <= bound).all(), float((err / bound).max())


# ---------------------------------------------------------------------------------------------
# vLLM: equality


VLLM_CASES = [
    dict(num_seqs=3, block_size=16, hq=4, hk=4, d=64),
    dict(num_seqs=4, block_size=1, hq=8, hk=2, d=16),
    dict(num_seqs=2, block_size=5, hq=6, hk=3, d=32, sliding_window=4),
    dict(num_seqs=3, block_size=7, hq=4, hk=1, d=128, soft_cap=2.5),
    dict(num_seqs=3, block_size=16, hq=4, hk=2, d=16, dv=24, sliding_window=1, soft_cap=30.0),
    dict(num_seqs=2, block_size=3, hq=2, hk=2, d=32, sliding_window=100),
]


@pytest.mark.parametrize("case", range(len(VLLM_CASES)))
@pytest.mark.parametrize("seed", [0, 1])
def test_vllm_equals_transcribed_reference(case, seed):
    c = dict(VLLM_CASES[case])
    sw, cap = c.pop("sliding_window", None), c.pop("soft_cap", None)
    query, kc, vc, ql, kl, table = paged_case(seed * 100 + case, **c)
    scale = c["d"] ** -0.5
    before = query.clone()
    ours = ref_paged_attn(query, kc, vc, ql, kl, table, scale, sliding_window=sw, soft_cap=cap)
    assert torch.equal(query, before)  # never scaled in place (vLLM's reference does)
    assert ours.dtype == torch.float64 and ours.shape == (sum(ql), c["hq"], vc.shape[-1])
    ref = vllm_ref(query, kc, vc, ql, kl, table, scale, sw, cap)
    pabs = vllm_ref(query, kc, vc, ql, kl, table, scale, sw, cap, absolute=True)
    close_to(ours, ref, pabs)
    # lengths as an int tensor and a list alike
    again = ref_paged_attn(query, kc, vc, torch.tensor(ql, dtype=torch.int32), kl.tolist(), table, scale,
                           sliding_window=sw, soft_cap=cap)
    assert torch.equal(again, ours)


def test_vllm_rows_without_keys_give_zero():
    query, kc, vc, ql, kl, table = paged_case(7, num_seqs=3, block_size=4, hq=4, hk=2, d=16, over=True)
    ours = ref_paged_attn(query, kc, vc, ql, kl, table, 0.25)
    ref = vllm_ref(query, kc, vc, ql, kl, table, 0.25)
    empty = ql[0] - int(kl[0])
    assert torch.isnan(ref[:empty]).all()          # vLLM's reference: NaN
    assert (ours[:empty] == 0).all()               # here: 0 (attnlib's convention)
    pabs = vllm_ref(query, kc, vc, ql, kl, table, 0.25, absolute=True)
    close_to(ours[empty:], ref[empty:], pabs[empty:])


def test_vllm_numpy_inputs():
    query, kc, vc, ql, kl, table = paged_case(3, num_seqs=2, block_size=16, hq=4, hk=2, d=32)
    ours = ref_paged_attn(query.numpy(), kc.numpy(), vc.numpy(), ql, kl.numpy(), table.numpy(), 0.2,
                          sliding_window=5)
    assert isinstance(ours, np.ndarray) and ours.dtype == np.float64
    ref = vllm_ref(query, kc, vc, ql, kl, table, 0.2, 5)
    close_to(ours, ref, vllm_ref(query, kc, vc, ql, kl, table, 0.2, 5, absolute=True))


# ---------------------------------------------------------------------------------------------
# vLLM: the twin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_twin_passes_correct_kernels(dtype):
    query, kc, vc, ql, kl, table = paged_case(11, num_seqs=3, block_size=16, hq=8, hk=2, d=64, dtype=dtype)
    for sw, cap in ((None, None), (6, None), (None, 4.0)):
        out = vllm_ref(query, kc, vc, ql, kl, table, 0.125, sw, cap, dtype=dtype).to(dtype)
        assert_ref_paged_attn_close(out, query, kc, vc, ql, kl, table, 0.125, sliding_window=sw, soft_cap=cap)


def test_vllm_twin_empty_rows_must_be_zero():
    query, kc, vc, ql, kl, table = paged_case(12, num_seqs=2, block_size=4, hq=4, hk=2, d=16, over=True,
                                              dtype=torch.float32)
    out = ref_paged_attn(query, kc, vc, ql, kl, table, 0.25).float()
    assert_ref_paged_attn_close(out, query, kc, vc, ql, kl, table, 0.25)
    nan_rows = vllm_ref(query, kc, vc, ql, kl, table, 0.25, dtype=torch.float32)  # NaN rows: fail
    with pytest.raises(AssertionError):
        assert_ref_paged_attn_close(nan_rows, query, kc, vc, ql, kl, table, 0.25)


@pytest.mark.parametrize("defect", ["window_sw_plus_1", "top_left", "scale"])
def test_vllm_twin_fails_wrong_kernels(defect):
    query, kc, vc, ql, kl, table = paged_case(13, num_seqs=3, block_size=5, hq=4, hk=2, d=32, dtype=torch.float32)
    ql = [max(q, 3) for q in ql]
    query = torch.randn(sum(ql), 4, 32, generator=torch.Generator().manual_seed(5)).float()
    kl = torch.maximum(kl, torch.tensor(ql, dtype=torch.int32) + 2)
    sw = 3 if defect == "window_sw_plus_1" else None
    kw = dict(dtype=torch.float32)
    if defect == "window_sw_plus_1":
        bad = vllm_ref(query, kc, vc, ql, kl, table, 0.2, sw + 1, **kw)
    elif defect == "top_left":
        bad = vllm_ref(query, kc, vc, ql, kl, table, 0.2, top_left=True, **kw)
    else:
        bad = vllm_ref(query, kc, vc, ql, kl, table, 0.2 * 1.05, **kw)
    with pytest.raises(AssertionError):
        assert_ref_paged_attn_close(bad.float(), query, kc, vc, ql, kl, table, 0.2, sliding_window=sw)


def test_vllm_bad_arguments():
    query, kc, vc, ql, kl, table = paged_case(14, num_seqs=2, block_size=4, hq=4, hk=2, d=16)
    with pytest.raises(ValueError, match="sum\\(query_lens\\)"):
        ref_paged_attn(query[:-1], kc, vc, ql, kl, table, 0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        ref_paged_attn(query, kc, vc, ql, kl, table, 0.1, sliding_window=0)
    with pytest.raises(TypeError, match="sliding_window"):
        ref_paged_attn(query, kc, vc, ql, kl, table, 0.1, sliding_window=2.0)
    with pytest.raises(ValueError, match="soft_cap"):
        ref_paged_attn(query, kc, vc, ql, kl, table, 0.1, soft_cap=-1.0)
    assert torch.equal(ref_paged_attn(query, kc, vc, ql, kl, table, 0.1, soft_cap=0.0),  # 0: no cap
                       ref_paged_attn(query, kc, vc, ql, kl, table, 0.1))
    with pytest.raises(ValueError, match="block_tables"):
        ref_paged_attn(query, kc, vc, ql, kl, table[:1], 0.1)
    with pytest.raises(ValueError, match="query_lens and kv_lens"):
        ref_paged_attn(query, kc, vc, ql, kl[:1], table, 0.1)
    with pytest.raises(TypeError, match="query_lens"):
        ref_paged_attn(query, kc, vc, [float(x) for x in ql], kl, table, 0.1)
    with pytest.raises(ValueError, match="kv_lens|cache_seqlens|max_blocks"):
        ref_paged_attn(query, kc, vc, ql, kl + 1000, table, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        ref_paged_attn(query[:, :3], kc, vc, ql, kl, table, 0.1)
    with pytest.raises(TypeError, match="scale"):
        ref_paged_attn(query, kc, vc, ql, kl, table, None)
    with pytest.raises(TypeError, match="causal"):
        assert_ref_paged_attn_close(query, query, kc, vc, ql, kl, table, 0.1, causal=False)


# ---------------------------------------------------------------------------------------------
# FlashInfer's definitions, transcribed (dense, computed in `dtype`)


def fi_slopes(n_heads):  # flashinfer/utils.py get_alibi_slopes
    n = 2 ** math.floor(math.log2(n_heads))
    m_0 = 2.0 ** (-8.0 / n)
    m = torch.pow(m_0, torch.arange(1, 1 + n))
    if n < n_heads:
        m_hat_0 = 2.0 ** (-4.0 / n)
        m_hat = torch.pow(m_hat_0, torch.arange(1, 1 + 2 * (n_heads - n), 2))
        m = torch.cat([m, m_hat])
    return m.float()


def fi_rope(x, pos, rope_scale=1.0, rope_theta=1e4, interleaved=False):
    """x (S, H, D) float64 rotated at pos (S,): non-interleaved halves (pos_enc.cuh)."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(d):
        if interleaved:  # the wrong (GPT-J) pairing: (2k, 2k+1)
            freq = (1 / rope_scale) * (1 / rope_theta) ** (2 * (i // 2) / d)
            partner, sign = (i + 1, -1.0) if i % 2 == 0 else (i - 1, 1.0)
        else:
            freq = (1 / rope_scale) * (1 / rope_theta) ** (2 * (i % (d // 2)) / d)
            partner, sign = (i + d // 2, -1.0) if i < d // 2 else (i - d // 2, 1.0)
        ang = torch.as_tensor(pos, dtype=torch.float64)[:, None] * freq
        out[..., i] = x[..., i] * torch.cos(ang) + sign * x[..., partner] * torch.sin(ang)
    return out


def fi_dense(q, k, v, *, causal=False, window_left=-1, sm_scale=None, cap=0.0, mode="NONE", rope_scale=1.0,
             rope_theta=1e4, mask=None, sinks=None, dtype=torch.float64, absolute=False, interleaved=False,
             window_exclusive=False, head_q=None, head_out=None):
    """FlashInfer's attention of one request: q (qo, Hq, D), k/v (kv, Hk, D) NHD; returns
    out (qo, Hq, Dv) and the base-2 lse (qo, Hq), in `dtype` (float32 scores for low types)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    qo, hq, d = q.shape
    kv, hk = k.shape[:2]
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    q, k, v = (x.to(dtype).to(work) for x in (q, k, v))
    if mode == "ROPE_LLAMA":
        q = fi_rope(q.double(), torch.arange(qo) + kv - qo, rope_scale, rope_theta, interleaved).to(dtype).to(work)
        k = fi_rope(k.double(), torch.arange(kv), rope_scale, rope_theta, interleaved).to(dtype).to(work)
    if head_q is not None:
        q = q * torch.as_tensor(head_q, dtype=work)[None, :, None]
    if absolute:
        v = v.abs()
    g = hq // hk
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    x = torch.einsum("qhd,khd->hqk", q, k)
    i = torch.arange(qo)[:, None]
    j = torch.arange(kv)[None, :]
    if mode == "ALIBI":  # variants.cuh: logits * sm_scale + slope * (kv_idx - qo_idx), then the cap
        s = x * sm_scale + fi_slopes(hq).to(work)[:, None, None] * (j - i).to(work)
        if cap:
            s = torch.tanh(s * (sm_scale / cap)) * cap
    else:
        s = x * sm_scale
        if cap:
            s = cap * torch.tanh(s / cap)
    keep = torch.ones(qo, kv, dtype=torch.bool)
    if mask is not None:
        keep = torch.as_tensor(mask)
    elif causal:
        keep = ~(j + qo > kv + i)
    if window_left >= 0:
        keep = keep & ((j + qo + window_left > kv + i) if window_exclusive else (j + qo + window_left >= kv + i))
    s = s.masked_fill(~keep[None], -math.inf)
    if sinks is not None:
        s = torch.cat([s, torch.as_tensor(sinks, dtype=work)[:, None, None].expand(hq, qo, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
    if sinks is not None:
        p = p[..., :-1]
    out = torch.einsum("hqk,khd->qhd", p.to(dtype).to(work), v)
    if head_out is not None:
        out = out * torch.as_tensor(head_out, dtype=work)[None, :, None]
    return out.to(dtype), (lse / LN2).t().contiguous().to(torch.float32 if dtype != torch.float64 else dtype)


def pack_little(masks):
    """segment_packbits(bitorder="little"): each request's row-major mask on whole bytes."""
    return torch.as_tensor(np.concatenate([np.packbits(np.asarray(m).reshape(-1), bitorder="little")
                                           for m in masks]).astype(np.uint8))


def fi_batch(requests, **kw):
    """fi_dense over requests [(q, k, v, mask)], concatenated: (out, lse)."""
    outs, lses = [], []
    for q, k, v, mask in requests:
        o, lse = fi_dense(q, k, v, mask=mask, **kw)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def lse_close(ours, ref, tol=1e-13):
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    both_inf = torch.isneginf(ours) & torch.isneginf(ref)
    assert (torch.isneginf(ours) == torch.isneginf(ref)).all()
    err = torch.where(both_inf, torch.zeros_like(ours), (ours - ref).abs())
    assert (err <= tol * (1 + ref.abs().nan_to_num(0, 0, 0))).all(), float(err.max())


def rand(g, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------------------------------------
# FlashInfer single prefill / decode: equality


SINGLE_OPTIONS = [
    dict(),
    dict(causal=True),
    dict(causal=True, window_left=3),
    dict(window_left=0),
    dict(logits_soft_cap=2.0, sm_scale=0.3),
    dict(pos_encoding_mode="ALIBI", causal=True),
    dict(pos_encoding_mode="ALIBI", logits_soft_cap=3.0),
    dict(pos_encoding_mode="ROPE_LLAMA", causal=True),
    dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=500.0, window_left=4),
    dict(custom_mask=True),
    dict(custom_mask=True, pos_encoding_mode="ALIBI", window_left=5),
    dict(packed_custom_mask=True, pos_encoding_mode="ROPE_LLAMA"),
]


def _fi_kw(opts):
    """The dense definition's keywords of a FlashInfer call's options."""
    return dict(causal=opts.get("causal", False), window_left=opts.get("window_left", -1),
                sm_scale=opts.get("sm_scale"), cap=opts.get("logits_soft_cap") or 0.0,
                mode=opts.get("pos_encoding_mode", "NONE"), rope_scale=opts.get("rope_scale", 1.0),
                rope_theta=opts.get("rope_theta", 1e4))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("case", range(len(SINGLE_OPTIONS)))
def test_single_prefill_equals_definition(case, layout):
    g = torch.Generator().manual_seed(case)
    d = (16, 32, 64, 128)[case % 4]
    qo, kv, hq, hk = 7, 13 + case, 4 * (1 + case % 2), 2
    q, k, v = rand(g, qo, hq, d), rand(g, kv, hk, d), rand(g, kv, hk, d)
    opts = dict(SINGLE_OPTIONS[case])
    mask = None
    if opts.pop("custom_mask", False):
        mask = torch.rand(qo, kv, generator=g) > 0.5
        mask[2] = False  # a row with no key
        opts["custom_mask"] = mask
    if opts.pop("packed_custom_mask", False):
        mask = torch.rand(qo, kv, generator=g) > 0.4
        opts["packed_custom_mask"] = pack_little([mask])
    kin, vin = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    out, lse = fi.single_prefill_with_kv_cache(q, kin, vin, kv_layout=layout, return_lse=True, **opts)
    ref, ref_lse = fi_dense(q, k, v, mask=mask, **_fi_kw(opts))
    pabs, _ = fi_dense(q, k, v, mask=mask, absolute=True, **_fi_kw(opts))
    assert out.shape == (qo, hq, d) and lse.shape == (qo, hq)
    close_to(out, ref, pabs)
    lse_close(lse, ref_lse)
    only = fi.single_prefill_with_kv_cache(q, kin, vin, kv_layout=layout, **opts)
    assert torch.equal(only, out)


@pytest.mark.parametrize("opts", [dict(), dict(window_left=2), dict(logits_soft_cap=1.5),
                                  dict(pos_encoding_mode="ALIBI"), dict(pos_encoding_mode="ROPE_LLAMA"),
                                  dict(pos_encoding_mode="ROPE_LLAMA", window_left=0, rope_theta=1e5)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode_equals_definition(opts, layout):
    g = torch.Generator().manual_seed(len(opts) * 7 + len(layout))
    kv, hq, hk, d = 19, 8, 2, 64
    q, k, v = rand(g, hq, d), rand(g, kv, hk, d), rand(g, kv, hk, d)
    kin, vin = (k, v) if layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
    out, lse = fi.single_decode_with_kv_cache(q, kin, vin, kv_layout=layout, return_lse=True, **opts)
    assert out.shape == (hq, d) and lse.shape == (hq,)
    ref, ref_lse = fi_dense(q[None], k, v, **_fi_kw(opts))
    pabs, _ = fi_dense(q[None], k, v, absolute=True, **_fi_kw(opts))
    close_to(out, ref[0], pabs[0])
    lse_close(lse, ref_lse[0])


def test_scales_fold_as_flashinfer_does():
    g = torch.Generator().manual_seed(3)
    qo, kv, hq, hk, d = 5, 9, 4, 2, 32
    q, k, v = rand(g, qo, hq, d), rand(g, kv, hk, d), rand(g, kv, hk, d)
    sq, sk, sv = torch.rand(hq, generator=g) + 0.5, torch.rand(hk, generator=g) + 0.5, torch.rand(hk, generator=g) + .5
    out, lse = fi.single_prefill_with_kv_cache(q, k, v, scale_q=sq, scale_k=sk, scale_v=sv, k_scale=0.7, v_scale=1.3,
                                               causal=True, return_lse=True)
    head_q = sq.double() * sk.double().repeat_interleave(2)
    head_out = sv.double().repeat_interleave(2) * 1.3
    ref, ref_lse = fi_dense(q, k, v, causal=True, sm_scale=d ** -0.5 * 0.7, head_q=head_q, head_out=head_out)
    pabs, _ = fi_dense(q, k, v, causal=True, sm_scale=d ** -0.5 * 0.7, head_q=head_q, head_out=head_out,
                       absolute=True)
    close_to(out, ref, pabs)
    lse_close(lse, ref_lse)
    out, lse = fi.single_decode_with_kv_cache(q[0], k, v, q_scale=0.5, k_scale=3.0, v_scale=2.0, return_lse=True)
    ref, ref_lse = fi_dense(q[:1], k, v, sm_scale=d ** -0.5 * 1.5)
    close_to(out, 2.0 * ref[0], 2.0 * fi_dense(q[:1], k, v, sm_scale=d ** -0.5 * 1.5, absolute=True)[0][0])
    lse_close(lse, ref_lse[0])


def test_slopes_are_flashinfers():
    for n in (1, 3, 8, 12, 32):
        assert torch.equal(fi.get_alibi_slopes(n), fi_slopes(n).double())


# ---------------------------------------------------------------------------------------------
# FlashInfer batch wrappers: equality


def paged_fi_case(seed, *, batch, page_size, hq, hk, d, layout="NHD", five_d=False, short_kv=False):
    """Random requests over a shuffled page pool: (qo_indptr, kv_indptr, indices, last, q, cache, requests)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    kv_lens = rng.integers(1, 30, batch)
    qo_lens = rng.integers(0 if batch > 2 else 1, 9, batch)
    if short_kv:  # kv_len < qo_len: causal rows with no key
        kv_lens[0], qo_lens[0] = 2, 6
    pages_per = -(-kv_lens // page_size)
    num_pages = int(pages_per.sum()) + 4
    perm = rng.permutation(num_pages)
    kv_indptr = np.concatenate([[0], np.cumsum(pages_per)])
    indices = perm[:kv_indptr[-1]]
    last = kv_lens - (pages_per - 1) * page_size
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    kc, vc = rand(g, num_pages, page_size, hk, d), rand(g, num_pages, page_size, hk, d)
    q = rand(g, int(qo_indptr[-1]), hq, d)
    reqs = []
    for b in range(batch):
        pages = indices[kv_indptr[b]:kv_indptr[b + 1]]
        k = kc[torch.as_tensor(pages)].reshape(-1, hk, d)[:kv_lens[b]]
        v = vc[torch.as_tensor(pages)].reshape(-1, hk, d)[:kv_lens[b]]
        reqs.append((q[qo_indptr[b]:qo_indptr[b + 1]], k, v, None))
    if layout == "HND":
        kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    cache = torch.stack([kc, vc], dim=1) if five_d else (kc, vc)
    t = lambda x: torch.as_tensor(x, dtype=torch.int32)  # noqa: E731
    return t(qo_indptr), t(kv_indptr), t(indices), t(last), q, cache, reqs


PAGED_OPTIONS = [
    dict(page_size=16, opts=dict(causal=True), short_kv=True),
    dict(page_size=1, opts=dict(causal=True, window_left=2)),
    dict(page_size=5, opts=dict(), layout="HND"),
    dict(page_size=3, opts=dict(causal=True, logits_soft_cap=4.0), five_d=True),
    dict(page_size=7, opts=dict(causal=True, pos_encoding_mode="ALIBI"), layout="HND", five_d=True),
    dict(page_size=16, opts=dict(causal=True, pos_encoding_mode="ROPE_LLAMA", rope_theta=1e3), short_kv=True),
    dict(page_size=4, opts=dict(custom_mask=True, window_left=6)),
    dict(page_size=6, opts=dict(packed_custom_mask=True, pos_encoding_mode="ALIBI"), layout="HND"),
]


@pytest.mark.parametrize("case", range(len(PAGED_OPTIONS)))
def test_batch_paged_prefill_equals_definition(case):
    c = PAGED_OPTIONS[case]
    d = (16, 32, 64, 128)[case % 4]
    hq, hk = (8, 2) if case % 2 else (4, 4)
    qo_indptr, kv_indptr, indices, last, q, cache, reqs = paged_fi_case(
        case, batch=4, page_size=c["page_size"], hq=hq, hk=hk, d=d, layout=c.get("layout", "NHD"),
        five_d=c.get("five_d", False), short_kv=c.get("short_kv", False))
    opts = dict(c["opts"])
    g = torch.Generator().manual_seed(case)
    if opts.pop("custom_mask", False) or opts.get("packed_custom_mask"):
        masks = [torch.rand(r[0].shape[0], r[1].shape[0], generator=g) > 0.5 for r in reqs]
        reqs = [(qq, kk, vv, m) for (qq, kk, vv, _), m in zip(reqs, masks)]
        if opts.pop("packed_custom_mask", False):
            opts["packed_custom_mask"] = pack_little(masks)
        else:
            opts["custom_mask"] = torch.cat([m.reshape(-1) for m in masks])
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), c.get("layout", "NHD"))
    w.plan(qo_indptr, kv_indptr, indices, last, hq, hk, d, c["page_size"], **opts)
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = fi_batch(reqs, **_fi_kw(opts))
    pabs, _ = fi_batch([(a, b, cc.abs(), m) for a, b, cc, m in reqs], **_fi_kw(opts))
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    close_to(out, ref, pabs)
    lse_close(lse, ref_lse)
    if c.get("short_kv") and opts.get("causal"):  # rows with no key: 0 and -inf
        assert (out[:4] == 0).all() and torch.isneginf(lse[:4]).all()
    assert torch.equal(w.run_return_lse(q, cache)[1], lse)


def test_batch_paged_forward_alias_and_window_override():
    qo_indptr, kv_indptr, indices, last, q, cache, reqs = paged_fi_case(21, batch=3, page_size=4, hq=4, hk=2, d=32)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(None)
    w.begin_forward(qo_indptr, kv_indptr, indices, last, 4, 2, 32, 4, causal=True)
    # forward resets the options to its own arguments (FlashInfer's deprecated path)
    out = w.forward(q, cache, causal=True, window_left=3)
    ref, _ = fi_batch(reqs, causal=True, window_left=3)
    close_to(out, ref, fi_batch([(a, b, c.abs(), m) for a, b, c, m in reqs], causal=True, window_left=3)[0])
    w.plan(qo_indptr, kv_indptr, indices, last, 4, 2, 32, 4, causal=True)
    out = w.run(q, cache, window_left=1)
    ref, _ = fi_batch(reqs, causal=True, window_left=1)
    close_to(out, ref, fi_batch([(a, b, c.abs(), m) for a, b, c, m in reqs], causal=True, window_left=1)[0])


def test_batch_paged_sinks_out():
    qo_indptr, kv_indptr, indices, last, q, cache, reqs = paged_fi_case(22, batch=3, page_size=4, hq=4, hk=2, d=16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    w = fi.BatchPrefillWithPagedKVCacheWrapper(None)
    w.plan(qo_indptr, kv_indptr, indices, last, 4, 2, 16, 4, causal=True)
    out = w.run(q, cache, sinks=sinks)
    ref, _ = fi_batch(reqs, causal=True, sinks=sinks)
    close_to(out, ref, fi_batch([(a, b, c.abs(), m) for a, b, c, m in reqs], causal=True, sinks=sinks)[0])


RAGGED_OPTIONS = [dict(causal=True), dict(causal=True, pos_encoding_mode="ROPE_LLAMA", window_left=4),
                  dict(pos_encoding_mode="ALIBI", logits_soft_cap=8.0), dict(custom_mask=True)]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("case", range(len(RAGGED_OPTIONS)))
def test_batch_ragged_prefill_equals_definition(case, layout):
    g = torch.Generator().manual_seed(40 + case)
    hq, hk, d = 6, 2, 32
    qo_lens, kv_lens = [3, 0, 5, 2], [7, 4, 5, 9]
    qs = [rand(g, n, hq, d) for n in qo_lens]
    ks = [rand(g, n, hk, d) for n in kv_lens]
    vs = [rand(g, n, hk, d) for n in kv_lens]
    opts = dict(RAGGED_OPTIONS[case])
    masks = [None] * 4
    if opts.pop("custom_mask", False):
        masks = [torch.rand(a, b, generator=g) > 0.5 for a, b in zip(qo_lens, kv_lens)]
        opts["custom_mask"] = torch.cat([m.reshape(-1) for m in masks])
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    t = lambda x: torch.as_tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32)  # noqa: E731
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(None, layout)
    w.plan(t(qo_lens), t(kv_lens), hq, hk, d, **opts)
    kin, vin = (k, v) if layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
    out, lse = w.run(q, kin, vin, return_lse=True)
    ref, ref_lse = fi_batch(list(zip(qs, ks, vs, masks)), **_fi_kw(opts))
    pabs, _ = fi_batch(list(zip(qs, ks, [x.abs() for x in vs], masks)), **_fi_kw(opts))
    close_to(out, ref, pabs)
    lse_close(lse, ref_lse)


@pytest.mark.parametrize("opts", [dict(), dict(window_left=3), dict(pos_encoding_mode="ALIBI"),
                                  dict(pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=5.0)])
@pytest.mark.parametrize("page_size,layout", [(1, "NHD"), (16, "HND"), (5, "NHD")])
def test_batch_decode_equals_definition(opts, page_size, layout):
    qo_indptr, kv_indptr, indices, last, q, cache, reqs = paged_fi_case(
        50 + page_size, batch=4, page_size=page_size, hq=8, hk=2, d=64, layout=layout)
    g = torch.Generator().manual_seed(page_size)
    qd = rand(g, 4, 8, 64)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(None, layout)
    w.plan(kv_indptr, indices, last, 8, 2, 64, page_size, **opts)
    out, lse = w.run(qd, cache, return_lse=True)
    assert out.shape == (4, 8, 64) and lse.shape == (4, 8)
    reqs = [(qd[b:b + 1], k, v, None) for b, (_, k, v, _) in enumerate(reqs)]
    ref, ref_lse = fi_batch(reqs, **_fi_kw(opts))
    pabs, _ = fi_batch([(a, b, c.abs(), m) for a, b, c, m in reqs], **_fi_kw(opts))
    close_to(out, ref, pabs)
    lse_close(lse, ref_lse)


def test_batch_decode_legacy_positional_plan_and_forward():
    qo_indptr, kv_indptr, indices, last, q, cache, reqs = paged_fi_case(60, batch=3, page_size=4, hq=4, hk=4, d=16)
    qd = rand(torch.Generator().manual_seed(1), 3, 4, 16)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", use_tensor_cores=True)
    w.plan(kv_indptr, indices, last, 4, 4, 16, 4, "ALIBI")  # vLLM passes the mode positionally
    a = w.run(qd, cache)
    b = w.forward(qd, cache, pos_encoding_mode="ALIBI")
    assert torch.equal(a, b)
    ref, _ = fi_batch([(qd[i:i + 1], k, v, None) for i, (_, k, v, _) in enumerate(reqs)], mode="ALIBI")
    close_to(a, ref, fi_batch([(qd[i:i + 1], k, v.abs(), None) for i, (_, k, v, _) in enumerate(reqs)],
                              mode="ALIBI")[0])


def test_inputs_never_modified_and_numpy_kind():
    qo_indptr, kv_indptr, indices, last, q, cache, reqs = paged_fi_case(61, batch=3, page_size=4, hq=4, hk=2, d=16)
    before = [x.clone() for x in (q, *cache)]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(None)
    w.plan(qo_indptr, kv_indptr, indices, last, 4, 2, 16, 4, causal=True, pos_encoding_mode="ROPE_LLAMA")
    w.run(q, cache, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, *cache)))
    out_np, lse_np = w.run(q.numpy(), tuple(x.numpy() for x in cache), return_lse=True)
    assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float64
    lse_close(torch.as_tensor(lse_np), w.run(q, cache, return_lse=True)[1])  # numpy's and torch's roundings


# ---------------------------------------------------------------------------------------------
# FlashInfer twins: correct low-precision kernels pass, named defects fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [dict(causal=True, window_left=5), dict(pos_encoding_mode="ROPE_LLAMA", causal=True),
                                  dict(pos_encoding_mode="ALIBI", logits_soft_cap=6.0)])
def test_single_prefill_twin_passes_correct_kernels(dtype, opts):
    g = torch.Generator().manual_seed(70)
    q, k, v = rand(g, 24, 8, 64, dtype=dtype), rand(g, 40, 2, 64, dtype=dtype), rand(g, 40, 2, 64, dtype=dtype)
    out, lse = fi_dense(q, k, v, dtype=dtype, **_fi_kw(opts))
    if dtype == torch.float32 and opts.get("pos_encoding_mode") == "ROPE_LLAMA":  # refused: see the contract
        with pytest.raises(ValueError, match="float32"):
            fi.assert_single_prefill_close(out, q, k, v, **opts)
        return
    fi.assert_single_prefill_close((out, lse), q, k, v, return_lse=True, **opts)
    fi.assert_single_prefill_close(out, q, k, v, **opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_twins_pass_correct_kernels(dtype):
    qo_indptr, kv_indptr, indices, last, q, cache, reqs = paged_fi_case(71, batch=4, page_size=16, hq=8, hk=2, d=64,
                                                                        short_kv=True)
    q, cache = q.to(dtype), tuple(x.to(dtype) for x in cache)
    reqs = [(a.to(dtype), b.to(dtype), c.to(dtype), m) for a, b, c, m in reqs]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(None)
    rope = dtype != torch.float32  # a float32 kernel's RoPE is refused by the twins
    for opts in (dict(causal=True), dict(causal=True, pos_encoding_mode="ROPE_LLAMA"),
                 dict(causal=True, pos_encoding_mode="ALIBI", window_left=4)):
        if opts.get("pos_encoding_mode") == "ROPE_LLAMA" and not rope:
            continue
        w.plan(qo_indptr, kv_indptr, indices, last, 8, 2, 64, 16, **opts)
        out, lse = fi_batch(reqs, dtype=dtype, **_fi_kw(opts))
        w.assert_close((out, lse), q, cache)
    if not rope:
        return
    wd = fi.BatchDecodeWithPagedKVCacheWrapper(None)
    wd.plan(kv_indptr, indices, last, 8, 2, 64, 16, pos_encoding_mode="ROPE_LLAMA")
    qd = q[:4]
    out, lse = fi_batch([(qd[b:b + 1], k, v, None) for b, (_, k, v, _) in enumerate(reqs)], dtype=dtype,
                        mode="ROPE_LLAMA")
    wd.assert_close((out, lse), qd, cache)


def test_single_decode_twin():
    g = torch.Generator().manual_seed(72)
    q, k, v = rand(g, 8, 64, dtype=torch.float32), rand(g, 50, 2, 64, dtype=torch.float32), \
        rand(g, 50, 2, 64, dtype=torch.float32)
    out, lse = fi_dense(q[None], k, v, dtype=torch.float32, window_left=9)
    fi.assert_single_decode_close((out[0], lse[0]), q, k, v, window_left=9, return_lse=True)
    bad, _ = fi_dense(q[None], k, v, dtype=torch.float32, window_left=9, window_exclusive=True)
    with pytest.raises(AssertionError):
        fi.assert_single_decode_close(bad[0], q, k, v, window_left=9)


def _masked_problem(seed, dtype=torch.float32):
    qo_indptr, kv_indptr, indices, last, q, cache, reqs = paged_fi_case(seed, batch=3, page_size=5, hq=4, hk=2, d=32)
    g = torch.Generator().manual_seed(seed)
    masks = [torch.rand(r[0].shape[0], r[1].shape[0], generator=g) > 0.5 for r in reqs]
    q, cache = q.to(dtype), tuple(x.to(dtype) for x in cache)
    reqs = [(a.to(dtype), b.to(dtype), c.to(dtype), m) for (a, b, c, _), m in zip(reqs, masks)]
    return qo_indptr, kv_indptr, indices, last, q, cache, reqs, masks


def test_packed_mask_twin_and_big_endian_defect():
    qo_indptr, kv_indptr, indices, last, q, cache, reqs, masks = _masked_problem(73)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(None)
    w.plan(qo_indptr, kv_indptr, indices, last, 4, 2, 32, 5, packed_custom_mask=pack_little(masks))
    out, lse = fi_batch(reqs, dtype=torch.float32)
    w.assert_close((out, lse), q, cache)
    # a kernel reading each byte big-endian
    packed = pack_little(masks).numpy()
    offset, wrong = 0, []
    for m in masks:
        n = m.numel()
        bits = np.unpackbits(packed[offset:offset + -(-n // 8)], bitorder="big")[:n].reshape(m.shape)
        wrong.append(torch.as_tensor(bits.astype(bool)))
        offset += -(-n // 8)
    bad, _ = fi_batch([(a, b, c, m) for (a, b, c, _), m in zip(reqs, wrong)], dtype=torch.float32)
    with pytest.raises(AssertionError):
        w.assert_close(bad, q, cache)


@pytest.mark.parametrize("defect", ["window_exclusive", "lse_base_e", "lse_transposed", "rope_interleaved",
                                    "last_page_len_off_by_one", "causal_top_left", "alibi_bottom_right_lse"])
def test_batch_twin_fails_named_defects(defect):
    qo_indptr, kv_indptr, indices, last, q, cache, reqs = paged_fi_case(74, batch=3, page_size=4, hq=4, hk=2, d=32)
    dt = torch.bfloat16 if defect == "rope_interleaved" else torch.float32  # float32 RoPE: refused
    q, cache = q.to(dt), tuple(x.to(dt) for x in cache)
    reqs = [(a.to(dt), b.to(dt), c.to(dt), m) for a, b, c, m in reqs]
    opts = dict(causal=True, window_left=3)
    if defect == "rope_interleaved":
        opts = dict(causal=True, pos_encoding_mode="ROPE_LLAMA")
    if defect == "alibi_bottom_right_lse":
        opts = dict(causal=True, pos_encoding_mode="ALIBI")
    w = fi.BatchPrefillWithPagedKVCacheWrapper(None)
    w.plan(qo_indptr, kv_indptr, indices, last, 4, 2, 32, 4, **opts)
    kw = dict(dtype=dt, **_fi_kw(opts))
    out, lse = fi_batch(reqs, **kw)
    w.assert_close((out, lse), q, cache)  # the correct kernel passes
    if defect == "window_exclusive":
        result = fi_batch(reqs, window_exclusive=True, **kw)
    elif defect == "lse_base_e":
        result = (out, lse * LN2)
    elif defect == "lse_transposed":
        result = (out, lse.t().contiguous())
    elif defect == "rope_interleaved":
        result = fi_batch(reqs, interleaved=True, **kw)
    elif defect == "last_page_len_off_by_one":
        result = fi_batch([(a, b[:-1], c[:-1], m) if i == 1 else (a, b, c, m) for i, (a, b, c, m) in enumerate(reqs)],
                          **kw)
    elif defect == "causal_top_left":
        result = fi_batch([(a, b[:a.shape[0]], c[:a.shape[0]], m) for a, b, c, m in reqs], **kw)
    else:  # the bottom-right ALiBi -slope |p - j|: the same out, an LSE shifted by slope (kv - qo)
        shift = torch.cat([fi_slopes(4)[None, :] * (b.shape[0] - a.shape[0]) / LN2 * torch.ones(a.shape[0], 1)
                           for a, b, c, m in reqs])
        result = (out, lse - shift)
    with pytest.raises(AssertionError):
        w.assert_close(result, q, cache)


def test_lse_transposed_when_square():
    g = torch.Generator().manual_seed(75)
    q, k, v = rand(g, 4, 4, 16, dtype=torch.float32), rand(g, 9, 4, 16, dtype=torch.float32), \
        rand(g, 9, 4, 16, dtype=torch.float32)
    out, lse = fi_dense(q, k, v, causal=True, dtype=torch.float32)
    fi.assert_single_prefill_close((out, lse), q, k, v, causal=True, return_lse=True)
    with pytest.raises(AssertionError):
        fi.assert_single_prefill_close((out, lse.t().contiguous()), q, k, v, causal=True, return_lse=True)


def test_ragged_twin():
    g = torch.Generator().manual_seed(76)
    q, k, v = rand(g, 8, 4, 32, dtype=torch.bfloat16), rand(g, 13, 2, 32, dtype=torch.bfloat16), \
        rand(g, 13, 2, 32, dtype=torch.bfloat16)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(None)
    w.plan(torch.tensor([0, 3, 8]), torch.tensor([0, 8, 13]), 4, 2, 32, causal=True, pos_encoding_mode="ALIBI")
    reqs = [(q[:3], k[:8], v[:8], None), (q[3:], k[8:], v[8:], None)]
    out, lse = fi_batch(reqs, dtype=torch.bfloat16, causal=True, mode="ALIBI")
    w.assert_close((out, lse), q, k, v)
    bad, _ = fi_batch(reqs, dtype=torch.bfloat16, causal=False, mode="ALIBI")
    with pytest.raises(AssertionError):
        w.assert_close(bad, q, k, v)


def test_scale_twins():
    g = torch.Generator().manual_seed(77)
    q, k, v = rand(g, 6, 4, 32, dtype=torch.float32), rand(g, 10, 2, 32, dtype=torch.float32), \
        rand(g, 10, 2, 32, dtype=torch.float32)
    sq, sk, sv = torch.tensor([0.5, 0.5, 2.0, 2.0]), torch.tensor([1.5, 0.25]), torch.tensor([3.0, 0.5])
    head_q = sq.double() * sk.double().repeat_interleave(2)
    out, _ = fi_dense(q, k, v, causal=True, dtype=torch.float32, sm_scale=32 ** -0.5 * 0.5, head_q=head_q,
                      head_out=sv.double().repeat_interleave(2) * 2.0)
    kw = dict(scale_q=sq, scale_k=sk, scale_v=sv, k_scale=0.5, v_scale=2.0, causal=True)
    fi.assert_single_prefill_close(out, q, k, v, **kw)
    with pytest.raises(AssertionError):  # the output scale applied twice
        fi.assert_single_prefill_close(out * 2.0, q, k, v, **kw)


# ---------------------------------------------------------------------------------------------
# FlashInfer: bad arguments


def test_flashinfer_bad_arguments():
    g = torch.Generator().manual_seed(80)
    q, k, v = rand(g, 4, 4, 16), rand(g, 6, 2, 16), rand(g, 6, 2, 16)
    sp = fi.single_prefill_with_kv_cache
    with pytest.raises(ValueError, match="kv_layout"):
        sp(q, k, v, kv_layout="NDH")
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        sp(q, k, v, pos_encoding_mode="ROPE")
    with pytest.raises(ValueError, match="window_left"):
        sp(q, k, v, window_left=-2)
    with pytest.raises(TypeError, match="custom_mask"):
        sp(q, k, v, custom_mask=torch.ones(4, 6))
    with pytest.raises(ValueError, match="custom_mask"):
        sp(q, k, v, custom_mask=torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="packed_custom_mask"):
        sp(q, k, v, packed_custom_mask=torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="kv_len"):
        sp(q, k[:2], v[:2], causal=True)
    with pytest.raises(ValueError, match="kv_cache_sf"):
        sp(q, k, v, kv_cache_sf=(k, v))
    with pytest.raises(ValueError, match="multiple"):
        sp(q[:, :3], k, v)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        sp(q, k, v, logits_soft_cap=-1.0)
    with pytest.raises(ValueError, match="scale_q"):
        sp(q, k, v, scale_q=torch.ones(3))
    with pytest.raises(ValueError, match="wrap"):
        sp(q, k[:2], v[:2], pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(TypeError, match="causal"):
        fi.assert_single_prefill_close(q, q, k, v, causal="yes")

    qo_indptr, kv_indptr, indices, last, qb, cache, _ = paged_fi_case(81, batch=2, page_size=4, hq=4, hk=2, d=16)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(None)
    with pytest.raises(RuntimeError, match="plan"):
        w.run(qb, cache)
    with pytest.raises(ValueError, match="last_page_len"):
        w.plan(qo_indptr, kv_indptr, indices, torch.zeros_like(last), 4, 2, 16, 4)
    with pytest.raises(ValueError, match="last_page_len"):
        w.plan(qo_indptr, kv_indptr, indices, last + 4, 4, 2, 16, 4)
    with pytest.raises(ValueError, match="indptr"):
        w.plan(qo_indptr.flip(0), kv_indptr, indices, last, 4, 2, 16, 4)
    with pytest.raises(ValueError, match="multiple"):
        w.plan(qo_indptr, kv_indptr, indices, last, 3, 2, 16, 4)
    with pytest.raises(ValueError, match="custom_mask"):
        w.plan(qo_indptr, kv_indptr, indices, last, 4, 2, 16, 4, custom_mask=torch.ones(3, dtype=torch.bool))
    w.plan(qo_indptr, kv_indptr, indices, last, 4, 2, 16, 4, causal=True)
    with pytest.raises(ValueError, match="page_size"):
        w.run(qb, (cache[0][:, :2], cache[1][:, :2]))
    with pytest.raises(ValueError, match="q must be"):
        w.run(qb[1:], cache)
    lse0 = w.run(qb, cache, return_lse=True)[1]  # FlashInfer's LSE includes the sink (its sink variant's m, d)
    lse_s = w.run(qb, cache, sinks=torch.zeros(4), return_lse=True)[1]
    assert torch.allclose(lse_s, torch.log2(torch.exp2(lse0) + 1.0), rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="sinks"):
        w.run(qb, cache, sinks=torch.zeros(3), return_lse=True)
    with pytest.raises(ValueError, match="skip_softmax"):
        w.run(qb, cache, skip_softmax_threshold_scale_factor=1.0)
    with pytest.raises(ValueError, match="positional"):
        w.run(qb, cache, torch.ones(4))
    with pytest.raises(TypeError, match="causal"):
        w.assert_close(qb, qb, cache, causal=False)
    with pytest.raises(ValueError, match="jit_args"):
        fi.BatchPrefillWithPagedKVCacheWrapper(None, jit_args=["x"])
    with pytest.raises(ValueError, match="multi-item|prefix_len_ptr"):
        w.plan(qo_indptr, kv_indptr, indices, last, 4, 2, 16, 4, prefix_len_ptr=torch.zeros(2))
    wr = fi.BatchPrefillWithRaggedKVCacheWrapper(None)
    wr.plan(torch.tensor([0, 4]), torch.tensor([0, 6]), 4, 2, 16)
    with pytest.raises(ValueError, match="q_scale"):
        wr.run(q, k, v, q_scale=2.0)
    with pytest.raises(ValueError, match="k and v"):
        wr.run(q, k[:5], v[:5])
    wd = fi.BatchDecodeWithPagedKVCacheWrapper(None)
    with pytest.raises(ValueError, match="q_len_per_req"):
        wd.plan(kv_indptr, indices, last, 4, 2, 16, 4, q_len_per_req=2)
    with pytest.raises(TypeError, match="multiple values"):
        wd.plan(kv_indptr, indices, last, 4, 2, 16, 4, "NONE", pos_encoding_mode="NONE")
