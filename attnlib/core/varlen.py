"""Varlen packing: FlashAttention's ``flash_attn_varlen_func`` layout, exactly.

``q: (total_q, Hq, D)``, ``k: (total_k, Hk, D)``, ``v: (total_k, Hk, Dv)`` hold a batch of
sequences back to back; ``cu_seqlens_q``, ``cu_seqlens_k`` (``batch + 1`` prefix sums) say
where each starts, and ``seqused_k`` (optional) how many of a sequence's keys it uses.
Sequence ``b`` is attended on its own, with the contract's masks and alignment on its own
lengths, as `attnlib.attention` would attend it alone; no padding is ever made.  Each
sequence's slices are views of the packed arrays (``(S, H, D) -> (H, S, D)``, no copy).
"""

from __future__ import annotations

import numbers

from dataclasses import replace

import numpy as np

from . import arrays, mla, problem, validate
from .arrays import as_numpy
from .backward import _score_mod_grad, dense_backward, tiled_backward
from . import device as dev_mod
from .options import Call, Options
from .reference import dense_attention
from .tiled import forward

#: Options that describe padding or documents: varlen says that with ``cu_seqlens`` and
#: ``seqused_k`` instead.
_NOT_IN_VARLEN = ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids", "key_leftpad", "block_table",
                  "cache_seqlens", "mask_mod", "score_mod", "block_mask", "gather_kv_indices")


#: What each varlen entry point takes besides the options: its kernel's own arguments.
_FORWARD = ("block_q", "block_k", "kv_splits", "workers", "rescale_threshold", "compute_dtype",
            "check_finite")
_DENSE = ("check_finite", "compute_dtype")
_BACKWARD = ("block_q", "block_k", "workers", "check_finite", "score_mod_grad")
_DENSE_BACKWARD = ("return_abs", "return_rss", "rss_accumulate", "check_finite", "compute_dtype",
                   "formulation", "score_mod_grad")


def _split(options: dict, entry: str, accept: tuple) -> tuple:
    """``(Options, the other keyword arguments)``: the masking and score options parsed once,
    those varlen says otherwise (padding, documents, pages, mods) refused, and any other name
    than ``accept`` refused naming ``entry``."""
    opts, rest = Options.split(entry=entry, accept=accept, **options)
    for name in opts.given(_NOT_IN_VARLEN):
        raise ValueError(f"{name} is not taken in the varlen layout: each sequence is attended "
                         "on its own (cu_seqlens_q/k), and seqused_k limits its keys")
    return opts, rest


def _offsets(x, name: str, total: int, batch: int | None) -> np.ndarray:
    """``cu_seqlens``: integers, ``batch + 1`` of them, from 0, non-decreasing, to ``total``."""
    if x is None:
        raise ValueError(f"{name} is required: the batch + 1 offsets of the packed sequences")
    arr = validate._integers(_as_host(x), name)
    if arr.ndim != 1 or arr.size < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 entries, got shape {arr.shape}")
    if batch is not None and arr.size != batch + 1:
        raise ValueError(f"{name} has {arr.size} entries, cu_seqlens_q {batch + 1}: the batch must agree")
    arr = arr.astype(np.int64)
    if arr[0] != 0 or np.any(np.diff(arr) < 0) or arr[-1] != total:
        raise ValueError(f"{name} must rise from 0 to the packed length {total} without decreasing, "
                         f"got {arr.tolist() if arr.size <= 12 else arr}")
    return arr


def _as_host(x):
    """Offsets and lengths from torch (any device) or numpy, as numpy."""
    return as_numpy(x, "offsets")


