"""Varlen and paged inputs of a kernel, as the padded batch the check judges.

A varlen kernel (layout ``thd``: ``q (total_q, H, D)`` with ``cu_seqlens_q/k``) is judged
as the batch of its sequences padded to the longest, with ``q_lengths`` and ``kv_lengths``:
the contract gives padded rows no key (their output must be 0) and aligns each sequence on
its own lengths, so the verdict is that of each sequence alone.  A paged kernel's caches
``(num_blocks, page_size, Hk, D)`` are gathered into contiguous keys with ``kv_lengths =
cache_seqlens``.  Positions in the verdict are then (sequence, position in it).  The padded
arrays cost ``batch * longest`` rows: the check's memory, not the kernel's.  Keys past a
sequence's ``seqused_k`` are left out (the kernel never reads them, and may leave anything
there), so their ``dk``, ``dv`` are not judged.
"""

from __future__ import annotations

import numpy as np

from ..core.paged import gather_pages, page_tables
from ..core.varlen import sequences
from ..core.arrays import UnusableInput

#: The packed tensors by which offsets index their first axis.
_BY_QUERY = ("q", "out", "dout", "dq", "qv", "dqv")
_BY_KEY = ("k", "v", "dk", "dv")


def _pad(x, starts, ends, width, fill=0):
    """Rows ``starts[b]:ends[b]`` of ``x (total, ...)`` as ``(batch, width, ...)``, ``fill`` (zero) after."""
    out = np.full((len(starts), width) + x.shape[1:], fill, dtype=x.dtype)
    for b, (s, e) in enumerate(zip(starts, ends)):
        out[b, :e - s] = x[s:e]
    return out


def unpack_varlen(given: dict, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks, names: dict, lse_convention=None):
    """``given`` (thd tensors, ``lse (H, total_q)``) as bshd ones: ``(given, q_lengths,
    kv_lengths)``.  The lse of padded rows is filled with what the contract gives a row
    without keys (``-inf``, or the sink), in the kernel's ``lse_convention``
    (`attnlib.core.lse_conventions`: its base, the sink's place, its empty rows' infinity),
    so that only real rows are judged."""
    q, k = given["q"], given["k"]
    for name, x in given.items():
        if name != "lse" and x.ndim != 3:
            raise UnusableInput(f"{names[name]}: the thd layout holds (total, nheads, headdim), got "
                                f"shape {x.shape}")
    try:
        seqs = sequences(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], seqused_k)
    except (ValueError, TypeError) as e:
        raise UnusableInput(str(e)) from None
    # k_end: the keys each sequence uses (the kernel reads no others)
    q0, q1, k0, k_end = (np.array([s[i] for s in seqs]) for i in range(4))
    q_lengths, kv_lengths = q1 - q0, k_end - k0
    wq, wk = max(1, int(q_lengths.max(initial=0))), max(1, int(kv_lengths.max(initial=0)))
    out = {}
    for name, x in given.items():
        if name in _BY_QUERY:
            out[name] = _pad(x, q0, q1, wq)
        elif name in _BY_KEY:
            out[name] = _pad(x, k0, k_end, wk)
    if "lse" in given:
        lse = given["lse"]
        if lse.ndim != 2 or lse.shape[1] != q.shape[0]:
            raise UnusableInput(f"{names['lse']}: the thd layout's lse is (nheads, total_q) = "
                                f"({q.shape[1]}, {q.shape[0]}), got shape {lse.shape}")
        conv = lse_convention
        empty = -np.inf if conv is None or conv.empty is None else conv.empty
        fill = np.full((len(seqs), lse.shape[0]), empty)
        if sinks is not None and (conv is None or conv.sink == "included"):
            fill[...] = np.asarray(sinks, dtype=np.float64) / (1.0 if conv is None else conv.factor)
        padded = _pad(lse.T, q0, q1, wq, fill[:, None, :])  # (batch, wq, H)
        out["lse"] = np.ascontiguousarray(np.swapaxes(padded, 1, 2))  # (batch, H, wq)
    return out, q_lengths, kv_lengths


def unpack_paged(given: dict, layout: str, block_table, cache_seqlens, names: dict):
    """``given`` with ``k`` and ``v`` paged caches as contiguous keys in ``layout``:
    ``(given, kv_lengths)``."""
    if "dk" in given or "dv" in given:
        raise UnusableInput("the gradients of a paged cache (dk, dv) are not judged; leave them out")
    kc, vc, q = given["k"], given["v"], given["q"]
    for name, x in (("k", kc), ("v", vc)):
        if x.ndim != 4:
            raise UnusableInput(f"{names[name]}: a paged cache is (num_blocks, page_size, nheads, headdim), "
                                f"got shape {x.shape}")
    if q.ndim != 4:
        raise UnusableInput(f"{names['q']}: with a paged cache q is 4-D (batch first), got shape {q.shape}")
    try:
        _, lens = page_tables(block_table, cache_seqlens, q.shape[0], kc.shape[0], kc.shape[1])
        k, v = gather_pages(kc, block_table, lens), gather_pages(vc, block_table, lens)  # bhsd
    except (ValueError, TypeError) as e:
        raise UnusableInput(str(e)) from None
    if k.shape[2] == 0:  # no keys anywhere: one zero key, invisible to every row
        k, v = (np.zeros(x.shape[:2] + (1,) + x.shape[3:], dtype=x.dtype) for x in (k, v))
    if layout == "bshd":
        k, v = np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2)
    return dict(given, k=k, v=v), lens
