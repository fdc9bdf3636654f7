"""attnlib.compat's FlashAttention 2/3/4 references against FlashAttention's own test reference
(``flash_attn/cute/testing.py`` ``attention_ref``, transcribed below in float64 torch with
``upcast=False``) and its rotary reference (``apply_rotary_emb_torch``); their assert twins
pass correct low-precision kernels and fail wrong ones."""

import math

import numpy as np
import pytest
import torch

from attnlib.compat import flash_attn as fa2
from attnlib.compat import flash_attn_cute as fa4
from attnlib.compat import flash_attn_interface as fa3

TOL = 1e-13


# ---- FlashAttention's references, transcribed (float64, no upcast) ---------------------------

def positions(sq, sk, qpm, kpm, key_leftpad):
    """Rows, key columns counted from the left padding (before it: 2**32), and the lengths."""
    row = torch.arange(sq)[:, None]
    col = torch.arange(sk)
    if key_leftpad is not None:
        lp = key_leftpad.view(-1, 1, 1, 1)
        col = col.expand(lp.shape[0], 1, 1, sk)
        col = torch.where(col >= lp, col - lp, 2 ** 32)
    skk = sk if kpm is None else kpm.sum(-1).view(-1, 1, 1, 1)
    sqq = sq if qpm is None else qpm.sum(-1).view(-1, 1, 1, 1)
    return row, col, skk, sqq


def local_mask(sq, sk, window, sink_token_length=0, qpm=None, kpm=None, key_leftpad=None):
    row, col, skk, sqq = positions(sq, sk, qpm, kpm, key_leftpad)
    if window[0] is None:
        return col > row + skk - sqq + window[1]
    skk = torch.full_like(col, sk) if kpm is None else skk
    left = col > skk if window[1] is None else col > torch.minimum(row + skk - sqq + window[1], skk)
    return left | ((col < row + skk - sqq - window[0]) & (col >= sink_token_length))


def chunk_mask(sq, sk, chunk, qpm=None, kpm=None, key_leftpad=None):
    row, col, skk, sqq = positions(sq, sk, qpm, kpm, key_leftpad)
    skk = torch.full_like(col, sk) if kpm is None else skk
    start = row + skk - sqq - (row + skk - sqq) % chunk
    return (col < start) | (col >= start + chunk)


def attention_ref(q, k, v, qpm=None, kpm=None, key_leftpad=None, attn_bias=None, causal=False, qv=None,
                  window=(None, None), attention_chunk=0, learnable_sink=None, softcap=0.0, scale=None,
                  gather_kv_indices=None, dtype=torch.float64):
    """FA4's attention_ref in ``dtype`` (float64: the exact reference; lower: a correct kernel's
    error), with ``scale`` settable and ``P @ |V|`` returned beside (out, lse)."""
    if causal:
        window = (window[0], 0)
    q, k, v, qv = (None if t is None else t.to(dtype) for t in (q, k, v, qv))
    sq, sk = q.shape[1], v.shape[1]
    g = q.shape[2] // v.shape[2]
    k, v = (t.repeat_interleave(g, dim=2) for t in (k, v))
    d, dv = q.shape[-1], v.shape[-1]
    scale = 1.0 / math.sqrt(d if qv is None else d + dv) if scale is None else scale
    scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if qv is not None:
        scores = scores + torch.einsum("bthd,bshd->bhts", qv * scale, v)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if kpm is not None:
        scores = scores.masked_fill(~kpm[:, None, None, :], -math.inf)
    mask = None
    if window[0] is not None or window[1] is not None:
        mask = local_mask(sq, sk, window, 0, qpm, kpm, key_leftpad)
    if attention_chunk > 0:
        c = chunk_mask(sq, sk, attention_chunk, qpm, kpm, key_leftpad)
        mask = c if mask is None else mask | c
    if gather_kv_indices is not None:
        idx = gather_kv_indices.long().masked_fill((gather_kv_indices < 0) | (gather_kv_indices >= sk), sk)
        keep = torch.zeros(q.shape[0], sq, sk + 1, dtype=torch.bool).scatter_(-1, idx, True)[..., :sk]
        scores = scores.masked_fill(~keep[:, None], -math.inf)
    if mask is not None:
        scores = scores.masked_fill(mask, -math.inf)
    if attn_bias is not None:
        scores = scores + attn_bias
    lse = torch.logsumexp(scores, -1)
    if learnable_sink is not None:
        sink = learnable_sink.to(dtype).view(1, -1, 1)
        lse = torch.logaddexp(lse, sink.expand_as(lse))
        attention = torch.exp(scores - lse[..., None])
    else:
        attention = torch.softmax(scores, -1)
    attention = torch.nan_to_num(attention, nan=0.0)
    if qpm is not None:
        attention = attention.masked_fill(~qpm[:, None, :, None], 0.0)
    out = torch.einsum("bhts,bshd->bthd", attention, v)
    pv = torch.einsum("bhts,bshd->bthd", attention, v.abs())
    return out, lse, pv


