"""FlashInfer's attention calls, exact in float64, with their assert twins (`docs/semantics.md`,
"Drop-in references: FlashInfer").

``single_prefill_with_kv_cache``, ``single_decode_with_kv_cache`` and the wrappers
``BatchPrefillWithPagedKVCacheWrapper``, ``BatchPrefillWithRaggedKVCacheWrapper`` and
``BatchDecodeWithPagedKVCacheWrapper`` (constructed with a workspace buffer, which is ignored;
``plan(...)`` binds the problem, ``run(...)`` computes; the older ``begin_forward``,
``forward``, ``forward_return_lse``, ``run_return_lse`` and ``end_forward`` too), with
FlashInfer's signatures and conventions (flashinfer-ai/flashinfer, ``include/flashinfer/
attention/variants.cuh``, ``prefill.cuh``, ``decode.cuh``, ``pos_enc.cuh``):

- layouts ``NHD`` and ``HND`` (and the 5-D one-tensor paged cache ``[:, 0]`` K, ``[:, 1]`` V);
- ``causal`` bottom-right (query ``i`` sees ``j <= i + kv_len - qo_len``); ``window_left``
  inclusive, ``-1`` full; ``logits_soft_cap`` after ``sm_scale`` (default ``1/sqrt(head_dim_qk)``);
- ``custom_mask`` (bool, True keeps, row-major per request; it overrides ``causal``) and
  ``packed_custom_mask`` (little-endian bit order, per-request byte-aligned segments as
  ``segment_packbits`` makes them);
- ``pos_encoding_mode``: ``"ROPE_LLAMA"`` rotates q and k in float64 (non-interleaved halves over
  the whole head dim; q at ``q_idx + kv_len - qo_len``, k at ``kv_idx``) before attnlib attends to
  the rotated copies; ``"ALIBI"`` adds FlashInfer's ``slope_h * (kv_idx - q_idx)`` (raw ``q_idx``,
  its own slopes `get_alibi_slopes`) as a ``score_mod``, so the LSE is FlashInfer's exactly;
- ``return_lse``: base 2, token-major ``(qo_len, Hq)`` (decode ``(Hq,)`` / ``(batch, Hq)``);
  rows with no key give 0 and ``lse = -inf``.

Everything is computed by ``attnlib.attention`` on the caller's arrays (torch tensors on their
device, numpy on the host): a paged problem without a mask, RoPE or ALiBi through attnlib's
paged path (pages read in place); the others on each request's keys gathered (a copy of that
request's pages).  Results are float64 tensors of the caller's kind.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import _common as C
from ._flashinfer import (_Request, _Spec, _attend, _factor, _finish, _heads, _indptr, _judge, _layout,  # noqa: F401
                          _masks, _no, _per_head, _shape, _short, _sinks, _spec, _unpack_cache, _window_left,
                          get_alibi_slopes, rope_llama, unpack_mask_bits)

# ---------------------------------------------------------------------------------------------
# Single request


def _single_problem(q, k, v, kv_layout, decode):
    _layout(kv_layout)
    if decode:
        _shape(q, "q", 2, "(num_qo_heads, head_dim)")
    else:
        _shape(q, "q", 3, "(qo_len, num_qo_heads, head_dim_qk)")
    what = "(kv_len, num_kv_heads, head_dim)" if kv_layout == "NHD" else "(num_kv_heads, kv_len, head_dim)"
    _shape(k, "k", 3, what)
    _shape(v, "v", 3, what)
    if kv_layout == "HND":
        k, v = C.swap(k, 0, 1), C.swap(v, 0, 1)
    if tuple(k.shape[:2]) != tuple(v.shape[:2]):
        raise ValueError(f"k and v must have the same kv_len and heads, got {tuple(k.shape)} and {tuple(v.shape)} "
                         "(NHD)")
    q3 = q[None] if decode else q
    if k.shape[-1] != q3.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q3.shape[-1]} and {k.shape[-1]}")
    _heads(int(q3.shape[1]), int(k.shape[1]))
    return q3, k, v, [_Request(0, int(q3.shape[0]), int(k.shape[0]))]


def _single_prefill_args(q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal,
                         kv_layout, pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left,
                         logits_soft_cap, rope_scale, rope_theta, backend, kv_cache_sf, k_scale, v_scale):
    _no("kv_cache_sf", kv_cache_sf, "NVFP4 block scales are not computed by the float64 reference")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {backend!r}")
    q3, k3, v3, reqs = _single_problem(q, k, v, kv_layout, decode=False)
    spec = _spec(causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
                 logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                 use_fp16_qk_reduction=use_fp16_qk_reduction)
    _masks(reqs, custom_mask, packed_custom_mask, single=True)
    r = reqs[0]
    if spec.causal and r.mask is None and r.kv_len < r.qo_len:
        raise ValueError(f"causal with kv_len ({r.kv_len}) < qo_len ({r.qo_len}): FlashInfer's single prefill "
                         "refuses it (prefill.cuh); its batch wrappers give those rows 0 and lse -inf")
    hq, hk = int(q3.shape[1]), int(k3.shape[1])
    heads = dict(q_scale_heads=_per_head(scale_q, "scale_q", hq), k_scale_heads=_per_head(scale_k, "scale_k", hk),
                 v_scale_heads=_per_head(scale_v, "scale_v", hk))
    return q3, k3, v3, reqs, spec, hq, hk, heads, _factor(k_scale, "k_scale"), _factor(v_scale, "v_scale")


def _head_factors(hq, hk, q_heads, k_heads, v_heads):
    """Per query head factors of the scores (``scale_q[h] scale_k[h // g]``) and of the output
    (``scale_v[h // g]``), or None."""
    g = hq // hk
    qf = None
    if q_heads is not None or k_heads is not None:
        qf = (np.ones(hq) if q_heads is None else q_heads) * np.repeat(np.ones(hk) if k_heads is None else k_heads, g)
    of = None if v_heads is None else np.repeat(v_heads, g)
    return qf, of


def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None, custom_mask=None,
                                 packed_custom_mask=None, causal=False, kv_layout="NHD", pos_encoding_mode="NONE",
                                 use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
                                 rope_scale=None, rope_theta=None, backend="auto", return_lse=False,
                                 kv_cache_sf=None, k_scale=None, v_scale=None):
    """FlashInfer's ``single_prefill_with_kv_cache``, exact in float64.

    Parameters
    ----------
    q : tensor, ``(qo_len, num_qo_heads, head_dim_qk)``
    k, v : tensor, ``(kv_len, num_kv_heads, head_dim)`` (``NHD``) or ``(num_kv_heads, kv_len, head_dim)`` (``HND``)
    scale_q, scale_k, scale_v : tensor, ``(num_qo_heads,)``, ``(num_kv_heads,)``, ``(num_kv_heads,)``, optional
        Per-head fp8 dequantisation factors: the scores are multiplied by ``scale_q[h] scale_k[h // g]``,
        the output by ``scale_v[h // g]`` (FlashInfer's fp8 variant).  Applied whenever given
        (FlashInfer reads them with fp8 inputs).
    custom_mask : bool tensor ``(qo_len, kv_len)``, optional
        True keeps; overrides ``causal``.
    packed_custom_mask : uint8 tensor, optional
        The mask packed little-endian (``packbits(mask.view(-1), bitorder="little")``); wins
        over ``custom_mask``.
    causal : bool
        Bottom-right (refused, as FlashInfer does, with ``kv_len < qo_len``).
    kv_layout : {"NHD", "HND"}
    pos_encoding_mode : {"NONE", "ROPE_LLAMA", "ALIBI"}
    use_fp16_qk_reduction : bool
        A precision knob of the kernel: accepted, ignored (the reference is exact).
    sm_scale : float, optional
        Default ``1/sqrt(head_dim_qk)``; ``k_scale`` multiplies it.
    window_left : int
        ``-1`` full, else keys ``j >= i + kv_len - qo_len - window_left`` (inclusive).
    logits_soft_cap : float, optional
        ``cap * tanh(sm_scale q.k / cap)``; None or 0: off.
    rope_scale, rope_theta : float, optional
        ROPE_LLAMA's (defaults 1 and 1e4).
    backend, o_dtype
        Accepted, ignored (the result is float64).
    return_lse : bool
        Also return ``lse (qo_len, num_qo_heads)``, base 2.
    kv_cache_sf
        NVFP4 block scales: refused.
    k_scale, v_scale : float, optional
        ``sm_scale *= k_scale``; the output times ``v_scale``.

    Returns
    -------
    out : float64, ``(qo_len, num_qo_heads, head_dim_vo)``; ``(out, lse)`` with ``return_lse``.
    """
    q3, k3, v3, reqs, spec, hq, hk, heads, ks, vs = _single_prefill_args(
        q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout,
        pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
        backend, kv_cache_sf, k_scale, v_scale)
    if ks is not None:
        spec = _with_scale(spec, spec.scale_for(int(q3.shape[-1])) * ks)
    qf, of = _head_factors(hq, hk, heads["q_scale_heads"], heads["k_scale_heads"], heads["v_scale_heads"])
    out, lse = _attend(q3, k3, v3, reqs, spec, hk=hk, q_factor=qf, out_factor=of)
    return _finish(out, lse, vs, return_lse, None)


def single_prefill_with_kv_cache_return_lse(q, k, v, *args, **kwargs):
    """`single_prefill_with_kv_cache` with ``return_lse=True``: ``(out, lse)`` (FlashInfer's alias)."""
    return single_prefill_with_kv_cache(q, k, v, *args, **{**kwargs, "return_lse": True})


def _with_scale(spec: _Spec, scale: float) -> _Spec:
    from dataclasses import replace
    return replace(spec, sm_scale=scale)


def assert_single_prefill_close(result, q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None,
                                custom_mask=None, packed_custom_mask=None, causal=False, kv_layout="NHD",
                                pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
                                logits_soft_cap=None, rope_scale=None, rope_theta=None, backend="auto",
                                return_lse=False, kv_cache_sf=None, k_scale=None, v_scale=None, **check):
    """Assert a kernel's ``result`` (``out`` or ``(out, lse)``) is `single_prefill_with_kv_cache`
    of the same arguments to within what a correct kernel in its precision differs by
    (`attnlib.testing.assert_attention_close`; ``**check`` its further keywords).  With
    ``ROPE_LLAMA`` the kernel is judged against the attention of q and k rotated in float64
    (its effective inputs) at the precision of ``q`` (``dtype=`` to say otherwise)."""
    q3, k3, v3, reqs, spec, hq, hk, heads, ks, vs = _single_prefill_args(
        q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout,
        pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
        backend, kv_cache_sf, k_scale, v_scale)
    _judge(result, q3, k3, v3, reqs, spec, hk=hk, check=check, return_lse_shape="tokens", scalar_k=ks,
           scalar_v=vs, return_lse=return_lse, **heads)


def _single_decode_args(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale,
                        window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta):
    if not isinstance(use_tensor_cores, (bool, np.bool_)):
        raise TypeError(f"use_tensor_cores must be a bool, got {use_tensor_cores!r}")
    q3, k3, v3, reqs = _single_problem(q, k, v, kv_layout, decode=True)
    spec = _spec(pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
                 logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta)
    return q3, k3, v3, reqs, spec, _factor(q_scale, "q_scale"), _factor(k_scale, "k_scale"), \
        _factor(v_scale, "v_scale")


def single_decode_with_kv_cache(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE", use_tensor_cores=False,
                                q_scale=None, k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None,
                                sm_scale=None, rope_scale=None, rope_theta=None, return_lse=False):
    """FlashInfer's ``single_decode_with_kv_cache``, exact in float64.

    ``q (num_qo_heads, head_dim)`` is one query at position ``kv_len - 1`` (ROPE_LLAMA) seeing
    every key (``window_left`` counts back from the last key); ``q_scale`` and ``k_scale``
    multiply ``sm_scale``, ``v_scale`` the output; ``use_tensor_cores`` is ignored.  Returns
    ``out (num_qo_heads, head_dim)`` float64, with ``return_lse`` also ``lse (num_qo_heads,)`` base 2.
    Other arguments as in `single_prefill_with_kv_cache`.
    """
    q3, k3, v3, reqs, spec, qs, ks, vs = _single_decode_args(
        q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
        logits_soft_cap, sm_scale, rope_scale, rope_theta)
    spec = _with_scale(spec, spec.scale_for(int(q3.shape[-1])) * (qs or 1.0) * (ks or 1.0))
    out, lse = _attend(q3, k3, v3, reqs, spec, hk=int(k3.shape[1]))
    return _finish(out[0], lse[0], vs, return_lse, None)


def assert_single_decode_close(result, q, k, v, kv_layout="NHD", pos_encoding_mode="NONE", use_tensor_cores=False,
                               q_scale=None, k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None,
                               sm_scale=None, rope_scale=None, rope_theta=None, return_lse=False, **check):
    """Assert a kernel's ``result`` (``out (Hq, D)`` or ``(out, lse (Hq,))``) is
    `single_decode_with_kv_cache` of the same arguments (see `assert_single_prefill_close`)."""
    q3, k3, v3, reqs, spec, qs, ks, vs = _single_decode_args(
        q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
        logits_soft_cap, sm_scale, rope_scale, rope_theta)
    _judge(result, q3, k3, v3, reqs, spec, hk=int(k3.shape[1]), check=check, return_lse_shape="single",
           scalar_q=qs, scalar_k=ks, scalar_v=vs, return_lse=return_lse)


# ---------------------------------------------------------------------------------------------
# The wrappers


class _Wrapper:
    """What the three wrappers share: the workspace ignored, ``plan`` before ``run``."""

    _planned = None

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD"):
        self._kv_layout = _layout(kv_layout)

    def end_forward(self) -> None:
        """Deprecated in FlashInfer; no effect."""

    def _plan(self):
        if self._planned is None:
            raise RuntimeError(f"{type(self).__name__}.run before plan: call plan(...) first")
        return self._planned

    def _bind(self, q, paged_kv_cache, window_left):
        """``(plan, k pages, v pages, spec)`` of a paged ``run``: ``window_left`` overrides the plan's."""
        plan = self._plan()
        _check_q(q, plan, self._q_shape)
        kc, vc = _unpack_cache(paged_kv_cache, self._kv_layout)
        _check_pages(plan, kc)
        spec = plan.spec
        if window_left is not None:
            spec = replace(spec, window_left=_window_left(window_left))
        return plan, kc, vc, spec

    def _paged_run(self, q, paged_kv_cache, q_scale, k_scale, v_scale, return_lse, window_left, sinks):
        """A paged wrapper's ``run``: ``q_scale``/``k_scale`` multiply ``sm_scale``, ``v_scale`` the output."""
        plan, kc, vc, spec = self._bind(q, paged_kv_cache, window_left)
        qs, ks, vs = _factor(q_scale, "q_scale"), _factor(k_scale, "k_scale"), _factor(v_scale, "v_scale")
        spec = _with_scale(spec, spec.scale_for(plan.d) * (qs or 1.0) * (ks or 1.0))
        s = _sinks(sinks, plan.hq, bool(return_lse))
        o, l = _attend(q, kc, vc, plan.reqs, spec, hk=plan.hk, sinks=s)
        return _finish(o, l, vs, return_lse, s)

    def _run_checks(self, args, kv_cache_sf=None, skip_softmax_threshold_scale_factor=None, uses_spcompress=None):
        if args:
            raise ValueError(f"{len(args)} positional argument(s) after the cache: a custom kernel's (or fp8 "
                             "scale tensors); not computed by the float64 reference")
        _no("kv_cache_sf", kv_cache_sf, "NVFP4 block scales are not computed by the float64 reference")
        _no("skip_softmax_threshold_scale_factor", skip_softmax_threshold_scale_factor,
            "skip-softmax sparsity drops keys by a threshold: not the exact attention")
        _no("uses_spcompress", uses_spcompress, "not computed by the float64 reference")


@dataclass
class _Plan:
    reqs: list
    spec: _Spec
    hq: int
    hk: int
    d: int
    dv: int
    page_size: int | None = None


def _check_q(q, plan: _Plan, what: str):
    _shape(q, "q", 3, what)
    total = plan.reqs[-1].q1 if plan.reqs else 0
    if tuple(q.shape) != (total, plan.hq, plan.d):
        raise ValueError(f"q must be {what} = ({total}, {plan.hq}, {plan.d}) as planned, got {tuple(q.shape)}")


def _paged_requests(qo_indptr, kv_indptr, kv_indices, last_page_len, page_size, *, names):
    ind = _indptr(kv_indptr, names[0])
    batch = ind.size - 1
    qo = np.arange(batch + 1) if qo_indptr is None else _indptr(qo_indptr, "qo_indptr")
    if qo.size != ind.size:
        raise ValueError(f"qo_indptr and {names[0]} must have the same length (batch + 1), got {qo.size} and "
                         f"{ind.size}")
    pages = C.ints(kv_indices, names[1])
    if pages is None or pages.ndim != 1 or pages.size < ind[-1]:
        raise ValueError(f"{names[1]} must be 1-D with at least {names[0]}[-1] = {int(ind[-1])} entries")
    last = C.ints(last_page_len, names[2])
    if last is None or last.shape != (batch,):
        raise ValueError(f"{names[2]} must have shape (batch_size,) = ({batch},), got "
                         f"{None if last is None else last.shape}")
    if isinstance(page_size, (bool, np.bool_)) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    reqs = []
    for b in range(batch):
        n = int(ind[b + 1] - ind[b])
        if n and not 1 <= last[b] <= page_size:
            raise ValueError(f"{names[2]}[{b}] = {int(last[b])}: must be in [1, page_size = {page_size}] (the "
                             "entries in the request's last page)")
        kv_len = 0 if n == 0 else (n - 1) * int(page_size) + int(last[b])
        req_pages = pages[ind[b]:ind[b + 1]]
        if (req_pages < 0).any():
            raise ValueError(f"{names[1]} of request {b} holds a negative page")
        reqs.append(_Request(int(qo[b]), int(qo[b + 1]), kv_len, pages=req_pages))
    return reqs


def _check_pages(plan: _Plan, kc):
    if int(kc.shape[1]) != plan.page_size:
        raise ValueError(f"the cache's page_size is {int(kc.shape[1])}, planned {plan.page_size}")
    if tuple(kc.shape[2:]) != (plan.hk, plan.d):
        raise ValueError(f"the K cache's (num_kv_heads, head_dim) are {tuple(kc.shape[2:])}, planned "
                         f"{(plan.hk, plan.d)}")
    top = max((int(r.pages.max()) for r in plan.reqs if r.pages is not None and r.pages.size), default=-1)
    if top >= int(kc.shape[0]):
        raise ValueError(f"the page indices name page {top}, but the cache has {int(kc.shape[0])} pages")


def _ignored(**kw):
    for name, x in kw.items():
        if x is not None:
            raise ValueError(f"{name}={_short(x)}: not computed by the float64 reference (a backend-specific "
                             "input; give the problem through the indptr arrays)")


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper``, exact in float64.

    ``plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
    num_kv_heads, head_dim_qk, page_size, ...)`` binds the requests: request ``b`` has queries
    ``q[qo_indptr[b]:qo_indptr[b+1]]`` and pages ``paged_kv_indices[paged_kv_indptr[b]:
    paged_kv_indptr[b+1]]`` holding ``(pages - 1) * page_size + paged_kv_last_page_len[b]`` keys
    (0 with no page).  ``run(q, paged_kv_cache)`` returns ``out (total_q, Hq, Dv)`` float64 and,
    with ``return_lse``, ``lse (total_q, Hq)`` base 2; rows with no key (causal with
    ``kv_len < qo_len``) give 0 and ``-inf``.  ``assert_close(result, q, paged_kv_cache, ...)``
    judges a kernel's ``run`` result for the same plan.
    """

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        super().__init__(float_workspace_buffer, kv_layout)
        _no("jit_args", jit_args, "a custom JIT attention variant is not FlashInfer's default attention")
        _no("jit_kwargs", jit_kwargs, "a custom JIT attention variant is not FlashInfer's default attention")

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False):
        """Bind the batch (FlashInfer's arguments; the data types, ``non_blocking`` and the split
        knobs are accepted and ignored; multi-item scoring and the cudnn/trtllm-gen inputs
        ``seq_lens``/``seq_lens_q``/``block_tables`` are refused)."""
        _ignored(prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                 max_item_len_ptr=max_item_len_ptr, seq_lens=seq_lens, seq_lens_q=seq_lens_q, block_tables=block_tables)
        reqs = _paged_requests(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size,
                               names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        spec = _spec(causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
                     logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                     use_fp16_qk_reduction=use_fp16_qk_reduction)
        _masks(reqs, custom_mask, packed_custom_mask)
        self._planned = _plan_of(reqs, spec, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size)

    begin_forward = plan

    _q_shape = "(qo_indptr[-1], num_qo_heads, head_dim_qk)"

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None, uses_spcompress=None):
        """``out`` (or ``(out, lse)``) of the planned batch: ``q (qo_indptr[-1], Hq, D)``,
        ``paged_kv_cache`` a ``(k_cache, v_cache)`` pair or one 5-D tensor in the wrapper's
        ``kv_layout``.  ``q_scale``/``k_scale`` multiply ``sm_scale``, ``v_scale`` the output;
        ``window_left`` overrides the plan's (FlashInfer's trtllm-gen backend takes an override,
        the others assert it equal); ``sinks (Hq,)``: natural-log logits joining each row's
        denominator (out only: not with ``return_lse``).  ``out``/``lse`` buffers are not
        written (the result is new float64 tensors)."""
        self._run_checks(args, kv_cache_sf, skip_softmax_threshold_scale_factor, uses_spcompress)
        return self._paged_run(q, paged_kv_cache, q_scale, k_scale, v_scale, return_lse, window_left, sinks)

    def run_return_lse(self, q, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    def forward(self, q, paged_kv_cache, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                rope_theta=None):
        """Deprecated in FlashInfer: sets these options on the plan (as FlashInfer does), then `run`."""
        self._reoption(causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                       window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                       rope_theta=rope_theta, use_fp16_qk_reduction=use_fp16_qk_reduction)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q, paged_kv_cache, causal=False, pos_encoding_mode="NONE",
                           use_fp16_qk_reduction=False, k_scale=None, v_scale=None, window_left=-1,
                           logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """Deprecated in FlashInfer: `forward` returning ``(out, lse)``."""
        self._reoption(causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                       window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                       rope_theta=rope_theta, use_fp16_qk_reduction=use_fp16_qk_reduction)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)

    def _reoption(self, **options):
        plan = self._plan()
        plan.spec = _spec(**options)

    def assert_close(self, result, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
                     window_left=None, sinks=None, kv_cache_sf=None, skip_softmax_threshold_scale_factor=None,
                     uses_spcompress=None, **check):
        """Assert a kernel's ``run`` result (``out`` or ``(out, lse)``) for this plan and the same
        ``run`` arguments is this wrapper's `run`, to within what a correct kernel in its
        precision differs by (`attnlib.testing.assert_attention_close`; ``**check`` its further
        keywords).  The requests are judged padded into one batch, their pages gathered."""
        self._run_checks(args, kv_cache_sf, skip_softmax_threshold_scale_factor, uses_spcompress)
        plan, kc, vc, spec = self._bind(q, paged_kv_cache, window_left)
        s = None if sinks is None else _sinks(sinks, plan.hq, False)
        _judge(result, q, kc, vc, plan.reqs, spec, hk=plan.hk, check=check, return_lse_shape="tokens", sinks=s,
               scalar_q=_factor(q_scale, "q_scale"), scalar_k=_factor(k_scale, "k_scale"),
               scalar_v=_factor(v_scale, "v_scale"))


def _plan_of(reqs, spec, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size=None) -> _Plan:
    for name, x in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim_qk", head_dim_qk)):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if head_dim_vo is not None and (isinstance(head_dim_vo, (bool, np.bool_)) or
                                    not isinstance(head_dim_vo, (int, np.integer)) or head_dim_vo < 1):
        raise ValueError(f"head_dim_vo must be a positive int or None, got {head_dim_vo!r}")
    _heads(int(num_qo_heads), int(num_kv_heads))
    dv = int(head_dim_qk if head_dim_vo is None else head_dim_vo)
    return _Plan(reqs, spec, int(num_qo_heads), int(num_kv_heads), int(head_dim_qk), dv,
                 None if page_size is None else int(page_size))


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    """FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper``, exact in float64.

    ``plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, ...)``: request ``b``
    has queries ``q[qo_indptr[b]:qo_indptr[b+1]]`` and keys ``k[kv_indptr[b]:kv_indptr[b+1]]``
    (``k, v (kv_indptr[-1], Hk, D)``; with ``kv_layout="HND"`` ``(Hk, kv_indptr[-1], D)``).
    ``run(q, k, v)``: ``out (total_q, Hq, Dv)``, ``lse (total_q, Hq)`` base 2.  The ``run``
    scales ``q_scale``/``k_scale``/``v_scale``/``o_scale`` are refused: FlashInfer's ragged
    path applies them by backend (fp8 kernels, NVFP4), not one definition.
    """

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None,
                 jit_kwargs=None):
        super().__init__(float_workspace_buffer, kv_layout)
        _no("jit_args", jit_args, "a custom JIT attention variant is not FlashInfer's default attention")
        _no("jit_kwargs", jit_kwargs, "a custom JIT attention variant is not FlashInfer's default attention")

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, custom_mask=None,
             packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
             window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None, fixed_split_size=None,
             disable_split_kv=False, seq_lens=None, seq_lens_q=None, max_token_per_sequence=None,
             max_sequence_kv=None, v_indptr=None, o_indptr=None):
        """Bind the batch (FlashInfer's arguments; note ``window_left`` and ``logits_soft_cap``
        come before ``sm_scale`` here)."""
        _ignored(prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                 max_item_len_ptr=max_item_len_ptr, seq_lens=seq_lens, seq_lens_q=seq_lens_q, v_indptr=v_indptr,
                 o_indptr=o_indptr)
        qo, kv = _indptr(qo_indptr, "qo_indptr"), _indptr(kv_indptr, "kv_indptr")
        if qo.size != kv.size:
            raise ValueError(f"qo_indptr and kv_indptr must have the same length (batch + 1), got {qo.size} and "
                             f"{kv.size}")
        reqs = [_Request(int(qo[b]), int(qo[b + 1]), int(kv[b + 1] - kv[b]), k0=int(kv[b])) for b in range(qo.size - 1)]
        spec = _spec(causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
                     logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                     use_fp16_qk_reduction=use_fp16_qk_reduction)
        _masks(reqs, custom_mask, packed_custom_mask)
        self._planned = _plan_of(reqs, spec, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo)
        self._kv_total = int(kv[-1])

    begin_forward = plan

    def _bind(self, q, k, v):
        plan = self._plan()
        _check_q(q, plan, "(qo_indptr[-1], num_qo_heads, head_dim_qk)")
        what = "(kv_indptr[-1], num_kv_heads, head_dim)" if self._kv_layout == "NHD" else \
            "(num_kv_heads, kv_indptr[-1], head_dim)"
        _shape(k, "k", 3, what)
        _shape(v, "v", 3, what)
        if self._kv_layout == "HND":
            k, v = C.swap(k, 0, 1), C.swap(v, 0, 1)
        if tuple(k.shape) != (self._kv_total, plan.hk, plan.d) or tuple(v.shape[:2]) != (self._kv_total, plan.hk):
            raise ValueError(f"k and v must be {what} as planned (kv_indptr[-1] = {self._kv_total}, "
                             f"{plan.hk} kv heads, head_dim {plan.d}), got {tuple(k.shape)} and {tuple(v.shape)}")
        return plan, k, v

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, kv_cache_sf=None):
        """``out`` (or ``(out, lse)``) of the planned batch."""
        self._run_checks(args, kv_cache_sf)
        for name, x in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale), ("o_scale", o_scale)):
            _no(name, x, "FlashInfer's ragged wrapper applies it by backend (fp8 kernels, NVFP4 keys); not "
                "one definition the reference could follow")
        plan, k, v = self._bind(q, k, v)
        o, l = _attend(q, k, v, plan.reqs, plan.spec, hk=plan.hk)
        return _finish(o, l, None, return_lse, None)

    def run_return_lse(self, q, k, v, *args, **kwargs):
        return self.run(q, k, v, *args, return_lse=True, **kwargs)

    def forward(self, q, k, v, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, window_left=-1,
                logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """Deprecated in FlashInfer: sets these options on the plan (as FlashInfer does), then `run`."""
        self._plan().spec = _spec(causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                                  window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                                  rope_theta=rope_theta, use_fp16_qk_reduction=use_fp16_qk_reduction)
        return self.run(q, k, v)

    def forward_return_lse(self, q, k, v, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                           window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """Deprecated in FlashInfer: `forward` returning ``(out, lse)``."""
        self._plan().spec = _spec(causal=causal, pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                                  window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                                  rope_theta=rope_theta, use_fp16_qk_reduction=use_fp16_qk_reduction)
        return self.run(q, k, v, return_lse=True)

    def assert_close(self, result, q, k, v, *args, kv_cache_sf=None, **check):
        """Assert a kernel's ``run`` result (``out`` or ``(out, lse)``) for this plan is this
        wrapper's `run` of ``q, k, v`` (see `BatchPrefillWithPagedKVCacheWrapper.assert_close`)."""
        self._run_checks(args, kv_cache_sf)
        plan, k, v = self._bind(q, k, v)
        _judge(result, q, k, v, plan.reqs, plan.spec, hk=plan.hk, check=check, return_lse_shape="tokens")


