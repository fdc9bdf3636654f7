"""PyTorch's attention entry points, computed exactly in float64.

``from attnlib.compat.pytorch import scaled_dot_product_attention, flex_attention`` in place of
``torch.nn.functional.scaled_dot_product_attention`` and
``torch.nn.attention.flex_attention.flex_attention``: the same signatures and defaults (torch
2.13), the same layout ``(N, ..., H, L, E)`` and the same results (``out``; ``(out, lse)``;
``(out, AuxOutput)``), the values float64 tensors of the caller's kind (torch on its device, or
numpy).  Each has an ``assert_..._close(result, <the same arguments>, **check)`` twin judging a
kernel's result with attnlib's rule (`attnlib.testing.assert_attention_close`; ``**check`` its
keywords: ``dtype``, ``dout``/``dq``/``dk``/``dv``, ``names``, ``device``).  Conventions:
`docs/semantics.md`, "Drop-in references".

>>> import numpy as np
>>> q, k, v = (np.random.default_rng(i).standard_normal((1, 2, 3, 16)) for i in range(3))
>>> out = scaled_dot_product_attention(q, k, v, is_causal=True)
>>> out.shape
(1, 2, 3, 16)
>>> assert_sdpa_close(out, q, k, v, is_causal=True)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..core import validate
from . import _common as C

#: check_kernel keywords the twins derive from the peer's own arguments (not to be given again).
_SDPA_SET = ("layout", "causal", "causal_align", "scale", "mask_mod", "score_mod", "block_mask",
             "score_mod_grad")
_FLEX_SET = ("layout", "causal", "causal_align", "scale", "mask_mod", "score_mod", "block_mask",
             "lse", "max_scores", "lse_base", "lse_empty")
_GRADS = ("dq", "dk", "dv")


# ----------------------------------------------------------------------------- arguments

def _tensor(x, name: str):
    """``x`` as given (a torch tensor) or as an ndarray, checked to hold real floats."""
    if C.is_torch(x):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
        return x
    arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    if not (arr.dtype.kind == "f" or arr.dtype.name.startswith(("bfloat16", "float8"))):
        raise TypeError(f"{name} must hold real floats, got {arr.dtype}")
    return arr


def _shape(x) -> tuple:
    return tuple(int(n) for n in x.shape)


def _expand(x, shape):
    """``x`` broadcast to ``shape``: a view in its own kind (no copy)."""
    if _shape(x) == tuple(shape):
        return x
    return x.expand(*shape) if C.is_torch(x) else np.broadcast_to(x, shape)


def _repeat_heads(x, g: int):
    """Each head of ``x (..., H, S, D)`` ``g`` times in turn (``repeat_interleave``)."""
    if g == 1:
        return x
    return x.repeat_interleave(g, dim=-3) if C.is_torch(x) else np.repeat(x, g, axis=-3)


def _reshape(x, shape):
    return x.reshape(shape) if C.is_torch(x) else np.reshape(x, shape)


def _broadcast(shapes, what: str) -> tuple:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(f"{what} do not broadcast: " + ", ".join(str(s) for s in shapes)) from None


def _mask_kind(attn_mask):
    """``"bool"`` or ``"float"``: SDPA's two kinds of ``attn_mask``; a TypeError otherwise."""
    if C.is_torch(attn_mask):
        import torch
        if attn_mask.dtype == torch.bool:
            return "bool"
        if attn_mask.is_floating_point():
            return "float"
        dtype = attn_mask.dtype
    else:
        dtype = np.asarray(attn_mask).dtype
        if dtype == np.bool_:
            return "bool"
        if dtype.kind == "f" or dtype.name.startswith(("bfloat16", "float8")):
            return "float"
    raise TypeError(f"attn_mask must be boolean (True: takes part) or floating (added to the scores), "
                    f"got {dtype}")


@dataclass
class _Call:
    """One call's arguments as attnlib takes them: ``q, k, v`` (broadcast views, layout
    ``(..., H, S, D)``), the batch axes ``lead``, the query heads, the options of `attention`,
    and whether an input was broadcast (``expanded``: its gradient is then not the view's)."""

    q: object
    k: object
    v: object
    lead: tuple
    heads: int
    options: dict = field(default_factory=dict)
    grad_mods: dict = field(default_factory=dict)
    expanded: bool = False


