"""FlashAttention 2, 3 and 4's calls translated into attnlib's, once for the three versions
(`docs/semantics.md`, "Drop-in references: FlashAttention").  The thin modules
`flash_attn` (FA2), `flash_attn_interface` (FA3, hopper/) and `flash_attn_cute` (FA4) hold
each version's exact signatures and call these.

What differs between the versions and is followed here: the window's sentinels (FA2 and FA3
``-1``, FA4 ``None`` with negative sides literal and ``L + R < 0`` meaning no window; FA2 turns
a one-sided ``-1`` right side into ``seqlen_k``), the default scale with ``qv``, the LSE of a
row with no key (FA2 ``+inf``, FA3 and FA4 ``-inf``), FA2's causal ALiBi LSE (its kernel adds
``slope * j``, a row constant away from the documented bias), FA4's LSE layout with ``qv``,
and what each returns.
"""

from __future__ import annotations

import math

import numpy as np

from . import _common as C

FA2, FA3, FA4 = "FlashAttention 2", "FlashAttention 3", "FlashAttention 4"


# ---------------------------------------------------------------------------------------------
# Arguments


def window(version: str, window_size, causal: bool, seqlen_k: int) -> tuple:
    """``(left, right)`` in attnlib's terms (None: unbounded) of a version's ``window_size``
    and ``causal`` (``seqlen_k``: the key length the kernel clamps with)."""
    if hasattr(window_size, "tolist"):  # a tensor or array of two ints, as FlashAttention's tests pass
        window_size = window_size.tolist()
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (x.item() if hasattr(x, "item") and getattr(x, "ndim", 1) == 0 else x for x in window_size)
    for side in (left, right):
        if side is not None and (isinstance(side, bool) or not isinstance(side, (int, np.integer))):
            raise TypeError(f"window_size sides must be integers{' or None' if version == FA4 else ''}, "
                            f"got {window_size!r}")
    if version == FA4:  # None unbounded, negatives literal; both given with L + R < 0: no window
        if causal:
            right = 0
        if left is not None and right is not None and left + right < 0:
            left = right = None
        return (None if left is None else int(left), None if right is None else int(right))
    if left is None or right is None:
        raise TypeError(f"window_size sides must be integers (-1: unbounded) in {version}, got {window_size!r}")
    left, right = int(left), int(right)
    if version == FA2:  # flash_api.cpp: clamp at seqlen_k, causal, then a one-sided -1 right is seqlen_k
        left = -1 if left >= seqlen_k else left
        right = -1 if right >= seqlen_k else right
        if causal:
            right = 0
        if left >= 0 and right < 0:
            right = seqlen_k
    elif causal:
        right = 0
    return (None if left < 0 else left, None if right < 0 else right)


def is_local(side_window: tuple) -> bool:
    return side_window != (None, None)


def fp8_descales(version, q, given: dict) -> dict:
    """FlashAttention 3 reads the descales of float8_e4m3fn inputs only (hopper/flash_api.cpp):
    ``given`` without them for other inputs."""
    if version == FA3 and "float8_e4m3fn" not in str(q.dtype):
        return {n: x for n, x in given.items() if n not in ("q_descale", "k_descale", "v_descale")}
    return given