_DECODE_LEGACY = ("pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
                  "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking", "block_tables",
                  "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req")


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``, exact in float64.

    ``plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
    **options)`` (the options after ``page_size`` may also come positionally, FlashInfer's
    deprecated order, as vLLM passes ``"NONE"``): request ``b`` is one query ``q[b]`` over its
    pages.  ``run(q, paged_kv_cache)``: ``out (batch, Hq, D)``, ``lse (batch, Hq)`` base 2.  A
    query sees every key of its request (``window_left`` counts back from the last; ROPE_LLAMA
    puts it at ``kv_len - 1``).  ``q_len_per_req > 1`` is refused.
    """

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout)
        _no("jit_args", jit_args, "a custom JIT attention variant is not FlashInfer's default attention")
        if not isinstance(use_tensor_cores, (bool, np.bool_)):
            raise TypeError(f"use_tensor_cores must be a bool, got {use_tensor_cores!r}")
        self.use_tensor_cores = bool(use_tensor_cores)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *deprecated_positional_args, **kwargs):
        """Bind the batch (FlashInfer's arguments)."""
        if len(deprecated_positional_args) > len(_DECODE_LEGACY):
            raise TypeError(f"plan() accepts at most {len(_DECODE_LEGACY)} positional options after page_size, got "
                            f"{len(deprecated_positional_args)}")
        for name, value in zip(_DECODE_LEGACY, deprecated_positional_args):
            if name in kwargs:
                raise TypeError(f"plan() got multiple values for argument {name!r}")
            kwargs[name] = value
        self._plan_impl(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs)

    begin_forward = plan

    def _plan_impl(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                   pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None,
                   q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
                   rope_scale=None, rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None,
                   fixed_split_size=None, disable_split_kv=False, q_len_per_req=1):
        _ignored(block_tables=block_tables, seq_lens=seq_lens)
        if q_len_per_req not in (None, 1):
            raise ValueError(f"q_len_per_req={q_len_per_req!r}: multi-token decode (causal within each request) is "
                             "not in this reference; use BatchPrefillWithPagedKVCacheWrapper with causal=True")
        if isinstance(window_right, (bool, np.bool_)) or not isinstance(window_right, (int, np.integer)) or \
                window_right < -1:
            raise ValueError(f"window_right must be an int >= -1, got {window_right!r}")
        reqs = _paged_requests(None, indptr, indices, last_page_len, page_size,
                               names=("indptr", "indices", "last_page_len"))
        spec = _spec(pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
                     logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta)
        self._planned = _plan_of(reqs, spec, num_qo_heads, num_kv_heads, head_dim, None, page_size)

    _q_shape = "(batch_size, num_qo_heads, head_dim)"

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        """``out (batch, Hq, D)`` (or ``(out, lse (batch, Hq))``) of the planned batch;
        arguments as in `BatchPrefillWithPagedKVCacheWrapper.run`."""
        self._run_checks(args, kv_cache_sf, skip_softmax_threshold_scale_factor)
        if q_len_per_req not in (None, 1):
            raise ValueError(f"q_len_per_req={q_len_per_req!r}: multi-token decode is not in this reference")
        return self._paged_run(q, paged_kv_cache, q_scale, k_scale, v_scale, return_lse, window_left, sinks)

    def run_return_lse(self, q, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    def forward(self, q, paged_kv_cache, pos_encoding_mode="NONE", q_scale=None, k_scale=None, v_scale=None,
                window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """Deprecated in FlashInfer: sets these options on the plan (as FlashInfer does), then `run`."""
        self._plan().spec = _spec(pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q, paged_kv_cache, pos_encoding_mode="NONE", q_scale=None, k_scale=None,
                           v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                           rope_theta=None):
        """Deprecated in FlashInfer: `forward` returning ``(out, lse)``."""
        self._plan().spec = _spec(pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)

    def assert_close(self, result, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
                     window_left=None, sinks=None, kv_cache_sf=None, skip_softmax_threshold_scale_factor=None,
                     **check):
        """Assert a kernel's ``run`` result (``out (batch, Hq, D)`` or ``(out, lse (batch, Hq))``)
        for this plan and the same ``run`` arguments is this wrapper's `run` (see
        `BatchPrefillWithPagedKVCacheWrapper.assert_close`)."""
        self._run_checks(args, kv_cache_sf, skip_softmax_threshold_scale_factor)
        plan, kc, vc, spec = self._bind(q, paged_kv_cache, window_left)
        s = None if sinks is None else _sinks(sinks, plan.hq, False)
        _judge(result, q, kc, vc, plan.reqs, spec, hk=plan.hk, check=check, return_lse_shape="batch_decode",
               sinks=s, scalar_q=_factor(q_scale, "q_scale"), scalar_k=_factor(k_scale, "k_scale"),
               scalar_v=_factor(v_scale, "v_scale"))


__all__ = ["single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse", "single_decode_with_kv_cache", "BatchPrefillWithPagedKVCacheWrapper",
           "BatchPrefillWithRaggedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper",
           "assert_single_prefill_close", "assert_single_decode_close", "get_alibi_slopes", "rope_llama",
           "unpack_mask_bits"]