def _sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> _Call:
    """SDPA's arguments checked as torch checks them, laid out for `attnlib.attention`."""
    q, k, v = (_tensor(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    is_causal, enable_gqa = validate.flag(is_causal, "is_causal"), validate.flag(enable_gqa, "enable_gqa")
    p = C.scalar(dropout_p, "dropout_p", default=0.0)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1], got {dropout_p!r}")
    if p > 0:
        raise ValueError(f"dropout_p={dropout_p!r}: dropout is random, and the float64 reference is exact "
                         "attention without it (dropout_p=0.0)")
    scale = C.scalar(scale, "scale")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask with is_causal=True: an explicit attn_mask should not be set when "
                         "is_causal=True (as torch refuses); give the causal mask inside attn_mask")
    if min(q.ndim, k.ndim, v.ndim) < 2:
        raise ValueError(f"query, key and value must be at least 2-D (..., L, E), got {q.ndim}-D, "
                         f"{k.ndim}-D and {v.ndim}-D")
    (L, E), (S, Ek), (Sv, _) = (_shape(x)[-2:] for x in (q, k, v))
    if Ek != E:
        raise ValueError(f"query and key must have the same embedding dim E, got {E} and {Ek}")
    if Sv != S:
        raise ValueError(f"key and value must have the same sequence length S, got {S} and {Sv}")
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    if enable_gqa and min(q.ndim, k.ndim, v.ndim) >= 3:
        # torch: key and value repeat_interleave'd to query's heads, then the batch axes broadcast
        hq, hk, hv = qs[-3], ks[-3], vs[-3]
        if hk == 0 or hv == 0 or hq % hk or hq % hv:
            raise ValueError(f"enable_gqa: the heads of key ({hk}) and value ({hv}) must divide the heads of "
                             f"query ({hq})")
        if hk != hv:  # attnlib's groups need one head count: both repeated to query's
            k, v = _repeat_heads(k, hq // hk), _repeat_heads(v, hq // hv)
            hk = hq
        lead = _broadcast([qs[:-3], ks[:-3], vs[:-3]], "the batch dims of query, key and value")
        heads, kv_heads = hq, hk
    else:
        # torch's matmuls: every axis before (L, E) broadcasts, the heads' too (no GQA)
        if not enable_gqa and q.ndim >= 3 and k.ndim >= 3 and qs[-3] != ks[-3] and 1 not in (qs[-3], ks[-3]):
            raise ValueError(f"query has {qs[-3]} heads and key {ks[-3]}: without enable_gqa=True they must "
                             "be equal (or broadcast)")
        batch = _broadcast([qs[:-2], ks[:-2], vs[:-2]], "the batch dims (N, ..., H) of query, key and value")
        if not batch:  # 2-D: one head
            lead, heads, kv_heads = (), None, None
        else:
            lead, heads = batch[:-1], batch[-1]
            kv_heads = _broadcast([ks[-3:-2], vs[-3:-2]], "the heads of key and value")
            kv_heads = kv_heads[0] if kv_heads else 1
            kv_heads = 1 if kv_heads == 1 else heads  # one kv head: attnlib's MQA, no copy
    if heads is not None:
        q = _expand(q, lead + (heads, L, E))
        k, v = _expand(k, lead + (kv_heads, S, E)), _expand(v, lead + (kv_heads, S, vs[-1]))
    expanded = (_shape(q), _shape(k), _shape(v)) != (qs, ks, vs)
    options = dict(scale=scale)
    if is_causal:
        options.update(causal=True, causal_align="top_left")
    grad_mods = {}
    if attn_mask is not None:
        kind = _mask_kind(attn_mask)
        grid = _shape(q)[:-1] + (S,)  # (N, ..., Hq, L, S)
        mask_shape = _shape(attn_mask) if hasattr(attn_mask, "shape") else np.shape(attn_mask)
        if len(mask_shape) > len(grid):
            raise ValueError(f"attn_mask of shape {mask_shape} does not broadcast to "
                             f"(N, ..., Hq, L, S) = {grid}")
        from ..core.flex import tensor_mods
        mods = tensor_mods(**{("attn_mask" if kind == "bool" else "attn_bias"): attn_mask},
                           batch=lead, heads=heads or 1, sq=L, sk=S)
        grad_mods = {n: mods.pop(n) for n in ("score_mod_grad",) if n in mods}
        options.update(mods)
    return _Call(q, k, v, lead, heads or 1, options, grad_mods, expanded)


# ----------------------------------------------------------------------------- SDPA

def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``, exact in float64.

    ``softmax(scale * q k^T + mask) v`` with the conventions of torch's math backend.

    Parameters
    ----------
    query : array, shape ``(N, ..., Hq, L, E)``
    key : array, shape ``(N, ..., H, S, E)``
    value : array, shape ``(N, ..., H, S, Ev)``
        torch tensors (any device, any floating type, read exactly) or numpy arrays; at least
        2-D.  The axes before ``(L, E)`` broadcast as in torch's matmuls (batch axes of size 1
        or missing, and without ``enable_gqa`` a head axis of size 1): such an input is
        expanded, a view (which attnlib's kernel copies once into a contiguous array).
    attn_mask : array, optional
        Boolean (True: the pair takes part) or floating (added to the scores after the scale;
        ``-inf`` masks), broadcastable to ``(N, ..., Hq, L, S)``; read exactly (any floating
        type: torch also takes one of another type than ``query``).
    dropout_p : float
        Must be 0.0: dropout is random (a ValueError otherwise).
    is_causal : bool
        Top-left causal: query ``i`` sees keys ``j <= i`` (``ones(L, S).tril()``; with
        ``L > S`` the last rows see every key).  Not with ``attn_mask``.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool
        Query head ``h`` reads key/value head ``h // (Hq // H)`` (torch's
        ``repeat_interleave``); without it the heads must be equal (or one of them 1).

    Returns
    -------
    array, shape ``(N, ..., Hq, L, Ev)``
        float64, a torch tensor on the inputs' device or a numpy array.  A row with no key
        taking part is 0 (the math backend's ``_safe_softmax``).

    Raises
    ------
    ValueError
        ``dropout_p > 0``, ``attn_mask`` with ``is_causal``, shapes that do not broadcast or
        heads that do not divide, a float mask holding NaN or ``+inf``.
    TypeError
        Non-floating inputs, a mask neither boolean nor floating, a flag not a bool.
    """
    from ..core.tiled import attention
    call = _sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return attention(call.q, call.k, call.v, **call.options)


def _flat(x, lead: tuple, what: str, want=None):
    """``x (*lead, ...)`` with its batch axes ``lead`` in one (check_kernel takes 4-D)."""
    if x is None or len(lead) < 2:
        return x
    shape = _shape(x)
    if want is not None and shape != tuple(want):
        raise ValueError(f"{what} has shape {shape}, expected {tuple(want)}")
    if shape[:len(lead)] != lead:
        raise ValueError(f"{what} has shape {shape}: its batch dims must be {lead}")
    return _reshape(x, (math.prod(lead),) + shape[len(lead):])


def assert_sdpa_close(out, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                      scale=None, enable_gqa=False, **check):
    """Assert that a kernel's ``out`` is `scaled_dot_product_attention` of these arguments,
    to within what a correct kernel in its precision differs by.

    Parameters
    ----------
    out : array, shape ``(N, ..., Hq, L, Ev)``
        The kernel's output.
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        The kernel's SDPA arguments, as in `scaled_dot_product_attention`.
    **check
        Further keywords of `attnlib.testing.assert_attention_close`: ``dtype``, ``device``,
        ``dout`` with ``dq``/``dk``/``dv`` (gradients of the SDPA inputs' shapes; not with
        inputs that broadcast), ``names``, ``workers``, ``lse`` ``(N, ..., Hq, L)``...
        Not those SDPA's arguments give: ``layout``, ``causal``, ``scale``, the mods.

    Notes
    -----
    Judged by `attnlib.testing.assert_attention_close` with ``layout="bhsd"``: batch axes
    beyond one are folded into one (a view where possible), broadcast inputs expanded, and the
    mask given as `attnlib.tensor_mods` (its derivative too, for the gradients).

    Raises
    ------
    AssertionError
        The verdict, when the kernel's result is not close.
    ValueError, TypeError
        Arguments SDPA refuses (as `scaled_dot_product_attention`), a keyword given twice,
        gradients of broadcast inputs, a wrongly shaped ``out``.
    """
    C.no_own_keywords(check, _SDPA_SET, "scaled_dot_product_attention")
    call = _sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if call.expanded and any(check.get(n) is not None for n in _GRADS):
        raise ValueError("dq, dk, dv are judged for query, key and value of the output's batch dims and "
                         "heads: these inputs broadcast (their gradients are sums over the broadcast "
                         "axes); expand them before the kernel to judge the gradients")
    lead = call.lead
    ev = _shape(call.v)[-1]
    out_shape = _shape(call.q)[:-1] + (ev,)
    check = dict(check)
    for n, like in (("dout", out_shape), ("dq", _shape(call.q)), ("dk", _shape(call.k)), ("dv", _shape(call.v)),
                    ("lse", out_shape[:-1]), ("max_scores", out_shape[:-1])):
        if check.get(n) is not None:
            check[n] = _flat(check[n], lead, n, like)
    q, k, v = (_flat(x, lead, n) for x, n in ((call.q, "query"), (call.k, "key"), (call.v, "value")))
    C.assert_close(_flat(out, lead, "out", out_shape), q, k, v, layout="bhsd", **call.options,
                   **call.grad_mods, **check)


# ----------------------------------------------------------------------------- FlexAttention

def _block_mask_geometry(block_mask):
    """``(B, H, Sq, Sk)`` of a FlexAttention or attnlib block mask (None: a TypeError)."""
    from ..core.flex import BlockMask
    if isinstance(block_mask, BlockMask):
        return block_mask.kinds.shape[0], block_mask.kinds.shape[1], block_mask.sq, block_mask.sk
    kind = type(block_mask)
    if not (kind.__name__ == "BlockMask" and kind.__module__.startswith("torch")):
        raise TypeError(f"block_mask must be a BlockMask (torch.nn.attention.flex_attention.create_block_mask, "
                        f"or attnlib.create_block_mask), got {kind.__name__}")
    counts = block_mask.kv_num_blocks
    sq, sk = (int(n) for n in block_mask.seq_lengths)
    return int(counts.shape[0]), int(counts.shape[1]), sq, sk


def _aux_request(return_aux):
    if return_aux is None:
        return None
    from torch.nn.attention.flex_attention import AuxRequest
    if not isinstance(return_aux, AuxRequest):
        raise TypeError(f"return_aux must be a torch.nn.attention.flex_attention.AuxRequest or None, "
                        f"got {type(return_aux).__name__}")
    return return_aux


def _flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
               return_aux) -> _Call:
    """FlexAttention's arguments checked as torch checks them, laid out for `attnlib.attention`."""
    q, k, v = (_tensor(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    enable_gqa, return_lse = validate.flag(enable_gqa, "enable_gqa"), validate.flag(return_lse, "return_lse")
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict (FlexKernelOptions) or None, got "
                        f"{type(kernel_options).__name__}")
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable (score, b, h, q_idx, kv_idx) -> score, got "
                        f"{type(score_mod).__name__}")
    scale = C.scalar(scale, "scale")
    if return_lse and return_aux is not None:
        raise ValueError("Cannot specify both return_lse and return_aux. return_lse is deprecated, please "
                         "use return_aux=AuxRequest(lse=True) instead.")
    _aux_request(return_aux)
    if (q.ndim, k.ndim, v.ndim) != (4, 4, 4):
        raise ValueError(f"query, key and value must be 4-D (B, H, L, E) as FlexAttention requires, got "
                         f"{q.ndim}-D, {k.ndim}-D and {v.ndim}-D")
    (bq, hq, L, E), (bk, hk, S, Ek), (bv, hv, Sv, _) = _shape(q), _shape(k), _shape(v)
    if Ek != E:
        raise ValueError(f"query and key must have the same embedding dim E, got {E} and {Ek}")
    if (bv, hv, Sv) != (bk, hk, S):
        raise ValueError(f"key (B, H, S) = {(bk, hk, S)} and value {(bv, hv, Sv)} must agree")
    if not enable_gqa and hq != hk:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={hq} and "
                         f"Hkv={hk}. Try setting enable_gqa=True for GQA.")
    if enable_gqa and (hk == 0 or hq % hk):
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but got Hq={hq} "
                         f"and Hkv={hk}.")
    geometry = None if block_mask is None else _block_mask_geometry(block_mask)
    if bq != bk:
        if geometry is None:
            raise ValueError(f"Expect query and key/value to have the same batch size, or non-none block_mask, "
                             f"but got block_mask=None, Bq={bq}, and Bkv={bk}.")
        if geometry[0] != bq:
            raise ValueError(f"Expect query and key/value to have the same batch size, or block_mask and query "
                             f"to have the same batch size, but got Bq={bq}, Bkv={bk}, B_block_mask={geometry[0]}.")
        if bk != 1:
            raise ValueError(f"Bq and Bkv must broadcast (Bkv = 1). Got Bq={bq} and Bkv={bk}")
    mods = {}
    if geometry is not None:
        nb, nh, sq, sk = geometry
        if (sq, sk) != (L, S):
            raise ValueError(f"block_mask was created for (q_len, kv_len) = {(sq, sk)} but got q_len={L} and "
                             f"kv_len={S}: create a block mask of these lengths")
        if nb not in (1, bq) or nh not in (1, hq):
            raise ValueError(f"block_mask has batch {nb} and heads {nh}: each must be 1 or the query's "
                             f"({bq}, {hq})")
        from ..core.flex import visible_mod
        # The mask FlexAttention's kernels compute with it (FULL blocks, PARTIAL ones where its
        # mask_mod holds), classified again by attnlib per batch entry and query head.
        mods["mask_mod"] = visible_mod(None, block_mask)
    if score_mod is not None:
        mods["score_mod"] = score_mod
    k, v = _expand(k, (bq,) + _shape(k)[1:]), _expand(v, (bq,) + _shape(v)[1:])
    return _Call(q, k, v, (bq,), hq, dict(scale=scale, **mods), {}, bk != bq)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """``torch.nn.attention.flex_attention.flex_attention``, exact in float64.

    ``softmax(score_mod(scale * q k^T))`` over the pairs ``block_mask`` keeps, times ``v``.

    Parameters
    ----------
    query : array, shape ``(B, Hq, L, E)``
    key : array, shape ``(Bkv, Hkv, S, E)``
    value : array, shape ``(Bkv, Hkv, S, Ev)``
        torch tensors (any device and floating type, read exactly) or numpy arrays.
        ``Bkv`` is ``B``, or 1 with a ``block_mask`` of batch ``B`` (keys shared by the batch).
    score_mod : callable ``(score, b, h, q_idx, kv_idx) -> score``, optional
        Applied to the scaled score; written with torch ops as for FlexAttention (attnlib
        calls it on whole tiles, see `docs/semantics.md`, "Programmable attention": it must
        be elementwise).  ``h`` is the query head.
    block_mask : BlockMask, optional
        From ``torch.nn.attention.flex_attention.create_block_mask`` (or attnlib's), of the
        lengths ``(L, S)``, batch 1 or ``B``, heads 1 or ``Hq``.  The pairs it keeps are those
        FlexAttention's fused kernels keep: its FULL blocks, and its PARTIAL blocks where its
        ``mask_mod`` holds (the eager path applies ``mask_mod`` everywhere: the same whenever
        the block lists are those of their ``mask_mod``, as ``create_block_mask`` makes them
        with the batch and heads the mask depends on).
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool
        Query head ``h`` reads kv head ``h // (Hq // Hkv)``; without it ``Hq == Hkv``.
    return_lse : bool
        Deprecated in torch (a ``FutureWarning``, as torch gives): return ``(out, lse)``.
    kernel_options : dict, optional
        Accepted and ignored: they tune FlexAttention's Triton kernels (performance only).
    return_aux : AuxRequest, optional
        ``torch.nn.attention.flex_attention.AuxRequest(lse=..., max_scores=...)``: return
        ``(out, AuxOutput(lse, max_scores))``, the fields not requested None.  Not with
        ``return_lse``.

    Returns
    -------
    out : array, shape ``(B, Hq, L, Ev)``
    lse : array, shape ``(B, Hq, L)``
        With ``return_lse``, or as ``AuxOutput.lse``: the natural log of each row's sum of
        ``exp`` of its kept scores; ``-inf`` for a row with none (whose ``out`` is 0).  None
        when it has no entry (as torch's).
    max_scores : array, shape ``(B, Hq, L)``
        ``AuxOutput.max_scores``: each row's largest kept score after ``score_mod`` (natural
        units; ``-inf`` for a row with none).  Computed on every device (torch refuses it on
        the CPU).

    All float64, torch tensors on the inputs' device or numpy arrays.

    Raises
    ------
    ValueError
        Where torch does (heads, batch sizes, a block mask of other lengths, ``return_lse``
        with ``return_aux``), and for inputs that are not 4-D.
    TypeError
        A ``return_aux`` that is no ``AuxRequest``, ``kernel_options`` that is no dict,
        non-floating inputs.
    """
    from ..core.tiled import attention
    call = _flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                      return_aux)
    if return_lse:
        warnings.warn("return_lse is deprecated and will be removed in v2.10. Please use "
                      "return_aux=AuxRequest(lse=True) instead.", FutureWarning, stacklevel=2)
    want_lse = return_lse or (return_aux is not None and bool(return_aux.lse))
    want_max = return_aux is not None and bool(return_aux.max_scores)
    result = attention(call.q, call.k, call.v, return_lse=want_lse, return_max_scores=want_max, **call.options)
    if return_aux is None and not return_lse:
        return result
    if not (want_lse or want_max):  # AuxRequest() asks for nothing: (out, AuxOutput(None, None))
        result = (result,)
    out, rest = result[0], list(result[1:])
    lse = rest.pop(0) if want_lse else None
    max_scores = rest.pop(0) if want_max else None
    empty = out.shape[0] * out.shape[1] * out.shape[2] == 0  # torch: None for a stat with no entry
    lse, max_scores = (None if empty else lse), (None if empty else max_scores)
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput
        return out, AuxOutput(lse=lse, max_scores=max_scores)
    return out, lse


