"""Top-k sparse keys (``gather_kv_indices``): hand-built lists, an independent float64
restatement of FlashAttention's top-k mask (torch autograd through it) with GQA, causal and
lengths, the gathered forward against the dense tiles, the tile classes, the work following
the listed keys, flat memory, bad input, and the check naming a kernel that ignored the lists
or read their -1 entries as keys."""

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, strategies as st

import attnlib
from attnlib import attention, attention_vjp, check, reference_attention
from attnlib.core import online, sparse
from attnlib.core.options import Options
from attnlib.core.problem import parse

BOUND = 1e-12  # two float64 computations of the same sums in other orders (the 1e-12)
STRICT = dict(divide="raise", over="raise", invalid="raise")
B, HQ, HK, SQ, SK, D = 2, 6, 2, 33, 90, 16


def _problem(seed=0, sq=SQ, sk=SK, topk=12, per_head=False):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, HQ, sq, D))
    k = rng.standard_normal((B, HK, sk, D))
    v = rng.standard_normal((B, HK, sk, D + 3))
    dout = rng.standard_normal((B, HQ, sq, D + 3))
    shape = (B, HK, sq, topk) if per_head else (B, sq, topk)
    idx = rng.integers(-2, sk + 2, size=shape)  # -1, -2 and past Sk: no key
    if topk >= 2:
        idx[..., 1] = idx[..., 0]  # a repeat: counts once
    return q, k, v, dout, idx


def _listed(idx, sk, per_head):
    """The lists as a dense (B, HQ, Sq, Sk) mask, written out entry by entry."""
    mask = np.zeros((B, HQ, idx.shape[-2], sk), dtype=bool)
    for b in range(B):
        for h in range(HQ):
            rows = idx[b, h // (HQ // HK)] if per_head else idx[b]
            for i, row in enumerate(rows):
                for j in row:
                    if 0 <= j < sk:
                        mask[b, h, i, j] = True
    return mask


def fa_reference(q, k, v, dout, idx, per_head, causal=False, kv_lengths=None):
    """FlashAttention's attention_ref with a top-k mask, in float64 with torch autograd: k and
    v repeated to the query heads, the listed keys scattered into a boolean mask (always, not
    only for topk < Sk), ANDed with the key padding and the bottom-right causal mask; rows
    without keys 0.  Returns ``(out, lse, (dq, dk, dv))``."""
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    g = HQ // HK
    kk, vv = tk.repeat_interleave(g, 1), tv.repeat_interleave(g, 1)
    sq, sk = q.shape[-2], k.shape[-2]
    s = torch.einsum("bhtd,bhsd->bhts", tq / math.sqrt(q.shape[-1]), kk)
    keep = torch.tensor(_listed(idx, sk, per_head))
    lengths = torch.full((B,), sk) if kv_lengths is None else torch.tensor(kv_lengths)
    j = torch.arange(sk)[None, None, None, :]
    i = torch.arange(sq)[None, None, :, None]
    hide = ~keep | (j >= lengths[:, None, None, None])
    if causal:
        hide = hide | (j > i + lengths[:, None, None, None] - sq)
    s = s.masked_fill(hide, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None]).masked_fill(hide, 0)
    out = p @ vv
    out.backward(torch.tensor(dout))
    return out.detach().numpy(), lse.detach().numpy(), tuple(x.grad.numpy() for x in (tq, tk, tv))


def _rel(a, b):
    a = np.asarray(a.numpy() if hasattr(a, "numpy") else a, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def test_hand_built_lists():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 2))
    idx = np.array([[0, 2, 2], [-1, 9, 4], [-1, -1, 5]])  # {0, 2}, {4}, {}
    with np.errstate(**STRICT):
        out, lse = reference_attention(q, k, v, gather_kv_indices=idx, return_lse=True)
        tiled, tiled_lse = attention(q, k, v, gather_kv_indices=idx, return_lse=True)
    s = q[0] @ k[[0, 2]].T / 2.0
    w = np.exp(s - s.max())
    np.testing.assert_allclose(out[0], w @ v[[0, 2]] / w.sum(), rtol=1e-14)
    np.testing.assert_allclose(lse[0], s.max() + np.log(w.sum()), rtol=1e-14)
    np.testing.assert_allclose(out[1], v[4], rtol=1e-14)
    assert lse[1] == q[1] @ k[4] / 2.0
    assert (out[2] == 0).all() and lse[2] == -np.inf
    np.testing.assert_allclose(tiled, out, rtol=0, atol=1e-15)
    assert tiled_lse[2] == -np.inf