def sequences(cu_seqlens_q, cu_seqlens_k, total_q, total_k, seqused_k=None, max_seqlen_q=None,
              max_seqlen_k=None) -> list[tuple[int, int, int, int]]:
    """``[(q0, q1, k0, k1), ...]``: each sequence's query rows and the keys it uses.

    ``k1 = k0 + seqused_k[b]`` when given (at most the sequence's keys), else the next
    offset.  ``max_seqlen_q/k``, when given, must bound the lengths (FlashAttention sizes
    its grid with them); they change nothing else.
    """
    cu_q = _offsets(cu_seqlens_q, "cu_seqlens_q", total_q, None)
    cu_k = _offsets(cu_seqlens_k, "cu_seqlens_k", total_k, cu_q.size - 1)
    q_lens, k_lens = np.diff(cu_q), np.diff(cu_k)
    if seqused_k is not None:
        used = validate.lengths(_as_host(seqused_k), "seqused_k", (q_lens.size,), int(k_lens.max(initial=0)),
                             "the longest key sequence")
        if np.any(used > k_lens):
            b = int(np.flatnonzero(used > k_lens)[0])
            raise ValueError(f"seqused_k[{b}] = {int(used[b])} exceeds sequence {b}'s {int(k_lens[b])} keys")
        k_lens = used.astype(np.int64)
    for value, lens, name in ((max_seqlen_q, q_lens, "max_seqlen_q"), (max_seqlen_k, k_lens, "max_seqlen_k")):
        if value is None:
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if lens.size and value < lens.max():
            raise ValueError(f"{name}={value} is shorter than the longest sequence ({int(lens.max())})")
    return [(int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b] + k_lens[b]))
            for b in range(q_lens.size)]


