"""The dense reference in torch, on the tensors' own device: `attnlib.core.reference`'s
`_scores` and `_dense` step for step, in the same order and the same types.

The whole ``(..., Hq, Sq, Sk)`` score matrix, as on the host (its memory grows as
``Sq * Sk``); the mask is evaluated on the device with torch comparisons (`visible`), the
rules of `MaskSpec.visible`.  In float64 it agrees with the numpy reference to rounding;
``compute_dtype`` (float32, float16, bfloat16: the naive low-precision baseline) rounds
where the numpy reference rounds: the inputs, the float32 scores (after ALiBi, which the
host forms in float64), the weights ``p``, and ``out``.  A float64 value is rounded to
float16 in one step, as numpy does, not through float32 (`device.rounded`).

The programmable options (``mask_mod``, ``score_mod``, ``block_mask``) are called on the
whole grid of device index tensors (`attnlib.core.torch_flex`), as the host reference calls
them on its index arrays.  This module imports none of the host reference (`reference`
imports it lazily).
"""

from __future__ import annotations

import math

import numpy as np

from . import problem
from . import device as dev_mod
from . import flex, torch_flex
from .masks import MaskSpec

#: ``compute_dtype`` names -> torch's type of the name (float64: None, the exact path).
_COMPUTE = ("float32", "float16", "bfloat16", "float8_e4m3fn")


def compute_type(compute_dtype):
    """``(compute, p)``: the torch types ``compute_dtype`` rounds the inputs and scores to
    and ``p`` to (`problem.Precision.p_type`), ``(None, None)`` for float64, checked as the
    host checks it (`problem.precision`); torch's own dtypes are taken too.  bfloat16 and
    float8_e4m3fn need no ml_dtypes here."""
    torch = dev_mod._torch()
    if isinstance(compute_dtype, torch.dtype):
        name = str(compute_dtype).removeprefix("torch.")
        if name not in ("float64",) + _COMPUTE:
            raise ValueError("compute_dtype must be one of None, 'float64', 'float32', 'float16', "
                             f"'bfloat16', 'float8_e4m3fn', got {compute_dtype!r}")
    elif isinstance(compute_dtype, problem.Precision):  # internal: the extended precision
        if compute_dtype.is_float64:
            return None, None
        raise ValueError(f"compute_dtype {compute_dtype.name!r} is not computed on a torch device")
    elif compute_dtype in ("bfloat16", "float8_e4m3fn"):
        name = compute_dtype
    else:
        name = problem.precision(compute_dtype).name
    if name == "float64":
        return None, None
    if name == "float8_e4m3fn":  # FlashAttention 3's fp8 forward: bfloat16 but for p
        return torch.bfloat16, torch.float8_e4m3fn
    return getattr(torch, name), getattr(torch, name)


def round_to(x, dtype):
    """``x`` rounded to ``dtype`` once, as numpy's ``astype`` rounds it (`device.rounded`:
    float64 to float16 not through float32), held in float32."""
    return dev_mod.rounded(x, dtype).to(dev_mod._torch().float32)


def visible(specs, pb, dev, distances=False):
    """`reference.pair_terms`'s ``(visible, distance)`` on ``dev``: bool ``(sq, sk)``, or
    ``(*batch, 1, 1, sq, sk)`` when the mask depends on the batch entry, and with
    ``distances`` the ALiBi distances ``|i + o - j|`` in float64 laid out alike (else None)."""
    torch = dev_mod._torch()
    i = torch.arange(pb.sq, device=dev)[:, None]
    j = torch.arange(pb.sk, device=dev)[None, :]

    def rule(spec):  # the tiled kernel's rule, over the whole grid as one tile
        return dev_mod.index_tensor(spec.visible(np.arange(pb.sq), np.arange(pb.sk)), dev)

    def distance(spec):
        return (i + spec.offset - j).abs().to(torch.float64)

    def per_pair(fn):
        if () in specs:
            return fn(specs[()])
        if not specs:  # a zero-size batch axis: no entry, no pair
            return torch.zeros(pb.batch + (1, 1, pb.sq, pb.sk), dtype=fn(MaskSpec(pb.sq, pb.sk)).dtype, device=dev)
        grid = torch.stack([fn(spec) for spec in specs.values()])
        return grid.reshape(pb.batch + (1, 1, pb.sq, pb.sk))

    return per_pair(rule), per_pair(distance) if distances else None