@pytest.mark.slow
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("causal,kv_lengths", [(False, None), (True, [90, 41])])
def test_equals_flashattention_reference_forward_lse_and_gradients(per_head, causal, kv_lengths):
    q, k, v, dout, idx = _problem(per_head=per_head)
    opts = dict(gather_kv_indices=idx, causal=causal,
                kv_lengths=None if kv_lengths is None else np.array(kv_lengths))
    ref_out, ref_lse, ref_grads = fa_reference(q, k, v, dout, idx, per_head, causal, kv_lengths)
    finite = np.isfinite(ref_lse)
    with np.errstate(**STRICT):
        for fn in (attention, reference_attention):
            out, lse = fn(q, k, v, return_lse=True, **opts)
            assert _rel(out, ref_out) < BOUND
            assert np.array_equal(np.isfinite(lse), finite) and _rel(lse[finite], ref_lse[finite]) < BOUND
        _, grads = attention_vjp(q, k, v, dout, **opts)
        dense = attnlib.reference_attention_backward(q, k, v, dout, **opts)
    for got, want, ref in zip(grads, dense, ref_grads):
        assert _rel(got, ref) < BOUND and _rel(want, ref) < BOUND


@pytest.mark.parametrize("per_head", [False, True])
def test_torch_tensors_compute_with_torch_and_match(per_head):
    torch = pytest.importorskip("torch")
    q, k, v, dout, idx = _problem(per_head=per_head, seed=5)
    opts = dict(causal=True, kv_lengths=np.array([90, 41]))
    ref_out, ref_lse, ref_grads = fa_reference(q, k, v, dout, idx, per_head, **opts)
    t = [torch.from_numpy(x) for x in (q, k, v, dout)]
    out, lse = attention(*t[:3], gather_kv_indices=torch.from_numpy(idx), return_lse=True, **opts)
    assert isinstance(out, torch.Tensor) and _rel(out, ref_out) < BOUND
    dense = reference_attention(*t[:3], gather_kv_indices=idx, **opts)
    assert isinstance(dense, torch.Tensor) and _rel(dense, ref_out) < BOUND
    _, grads = attention_vjp(*t, gather_kv_indices=idx, **opts)
    for got, ref in zip(grads, ref_grads):
        assert isinstance(got, torch.Tensor) and _rel(got, ref) < BOUND


def _both_paths(monkeypatch, q, k, v, **kw):
    """``attention`` with the gathered forward and with the dense tiles, forced."""
    results = []
    for cost in (0, 10**18):  # 0: always gather; huge: never
        monkeypatch.setattr(sparse, "GATHER_COST", cost)
        results.append(attention(q, k, v, return_lse=True, return_stats=True, **kw))
    return results


@given(seed=st.integers(0, 2**16), topk=st.integers(0, 40), per_head=st.booleans(),
       variant=st.sampled_from(["none", "causal", "window+sinks", "chunk", "leftpad", "scores", "segments",
                                "top_left"]),
       block=st.sampled_from([(8, 16), (16, 32), (64, 64)]))