def descaled(q, k, v, seq_q, seq_k, hk, opts: dict):
    """Packed ``q, k, v`` in float64 with their ``(b, hk)`` descales applied to each sequence's
    rows (``seq_q``, ``seq_k``: each row's sequence), exact (fp8 times float32); ``opts`` without them."""
    names = ("q_descale", "k_descale", "v_descale")
    if all(opts.get(n) is None for n in names):
        return q, k, v, opts
    out = []
    for x, name, seq in zip((q, k, v), names, (seq_q, seq_k, seq_k)):
        x = C.float64(x, name[0])
        if opts.get(name) is not None:
            f = C.as_host(C.float64(opts[name], name))
            f = np.broadcast_to(f, (int(seq.max(initial=-1)) + 1, hk))[seq]  # (rows, hk)
            f = np.repeat(f, x.shape[1] // hk, axis=1)[..., None]  # q's heads: their kv head's factor
            x = x * C.like(f, x)
        out.append(x)
    return (*out, {n: x for n, x in opts.items() if n not in names})


def options(version, *, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
            alibi_slopes=None, qv=None, q_descale=None, k_descale=None, v_descale=None,
            attention_chunk=0, learnable_sink=None, seqlen_k: int, dropout_p=0.0) -> dict:
    """attnlib's options of a FlashAttention call (every layout: ``qv`` left to the caller)."""
    if dropout_p not in (None, 0, 0.0):
        C.scalar(dropout_p, "dropout_p")
        raise ValueError(f"dropout_p={dropout_p!r}: the float64 oracle is deterministic and computes "
                         "dropout_p=0 only (the kernel's random mask is not known)")
    if window_size is None:
        window_size = (None, None) if version == FA4 else (-1, -1)
    opts = {"window": window(version, window_size, bool(causal), seqlen_k),
            "scale": C.scalar(softmax_scale, "softmax_scale")}
    cap = C.scalar(softcap, "softcap", default=0.0, positive=True)
    if cap:
        opts["softcap"] = cap
    chunk = attention_chunk or 0
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 0:
        raise ValueError(f"attention_chunk must be an integer >= 0, got {attention_chunk!r}")
    if chunk:
        opts["attention_chunk"] = int(chunk)
    for name, x in (("alibi_slopes", alibi_slopes), ("q_descale", q_descale), ("k_descale", k_descale),
                    ("v_descale", v_descale)):
        if x is not None:
            opts[name] = x
    if learnable_sink is not None:
        opts["sinks"] = learnable_sink
    return opts


def empty_lse(version: str) -> float:
    """What a version's LSE holds on a row with no visible key."""
    return math.inf if version == FA2 else -math.inf


def with_empty(lse, version: str):
    """attnlib's lse (``-inf`` on empty rows) in a version's convention."""
    if version != FA2:
        return lse
    if C.is_torch(lse):
        import torch
        return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
    return np.where(np.isneginf(lse), math.inf, lse)


def causal_alibi_shift(version, opts, lse, sq, sk):
    """FlashAttention 2's kernel adds ``slope * j`` on its causal path (alibi.h), the documented
    ``-slope |i + Sk - Sq - j|`` plus ``slope (i + Sk - Sq)``: the same softmax, the LSE that much
    larger.  ``lse (b, Hq, Sq)``; ``sk`` the key count, a number or ``(b, 1, 1)``."""
    if version != FA2 or opts.get("alibi_slopes") is None or opts["window"] != (None, 0):
        return lse
    slopes = C.as_host(C.float64(opts["alibi_slopes"], "alibi_slopes"))  # (Hq,) or (b, Hq)
    shift = slopes[..., None] * (np.arange(sq) + (np.asarray(sk, np.float64) - sq))  # (.., Hq, Sq)
    if C.is_torch(lse):
        import torch
        shift = torch.as_tensor(shift, device=lse.device)
    return lse + shift


# ---------------------------------------------------------------------------------------------
# Rotary embedding (flash_attn.layers.rotary.apply_rotary_emb), exact in float64


def rotary(x, cos, sin, positions, interleaved: bool):
    """``x (b, s, h, d)`` float64 rotated at ``positions (b, s)`` (host ints) by the tables
    ``cos, sin (seqlen_ro, rotary_dim / 2)``: the first ``rotary_dim`` dims turn, the rest pass.
    Interleaved (GPT-J): pairs ``(2i, 2i + 1)``; else (GPT-NeoX): ``(i, i + rotary_dim / 2)``;
    each pair ``(x0 cos - x1 sin, x0 sin + x1 cos)`` with the table's row ``i``."""
    half = cos.shape[-1]
    c, s = (C.index(t, positions.reshape(-1)).reshape(positions.shape + (1, half)) for t in (cos, sin))
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    if interleaved:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
    else:
        x0, x1 = rot[..., :half], rot[..., half:]
    o0, o1 = x0 * c - x1 * s, x0 * s + x1 * c
    if C.is_torch(x):
        import torch
        turned = torch.stack((o0, o1), -1).flatten(-2) if interleaved else torch.cat((o0, o1), -1)
        return torch.cat((turned, rest), -1)
    turned = np.stack((o0, o1), -1).reshape(o0.shape[:-1] + (2 * half,)) if interleaved \
        else np.concatenate((o0, o1), -1)
    return np.concatenate((turned, rest), -1)


def rounded_to(x64, like):
    """float64 values rounded once to ``like``'s type, in its kind (what a kernel stores)."""
    if C.is_torch(like):
        from ..core.device import rounded
        return rounded(x64, like.dtype)
    return np.asarray(x64).astype(like.dtype)


# ---------------------------------------------------------------------------------------------
# The three calls


def literal_window(opts: dict, sq: int, sk: int) -> dict:
    """FlashAttention 4's negative window sides (``(None, -2)``: keys up to two before the
    diagonal) as a ``mask_mod`` of the bottom-right diagonal ``i + sk - sq`` (attnlib's windows
    have sides >= 0)."""
    left, right = opts["window"]
    if not any(x is not None and x < 0 for x in (left, right)):
        return opts
    o = sk - sq

    def literal_window(b, h, q_idx, kv_idx):
        keep = np.ones(np.broadcast_shapes(np.shape(q_idx), np.shape(kv_idx)), bool)
        if left is not None:
            keep = keep & (kv_idx >= q_idx + o - left)
        if right is not None:
            keep = keep & (kv_idx <= q_idx + o + right)
        return keep

    return {**opts, "window": (None, None), "mask_mod": literal_window}


def func(version, q, k, v, *, qv=None, gather_kv_indices=None, **given):
    """``(out (b, sq, hq, dv), lse (b, hq, sq))`` of ``flash_attn_func``, float64."""
    given = fp8_descales(version, q, given)
    if q.ndim != 4:
        raise ValueError(f"q must be (batch, seqlen, nheads, headdim), got shape {tuple(q.shape)}")
    opts = _func_options(version, q, k, gather_kv_indices, given)
    return _run(version, q, k, v, qv, opts)


def _func_options(version, q, k, gather_kv_indices, given):
    opts = literal_window(options(version, seqlen_k=k.shape[1], **given), q.shape[1], k.shape[1])
    if gather_kv_indices is not None:
        opts["gather_kv_indices"] = gather_kv_indices
    return opts


def _run(version, q, k, v, qv, opts, **extra):
    from ..core.tiled import attention
    out, lse = attention(C.swap(q), C.swap(k), C.swap(v), qv=C.swap(qv), return_lse=True, **opts, **extra)
    lse = causal_alibi_shift(version, opts, lse, q.shape[1], _key_count(extra, k.shape[1]))
    return C.swap(out), with_empty(lse, version)


def _key_count(extra, sk):
    """Each entry's key count after padding: ``sk``, or ``(b, 1, 1)``."""
    lengths, leftpad = extra.get("kv_lengths"), extra.get("key_leftpad")
    if lengths is None and leftpad is None:
        return sk
    n = (np.full(1, sk) if lengths is None else lengths) - (0 if leftpad is None else leftpad)
    return np.asarray(n, np.float64)[:, None, None]


def assert_func(version, result, q, k, v, *, qv=None, gather_kv_indices=None, check=None, lse_position=1, **given):
    given = fp8_descales(version, q, given)
    out, lse = C.result_lse(result, "result", position=lse_position)
    opts = _func_options(version, q, k, gather_kv_indices, given)
    C.assert_close(out, q, k, v, layout="bshd", qv=qv, **_judged_lse(version, opts, lse),
                   **judged_options(opts, q.shape[1], k.shape[1]), **(check or {}))


def judged_options(opts: dict, sq: int, sk, leftpad=None) -> dict:
    """The check's options of a call: ALiBi (which the check takes as a ``score_mod``) as
    ``-slope |i + o - j'|``, ``o`` the entry's ``Sk' - Sq`` and ``j' = j - leftpad`` (its
    bottom-right distance, as attnlib's ALiBi); ``sk``: a number or each entry's key end."""
    slopes = opts.get("alibi_slopes")
    if slopes is None:
        return opts
    sl = C.as_host(C.float64(slopes, "alibi_slopes"))
    ends = np.asarray(sk, np.int64).reshape(-1)
    pad = np.zeros(1, np.int64) if leftpad is None else np.asarray(leftpad, np.int64).reshape(-1)
    offset = ends - pad - sq  # (b,) or (1,)

    def alibi(score, b, h, q_idx, kv_idx):  # numpy-written: attnlib calls it with host arrays
        score, b, h, q_idx, kv_idx = (np.asarray(x) for x in (score, b, h, q_idx, kv_idx))
        at = b if offset.size > 1 else 0
        slope = sl[h] if sl.ndim == 1 else sl[b, h]
        return score - slope * np.abs(q_idx + offset[at] - (kv_idx - pad[at if pad.size > 1 else 0]))

    rest = {n: x for n, x in opts.items() if n != "alibi_slopes"}
    return {**rest, "score_mod": alibi, "score_mod_grad": lambda score, b, h, q_idx, kv_idx: np.ones_like(score)}


def _judged_lse(version, opts, lse) -> dict:
    """The lse keywords of the check: FlashAttention 2's causal ALiBi LSE is its kernel's
    shifted one (see `causal_alibi_shift`), left unjudged (only the output is)."""
    if lse is None or (version == FA2 and opts.get("alibi_slopes") is not None and opts["window"] == (None, 0)):
        return {}
    return {"lse": lse, "lse_empty": "+inf" if version == FA2 else "-inf"}


def varlen(version, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_q=None,
           seqused_k=None, block_table=None, qv=None, **given):
    """``(out (total_q, hq, dv), lse (hq, total_q))`` of ``flash_attn_varlen_func``, float64."""
    given = fp8_descales(version, q, given)
    from ..core.varlen import attention_varlen
    cu_q, cu_k = C.ints(cu_seqlens_q, "cu_seqlens_q"), C.ints(cu_seqlens_k, "cu_seqlens_k")
    k, v = _paged_to_packed(k, v, block_table, cu_k)
    opts = _no_literal(options(version, seqlen_k=int(max_seqlen_k) if max_seqlen_k is not None else k.shape[0],
                               **given))
    q, k, v, opts = descaled(q, k, v, np.repeat(np.arange(len(cu_q) - 1), np.diff(cu_q)),
                             np.repeat(np.arange(len(cu_k) - 1), np.diff(cu_k)), k.shape[1], opts)
    used = _used_rows(seqused_q, cu_q)
    qs, cu_qs = (q, cu_q) if used is None else (C.index(q, used[0]), used[1])
    qvs = qv if qv is None or used is None else C.index(qv, used[0])
    out, lse = attention_varlen(qs, k, v, cu_qs, cu_k, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k, qv=qvs, return_lse=True, **opts)
    if version == FA2 and opts.get("alibi_slopes") is not None and opts["window"] == (None, 0):
        lse = _varlen_alibi_shift(lse, opts, cu_qs, cu_k, seqused_k)
    lse = with_empty(lse, version)
    if used is not None:  # rows past seqused_q: 0 and an empty row's lse
        full_out = C.zeros_like(out, (q.shape[0],) + tuple(out.shape[1:]))
        full_lse = C.zeros_like(lse, (lse.shape[0], q.shape[0])) + empty_lse(version)
        idx = used[0] if not C.is_torch(out) else __import__("torch").as_tensor(used[0], device=out.device)
        full_out[idx] = out
        full_lse[:, idx] = lse
        out, lse = full_out, full_lse
    return out, lse


def _no_literal(opts):
    if any(x is not None and x < 0 for x in opts["window"]):
        raise ValueError(f"window_size={opts['window']}: negative sides are taken by flash_attn_func only, "
                         "not by flash_attn_varlen_func")
    return opts


def _used_rows(seqused_q, cu_q):
    """``(rows, offsets)`` of the first ``seqused_q[b]`` rows of each sequence, or None."""
    if seqused_q is None:
        return None
    used = C.ints(seqused_q, "seqused_q", len(cu_q) - 1)
    counts = np.diff(cu_q)
    if (used < 0).any() or (used > counts).any():
        raise ValueError("seqused_q must be within 0 and each sequence's query count")
    rows = np.concatenate([np.arange(a, a + u) for a, u in zip(cu_q[:-1], used)]) if len(used) else np.zeros(0, np.int64)
    return rows.astype(np.int64), np.concatenate(([0], np.cumsum(used))).astype(np.int64)


def _varlen_alibi_shift(lse, opts, cu_q, cu_k, seqused_k):
    """`causal_alibi_shift` of packed sequences: ``lse (hq, total_q)``."""
    sq = np.diff(cu_q)
    sk = np.diff(cu_k) if seqused_k is None else C.ints(seqused_k, "seqused_k", len(sq))
    seq = np.repeat(np.arange(len(sq)), sq)
    pos = (np.arange(cu_q[-1]) - cu_q[:-1][seq] + sk[seq] - sq[seq]).astype(np.float64)  # (total_q,)
    slopes = C.as_host(C.float64(opts["alibi_slopes"], "alibi_slopes"))
    shift = (slopes[:, None] if slopes.ndim == 1 else slopes.T[:, seq]) * pos[None]
    if C.is_torch(lse):
        import torch
        shift = torch.as_tensor(shift, device=lse.device)
    return lse + shift


def _paged_to_packed(k, v, block_table, cu_k):
    """FlashAttention 2's varlen ``block_table``: the pages of each sequence, packed."""
    if block_table is None:
        return k, v
    page = k.shape[1]
    lengths = np.diff(cu_k)
    table = C.ints(block_table, "block_table")
    if table.ndim != 2 or table.shape[0] < len(lengths):
        raise ValueError(f"block_table must be (batch, max_blocks) for the {len(lengths)} sequences, "
                         f"got {tuple(table.shape)}")
    table = used_pages(table[:len(lengths)], lengths, page, k.shape[0], "block_table")
    rows = []
    for b, n in enumerate(lengths):
        pages = table[b, :-(-n // page)] if n else table[b, :0]
        rows.append((pages[:, None] * page + np.arange(page)[None]).reshape(-1)[:n])
    flat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    kf, vf = (x.reshape((-1,) + tuple(x.shape[2:])) for x in (k, v))
    return C.index(kf, flat), C.index(vf, flat)


def assert_varlen(version, result, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                  seqused_q=None, seqused_k=None, block_table=None, qv=None, check=None, lse_position=1, **given):
    given = fp8_descales(version, q, given)
    out, lse = C.result_lse(result, "result", position=lse_position)
    cu_q, cu_k = C.ints(cu_seqlens_q, "cu_seqlens_q"), C.ints(cu_seqlens_k, "cu_seqlens_k")
    k, v = _paged_to_packed(k, v, block_table, cu_k)
    opts = _no_literal(options(version, seqlen_k=int(max_seqlen_k) if max_seqlen_k is not None else k.shape[0],
                               **given))
    used = _used_rows(seqused_q, cu_q)
    if used is not None:
        q, out, cu_q = C.index(q, used[0]), C.index(out, used[0]), used[1]
        qv = None if qv is None else C.index(qv, used[0])
        lse = None if lse is None else lse[:, used[0] if not C.is_torch(lse) else
                                          __import__("torch").as_tensor(used[0], device=lse.device)]
    if opts.get("alibi_slopes") is not None:
        raise ValueError("alibi_slopes: the check takes ALiBi as a score_mod, which it does not take with packed "
                         "sequences; judge the sequences batched (flash_attn_func's twin)")
    C.assert_close(out, q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k,
                   qv=qv, **_judged_lse(version, opts, lse), **opts, **(check or {}))


# ---------------------------------------------------------------------------------------------
# flash_attn_with_kvcache


def kvcache_inputs(version, q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None,
                   cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                   rotary_interleaved=True, rotary_seqlens=None, causal=False, window_size=None,
                   attention_chunk=0, update=True):
    """What the kernel attends over: ``(q_ro, keys, values, window, attnlib options, where,
    caches)``, with keys and values ``(b, capacity, hk, d)`` float64 read from the caches after the
    new ``k, v`` (rotated) are written into them at the cache indices ``where`` (None without new
    keys): in place when ``update``, else into copies; ``caches``: the two as written."""
    b, sq = q.shape[0], q.shape[1]
    paged = block_table is not None
    if paged and cache_batch_idx is not None and version == FA2:
        raise ValueError("cache_batch_idx cannot be combined with a paged cache (block_table) in FlashAttention 2")
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values) must be given together")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    table = C.ints(block_table, "block_table") if paged else None
    page = k_cache.shape[1]
    rows = C.ints(cache_batch_idx, "cache_batch_idx", b) if cache_batch_idx is not None else np.arange(b)
    if ((rows < 0) | (rows >= (table.shape[0] if paged else k_cache.shape[0]))).any():
        raise ValueError(f"cache_batch_idx must index the cache's {table.shape[0] if paged else k_cache.shape[0]} "
                         f"rows, got {rows.tolist()}")
    if paged:
        table = table[rows]  # FA3: entry b reads page_table[cache_batch_idx[b]]
    capacity = table.shape[1] * page if paged else k_cache.shape[1]
    seqlens = C.ints(cache_seqlens, "cache_seqlens", b)
    leftpad = C.ints(cache_leftpad, "cache_leftpad", b)
    s_new = 0 if k is None else k.shape[1]
    if k is not None and seqlens is None:
        raise ValueError("appending k and v needs cache_seqlens (where each entry's new keys go)")
    end = (np.full(b, capacity) if seqlens is None else seqlens + s_new)
    if (end > capacity).any() or (seqlens is not None and (seqlens < 0).any()):
        raise ValueError(f"cache_seqlens + seqlen_new must be within 0 and the cache's {capacity} slots")
    if leftpad is not None and ((leftpad < 0) | (leftpad > end)).any():
        raise ValueError("cache_leftpad must be within 0 and each entry's cache_seqlens")
    if paged:
        table = used_pages(table, end, page, k_cache.shape[0], "block_table/page_table")
    win = window(version, (None, None) if window_size is None and version == FA4 else
                 (-1, -1) if window_size is None else window_size, bool(causal), capacity)
    q64 = C.float64(q, "q")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin apply to new keys: give k and v too")
        cos, sin = C.float64(rotary_cos, "rotary_cos"), C.float64(rotary_sin, "rotary_sin")
        if cos.ndim != 2 or cos.shape != sin.shape or 2 * cos.shape[1] > q.shape[-1]:
            raise ValueError(f"rotary_cos/rotary_sin must be (seqlen_ro, rotary_dim / 2) with rotary_dim <= "
                             f"headdim, got {tuple(cos.shape)} and {tuple(sin.shape)}")
        start = C.ints(rotary_seqlens, "rotary_seqlens", b) if rotary_seqlens is not None else seqlens
        k_pos = start[:, None] + np.arange(s_new)[None]
        moving = causal or _rotary_local(version, window_size, win, attention_chunk, sq, capacity)
        q_pos = start[:, None] + (np.arange(sq)[None] if moving else np.zeros((1, sq), np.int64))
        top = max(int(k_pos.max(initial=-1)), int(q_pos.max(initial=-1)))
        if top >= cos.shape[0]:
            raise ValueError(f"rotary_cos/rotary_sin have {cos.shape[0]} positions; position {top} is needed")
        q64 = C.float64(rounded_to(rotary(q64, cos, sin, q_pos, bool(rotary_interleaved)), q), "q")
        k_new = rotary(C.float64(k, "k"), cos, sin, k_pos, bool(rotary_interleaved))
    else:
        k_new = None if k is None else C.float64(k, "k")
    if not update:
        k_cache, v_cache = (x.clone() if C.is_torch(x) else x.copy() for x in (k_cache, v_cache))
    where = None
    if k is not None:  # written at [cache_seqlens, cache_seqlens + s_new) of each entry, in the cache's type
        slot = seqlens[:, None] + np.arange(s_new)[None]
        where = (table[np.arange(b)[:, None], slot // page], slot % page) if paged else (rows[:, None], slot)
        v_new = C.float64(v, "v")
        for cache, new in ((k_cache, k_new), (v_cache, v_new)):
            value = rounded_to(C.like(new, cache), cache)
            if C.is_torch(cache):
                import torch
                cache[tuple(torch.as_tensor(w, device=cache.device) for w in where)] = value
            else:
                cache[where] = value
    keys, values = (_logical(c, table, rows, capacity) for c in (k_cache, v_cache))
    extra = {"kv_lengths": end if seqlens is not None else None, "key_leftpad": leftpad}
    return q64, keys, values, win, {n: x for n, x in extra.items() if x is not None}, where, (k_cache, v_cache)


def used_pages(table, lengths, page, num_pages, name):
    """``table`` with the entries each entry reads (its first ``ceil(lengths / page)``) checked
    to be pages of the cache (a ``ValueError`` naming ``name`` otherwise), the others, which
    FlashAttention never reads (a sentinel such as -1 or any number), set to page 0."""
    need = -(-np.asarray(lengths, np.int64) // page)
    if (need > table.shape[1]).any():
        raise ValueError(f"{name} has {table.shape[1]} pages per sequence; {int(need.max())} are needed")
    read = np.arange(table.shape[1])[None, :] < need[:, None]
    bad = read & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"{name}[{b}, {j}] = {int(table[b, j])} is not one of the cache's {num_pages} pages")
    return np.where(read, table, 0)


def _rotary_local(version, window_size, win, attention_chunk, sq, capacity) -> bool:
    """Whether FlashAttention rotates each query at its own position (``cache_seqlens + i``) on a
    non-causal call: a local one.  FA3 counts a window side as local only below its clamps
    (``left < seqlen_k - 1``, ``right < seqlen_q - 1``, hopper/flash_api.cpp) and chunks as local."""
    if version != FA3:
        return is_local(win)
    left, right = (-1, -1) if window_size is None else window(FA2, window_size, False, 1 << 62)
    left = -1 if left is None or left >= capacity - 1 else left
    right = -1 if right is None or right >= sq - 1 else right
    return left >= 0 or right >= 0 or bool(attention_chunk)


def _logical(cache, table, rows, capacity):
    """Each entry's cache rows ``(b, capacity, hk, d)`` float64: its pages in order, or its row."""
    if table is None:
        return C.float64(C.index(cache, rows), "cache")
    flat = cache.reshape((-1,) + tuple(cache.shape[2:]))
    page = cache.shape[1]
    idx = (table[:, :, None] * page + np.arange(page)[None, None]).reshape(table.shape[0], -1)[:, :capacity]
    return C.float64(C.index(flat, idx.reshape(-1)), "cache").reshape((table.shape[0], capacity) + tuple(cache.shape[2:]))


def kvcache(version, q, k_cache, v_cache, k=None, v=None, *, qv=None, rotary_cos=None, rotary_sin=None,
            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
            rotary_interleaved=True, rotary_seqlens=None, causal=False, window_size=None, **given):
    """``(out (b, sq, hq, dv), lse (b, hq, sq))`` of ``flash_attn_with_kvcache``, float64; the new
    ``k, v`` written into the caches in place, as FlashAttention does."""
    given = fp8_descales(version, q, given)
    q64, keys, values, win, extra, *_ = kvcache_inputs(
        version, q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, rotary_interleaved=rotary_interleaved, rotary_seqlens=rotary_seqlens,
        causal=causal, window_size=window_size, attention_chunk=given.get("attention_chunk", 0))
    opts = options(version, seqlen_k=keys.shape[1], causal=causal, window_size=window_size, **given)
    return _run(version, q64, keys, values, qv, opts, **extra)


def assert_kvcache(version, result, q, k_cache, v_cache, k=None, v=None, *, qv=None, rotary_cos=None,
                   rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                   block_table=None, rotary_interleaved=True, rotary_seqlens=None, causal=False,
                   window_size=None, k_cache_out=None, v_cache_out=None, check=None, lse_position=1, **given):
    """The kernel's ``result`` judged against the attention over the caches as given (before
    its call) with the new keys appended; ``k_cache_out``/``v_cache_out``, the caches after the
    kernel's call, judged too: the appended rows within a rounding of the exact rotated keys
    (values: exact), every other slot unchanged."""
    given = fp8_descales(version, q, given)
    out, lse = C.result_lse(result, "result", position=lse_position)
    call = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
                cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                rotary_interleaved=rotary_interleaved, rotary_seqlens=rotary_seqlens, causal=causal,
                window_size=window_size, attention_chunk=given.get("attention_chunk", 0))
    q64, keys, values, win, extra, where, written = kvcache_inputs(version, q, k_cache, v_cache, k, v, update=False,
                                                                   **call)
    opts = options(version, seqlen_k=keys.shape[1], causal=causal, window_size=window_size, **given)
    dtype = (check or {}).get("dtype") or C.dtype_name(q)  # q64 is float64: name the kernel's
    if k_cache_out is not None or v_cache_out is not None:
        _judge_cache(q, k, written, where, k_cache_out, v_cache_out, call)
    judged = judged_options(opts, q.shape[1], extra.get("kv_lengths", keys.shape[1]), extra.get("key_leftpad"))
    C.assert_close(out, q64, keys, values, layout="bshd", qv=qv, **{"dtype": dtype, **(check or {})},
                   **_judged_lse(version, opts, lse), **judged, **extra)


def _judge_cache(q, k, expected, where, k_out, v_out, call: dict):
    """AssertionError unless the kernel's caches are the ``expected`` ones (the given caches with
    the new rows written at ``where``, `kvcache_inputs`): values exactly (rounded once to the
    cache's type), keys within ``ulp(|k_ro|) + 4 eps32 (|x0 cos| + |x1 sin|)`` of the exact
    rotated key (a rotation in float32, stored once), every other slot bit for bit."""
    slack = None
    if k is not None and call["rotary_cos"] is not None:  # the rotation's own rounding: 4 eps32 (|x0 cos| + |x1 sin|)
        b = q.shape[0]
        seq = C.ints(call["cache_seqlens"], "cache_seqlens", b)
        start = seq if call["rotary_seqlens"] is None else C.ints(call["rotary_seqlens"], "rotary_seqlens", b)
        pos = start[:, None] + np.arange(k.shape[1])[None]
        k64 = np.abs(C.as_host(C.float64(k, "k")))
        c, s = (np.abs(C.as_host(C.float64(call[n], n))) for n in ("rotary_cos", "rotary_sin"))
        turn = bool(call["rotary_interleaved"])
        mag = np.maximum(np.abs(rotary(k64, c, -s, pos, turn)), np.abs(rotary(k64, c, s, pos, turn)))
        slack = 4 * 2.0 ** -24 * mag  # |x0| c + |x1| s, |x0| s + |x1| c
    for name, got, want in zip(("k_cache", "v_cache"), (k_out, v_out), expected):
        if got is None:
            continue
        g, w = (C.as_host(C.float64(x, name)) for x in (got, want))
        if g.shape != w.shape:
            raise AssertionError(f"{name}: the kernel's cache has shape {g.shape}, expected {w.shape}")
        allow = np.zeros_like(w)
        if name == "k_cache" and slack is not None:
            allow[where] = slack
            allow += _ulp(w, got)
        bad = ~(np.abs(g - w) <= allow)
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            raise AssertionError(f"{name} after the kernel's call differs from the expected cache at {bad.sum()} "
                                 f"entries, first at {at}: {g[at]!r} (expected {w[at]!r}, allowance "
                                 f"{allow[at]:.3g}): new rows appended at the wrong position, rotated wrongly, "
                                 "or other slots written")


def _ulp(x, like):
    """An ulp of ``like``'s type at each ``|x|``."""
    from ..core.arrays import _ml_dtype, finfo
    name = C.dtype_name(like)
    eps = float(finfo(np.dtype(name) if hasattr(np, name) else _ml_dtype(name, "the cache")).eps)
    return eps * np.exp2(np.floor(np.log2(np.maximum(np.abs(x), np.finfo(np.float64).tiny))))
