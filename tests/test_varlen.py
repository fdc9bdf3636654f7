"""attention_varlen against the same problem padded into a batch (q_lengths, kv_lengths):
two independent routes to per-sequence attention."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlib
from attnlib.judge.metrics import rel_error

STRICT = dict(divide="raise", over="raise", invalid="raise")


def packed_problem(lens_q, lens_k, hq=4, hk=2, d=16, dv=12, seed=0):
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d))
    k = rng.standard_normal((cu_k[-1], hk, d))
    v = rng.standard_normal((cu_k[-1], hk, dv))
    return q, k, v, cu_q, cu_k


def padded(x, cu, width):
    """(total, H, D) -> (batch, H, width, D), zero past each sequence."""
    out = np.zeros((len(cu) - 1, x.shape[1], width, x.shape[2]))
    for b in range(len(cu) - 1):
        out[b, :, :cu[b + 1] - cu[b]] = np.swapaxes(x[cu[b]:cu[b + 1]], 0, 1)
    return out


def unpad(x, cu):
    """(batch, H, width, D) -> (total, H, D); lse (batch, H, width) -> (H, total)."""
    if x.ndim == 3:
        return np.concatenate([x[b, :, :cu[b + 1] - cu[b]] for b in range(len(cu) - 1)], axis=1)
    return np.concatenate([np.swapaxes(x[b, :, :cu[b + 1] - cu[b]], 0, 1) for b in range(len(cu) - 1)])


def as_batch(q, k, v, cu_q, cu_k, seqused_k=None):
    lq, lk = np.diff(cu_q), np.diff(cu_k)
    used = lk if seqused_k is None else np.asarray(seqused_k)
    wq, wk = max(1, lq.max(initial=0)), max(1, lk.max(initial=0))
    return (padded(q, cu_q, wq), padded(k, cu_k, wk), padded(v, cu_k, wk),
            dict(q_lengths=lq, kv_lengths=used))


LENS = {  # (lens_q, lens_k): ragged, empty sequences of either kind, decode
    "ragged": ([37, 5, 64, 1], [37, 70, 64, 90]),
    "empty q and k": ([0, 12, 9, 0], [5, 0, 30, 0]),
    "decode": ([1, 1, 1], [100, 1, 257]),
    "one": ([50], [50]),
}
OPTIONS = {
    "causal": dict(causal=True),
    "causal top_left": dict(causal=True, causal_align="top_left"),
    "window softcap": dict(window=(9, 3), softcap=4.0),
    "sinks per sequence": "sinks",
    "alibi per head": dict(causal=True, alibi_slopes=np.array([0.5, 0.25, 0.125, 1.0])),
}


def options_for(name, batch, rng):
    o = OPTIONS[name]
    if o == "sinks":
        return dict(causal=True, sinks=2 * rng.standard_normal((batch, 4)))
    return dict(o)


@pytest.mark.parametrize("used", [False, True])
@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("lens", list(LENS))
def test_forward_equals_the_padded_batch(lens, opt, used):
    q, k, v, cu_q, cu_k = packed_problem(*LENS[lens])
    rng = np.random.default_rng(1)
    seqused = (rng.integers(0, np.diff(cu_k) + 1) if used else None)
    o = options_for(opt, len(cu_q) - 1, rng)
    with np.errstate(**STRICT):
        out, lse = attnlib.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=seqused, return_lse=True,
                                            block_q=16, block_k=24, **o)
        dense, dense_lse = attnlib.reference_attention_varlen(q, k, v, cu_q, cu_k, seqused_k=seqused,
                                                              return_lse=True, **o)
    qb, kb, vb, lengths = as_batch(q, k, v, cu_q, cu_k, seqused)
    ref, ref_lse = attnlib.reference_attention(qb, kb, vb, return_lse=True, **lengths, **o)
    size = attnlib.reference_attention(qb, kb, np.abs(vb), **lengths, **o)
    ref, size, ref_lse = unpad(ref, cu_q), unpad(size, cu_q), unpad(ref_lse, cu_q)
    assert out.shape == q.shape[:2] + v.shape[2:] and lse.shape == (q.shape[1], q.shape[0])
    for got, got_lse in ((out, lse), (dense, dense_lse)):
        assert rel_error(got, ref, size) < 1e-13
        assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        assert np.all(np.abs(got_lse[fin] - ref_lse[fin]) <= 1e-13 * np.maximum(1, np.abs(ref_lse[fin])))


@pytest.mark.parametrize("opt", ["causal", "window softcap", "sinks per sequence"])
@pytest.mark.parametrize("lens", ["ragged", "empty q and k"])
def test_backward_equals_the_padded_batch(lens, opt):
    q, k, v, cu_q, cu_k = packed_problem(*LENS[lens], seed=2)
    rng = np.random.default_rng(3)
    seqused = rng.integers(0, np.diff(cu_k) + 1)
    o = options_for(opt, len(cu_q) - 1, rng)
    out, lse = attnlib.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=seqused, return_lse=True, **o)
    dout = rng.standard_normal(out.shape)
    with np.errstate(**STRICT):
        grads = attnlib.attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k, seqused_k=seqused,
                                                  block_q=16, block_k=16, **o)
    qb, kb, vb, lengths = as_batch(q, k, v, cu_q, cu_k, seqused)
    want = attnlib.reference_attention_backward(qb, kb, vb, padded(dout, cu_q, qb.shape[2]), **lengths, **o)
    assert len(grads) == len(want)
    for g, w, cu in zip(grads[:3], want[:3], (cu_q, cu_k, cu_k)):
        w = unpad(w, cu)
        assert np.max(np.abs(g - w), initial=0) <= 1e-13 * max(1, np.abs(w).max(initial=0))
    if "sinks" in o:
        assert np.max(np.abs(grads[3] - want[3])) <= 1e-13 * max(1, np.abs(want[3]).max())
    # keys past seqused_k get no gradient
    for b in range(len(cu_k) - 1):
        assert not grads[1][cu_k[b] + seqused[b]:cu_k[b + 1]].any()


@settings(max_examples=30)
@given(lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=5),
       causal=st.booleans(), seed=st.integers(0, 2**16), bk=st.integers(1, 20))
@pytest.mark.slow
def test_any_packing(lens, causal, seed, bk):
    q, k, v, cu_q, cu_k = packed_problem([a for a, _ in lens], [b for _, b in lens], hq=2, hk=1, d=8, dv=8, seed=seed)
    out, lse = attnlib.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, block_k=bk)
    ref, ref_lse = attnlib.reference_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    assert np.allclose(out, ref, rtol=0, atol=1e-14) and np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.allclose(lse[fin], ref_lse[fin], rtol=1e-14, atol=1e-14)
    for b in range(len(lens)):  # each sequence alone
        qb, kb, vb = (np.swapaxes(x[c[b]:c[b + 1]], 0, 1) for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        alone = attnlib.attention(qb, kb, vb, causal=causal, block_k=bk)
        assert np.array_equal(np.swapaxes(alone, 0, 1), out[cu_q[b]:cu_q[b + 1]])  # the same arithmetic


def test_stats_per_sequence_and_torch_offsets():
    import torch

    q, k, v, cu_q, cu_k = packed_problem(*LENS["ragged"])
    out, stats = attnlib.attention_varlen(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), causal=True,
                                          return_stats=True, block_q=16, block_k=16)
    assert len(stats) == 4 and all(isinstance(s, attnlib.AttentionStats) for s in stats)
    assert stats[1].tile_kind.shape == (1, 5)  # 5 queries, 70 keys in 16-key tiles


def test_bad_offsets_and_options():
    q, k, v, cu_q, cu_k = packed_problem(*LENS["ragged"])
    before = [x.copy() for x in (q, k, v, cu_q, cu_k)]
    bad = [
        (dict(cu_seqlens_q=cu_q[::-1]), "cu_seqlens_q must rise from 0"),
        (dict(cu_seqlens_q=cu_q[:-1]), "cu_seqlens_q must rise from 0 to the packed length"),
        (dict(cu_seqlens_k=cu_k[:-1]), "cu_seqlens_k has 4 entries, cu_seqlens_q 5"),
        (dict(cu_seqlens_q=cu_q.astype(float)), "cu_seqlens_q must hold integers"),
        (dict(seqused_k=[37, 71, 64, 90]), "seqused_k"),
        (dict(seqused_k=[1, 2]), "seqused_k must have the batch shape"),
        (dict(max_seqlen_q=10), "max_seqlen_q=10 is shorter than the longest sequence"),
        (dict(kv_lengths=[1, 2, 3, 4]), "kv_lengths is not taken in the varlen layout"),
        (dict(sinks=np.zeros((3, 4))), "sinks must have shape"),
        (dict(q=q[None]), "q must be packed as"),
        (dict(cu_seqlens_q=None), "cu_seqlens_q is required"),
    ]
    for change, words in bad:
        args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k) | change
        with pytest.raises((ValueError, TypeError), match=words):
            attnlib.attention_varlen(**args)
    assert all(np.array_equal(a, b) for a, b in zip(before, (q, k, v, cu_q, cu_k)))


def test_torch_inputs_and_no_paged_arguments():
    import torch

    q, k, v, cu_q, cu_k = packed_problem(*LENS["ragged"])
    out = attnlib.attention_varlen(torch.tensor(q).to(torch.bfloat16), torch.tensor(k), torch.tensor(v), cu_q, cu_k)
    want = attnlib.attention_varlen(torch.tensor(q).to(torch.bfloat16).double().numpy(), k, v, cu_q, cu_k)
    assert isinstance(out, torch.Tensor)  # torch in, computed with torch, torch out
    assert np.abs(out.numpy() - want).max() <= 1e-13  # bfloat16 read exactly; the products round differently
    with pytest.raises(ValueError, match="block_table is not taken in the varlen layout"):
        attnlib.attention_varlen(q, k, v, cu_q, cu_k, block_table=np.zeros((4, 1), int), cache_seqlens=[1, 1, 1, 1])