@pytest.mark.slow
def test_gathered_equals_dense_tiles_and_reference(seed, topk, per_head, variant, block):
    mp = pytest.MonkeyPatch()
    try:
        q, k, v, _, idx = _problem(seed, sq=21, sk=70, topk=topk, per_head=per_head)
        rng = np.random.default_rng(seed)
        kw = {"none": {}, "causal": dict(causal=True, kv_lengths=np.array([70, 33])),
              "window+sinks": dict(causal=True, window=(9, 0), sink_token_length=3, sinks=rng.standard_normal(HQ)),
              "chunk": dict(causal=True, attention_chunk=16),
              "leftpad": dict(causal=True, key_leftpad=np.array([5, 20]), kv_lengths=np.array([70, 60])),
              "scores": dict(softcap=2.0, alibi_slopes=rng.uniform(0.01, 0.3, HQ), scale=0.4),
              "segments": dict(q_segment_ids=np.repeat([[0, 1, 2]], B, 0).repeat(7, 1),
                               kv_segment_ids=np.repeat([[0, 1, 2]], B, 0).repeat([20, 30, 20], 1)),
              "top_left": dict(causal=True, causal_align="top_left", q_lengths=np.array([21, 9]))}[variant]
        kw["block_q"], kw["block_k"] = block
        with np.errstate(**STRICT):
            (g_out, g_lse, g_st), (d_out, d_lse, d_st) = _both_paths(mp, q, k, v, gather_kv_indices=idx, **kw)
            kw.pop("block_q"), kw.pop("block_k")
            r_out, r_lse = reference_attention(q, k, v, gather_kv_indices=idx, return_lse=True, **kw)
        fin = np.isfinite(r_lse)
        for out, lse in ((g_out, g_lse), (d_out, d_lse)):
            assert np.abs(out - r_out).max() <= BOUND * max(1.0, np.abs(r_out).max())
            assert np.array_equal(np.isfinite(lse), fin)
            assert np.abs(lse[fin] - r_lse[fin]).max(initial=0) <= BOUND * max(1.0, np.abs(r_lse[fin]).max(initial=0))
        np.testing.assert_array_equal(g_st.tile_kind, d_st.tile_kind)  # the same classes in both paths
        np.testing.assert_array_equal(g_st.rescales, d_st.rescales)  # and the same events, per key tile
    finally:
        mp.undo()


@pytest.mark.slow
def test_tile_classes_skip_unlisted_tiles_and_work_follows_the_listed_keys(monkeypatch):
    rng = np.random.default_rng(0)
    sq, sk, topk = 256, 4096, 16
    q, k, v = rng.standard_normal((1, 2, sq, 32)), rng.standard_normal((1, 2, sk, 32)), rng.standard_normal((1, 2, sk, 32))
    idx = np.sort(rng.choice(1024, size=(1, sq, topk)), axis=-1)  # every list among the first 1024 keys
    sizes = []
    update = online.OnlineSoftmax.update

    def counted(self, s, *args, **kw):
        sizes.append(np.size(s))
        return update(self, s, *args, **kw)

    monkeypatch.setattr(online.OnlineSoftmax, "update", counted)
    out, st_ = attention(q, k, v, gather_kv_indices=idx, block_q=64, block_k=256, return_stats=True)
    kinds = st_.tile_kind  # (1, 4, 16)
    assert (kinds[..., 4:] == 0).all() and (kinds[..., :4] != 0).any()  # keys >= 1024: SKIP
    assert st_.skipped_tiles >= 2 * 4 * 12
    # Work: the scores the online softmax absorbed are the listed pairs (rows padded to their
    # tile's longest list), not Sq x Sk.
    assert sum(sizes) <= 2 * sq * topk
    assert np.abs(out - reference_attention(q, k, v, gather_kv_indices=idx)).max() < BOUND


@pytest.mark.slow
def test_working_memory_is_flat_in_n():
    """tracemalloc, after a warm-up: the peak less the output and the lists' sorted copy (as
    large as the input lists, O(n topk)) does not grow from n = 2048 to 8192 at topk = 64
    (measured 8.8 and 8.9 MB; 9.7 at 32768)."""
    rng = np.random.default_rng(1)

    def working(n):
        q, k, v = (rng.standard_normal((1, 2, n, 64)) for _ in range(3))
        idx = rng.integers(0, n, size=(1, n, 64))
        attention(q[..., :64, :], k, v, gather_kv_indices=idx[:, :64])  # warm-up
        tracemalloc.start()
        out = attention(q, k, v, gather_kv_indices=idx, workers=1)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak - out.nbytes - idx.nbytes  # the lists' sorted copy: O(n topk), like the input

    small, large = working(2048), working(8192)
    assert large <= 1.15 * small + (1 << 20)