def _describe(result) -> str:
    if isinstance(result, (tuple, list)):
        return f"a {type(result).__name__} of {len(result)}: " + ", ".join(type(x).__name__ for x in result)
    return f"a {type(result).__name__}"


def _torch_derivative(score_mod):
    """``d score_mod / d score`` by torch autograd, as attnlib's ``score_mod_grad``: called
    on numpy tiles (or tensors), returns the same kind."""

    def grad(s, b, h, q_idx, kv_idx):
        import torch
        numpy = not C.is_torch(s)
        dev = None if numpy else s.device
        args = [torch.as_tensor(np.asarray(x), device=dev) if not C.is_torch(x) else x for x in (b, h, q_idx, kv_idx)]
        st = torch.as_tensor(np.asarray(s, np.float64), device=dev) if numpy else s.detach().to(torch.float64)
        shape = torch.broadcast_shapes(st.shape, *(a.shape for a in args))
        st = st.expand(shape).clone().requires_grad_(True)  # one entry per output: no summed copies
        try:
            with torch.enable_grad():
                y = score_mod(st, *args)
                d = None if not y.requires_grad else \
                    torch.autograd.grad(y, st, torch.ones_like(y), allow_unused=True)[0]
        except Exception as e:  # noqa: BLE001 - named, and the way out given
            raise ValueError(f"score_mod's derivative by torch autograd failed ({type(e).__name__}: {e}); "
                             "pass score_mod_grad=(score, b, h, q_idx, kv_idx) -> d score_mod / d score") from e
        d = torch.zeros_like(st) if d is None else d
        return d.detach().cpu().numpy() if numpy else d.detach()

    return grad