def rotary_ref(x, cos, sin, interleaved):
    """flash_attn.layers.rotary.apply_rotary_emb_torch (cos/sin (b, s, rd/2) or (s, rd/2))."""
    rd = cos.shape[-1] * 2
    if interleaved:
        c, s = (t.repeat_interleave(2, -1).unsqueeze(-2) for t in (cos, sin))
        x1, x2 = x[..., :rd][..., ::2], x[..., :rd][..., 1::2]
        rot = torch.stack((-x2, x1), -1).flatten(-2)
    else:
        c, s = (torch.cat((t, t), -1).unsqueeze(-2) for t in (cos, sin))
        x1, x2 = x[..., :rd].chunk(2, -1)
        rot = torch.cat((-x2, x1), -1)
    return torch.cat((x[..., :rd] * c + rot * s, x[..., rd:]), -1)


def close(out, ref, pv, what=""):
    out = torch.as_tensor(np.asarray(out)) if not isinstance(out, torch.Tensor) else out
    err = (out - ref).abs()
    assert (err <= TOL * pv + 1e-300).all(), f"{what}: max err {err.max():.3g} vs P@|V| {pv.max():.3g}"


def lse_close(lse, ref, what=""):
    lse = torch.as_tensor(np.asarray(lse)) if not isinstance(lse, torch.Tensor) else lse
    both_inf = torch.isinf(lse) & torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), what
    fin = ~both_inf
    assert ((lse[fin] - ref[fin]).abs() <= TOL * (ref[fin].abs() + 1)).all(), what


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---- Equality with the references --------------------------------------------------------

CASES = [  # (b, sq, sk, hq, hk, d, dv)
    (2, 9, 9, 4, 2, 16, 16), (1, 1, 37, 8, 1, 64, 64), (2, 17, 5, 2, 2, 32, 16), (1, 33, 64, 6, 3, 128, 128),
    (3, 4, 30, 4, 4, 8, 24),
]
WINDOWS4 = [(None, None), (3, None), (None, 0), (2, 1), (None, -2), (-1, 4), (5, -1), (0, 0)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", WINDOWS4)
def test_fa4_func_equals_attention_ref(case, window):
    b, sq, sk, hq, hk, d, dv = case
    seed = hash((case, window)) % 2 ** 31
    q, k, v = rand(b, sq, hq, d, seed=seed), rand(b, sk, hk, d, seed=seed + 1), rand(b, sk, hk, dv, seed=seed + 2)
    for causal in (False, True):
        out, lse = fa4.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
        w = window
        if causal:
            w = (w[0], 0)
        if w[0] is not None and w[1] is not None and w[0] + w[1] < 0:  # FA4's interface: no window
            w = (None, None)
        ref, ref_lse, pv = attention_ref(q, k, v, causal=False, window=w)
        close(out, ref, pv, f"{case} {window} causal={causal}")
        lse_close(lse, ref_lse, f"{case} {window}")


@pytest.mark.parametrize("case", CASES[:3])
def test_fa4_options_equal_attention_ref(case):
    b, sq, sk, hq, hk, d, dv = case
    q, k, v = rand(b, sq, hq, d, seed=1), rand(b, sk, hk, d, seed=2), rand(b, sk, hk, dv, seed=3)
    qv, sink = rand(b, sq, hq, dv, seed=4), rand(hq, seed=5)
    idx = torch.randint(-1, sk + 2, (b, sq, 5), generator=torch.Generator().manual_seed(6))
    for kw, ref_kw in [({"softcap": 3.0, "causal": True}, {"softcap": 3.0, "causal": True}),
                       ({"qv": qv}, {"qv": qv}),
                       ({"learnable_sink": sink, "window_size": (2, 0)}, {"learnable_sink": sink, "window": (2, 0)}),
                       ({"gather_kv_indices": idx}, {"gather_kv_indices": idx}),
                       ({"softmax_scale": 0.3}, {"scale": 0.3})]:
        out, lse = fa4.flash_attn_func(q, k, v, return_lse=True, **kw)
        ref, ref_lse, pv = attention_ref(q, k, v, **ref_kw)
        close(out, ref, pv, str(kw.keys()))
        if "qv" in kw:  # FA4's LSE is (b, sq, hq) with qv
            lse = lse.transpose(1, 2)
        lse_close(lse, ref_lse, str(kw.keys()))


def fa23_window(window, causal, sk, version):
    """The reference's window of an FA2/FA3 call (-1 sentinels; FA2: a one-sided -1 right is seqlen_k)."""
    left, right = window
    if version == 2:
        left, right = (-1 if left >= sk else left), (-1 if right >= sk else right)
    if causal:
        right = 0
    if version == 2 and left >= 0 and right < 0:
        right = sk
    return (None if left < 0 else left, None if right < 0 else right)


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_fa2_fa3_func_windows_and_lse(version, case):
    b, sq, sk, hq, hk, d, dv = case
    q, k, v = rand(b, sq, hq, d, seed=7), rand(b, sk, hk, d, seed=8), rand(b, sk, hk, dv, seed=9)
    mod = fa2 if version == 2 else fa3
    for window in [(-1, -1), (3, -1), (-1, 2), (1, 1), (sk + 3, 0), (2, sk)]:
        for causal in (False, True):
            out, lse = mod.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                           return_attn_probs=True)[:2]
            ref, ref_lse, pv = attention_ref(q, k, v, window=fa23_window(window, causal, sk, version))
            close(out, ref, pv, f"FA{version} {window} {causal}")
            if version == 2:  # FA2's kernel: +inf on rows without a key
                ref_lse = torch.where(torch.isneginf(ref_lse), math.inf, ref_lse)
            lse_close(lse, ref_lse, f"FA{version} {window} {causal}")