def test_lists_are_not_modified_and_bad_lists_are_refused():
    q, k, v, _, idx = _problem()
    copy = idx.copy()
    attention(q, k, v, gather_kv_indices=idx)
    np.testing.assert_array_equal(idx, copy)
    with pytest.raises(TypeError, match="gather_kv_indices must hold integers"):
        attention(q, k, v, gather_kv_indices=idx.astype(float))
    with pytest.raises(ValueError, match="gather_kv_indices must have shape"):
        attention(q, k, v, gather_kv_indices=idx[:, :-1])
    with pytest.raises(ValueError, match="gather_kv_indices cannot be combined with mask_mod"):
        attention(q, k, v, gather_kv_indices=idx, mask_mod=lambda b, h, i, j: i >= j)
    with pytest.raises(ValueError, match="gather_kv_indices"):
        attnlib.attention_varlen(q[0].transpose(1, 0, 2).reshape(SQ, HQ, D), k[0].transpose(1, 0, 2),
                                 v[0].transpose(1, 0, 2), np.array([0, SQ]), np.array([0, SK]),
                                 gather_kv_indices=idx[0])
    pages = k[0].transpose(1, 0, 2)[None]  # one page of all keys
    with pytest.raises(ValueError, match="gather_kv_indices"):
        attention(q[:1], pages, v[0].transpose(1, 0, 2)[None], block_table=np.zeros((1, 1), np.int64),
                  cache_seqlens=np.array([SK]), gather_kv_indices=idx[:1])


