"""The pieces both backwards share (`attnlib.core.backward`'s dense reference and tiled kernel,
`attnlib.core.gradsizes`): their options, inputs read and checked, the gradients split back to
the inputs' layouts, and the power of two that keeps values near float64's range summable.
"""

from __future__ import annotations

import math

import numpy as np

from . import arrays, problem
from .backend import NUMPY
from .options import Options


def _options(scale, options: dict, entry: str):
    """``(Options, score_mod_grad)`` of a backward's keyword arguments: the forward's masking
    and score options (not a paged cache) and the derivative of its ``score_mod``."""
    opts, rest = Options.split(entry=entry, accept=("score_mod_grad",), scale=scale, **options)
    grad = rest.get("score_mod_grad")
    if opts.paged:
        raise ValueError("block_table and cache_seqlens cannot be given to the backward, which takes "
                         "contiguous keys: gather the pages first (attnlib.core.paged.gather_pages)")
    return opts, _score_mod_grad(grad, opts)


def _score_mod_grad(grad, opts: Options):
    """``score_mod_grad``, required with a ``score_mod`` (numpy has no autograd)."""
    if grad is not None and opts.score_mod is None:
        raise ValueError("score_mod_grad was given without a score_mod: it is the derivative of one")
    if opts.score_mod is not None and grad is None:
        raise ValueError("the backward of a score_mod needs its derivative: pass score_mod_grad(score, b, h, "
                         "q_idx, kv_idx) -> d score_mod / d score (numpy has no autograd)")
    if grad is not None and not callable(grad):
        raise TypeError(f"score_mod_grad must be callable, got {type(grad).__name__}")
    return grad


def _grad_inputs(pb, check_finite, xp=NUMPY, **given):
    """``out``/``dout`` ``(..., Hq, Sq, Dv)`` and ``lse`` ``(..., Hq, Sq)``, read as ``xp``'s
    arrays and checked, as grouped views ``(*batch, hk, g, sq[, dv])``."""
    heads = pb.batch + (pb.hq, pb.sq)
    grouped = pb.batch + (pb.hk, pb.group, pb.sq)
    result = []
    for name, x in given.items():
        tail = () if name in ("lse", "dlse") else (pb.dv,)
        x = xp.read(x, name)
        shape = (heads + tail)[1:] if pb.squeeze else heads + tail  # 2-D inputs: no head axis
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
        if check_finite and name == "lse":
            if any(xp.host_bools([(xp.isnan(x) | xp.isposinf(x)).any()])):
                raise ValueError("lse must be finite or -inf (rows without a visible key)")
        elif check_finite:
            xp.checked_max(x, name)
        result.append(x.reshape(grouped + tail))
    return result


def _split_grads(pb, dq5, dk4, dv4, dsink5=None, sinks=None):
    """Grouped ``(dq, dk, dv)`` back to the layout of q, k and v; and ``dsinks``, in the
    shape of the ``sinks`` given, when there are sinks."""
    dq = pb.merge_heads(dq5, 2)
    grads = (dq, dk4[0], dv4[0]) if pb.squeeze else (dq, dk4, dv4)
    if sinks is None:
        return grads
    # (*batch, hk, g) -> (*batch, Hq), summed over the batch axes the sinks broadcast over.
    dsink = dsink5.reshape(tuple(dsink5.shape[:-2]) + (pb.hq,))
    shape = np.shape(sinks)
    if dsink.ndim > len(shape):
        dsink = dsink.sum(tuple(range(dsink.ndim - len(shape))))
    return grads + (dsink.reshape(shape),)