def _packed(q, k, v, dev=None):
    """Check the packed layout: ``(total_q, Hq, D)``, ``(total_k, Hk, D)``, ``(total_k, Hk, Dv)``.
    ``dev``: read as torch tensors on that device (in their stored types), not numpy arrays."""
    if dev is None:
        q = arrays.as_float_array(q, "q")
        k = arrays.as_float_array(k, "k")
        v = arrays.as_float_array(v, "v")
    else:
        q, k, v = (dev_mod.as_tensor(x, name, dev) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if x.ndim != 3:
            raise ValueError(f"{name} must be packed as (total, heads, headdim) (FlashAttention's varlen "
                             f"layout), got shape {tuple(x.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must hold the same keys, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    return q, k, v


def _joined(q, k, v, qv, dev, check_finite=True):
    """``(q, k, v)`` with MLA's ``qv`` joined (`mla.join`: the packed ``(total, H, .)`` layout
    joins along the head dim as the padded one does), on ``dev`` (None: numpy)."""
    if qv is None:
        return q, k, v
    return (*mla.join(q, k, v, qv, dev, check_finite), v)


def _heads_first(x):
    return np.swapaxes(x, 0, 1)  # (S, H, D) -> (H, S, D), a view


def _run(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, options,
         entry="attention_varlen", accept=_FORWARD, dev=None):
    """``fn(q_b, k_b, v_b, **options_b)`` per sequence; ``(out (total_q, Hq, Dv), lse (Hq, total_q),
    per-sequence extras)``.  ``dev``: a torch device, where the sequences are torch views and
    ``out``, ``lse`` float64 tensors (``fn`` computes there); None: numpy throughout."""
    opts, options = _split(options, entry, accept)
    q, k, v = _packed(q, k, v, dev)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], seqused_k, max_seqlen_q, max_seqlen_k)
    hq, dv = q.shape[1], v.shape[2]
    slopes = problem.per_entry(opts.alibi_slopes, "alibi_slopes", len(seqs), hq)
    sinks = problem.per_entry(opts.sinks, "sinks", len(seqs), hq)
    if dev is None:
        out = np.zeros((q.shape[0], hq, dv))
        lse = np.full((hq, q.shape[0]), -np.inf)
        swap = np.swapaxes
    else:
        torch = dev_mod._torch()
        out = torch.zeros((q.shape[0], hq, dv), dtype=torch.float64, device=dev)
        lse = torch.full((hq, q.shape[0]), -np.inf, dtype=torch.float64, device=dev)
        swap = torch.transpose
    extras = []
    for b, (q0, q1, k0, k1) in enumerate(seqs):
        result = fn(swap(q[q0:q1], 0, 1), swap(k[k0:k1], 0, 1), swap(v[k0:k1], 0, 1),
                    replace(opts, alibi_slopes=slopes(b), sinks=sinks(b)), **options)
        out[q0:q1] = swap(result[0], 0, 1)
        lse[:, q0:q1] = result[1]
        extras.append(result[2:])
    return out, lse, extras


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_k=None, max_seqlen_q=None,
                     max_seqlen_k=None, return_lse=False, return_stats=False, qv=None, device=None, **options):
    """Attention over packed variable-length sequences (FlashAttention's varlen layout).

    Parameters
    ----------
    q : array_like, shape ``(total_q, Hq, D)``
    k : array_like, shape ``(total_k, Hk, D)``
    v : array_like, shape ``(total_k, Hk, Dv)``
        The sequences back to back (``Hq % Hk == 0``).
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape ``(batch + 1,)``
        Offsets: sequence ``b`` holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``q``
        and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``k`` and ``v``; from 0 to the packed
        length, never decreasing (empty sequences allowed).
    seqused_k : array_like of int, shape ``(batch,)``, optional
        Sequence ``b`` uses only its first ``seqused_k[b]`` keys (the others are never read);
        its length for the alignment is ``seqused_k[b]``.
    max_seqlen_q, max_seqlen_k : int, optional
        Checked to bound the lengths (FlashAttention's grid sizes); nothing else.
    causal, causal_align, window, softcap, scale
        As in `attention`, per sequence on its own lengths: bottom-right causal alignment is
        ``o = Sk_b - Sq_b``.
    alibi_slopes, sinks : array_like, shape ``(Hq,)`` or ``(batch, Hq)``, optional
        As in `attention`, for every sequence or per sequence.
    block_q, block_k, kv_splits, workers, rescale_threshold, compute_dtype, check_finite
        The tiled kernel's arguments, for each sequence.
    return_lse : bool
        Also return ``lse: (Hq, total_q)`` (FlashAttention's ``softmax_lse`` layout).
    return_stats : bool
        Also return a list of `AttentionStats`, one per sequence.
    qv : array_like, shape ``(total_q, Hq, Dv)``, optional
        MLA's second query, as in `attention` (FlashMLA's varlen prefill): joined to ``q`` and
        ``k`` once (`attnlib.core.mla`), default scale ``1/sqrt(D + Dv)``.
    device : str or torch.device, optional
        As in `attention`: given torch tensors (or ``device=``) each sequence goes through
        the torch forward on that device, ``out`` and ``lse`` float64 tensors there (numpy
        for numpy inputs with ``device=``); the stats are host objects, as on the host.

    Returns
    -------
    out : ndarray, shape ``(total_q, Hq, Dv)``
    lse : ndarray, shape ``(Hq, total_q)``, if ``return_lse``
    stats : list of AttentionStats, if ``return_stats``

    Notes
    -----
    Equal to `attention` of each sequence alone (the test suite compares it with the same
    problem padded into a batch, ``q_lengths``/``kv_lengths``).  A sequence with no keys
    gives ``out = 0`` and ``lse = -inf`` (``sink`` with sinks); padding, documents and
    lengths come from the offsets, so ``q_lengths``, ``kv_lengths`` and segment ids are
    refused.  Working memory is the tiled kernel's for the longest sequence.

    Examples
    --------
    >>> import numpy as np, attnlib
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 10, 2, 8))
    >>> cu = np.array([0, 3, 3, 10])  # sequences of 3, 0 and 7 tokens
    >>> out = attnlib.attention_varlen(q, k, v, cu, cu, causal=True)
    >>> alone = attnlib.attention(q[3:].swapaxes(0, 1), k[3:].swapaxes(0, 1), v[3:].swapaxes(0, 1), causal=True)
    >>> bool(np.allclose(out[3:], alone.swapaxes(0, 1), rtol=0, atol=1e-15))
    True
    """
    return_lse = validate.flag(return_lse, "return_lse")
    return_stats = validate.flag(return_stats, "return_stats")
    dev = dev_mod.resolve(device, q, k, v)
    q, k, v = _joined(q, k, v, qv, dev, options.get("check_finite", True))
    def kernel(q_b, k_b, v_b, opts, **run):
        return forward(q_b, k_b, v_b, Call.bind(options=opts, return_lse=True, return_stats=return_stats, **run),
                       dev=dev)
    out, lse, extras = _run(kernel,
                            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                            max_seqlen_k, dict(options), dev=dev)
    result = [out] + ([lse] if return_lse else []) + ([[e[0] for e in extras]] if return_stats else [])
    result = result[0] if len(result) == 1 else tuple(result)
    return result if dev is None else dev_mod.on_device(result, (q, k, v))