def test_selection_mask_mod_and_tile_search_equal_the_dense_lists():
    q, k, v, _, idx = _problem(per_head=True)
    pb = parse(q, k, v, scale=None, check_finite_inputs=False)[3]
    sel = Options.parse(gather_kv_indices=idx).selection(pb)
    dense = sel.dense(pb.batch, pb.hk)[:, :, 0]  # (B, HK, Sq, Sk)
    np.testing.assert_array_equal(dense.repeat(HQ // HK, 1), _listed(idx, SK, True))
    b, h = np.arange(B)[:, None, None, None], np.arange(HQ)[None, :, None, None]
    grid = sel(b, h, np.arange(SQ)[:, None], np.arange(SK)[None, :])
    np.testing.assert_array_equal(grid, _listed(idx, SK, True))
    tile = sel.tile(np.array([1, 1]), np.array([0, 5]), np.arange(4, 20), 30, 77)
    np.testing.assert_array_equal(tile, _listed(idx, SK, True)[1, [0, 5]][:, 4:20, 30:77])


def _kernel(q, k, v, idx, *, wrap=False, ignore=False):
    """A float32 top-k kernel written independently: gather each row's listed keys."""
    b_, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = np.zeros((b_, sq, hq, v.shape[-1]), dtype=np.float32)
    for b in range(b_):
        for h in range(hq):
            for i in range(sq):
                row = np.arange(sk) if ignore else idx[b, i]
                row = np.where(row < 0, row + sk, row) if wrap else row[(row >= 0) & (row < sk)]
                row = np.unique(row)
                row = row[row <= i + sk - sq]  # causal, bottom right
                if row.size:
                    s = (k[b, row, h // (hq // hk)] @ q[b, i, h]) / np.float32(math.sqrt(d))
                    w = np.exp(s - s.max())
                    out[b, i, h] = (w @ v[b, row, h // (hq // hk)]) / w.sum()
    return out


@pytest.mark.slow
def test_check_passes_a_correct_kernel_and_names_lists_ignored_or_wrapped(tmp_path):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 24, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 96, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, 96, 2, 16)).astype(np.float32)
    idx = rng.integers(-1, 96, size=(2, 24, 10))
    idx[..., 0] = -1
    good = check.check_kernel(q, k, v, _kernel(q, k, v, idx), causal=True, gather_kv_indices=idx)
    assert good.passed
    for kw, words in ((dict(ignore=True), "gather_kv_indices ignored"),
                      (dict(wrap=True), "the -1 entries read as key Sk - 1")):
        bad = check.check_kernel(q, k, v, _kernel(q, k, v, idx, **kw), causal=True, gather_kv_indices=idx)
        assert bad.passed is False and words in check.format_text(bad)
    # The CLI, with per-kv-head lists in bshd order (batch, Sq, Hk, topk).
    per_head = np.repeat(idx[:, :, None, :], 2, axis=2)
    for name, x in dict(q=q, k=k, v=v, out=_kernel(q, k, v, idx), idx=per_head).items():
        np.save(tmp_path / f"{name}.npy", x)
    args = [f"--{n}={tmp_path / n}.npy" for n in ("q", "k", "v", "out")]
    from attnlib.check.cli import main
    assert main(args + ["--causal", f"--gather-kv-indices={tmp_path / 'idx.npy'}"]) == 0
    assert main(args + ["--causal"]) == 1  # without the lists: the dense attention, a failure


def test_the_rescale_counts_follow_the_key_tiles_in_both_paths(monkeypatch):
    """A review's case: keys 4..7 of one tile and key 0 of another hidden by the left padding;
    the gathered path counts per key tile, as the dense tiles and `reference_rescales` do."""
    q, k, v = np.ones((1, 1, 1, 1)), np.arange(8.0).reshape(1, 1, 8, 1), np.ones((1, 1, 8, 1))
    idx = np.array([[[0, 4, 5, 6, 7]]])
    for cost in (0, 10**18):
        monkeypatch.setattr(sparse, "GATHER_COST", cost)
        stats = attention(q, k, v, gather_kv_indices=idx, key_leftpad=np.array([4]), scale=1.0, block_k=4,
                          return_stats=True)[1]
        np.testing.assert_array_equal(stats.rescales.ravel(), [0, 0])
    scores = attnlib.reference_scores(q, k, key_leftpad=np.array([4]), scale=1.0)
    scores = np.where(_listed_one(idx, 8), scores, -np.inf)
    np.testing.assert_array_equal(attnlib.reference_rescales(scores, 1, 4).ravel(), [0, 0])


def _listed_one(idx, sk):
    mask = np.zeros(idx.shape[:-1] + (sk,), dtype=bool)
    np.put_along_axis(mask, np.where((idx >= 0) & (idx < sk), idx, 0), (idx >= 0) & (idx < sk), axis=-1)
    return mask


def test_check_takes_narrow_integer_lists_and_bshd_lists_without_a_batch_axis():
    rng = np.random.default_rng(9)
    # int8 lists, Sk past int8's range: a failing kernel gets a verdict (its diagnosis adds Sk).
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    k = v = rng.standard_normal((1, 200, 2, 8)).astype(np.float32)
    idx = np.array([[[-1, 3, 7]] * 4], np.int8)
    assert check.check_kernel(q, k, v, np.zeros((1, 4, 2, 8), np.float32), gather_kv_indices=idx).passed is False
    # 3-D bshd inputs: per-kv-head lists are (Sq, Hk, topk), even where Sq == Hk.
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 2, 8), (10, 2, 8), (10, 2, 8)))
    lists = np.array([[[0, 1], [5, 6]], [[2, 3], [8, 9]]])  # (Sq, Hk, topk)
    out = np.zeros((2, 2, 8), np.float32)
    for i in range(2):
        for h in range(2):
            s = k[lists[i, h], h] @ q[i, h] / np.float32(math.sqrt(8))
            w = np.exp(s - s.max())
            out[i, h] = w @ v[lists[i, h], h] / w.sum()
    assert check.check_kernel(q, k, v, out, gather_kv_indices=lists).passed
    assert check.check_kernel(q, k, v, out, gather_kv_indices=np.swapaxes(lists, 0, 1)).passed is False
