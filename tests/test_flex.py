"""Programmable attention (mask_mod, score_mod, block masks) against PyTorch FlexAttention in
eager float64, against attnlib's built-in equivalents, and against dense gradients."""

import tracemalloc

import numpy as np
import pytest
import torch
from torch.nn.attention import flex_attention as fa

import attnlib
from attnlib.core.flex import from_torch

STRICT = dict(divide="raise", over="raise", invalid="raise")
# FlexAttention in eager mode is the reference here; its advice to compile is not for us.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
B, H, S, D = 2, 4, 384, 16


def qkv(seed=0, s=S, kv_heads=H):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, s, D)), rng.standard_normal((B, kv_heads, s, D)),
            rng.standard_normal((B, kv_heads, s, D)))


DOC = torch.tensor(np.repeat([0, 1, 2, 3], [100, 60, 150, 74]))  # document of each position


# FlexAttention functions, written with torch ops as their users write them.
def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < 64)


def dilated_window(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx).abs() <= 96) & ((q_idx - kv_idx) % 3 == 0)


def document_window(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx <= 48)


def neighbourhood_2d(b, h, q_idx, kv_idx):  # a 16 x 24 image, 5 x 5 neighbourhoods
    return ((q_idx // 24 - kv_idx // 24).abs() <= 2) & ((q_idx % 24 - kv_idx % 24).abs() <= 2)


def alibi(score, b, h, q_idx, kv_idx):
    return score - 2.0 ** (-8.0 * (h + 1) / H) * (q_idx - kv_idx).abs()


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def t5_bias(score, b, h, q_idx, kv_idx):  # bucketed relative position bias, a table per head
    rel = (kv_idx - q_idx).clamp(-32, 32) + 32
    return score + TABLE[h, rel]


TABLE = torch.tensor(np.random.default_rng(3).standard_normal((H, 65)) * 0.5)

GALLERY = {"prefix_lm": (prefix_lm, None), "dilated_window": (dilated_window, None),
           "document_window": (document_window, None), "neighbourhood_2d": (neighbourhood_2d, None),
           "alibi": (lambda b, h, q, k: q >= k, alibi), "softcap": (None, softcap),
           "t5_bias": (prefix_lm, t5_bias)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GALLERY))
def test_gallery_equals_flex_attention_eager_float64(name):
    mask_mod, score_mod = GALLERY[name]
    q, k, v = qkv()
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    block_mask = None if mask_mod is None else fa.create_block_mask(mask_mod, B, H, S, S, device="cpu")
    want = fa.flex_attention(tq, tk, tv, score_mod=score_mod, block_mask=block_mask).numpy()
    mm = None if mask_mod is None else from_torch(mask_mod)
    sm = None if score_mod is None else from_torch(score_mod)
    with np.errstate(**STRICT):
        out, lse = attnlib.attention(q, k, v, mask_mod=mm, score_mod=sm, block_q=64, block_k=64,
                                     return_lse=True)
    ref, ref_lse = attnlib.reference_attention(q, k, v, mask_mod=mm, score_mod=sm, return_lse=True)
    size = attnlib.reference_attention(q, k, np.abs(v), mask_mod=mm, score_mod=sm)
    assert attnlib.rel_error(out, want, size) < 1e-13
    assert attnlib.rel_error(ref, want, size) < 1e-13
    assert np.max(np.abs(lse - ref_lse)) < 1e-13


def numpy_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (kv_idx >= q_idx - 50)


@pytest.mark.slow
def test_built_in_equivalents_give_the_same_result_and_tile_map():
    q, k, v = qkv(1)
    ids = np.stack([np.repeat([0, 1, 2], [100, 200, 84]), np.repeat([0, 1], [300, 84])])
    cases = [
        (dict(causal=True, window=(50, None)), dict(mask_mod=numpy_window)),
        (dict(q_segment_ids=ids, kv_segment_ids=ids),
         dict(mask_mod=lambda b, h, qi, kj: ids[b, qi] == ids[b, kj])),
        (dict(softcap=7.0), dict(score_mod=lambda s, b, h, qi, kj: 7.0 * np.tanh(s / 7.0))),
        (dict(causal=True, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
         dict(mask_mod=lambda b, h, qi, kj: kj <= qi,
              score_mod=lambda s, b, h, qi, kj: s - np.array([0.5, 0.25, 0.125, 0.0625])[h] * np.abs(qi - kj))),
    ]
    for built_in, mods in cases:
        a, sa = attnlib.attention(q, k, v, block_q=64, block_k=64, return_stats=True, **built_in)
        b, sb = attnlib.attention(q, k, v, block_q=64, block_k=64, return_stats=True, **mods)
        assert np.max(np.abs(a - b)) < 1e-14, built_in
        if "mask_mod" in mods:
            assert np.array_equal(sa.tile_kind, np.broadcast_to(sb.tile_kind, sa.tile_kind.shape)), built_in


def test_only_visible_tiles_are_touched_and_counted():
    """The kernel evaluates mask_mod only on PARTIAL tiles (never on a SKIP one), and its
    processed tiles are the tiles an independent dense count finds a visible pair in."""
    q, k, v = qkv(2)
    mask = from_torch(document_window)
    bm = attnlib.create_block_mask(mask, None, None, S, S, 32, 32)
    seen = []

    def recording(b, h, q_idx, kv_idx):
        seen.append((int(np.min(q_idx)) // 32, int(np.min(kv_idx)) // 32))
        return mask(b, h, q_idx, kv_idx)

    bm_recording = attnlib.BlockMask(bm.kinds, 32, 32, S, S, recording)
    _, stats = attnlib.attention(q, k, v, block_mask=bm_recording, return_stats=True)
    kinds = bm.kinds[0, 0]
    assert seen and all(kinds[a, t] == attnlib.PARTIAL for a, t in seen)
    dense = mask(0, 0, np.arange(S)[:, None], np.arange(S)[None, :])
    visible_tiles = dense.reshape(S // 32, 32, S // 32, 32).any(axis=(1, 3))
    assert np.array_equal(stats.tile_kind[0] != attnlib.SKIP, visible_tiles)
    assert stats.processed_tiles == B * H * visible_tiles.sum()


@pytest.mark.slow
def test_memory_is_flat_in_n_with_a_dilated_window():
    """tracemalloc in this process: the kernel's traced peak with a precomputed block mask
    at n = 4096 and 16384 (1 head, D = 16): the same but for the output and lse (the gallery's
    report measures the same path at its own sizes)."""
    def dilated(b, h, q_idx, kv_idx):
        return (np.abs(q_idx - kv_idx) <= 512) & ((q_idx - kv_idx) % 4 == 0)

    peaks = {}
    for n in (4096, 16384):
        rng = np.random.default_rng(n)
        q, k, v = (rng.standard_normal((1, 1, n, 16)) for _ in range(3))
        bm = attnlib.create_block_mask(dilated, None, None, n, n, 256, 256)
        attnlib.attention(q[..., :512, :], k[..., :512, :], v[..., :512, :], mask_mod=dilated, workers=1)
        tracemalloc.start()
        out, lse, stats = attnlib.attention(q, k, v, block_mask=bm, workers=1, return_lse=True, return_stats=True)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        visible = ((n // 256) * 5 - 4)  # the tiles of a 512-wide band: 5 per row, fewer at the ends
        assert stats.processed_tiles <= visible + 2
        peaks[n] = peak - out.nbytes - lse.nbytes - stats.tile_kind.nbytes - stats.rescales.nbytes
    assert peaks[16384] < 1.25 * peaks[4096], peaks
    assert peaks[16384] < 8 * 2**20


@pytest.mark.slow
@pytest.mark.parametrize("with_score_mod", [False, True])
def test_gradients_equal_the_dense_gradient(with_score_mod):
    q, k, v = qkv(4, s=200, kv_heads=2)
    mm = from_torch(prefix_lm)
    def capped_bias(s, b, h, qi, kj):
        return 5.0 * np.tanh(s / 5.0) - 0.01 * (h + 1) * np.abs(qi - kj)

    def capped_bias_grad(s, b, h, qi, kj):
        return 1.0 - np.tanh(s / 5.0) ** 2

    sm, gm = (capped_bias, capped_bias_grad) if with_score_mod else (None, None)
    dout = np.random.default_rng(5).standard_normal(q.shape)
    out, lse = attnlib.attention(q, k, v, mask_mod=mm, score_mod=sm, return_lse=True, block_q=32, block_k=48)
    with np.errstate(**STRICT):
        grads = attnlib.attention_backward(q, k, v, out, lse, dout, mask_mod=mm, score_mod=sm,
                                           score_mod_grad=gm, block_q=32, block_k=48)
    want = attnlib.reference_attention_backward(q, k, v, dout, mask_mod=mm, score_mod=sm, score_mod_grad=gm)
    for g, w in zip(grads, want):
        assert np.max(np.abs(g - w)) <= 1e-13 * max(1.0, np.abs(w).max())
    # Against torch autograd of the same attention written densely (FlexAttention has no
    # backward on CPU): scores, score_mod, the mask, softmax.
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    kr, vr = tk.repeat_interleave(2, dim=1), tv.repeat_interleave(2, dim=1)
    ts = tq @ kr.transpose(-1, -2) / D ** 0.5
    qi, kj = torch.arange(200)[:, None], torch.arange(200)[None, :]
    hh = torch.arange(H)[:, None, None]
    if with_score_mod:
        ts = 5.0 * torch.tanh(ts / 5.0) - 0.01 * (hh + 1).double() * (qi - kj).abs().double()
    ts = ts.masked_fill(~prefix_lm(0, 0, qi, kj), float("-inf"))
    to = torch.softmax(ts, dim=-1) @ vr
    auto = torch.autograd.grad(to, (tq, tk, tv), torch.from_numpy(dout))
    for g, w in zip(grads, auto):
        assert np.max(np.abs(g - w.numpy())) <= 1e-12 * max(1.0, np.abs(w.numpy()).max())
    if with_score_mod:
        with pytest.raises(ValueError, match="needs its derivative: pass score_mod_grad"):
            attnlib.attention_backward(q, k, v, out, lse, dout, mask_mod=mm, score_mod=sm)


def test_bad_mods():
    q, k, v = qkv(6, s=64)
    bm = attnlib.create_block_mask(numpy_window, None, None, 64, 64, 32, 32)
    cases = [
        (dict(mask_mod=3), TypeError, "mask_mod must be callable"),
        (dict(mask_mod=lambda b, h, qi, kj: qi - kj), TypeError, "mask_mod must return booleans"),
        (dict(mask_mod=lambda b, h, qi, kj: np.ones(7, bool)), ValueError, "does not broadcast"),
        (dict(score_mod=lambda s, b, h, qi, kj: s * np.nan), ValueError, "score_mod returned NaN"),
        (dict(block_mask=bm, block_q=64), ValueError, "block_mask has 32 x 32 tiles"),
        (dict(block_mask=attnlib.create_block_mask(numpy_window, None, None, 65, 64, 32, 32)), ValueError,
         "block_mask is for Sq=65"),
        (dict(block_mask="x"), TypeError, "block_mask must be a BlockMask"),
    ]
    for options, err, words in cases:
        with pytest.raises(err, match=words):
            attnlib.attention(q, k, v, **options)
    with pytest.raises(ValueError, match="mask_mod is not taken in the varlen layout"):
        attnlib.attention_varlen(q[0].swapaxes(0, 1), k[0].swapaxes(0, 1), v[0].swapaxes(0, 1), [0, 64], [0, 64],
                                 mask_mod=numpy_window)


@pytest.mark.slow
def test_the_check_takes_mask_mod_and_score_mod():
    """A float32 kernel with a programmable mask passes the check with the same mask_mod and
    fails it without; its gradients are judged with score_mod_grad."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 128, 16)).astype(np.float32) for _ in range(3))
    mm = from_torch(dilated_window)

    def sm(s, b, h, qi, kj):
        return 10.0 * np.tanh(s / 10.0)

    out = attnlib.attention(q, k, v, mask_mod=mm, score_mod=sm, compute_dtype="float32", block_k=32)
    bm = attnlib.create_block_mask(mm, None, None, 128, 128, 64, 64)
    assert attnlib.check.check_kernel(q, k, v, out, layout="bhsd", block_mask=bm, score_mod=sm).passed
    assert not attnlib.check.check_kernel(q, k, v, out, layout="bhsd", score_mod=sm).passed
    with pytest.raises(attnlib.check.UnusableInput, match="score_mod_grad"):
        attnlib.check.check_kernel(q, k, v, out, layout="bhsd", mask_mod=mm, score_mod=sm, dout=out, dq=q)


def test_score_mod_grad_errors_and_vjp():
    q, k, v = qkv(8, s=64)
    dout = np.ones(q.shape)
    out, lse = attnlib.attention(q, k, v, return_lse=True)

    def sm(s, b, h, qi, kj):
        return 2.0 * s

    def gm(s, b, h, qi, kj):
        return 2.0 + 0.0 * s

    for fn in (lambda **o: attnlib.attention_backward(q, k, v, out, lse, dout, **o),
               lambda **o: attnlib.reference_attention_backward(q, k, v, dout, **o)):
        with pytest.raises(ValueError, match="score_mod_grad was given without a score_mod"):
            fn(score_mod_grad=gm)
        with pytest.raises(TypeError, match="score_mod_grad must return numbers"):
            fn(score_mod=sm, score_mod_grad=lambda s, b, h, qi, kj: s > 0)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        attnlib.attention_backward(q, k, v, out, lse, dout, block_mask="x")
    o, grads = attnlib.attention_vjp(q, k, v, dout, score_mod=sm, score_mod_grad=gm)
    same = attnlib.attention_vjp(q, k, v, dout, scale=2.0 / np.sqrt(D))  # 2 * (scale q.k)
    assert np.max(np.abs(o - same[0])) < 1e-14
    assert all(np.max(np.abs(a - b)) < 1e-13 for a, b in zip(grads, same[1]))