def reference_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_k=None,
                               max_seqlen_q=None, max_seqlen_k=None, return_lse=False, qv=None, device=None,
                               **options):
    """`attention_varlen` by the dense float64 reference, sequence by sequence (each
    sequence's ``(Hq, Sq_b, Sk_b)`` scores at a time); with torch tensors (or ``device=``)
    by the same reference with torch on that device."""
    dev = dev_mod.resolve(device, q, k, v)
    q, k, v = _joined(q, k, v, qv, dev, options.get("check_finite", True))
    out, lse, _ = _run(lambda *a, **o: dense_attention(*a, return_lse=True, dev=dev, **o), q, k, v,
                       cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, dict(options),
                       "reference_attention_varlen", _DENSE, dev=dev)
    result = (out, lse) if return_lse else out
    return result if dev is None else dev_mod.on_device(result, (q, k, v))


def attention_varlen_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, *, seqused_k=None,
                              max_seqlen_q=None, max_seqlen_k=None, reference=False, **options):
    """Gradients of `attention_varlen`: ``(dq, dk, dv)`` packed like ``q, k, v`` (and
    ``dsinks``, shaped like ``sinks``, when sinks are given).

    ``out (total_q, Hq, Dv)``, ``lse (Hq, total_q)`` (the forward's) and ``dout``; the
    other arguments as in `attention_varlen` and `attention_backward` (tiles, workers).
    Each sequence's gradients are `attention_backward`'s on its own; keys past a sequence's
    ``seqused_k`` get zero gradients.  ``reference=True`` uses the dense
    `reference_attention_backward` instead (``out`` and ``lse`` are then not used).
    """
    q, k, v = _packed(q, k, v)
    hq = q.shape[1]
    out, dout, lse = (arrays.as_float_array(x, name) for x, name in ((out, "out"), (dout, "dout"), (lse, "lse")))
    for x, name, shape in ((out, "out", q.shape[:2] + v.shape[2:]), (dout, "dout", q.shape[:2] + v.shape[2:]),
                           (lse, "lse", (hq, q.shape[0]))):
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    opts, options = _split(options, "attention_varlen_backward", _DENSE_BACKWARD if reference else _BACKWARD)
    mod_grad = _score_mod_grad(options.pop("score_mod_grad", None), opts)
    sinks = opts.sinks
    seqs = sequences(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], seqused_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = None if sinks is None else np.zeros(np.shape(sinks))
    slopes = problem.per_entry(opts.alibi_slopes, "alibi_slopes", len(seqs), hq)
    per_sink = problem.per_entry(opts.sinks, "sinks", len(seqs), hq)
    for b, (q0, q1, k0, k1) in enumerate(seqs):
        qb, kb, vb = _heads_first(q[q0:q1]), _heads_first(k[k0:k1]), _heads_first(v[k0:k1])
        doutb = _heads_first(dout[q0:q1])
        o = replace(opts, alibi_slopes=slopes(b), sinks=per_sink(b))
        if reference:
            g = dense_backward(qb, kb, vb, doutb, o, mod_grad, **options)
        else:
            g = tiled_backward(qb, kb, vb, _heads_first(out[q0:q1]), lse[:, q0:q1], doutb, o, mod_grad,
                               **options)
        dq[q0:q1] = np.swapaxes(g[0], 0, 1)
        dk[k0:k1] = np.swapaxes(g[1], 0, 1)
        dv[k0:k1] = np.swapaxes(g[2], 0, 1)
        if dsinks is not None:  # per sequence, or summed over them
            if dsinks.ndim == 2:
                dsinks[b] = g[3]
            else:
                dsinks += g[3]
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


__all__ = ["attention_varlen", "reference_attention_varlen", "attention_varlen_backward", "sequences"]