def test_fa2_alibi_and_causal_lse_shift():
    b, sq, sk, hq, d = 2, 6, 11, 4, 16
    q, k, v = rand(b, sq, hq, d, seed=10), rand(b, sk, hq, d, seed=11), rand(b, sk, hq, d, seed=12)
    slopes = torch.rand(hq, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None]
    bias = -slopes.view(-1, 1, 1) * (i - j).abs()
    for causal in (False, True):
        out, lse, _ = fa2.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, return_attn_probs=True)
        ref, ref_lse, pv = attention_ref(q, k, v, causal=causal, attn_bias=bias)
        close(out, ref, pv)
        if causal:  # FA2's causal kernel adds slope * j: the LSE is slope * (i + sk - sq) larger
            ref_lse = ref_lse + slopes.view(-1, 1) * i.view(1, -1)
        lse_close(lse, ref_lse)
        fa2.assert_flash_attn_func_close((out.float(), lse.float(), None), q.float(), k.float(), v.float(),
                                         causal=causal, alibi_slopes=slopes)


def test_fa3_chunk_and_descale():
    """FA3 applies descales to float8_e4m3fn inputs (and ignores them on others, hopper/flash_api.cpp)."""
    b, sq, sk, hq, hk, d = 2, 12, 20, 4, 2, 16
    q, k, v = (rand(*s, seed=14 + i).to(torch.float8_e4m3fn) for i, s in enumerate([(b, sq, hq, d), (b, sk, hk, d),
                                                                                    (b, sk, hk, d)]))
    qd, kd, vd = (torch.rand(b, hk, dtype=torch.float32, generator=torch.Generator().manual_seed(s)) + 0.5
                  for s in (17, 18, 19))
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, attention_chunk=6, q_descale=qd, k_descale=kd,
                                   v_descale=vd, return_attn_probs=True)
    q64, k64, v64 = (x.double() for x in (q, k, v))
    qq = q64 * qd.double().repeat_interleave(hq // hk, 1)[:, None, :, None]
    ref, ref_lse, pv = attention_ref(qq, k64 * kd.double()[:, None, :, None], v64 * vd.double()[:, None, :, None],
                                     causal=True, attention_chunk=6)
    close(out, ref, pv)
    lse_close(lse, ref_lse)
    # the same packed: the descales of each sequence
    cu = torch.tensor([0, sq, 2 * sq], dtype=torch.int32)
    cuk = torch.tensor([0, sk, 2 * sk], dtype=torch.int32)
    out_v = fa3.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cuk, sq, sk, causal=True,
                                       attention_chunk=6, q_descale=qd, k_descale=kd, v_descale=vd)
    close(out_v.view(b, sq, hq, d), ref, pv)
    # bfloat16 inputs: FA3 reads no descales
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    plain = fa3.flash_attn_func(qb, kb, vb, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(plain, fa3.flash_attn_func(qb, kb, vb, causal=True))


@pytest.mark.parametrize("version", [2, 3, 4])
def test_varlen_equals_each_sequence(version):
    lens_q, lens_k = [3, 0, 9, 1], [7, 4, 9, 0]
    hq, hk, d = 4, 2, 16
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q, k, v = rand(cu_q[-1], hq, d, seed=20), rand(cu_k[-1], hk, d, seed=21), rand(cu_k[-1], hk, d, seed=22)
    mod = {2: fa2, 3: fa3, 4: fa4}[version]
    cu_qt, cu_kt = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    if version == 4:
        out, lse = mod.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_qt, cu_seqlens_k=cu_kt, causal=True,
                                              window_size=(2, None), return_lse=True)
    else:
        out, lse = mod.flash_attn_varlen_func(q, k, v, cu_qt, cu_kt, max(lens_q), max(lens_k), causal=True,
                                              window_size=(2, -1), return_attn_probs=True)[:2]
    for bq in range(4):
        qs, ks = slice(cu_q[bq], cu_q[bq + 1]), slice(cu_k[bq], cu_k[bq + 1])
        ref, ref_lse, pv = attention_ref(q[None, qs], k[None, ks], v[None, ks], causal=True, window=(2, 0))
        close(out[qs][None], ref, pv, f"seq {bq}")
        if version == 2:
            ref_lse = torch.where(torch.isneginf(ref_lse), math.inf, ref_lse)
        lse_close(lse[:, qs][None], ref_lse, f"seq {bq}")
    low = [x.float() for x in (q, k, v)]
    if version == 4:
        mod.assert_flash_attn_varlen_func_close((out.float(), lse.float()), *low, cu_seqlens_q=cu_qt,
                                                cu_seqlens_k=cu_kt, causal=True, window_size=(2, None))
    else:
        mod.assert_flash_attn_varlen_func_close((out.float(), lse.float()), *low, cu_qt, cu_kt, max(lens_q),
                                                max(lens_k), causal=True, window_size=(2, -1))


