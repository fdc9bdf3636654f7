"""FlashInfer's conventions shared by `attnlib.compat.flashinfer`'s calls: its ALiBi slopes,
RoPE, packed masks, the requests of a batch, and the one path each takes into attnlib (the
reference, `_attend`, and the assert twins, `_judge`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _common as C
from .vllm import _padded

LAYOUTS = ("NHD", "HND")
MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
_OWN = ("layout", "causal", "window", "softcap", "scale", "kv_lengths", "q_lengths", "mask_mod", "score_mod",
        "lse", "lse_base", "lse_empty", "sinks", "q_descale", "k_descale", "v_descale", "block_table",
        "cache_seqlens", "cu_seqlens_q", "cu_seqlens_k", "seqused_k")


# ---------------------------------------------------------------------------------------------
# FlashInfer's definitions


def get_alibi_slopes(n_heads: int, device=None):
    """FlashInfer's ALiBi slopes (``flashinfer/utils.py``), the float32 values its kernels use,
    as float64: ``2^(-8k/n)`` for the ``n`` (a power of two) first heads, then the odd powers of
    ``2^(-4/n)``.  A torch tensor (on ``device``) when torch is installed, else numpy."""
    if isinstance(n_heads, (bool, np.bool_)) or not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    n_heads = int(n_heads)
    n = 2 ** math.floor(math.log2(n_heads))
    m_0, m_hat_0 = 2.0 ** (-8.0 / n), 2.0 ** (-4.0 / n)
    try:
        import torch
    except ImportError:  # numpy's float32 pow (FlashInfer computes with torch's)
        m = np.power(np.float32(m_0), np.arange(1, 1 + n, dtype=np.float32))
        if n < n_heads:
            m = np.concatenate([m, np.power(np.float32(m_hat_0), np.arange(1, 1 + 2 * (n_heads - n), 2,
                                                                             dtype=np.float32))])
        return m.astype(np.float64)
    m = torch.pow(m_0, torch.arange(1, 1 + n, device=device))
    if n < n_heads:
        m = torch.cat([m, torch.pow(m_hat_0, torch.arange(1, 1 + 2 * (n_heads - n), 2, device=device))])
    return m.float().double()


def rope_llama(x, positions, rope_scale: float = 1.0, rope_theta: float = 1e4, *, kernel: bool = False):
    """FlashInfer's ``ROPE_LLAMA`` of ``x (..., S, D)`` at ``positions (S,)``, in float64:
    non-interleaved halves over the whole head dim, ``x_i cos(a_i) - x_{i+D/2} sin(a_i)`` for
    ``i < D/2`` and ``x_i cos(a_i) + x_{i-D/2} sin(a_i)`` after, with ``a_i = pos (1/rope_scale)
    (1/rope_theta)^(2 (i mod D/2) / D)`` (``pos_enc.cuh`` ``vec_apply_llama_rope``,
    ``prefill.cuh`` ``compute_rope_freq``).  A float64 copy in ``x``'s kind.  ``kernel``: as
    FlashInfer's kernels compute it, in float32 (the frequency, the angle ``pos * freq`` and its
    cosine and sine rounded to float32, each output ``x cos + r sin`` one fused rounding of a
    float32 product and sum), which at long positions differs from the exact rotation by far more
    than float32's rounding of the result (the angle's own rounding, ``pos * freq * 2**-24``)."""
    x = C.float64(x, "x")
    d = int(x.shape[-1])
    if d % 2:
        raise ValueError(f"ROPE_LLAMA rotates halves of the head dim, which must be even; got {d}")
    half = d // 2
    i = np.arange(d)
    if kernel:
        f32 = np.float32
        freq = f32(1.0 / rope_scale) * np.power(f32(1.0 / rope_theta), (2 * (i % half)).astype(f32) / f32(d))
        angle = (np.asarray(positions).astype(f32)[:, None] * freq[None, :]).astype(np.float64)
        cos, sin = (np.float32(fn(angle)).astype(np.float64) for fn in (np.cos, np.sin))
    else:
        freq = (1.0 / rope_scale) * (1.0 / rope_theta) ** (2.0 * (i % half) / d)
        angle = np.asarray(positions, np.float64)[:, None] * freq[None, :]
        cos, sin = np.cos(angle), np.sin(angle)
    if C.is_torch(x):
        import torch
        cos, sin = (torch.as_tensor(a, device=x.device) for a in (cos, sin))
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    else:
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    if not kernel:
        return x * cos + rotated * sin

    def f32(t):  # rounded to float32, held in float64, in t's kind
        return t.float().double() if C.is_torch(t) else t.astype(np.float32).astype(np.float64)

    x, rotated = f32(x), f32(rotated)
    return f32(x * cos + f32(rotated * sin))  # fma(x, cos, fl(r sin)): x cos is exact in float64


def unpack_mask_bits(packed, nbits: int, name: str = "packed_custom_mask", offset: int = 0) -> np.ndarray:
    """Bits ``[0, nbits)`` of the byte segment starting at byte ``offset`` of a packed mask,
    little-endian bit order (bit ``o % 8`` of byte ``o // 8``), as a host bool array."""
    data = np.asarray(C.as_host(packed))
    if data.dtype != np.uint8 or data.ndim != 1:
        raise TypeError(f"{name} must be a 1-D uint8 tensor (flashinfer.packbits/segment_packbits, "
                        f"bitorder='little'), got {data.dtype} of shape {data.shape}")
    need = -(-nbits // 8)
    if offset + need > data.size:
        raise ValueError(f"{name} has {data.size} bytes; this request needs bytes [{offset}, {offset + need})")
    return np.unpackbits(data[offset:offset + need], bitorder="little")[:nbits].astype(bool)


# ---------------------------------------------------------------------------------------------
# Arguments


@dataclass(frozen=True)
class _Spec:
    """The attention options of a call, checked (FlashInfer's names)."""
    causal: bool = False
    window_left: int = -1
    sm_scale: float | None = None
    soft_cap: float = 0.0
    mode: str = "NONE"
    rope_scale: float = 1.0
    rope_theta: float = 1e4

    def scale_for(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self.sm_scale is None else self.sm_scale


def _spec(*, causal=False, pos_encoding_mode="NONE", sm_scale=None, window_left=-1, logits_soft_cap=None,
          rope_scale=None, rope_theta=None, use_fp16_qk_reduction=False) -> _Spec:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if pos_encoding_mode not in MODES:
        raise ValueError(f"pos_encoding_mode must be one of {MODES}, got {pos_encoding_mode!r}")
    if not isinstance(use_fp16_qk_reduction, (bool, np.bool_)):
        raise TypeError(f"use_fp16_qk_reduction must be a bool, got {use_fp16_qk_reduction!r}")
    cap = C.scalar(logits_soft_cap, "logits_soft_cap", default=0.0, positive=True)
    scale = C.scalar(sm_scale, "sm_scale")
    rs = C.scalar(rope_scale, "rope_scale", default=1.0)
    rt = C.scalar(rope_theta, "rope_theta", default=1e4)
    if rs == 0 or rt <= 0:
        raise ValueError(f"rope_scale must be nonzero and rope_theta positive, got {rope_scale!r}, {rope_theta!r}")
    return _Spec(bool(causal), _window_left(window_left), scale, cap, pos_encoding_mode, rs, rt)


def _window_left(w) -> int:
    if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
        raise TypeError(f"window_left must be an int (-1: no window), got {w!r}")
    if w < -1:
        raise ValueError(f"window_left must be -1 (no window) or >= 0 (keys left of the diagonal), got {w}")
    return int(w)


def _layout(kv_layout) -> str:
    if kv_layout not in LAYOUTS:
        raise ValueError(f"kv_layout must be one of {LAYOUTS}, got {kv_layout!r}")
    return kv_layout


def _factor(x, name: str):
    """A scalar calibration scale (float, or a one-element tensor) as a float, or None."""
    if x is None:
        return None
    if hasattr(x, "shape"):
        a = C.as_host(x)
        if a.size != 1:
            raise ValueError(f"{name} must be a scalar (a float or a one-element tensor), got shape {a.shape}")
        x = float(np.asarray(a, np.float64).reshape(()))
    return C.scalar(x, name)


def _per_head(x, name: str, heads: int):
    if x is None:
        return None
    a = np.asarray(C.as_host(x), np.float64)
    if a.shape != (heads,):
        raise ValueError(f"{name} must have shape ({heads},) (one factor per head), got {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite")
    return a


def _no(name: str, value, why: str):
    if value is not None and value is not False:
        raise ValueError(f"{name}={_short(value)}: {why}")


def _short(x):
    return f"<{type(x).__name__} of shape {tuple(x.shape)}>" if hasattr(x, "shape") else repr(x)


def _shape(x, name: str, ndim: int, what: str):
    if x is None or not hasattr(x, "shape") or len(x.shape) != ndim:
        raise ValueError(f"{name} must be {what}, got {_short(x) if x is not None else None}")


def _heads(hq: int, hk: int):
    if hk == 0 or hq % hk:
        raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hk})")


def _indptr(x, name: str) -> np.ndarray:
    a = C.ints(x, name)
    if a is None or a.ndim != 1 or a.size < 1 or a[0] != 0 or (np.diff(a) < 0).any():
        raise ValueError(f"{name} must be 1-D offsets from 0, never decreasing, got "
                         f"{None if a is None else a.tolist()}")
    return a


def _bool_mask(mask, name: str) -> np.ndarray:
    m = np.array(C.as_host(mask))  # a copy: FlashInfer packs the mask at plan time
    if m.dtype != np.bool_:
        raise TypeError(f"{name} must be a boolean tensor (True: the pair takes part), got {m.dtype}")
    return m


@dataclass
class _Request:
    q0: int            # its query rows [q0, q1)
    q1: int
    kv_len: int
    pages: np.ndarray | None = None   # paged: its pages, in order
    k0: int = 0                       # contiguous keys: its first row
    mask: np.ndarray | None = None    # (qo_len, kv_len) bool, True keeps

    @property
    def qo_len(self):
        return self.q1 - self.q0


def _masks(reqs, custom_mask, packed_custom_mask, single=False):
    """Each request's ``(qo_len, kv_len)`` mask from FlashInfer's flattened ``custom_mask`` or
    its little-endian ``packed_custom_mask`` (one byte-aligned segment per request, as
    ``segment_packbits`` makes; it wins when both are given, as in FlashInfer)."""
    if packed_custom_mask is not None:
        offset = 0
        for r in reqs:
            n = r.qo_len * r.kv_len
            r.mask = unpack_mask_bits(packed_custom_mask, n, offset=offset).reshape(r.qo_len, r.kv_len)
            offset += -(-n // 8)
    elif custom_mask is not None:
        m = _bool_mask(custom_mask, "custom_mask")
        total = sum(r.qo_len * r.kv_len for r in reqs)
        if single and m.ndim == 2 and m.shape != (reqs[0].qo_len, reqs[0].kv_len):
            raise ValueError(f"custom_mask must be (qo_len, kv_len) = ({reqs[0].qo_len}, {reqs[0].kv_len}), "
                             f"got {m.shape}")
        if m.size != total:
            raise ValueError(f"custom_mask has {m.size} entries; the requests' qo_len * kv_len sum to {total} "
                             "(each request's mask row-major, concatenated)")
        flat, offset = m.reshape(-1), 0
        for r in reqs:
            n = r.qo_len * r.kv_len
            r.mask = flat[offset:offset + n].reshape(r.qo_len, r.kv_len)
            offset += n


def _unpack_cache(paged_kv_cache, kv_layout: str):
    """``(k_cache, v_cache)`` of a paged cache (a pair of 4-D tensors, or one 5-D tensor with K
    at ``[:, 0]`` and V at ``[:, 1]``; page_size 1 may drop its axis), as NHD views
    ``(num_pages, page_size, Hk, D)``."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache must be (k_cache, v_cache), got {len(paged_kv_cache)} tensors")
        k, v = paged_kv_cache
        k, v = (_expand(x, 3, n, kv_layout) for x, n in ((k, "k_cache"), (v, "v_cache")))
    elif hasattr(paged_kv_cache, "shape"):
        kv = _expand(paged_kv_cache, 4, "paged_kv_cache", kv_layout)
        if kv.shape[1] != 2:
            raise ValueError(f"a one-tensor paged_kv_cache is (num_pages, 2, ...), K then V; got shape "
                             f"{tuple(kv.shape)}")
        k, v = kv[:, 0], kv[:, 1]
    else:
        raise TypeError(f"paged_kv_cache must be a tensor or a (k_cache, v_cache) pair, got {type(paged_kv_cache)}")
    if kv_layout == "HND":
        k, v = C.swap(k, 1, 2), C.swap(v, 1, 2)
    if tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise ValueError(f"the K and V caches must have the same pages, page size and heads, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)} (NHD)")
    return k, v


def _expand(x, short: int, name: str, kv_layout: str):
    if not hasattr(x, "shape") or len(x.shape) not in (short, short + 1):
        raise ValueError(f"{name} must be {short + 1}-D ({kv_layout}), got {_short(x)}")
    if len(x.shape) == short + 1:
        return x
    axis = -3 if kv_layout == "NHD" else -2  # page_size 1
    return x.unsqueeze(axis) if C.is_torch(x) else np.expand_dims(x, axis)


# ---------------------------------------------------------------------------------------------
# The computation


def _alibi_mod(slopes: np.ndarray, soft_cap: float, sm_scale: float):
    """FlashInfer's ALiBi logits transform as a ``score_mod`` of attnlib's ``s = sm_scale q.k``:
    ``s + slope_h (kv_idx - q_idx)``, and with a soft cap its kernel's
    ``cap tanh((s + slope_h (kv_idx - q_idx)) sm_scale / cap)`` (variants.cuh: the biased logit
    is scaled by ``sm_scale`` once more before the tanh)."""
    cache = {}

    def mod(s, b, h, q_idx, kv_idx):
        if C.is_torch(s):  # on a torch device: torch operations where the tensors are
            import torch
            key = (s.device, s.dtype)
            if key not in cache:
                cache[key] = torch.as_tensor(slopes, dtype=s.dtype, device=s.device)
            x = s + cache[key][h] * (kv_idx - q_idx).to(s.dtype)
            return soft_cap * torch.tanh(x * (sm_scale / soft_cap)) if soft_cap else x
        x = s + slopes[np.asarray(h)] * (np.asarray(kv_idx) - np.asarray(q_idx))
        return soft_cap * np.tanh(x * (sm_scale / soft_cap)) if soft_cap else x
    return mod


def _request_keys(r: _Request, kc, vc):
    """The request's keys and values ``(kv_len, Hk, D)`` in the cache's own type (a copy of its
    pages, or views of its rows)."""
    if r.pages is None:
        return kc[r.k0:r.k0 + r.kv_len], vc[r.k0:r.k0 + r.kv_len]
    k, v = C.index(kc, r.pages), C.index(vc, r.pages)
    return (k.reshape((-1,) + tuple(kc.shape[2:]))[:r.kv_len], v.reshape((-1,) + tuple(vc.shape[2:]))[:r.kv_len])


def _rope_positions(r: _Request, spec: _Spec):
    """``(q positions, k positions)`` of ROPE_LLAMA: q at ``q_idx + kv_len - qo_len``, k at ``kv_idx``."""
    if r.kv_len == 0:  # no key: every row is 0, lse -inf, whatever the rotation
        return np.zeros(r.qo_len, np.int64), np.zeros(0, np.int64)
    if r.kv_len < r.qo_len and not (spec.causal and r.mask is None) and r.qo_len > 1:
        raise ValueError(f"ROPE_LLAMA with kv_len ({r.kv_len}) < qo_len ({r.qo_len}) without causal: "
                         "FlashInfer's query positions q_idx + kv_len - qo_len go negative in its unsigned "
                         "arithmetic (they wrap); not reproduced")
    return np.arange(r.qo_len) + (r.kv_len - r.qo_len), np.arange(r.kv_len)


def _options(spec: _Spec, unmasked: bool, sinks) -> dict:
    """attnlib's options of FlashInfer's causal (unless a custom mask overrides it), window, soft
    cap (ALiBi's is in its ``score_mod``) and sinks."""
    opts = {"causal": spec.causal and unmasked}
    if spec.window_left >= 0:
        opts["window"] = (spec.window_left, None)
    if spec.soft_cap and spec.mode != "ALIBI":
        opts["softcap"] = spec.soft_cap
    if sinks is not None:
        opts["sinks"] = sinks
    return opts


def _attend(q, kc, vc, reqs, spec: _Spec, *, hk: int, sinks=None, q_factor=None, out_factor=None):
    """``(out (total_q, Hq, Dv), lse (total_q, Hq) base 2)`` float64 of the requests; ``kc``/``vc``
    NHD pages ``(P, page_size, Hk, D)`` or rows ``(N, Hk, D)``; ``q_factor``/``out_factor``:
    per query head (fp8 scales)."""
    from ..core.flex import tensor_mods
    from ..core.tiled import attention

    hq, d = int(q.shape[1]), int(q.shape[-1])
    dv = int(vc.shape[-1])
    sm_scale = spec.scale_for(d)
    slopes = None if spec.mode != "ALIBI" else np.asarray(C.as_host(get_alibi_slopes(hq)), np.float64)
    outs, lses = [], []
    for r in reqs:
        if r.qo_len == 0:
            continue
        qb = C.swap(q[r.q0:r.q1], 0, 1)  # (Hq, qo, D)
        if q_factor is not None:
            qb = C.float64(qb, "q") * _like(q_factor[:, None, None], qb)
        opts = dict(scale=sm_scale, return_lse=True, lse_base=2, **_options(spec, r.mask is None, sinks))
        if r.pages is not None and r.mask is None and spec.mode == "NONE":
            # attnlib's paged path: the request's pages read in place
            out, lse = attention(qb[None], kc, vc, block_table=r.pages[None], cache_seqlens=np.array([r.kv_len]),
                                 **opts)
            out, lse = out[0], lse[0]
        else:
            k, v = _request_keys(r, kc, vc)
            kb, vb = C.swap(k, 0, 1), C.swap(v, 0, 1)  # (Hk, kv, D)
            if spec.mode == "ROPE_LLAMA":
                pq, pk = _rope_positions(r, spec)
                qb = rope_llama(qb, pq, spec.rope_scale, spec.rope_theta)
                kb = rope_llama(kb, pk, spec.rope_scale, spec.rope_theta)
            if r.mask is not None:
                opts["mask_mod"] = tensor_mods(attn_mask=r.mask, heads=hq, sq=r.qo_len, sk=r.kv_len)["mask_mod"]
            if slopes is not None:
                opts["score_mod"] = _alibi_mod(slopes, spec.soft_cap, sm_scale)
            out, lse = attention(qb, kb, vb, **opts)
        outs.append(C.swap(out, 0, 1))      # (qo, Hq, Dv)
        lses.append(C.swap(lse, 0, 1))      # (qo, Hq)
    if not outs:
        return C.zeros_like(q, (0, hq, dv)), C.zeros_like(q, (0, hq))
    out, lse = C.concat(outs, outs[0]), C.concat(lses, lses[0])
    if out_factor is not None:
        out = out * _like(out_factor[:, None], out)
    return out, lse


def _like(a: np.ndarray, x):
    if C.is_torch(x):
        import torch
        return torch.as_tensor(a, dtype=torch.float64, device=x.device)
    return a


def _finish(out, lse, v_scale, return_lse, sinks):
    if v_scale is not None and v_scale != 1.0:
        out = out * v_scale
    return (out, lse) if return_lse else out


def _sinks(sinks, hq: int, return_lse: bool):
    if sinks is None:
        return None
    s = np.asarray(C.as_host(sinks), np.float64)
    if s.shape != (hq,):
        raise ValueError(f"sinks must have shape (num_qo_heads,) = ({hq},), got {s.shape}")
    return s


# ---------------------------------------------------------------------------------------------
# The assert twins' common path


def _stack(parts, lens, like_shape_tail, like):
    """Per-request arrays ``(len_i, ...)`` padded with zeros into ``(B, max len, ...)`` in the
    type and kind of ``like`` (or of the parts)."""
    longest = int(max(lens, default=0))
    src = parts[0] if parts else like
    if C.is_torch(src):
        import torch
        full = torch.zeros((len(lens), longest) + tuple(like_shape_tail), dtype=src.dtype, device=src.device)
    else:
        full = np.zeros((len(lens), longest) + tuple(like_shape_tail), dtype=np.asarray(src).dtype)
    for b, (x, n) in enumerate(zip(parts, lens)):
        full[b, :n] = x
    return full


def _judge(result, q, kc, vc, reqs, spec: _Spec, *, hk: int, check: dict, return_lse_shape: str,
           sinks=None, q_scale_heads=None, k_scale_heads=None, v_scale_heads=None, scalar_q=None,
           scalar_k=None, scalar_v=None, return_lse=False):
    """Judge a kernel's ``result`` (``out`` or ``(out, lse)`` in FlashInfer's layout) against the
    requests' attention: the requests padded into a batch (their keys gathered, rotated in
    float64 for ROPE_LLAMA), their masks and ALiBi as mods, FlashInfer's LSE convention."""
    from ..core.flex import tensor_mods

    C.no_own_keywords(check, _OWN, "FlashInfer's call")
    out, lse = C.result_lse(result, "result")
    if return_lse and lse is None:
        raise AssertionError("the call asked for the LSE (return_lse=True) and the result holds none")
    hq, d = int(q.shape[1]), int(q.shape[-1])
    dv = int(vc.shape[-1])
    total = int(q.shape[0])
    want_out = (hq, dv) if return_lse_shape == "single" else (total, hq, dv)
    if out is None or not hasattr(out, "shape") or tuple(out.shape) != want_out:
        raise AssertionError(f"out has shape {tuple(getattr(out, 'shape', ()))}; FlashInfer's is {want_out}")
    out = out.reshape(total, hq, dv)
    if lse is not None:
        want = {"single": (hq,), "batch_decode": (total, hq), "tokens": (total, hq)}[return_lse_shape]
        if tuple(lse.shape) != want:
            raise AssertionError(f"lse has shape {tuple(lse.shape)}; FlashInfer's is {want} (token-major, "
                                 "base 2)")
        lse = None if spec.mode == "ROPE_LLAMA" else lse.reshape(total, hq)  # RoPE: its shape checked, not its
        # values (the kernel's rotated inputs round where the check's cannot: the contract says why)
    qo = np.array([r.qo_len for r in reqs], np.int64)
    kv = np.array([r.kv_len for r in reqs], np.int64)
    starts = np.array([r.q0 for r in reqs], np.int64)
    if (starts != np.concatenate([[0], np.cumsum(qo)[:-1]])).any() or int(qo.sum()) != total:
        raise ValueError("the requests' query rows must tile q in order")
    sm_scale = spec.scale_for(d) * (scalar_q or 1.0) * (scalar_k or 1.0)
    qs, ks, vs = [], [], []
    rotated = spec.mode == "ROPE_LLAMA"
    if rotated and (check.get("dtype") or C.dtype_name(q)) in ("float32", "float64"):
        raise ValueError("ROPE_LLAMA with a float32 kernel: FlashInfer's rotation (float32 angles, the GPU's "
                         "fast sine and cosine) differs from any exact one by more than float32 attention's "
                         "rounding at long positions; rotate q and k yourself and judge with "
                         "attnlib.testing.assert_attention_close")
    for r in reqs:
        qb = q[r.q0:r.q1]
        k, v = _request_keys(r, kc, vc)
        if rotated:
            pq, pk = _rope_positions(r, spec)
            qb = C.swap(rope_llama(C.swap(qb, 0, 1), pq, spec.rope_scale, spec.rope_theta, kernel=True), 0, 1)
            k = C.swap(rope_llama(C.swap(k, 0, 1), pk, spec.rope_scale, spec.rope_theta, kernel=True), 0, 1)
        qs.append(qb), ks.append(k), vs.append(v)
    q_pad = _stack(qs, qo, (hq, d), q if not rotated else C.float64(q[:0], "q"))
    k_pad = _stack(ks, kv, tuple(kc.shape[-2:]), kc if not rotated else C.float64(kc[:0], "k"))
    v_pad = _stack(vs, kv, tuple(vc.shape[-2:]), vc)
    out_pad = _padded(out, qo)
    opts = dict(layout="bshd", scale=sm_scale, q_lengths=qo, kv_lengths=kv)
    if "dtype" not in check:
        opts["dtype"] = C.dtype_name(q)
    opts.update(_options(spec, all(r.mask is None for r in reqs), sinks))  # a custom mask overrides causal
    mods = {}
    if any(r.mask is not None for r in reqs):
        full = np.zeros((len(reqs), int(qo.max(initial=0)), int(kv.max(initial=0))), bool)
        for b, r in enumerate(reqs):
            full[b, :r.qo_len, :r.kv_len] = r.mask
        mods["mask_mod"] = tensor_mods(attn_mask=full[:, None], batch=(len(reqs),), heads=hq, sq=full.shape[1],
                                       sk=full.shape[2])["mask_mod"]
    if spec.mode == "ALIBI":
        slopes = np.asarray(C.as_host(get_alibi_slopes(hq)), np.float64)
        mods["score_mod"] = _alibi_mod(slopes, spec.soft_cap, sm_scale)
    descales = _descales(hq, hk, q_scale_heads, k_scale_heads, v_scale_heads, scalar_v, len(reqs))
    if lse is not None:
        lse_pad = _padded(lse, qo)  # (B, max qo, Hq)
        if C.is_torch(lse_pad):
            import torch
            valid = torch.as_tensor(np.arange(lse_pad.shape[1])[None, :] < qo[:, None], device=lse_pad.device)
            lse_pad = torch.where(valid[..., None], lse_pad, torch.full((), -math.inf, dtype=lse_pad.dtype,
                                                                        device=lse_pad.device))
        else:
            lse_pad = np.where((np.arange(lse_pad.shape[1])[None, :] < qo[:, None])[..., None], lse_pad, -np.inf)
        opts.update(lse=C.swap(lse_pad, 1, 2), lse_base=2, lse_empty="-inf")
    C.assert_close(out_pad, q_pad, k_pad, v_pad, **opts, **mods, **descales, **check)


def _descales(hq, hk, q_heads, k_heads, v_heads, scalar_v, batch):
    """check_kernel's ``(batch, Hk)`` descales of FlashInfer's per-head fp8 scales and ``v_scale``."""
    if q_heads is None and k_heads is None and v_heads is None and scalar_v in (None, 1.0):
        return {}
    g = hq // hk
    out = {}
    if q_heads is not None:
        grouped = q_heads.reshape(hk, g)
        if (grouped != grouped[:, :1]).any():
            raise ValueError("scale_q differs within a kv head's group of query heads: the check takes one "
                             "q descale per kv head (FlashAttention 3's); not judged")
        out["q_descale"] = np.broadcast_to(grouped[:, 0], (batch, hk)).copy()
    if k_heads is not None:
        out["k_descale"] = np.broadcast_to(k_heads, (batch, hk)).copy()
    v = np.ones(hk) if v_heads is None else v_heads
    if scalar_v is not None:
        v = v * scalar_v
    if v_heads is not None or scalar_v not in (None, 1.0):
        if (v <= 0).any():
            raise ValueError("v_scale/scale_v must be positive to be judged as descales")
        out["v_descale"] = np.broadcast_to(v, (batch, hk)).copy()
    return out
