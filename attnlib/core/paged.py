"""Paged KV caches: FlashAttention's ``flash_attn_with_kvcache`` / vLLM's layout, read in place.

The keys and values live in pages, ``k_cache: (num_blocks, page_size, Hk, D)``; batch entry
``b`` owns the pages ``block_table[b, 0], block_table[b, 1], ...`` and its key ``j`` (for
``j < cache_seqlens[b]``) is ``k_cache[block_table[b, j // page_size], j % page_size]``::

    block_table[b] = [7, 2, 5]        page_size = 4, cache_seqlens[b] = 10
    keys 0..3 -> page 7,  keys 4..7 -> page 2,  keys 8, 9 -> page 5 (rows 0, 1)

Each batch entry's keys stream through `attention_stream` a few whole pages at a time (the
key tiles are the chunks, so they start at page boundaries), gathered from the cache one
chunk at a time: the memory is one chunk's copy plus the queries' state, whatever the
number of pages in the cache, and pages no sequence owns are never read.
"""

from __future__ import annotations

import math

from dataclasses import replace

import numpy as np

from . import device as dev_mod
from .backend import NUMPY, backend_for
from .arrays import as_numpy
from . import problem, validate
from .options import Call
from .stream import stream_forward
from .tilesizes import DEFAULT_TILES
from .parallel import run_tiles

#: Keys per chunk (a whole number of pages, at least one) when not given.
DEFAULT_CHUNK_KEYS = DEFAULT_TILES.block_k