def test_fa3_seqused_and_fa4_batched_paged():
    lens = [5, 8]
    hq, d = 2, 16
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    q, k, v = rand(13, hq, d, seed=23), rand(13, hq, d, seed=24), rand(13, hq, d, seed=25)
    used_q, used_k = torch.tensor([3, 8], dtype=torch.int32), torch.tensor([5, 6], dtype=torch.int32)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, seqused_q=used_q, seqused_k=used_k, causal=True,
                                          return_attn_probs=True)
    for bq, (a, uq, uk) in enumerate(zip([0, 5], used_q.tolist(), used_k.tolist())):
        ref, ref_lse, pv = attention_ref(q[None, a:a + uq], k[None, a:a + uk], v[None, a:a + uk], causal=True)
        close(out[a:a + uq][None], ref, pv)
        lse_close(lse[:, a:a + uq][None], ref_lse)
        assert (out[a + uq:a + lens[bq]] == 0).all() and torch.isneginf(lse[:, a + uq:a + lens[bq]]).all()
    # FA4: batched q, paged keys with a page table
    b, sq, page, pages = 2, 4, 3, 4
    kp, vp = rand(10, page, hq, d, seed=26), rand(10, page, hq, d, seed=27)
    table = torch.tensor([[3, 0, 7, 9], [1, 2, 5, 4]], dtype=torch.int32)
    qb = rand(b, sq, hq, d, seed=28)
    used = torch.tensor([7, 12], dtype=torch.int32)
    out, lse = fa4.flash_attn_varlen_func(qb, kp, vp, page_table=table, seqused_k=used, causal=True, return_lse=True)
    for bq in range(b):
        keys, vals = (x[table[bq].long()].reshape(-1, hq, d)[:used[bq]] for x in (kp, vp))
        ref, ref_lse, pv = attention_ref(qb[bq:bq + 1], keys[None], vals[None], causal=True)
        close(out[bq:bq + 1], ref, pv)
        lse_close(lse[bq:bq + 1], ref_lse)


