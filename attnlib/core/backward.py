"""Gradients of attention: the dense reference and the tiled FlashAttention-2 backward.

With ``P = softmax(S)`` row by row and ``out = P V``, for an upstream gradient ``dout``::

    dV = P^T dout
    dP = dout V^T
    dS = P * (dP - D),   D_i = sum_j P_ij dP_ij = dout_i . out_i     (softmax Jacobian)
    dT = dS * (1 - tanh(T / c)**2)        with softcap S = c tanh(T / c), else dT = dS
    dQ = scale * dT K,   dK = scale * dT^T Q

where ``T = scale * Q K^T`` are the raw scores.  Masked pairs have ``P = 0`` and so no
gradient; ALiBi is a constant bias and has none of its own.  With GQA, ``dK`` and ``dV``
sum over the query heads that share a kv head.

With attention sinks the softmax runs over ``[S_i, sink_h]`` with a value of 0 for the
sink, so ``dP_sink = 0``, ``D_i`` is unchanged, ``P`` above is already normalised with the
sink in its denominator (through ``lse``), and the sink's own gradient is::

    dsink_h = sum_{b, i} P_sink_i (0 - D_i) = -sum_{b, i} exp(sink_h - lse_i) D_i
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

from . import mla, problem, validate, flex, hooks
from .masks import PARTIAL, SKIP
from .options import Options
from .reference import _scores
from .tilesizes import DEFAULT_TILES
from .backend import NUMPY, backend_for
from .parallel import Turns, _unit_of, run_tiles
from .tiled import attention, prepare
from .gradparts import (_grad_exponent, _grad_inputs, _options, _scaled_dout, _score_mod_grad,  # noqa: F401
                        _split_grads, _unscale_grads, grad_exponent)
from . import device as dev_mod


#: The naive same-precision backward's formulations (``compute_dtype`` below float64).
FORMULATIONS = ("math", "eager", "flash", "sequential")
#: The "sequential" formulation's most slices of a sum: one key (or query) per step up to
#: this many, beyond it slices of a few summed by BLAS inside (a bounded cost).
SEQUENTIAL_STEPS = 1024


def reference_attention_backward(q, k, v, dout, *, scale=None, return_abs=False,
                                 return_rss=False, rss_accumulate=1.0, rss_scores=0.0, check_finite=True,
                                 compute_dtype=None, formulation="math", qv=None, **options):
    """Dense float64 gradients ``(dq, dk, dv)`` of `reference_attention` for ``dout``.

    Parameters
    ----------
    q, k, v : array_like
        As in `reference_attention`.
    dout : array_like, shape ``(..., Hq, Sq, Dv)``
        Gradient of the loss with respect to the output.
    scale, causal, causal_align, window, kv_lengths, q_lengths, q_segment_ids,
    kv_segment_ids, softcap, alibi_slopes, sinks
        As in `attention`.
    return_abs : bool
        Also return the sizes of what each gradient entry sums, for the error metric
        (`attnlib.gradient_errors`): the same formulas with ``|dout|, |q|, |k|, |v|`` and
        ``|dp| + |D|`` in place of ``dp - D``.
    return_rss : bool or "dot"
        Also return each gradient entry's root-sum-square size, ``sqrt(sum_j t_j**2)`` over
        the terms ``t_j`` it sums (``dv``: ``p dout``; ``dq``, ``dk``: ``scale p (|dp| +
        D1) k`` and ``q`` with ``D1 = sum_j |p dp|``, the size of ``D``'s terms, whose
        rounding ``ds`` carries; ``dsinks``: ``p_sink D1``): the size of the independent rounding
        errors of a sum (Higham & Mary 2019), which cancellation does not shrink the way
        it shrinks the entry itself.  Computed in float64.
    rss_accumulate : float
        With ``return_rss``: how much the componentwise size of the dot products ``dp`` and
        ``D`` (``|dout| . |v|``, which bounds their summation error, where ``|dp|`` may
        cancel) adds to ``ds``'s size, in units of the stored type's epsilon: the
        accumulator's epsilon over the stored type's (1 for float32 and float64; ``2**-16``
        for 16-bit values summed in float32).  ``return_rss="dot"``: that part alone (with
        ``rss_accumulate=1``), for a bound that weighs the dot products' rounding apart.
    rss_scores : float
        With ``return_rss``: how much the scores' rounding adds, in units of the stored
        type's epsilon (the accumulator's epsilon over the stored type's, as
        ``rss_accumulate``; 0: nothing).  A score off by ``ds_ij`` (a few ulps of the row's
        score size ``S_i = sigma_i + |lse_i|``, ``sigma_i = max_j |scale| sum_c |q_ic k_jc|``)
        moves ``p_ij`` by ``p_ij ds_ij``: each term of ``dv`` gets ``S_i p_ij dout_i`` more
        size and each of ``ds`` ``S_i p_ij (|dp_ij| + D1_i)``; and ``D1_i`` holds
        ``sqrt(sum_c (dout_ic out_ic)**2)``, the rounding of ``D_i = dout_i . out_i`` from the
        output as a kernel stored it (FlashAttention's, PyTorch's flash backward: without it
        their bfloat16 ``dq`` failed at logits of standard deviation 10, ratio 2.3).
    compute_dtype : {None, "float64", "float32", "float16", "bfloat16"}
        The naive same-precision baseline of FlashAttention's gradient tests: inputs rounded
        to it, every matmul accumulated in float32, the softmax in float32, and some
        intermediates rounded to it, by ``formulation``.
    formulation : {"math", "eager", "flash", "sequential"}
        Below float64, which intermediates are rounded: ``"math"`` is PyTorch's eager
        autograd (``s``, ``p``, ``dp``, ``ds`` and each head's ``dq``, ``dk``, ``dv``
        rounded; ``D = rowsum(p * dp)``); ``"eager"`` is the same with the scores formed as
        ``(q k^T) * scale`` (Hugging Face's eager attention), so ``scale * ds`` is rounded
        before its matmuls (in float16's subnormal range, below 6.1e-5, that rounding is
        what a small ``dout`` costs); ``"flash"`` is FlashAttention's backward (``s``,
        ``dp`` and ``D`` in float32, ``p`` and ``ds`` rounded before their matmuls,
        ``D = dout . out`` with ``out`` rounded to the type and summed one column after
        another, a GQA group's ``dk``, ``dv`` summed in float32 and rounded once);
        ``"sequential"`` is ``"math"`` with
        ``D = rowsum(p * dp)`` and every matmul summed one key (or query) after another in
        float32, as a kernel that accumulates tile by tile does (up to `SEQUENTIAL_STEPS`
        steps), rather than in BLAS's blocked order.

    Returns
    -------
    grads : ``(dq, dk, dv)``, shaped like ``q``, ``k`` and ``v`` (float64, or
        ``compute_dtype``), and ``dsinks`` shaped like ``sinks`` when sinks are given
    sizes : ``(dq_abs, dk_abs, dv_abs[, dsinks_abs])``, if ``return_abs``
    rss : ``(dq_rss, dk_rss, dv_rss[, dsinks_rss])``, if ``return_rss``

    Notes
    -----
    Materialises ``P`` and ``dS`` of shape ``(..., Hq, Sq, Sk)``: the softmax Jacobian
    written out (see the module docstring).  Rows with no visible key have ``P = 0`` and
    contribute nothing.
    """
    if qv is not None:  # MLA: the joined problem's gradients, split back
        if return_abs or return_rss:
            raise ValueError("return_abs and return_rss are not split for qv; leave them out")
        joined_q, joined_k, _ = mla.inputs(q, k, v, qv)
        return mla.split(reference_attention_backward(
            joined_q, joined_k, v, dout, scale=scale, check_finite=check_finite, compute_dtype=compute_dtype,
            formulation=formulation, **options), _head_dim(q), q is not None)
    opts, mod_grad = _options(scale, options, "reference_attention_backward")
    return dense_backward(q, k, v, dout, opts, mod_grad, return_abs=return_abs, return_rss=return_rss,
                          rss_accumulate=rss_accumulate, rss_scores=rss_scores, check_finite=check_finite,
                          compute_dtype=compute_dtype, formulation=formulation)


def dense_backward(q, k, v, dout, opts: Options, mod_grad=None, *, return_abs=False, return_rss=False,
                   rss_accumulate=1.0, rss_scores=0.0, check_finite=True, compute_dtype=None,
                   formulation="math", rows=None, keys=None, stats=None):
    """`reference_attention_backward` with its options parsed into ``opts`` (and ``mod_grad``
    the ``score_mod_grad``).  ``formulation``: one of `FORMULATIONS`, or a tuple of them for a
    list of their gradients (those that round the same scores share them).

    A part of the gradients (the check's naive baselines on a sample, `attnlib.check.naive`), the
    pairs of query positions ``rows`` and key positions ``keys`` (None: all): without ``stats``,
    ``dq`` on ``rows``, each row's softmax from its own scores (``keys`` must hold every key the rows
    see); with ``stats = (lse, out)``, the forward's ``(..., Hq, Sq)`` and ``(..., Hq, Sq, Dv)``
    (float64), ``dk`` and ``dv`` on ``keys`` (``rows`` must hold every row that sees them) with ``p =
    exp(s - lse)`` and ``D_i`` from ``out`` in the formulation's arithmetic (``lse`` and ``out`` as a
    kernel stores them), and ``dsinks`` when ``rows`` is None.  The others are None."""
    several = not isinstance(formulation, str)
    formulations = tuple(formulation) if several else (formulation,)
    for f in formulations:
        if f not in FORMULATIONS:
            raise ValueError(f"formulation must be one of {FORMULATIONS}, got {f!r}")
    part = rows is not None or keys is not None or stats is not None
    if part and (return_abs or return_rss or (stats is None and rows is None)):
        raise ValueError("rows= (and keys=) give dq on rows, keys= with stats= dk and dv on keys: a part of "
                         "the gradients, without their sizes")
    prec = problem.precision(compute_dtype)
    if prec.p_type is not None:
        raise ValueError(f"compute_dtype={prec.name!r} has no backward: FlashAttention 3's fp8 path "
                         "is forward only; judge fp8 gradients as bfloat16")
    if several and (return_abs or return_rss or prec.is_float64):
        raise ValueError("several formulations are those of a lower compute_dtype, without sizes")
    q5, k5, v5, pb = problem.parse(q, k, v, scale=opts.scale, check_finite_inputs=check_finite)
    (dout5,) = _grad_inputs(pb, check_finite, dout=dout)
    if not part:  # (a part: the check's sample, where an overflowing formulation is left out)
        problem.check_representable(prec, q=q5, k=k5, v=v5, dout=dout5)
    e = _grad_exponent(pb, dout5, (v5,), q5, k5) if prec.is_float64 else 0
    if e:  # values near float64's range: dout / 2**e, the gradients times 2**e
        return _unscale_grads(dense_backward(
            q, k, v, _scaled_dout(dout, e), opts, mod_grad, return_abs=return_abs, return_rss=return_rss,
            rss_accumulate=rss_accumulate, rss_scores=rss_scores, check_finite=check_finite,
            compute_dtype=compute_dtype, formulation=formulation), e)
    # float64: rnd is the identity.  Lower: values are rounded where a same-precision
    # implementation stores them, and everything else is float32.
    dtype = prec.accumulate.type
    rnd = (lambda x: x) if prec.is_float64 else prec.round  # noqa: E731
    i_at = np.arange(pb.sq) if rows is None else np.asarray(rows)
    j_at = np.arange(pb.sk) if keys is None else np.asarray(keys)
    if rows is not None:
        q5, dout5 = q5[..., i_at, :], dout5[..., i_at, :]
    if keys is not None:
        k5, v5 = k5[..., j_at, :], v5[..., j_at, :]
    q5, k5, v5, dout5 = (rnd(x).astype(dtype) for x in (q5, k5, v5, dout5))
    sinks = opts.sinks
    sink = problem.sinks(sinks, pb, dtype)  # (..., hk, g) or None
    scores = _scores(q5, k5, pb, opts, dtype, rows=rows, cols=keys)  # (..., hk, g, sq, sk), -inf where invisible
    if sink is not None:
        sink = sink.astype(dtype)[..., None, None]  # (..., hk, g, 1, 1)
    if stats is not None:  # the rows' lse as the forward stored it: p = exp(s - lse)
        lse, out5 = (np.asarray(x, dtype=np.float64).reshape(pb.batch + (pb.hk, pb.group) + np.shape(x)[-1 - t:])
                     for t, x in enumerate(stats))
        if rows is not None:
            lse, out5 = lse[..., i_at], out5[..., i_at, :]
        lse = lse.astype(dtype)[..., None]  # (..., hk, g, sq, 1)

    def softmax(s):
        """``(p, p_sink, lse)`` of the scores ``s`` as kept (``lse`` 0 on rows with no key)."""
        if stats is not None:
            with np.errstate(over="ignore"):  # -inf rows (no key): shifted by 0, p = 0
                p = rnd(np.exp(s - np.where(np.isfinite(lse), lse, 0.0)))
                return p, None if sink is None else np.exp(sink - np.where(np.isfinite(lse), lse, 0.0)), lse
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        if sink is not None:  # the softmax over [s_i, sink]: the sink column is one more logit
            m = np.maximum(m, sink)
        with np.errstate(over="ignore"):  # s - m below -max (scores of +-1e308) is -inf: p = 0, exact
            p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
        l = p.sum(axis=-1, keepdims=True)
        p_sink = None
        if sink is not None:
            with np.errstate(over="ignore"):  # sink - m below -max: weight exactly 0
                w_sink = np.exp(sink - m)  # (..., hk, g, sq, 1)
            l = l + w_sink
            p_sink = w_sink / l  # l >= 1: the sink's share of each row
        row_lse = np.where(l > 0, np.where(np.isfinite(m), m, 0.0) + np.log(np.where(l > 0, l, 1.0)), 0.0)
        return rnd(np.divide(p, l, out=np.zeros_like(p), where=l > 0)), p_sink, row_lse  # P, 0 on rows with no key

    cap = opts.softcap
    t = None
    if cap is not None or mod_grad is not None:
        # Only visible pairs matter (ds is 0 elsewhere).  A masked pair's product may
        # overflow (the scores above refuse a visible one's), so it is taken as 0; a huge
        # finite t / c is fine: tanh(+-inf) = +-1.
        with np.errstate(over="ignore", invalid="ignore"):
            t = dtype(pb.scale) * (q5 @ np.swapaxes(k5, -1, -2))
            t[~np.isfinite(t)] = 0.0
            if cap is not None:
                capped = dtype(cap) * np.tanh(t / dtype(cap))
                cap_factor = 1.0 - np.tanh(t / dtype(cap)) ** 2  # d/dt of c tanh(t / c)
                t = capped
    if mod_grad is not None:  # the chain rule through score_mod, at the softcapped scores
        b, h = flex.index_grids(pb, ())
        mod_factor = flex.score_values(mod_grad, t, b[..., None, None], h[..., None, None],
                                       i_at[:, None], j_at[None, :], name="score_mod_grad")

    def factor_of(p):  # d/dt of the score's modifications; where p = 0, ds = 0 whatever g is
        factor = 1.0 if cap is None else cap_factor
        return factor if mod_grad is None else factor * np.where(p > 0, mod_factor, 0.0)

    results, kept = [], {}
    for formulation in formulations:
        flash = formulation == "flash" and not prec.is_float64
        keep = (lambda x: x) if flash else rnd  # noqa: E731  # what FlashAttention keeps in float32
        if flash not in kept:  # the scores as this formulation keeps them, and their softmax
            s = keep(scores)
            kept[flash] = (s,) + softmax(s)
        s, p, p_sink, _ = kept[flash]
        results.append(_dense_grads(formulation, prec, pb, p, p_sink, factor_of(p), q5, k5, v5, dout5, sink,
                                    sinks, rows, stats, part, None if stats is None else out5))
    if several:
        return results
    result, formulation = results[0], formulations[0]
    flash = formulation == "flash" and not prec.is_float64
    s, p, p_sink, row_lse = kept[flash]
    factor = factor_of(p)
    extra = ()
    if return_abs:
        extra += (_dense_grads(formulation, prec, pb, p, p_sink, factor, np.abs(q5), np.abs(k5), np.abs(v5),
                               np.abs(dout5), sink, sinks, rows, stats, part, None, sign=1.0),)

    def rss():
        # Squares of the terms each entry sums, summed (a GQA group's heads too), rooted.
        p2 = p * p
        dp = dout5 @ np.swapaxes(v5, -1, -2)
        # ds_ij = p_ij (dp_ij - D_i) carries the rounding of dp_ij and of D_i's terms: its
        # size is p_ij (|dp_ij| + sum_j |p_ij dp_ij|) (|D_i| is at most the sum), and, weighted
        # by rss_accumulate, the componentwise sizes |dout| . |v_j| of what dp_ij and D_i sum.
        d1 = np.sum(np.abs(p * dp), axis=-1, keepdims=True)
        if rss_scores:  # D_i = dout_i . out_i from the output as stored (each out_ic rounded)
            d1 = d1 + np.sqrt(np.sum((dout5 * (p @ v5)) ** 2, axis=-1, keepdims=True))
        dp = np.abs(dp)
        if return_rss == "dot":  # the dot products' part alone
            d1, dp = 0.0 * d1, 0.0 * dp
        if rss_accumulate:
            dp_abs = np.abs(dout5) @ np.swapaxes(np.abs(v5), -1, -2)
            d1 = d1 + rss_accumulate * np.sum(p * dp_abs, axis=-1, keepdims=True)
            dp = dp + rss_accumulate * dp_abs
        # Under softcap, 1 - tanh**2 computed from a rounded tanh is off by up to 4u absolutely.
        size = np.abs(factor) + (4 * 2.0 ** -53 if cap is not None else 0.0)
        a2 = (p * (dp + d1) * size) ** 2
        dv = np.swapaxes(p2, -1, -2) @ (dout5 * dout5)
        if rss_scores:  # the scores' rounding, S_i = sigma_i + |lse_i| per row (weighted)
            seen = np.isfinite(s)
            with np.errstate(over="ignore", invalid="ignore"):
                sigma = np.max(np.where(seen, abs(pb.scale) * (np.abs(q5) @ np.swapaxes(np.abs(k5), -1, -2)), 0.0),
                               axis=-1, keepdims=True, initial=0.0)
            w2 = (rss_scores * (sigma + np.abs(row_lse))) ** 2  # (..., hk, g, sq, 1)
            a2 = a2 * (1.0 + w2)
            dv = dv + np.swapaxes(p2 * w2, -1, -2) @ (dout5 * dout5)
        if return_rss == "dot":  # dv sums no dot product's result
            dv = 0.0 * dv
        dq = pb.scale ** 2 * (a2 @ (k5 * k5))
        dk = pb.scale ** 2 * (np.swapaxes(a2, -1, -2) @ (q5 * q5))
        dsink = None if sink is None else np.sum((p_sink * d1) ** 2, axis=(-2, -1))
        grads = _split_grads(pb, dq, dk.sum(axis=-3), dv.sum(axis=-3), dsink, sinks)
        return tuple(np.sqrt(g) for g in grads)

    if return_rss:
        if not prec.is_float64:
            raise ValueError("return_rss is computed in float64: leave compute_dtype out")
        extra += (rss(),)
    return (result,) + extra if extra else result


def _dense_grads(formulation, prec, pb, p, p_sink, factor, q5, k5, v5, dout5, sink, sinks, rows, stats, part, out5,
                 sign=-1.0):
    """`dense_backward`'s gradients in one formulation from the weights ``p`` (and the sink's,
    ``p_sink``); ``sign`` -1: the softmax Jacobian; +1: the sizes (``return_abs``), where a factor
    counts by its size."""
    dtype = prec.accumulate.type
    rnd = (lambda x: x) if prec.is_float64 else prec.round  # noqa: E731
    flash = formulation == "flash" and not prec.is_float64
    keep = (lambda x: x) if flash else rnd  # noqa: E731  # what FlashAttention keeps in float32
    sequential = formulation == "sequential" and not prec.is_float64

    def mm(a, b):
        """``a @ b``; "sequential": summed in float32 one slice of the inner axis after
        another (one key or query at a time, up to `SEQUENTIAL_STEPS` slices)."""
        n = a.shape[-1]
        if not sequential or n == 0:
            return a @ b
        step = -(-n // SEQUENTIAL_STEPS)
        acc = a[..., :step] @ b[..., :step, :]
        for j in range(step, n, step):
            acc = acc + a[..., j:j + step] @ b[..., j:j + step, :]
        return acc

    head = keep  # FlashAttention sums a GQA group's dk, dv before rounding them
    # A part (rows or keys): the gradients whole there only, the others left empty.
    dq_too, kv_too = stats is None, stats is not None or not part
    dv = head(mm(np.swapaxes(p, -1, -2), dout5)) if kv_too else np.zeros(q5.shape[:-2] + (0, v5.shape[-1]), dtype)
    dp = keep(dout5 @ np.swapaxes(v5, -1, -2))  # (..., hk, g, sq, sk)
    if flash and sign < 0:  # D_i = dout_i . out_i, out rounded as the forward stored it, in sequence
        out = rnd(p @ v5 if stats is None else out5).astype(dtype)
        d = np.cumsum(dout5 * out, axis=-1)[..., -1:] if dout5.shape[-1] else np.zeros(p.shape[:-1] + (1,), dtype)
    elif stats is not None:  # D_i = dout_i . out_i of the output the forward gave (every key's sum)
        d = np.sum(dout5 * out5.astype(dtype), axis=-1, keepdims=True)
    elif sequential and sign < 0 and p.shape[-1]:
        d = np.cumsum(p * dp, axis=-1)[..., -1:]  # key after key
    else:
        d = np.sum(p * dp, axis=-1, keepdims=True)  # D_i = dout_i . out_i
    ds = rnd(p * (dp + sign * d) * (factor if sign < 0 else np.abs(factor)))
    empty_dq, empty_dk = (np.zeros(q5.shape[:-2] + (0, x.shape[-1]), dtype) for x in (q5, k5))
    if formulation == "eager" and not prec.is_float64:  # d(q k^T) = scale * ds, rounded
        ds_scaled = rnd(dtype(pb.scale) * ds)
        dq = rnd(mm(ds_scaled, k5)) if dq_too else empty_dq
        dk = head(mm(np.swapaxes(ds_scaled, -1, -2), q5)) if kv_too else empty_dk
    else:
        dq = rnd(dtype(pb.scale) * mm(ds, k5)) if dq_too else empty_dq
        dk = head(dtype(pb.scale) * mm(np.swapaxes(ds, -1, -2), q5)) if kv_too else empty_dk
    # The sink's value is 0, so dP_sink = 0 and dsink_i = P_sink_i (0 - D_i).
    dsink = None if sink is None else rnd(np.sum(sign * p_sink * d, axis=(-2, -1)))
    # GQA: the query heads of a group share k and v, so their gradients add up.
    grads = _split_grads(pb, dq, rnd(dk.sum(axis=-3)), rnd(dv.sum(axis=-3)), dsink, sinks)
    grads = tuple(g.astype(prec.compute) for g in grads)
    whole = (dq_too, kv_too, kv_too, rows is None)  # dsinks: every row's
    return tuple(g if w else None for g, w in zip(grads, whole))


def attention_backward(q, k, v, out, lse, dout, *, scale=None, block_q=None, block_k=None,
                       workers=None, check_finite=True, qv=None, device=None, **options):
    """Tiled float64 gradients ``(dq, dk, dv)``: the FlashAttention-2 backward pass.

    Parameters
    ----------
    q, k, v : array_like
        As in `attention`.
    out : array_like, shape ``(..., Hq, Sq, Dv)``
    lse : array_like, shape ``(..., Hq, Sq)``
        The forward's output and log-sum-exp (``attention(..., return_lse=True)``).
    dout : array_like, shape ``(..., Hq, Sq, Dv)``
        Gradient of the loss with respect to ``out``.
    scale, causal, causal_align, window, kv_lengths, q_lengths, q_segment_ids,
    kv_segment_ids, softcap, alibi_slopes, sinks
        As in `attention`, and equal to the forward's (``lse`` then includes the sinks).
    block_q, block_k : int, optional
        Tile sizes (default `DEFAULT_TILES`).
    workers : int, optional
        Threads that take key tiles in parallel; default (None, or -1): one per available
        CPU, with BLAS held to one thread.  The result is bit-identical for every thread
        count: each key tile owns its ``dk``/``dv`` rows, and the additions to each ``dq``
        tile are made in ascending key-tile order.
    qv : array_like, shape ``(..., Hq, Sq, Dv)``, optional
        MLA's second query, as in the forward (``q`` may be None): the gradients are those of
        the joined problem split back (`attnlib.core.mla`), ``dv`` both its parts.
    device : str or torch.device, optional
        Compute with torch on this device (`attnlib.core.torch_backend`); torch tensors among
        the inputs choose it when None.  Tensors in give float64 tensors on the device out;
        numpy inputs with ``device=`` give numpy.  Numpy inputs without it take the numpy
        kernel (torch is not imported).  ``mask_mod``, ``score_mod`` (with
        ``score_mod_grad``) and ``block_mask`` are called there as in the forward.

    Returns
    -------
    dq : ndarray, shape of ``q``;  dk : shape of ``k``;  dv : shape of ``v`` (float64)
    dqv : ndarray, shape of ``qv``, only when ``qv`` is given (``dq`` and ``dk`` are then
        None without ``q``)
    dsinks : ndarray, shape of ``sinks``, only when sinks are given:
        ``-sum exp(sink_h - lse_i) D_i`` over the rows (and batch entries) of each sink

    Notes
    -----
    ``D_i = rowsum(dout_i * out_i)`` per query row, once.  Key tiles are the outer loop
    (each owns ``dk_j``, ``dv_j``); for each visible query tile the probabilities are
    recomputed from the saved ``lse`` as ``p = exp(s - lse)`` (no second softmax pass),
    then ``dv_j += p^T dout_i``, ``dp = dout_i v_j^T``, ``ds = p * (dp - D_i)`` (times
    ``1 - tanh^2`` under softcap), ``dk_j += scale * ds^T q_i`` and
    ``dq_i += scale * ds k_j``.  SKIP tiles are never touched and FULL tiles do no mask
    work, as in the forward.  Rows with ``lse = -inf`` (no visible key) have ``p = 0`` and
    contribute exactly zero.  Working memory is a few tile-sized arrays per head and
    thread, the per-row ``D`` and the tile map (one byte per tile); the gradients
    themselves are the size of the inputs.

    References
    ----------
    T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning", 2023, Algorithm 2.

    Examples
    --------
    >>> import attnlib
    >>> q, k, v = attnlib.random_qkv(200, 300, 32, seed=0)
    >>> out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True)
    >>> dout = attnlib.random_qkv(200, 1, 32, seed=1)[0]
    >>> dq, dk, dv = attnlib.attention_backward(q, k, v, out, lse, dout, causal=True)
    >>> errors = attnlib.gradient_errors((dq, dk, dv), q, k, v, dout, causal=True)
    >>> max(errors["dq"], errors["dk"], errors["dv"]) < 1e-12
    True
    """
    if qv is not None:  # MLA: the joined problem's gradients, split back
        joined_q, joined_k, _ = mla.inputs(q, k, v, qv)
        return mla.split(attention_backward(joined_q, joined_k, v, out, lse, dout, scale=scale, block_q=block_q,
                                            block_k=block_k, workers=workers, check_finite=check_finite,
                                            device=device, **options), _head_dim(q), q is not None)
    dev = dev_mod.resolve(device, q, k, v, out, lse, dout)
    opts, mod_grad = _options(scale, options, "attention_backward")
    grads = tiled_backward(q, k, v, out, lse, dout, opts, mod_grad, block_q=block_q, block_k=block_k,
                           workers=workers, check_finite=check_finite, dev=dev)
    return grads if dev is None else dev_mod.on_device(grads, (q, k, v, out, lse, dout))


def tiled_backward(q, k, v, out, lse, dout, opts: Options, mod_grad=None, *, block_q=None, block_k=None,
                   workers=None, check_finite=True, dev=None, sizes=None):
    """`attention_backward` with its options parsed into ``opts`` (and ``mod_grad`` the
    ``score_mod_grad``); ``dev``: a torch device to compute on (`attnlib.core.torch_backend`),
    or None for numpy.  The gradients as ``xp``'s arrays.

    ``sizes``: `GradSizes`, for ``(grads, rss)``: the gradients bit for bit and, beside them, the
    root-sum-squares `dense_backward` gives with ``return_rss`` (the check's entry sizes, in
    memory bounded in the sequence length): a first pass over the tiles for each row's
    ``d1_i``, then the backward with the squares summed beside the gradients."""
    workers = validate.workers(workers) if dev is None or workers is not None else None
    xp = NUMPY if dev is None else backend_for(dev, workers)
    q5, k5, v5, pb, extremes = xp.parse(q, k, v, opts.scale, check_finite)
    out5, lse5, dout5 = _grad_inputs(pb, check_finite, xp, out=out, lse=lse, dout=dout)
    # The host's backward keeps 256 x 256 tiles at every head dim (the forward's 512 x 512 for D >= 128).
    setup = prepare(q5, k5, v5, pb, opts, block_q=block_q, block_k=block_k, xp=xp, extremes=extremes,
                    base=DEFAULT_TILES if xp is NUMPY else None)
    workers = workers if xp is NUMPY else xp.workers
    sink = setup.sink  # (..., hk, g) or None
    if sink is not None and check_finite and any(xp.host_bools([(lse5 == -math.inf).any()])):
        raise ValueError("lse has -inf rows, but with sinks every row's lse is at least its sink: "
                         "pass the lse of attention(..., sinks=sinks, return_lse=True)")
    # Values near float64's range: dout / 2**e while summing, the gradients times 2**e after.
    e = _grad_exponent(pb, dout5, (v5, out5), q5, k5, xp)
    dout5 = xp.ldexp(dout5, -e) if e else dout5
    dq = xp.zeros(tuple(q5.shape))
    dk = xp.zeros(pb.batch + (pb.hk, pb.sk, pb.d))
    dv = xp.zeros(pb.batch + (pb.hk, pb.sk, pb.dv))
    # dsink_h = -sum_i exp(sink_h - lse_i) D_i, per grouped head (*batch, hk, g).
    dsink = None if sink is None else xp.zeros(pb.batch + (pb.hk, pb.group))
    if pb.sq == 0 or pb.sk == 0 or not math.prod(pb.batch):
        # No query: no loss reaches k and v.  No key: out = 0 whatever q is.  Zeros either way
        # (and D = dout . out = 0 for dsinks).
        grads = _split_grads(pb, dq, dk, dv, dsink, opts.sinks)
        return grads if sizes is None else (grads, tuple(xp.zeros(tuple(g.shape)) for g in grads))
    hook = hooks.get("backward")  # the stage edits (`attnlib.core.hooks`)
    hook = None if hook is hooks.keep else hook  # the identity: not called at all
    lse5 = xp.operand(lse5)
    delta = _rows_delta(out5, dout5, setup.tiles.block_q, xp)  # D = rowsum(dout * out), (..., sq)
    if hook is not None:
        delta = hook("delta", delta)
    sized = None if sizes is None else sizes.bind(pb, out5, dout5, setup.cap, xp)
    # The shift of p = exp(s - lse): rows without a visible key have lse = -inf and only -inf
    # scores; shifting them by 0 gives exp(-inf) = 0, not -inf - (-inf).
    shift = xp.finite_or_zero(lse5)
    per_thread = threading.local()  # each thread's tile buffers and band masks
    mods = setup.mods

    def sweep(sized_pass):  # every mask's tiles, key tiles outer
        items = []
        for idx, spec in setup.specs.items():  # idx = (): all batch entries share one mask
            items += _backward_plan(q5[idx], k5[idx], v5[idx], dout5[idx], delta[idx], shift[idx], pb.scale, spec,
                                    setup, problem.for_entry(setup.slopes, idx), dq[idx], dk[idx], dv[idx], workers,
                                    per_thread, None if mods is None else flex.Mods(*mods, *flex.index_grids(pb, idx)),
                                    mod_grad, hook, None if sized_pass is None else sized_pass.at(idx))
        # A wrong lse makes exp(s - lse) overflow: let it, and name it below (not a FloatingPointError).
        with xp.threads(workers), xp.ignore_overflow(check_finite):
            run_tiles(lambda item: item(), items, workers)
            xp.finish()  # the errors a device gathered, raised once

    if sized is not None:  # the sizes' first pass: each row's d1_i over all its keys
        sweep(sized.rows_pass())
    sweep(sized)
    p_sinks = None if sink is None or sized is None else xp.zeros(tuple(delta.shape))
    with xp.threads(workers), xp.ignore_overflow(check_finite):
        if sink is not None:  # lse_i >= sink_h, so every exponent is <= 0
            for idx in setup.specs:
                with xp.overflow_ok():  # sink - lse below -max: weight exactly 0
                    p_sink = xp.exp(xp.broadcast_to(problem.for_entry(sink, idx), tuple(delta[idx].shape[:-1]))[..., None]
                                    - lse5[idx])  # (*lead, sq)
                dsink[idx] -= (p_sink * delta[idx]).sum(-1)  # 0 - x: +0 where no row counts
                if p_sinks is not None:
                    p_sinks[idx] = p_sink
    dq *= pb.scale  # dq = scale * sum_j ds_ij k_j
    grads = _split_grads(pb, dq, dk, dv, dsink, opts.sinks)
    if check_finite:
        for ok, name in zip(xp.host_bools([xp.isfinite(g).all() for g in grads]), ("dq", "dk", "dv", "dsinks")):
            if not ok:  # with finite inputs only a wrong lse makes exp(s - lse) > 1
                raise ValueError(f"{name} is not finite: lse does not match q and k (exp(s - lse) "
                                 "exceeds 1): pass the lse of attention(..., return_lse=True) with the "
                                 "same options")
    grads = grads if hook is None else hook("grads", grads, xp=xp)
    if sized is not None:
        rss = sized.finish(pb, p_sinks, opts.sinks)
        return (_unscale_grads(grads, e, xp=xp), _unscale_grads(rss, e, xp=xp)) if e else (grads, rss)
    return _unscale_grads(grads, e, xp=xp) if e else grads


def _rows_delta(out, dout, bq, xp):
    """``D = rowsum(dout * out)`` in float64, a query tile at a time (within the memory bound)."""
    delta = xp.empty(tuple(out.shape[:-1]))  # (*lead, sq)
    for q0 in range(0, out.shape[-2], bq):
        q1 = min(q0 + bq, out.shape[-2])
        delta[..., q0:q1] = (xp.operand(dout[..., q0:q1, :]) * xp.operand(out[..., q0:q1, :])).sum(-1)
    return delta


def _backward_plan(q, k, v, dout, delta, shift, scale, spec, setup, slopes, dq, dk, dv, workers, per_thread,
          mods=None, mod_grad=None, hook=None, sized=None):
    """The tiles of one mask, key tiles outer, as in FlashAttention-2's Algorithm 2: one
    callable per (head block, key tile) unit, in ascending key tiles.

    ``q, dout: (*lead, sq, .)``, ``delta, shift: (*lead, sq)`` with ``lead = (..., hk, g)``;
    ``k, v: (..., hk, 1, sk, .)``.  Each unit's key tile owns its ``dk_j`` and ``dv_j``
    (written to ``dk, dv: (..., hk, sk, .)``, a GQA group's query heads summed); its
    contributions ``ds @ k_j`` are added to ``dq`` (unscaled) in ascending key-tile order
    whatever the number of ``workers``, so the result is bit-identical to the serial run
    (FlashAttention-2's deterministic backward orders its dq additions the same way).
    ``hook``: the step ``"backward"`` of `attnlib.core.hooks` (its stages are listed there),
    or None for its default, the identity (no call per tile); the scores and masks are the
    steps ``"tile_scores"`` and ``"tile_visible"``, as in the forward.  ``sized``: a
    `_SizedPass` at this mask's entries: its first pass (``rows``) sums each row's ``d1_i``
    (in the ``dq`` order) and nothing else, its second the squares beside the gradients.
    """
    xp, tiles = setup.xp, setup.tiles
    bq, bk = tiles.block_q, tiles.block_k
    lead, sq = tuple(q.shape[:-2]), q.shape[-2]
    k_starts, k_ends, kv_ranges = spec.key_tiles(bk)  # (n_k_tiles,) each
    q_starts = np.arange(0, sq, bq)
    q_ends = np.minimum(q_starts + bq, sq)
    # The tile map, one byte a tile, on the host: (n_q_tiles, n_k_tiles).
    kinds = np.stack([spec.tile_kind(q0, q1, k_starts, k_ends, kv_ranges) for q0, q1 in zip(q_starts, q_ends)])
    units = xp.units(lead[:-1], lead[-1] * min(bq, sq), min(bk, k.shape[-2]), k_starts.size)
    # Each unit's tile map: the built-in classes AND its heads' block mask, (n_units, nq, nk).
    unit_mods = [None if mods is None else mods.unit(unit) for unit in units]
    unit_kinds = np.stack([kinds if m is None else np.stack([m.tile_kinds(a, kinds[a]) for a in range(len(kinds))])
                           for m in unit_mods])
    visible = unit_kinds != SKIP
    # rank[u, a, b]: visible key tiles before b in query tile a, i.e. b's turn to add to dq_a.
    turns = Turns(np.cumsum(visible, axis=2) - visible, threaded=workers > 1)
    last = np.where(visible.any(axis=2), visible.shape[2] - 1 - np.argmax(visible[..., ::-1], axis=2), -1)
    slopes = None if slopes is None else xp.broadcast_to(slopes, lead)
    # The declared steps (`attnlib.core.hooks`), as the forward's: the same masks and scores.
    tile_visible, scores_of = hooks.get("tile_visible"), hooks.get("tile_scores")
    on_device = {} if xp is NUMPY else {"xp": xp}  # the steps' replacements of old take no xp on the host

    def key_tile(u, b):
        xp.worker_start()
        unit, mods_u = units[u], unit_mods[u]
        q_u, dout_u, delta_u, shift_u = q[unit], dout[unit], delta[unit], shift[unit]
        dq_u, slopes_u = dq[unit], None if slopes is None else slopes[unit]
        k0, k1 = int(k_starts[b]), int(k_ends[b])
        cols = np.arange(k0, k1)
        k_j = xp.operand(_unit_of(k, unit)[..., k0:k1, :])  # (..., hk, 1, bk, d)
        v_j = xp.operand(_unit_of(v, unit)[..., k0:k1, :])  # (..., hk, 1, bk, dv)
        dk_j = xp.zeros(tuple(q_u.shape[:-2]) + tuple(k_j.shape[-2:]))  # (..., hk, g, bk, d)
        dv_j = xp.zeros(tuple(q_u.shape[:-2]) + tuple(v_j.shape[-2:]))  # (..., hk, g, bk, dv)
        dk_part, dv_part = xp.empty(tuple(dk_j.shape)), xp.empty(tuple(dv_j.shape))
        if sized is not None:  # the sizes' operands: |v_j|, k_j**2 and this unit's rows
            v_abs, k_sq, d1_u = abs(v_j), k_j * k_j, sized.d1[unit]
            w2_u = None if sized.w2 is None else sized.w2[unit]
            if not sized.rows:
                dq2_u, dk2_j, dv2_j = sized.dq2[unit], xp.zeros(tuple(dk_j.shape)), xp.zeros(tuple(dv_j.shape))
        buffers = per_thread.__dict__.setdefault("buffers", {})  # s/p, ds and dq_ij per tile shape
        band_masks = per_thread.__dict__.setdefault("band masks", {})  # for tile_visible
        try:
            for a in np.flatnonzero(visible[u, :, b]):
                q0, q1, kind = int(q_starts[a]), int(q_ends[a]), unit_kinds[u, a, b]
                rows = np.arange(q0, q1)
                shape = tuple(q_u.shape[:-2]) + (q1 - q0, k1 - k0, q_u.shape[-1])
                if shape not in buffers:
                    buffers[shape] = (xp.empty(shape[:-1]), xp.empty(shape[:-1]), xp.empty(shape[:-2] + shape[-1:]))
                s_buf, ds, dq_ij = buffers[shape]
                with xp.ignore_overflow(setup.check):
                    q_i = xp.operand(q_u[..., q0:q1, :]) * scale  # (..., g, bq, d), scaled; inf: caught below
                dout_i = xp.operand(dout_u[..., q0:q1, :])
                vis = (xp.mask(tile_visible(spec, rows, k0, k1, contiguous=True, cache=band_masks))
                       if kind == PARTIAL else None)  # (bq, bk)
                if mods_u is not None and kind == PARTIAL:  # AND mask_mod, per head
                    vis = mods_u.visible(vis, rows, cols, False, xp)
                grad = None if mod_grad is None else [mod_grad]
                s, th = scores_of(q_i, k_j, spec, rows, cols, kind, setup.cap, slopes_u, keep_tanh=True,
                                  out=s_buf, check=setup.check, vis=vis, mods=mods_u, mod_grad=grad, **on_device)
                with xp.overflow_ok():  # below -max: -inf, whose exp is the exact 0
                    s -= shift_u[..., q0:q1, None]
                # (..., g, bq, bk): the forward's probabilities, exactly 0 where hidden.
                p = xp.exp(s, out=s) if vis is None else xp.exp_visible_(s, vis)
                if sized is not None:
                    # |dp_ij| and, weighted, the componentwise |dout_i| . |v_j| that dp_ij and D_i sum.
                    dp_size = abs(xp.matmul(dout_i, xp.swapaxes(v_j, -1, -2), out=ds))
                    dp_size += sized.accumulate * xp.matmul(abs(dout_i), xp.swapaxes(v_abs, -1, -2))
                    if sized.rows:  # d1_i = sum_j p_ij (|dp_ij| + a |dout_i| . |v_j|), in the dq order
                        d1_add = (p * dp_size).sum(-1)
                        with turns.turn((u,), a, b):
                            d1_u[..., q0:q1] += d1_add
                        continue
                dv_part = xp.matmul(xp.swapaxes(p, -1, -2), dout_i, out=dv_part)
                dv_j += dv_part if hook is None else hook("dv_tile", dv_part, a=a, b=b)
                if sized is None:  # (the sizes' pass holds dp in ds already)
                    ds = xp.matmul(dout_i, xp.swapaxes(v_j, -1, -2), out=ds)  # dp, (..., g, bq, bk)
                ds -= delta_u[..., q0:q1, None]
                ds *= p  # ds = p * (dp - D)
                if th is not None:  # softcap: d/dt c tanh(t / c) = 1 - tanh(t / c)**2
                    th *= th
                    th *= -1.0
                    th += 1.0
                    ds *= th
                if grad is not None:  # score_mod: its derivative at the (capped) score; p = 0: ds = 0 whatever it is
                    ds = xp.copy_where(ds, ds * grad[1], p > 0)
                if sized is not None:
                    # ds_ij's size p_ij (|dp_ij| + d1_i) |factor|, squared (1 + w_i**2) with the scores'.
                    size = 1.0 if th is None else th + sized.cap
                    if grad is not None:
                        size = size * xp.where(p > 0, abs(grad[1]), 0.0)
                    a2 = p * (dp_size + d1_u[..., q0:q1, None]) * size
                    a2 *= a2
                    p2 = p * p
                    if w2_u is not None:
                        a2 *= w2_u[..., q0:q1, None]
                        p2 *= w2_u[..., q0:q1, None]
                    dv2_j += xp.matmul(xp.swapaxes(p2, -1, -2), dout_i * dout_i)
                    dk2_j += xp.matmul(xp.swapaxes(a2, -1, -2), q_i * q_i)  # q_i carries the scale
                    dq2_add = xp.matmul(a2, k_sq)
                if hook is not None:
                    ds = hook("ds", ds, a=a, b=b)
                dk_part = xp.matmul(xp.swapaxes(ds, -1, -2), q_i, out=dk_part)  # q_i carries the scale
                dk_j += dk_part if hook is None else hook("dk_tile", dk_part, a=a, b=b)
                add = xp.matmul(ds, k_j, out=dq_ij)  # (..., g, bq, d)
                if hook is not None:
                    add = hook("dq_tile", add, a=a, b=b, last=b == last[u, a])
                with turns.turn((u,), a, b):  # taken even by a dropped tile: the order stays fixed
                    if add is not None:
                        dq_u[..., q0:q1, :] += add
                    if sized is not None:
                        dq2_u[..., q0:q1, :] += dq2_add
        except BaseException:
            turns.abort()  # no other worker may wait for this tile's turns any more
            raise
        if sized is not None and sized.rows:
            return
        # GQA: the query heads of a group share k_j and v_j, so their gradients add up.
        dk[unit][..., k0:k1, :] = dk_j.sum(-3)
        dv[unit][..., k0:k1, :] = dv_j.sum(-3)
        if sized is not None:  # and so do their squares
            sized.dk2[unit][..., k0:k1, :] = dk2_j.sum(-3)
            sized.dv2[unit][..., k0:k1, :] = dv2_j.sum(-3)

    # Key tiles are handed out in ascending order, so the lowest unfinished one never
    # waits: no deadlock.  Under causal masks the first key tiles are also the longest.
    return [functools.partial(key_tile, u, b) for b in range(k_starts.size) for u in range(len(units))
            if visible[u, :, b].any()]


def _head_dim(q) -> int:
    """q's head dim D (0 without q): where MLA's joined gradients split."""
    return 0 if q is None else (q.shape[-1] if hasattr(q, "shape") else np.shape(q)[-1])


def attention_vjp(q, k, v, dout, *, qv=None, device=None, **options):
    """Forward and backward in one call: ``(out, (dq, dk, dv))`` (``dqv`` next with ``qv``,
    ``dsinks`` last with sinks).

    ``options`` are those of `attention_backward` (masks, score options, tiles,
    ``check_finite``), passed to both passes.  With torch tensors (or ``device=``) both
    passes run with torch on the device, ``out`` and ``lse`` staying there between them;
    numpy inputs with ``device=`` get numpy back.
    """
    if qv is not None:  # MLA: the joined problem's, its gradients split back
        joined_q, joined_k, _ = mla.inputs(q, k, v, qv)
        out, grads = attention_vjp(joined_q, joined_k, v, dout, device=device, **options)
        return out, mla.split(grads, _head_dim(q), q is not None)
    forward = {name: value for name, value in options.items() if name != "score_mod_grad"}
    dev = dev_mod.resolve(device, q, k, v, dout)
    if dev is None:
        out, lse = attention(q, k, v, return_lse=True, **forward)
        return out, attention_backward(q, k, v, out, lse, dout, **options)
    given = (q, k, v, dout)
    q, k, v, dout = (dev_mod.as_tensor(x, name, dev) for x, name in zip(given, ("q", "k", "v", "dout")))
    out, lse = attention(q, k, v, return_lse=True, device=dev, **forward)
    grads = attention_backward(q, k, v, out, lse, dout, device=dev, **options)
    return dev_mod.on_device(out, given), dev_mod.on_device(grads, given)


__all__ = ["attention_backward", "reference_attention_backward", "attention_vjp"]
