"""The dense float64 gradient (the judge's reference) and the naive backward in a lower
precision in its formulations (the check's baselines, `attnlib.check.naive`): the whole
``(Sq, Sk)`` score matrix per head, or a part of it (`dense_backward`'s ``rows`` and ``keys``).
The formulas are `attnlib.core.backward`'s.
"""

from __future__ import annotations

import numpy as np

from . import flex, mla, problem
from .gradparts import (_grad_exponent, _grad_inputs, _head_dim, _options, _scaled_dout, _split_grads,
                        _unscale_grads)
from .options import Options
from .reference import _scores


#: The naive same-precision backward's formulations (``compute_dtype`` below float64).
FORMULATIONS = ("math", "eager", "flash", "sequential")
#: The "sequential" formulation's most slices of a sum: one key (or query) per step up to
#: this many, beyond it slices of a few summed by BLAS inside (a bounded cost).
SEQUENTIAL_STEPS = 1024


def reference_attention_backward(q, k, v, dout, *, dlse=None, scale=None, return_abs=False,
                                 return_rss=False, rss_accumulate=1.0, rss_scores=0.0, check_finite=True,
                                 compute_dtype=None, formulation="math", qv=None, **options):
    """Dense float64 gradients ``(dq, dk, dv)`` of `reference_attention` for ``dout``.

    Parameters
    ----------
    q, k, v : array_like
        As in `reference_attention`.
    dout : array_like, shape ``(..., Hq, Sq, Dv)``
        Gradient of the loss with respect to the output.
    dlse : array_like, shape ``(..., Hq, Sq)``, optional
        Gradient of the loss with respect to the natural-log ``lse`` (sinks included):
        ``ds_ij = p_ij (dp_ij - D_i + dlse_i)`` (`attention_backward`'s).  None: 0.
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
        ``(q k^T) * scale``, the product stored in the type and then the scaled one (Hugging
        Face's eager attention: a scale that is no power of two rounds them twice), so
        ``scale * ds`` is rounded before its matmuls (in float16's subnormal range, below 6.1e-5, that rounding is
        what a small ``dout`` costs) and a softcap's steps are stored in the type, forward and
        back (Gemma 2's eager softcap); ``"flash"`` is FlashAttention's backward (``s``,
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
            joined_q, joined_k, v, dout, dlse=dlse, scale=scale, check_finite=check_finite, compute_dtype=compute_dtype,
            formulation=formulation, **options), _head_dim(q), q is not None)
    opts, mod_grad = _options(scale, options, "reference_attention_backward")
    return dense_backward(q, k, v, dout, opts, mod_grad, return_abs=return_abs, return_rss=return_rss,
                          rss_accumulate=rss_accumulate, rss_scores=rss_scores, check_finite=check_finite,
                          compute_dtype=compute_dtype, formulation=formulation, dlse=dlse)


def dense_backward(q, k, v, dout, opts: Options, mod_grad=None, *, return_abs=False, return_rss=False,
                   rss_accumulate=1.0, rss_scores=0.0, check_finite=True, compute_dtype=None,
                   formulation="math", rows=None, keys=None, stats=None, dlse=None):
    """`reference_attention_backward` with its options parsed into ``opts`` (and ``mod_grad``
    the ``score_mod_grad``).  ``formulation``: one of `FORMULATIONS`, or a tuple of them for a
    list of their gradients (those that round the same scores share them).

    A part of the gradients (the check's naive baselines on a sample, `attnlib.check.naive`), the
    pairs of query positions ``rows`` and key positions ``keys`` (None: all): without ``stats``,
    ``dq`` on ``rows``, each row's softmax from its own scores (``keys`` must hold every key the rows
    see); with ``stats = (lse, out)``, the forward's ``(..., Hq, Sq)`` and ``(..., Hq, Sq, Dv)``
    (float64), ``dk`` and ``dv`` on ``keys`` (``rows`` must hold every row that sees them) with ``p =
    exp(s - lse)`` and ``D_i`` from ``out`` in the formulation's arithmetic (``lse`` and ``out`` as a
    kernel stores them); ``stats = (lse, out, shift, d)``: the formulations that store the scores
    in the type take ``lse + shift`` and ``D_i = d`` instead, the rows as their own softmax has them
    (`attnlib.core.gradsizes.GradSizes`'s ``naive``).  ``dsinks``: the sum over ``rows`` alone, unrounded (in the
    accumulator's type: the parts of a sum add up before its one rounding).  The others are None.
    ``dlse``: the loss's gradient with respect to ``lse``, ``(..., Hq, Sq)`` (every row; None: 0): each
    formulation's ``D_i - dlse_i`` in its accumulator's type."""
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
        raise ValueError(f"{prec.label} has no backward (p rounded to {prec.p_type.name}: FlashAttention 3's "
                         "fp8 path is forward only); judge fp8 gradients as bfloat16")
    if several and (return_abs or return_rss or prec.is_float64):
        raise ValueError("several formulations are those of a lower compute_dtype, without sizes")
    q5, k5, v5, pb = problem.parse(q, k, v, scale=opts.scale, check_finite_inputs=check_finite)
    (dout5,) = _grad_inputs(pb, check_finite, dout=dout)
    dlse5 = None if dlse is None else _grad_inputs(pb, check_finite, dlse=dlse)[0]  # (*batch, hk, g, sq)
    if not part:  # (a part: the check's sample, where an overflowing formulation is left out)
        problem.check_representable(prec, q=q5, k=k5, v=v5, dout=dout5)
    e = _grad_exponent(pb, dout5, (v5,), q5, k5, dlse5=dlse5) if prec.is_float64 else 0
    if e:  # values near float64's range: dout and dlse / 2**e, the gradients times 2**e
        return _unscale_grads(dense_backward(
            q, k, v, _scaled_dout(dout, e), opts, mod_grad, return_abs=return_abs, return_rss=return_rss,
            rss_accumulate=rss_accumulate, rss_scores=rss_scores, check_finite=check_finite,
            compute_dtype=compute_dtype, formulation=formulation, rows=rows, keys=keys, stats=stats,
            dlse=None if dlse is None else np.ldexp(dlse5.astype(np.float64), -e).reshape(np.shape(dlse))), e)
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
    if dlse5 is not None:  # (..., hk, g, sq, 1) on these rows, as the kernel reads it
        dlse5 = (dlse5 if rows is None else dlse5[..., i_at]).astype(dtype)[..., None]
    sinks = opts.sinks
    sink = problem.sinks(sinks, pb, dtype)  # (..., hk, g) or None
    scores = _scores(q5, k5, pb, opts, dtype, rows=rows, cols=keys)  # (..., hk, g, sq, sk), -inf where invisible
    if sink is not None:
        sink = sink.astype(dtype)[..., None, None]  # (..., hk, g, 1, 1)
    lse_of, d_of = {}, {}  # per score group: the rows' lse and D_i the weights take (with stats)
    if stats is not None:  # the rows' lse as the forward stored it: p = exp(s - lse)
        grouped = [np.asarray(x, dtype=np.float64).reshape(pb.batch + (pb.hk, pb.group) + np.shape(x)[-1 - (t == 1):])
                   for t, x in enumerate(stats)]
        if rows is not None:
            grouped = [x[..., i_at, :] if t == 1 else x[..., i_at] for t, x in enumerate(grouped)]
        lse, out5 = grouped[0], grouped[1]
        lse_of["flash"] = lse_of["rounded"] = lse_of["exact"] = lse.astype(dtype)[..., None]  # (..., hk, g, sq, 1)
        if len(grouped) > 2:  # the naive's own rows (`GradSizes`'s naive): its LSE's shift and its D_i
            lse_of["rounded"] = (lse + grouped[2]).astype(dtype)[..., None]
            d_of["rounded"] = grouped[3].astype(dtype)[..., None]
        lse_of["eager"], d_of["eager"] = lse_of["rounded"], d_of.get("rounded")

    def softmax(s, group):
        """``(p, p_sink, lse)`` of the scores ``s`` as ``group`` keeps them (``lse`` 0 on rows with no key)."""
        if stats is not None:
            lse = lse_of[group]
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
                raw = t
                capped = dtype(cap) * np.tanh(t / dtype(cap))
                cap_factor = 1.0 - np.tanh(t / dtype(cap)) ** 2  # d/dt of c tanh(t / c)
                t = capped
    if mod_grad is not None:  # the chain rule through score_mod, at the softcapped scores
        b, h = flex.index_grids(pb, ())
        mod_factor = flex.score_values(mod_grad, t, b[..., None, None], h[..., None, None],
                                       i_at[:, None], j_at[None, :], name="score_mod_grad")

    eager_cap = cap is not None and mod_grad is None  # the eager kernel's softcap, forward and back

    def factor_of(p, group):  # d/dt of the score's modifications; where p = 0, ds = 0 whatever g is
        if group == "eager" and eager_cap:  # tanh's derivative 1 - y**2 from the tanh y stored in the type
            y = rnd(np.tanh(rnd(rnd(raw) / dtype(cap))))
            return 1.0 - y * y
        factor = 1.0 if cap is None else cap_factor
        return factor if mod_grad is None else factor * np.where(p > 0, mod_factor, 0.0)

    def group_of(formulation):  # the formulations that keep the same scores
        if prec.is_float64:
            return "exact"
        if formulation == "flash":
            return "flash"  # FlashAttention keeps them in float32
        # An eager kernel (Hugging Face's) stores q k^T, then its scaled product, and each step of a
        # softcap (Gemma 2's) in the type.
        return "eager" if formulation == "eager" else "rounded"

    dp_parts = {}  # dp = dout @ v^T: one product for every formulation, rounded once for those that store it

    def dp_of(stored):
        if "raw" not in dp_parts:
            dp_parts["raw"] = dout5 @ np.swapaxes(v5, -1, -2)  # (..., hk, g, sq, sk)
        if stored and "rounded" not in dp_parts:
            dp_parts["rounded"] = rnd(dp_parts["raw"])
        return dp_parts["rounded" if stored else "raw"]

    groups = list(dict.fromkeys(map(group_of, formulations)))  # a group's formulations one after another
    results, kept = {}, {}
    for at in sorted(range(len(formulations)), key=lambda f: groups.index(group_of(formulations[f]))):
        formulation = formulations[at]
        group = group_of(formulation)
        if group not in kept:  # the scores as this formulation keeps them, and their softmax
            kept.clear()  # (the group before is done with)
            s = (_scores(q5, k5, pb, opts, dtype, rows=rows, cols=keys, eager=prec) if group == "eager"
                 else scores if group in ("flash", "exact") else rnd(scores))
            kept[group] = (s,) + softmax(s, group)
        s, p, p_sink, _ = kept[group]
        results[at] = _dense_grads(formulation, prec, pb, p, p_sink, factor_of(p, group), q5, k5, v5, dout5, sink,
                                   sinks, rows, stats, part, None if stats is None else out5,
                                   cap_chain=cap if group == "eager" and eager_cap else None,
                                   d_rows=d_of.get(group), dp_of=dp_of, dlse=dlse5)
    results = [results[f] for f in range(len(formulations))]
    if several:
        return results
    result, formulation = results[0], formulations[0]
    s, p, p_sink, row_lse = kept[group_of(formulation)]
    factor = factor_of(p, group_of(formulation))
    extra = ()
    if return_abs:
        extra += (_dense_grads(formulation, prec, pb, p, p_sink, factor, np.abs(q5), np.abs(k5), np.abs(v5),
                               np.abs(dout5), sink, sinks, rows, stats, part, None, sign=1.0, dlse=dlse5),)

    def rss():
        # Squares of the terms each entry sums, summed (a GQA group's heads too), rooted.
        p2 = p * p
        dp = dout5 @ np.swapaxes(v5, -1, -2)
        # ds_ij = p_ij (dp_ij - D_i) carries the rounding of dp_ij and of D_i's terms: its
        # size is p_ij (|dp_ij| + sum_j |p_ij dp_ij|) (|D_i| is at most the sum), and, weighted
        # by rss_accumulate, the componentwise sizes |dout| . |v_j| of what dp_ij and D_i sum.
        d1 = np.sum(np.abs(p * dp), axis=-1, keepdims=True)
        if dlse5 is not None:  # D_i - dlse_i: one more term
            d1 = d1 + np.abs(dlse5)
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
        dsink = None if sink is None else np.sum((p_sink * d1) ** 2 * (1.0 + w2 if rss_scores else 1.0), axis=(-2, -1))
        grads = _split_grads(pb, dq, dk.sum(axis=-3), dv.sum(axis=-3), dsink, sinks)
        return tuple(np.sqrt(g) for g in grads)

    if return_rss:
        if not prec.is_float64:
            raise ValueError("return_rss is computed in float64: leave compute_dtype out")
        extra += (rss(),)
    return (result,) + extra if extra else result


def _dense_grads(formulation, prec, pb, p, p_sink, factor, q5, k5, v5, dout5, sink, sinks, rows, stats, part, out5,
                 sign=-1.0, cap_chain=None, d_rows=None, dp_of=None, dlse=None):
    """`dense_backward`'s gradients in one formulation from the weights ``p`` (and the sink's,
    ``p_sink``); ``sign`` -1: the softmax Jacobian; +1: the sizes (``return_abs``), where a factor
    counts by its size.  ``cap_chain``: the softcap ``c`` of an eager kernel, whose backward stores
    each step of the chain rule through ``c tanh(s / c)`` in the type; ``d_rows``: the rows' ``D_i``
    as the formulation has them (with ``stats``; default from ``out``); ``dp_of(stored)``: ``dout @ v^T``
    as computed (``stored`` False) or rounded to the type, shared by the formulations (None: computed here);
    ``dlse``: ``(..., hk, g, sq, 1)`` or None, taken from ``D_i`` (its size added to ``D_i``'s with ``sign`` +1)."""
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
        # One key a step: its one product by a broadcast multiply, bit for bit a matmul's (whose inner
        # size 1 took 2.5x as long: 0.115 s against 0.046 s for (8, 160, 1024) @ (8, 1024, 64)).
        part = ((lambda j: a[..., j:j + 1] * b[..., j:j + 1, :]) if step == 1
                else (lambda j: a[..., j:j + step] @ b[..., j:j + step, :]))
        acc = part(0)
        for j in range(step, n, step):
            acc += part(j)
        return acc

    head = keep  # FlashAttention sums a GQA group's dk, dv before rounding them
    # A part (rows or keys): the gradients whole there only, the others left empty.
    dq_too, kv_too = stats is None, stats is not None or not part
    dv = head(mm(np.swapaxes(p, -1, -2), dout5)) if kv_too else np.zeros(q5.shape[:-2] + (0, v5.shape[-1]), dtype)
    dp = keep(dout5 @ np.swapaxes(v5, -1, -2)) if dp_of is None else dp_of(not flash)  # (..., hk, g, sq, sk)
    if flash and sign < 0:  # D_i = dout_i . out_i, out rounded as the forward stored it, in sequence
        out = rnd(p @ v5 if stats is None else out5).astype(dtype)
        d = np.cumsum(dout5 * out, axis=-1)[..., -1:] if dout5.shape[-1] else np.zeros(p.shape[:-1] + (1,), dtype)
    elif d_rows is not None:  # the naive's own D_i over every key (`GradSizes`'s naive)
        d = d_rows
    elif stats is not None:  # D_i = dout_i . out_i of the output the forward gave (every key's sum)
        d = np.sum(dout5 * out5.astype(dtype), axis=-1, keepdims=True)
    elif sequential and sign < 0 and p.shape[-1]:
        d = np.cumsum(p * dp, axis=-1)[..., -1:]  # key after key
    else:
        d = np.sum(p * dp, axis=-1, keepdims=True)  # D_i = dout_i . out_i
    if dlse is not None:  # a loss of lse too: D_i - dlse_i (sizes: |D_i| + |dlse_i|)
        d = d - dlse if sign < 0 else d + np.abs(dlse)
    if cap_chain is None:
        ds = rnd(p * (dp + sign * d) * (factor if sign < 0 else np.abs(factor)))
    else:  # d/dz, times c, times 1 - y**2, over c: each product stored in the type
        c = dtype(cap_chain)
        ds = rnd(rnd(rnd(rnd(p * (dp + sign * d)) * c) * factor) / c)
    empty_dq, empty_dk = (np.zeros(q5.shape[:-2] + (0, x.shape[-1]), dtype) for x in (q5, k5))
    if formulation == "eager" and not prec.is_float64:  # d(q k^T) = scale * ds, rounded
        ds_scaled = rnd(dtype(pb.scale) * ds)
        dq = rnd(mm(ds_scaled, k5)) if dq_too else empty_dq
        dk = head(mm(np.swapaxes(ds_scaled, -1, -2), q5)) if kv_too else empty_dk
    else:
        dq = rnd(dtype(pb.scale) * mm(ds, k5)) if dq_too else empty_dq
        dk = head(dtype(pb.scale) * mm(np.swapaxes(ds, -1, -2), q5)) if kv_too else empty_dk
    # The sink's value is 0, so dP_sink = 0 and dsink_i = P_sink_i (0 - D_i).
    dsink = None if sink is None else np.sum(sign * p_sink * d, axis=(-2, -1))
    # GQA: the query heads of a group share k and v, so their gradients add up.
    grads = _split_grads(pb, dq, rnd(dk.sum(axis=-3)), rnd(dv.sum(axis=-3)),
                         None if dsink is None else dsink if part else rnd(dsink), sinks)
    # (a part's dsinks, the sum over its rows, stays in the accumulator's type: the parts add up
    # before the one rounding of the whole sum)
    grads = tuple(g if part and i == 3 else g.astype(prec.compute) for i, g in enumerate(grads))
    whole = (dq_too, kv_too, kv_too, True)  # dsinks: the sum over these rows
    return tuple(g if w else None for g, w in zip(grads, whole))


__all__ = ["FORMULATIONS", "dense_backward", "reference_attention_backward"]