# ---- flash_attn_with_kvcache ---------------------------------------------------------------

def kvcache_problem(seed, b=3, s_cache=24, sq=4, s_new=3, hq=4, hk=2, d=32, rd=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(b, s_cache, hk, d, generator=g, dtype=torch.float64).to(dtype)
    v_cache = torch.randn(b, s_cache, hk, d, generator=g, dtype=torch.float64).to(dtype)
    q = torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, s_new, hk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, s_new, hk, d, generator=g, dtype=torch.float64).to(dtype)
    seqlens = torch.tensor([5, 0, 17][:b], dtype=torch.int32)
    angle = torch.arange(s_cache)[:, None] * (10000.0 ** (-torch.arange(rd // 2) / (rd // 2)))[None]
    cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
    return q, k_cache, v_cache, k, v, seqlens, cos, sin


def kvcache_ref(q, k_cache, v_cache, k, v, seqlens, cos, sin, causal, interleaved, leftpad=None, window=(None, None)):
    """FA2's test_flash_attn_kvcache construction: rotary at cache_seqlens (+ i for causal/local q),
    new keys written at cache_seqlens, attention_ref with the key padding and leftpad masks."""
    b, sq = q.shape[:2]
    s_new = k.shape[1]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    pos_k = seqlens.long()[:, None] + torch.arange(s_new)[None]
    k_ro = rotary_ref(k, cos[pos_k], sin[pos_k], interleaved)
    local = causal or window != (None, None)
    pos_q = seqlens.long()[:, None] + (torch.arange(sq)[None] if local else torch.zeros(1, sq, dtype=torch.long))
    q_ro = rotary_ref(q, cos[pos_q], sin[pos_q], interleaved)
    for bi in range(b):
        k_cache[bi, seqlens[bi]:seqlens[bi] + s_new] = k_ro[bi]
        v_cache[bi, seqlens[bi]:seqlens[bi] + s_new] = v[bi]
    end = seqlens.long() + s_new
    kpm = torch.arange(k_cache.shape[1])[None] < end[:, None]
    if leftpad is not None:
        kpm = kpm & (torch.arange(k_cache.shape[1])[None] >= leftpad[:, None])
    out, lse, pv = attention_ref(q_ro, k_cache, v_cache, kpm=kpm, key_leftpad=leftpad, causal=causal, window=window)
    return out, lse, pv, k_cache, v_cache


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_equals_fa_test_construction(interleaved, causal):
    q, k_cache, v_cache, k, v, seqlens, cos, sin = kvcache_problem(30 + interleaved + 2 * causal)
    leftpad = torch.tensor([2, 0, 5], dtype=torch.int32)
    ref, ref_lse, pv, kc_ref, vc_ref = kvcache_ref(q, k_cache, v_cache, k, v, seqlens, cos, sin, causal, interleaved,
                                                   leftpad=leftpad)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                           cache_leftpad=leftpad, causal=causal, rotary_interleaved=interleaved,
                                           return_softmax_lse=True)
    close(out, ref, pv)
    lse_close(lse, torch.where(torch.isneginf(ref_lse), math.inf, ref_lse))
    assert (kc - kc_ref).abs().max() < 1e-14 and torch.equal(vc, vc_ref)  # the cache, updated in place


def test_kvcache_paged_batch_idx_and_fa3_rotary_seqlens():
    q, k_cache, v_cache, k, v, seqlens, cos, sin = kvcache_problem(40)
    # cache_batch_idx: entry b reads and writes cache row idx[b]
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = fa3.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, cache_batch_idx=idx, causal=True)
    ref, _, pv, kc_ref, vc_ref = kvcache_ref(q, k_cache[idx.long()], v_cache[idx.long()], k, v, seqlens,
                                             cos[:, :0], sin[:, :0], True, False)
    close(out, ref, pv)
    assert torch.equal(kc[idx.long()], kc_ref) and torch.equal(vc[idx.long()], vc_ref)
    # paged: the same cache in pages of 4 behind a shuffled table
    page = 4
    perm = torch.randperm(3 * 24 // page, generator=torch.Generator().manual_seed(41))
    kp = torch.empty(3 * 24 // page, page, *k_cache.shape[2:], dtype=torch.float64)
    vp = torch.empty_like(kp)
    table = perm.view(3, -1).to(torch.int32)
    kp[perm] = k_cache.reshape(-1, page, *k_cache.shape[2:])
    vp[perm] = v_cache.reshape(-1, page, *v_cache.shape[2:])
    out_p = fa3.flash_attn_with_kvcache(q, kp, vp, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                        page_table=table, causal=True, rotary_seqlens=seqlens // 2)
    # FA3's rotary_seqlens: positions from rotary_seqlens, keys written at cache_seqlens
    pos_k = (seqlens // 2).long()[:, None] + torch.arange(k.shape[1])[None]
    pos_q = (seqlens // 2).long()[:, None] + torch.arange(q.shape[1])[None]
    k_ro = rotary_ref(k, cos[pos_k], sin[pos_k], True)
    q_ro = rotary_ref(q, cos[pos_q], sin[pos_q], True)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    for bi in range(3):
        kc2[bi, seqlens[bi]:seqlens[bi] + 3] = k_ro[bi]
        vc2[bi, seqlens[bi]:seqlens[bi] + 3] = v[bi]
    kpm = torch.arange(24)[None] < (seqlens.long() + 3)[:, None]
    ref, _, pv = attention_ref(q_ro, kc2, vc2, kpm=kpm, causal=True)
    close(out_p, ref, pv)
    assert (kp[perm].reshape(k_cache.shape) - kc2).abs().max() < 1e-14


# ---- The assert twins: correct kernels pass, wrong ones fail ------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_twin_passes_correct_and_fails_wrong_func(dtype):
    b, sq, sk, hq, hk, d = 2, 40, 64, 4, 2, 64
    q, k, v = (rand(*s, seed=50 + i).to(dtype) for i, s in enumerate([(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)]))
    kw = {"causal": True, "window_size": (16, None)}
    good, _, _ = attention_ref(q, k, v, causal=True, window=(16, None), dtype=dtype)  # FA's own baseline
    good_lse = attention_ref(q, k, v, causal=True, window=(16, None), dtype=torch.float32)[1]  # a kernel's, in float32
    fa4.assert_flash_attn_func_close((good.to(dtype), good_lse.float()), q, k, v, **kw)
    wrong = {
        "window off by one": attention_ref(q, k, v, causal=True, window=(15, None), dtype=dtype),
        "causal top-left": attention_ref(q, k, v, window=(16 + sk - sq, -(sk - sq)), dtype=dtype),
        "no window": attention_ref(q, k, v, causal=True, dtype=dtype),
        "scale 1/d": attention_ref(q, k, v, causal=True, window=(16, None), scale=1 / d, dtype=dtype),
    }
    for name, (out, lse, _) in wrong.items():
        with pytest.raises(AssertionError):
            fa4.assert_flash_attn_func_close((out.to(dtype), None), q, k, v, **kw)
    with pytest.raises(AssertionError):  # base-2 LSE where FlashAttention's is natural
        fa4.assert_flash_attn_func_close((good.to(dtype), (good_lse / math.log(2)).float()), q, k, v, **kw)


def test_twin_kvcache_rotary_and_append():
    dtype = torch.bfloat16
    q, k_cache, v_cache, k, v, seqlens, cos, sin = kvcache_problem(60, dtype=dtype)
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, causal=True)
    f = lambda *a: a  # noqa: E731

    def kernel(interleaved=True, shift=0, halves=False):
        """A bfloat16 'kernel': FA's construction in float32 from the bf16 inputs, stored in bf16."""
        kc, vc = k_cache.clone(), v_cache.clone()
        c, s = cos.float(), sin.float()
        pos_k = seqlens.long()[:, None] + torch.arange(k.shape[1])[None]
        pos_q = seqlens.long()[:, None] + torch.arange(q.shape[1])[None]
        il = interleaved != halves
        k_ro = rotary_ref(k.float(), c[pos_k], s[pos_k], il).to(dtype)
        q_ro = rotary_ref(q.float(), c[pos_q], s[pos_q], il).to(dtype)
        for bi in range(3):
            at = seqlens[bi] + shift
            kc[bi, at:at + 3] = k_ro[bi]
            vc[bi, at:at + 3] = v[bi]
        kpm = torch.arange(24)[None] < (seqlens.long() + 3)[:, None]
        out, lse, _ = attention_ref(q_ro, kc, vc, kpm=kpm, causal=True, dtype=torch.float32)
        return out.to(dtype), kc, vc

    out, kc, vc = kernel()
    fa2.assert_flash_attn_with_kvcache_close(out, q, k_cache, v_cache, k, v, k_cache_out=kc, v_cache_out=vc, **kw)
    for name, args in [("rotary on the other pairing (NeoX halves)", {"halves": True}),
                       ("appended one slot late", {"shift": 1})]:
        out, kc, vc = kernel(**args)
        with pytest.raises(AssertionError):
            fa2.assert_flash_attn_with_kvcache_close(out, q, k_cache, v_cache, k, v, **kw)
        with pytest.raises(AssertionError):
            fa2.assert_flash_attn_with_kvcache_close(out, q, k_cache, v_cache, k, v, k_cache_out=kc,
                                                     v_cache_out=vc, **kw)


def test_numpy_in_numpy_out_and_inputs_untouched():
    rng = np.random.default_rng(70)
    q, k, v = (rng.standard_normal((1, 6, 2, 8)) for _ in range(3))
    copies = [x.copy() for x in (q, k, v)]
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64 and lse.shape == (1, 2, 6)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v), copies))


def test_clear_errors():
    q = rand(1, 4, 2, 8, seed=80)
    with pytest.raises(ValueError, match="dropout_p"):
        fa2.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(TypeError, match="window_size"):
        fa2.flash_attn_func(q, q, q, window_size=(None, 2))
    with pytest.raises(ValueError, match="score_mod"):
        fa4.flash_attn_func(q, q, q, score_mod=lambda *a: a[0])
    with pytest.raises(ValueError, match="cache_seqlens"):
        fa2.flash_attn_with_kvcache(q, q, q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="rotary_cos"):
        fa2.flash_attn_with_kvcache(q, q, q, q[:, :1], q[:, :1], rotary_cos=torch.ones(2, 4),
                                    rotary_sin=torch.ones(2, 4), cache_seqlens=2)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fa3.flash_attn_with_kvcache(q, q, q, cu_seqlens_q=torch.tensor([0, 4]))


def test_fa3_kvcache_rotary_positions_follow_its_local_rule():
    """FA3 rotates each query at its own position when causal or local, local counting chunks and
    windows below its clamps (left < seqlen_k - 1, right < seqlen_q - 1)."""
    q, k_cache, v_cache, k, v, seqlens, cos, sin = kvcache_problem(90)
    for kw, moving in [({"attention_chunk": 3}, True), ({"window_size": (-1, 5)}, False),
                       ({"window_size": (20, -1)}, True), ({"window_size": (30, -1)}, False), ({}, False)]:
        kc, vc = k_cache.clone(), v_cache.clone()
        out = fa3.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, **kw)
        pos_q = seqlens.long()[:, None] + (torch.arange(q.shape[1])[None] if moving else 0 * torch.arange(q.shape[1])[None])
        pos_k = seqlens.long()[:, None] + torch.arange(k.shape[1])[None]
        q_ro, k_ro = rotary_ref(q, cos[pos_q], sin[pos_q], True), rotary_ref(k, cos[pos_k], sin[pos_k], True)
        kc2, vc2 = k_cache.clone(), v_cache.clone()
        for bi in range(3):
            kc2[bi, seqlens[bi]:seqlens[bi] + 3], vc2[bi, seqlens[bi]:seqlens[bi] + 3] = k_ro[bi], v[bi]
        kpm = torch.arange(24)[None] < (seqlens.long() + 3)[:, None]
        window = fa23_window(kw.get("window_size", (-1, -1)), False, 24, 3)
        ref, _, pv = attention_ref(q_ro, kc2, vc2, kpm=kpm, window=window, attention_chunk=kw.get("attention_chunk", 0))
        close(out, ref, pv, str(kw))


def test_pages_indices_and_sentinels():
    q, k_cache, v_cache, k, v, seqlens, cos, sin = kvcache_problem(91)
    page = 4
    kp, vp = k_cache.reshape(-1, page, *k_cache.shape[2:]), v_cache.reshape(-1, page, *v_cache.shape[2:])
    table = torch.arange(18, dtype=torch.int32).view(3, 6)
    ref = fa2.flash_attn_with_kvcache(q, kp.clone(), vp.clone(), k, v, cache_seqlens=seqlens, block_table=table)
    sentinel = table.clone()
    for bi, n in enumerate((seqlens + 3).tolist()):  # entries past each sequence are never read
        sentinel[bi, -(-n // page):] = 4000
    assert torch.equal(ref, fa2.flash_attn_with_kvcache(q, kp.clone(), vp.clone(), k, v, cache_seqlens=seqlens,
                                                         block_table=sentinel))
    bad = table.clone()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="block_table"):
        fa2.flash_attn_with_kvcache(q, kp.clone(), vp.clone(), k, v, cache_seqlens=seqlens, block_table=bad)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        fa2.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=seqlens,
                                    cache_batch_idx=torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match="cache_batch_idx"):  # FA2 refuses pages with a batch index; FA3 takes it
        fa2.flash_attn_with_kvcache(q, kp.clone(), vp.clone(), k, v, cache_seqlens=seqlens, block_table=table,
                                    cache_batch_idx=torch.tensor([2, 0, 1]))
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    out3 = fa3.flash_attn_with_kvcache(q, kp.clone(), vp.clone(), k, v, cache_seqlens=seqlens, page_table=table,
                                       cache_batch_idx=idx)
    assert torch.equal(out3, fa3.flash_attn_with_kvcache(q, kp.clone(), vp.clone(), k, v, cache_seqlens=seqlens,
                                                         page_table=table[idx.long()]))
    # window sides as a tensor, as FlashAttention's tests draw them
    w = torch.tensor([3, 0])
    assert torch.equal(fa2.flash_attn_func(q, k_cache, v_cache, window_size=w),
                       fa2.flash_attn_func(q, k_cache, v_cache, window_size=(3, 0)))


def test_fa4_shared_kv_mla_lse_with_grad_and_fa3_qkvpacked():
    b, sq, sk, hq = 1, 3, 5, 2
    q, kv = rand(b, sq, hq, 512, seed=92), rand(b, sk, 1, 512, seed=93)
    out, lse = fa4.flash_attn_func(q, kv, kv, return_lse=True)  # FA4's MLA path: scores q . v, scale 1/sqrt(512)
    ref, ref_lse, pv = attention_ref(q, kv, kv, scale=512 ** -0.5)
    close(out, ref, pv)
    lse_close(lse.transpose(1, 2), ref_lse)  # (b, sq, hq) there
    qg = rand(b, sq, hq, 16, seed=94).requires_grad_()
    kg = rand(b, sk, hq, 16, seed=95)
    assert fa4.flash_attn_func(qg, kg, kg)[1] is not None  # an input taking a gradient: FA4 returns the LSE
    qkv = rand(b, sk, 3, hq, 16, seed=96)
    assert torch.equal(fa3.flash_attn_qkvpacked_func(qkv, causal=True),
                       fa3.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True))