def _scores(torch, q5, k5, pb, opts, np_dtype, dev, visible_, distance):
    """The scores ``(..., hk, g, sq, sk)``, ``-inf`` where invisible: `reference._scores`.
    In float32 (``np_dtype``) the ALiBi bias is formed in float64 and the scores become
    float64, as numpy's promotion makes them."""
    cap = problem.softcap_in(opts.softcap, np_dtype, "low-precision")
    slopes = problem.alibi_slopes(opts.alibi_slopes, pb, np_dtype)  # (..., hk, g)
    flex.check_elementwise(opts.mask_mod, opts.score_mod, pb.sq, pb.sk)
    mask_fn = torch_flex.on_device(flex.visible_mod(opts.mask_mod, opts.block_mask), "mask_mod", dev)
    score_fn = torch_flex.on_device(opts.score_mod, "score_mod", dev)
    if mask_fn is not None or score_fn is not None:  # (*batch, hk, g): each head's batch entry and query head
        _, (b, h) = torch_flex.grids(pb, (), dev)
    sel = opts.selection(pb)
    if sel is not None:  # top-k lists, ANDed: the dense mask, as the numpy reference's
        visible_ = visible_ & torch.as_tensor(sel.dense(pb.batch, pb.hk), device=dev)
    if mask_fn is not None:  # AND the built-in masks
        visible_ = visible_ & torch_flex.mask_values(mask_fn, b, h, 0, pb.sq, 0, pb.sk,
                                                     tuple(b.shape) + (pb.sq, pb.sk), dev)
    may_overflow = bool(q5.numel() and k5.numel()) and problem.scores_may_overflow(
        q5, k5, pb.scale, np_dtype, q_max=pb.maxima[0], k_max=pb.maxima[1])
    s = torch.matmul(q5, k5.transpose(-1, -2)) * float(np_dtype(pb.scale))
    if may_overflow and bool((~torch.isfinite(s) & visible_).any()):
        raise ValueError(problem.overflow_message(np_dtype))
    if cap is not None:  # s / cap beyond the range: tanh(+-inf) = +-1, exact
        c = float(np_dtype(cap))
        s = torch.tanh(s / c) * c
    if score_fn is not None:  # after the softcap, before the masks
        s = torch_flex.score_values(score_fn, s.expand(tuple(b.shape) + tuple(s.shape[-2:])), b, h,
                                    0, pb.sq, 0, pb.sk, dev)
    s = s.masked_fill(~visible_, -math.inf)
    if score_fn is not None and bool((torch.isnan(s) | torch.isposinf(s)).any()):
        raise ValueError("score_mod returned NaN or +inf for a visible pair; it must return finite "
                         "scores, or -inf to mask")
    if slopes is not None:  # after masking: -inf stays -inf
        slope = torch.as_tensor(slopes.astype(np_dtype).astype(np.float64), device=dev)[..., None, None]
        biased = s.to(torch.float64) - slope * distance
        if may_overflow and bool((torch.isfinite(s) & ~torch.isfinite(biased)).any()):
            raise ValueError(problem.overflow_message(np_dtype))
        s = biased
    return s


