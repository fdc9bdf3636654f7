"""FlashAttention 4's Python API (``flash_attn.cute``), computed exactly in float64: the same
signatures and defaults, float64 values of the caller's kind; ``assert_..._close`` twins as in
`attnlib.compat.flash_attn`.  FA4's conventions: ``window_size=(None, None)`` with ``None``
unbounded, negative sides literal, and both sides given with ``left + right < 0`` meaning no
window; ``learnable_sink (hq,)`` in the softmax and in the LSE; every call returns ``(out,
lse)``, ``lse`` None unless ``return_lse``; with ``qv`` the LSE is ``(b, sq, hq)`` (``(total_q,
hq)``).  CuTe-DSL callables (``score_mod``, ``mask_mod``, ``aux_*``, block-sparse tensors) cannot
run here and are refused: `attnlib.compat.pytorch.flex_attention` takes torch mods.

>>> import numpy as np
>>> q, k, v = (np.random.default_rng(i).standard_normal((1, 8, 2, 16)) for i in range(3))
>>> out, lse = flash_attn_func(q, k, v, window_size=(None, -2), return_lse=True)
>>> assert_flash_attn_func_close((out, lse), q, k, v, window_size=(None, -2))
"""

from __future__ import annotations

import numpy as np

from . import _common as C
from . import _flash as F

V = F.FA4


def _refuse_cute(gather_kv_indices=None, **given):
    if gather_kv_indices is not None:  # a plain index tensor, taken by flash_attn_func
        raise ValueError("gather_kv_indices with packed sequences is not taken by this reference: give q, k "
                         "and v batched to flash_attn_func")
    for name, x in given.items():
        if x is not None:
            raise ValueError(f"{name}: FlashAttention 4's CuTe-DSL callables and block-sparse tensors cannot run "
                             "in the float64 reference; pass torch-written mods to "
                             "attnlib.compat.pytorch.flex_attention, or attnlib's mask_mod/score_mod")


def _shared_kv(q, k, v, qv):
    """FlashAttention 4's MLA path: with ``k is v`` and ``dv == 512`` it drops ``q`` and ``k`` and
    scores ``qv . v`` (``qv`` the caller's, else ``q``): ``(q, k, v, qv)`` as computed."""
    if k is v and v.shape[-1] == 512:
        return (q if qv is None else qv), v, v, None, True
    return q, k, v, qv, False


def _wants_lse(return_lse, *xs) -> bool:
    """FA4 returns the LSE when asked, or when an input requires grad (its backward keeps it)."""
    return bool(return_lse) or any(getattr(x, "requires_grad", False) for x in xs if x is not None)


def _lse_layout(lse, qv):
    """FA4's LSE: ``(b, hq, sq)`` / ``(hq, total_q)``, heads last with ``qv``."""
    return C.swap(lse, -2, -1) if qv is not None and lse is not None else lse


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False):
    """``(out (b, sq, hq, dv), lse (b, hq, sq) or None)``."""
    _refuse_cute(score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                 aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors)
    wants = _wants_lse(return_lse, q, k, v, qv)
    q, k, v, qv, shared = _shared_kv(q, k, v, qv)
    out, lse = F.func(V, q, k, v, qv=qv, gather_kv_indices=gather_kv_indices, softmax_scale=softmax_scale,
                      causal=causal, window_size=window_size, learnable_sink=learnable_sink, softcap=softcap)
    return out, (_lse_layout(lse, qv if not shared else True) if wants else None)


