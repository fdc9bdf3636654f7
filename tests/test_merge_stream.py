"""Split-KV merging and streaming over chunks (generators and a memmapped KV cache)."""

import numpy as np
import pytest

import attnlib
from attnlib import (attention, attention_errors, attention_stream, merge_attention, random_qkv,
                     reference_attention)
from attnlib.evidence.memory import peak_memory


@pytest.mark.parametrize("seed", range(8))
def test_merge_of_random_key_splits_equals_unsplit(seed, strict):
    rng = np.random.default_rng(seed)
    sq, sk = int(rng.integers(1, 80)), int(rng.integers(1, 300))
    q, k, v = random_qkv(sq, sk, 8, batch=(2,), heads=2, seed=seed)
    cuts = np.sort(rng.integers(0, sk + 1, int(rng.integers(1, 6))))
    bounds = [0, *cuts.tolist(), sk]  # repeated cuts make empty ranges
    outs, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        o, l = attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True, block_q=16, block_k=16)
        outs.append(o)
        lses.append(l)
    out, lse = merge_attention(outs, lses)
    ref, ref_lse = reference_attention(q, k, v, return_lse=True)
    assert attention_errors(out, q, k, v).rel_error < 1e-13
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)


def test_merge_ignores_empty_partials_cleanly(strict):
    out0 = np.zeros((3, 2))
    lse0 = np.full(3, -np.inf)
    out1 = np.arange(6.0).reshape(3, 2)
    lse1 = np.array([0.5, -np.inf, 2.0])
    out1[1] = 0.0
    out, lse = merge_attention([out0, out1, out0], [lse0, lse1, lse0])
    np.testing.assert_array_equal(out, out1)
    np.testing.assert_array_equal(lse, lse1)
    out, lse = merge_attention([out0], [lse0])
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_merge_validation():
    with pytest.raises(ValueError, match="as many outs as lses"):
        merge_attention([np.zeros((2, 2))], [])
    with pytest.raises(ValueError, match=r"do not match"):
        merge_attention([np.zeros((2, 2))], [np.zeros(3)])
    with pytest.raises(ValueError, match="finite or -inf"):
        merge_attention([np.zeros((2, 2))], [np.array([np.nan, 0.0])])


@pytest.mark.parametrize("splits", [2, 3, 7, 100])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, causal_align="top_left"),
                                dict(window=(30, 5), kv_lengths=[150, 0]),
                                dict(softcap=20.0, alibi_slopes=[0.1, 0.3])])
def test_kv_splits_equal_unsplit(splits, kw, strict):
    q, k, v = random_qkv(90, 150, 16, batch=(2,), heads=2, kv_heads=1, seed=splits)
    out, lse = attention(q, k, v, return_lse=True, block_q=32, block_k=16, **kw)
    out_s, lse_s, stats = attention(q, k, v, return_lse=True, return_stats=True, block_q=32,
                                    block_k=16, kv_splits=splits, **kw)
    assert attention_errors(out_s, q, k, v, **kw).rel_error < 1e-13
    np.testing.assert_allclose(out_s, out, rtol=0, atol=1e-14)  # measured 3 eps
    np.testing.assert_array_equal(np.isneginf(lse_s), np.isneginf(lse))
    fin = np.isfinite(lse)
    np.testing.assert_allclose(lse_s[fin], lse[fin], rtol=1e-13)
    assert stats.processed_tiles > 0


@pytest.mark.parametrize("kw, total", [
    (dict(), False), (dict(causal=True), True), (dict(causal=True, causal_align="top_left"), False),
    (dict(window=(100, 20)), True), (dict(window=(50, None), causal_align="top_left"), False),
    (dict(causal=True, softcap=10.0, alibi_slopes=[0.05, 0.1, 0.2, 0.4]), True),
])
@pytest.mark.slow
@pytest.mark.parametrize("sq", [1, 37, 128])
def test_stream_equals_attention(kw, total, sq, strict):
    q, k, v = random_qkv(sq, 1000, 16, 8, heads=4, kv_heads=2, seed=sq)
    sizes = [0, 1, 130, 0, 499, 370]  # uneven, with empty chunks
    edges = np.cumsum([0] + sizes)
    chunks = ((k[..., a:b, :], v[..., a:b, :]) for a, b in zip(edges[:-1], edges[1:]))
    extra = dict(total_keys=1000) if total else {}
    out, lse = attention_stream(q, chunks, return_lse=True, block_q=32, block_k=64, **kw, **extra)
    # 1e-13 as for the other paths here (measured: at most 2.6 eps); BOUND (1e-9) would pass
    # a chunk seam handled wrong by 1e-10.
    assert attention_errors(out, q, k, v, **kw).rel_error < 1e-13
    ref_lse = reference_attention(q, k, v, return_lse=True, **kw)[1]
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~fin)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-13)


def test_stream_from_memmap(tmp_path):
    q, k, v = random_qkv(8, 5000, 16, seed=3)
    np.save(tmp_path / "k.npy", k)
    np.save(tmp_path / "v.npy", v)
    km = np.load(tmp_path / "k.npy", mmap_mode="r")
    vm = np.load(tmp_path / "v.npy", mmap_mode="r")
    chunks = ((km[i:i + 1024], vm[i:i + 1024]) for i in range(0, 5000, 1024))
    out = attention_stream(q, chunks, causal=True, total_keys=5000)
    assert attention_errors(out, q, k, v, causal=True).rel_error < 1e-13


def test_stream_validation():
    q, k, v = random_qkv(4, 10, 8, seed=0)
    with pytest.raises(ValueError, match="total_keys is needed"):
        attention_stream(q, [(k, v)], causal=True)
    with pytest.raises(ValueError, match=r"the chunks hold 10 keys, but total_keys=12"):
        attention_stream(q, [(k, v)], causal=True, total_keys=12)
    with pytest.raises(ValueError, match=r"more than total_keys=5"):
        attention_stream(q, [(k, v)], causal=True, total_keys=5)
    with pytest.raises(ValueError, match="kv_chunks is empty"):
        attention_stream(q, [])
    with pytest.raises(ValueError, match=r"kv_chunks\[1\] must be a \(k_chunk, v_chunk\) pair"):
        attention_stream(q, [(k, v), k])
    with pytest.raises(ValueError, match=r"k of kv_chunks\[0\] contains NaN"):
        bad = k.copy()
        bad[3, 1] = np.inf
        attention_stream(q, [(bad, v)])
    with pytest.raises(ValueError, match="same head dim"):
        attention_stream(q, [(k[:, :4], v)])
    with pytest.raises(ValueError, match=r"kv_chunks\[1\] has shape"):
        attention_stream(q, [(k, v), (k, v[:, :3])])


@pytest.mark.slow
def test_decode_against_a_memmapped_cache_in_bounded_memory():
    # 2**18 keys of dimension 64: 256 MiB of float64 k and v on disk, 64 decode queries.
    r = peak_memory("stream", 64, 2**18, 64, block_k=512, chunk=65536)
    assert r["cache_bytes"] == 2 * 2**18 * 64 * 8
    assert r["working_bytes"] < r["cache_bytes"] / 100
    assert r["working_bytes"] < attnlib.evidence.memory.CAP_BYTES