def assert_flex_attention_close(result, query, key, value, score_mod=None, block_mask=None, scale=None,
                                enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None,
                                **check):
    """Assert that a kernel's result is `flex_attention` of these arguments, to within what
    a correct kernel in its precision differs by.

    Parameters
    ----------
    result
        What the kernel returned for these arguments: ``out``, ``(out, lse)`` with
        ``return_lse``, or ``(out, aux)`` with ``return_aux`` (an ``AuxOutput``: its requested
        ``lse`` and ``max_scores`` are judged too; natural log, ``-inf`` on rows that keep no
        pair, ``(B, Hq, L)``).
    query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options, return_aux
        The kernel's FlexAttention arguments, as in `flex_attention`.
    **check
        Further keywords of `attnlib.testing.assert_attention_close`: ``dtype``, ``device``,
        ``dout`` with ``dq``/``dk``/``dv``, ``score_mod_grad`` (default: ``score_mod``'s
        derivative by torch autograd, for the gradients), ``names``, ``lse_dtype``...  Not
        those FlexAttention's arguments and conventions give (``layout``, ``scale``, the mods,
        ``lse``, ``max_scores``, ``lse_base``, ``lse_empty``).

    Raises
    ------
    AssertionError
        The verdict, when the result is not close, or a result without what the call asks for
        (an ``lse`` or ``max_scores`` missing, a tuple where ``out`` alone is returned).
    ValueError, TypeError
        Arguments FlexAttention refuses (as `flex_attention`), a keyword given twice, ``dk``
        or ``dv`` of keys shared by the batch (``Bkv = 1 < B``).
    """
    C.no_own_keywords(check, _FLEX_SET, "flex_attention")
    call = _flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                      return_aux)
    if call.expanded and any(check.get(n) is not None for n in ("dk", "dv")):
        raise ValueError("dk and dv are judged for key and value of the query's batch: these are shared by the "
                         "batch (Bkv = 1), their gradients sums over it; expand them to judge the gradients")
    lse = max_scores = None
    empty = math.prod(_shape(call.q)[:3]) == 0
    if return_aux is not None:
        if not (isinstance(result, (tuple, list)) and len(result) == 2 and hasattr(result[1], "lse")
                and hasattr(result[1], "max_scores")):
            raise AssertionError("flex_attention(return_aux=...) returns (out, AuxOutput); the kernel returned "
                                 + _describe(result))
        out, aux = result
        for name, asked in (("lse", return_aux.lse), ("max_scores", return_aux.max_scores)):
            if asked and getattr(aux, name) is None and not empty:
                raise AssertionError(f"AuxRequest({name}=True) asks for AuxOutput.{name}; the kernel returned None")
        lse = aux.lse if return_aux.lse else None
        max_scores = aux.max_scores if return_aux.max_scores else None
    elif return_lse:
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise AssertionError("flex_attention(return_lse=True) returns (out, lse); the kernel returned "
                                 + _describe(result))
        out, lse = result
        if lse is None and not empty:
            raise AssertionError("flex_attention(return_lse=True) returns (out, lse); the kernel's lse is None")
        if hasattr(lse, "max_scores"):
            raise AssertionError("flex_attention(return_lse=True) returns (out, lse); the kernel returned "
                                 f"(out, {type(lse).__name__}) as for return_aux (pass the call's return_aux)")
    else:
        if isinstance(result, (tuple, list)):
            raise AssertionError("flex_attention returns out alone without return_lse/return_aux; the kernel "
                                 f"returned {_describe(result)} (pass the call's return_lse or return_aux)")
        out = result
    options = dict(call.options)
    if "mask_mod" in options:  # the block mask itself: the check finds its mask again
        options.pop("mask_mod")
        options["block_mask"] = block_mask
    if score_mod is not None and "score_mod_grad" not in check and any(check.get(n) is not None for n in _GRADS):
        check["score_mod_grad"] = _torch_derivative(score_mod)
    if lse is not None or max_scores is not None:
        options.update(lse_base="e", lse_empty="-inf")
    C.assert_close(out, call.q, call.k, call.v, layout="bhsd", lse=lse, max_scores=max_scores, **options, **check)


__all__ = ["scaled_dot_product_attention", "assert_sdpa_close", "flex_attention", "assert_flex_attention_close"]
