"""FlashAttention 2's Python API (``flash_attn``), computed exactly in float64.

``from attnlib.compat.flash_attn import flash_attn_func`` in place of ``from flash_attn import
flash_attn_func``: the same signatures and defaults, the same results' layout and tuples, the
values float64 tensors of the caller's kind (torch on its device, or numpy).  Each has an
``assert_..._close(result, <the same arguments>, **check)`` twin judging a kernel's result with
attnlib's rule (`attnlib.testing.assert_attention_close`; ``**check`` its keywords: ``dtype``,
``dout``/``dq``/``dk``/``dv``, ``names``, ``device``).  Conventions: `docs/semantics.md`,
"Drop-in references".

>>> import numpy as np
>>> q, k, v = (np.random.default_rng(i).standard_normal((1, 8, 2, 16)) for i in range(3))
>>> out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
>>> out.shape, lse.shape
((1, 8, 2, 16), (1, 2, 8))
>>> assert_flash_attn_func_close((out, lse), q, k, v, causal=True)
"""

from __future__ import annotations

from . import _common as C
from . import _flash as F

V = F.FA2


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``out (b, sq, hq, dv)``, or ``(out, softmax_lse (b, hq, sq), S_dmask)`` with
    ``return_attn_probs`` (``S_dmask`` empty: it is only formed with dropout)."""
    out, lse = F.func(V, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    return (out, lse, C.empty_like_peer(out)) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """`flash_attn_func` of ``qkv (b, s, 3, h, d)``."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """`flash_attn_func` of ``q`` and ``kv (b, sk, 2, hk, d)``."""
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """``out (total_q, hq, dv)``, or ``(out, softmax_lse (hq, total_q), S_dmask)``; with
    ``block_table`` ``k``/``v`` are pages ``(num_blocks, page_block_size, hk, d)``."""
    out, lse = F.varlen(V, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        block_table=block_table, dropout_p=dropout_p, softmax_scale=softmax_scale,
                        causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    return (out, lse, C.empty_like_peer(out)) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False):
    """`flash_attn_varlen_func` of ``qkv (total, 3, h, d)``."""
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                                  max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """`flash_attn_varlen_func` of ``q`` and ``kv (total_k, 2, hk, d)``."""
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """``out (b, sq, hq, dv)`` or ``(out, softmax_lse (b, hq, sq))``.  As FlashAttention does, the
    new ``k``, ``v`` are written into ``k_cache``, ``v_cache`` in place at ``cache_seqlens`` (``k``
    rotated when ``rotary_cos``/``rotary_sin`` are given), rounded once to the cache's type; the
    attention then reads the caches as stored and ``q`` rotated (rounded to its type)."""
    out, lse = F.kvcache(V, q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                         cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                         block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved,
                         alibi_slopes=alibi_slopes)
    return (out, lse) if return_softmax_lse else out


def assert_flash_attn_func_close(result, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                 return_attn_probs=False, **check):
    """AssertionError unless ``result`` (``out`` or ``(out, softmax_lse, ...)``) is
    `flash_attn_func`'s to within a correct kernel's rounding in its precision."""
    F.assert_func(V, result, q, k, v, check=check, dropout_p=dropout_p, softmax_scale=softmax_scale,
                  causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)


def assert_flash_attn_varlen_func_close(result, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                        softcap=0.0, alibi_slopes=None, deterministic=False,
                                        return_attn_probs=False, block_table=None, **check):
    """`assert_flash_attn_func_close` of `flash_attn_varlen_func`."""
    F.assert_varlen(V, result, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    block_table=block_table, check=check, dropout_p=dropout_p, softmax_scale=softmax_scale,
                    causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)


def assert_flash_attn_with_kvcache_close(result, q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                                         rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                         cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                                         alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                                         k_cache_out=None, v_cache_out=None, **check):
    """`assert_flash_attn_func_close` of `flash_attn_with_kvcache`: ``k_cache``/``v_cache`` as they
    were before the kernel's call (clone them: the kernel writes into them); the caches after it,
    ``k_cache_out``/``v_cache_out``, judged as well when given (the new rows, rotated, at
    ``cache_seqlens``; every other slot unchanged)."""
    F.assert_kvcache(V, result, q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                     cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                     block_table=block_table, rotary_interleaved=rotary_interleaved, causal=causal,
                     window_size=window_size, k_cache_out=k_cache_out, v_cache_out=v_cache_out, check=check,
                     softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes)


__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
           "assert_flash_attn_func_close", "assert_flash_attn_varlen_func_close",
           "assert_flash_attn_with_kvcache_close"]