def _dense(torch, q5, k5, v5, pb, opts, dev, low=None, p_low=None, softmax_first=False):
    """`reference._dense`: ``(out, lse, max_scores)`` in the caller's layout.  ``low``: the torch
    compute type of the naive low-precision baseline (q5, k5, v5 already rounded to it and
    held in float32), or None for float64; ``p_low``: the type ``p`` is rounded to."""
    np_dtype = np.float64 if low is None else np.float32
    dtype = torch.float64 if low is None else torch.float32
    sink = problem.sinks(opts.sinks, pb, np_dtype)  # (..., hk, g) or None
    vis, distance = visible(opts.specs(pb), pb, dev, distances=opts.alibi_slopes is not None)
    s = _scores(torch, q5, k5, pb, opts, np_dtype, dev, vis, distance)
    if low is not None:
        s = round_to(s, low)  # a naive kernel stores its scores in the compute type
    if pb.sk:
        m = s.amax(dim=-1, keepdim=True)  # -inf for rows with no visible key
    else:
        m = torch.full(s.shape[:-1] + (1,), -math.inf, dtype=dtype, device=dev)
    maxes = m[..., 0]  # the keys' largest score: max_scores (the sink is no key's)
    if sink is not None:  # one more logit per row, with no value: the max over both
        sink = torch.as_tensor(sink.astype(np_dtype), device=dev)[..., None, None]
        m = torch.maximum(m, sink)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))  # masked pairs: exp(-inf) = 0
    l = p.sum(dim=-1, keepdim=True)  # >= 1 where the row sees a key, else 0
    if sink is not None:
        l = l + torch.exp(sink - m)  # the sink's weight joins the denominator only
    seen = l > 0
    v_max = pb.maxima[2]
    e = problem.value_exponent(v_max, pb.sk, np_dtype)  # values near the range: summed / 2**e
    v_scaled = v5.to(dtype) if not e else v5.to(dtype) * math.ldexp(1.0, -e)  # exact: a power of two
    if softmax_first:  # the weights normalised, then rounded, then summed: softmax(s) @ v
        p = torch.where(seen, p / torch.where(seen, l, 1.0), 0.0)
        out = torch.matmul(p if low is None else round_to(p, p_low or low), v_scaled)
    else:
        out = torch.matmul(p if low is None else round_to(p, p_low or low), v_scaled)
        out = torch.where(seen, out / torch.where(seen, l, 1.0), 0.0)
    if e:  # `problem.unscale_values`
        bound = math.ldexp(v_max, -e)
        out = out.clamp(-bound, bound) * math.ldexp(1.0, e)
    lse = torch.where(seen, torch.log(torch.where(seen, l, 1.0)), -math.inf) + m
    return pb.merge_heads(out, 2), pb.merge_heads(lse[..., 0], 1), pb.merge_heads(maxes.to(lse.dtype), 1)


def _check_representable(torch, low, pb_inputs):
    """`problem.check_representable` on the device: ValueError naming the first input whose
    extremes round to inf in ``low`` (one host synchronisation for the three)."""
    ext = torch.stack([dev_mod._extremes(x) for _, x in pb_inputs])  # (3, 2): max, min; float64
    rounded = round_to(ext, low)
    bad = np.asarray(torch.isinf(rounded).any(dim=-1).cpu())
    if not bad.any():
        return
    r = int(np.flatnonzero(bad)[0])
    name, ext = pb_inputs[r][0], np.asarray(ext[r].cpu())
    kind = str(low).removeprefix("torch.")
    raise ValueError(
        f"{name} holds {float(ext[np.argmax(np.abs(ext))]):.4g}, beyond "
        f"{kind}'s range (largest finite {float(torch.finfo(low).max):.5g}): "
        f"rounded to {kind} it is inf; scale {name} down or compute in a wider type")


def dense_attention(q, k, v, opts, *, dev, return_lse=False, check_finite=True, compute_dtype=None,
                    return_max_scores=False, softmax_first=False):
    """`reference.dense_attention` computed with torch on ``dev``: torch tensors out
    (float64, or ``out`` in the compute type and ``lse`` in float32 for a low one)."""
    torch = dev_mod._torch()
    q5, k5, v5, pb = dev_mod.parse(q, k, v, scale=opts.scale, check_finite_inputs=check_finite, dev=dev)
    low, p_low = compute_type(compute_dtype)
    with torch.no_grad():
        if low is None:
            f64 = torch.float64
            out, lse, maxes = _dense(torch, q5.to(f64), k5.to(f64), v5.to(f64), pb, opts, dev)
        else:
            _check_representable(torch, low, (("q", q5), ("k", k5), ("v", v5)))
            out, lse, maxes = _dense(torch, round_to(q5, low), round_to(k5, low), round_to(v5, low), pb, opts,
                                     dev, low, p_low, softmax_first)
            out = out.to(low)
    result = (out,) + ((lse,) if return_lse else ()) + ((maxes,) if return_max_scores else ())
    return result[0] if len(result) == 1 else result