def grad_exponent(pb, dout_max: float, vo_max: float, qk_max: float, dtype=np.float64, dlse_max: float = 0.0) -> int:
    """The power of two ``e >= 0`` that ``dout`` is divided by while the gradients are
    summed; they are linear in ``dout``, so ``2**e`` times the result is exact.

    ``dp = dout . v`` and ``D = dout . out`` reach ``Dv max|dout| max(|v|, |out|)``, which
    overflows for finite values near the range (``v = 1e308``); every gradient entry, and
    every partial sum of one, is within ``2 Dv max|dout| max(|v|, |out|) max(1, max(|q|,
    |k|) Sq g) max(1, |scale|)`` (``|ds_ij| <= 2 p_ij max|dp|``), kept below a quarter of
    the range.  0, every bit as before, for any ordinary input.  The maxima: ``max|dout|``,
    ``max(|v|, |out|)`` and ``max(|q|, |k|)``; ``dlse_max``: ``max|dlse|``, which ``dp - D + dlse``
    adds to what ``dout . v`` reaches (`attention_backward`'s ``dlse``).
    """
    # log2 of what a row's dp - D + dlse reaches: 2 (Dv + 1) max|dout| max(|v|, |out|) + max|dlse|
    terms = []
    if dout_max and vo_max and math.isfinite(dout_max) and math.isfinite(vo_max):
        terms.append(math.log2(2 * (pb.dv + 1)) + math.log2(dout_max) + math.log2(vo_max))
    if dlse_max and math.isfinite(dlse_max):
        terms.append(math.log2(dlse_max))
    if not terms:
        return 0
    # log2 of max(1, max(|q|, |k|) Sq g) max(1, |scale|): ds @ k and ds^T @ q are summed
    # before the scale multiplies them, so a tiny scale does not shrink their partial sums.
    spread = max(0.0, math.log2(abs(pb.scale))) if pb.scale else 0.0
    if qk_max and math.isfinite(qk_max):
        spread += max(0.0, math.log2(qk_max) + math.log2(pb.sq + 1) + math.log2(pb.group))
    return problem.range_exponent(float(np.logaddexp2.reduce(terms)) + spread, dtype)


def _grad_exponent(pb, dout5, values, q5, k5, xp=NUMPY, dtype=np.float64, dlse5=None) -> int:
    """`grad_exponent` of the grouped arrays; ``values``: ``v`` (and ``out``); ``dlse5``: ``dlse`` or None."""
    return grad_exponent(pb, xp.abs_max(dout5), max(xp.abs_max(x) for x in values),
                         max(pb.max_of("q", q5), pb.max_of("k", k5)), dtype,
                         0.0 if dlse5 is None else xp.abs_max(dlse5))


def _scaled_dout(dout, e: int) -> np.ndarray:
    """``dout / 2**e`` (a new array; the caller's is never modified)."""
    return NUMPY.ldexp(arrays.as_float_array(dout, "dout"), -e)


def _unscale_grads(result, e: int, names=("dq", "dk", "dv", "dsinks"), xp=NUMPY):
    """``result`` (gradients, or tuples of them) times ``2**e``; a ValueError naming the
    gradient whose entries then exceed float64's range (their true values do, up to the
    bound's factor of 4), rather than an inf.  A gradient already not finite stays as it is
    (see `attention_backward`)."""
    if isinstance(result, tuple) and result and isinstance(result[0], tuple):
        return tuple(_unscale_grads(r, e, names, xp) for r in result)
    grads = result if isinstance(result, tuple) else (result,)
    if any(g is None for g in grads):  # a part of the gradients (`dense_backward`'s rows, keys)
        at = [i for i, g in enumerate(grads) if g is not None]
        done = _unscale_grads(tuple(grads[i] for i in at), e, tuple(names[i] for i in at), xp)
        return tuple(done[at.index(i)] if i in at else None for i in range(len(grads)))
    scaled = [xp.ldexp(g, e) for g in grads]
    flags = xp.host_bools([xp.isfinite(x).all() for x in grads + tuple(scaled)])
    kept = []
    for g, s, ok, still, name in zip(grads, scaled, flags[:len(grads)], flags[len(grads):], names):
        if ok and not still:
            raise ValueError(f"{name} exceeds float64's range (dout times v, out, q and k, or dlse, reaches "
                             f"2**{e} times it): scale dout (or v, dlse) down")
        kept.append(s if ok else g)
    return tuple(kept) if isinstance(result, tuple) else kept[0]


def _head_dim(q) -> int:
    """q's head dim D (0 without q): where MLA's joined gradients split."""
    return 0 if q is None else (q.shape[-1] if hasattr(q, "shape") else np.shape(q)[-1])