def test_fp8_kvcache_judged_in_fp8_and_empty_topk_lists():
    q, k_cache, v_cache, k, v, seqlens, cos, sin = kvcache_problem(97)
    with pytest.raises(ValueError, match="dtype"):  # a type the check cannot name: the caller says it
        fa3.assert_flash_attn_with_kvcache_close(q, q.to(torch.int8).float().to(torch.float8_e5m2), k_cache,
                                                 v_cache, k, v, cache_seqlens=seqlens)
    qq, kk, vv = rand(1, 1, 2, 32, seed=98), rand(1, 1, 2, 32, seed=99), rand(1, 1, 2, 32, seed=100)
    idx = torch.full((1, 1, 1), -1)
    result = fa4.flash_attn_func(qq, kk, vv, gather_kv_indices=idx, return_lse=True)
    assert (result[0] == 0).all() and torch.isneginf(result[1]).all()
    fa4.assert_flash_attn_func_close(result, qq, kk, vv, gather_kv_indices=idx)


def test_a_twin_names_itself_to_the_recorder():
    from attnlib import testing
    q = rand(1, 4, 2, 8, seed=101)
    names = []
    testing._listeners.append(lambda result: names.append(testing._entry.get()))
    try:
        fa2.assert_flash_attn_func_close(fa2.flash_attn_func(q, q, q), q, q, q)
    finally:
        testing._listeners.pop()
    assert names == ["assert_flash_attn_func_close"] and testing._entry.get() == "assert_attention_close"