def page_tables(block_table, cache_seqlens, batch: int, num_blocks: int, page_size: int):
    """Checked ``(block_table (batch, max_blocks) int64, cache_seqlens (batch,) int64)``:
    every page a sequence reads (its first ``ceil(len / page_size)`` entries) is a page of
    the cache; entries past them are never read (they may hold anything, e.g. -1)."""
    table = validate._integers(as_numpy(block_table, "block_table"), "block_table")
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch={batch}, max_blocks), got {table.shape}")
    lens = validate.lengths(as_numpy(cache_seqlens, "cache_seqlens"), "cache_seqlens", (batch,),
                         table.shape[1] * page_size, "max_blocks * page_size")
    table, lens = table.astype(np.int64), lens.astype(np.int64)
    for b in range(batch):
        used = table[b, :-(-int(lens[b]) // page_size)]
        if used.size and (used.min() < 0 or used.max() >= num_blocks):
            bad = int(used[(used < 0) | (used >= num_blocks)][0])
            raise ValueError(f"block_table[{b}] names page {bad}, but the cache has pages 0..{num_blocks - 1}")
    return table, lens


def paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, *, causal=False,
                    causal_align="bottom_right", window=None, softcap=None, alibi_slopes=None,
                    sinks=None, scale=None, block_q=None, chunk_keys=None, workers=None,
                    return_lse=False, check_finite=True):
    """Attention of ``q`` over a paged KV cache (see the module docstring); reached as
    ``attention(q, k_cache, v_cache, block_table=..., cache_seqlens=...)``.

    Parameters
    ----------
    q : array_like, shape ``(batch, Hq, Sq, D)``
        attnlib's layout (one batch axis).
    k_cache, v_cache : array_like, shapes ``(num_blocks, page_size, Hk, D)`` and
        ``(num_blocks, page_size, Hk, Dv)``
        The pages (a numpy array or an ``np.memmap``: only the pages read are touched).
    block_table : array_like of int, shape ``(batch, max_blocks)``
    cache_seqlens : array_like of int, shape ``(batch,)``
        Entry ``b``'s keys: its first ``cache_seqlens[b]`` positions, page by page.
    causal, causal_align, window, softcap, scale, alibi_slopes, sinks
        As in `attention`, per batch entry with ``Sk = cache_seqlens[b]`` (bottom-right:
        the queries are the last ``Sq`` positions); ALiBi slopes and sinks ``(Hq,)`` or
        ``(batch, Hq)``.
    block_q : int, optional
        Query tile.
    chunk_keys : int, optional
        Keys gathered at a time: rounded down to whole pages (at least one); default 256.
        The key tiles are the chunks, so every tile starts on a page boundary.
    workers : int, optional
        Threads, over the batch entries (each entry's work is serial and so bit-identical
        for any thread count); default: one per available CPU, BLAS held to one thread.
    return_lse : bool
        Also return ``lse: (batch, Hq, Sq)``.
    check_finite : bool
        Refuse NaN or inf in q and in every page read.

    Returns
    -------
    out : ndarray, shape ``(batch, Hq, Sq, Dv)``; ``lse`` with ``return_lse``.

    Notes
    -----
    Equal to `attention` on the contiguous keys with ``kv_lengths = cache_seqlens`` up to
    rounding (the tiles differ).  Memory: one chunk of every head's keys and values in
    float64 and its score tile per thread, plus the queries' state and the output;
    independent of the number of pages in the cache.
    """
    if chunk_keys is not None:  # the call's block_k below
        validate.positive_int(chunk_keys, "chunk_keys")
    return paged_forward(q, k_cache, v_cache, Call.bind(locals(), block_k=chunk_keys))


def paged_forward(q, k_cache, v_cache, call: Call, dev=None):
    """`paged_attention` of the bound ``call`` (the page table among its options; ``block_k``
    the keys gathered at a time).  ``dev``: a torch device, where the pages are gathered and
    attended to with torch (`attnlib.core.stream` on the torch backend), torch tensors out;
    None: numpy."""
    opts, check_finite = call.options, call.check_finite
    xp = NUMPY if dev is None else backend_for(dev)  # the arrays' backend: reading, checks, buffers
    q, k_cache, v_cache = (xp.read(x, name) for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")))
    if q.ndim != 4:
        raise ValueError(f"q must be (batch, Hq, Sq, D) with a paged cache, got shape {tuple(q.shape)}")
    for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if x.ndim != 4:
            raise ValueError(f"{name} must be (num_blocks, page_size, Hk, D), got shape {tuple(x.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must have the same pages and heads, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if check_finite:  # the pages are checked as they are read (only those read)
        xp.checked_max(q, "q")
    batch, hq = q.shape[0], q.shape[1]
    num_blocks, page_size = k_cache.shape[:2]
    if page_size == 0:
        raise ValueError("the cache's page_size (axis 1 of k_cache) must be at least 1")
    table, lens = page_tables(opts.block_table, opts.cache_seqlens, batch, num_blocks, page_size)
    pages_per_chunk = max(1, (call.block_k or DEFAULT_CHUNK_KEYS) // page_size)
    workers = validate.workers(call.workers)
    slopes = problem.per_entry(opts.alibi_slopes, "alibi_slopes", batch, hq)
    sink = problem.per_entry(opts.sinks, "sinks", batch, hq)
    out, lse = xp.empty(tuple(q.shape[:3]) + (v_cache.shape[-1],)), xp.empty(tuple(q.shape[:3]))

    def chunks(b):
        n = int(lens[b])
        used = -(-n // page_size)  # the table entries this entry reads; later ones never
        for p0 in range(0, used, pages_per_chunk):
            pages = table[b, p0:min(p0 + pages_per_chunk, used)]
            keys = min(n - p0 * page_size, pages.size * page_size)
            if dev is not None:  # the page numbers, as an index on the device
                pages = dev_mod.index_tensor(pages, dev)
            # (pages, page_size, Hk, D) -> (pages * page_size, Hk, D) -> (Hk, keys, D)
            k = k_cache[pages].reshape((-1,) + tuple(k_cache.shape[2:]))[:keys]
            v = v_cache[pages].reshape((-1,) + tuple(v_cache.shape[2:]))[:keys]
            if check_finite:
                for x, name in ((k, "k_cache"), (v, "v_cache")):
                    bad = np.argwhere(~np.isfinite(x)) if dev is None else \
                        xp.torch.nonzero(~xp.isfinite(x)).cpu().numpy()  # a synchronisation per chunk
                    if bad.size:
                        j = p0 * page_size + int(bad[0][0])  # the key's position in its sequence
                        raise ValueError(f"{name} page {int(table[b, j // page_size])} holds NaN or inf "
                                         f"(key {j} of batch entry {b}); pass check_finite=False to "
                                         "skip this check")
            yield k.swapaxes(0, 1), v.swapaxes(0, 1)
        if n == 0:  # no keys: one empty chunk, so that the stream knows the shapes
            yield xp.zeros((k_cache.shape[2], 0, k_cache.shape[3])), xp.zeros((v_cache.shape[2], 0, v_cache.shape[3]))

    def entry(b):
        block_k = min(pages_per_chunk * page_size, max(1, int(lens[b])))
        # This entry's slopes and sinks: already checked, so set without a second parse.
        entry_opts = replace(opts, alibi_slopes=slopes(b), sinks=sink(b), block_table=None, cache_seqlens=None)
        # The torch backend runs its own threads on the CPU; numpy one thread per entry.
        entry_call = replace(call, options=entry_opts, block_k=block_k, return_lse=True, check_finite=False,
                             workers=1 if dev is None else None, device=dev)
        out[b], lse[b] = stream_forward(q[b], chunks(b), entry_call, total_keys=int(lens[b]))

    run_tiles(entry, range(batch), min(workers, max(1, batch)) if dev is None else 1)
    return (out, lse) if call.return_lse else out


def gather_pages(cache, block_table, cache_seqlens) -> np.ndarray:
    """The contiguous keys (or values) of a paged cache, ``(batch, Hk, max_len, D)``, zero
    past each entry's length (for a dense comparison or a check; its memory is the whole
    cache's)."""
    cache = np.asarray(cache)
    table, lens = page_tables(block_table, cache_seqlens, len(np.asarray(cache_seqlens)), cache.shape[0],
                              cache.shape[1])
    page_size = cache.shape[1]
    longest = int(lens.max(initial=0))
    full = np.zeros((table.shape[0], longest) + cache.shape[2:], dtype=cache.dtype)
    for b, n in enumerate(lens):
        pages = table[b, :math.ceil(int(n) / page_size)]
        full[b, :n] = cache[pages].reshape((-1,) + cache.shape[2:])[:n]
    return np.swapaxes(full, 1, 2)


__all__ = ["paged_attention", "gather_pages", "page_tables"]
