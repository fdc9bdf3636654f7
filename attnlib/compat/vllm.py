"""vLLM's paged-attention test reference ``ref_paged_attn``, exact in float64, with its assert
twin (`docs/semantics.md`, "Drop-in references: vLLM").

vLLM's kernel tests (``tests/kernels/attention/test_flash_attn.py``, ``test_flashinfer.py``
and their near-copies) judge every paged kernel against ``ref_paged_attn``: ragged queries
``(sum(query_lens), Hq, D)`` over an NHD paged cache ``(num_blocks, block_size, Hk, D)``,
causal (bottom-right) always, an optional sliding window of ``sliding_window`` keys and a
softcap.  Here each sequence is attnlib's paged attention on the cache as it is (pages read
in place, never gathered whole):

>>> import numpy as np
>>> from attnlib.compat.vllm import ref_paged_attn
>>> rng = np.random.default_rng(0)
>>> kc, vc = rng.standard_normal((2, 4, 3, 2, 8))        # 4 blocks of 3 slots, 2 kv heads
>>> q = rng.standard_normal((3, 4, 8))                    # 2 + 1 query tokens, 4 heads
>>> out = ref_paged_attn(q, kc, vc, [2, 1], [5, 3], np.array([[2, 0], [1, 3]]), 8 ** -0.5)
>>> out.shape, out.dtype
((3, 4, 8), dtype('float64'))
"""

from __future__ import annotations

import numpy as np

from . import _common as C

#: The check keywords an assert twin sets itself (from the call's own arguments).
_OWN = ("layout", "block_table", "cache_seqlens", "q_lengths", "causal", "window", "softcap", "scale")


def _lengths(query_lens, kv_lens, block_tables):
    """``(query_lens, kv_lens, table)`` as host int64 arrays, checked against each other."""
    if query_lens is None or kv_lens is None:
        raise TypeError("query_lens and kv_lens are required (lists of int or int tensors)")
    ql, kl = C.ints(query_lens, "query_lens"), C.ints(kv_lens, "kv_lens")
    for name, x in (("query_lens", ql), ("kv_lens", kl)):
        if x.ndim != 1:
            raise ValueError(f"{name} must be one length per sequence (1-D), got shape {tuple(x.shape)}")
        if (x < 0).any():
            raise ValueError(f"{name} must be >= 0, got {x.tolist()}")
    if ql.shape != kl.shape:
        raise ValueError(f"query_lens and kv_lens must name the same sequences, got {ql.size} and {kl.size}")
    table = C.ints(block_tables, "block_tables")
    if table is None or table.ndim != 2:
        raise ValueError(f"block_tables must be (num_seqs, max_blocks_per_seq), got "
                         f"{None if table is None else tuple(table.shape)}")
    if table.shape[0] < ql.size:
        raise ValueError(f"block_tables has {table.shape[0]} rows for {ql.size} sequences")
    return ql, kl, table[:ql.size]


def _check_pages(table, kl, key_cache):
    """The pages each sequence reads, checked in vLLM's names (``block_tables``, ``kv_lens``)."""
    from ._flash import used_pages
    page, pages = int(key_cache.shape[1]), int(key_cache.shape[0])
    if (kl > table.shape[1] * page).any():
        i = int(np.argmax(kl > table.shape[1] * page))
        raise ValueError(f"kv_lens[{i}] = {int(kl[i])} exceeds block_tables' {table.shape[1]} blocks of "
                         f"{page} slots")
    used_pages(table, kl, page, pages, "block_tables")


def _options(scale, sliding_window, soft_cap) -> dict:
    """attnlib's options of the reference: causal (bottom-right) always, ``sliding_window``
    keys including the diagonal (window ``(sw - 1, 0)``), softcap after the scale."""
    if scale is None:
        raise TypeError("scale is required (vLLM's reference takes no default)")
    opts = {"causal": True, "scale": C.scalar(scale, "scale")}
    if sliding_window is not None:
        if isinstance(sliding_window, (bool, np.bool_)) or not isinstance(sliding_window, (int, np.integer)):
            raise TypeError(f"sliding_window must be an int (keys per query, the diagonal included) or None, "
                            f"got {sliding_window!r}")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (keys per query, the diagonal included), got "
                             f"{sliding_window}: vLLM's reference masks every key then (NaN rows)")
        opts["window"] = (int(sliding_window) - 1, 0)
    if soft_cap is not None:
        cap = C.scalar(soft_cap, "soft_cap")
        if cap < 0:
            raise ValueError(f"soft_cap must be > 0, or 0 or None for none, got {soft_cap!r}")
        if cap > 0:  # 0: no cap, as the newer copies' ``soft_cap is not None and soft_cap > 0``
            opts["softcap"] = cap
    return opts