def _packed(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table):
    """Every FA4 varlen form as packed sequences: ``(q, k, v, qv, cu_q, cu_k, seqused_k, batched)``
    with ``batched`` q's ``(b, sq)`` when it came batched (None when packed)."""
    batched = None
    if cu_seqlens_q is None:
        if q.ndim != 4:
            raise ValueError("q must be (b, sq, hq, d) without cu_seqlens_q, or (total_q, hq, d) with it")
        batched = q.shape[:2]
        q, qv = (None if x is None else x.reshape((-1,) + tuple(x.shape[2:])) for x in (q, qv))
        cu_seqlens_q = np.arange(batched[0] + 1) * batched[1]
    if page_table is not None:
        if cu_seqlens_k is not None:
            raise ValueError("page_table is not supported with cu_seqlens_k (FlashAttention 4's rule): the pages "
                             "give each sequence's keys, seqused_k their counts")
        table = C.ints(page_table, "page_table")
        full = table.shape[1] * k.shape[1]
        lengths = np.full(table.shape[0], full) if seqused_k is None else C.ints(seqused_k, "seqused_k", table.shape[0])
        table = F.used_pages(table, np.minimum(lengths, full), k.shape[1], k.shape[0], "page_table")
        k, v = (F._logical(x, table, None, full) for x in (k, v))
    if cu_seqlens_k is None and (page_table is not None or k.ndim == 4):
        cu_seqlens_k = np.arange(k.shape[0] + 1) * k.shape[1]
        k, v = (x.reshape((-1,) + tuple(x.shape[2:])) for x in (k, v))
    return q, k, v, qv, C.ints(cu_seqlens_q, "cu_seqlens_q"), C.ints(cu_seqlens_k, "cu_seqlens_k"), batched


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False):
    """``(out, lse or None)``: ``out (total_q, hq, dv)`` and ``lse (hq, total_q)`` for packed
    queries, ``(b, sq, hq, dv)`` and ``(b, hq, sq)`` for batched ones (``seqused_q``: rows past it
    hold 0); keys packed (``cu_seqlens_k``), batched, or pages ``(num_pages, page_size, hk, d)``
    with ``page_table (b, max_pages)``."""
    _refuse_cute(score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                 aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors,
                 gather_kv_indices=gather_kv_indices)
    wants = _wants_lse(return_lse, q, k, v, qv)
    q, k, v, qv, shared = _shared_kv(q, k, v, qv)
    q2, k2, v2, qv2, cu_q, cu_k, batched = _packed(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                                   seqused_k, page_table)
    out, lse = F.varlen(V, q2, k2, v2, cu_q, cu_k, None, None, seqused_q=seqused_q, seqused_k=seqused_k, qv=qv2,
                        softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        learnable_sink=learnable_sink, softcap=softcap)
    if batched is not None:
        out = out.reshape(tuple(batched) + tuple(out.shape[1:]))
        lse = C.swap(lse.reshape((lse.shape[0],) + tuple(batched)), 0, 1)  # (b, hq, sq)
    return out, (_lse_layout(lse, qv if not shared else True) if wants else None)


def assert_flash_attn_func_close(result, q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None,
                                 causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
                                 num_splits=1, pack_gqa=None, deterministic=False, score_mod=None,
                                 score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None,
                                 block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                                 **check):
    """AssertionError unless ``result`` (``(out, lse or None)``, or ``out``) is `flash_attn_func`'s
    to within a correct kernel's rounding in its precision."""
    _refuse_cute(score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                 aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors)
    out, lse = C.result_lse(result, "result")
    q, k, v, qv, shared = _shared_kv(q, k, v, qv)
    F.assert_func(V, (out, _lse_layout(lse, qv if not shared else True)), q, k, v, qv=qv, gather_kv_indices=gather_kv_indices, check=check,
                  softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                  learnable_sink=learnable_sink, softcap=softcap)


def assert_flash_attn_varlen_func_close(result, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None,
                                        max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, seqused_q=None,
                                        seqused_k=None, gather_kv_indices=None, page_table=None, softmax_scale=None,
                                        causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
                                        num_splits=1, pack_gqa=None, deterministic=False, score_mod=None,
                                        score_mod_bwd=None, mask_mod=None, block_sparse_tensors=None,
                                        aux_tensors=None, aux_scalars=None, return_lse=False, scheduler_metadata=None,
                                        seqlen_k_per_split=None, disable_scheduler_metadata=False, **check):
    """`assert_flash_attn_func_close` of `flash_attn_varlen_func` (rows past ``seqused_q`` not judged)."""
    _refuse_cute(score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                 aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors,
                 gather_kv_indices=gather_kv_indices)
    out, lse = C.result_lse(result, "result")
    q, k, v, qv, shared = _shared_kv(q, k, v, qv)
    lse = _lse_layout(lse, qv if not shared else True)
    q2, k2, v2, qv2, cu_q, cu_k, batched = _packed(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                                   seqused_k, page_table)
    if batched is not None:
        out = out.reshape((-1,) + tuple(out.shape[2:]))
        lse = None if lse is None else C.swap(lse, 0, 1).reshape(lse.shape[1], -1)
    F.assert_varlen(V, (out, lse), q2, k2, v2, cu_q, cu_k, None, None, seqused_q=seqused_q, seqused_k=seqused_k,
                    qv=qv2, check=check, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    learnable_sink=learnable_sink, softcap=softcap)


__all__ = ["flash_attn_func", "flash_attn_varlen_func", "assert_flash_attn_func_close",
           "assert_flash_attn_varlen_func_close"]
