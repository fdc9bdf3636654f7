"""attention over a paged KV cache equals attention over the contiguous keys, and reads the
pages in place: its memory does not grow with the pages in the cache (measured)."""

import numpy as np
import pytest

import attnlib
from attnlib.evidence import memory
from attnlib.judge.metrics import rel_error
from attnlib.core.paged import gather_pages

STRICT = dict(divide="raise", over="raise", invalid="raise")


def paged_problem(lens, page_size, sq=3, hq=4, hk=2, d=16, dv=10, spare=7, seed=0):
    """A cache with the sequences' pages scattered among spare ones, and the contiguous keys."""
    rng = np.random.default_rng(seed)
    need = [-(-n // page_size) for n in lens]
    num_blocks = sum(need) + spare
    k_cache = rng.standard_normal((num_blocks, page_size, hk, d))
    v_cache = rng.standard_normal((num_blocks, page_size, hk, dv))
    order = rng.permutation(num_blocks)
    table = np.full((len(lens), max(need) + 2), -1, dtype=np.int32)  # unused entries: -1
    at = 0
    for b, m in enumerate(need):
        table[b, :m] = order[at:at + m]
        at += m
    q = rng.standard_normal((len(lens), hq, sq, d))
    return q, k_cache, v_cache, table, np.array(lens, dtype=np.int32)


CASES = {
    "causal": dict(causal=True),
    "window top_left": dict(causal=True, causal_align="top_left", window=(20, None)),
    "softcap alibi": dict(softcap=6.0, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4])),
    "sinks": dict(causal=True, sinks=np.array([[1.0, -2.0, 0.5, 3.0], [0.0, 0.0, 1.0, 1.0], [5.0, -5, 2, 2]])),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size, sq", [(1, 1), (7, 3), (16, 40), (256, 5)])
def test_paged_equals_contiguous(page_size, sq, case):
    q, kc, vc, table, lens = paged_problem([61, 0, 300], page_size, sq=sq)
    o = CASES[case]
    with np.errstate(**STRICT):
        out, lse = attnlib.attention(q, kc, vc, block_table=table, cache_seqlens=lens, return_lse=True,
                                     block_k=50, **o)
    k, v = gather_pages(kc, table, lens), gather_pages(vc, table, lens)
    ref, ref_lse = attnlib.reference_attention(q, k, v, kv_lengths=lens, return_lse=True, **o)
    size = attnlib.reference_attention(q, k, np.abs(v), kv_lengths=lens, **o)
    assert rel_error(out, ref, size) < 1e-13
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.all(np.abs(lse[fin] - ref_lse[fin]) <= 1e-13 * np.maximum(1, np.abs(ref_lse[fin])))


def test_key_tiles_start_on_page_boundaries_and_threads_agree():
    """A chunk is whole pages (chunk_keys rounded down), whatever block_k asks for; the
    result does not depend on the thread count."""
    q, kc, vc, table, lens = paged_problem([200, 130, 77, 1], 16, sq=8)
    runs = [attnlib.attention(q, kc, vc, block_table=table, cache_seqlens=lens, causal=True, block_k=40,
                              workers=w) for w in (1, 2, 3)]
    assert all(np.array_equal(runs[0], r) for r in runs[1:])
    # 40 keys -> chunks of 2 pages (32 keys): the same as asking for 32.
    assert np.array_equal(runs[0], attnlib.attention(q, kc, vc, block_table=table, cache_seqlens=lens,
                                                     causal=True, block_k=32))


def test_memmapped_cache_and_only_used_pages_are_read(tmp_path):
    """Pages no sequence owns are never read: NaN there changes nothing (and is not refused)."""
    q, kc, vc, table, lens = paged_problem([100, 45], 8, spare=50)
    used = {int(p) for b, n in enumerate(lens) for p in table[b, :-(-int(n) // 8)]}
    spare = [p for p in range(kc.shape[0]) if p not in used]
    kc[spare], vc[spare] = np.nan, np.inf
    np.save(tmp_path / "k.npy", kc)
    np.save(tmp_path / "v.npy", vc)
    km, vm = np.load(tmp_path / "k.npy", mmap_mode="r"), np.load(tmp_path / "v.npy", mmap_mode="r")
    out = attnlib.attention(q, km, vm, block_table=table, cache_seqlens=lens, causal=True)
    ref = attnlib.attention(q, gather_pages(kc, table, lens), gather_pages(vc, table, lens), kv_lengths=lens,
                            causal=True)
    assert np.all(np.isfinite(out)) and np.abs(out - ref).max() < 1e-14
    kc[table[0, 0], 3] = np.nan  # a used page: refused, named
    with pytest.raises(ValueError, match="NaN or inf"):
        attnlib.attention(q, kc, vc, block_table=table, cache_seqlens=lens)


@pytest.mark.slow
def test_memory_does_not_grow_with_the_cache():
    """tracemalloc in a fresh process: the same sequence (4096 keys on 16-key pages) in caches
    of 256, 2,560 and 25,600 pages (2 MiB to 200 MiB of keys and values): the call's traced
    peak is the same within 1 KiB (Python ints of other page numbers: 32 bytes seen), where a
    copy of the cache would add megabytes; against the sequence's length it grows only by
    the page table (8 bytes a page)."""
    peaks = [memory.peak_memory("paged", 1, 4096, d=64, cache_pages=p, page_size=16) for p in (256, 2560, 25600)]
    assert peaks[0]["input_bytes"] < peaks[2]["input_bytes"] / 90
    spread = max(p["peak_bytes"] for p in peaks) - min(p["peak_bytes"] for p in peaks)
    assert spread <= 1024, [p["peak_bytes"] for p in peaks]
    longer = memory.peak_memory("paged", 1, 32768, d=64, cache_pages=25600, page_size=16)
    pages_added = (32768 - 4096) // 16
    assert longer["peak_bytes"] - peaks[0]["peak_bytes"] <= 8 * pages_added + 4096
    assert peaks[0]["working_bytes"] < 2**20


def test_bad_tables_and_options():
    q, kc, vc, table, lens = paged_problem([61, 0, 300], 16)
    cases = [
        (dict(block_table=table[:2]), "block_table must have shape"),
        (dict(cache_seqlens=[61, 0, 10**6]), "cache_seqlens must be in"),
        (dict(cache_seqlens=None), "needs both block_table and cache_seqlens"),
        (dict(block_table=np.where(table == table[0, 0], 10**6, table)), "names page 1000000"),
        (dict(block_table=table.astype(float)), "block_table must hold integers"),
        (dict(kv_lengths=lens), "kv_lengths cannot be combined with a paged KV cache"),
        (dict(kv_splits=2, return_stats=True), "kv_splits, return_stats cannot be combined"),
        (dict(q=q[0]), "q must be"),
        (dict(k=kc[:, :, :1]), "same pages and heads"),
    ]
    for change, words in cases:
        args = dict(q=q, k=kc, v=vc, block_table=table, cache_seqlens=lens) | change
        with pytest.raises((ValueError, TypeError), match=words):
            attnlib.attention(**args)


def test_table_entries_past_the_used_pages_are_never_read():
    q, kc, vc, table, lens = paged_problem([20, 33], 16)
    filler = table.copy()
    for b, n in enumerate(lens):
        filler[b, -(-int(n) // 16):] = 10**6  # not a page of the cache: never indexed
    out = attnlib.attention(q, kc, vc, block_table=filler, cache_seqlens=lens, causal=True, block_k=64)
    assert np.array_equal(out, attnlib.attention(q, kc, vc, block_table=table, cache_seqlens=lens, causal=True,
                                                 block_k=64))
    kc = kc.copy()
    kc[table[1, 1], 5] = np.nan
    with pytest.raises(ValueError, match=rf"k_cache page {table[1, 1]} holds NaN or inf \(key 21 of batch entry 1\)"):
        attnlib.attention(q, kc, vc, block_table=table, cache_seqlens=lens)
    with pytest.raises(ValueError, match="block_k must be a positive integer"):
        attnlib.attention(q, kc, vc, block_table=table, cache_seqlens=lens, block_k=0)