def _check_shapes(query, key_cache, value_cache, ql):
    for name, x, nd in (("query", query, 3), ("key_cache", key_cache, 4), ("value_cache", value_cache, 4)):
        if x is None or not hasattr(x, "shape") or len(x.shape) != nd:
            want = "(sum(query_lens), num_q_heads, head_size)" if nd == 3 else \
                "(num_blocks, block_size, num_kv_heads, head_size)"
            raise ValueError(f"{name} must be {want}, got shape {None if x is None else getattr(x, 'shape', x)}")
        if "float" not in str(x.dtype):
            raise TypeError(f"{name} must hold floating values, got {x.dtype}")
    if int(query.shape[0]) != int(ql.sum()):
        raise ValueError(f"query has {query.shape[0]} tokens but sum(query_lens) = {int(ql.sum())}")
    if tuple(key_cache.shape[:3]) != tuple(value_cache.shape[:3]):
        raise ValueError(f"key_cache and value_cache must have the same blocks, slots and heads, got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.shape[-1] != query.shape[-1]:
        raise ValueError(f"query and key_cache must have the same head_size, got {query.shape[-1]} and "
                         f"{key_cache.shape[-1]}")
    hq, hk = int(query.shape[1]), int(key_cache.shape[2])
    if hk == 0 or hq % hk:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hk})")


def ref_paged_attn(query, key_cache, value_cache, query_lens, kv_lens, block_tables, scale,
                   sliding_window=None, soft_cap=None):
    """vLLM's ``ref_paged_attn``, exact in float64.

    Parameters
    ----------
    query : tensor, shape ``(sum(query_lens), num_q_heads, head_size)``
        The sequences' query tokens, concatenated (ragged).  Never modified: vLLM's reference
        scales its slices in place (``q *= scale``), this one does not.
    key_cache, value_cache : tensor, shape ``(num_blocks, block_size, num_kv_heads, head_size)``
        NHD pages (``value_cache``'s last axis may differ: the output has it).
    query_lens, kv_lens : list of int or int tensor, shape ``(num_seqs,)``
        Sequence ``i`` has ``query_lens[i]`` queries, the last of its ``kv_lens[i]`` keys.
    block_tables : int tensor, shape ``(num_seqs, max_blocks_per_seq)``
        Sequence ``i``'s key ``j`` is ``key_cache[block_tables[i, j // block_size], j % block_size]``;
        only its first ``ceil(kv_lens[i] / block_size)`` entries are read.
    scale : float
        The score scale (required, as in vLLM).
    sliding_window : int, optional
        Each query sees its last ``sliding_window`` keys, its own position included
        (attnlib's window ``(sliding_window - 1, 0)``).
    soft_cap : float, optional
        ``soft_cap * tanh(s / soft_cap)`` of the scaled scores, before the mask; 0 or None: none
        (the copy in test_flash_attn.py divides by a 0 cap, the newer copies skip it: here 0 is none).

    Returns
    -------
    out : float64 tensor, shape ``(sum(query_lens), num_q_heads, head_size_v)``
        In ``query``'s kind (a torch tensor on its device, or numpy).  Causal is bottom-right
        (query ``i`` of a sequence sees keys ``j <= i + kv_len - query_len``); query head
        ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)`` (``repeat_interleave``).
        A query with no key (``query_len > kv_len``, its first ``query_len - kv_len`` rows)
        gives 0, where vLLM's reference gives NaN.

    Raises
    ------
    TypeError, ValueError
        Lengths that do not match the query, a table row short of a sequence's keys or
        naming a page outside the cache, ``sliding_window < 1``, ``soft_cap < 0``.
    """
    from ..core.tiled import attention

    ql, kl, table = _lengths(query_lens, kv_lens, block_tables)
    _check_shapes(query, key_cache, value_cache, ql)
    _check_pages(table, kl, key_cache)
    opts = _options(scale, sliding_window, soft_cap)
    starts = np.concatenate([[0], np.cumsum(ql)])
    hq, dv = int(query.shape[1]), int(value_cache.shape[-1])
    parts = []
    for i in range(ql.size):
        if ql[i] == 0:
            continue
        q_i = C.swap(query[int(starts[i]):int(starts[i + 1])], 0, 1)[None]  # (1, Hq, ql, D), a view
        out = attention(q_i, key_cache, value_cache, block_table=table[i:i + 1], cache_seqlens=kl[i:i + 1],
                        **opts)
        parts.append(C.swap(out[0], 0, 1))  # (ql, Hq, Dv)
    if not parts:
        return C.zeros_like(query, (0, hq, dv))
    return C.concat(parts, parts[0])


