"""FlashAttention 3's Python API (``hopper/flash_attn_interface.py``), computed exactly in
float64: the same signatures and defaults, results and tuples, float64 values of the caller's
kind; ``assert_..._close`` twins as in `attnlib.compat.flash_attn`.  FA3's conventions: the window's
``-1`` sides are unbounded, the default scale with ``qv`` is ``(d + dv) ** -0.5``, a row with no
key has ``lse = -inf``, descales ``(b, hk)`` (q's too), ``attention_chunk``, ``page_table``,
``seqused_q``/``seqused_k``, ``rotary_seqlens``.  Performance knobs (``num_splits``,
``pack_gqa``, ``sm_margin``, ``scheduler_metadata``, ``deterministic``) are taken and change
nothing.  `docs/semantics.md`, "Drop-in references".

>>> import numpy as np
>>> q, k, v = (np.random.default_rng(i).standard_normal((1, 8, 2, 16)) for i in range(3))
>>> out, lse = flash_attn_func(q, k, v, causal=True, window_size=(2, -1), return_attn_probs=True)
>>> assert_flash_attn_func_close((out, lse), q, k, v, causal=True, window_size=(2, -1))
"""

from __future__ import annotations

from . import _common as C
from . import _flash as F

V = F.FA3


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """``out (b, sq, hq, dv)``, or ``(out, softmax_lse (b, hq, sq))``."""
    out, lse = F.func(V, q, k, v, qv=qv, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                      k_descale=k_descale, v_descale=v_descale, window_size=window_size,
                      attention_chunk=attention_chunk, softcap=softcap)
    return (out, lse) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                              v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                              deterministic=False, num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """`flash_attn_func` of ``qkv (b, s, 3, h, d)``, or ``(b, s, hq + 2 hk, d)`` with ``num_heads_q``
    (GQA: the query heads first, then the key and the value heads)."""
    if qkv.ndim == 5:
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        if num_heads_q is None or (qkv.shape[2] - num_heads_q) % 2:
            raise ValueError("a 4-D qkv (b, s, hq + 2 hk, d) needs num_heads_q, with an even remainder of heads")
        hk = (qkv.shape[2] - num_heads_q) // 2
        q, k, v = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + hk], qkv[:, :, num_heads_q + hk:]
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, return_attn_probs=return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                           num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """``out (total_q, hq, dv)``, or ``(out, softmax_lse (hq, total_q))``; rows past
    ``seqused_q`` hold 0 (and ``lse = -inf``)."""
    out, lse = F.varlen(V, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=seqused_q,
                        seqused_k=seqused_k, qv=qv, softmax_scale=softmax_scale, causal=causal,
                        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, window_size=window_size,
                        attention_chunk=attention_chunk, softcap=softcap)
    return (out, lse) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """``out (b, sq, hq, dv)``, or ``(out, softmax_lse (b, hq, sq), out_accum, lse_accum)`` (the
    last two empty, as FA3 returns them without splits); the new ``k``, ``v`` written into the
    caches in place (see `attnlib.compat.flash_attn.flash_attn_with_kvcache`).  Packed queries
    (``cu_seqlens_q``, ``cu_seqlens_k_new``) are refused: give them batched."""
    _refuse_packed(cu_seqlens_q, cu_seqlens_k_new)
    out, lse = F.kvcache(V, q, k_cache, v_cache, k, v, qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                         cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                         block_table=page_table, rotary_interleaved=rotary_interleaved,
                         rotary_seqlens=rotary_seqlens, causal=causal, window_size=window_size,
                         softmax_scale=softmax_scale, q_descale=q_descale, k_descale=k_descale,
                         v_descale=v_descale, attention_chunk=attention_chunk, softcap=softcap)
    return (out, lse, C.empty_like_peer(out), C.empty_like_peer(out)) if return_softmax_lse else out


def _refuse_packed(cu_seqlens_q, cu_seqlens_k_new):
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k_new", cu_seqlens_k_new)):
        if x is not None:
            raise ValueError(f"{name}: packed queries or new keys are not taken by this reference; give q, k "
                             "and v batched (b, s, h, d)")


def assert_flash_attn_func_close(result, q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                                 k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                                 softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                                 return_attn_probs=False, **check):
    """AssertionError unless ``result`` (``out`` or ``(out, softmax_lse)``) is `flash_attn_func`'s
    to within a correct kernel's rounding in its precision."""
    F.assert_func(V, result, q, k, v, qv=qv, check=check, softmax_scale=softmax_scale, causal=causal,
                  q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, window_size=window_size,
                  attention_chunk=attention_chunk, softcap=softcap)


def assert_flash_attn_varlen_func_close(result, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, qv=None,
                                        q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1),
                                        attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                                        deterministic=False, sm_margin=0, return_attn_probs=False, **check):
    """`assert_flash_attn_func_close` of `flash_attn_varlen_func` (rows past ``seqused_q`` are not judged)."""
    F.assert_varlen(V, result, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    seqused_q=seqused_q, seqused_k=seqused_k, qv=qv, check=check, softmax_scale=softmax_scale,
                    causal=causal, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                    window_size=window_size, attention_chunk=attention_chunk, softcap=softcap)


def assert_flash_attn_with_kvcache_close(result, q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                                         rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                         cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                                         cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                         q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                                         rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                                         pack_gqa=None, sm_margin=0, return_softmax_lse=False,
                                         k_cache_out=None, v_cache_out=None, **check):
    """`attnlib.compat.flash_attn.assert_flash_attn_with_kvcache_close` with FA3's arguments."""
    _refuse_packed(cu_seqlens_q, cu_seqlens_k_new)
    F.assert_kvcache(V, result, q, k_cache, v_cache, k, v, qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                     cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                     block_table=page_table, rotary_interleaved=rotary_interleaved, rotary_seqlens=rotary_seqlens,
                     causal=causal, window_size=window_size, k_cache_out=k_cache_out, v_cache_out=v_cache_out,
                     check=check, softmax_scale=softmax_scale, q_descale=q_descale, k_descale=k_descale,
                     v_descale=v_descale, attention_chunk=attention_chunk, softcap=softcap)


__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "assert_flash_attn_func_close",
           "assert_flash_attn_varlen_func_close", "assert_flash_attn_with_kvcache_close"]