def assert_ref_paged_attn_close(output, query, key_cache, value_cache, query_lens, kv_lens, block_tables,
                                scale, sliding_window=None, soft_cap=None, **check):
    """Assert a paged kernel's ``output`` is `ref_paged_attn` of the same arguments, to within
    what a correct kernel in its precision differs by (`attnlib.testing.assert_attention_close`).

    ``output`` ``(sum(query_lens), num_q_heads, head_size_v)``, as vLLM's kernels return it.
    The ragged queries are padded into a batch ``(num_seqs, max(query_lens), Hq, D)`` in the
    kernel's own type (padded rows are zeros, left out with ``q_lengths``) and judged against
    the cache as it is (``block_table``, ``cache_seqlens``).  Rows with no key must be exactly 0.
    ``**check``: `check_kernel`'s further keywords (``dtype``, ``workers``, ``names``,
    ``device``, ...); those this twin sets from the call are refused.
    """
    C.no_own_keywords(check, _OWN, "ref_paged_attn")
    ql, kl, table = _lengths(query_lens, kv_lens, block_tables)
    _check_shapes(query, key_cache, value_cache, ql)
    _check_pages(table, kl, key_cache)
    opts = _options(scale, sliding_window, soft_cap)
    if output is None or not hasattr(output, "shape") or tuple(output.shape[:2]) != tuple(query.shape[:2]):
        raise ValueError(f"output must be (sum(query_lens), num_q_heads, head_size_v) = "
                         f"({query.shape[0]}, {query.shape[1]}, {value_cache.shape[-1]}), got shape "
                         f"{getattr(output, 'shape', output)}")
    q_pad, out_pad = _padded(query, ql), _padded(output, ql)
    C.assert_close(out_pad, q_pad, key_cache, value_cache, layout="bshd", block_table=table, cache_seqlens=kl,
                   q_lengths=ql, **opts, **check)


def _padded(x, lens):
    """``x (sum(lens), ...)`` as ``(len(lens), max(lens), ...)`` in its own type and kind,
    zeros past each sequence's length."""
    starts = np.concatenate([[0], np.cumsum(lens)])
    longest = int(lens.max(initial=0))
    rows = np.zeros((lens.size, longest), np.int64)  # row 0 stands in for padding (masked below)
    valid = np.arange(longest)[None, :] < lens[:, None]
    rows[valid] = (starts[:-1, None] + np.arange(longest)[None, :])[valid]
    if C.is_torch(x):
        import torch
        idx = torch.as_tensor(rows, device=x.device)
        keep = torch.as_tensor(valid, device=x.device).reshape(valid.shape + (1,) * (x.ndim - 1))
        if x.shape[0] == 0:
            return torch.zeros((lens.size, longest) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        return torch.where(keep, x[idx], torch.zeros((), dtype=x.dtype, device=x.device))
    x = np.asarray(x)
    if x.shape[0] == 0:
        return np.zeros((lens.size, longest) + x.shape[1:], x.dtype)
    return np.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x[rows], np.zeros((), x.dtype))


__all__ = ["ref_paged_attn", "assert_ref_paged_attn_close"]
