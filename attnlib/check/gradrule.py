"""The gradients' rule (`attnlib.check.rule`'s docstring, *Gradients*): each gradient's reference,
its allowance per entry, and the verdicts."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..core import arrays, problem, validate
from ..core.backward import _score_mod_grad, dense_backward, tiled_backward
from ..core.gradsizes import GradSizes
from ..core.options import Options
from ..judge.gate import C_EXP, LAMBDA, row_stats
from ..judge.sizing import dense_fits
from .naive import _in_threads, naive_gradient_errors, sampled_ratio
from .rule import FINAL_ROUNDINGS, judge, naive_allowance, row_masks, unit, worst_rows
from .shapes import UnusableInput, positions, to_bhsd

#: The largest ``batch * Hq * Sq * Sk * D`` of the long double gradient reference (numpy's
#: long double matmul runs at ~0.4 GFLOP/s: about a minute at this size).
EXTENDED_MAX_WORK = 1 << 31


def gradient_rounding(qh, kh, vh, opts: Options, prec) -> float:
    """``e_g``: a first-order bound on one implementation's gradient error, relative to the
    gradient's componentwise size (`reference_attention_backward` with ``return_abs``).

    In the verdict gate's terms (`attnlib.judge.gate`), with ``u`` the unit roundoff of the
    kernel's type, ``N = max(Sq, Sk)`` and ``delta`` the largest exponent error of any row:
    ``p`` is off by ``2 delta + C_EXP u + h`` relative (``h = g(N) + 2 N u``, the row sum,
    its sequential steps at the worst case), ``dp = dout . v`` by ``g(Dv)``, ``D`` by
    ``p``'s error plus ``h + g(Dv)``, ``ds = p (dp - D)`` by the sum of those relative to
    ``p (|dp| + |D|)``, and ``ds @ k`` (or ``ds^T @ q``, ``p^T @ dout``) adds ``h`` and a
    rounding::

        e_g = 4 delta + 2 C_EXP u + 4 g(N) + 8 N u + 2 g(Dv) + 3 u

    Two implementations (the kernel and the dense reference) differ by ``2 e_g`` times the
    size.  Not derived for softcap, whose derivative ``1 - tanh^2`` loses its relative
    accuracy where it is small.
    """
    u = float(np.finfo(prec.accumulate).eps) / 2
    sigma = float(row_stats(qh, kh, options=row_masks(opts))[0].max(initial=0.0))

    def g(n):
        return LAMBDA * math.sqrt(n) * u

    n, d, dv = max(qh.shape[-2], kh.shape[-2]), qh.shape[-1], vh.shape[-1]
    delta = g(d + 1) * sigma + 3 * u * sigma
    return 4 * delta + 2 * C_EXP * u + 4 * g(n) + 8 * n * u + 2 * g(dv) + 3 * u


def _split_qv(d, ref_grads, allowances, naive_errs, unjudged, units):
    """The joined problem's ``(ref, allowance, naive error, unit)`` per gradient as the kernel's
    ``dq, dqv, dk, dv`` (`judge_grads`'s ``qv_dim``)."""
    def parts(x):
        if x is None:
            return None
        dq, dk, dv = x.get("dq"), x.get("dk"), x.get("dv")
        out = {"dq": None if dq is None else dq[..., :d], "dqv": None if dq is None else dq[..., d:],
               "dk": None if dk is None else dk[..., :d],
               "dv": None if dv is None or dk is None else dv + dk[..., d:]}
        return out | {n: y for n, y in x.items() if n not in ("dq", "dk", "dv")}  # dsinks

    skipped = unjudged | {part: unjudged[n] for n, part in (("dq", "dqv"), ("dk", "dv")) if n in unjudged}
    return parts(ref_grads), parts(allowances), parts(naive_errs), skipped, parts(units)


@dataclass
class ExpectedGrads:
    """A problem's reference gradients and what a correct kernel's may differ from them by, per
    name (``dq``, ``dk``, ``dv``, ``dsinks``; bhsd, dsinks as ``(..., H, 1, 1)``): ``allowance``
    None where none is made (``why``), ``unjudged`` the names without a verdict and why.  Two
    add up to the gradients of a sum of the two problems' losses, the allowances (and naive
    errors) added: a bound on the error of the sum (`attnlib.check.dropout`)."""

    ref: dict
    allowance: dict | None
    naive: dict
    unjudged: dict
    units: dict
    why: str = ""

    def __add__(self, other: "ExpectedGrads") -> "ExpectedGrads":
        def add(a, b):
            return None if a is None or b is None else a + b
        both = None if self.allowance is None or other.allowance is None else \
            {n: self.allowance[n] + other.allowance[n] for n in self.allowance}
        return ExpectedGrads({n: self.ref[n] + other.ref[n] for n in self.ref}, both,
                             {n: add(self.naive.get(n), other.naive.get(n)) for n in self.ref},
                             other.unjudged | self.unjudged,
                             {n: add(self.units.get(n), other.units.get(n)) for n in self.ref if n in self.units},
                             self.why or other.why)


def judge_grads(kernel_grads, qh, kh, vh, ref, ref_lse, douth, prec, opts: Options, layout, shape,
                workers, context=None, mod_grad=None, device=None, qv_dim=None, scores=None, dlse=None,
                expected=None) -> dict:
    """The gradients' rule (`attnlib.check.rule`'s docstring) on each given gradient, against
    ``expected`` (an `ExpectedGrads`; default `expect_grads` of the problem).  ``context`` (a
    dict): filled with each judged gradient's ``kernel``, ``ref`` and ``allowance`` (bhsd,
    float64) for the diagnosis."""
    if expected is None:
        expected = expect_grads(kernel_grads, qh, kh, vh, ref, ref_lse, douth, prec, opts, layout, shape, workers,
                                mod_grad, device, qv_dim, scores, dlse)
    ref_grads, allowances, naive_errs, unjudged, units = (expected.ref, expected.allowance, expected.naive,
                                                          expected.unjudged, expected.units)

    def per_head(name, x):  # dsinks (..., H) as (..., H, 1, 1), a head's one entry
        return x[..., None, None] if name == "dsinks" else x

    def verdict(name, g):  # (verdict, the diagnosis's context or None)
        if name == "dsinks":
            kernel = per_head(name, np.asarray(g, dtype=np.float64))
            if kernel.shape != ref_grads[name].shape:
                raise UnusableInput(f"dsinks must have the shape of the sinks, {ref_grads[name].shape[:-2]}, "
                                    f"got {np.shape(g)}")
            describe = positions("sink")
        else:
            kernel = to_bhsd(g, layout).astype(np.float64)
            describe = positions("query" if name in ("dq", "dqv") else "key")
        if allowances is None or name in unjudged:
            v = judge(name, kernel, ref_grads[name], np.inf, None, describe)[0]
            v.passed, v.ratio = None, None
            v.notes.append(f"no verdict: {unjudged.get(name, expected.why)}")
            return v, None
        v = judge(name, kernel, ref_grads[name], allowances[name], naive_errs[name], describe, units.get(name))[0]
        return v, dict(kernel=kernel, ref=ref_grads[name], allowance=allowances[name])

    # Each gradient's verdict on a thread (numpy's sorts and passes release the GIL).
    given = [(name, g) for name, g in kernel_grads.items() if g is not None]
    found = _in_threads([functools.partial(verdict, name, g) for name, g in given], validate.workers(workers))
    if context is not None:
        context.update({name: c for (name, _), (_, c) in zip(given, found) if c is not None})
    return {name: v for (name, _), (v, _) in zip(given, found)}


def expect_grads(kernel_grads, qh, kh, vh, ref, ref_lse, douth, prec, opts: Options, layout, shape,
                 workers, mod_grad=None, device=None, qv_dim=None, scores=None, dlse=None,
                 d_terms=None) -> ExpectedGrads:
    """The problem's `ExpectedGrads` by the gradients' rule.  ``kernel_grads``: the kernel's (its
    worst rows join the naive's sample; ``{}``: none); ``mod_grad``: the ``score_mod_grad``
    (required with a ``score_mod``); ``device``: where the tiled float64 gradients (the lengths
    at which the dense ones do not fit) are computed with torch (`attnlib.core.torch_backend`).
    ``qv_dim``: q's head dim ``D`` when ``qh``, ``kh`` are MLA's joined ``[q, qv]``, ``[k, v]``
    (`attnlib.core.mla`): the kernel's ``dq``, ``dqv``, ``dk`` are judged by the joined
    gradients' parts, its ``dv`` by ``dv_p + dk'[..., D:]`` with the two allowances (and naive
    errors) added, a bound on the error of the sum.  ``dlse``: the loss's gradient with respect to the
    natural LSE, ``(..., Hq, Sq)`` (`attnlib.core.backward.attention_backward`'s), or None; ``d_terms``:
    `~attnlib.core.gradsizes.GradSizes`'s (another problem's ``D_i`` that ``dlse`` carries)."""
    mod_grad = _score_mod_grad(mod_grad, opts)  # refused as the backward's keyword arguments are
    heads = shape["batch"] * shape["hq"]
    sq, sk = shape["sq"], shape["sk"]
    # dsinks: the sinks' gradient, (H,) or (batch, H), when the problem has sinks.
    names = ("dq", "dk", "dv") + (("dsinks",) if opts.sinks is not None else ())
    # float64 softcap's dense long double gradient holds about twice the forward's (heads, Sq, Sk)
    # arrays (measured: 528 MiB against 384 MiB at n = 4096), with its sizes twice that.
    dense = dense_fits(sq, heads=4 * heads, sk=sk)
    allowances, naive_errs, unjudged, units = None, {}, {}, {}  # units: each entry's u (`unit`), for ulps

    def per_head(name, x):  # dsinks (..., H) as (..., H, 1, 1), a head's one entry
        return x[..., None, None] if name == "dsinks" else x

    expanded = False  # dsinks already (..., H, 1, 1)
    why = "the dense gradient the rule needs would not fit in memory at this length"
    if prec.is_float64 and opts.softcap is None:
        # float64: the first-order rounding bound on the componentwise size, summed beside the
        # gradients tile by tile (any length).
        grads, sizes = tiled_backward(qh, kh, vh, ref, ref_lse, douth, opts, mod_grad, workers=workers, dev=device,
                                      sizes=GradSizes(componentwise=True, d_terms=d_terms), dlse=dlse)
        ref_grads = {n: np.asarray(arrays.as_numpy(g, n), dtype=np.float64) for n, g in zip(names, grads)}
        sizes = {n: np.asarray(arrays.as_numpy(g, n), dtype=np.float64) for n, g in zip(names, sizes)}
        e_g = gradient_rounding(qh, kh, vh, opts, prec)
        allowances = {n: 2 * e_g * sizes[n] for n in names}
        units = {n: unit(sizes[n], np.float64) for n in names}
        naive_errs = dict.fromkeys(names)
    elif not prec.is_float64:
        # The naive backward in the kernel's precision, in ulps of each entry's own size: the
        # reference and the sizes in one tiled pass, the naive on a sample (`naive_gradient_errors`).
        accumulate = float(np.finfo(prec.accumulate).eps) / prec.eps  # float32 sums of 16-bit values
        # (flush: the weights below the accumulator's smallest normal, which GPU exponentials flush to zero)
        grads, rss, naive_rows, flushed = tiled_backward(
            qh, kh, vh, ref, ref_lse, douth, opts, mod_grad, workers=workers, dev=device, dlse=dlse,
            sizes=GradSizes(accumulate, accumulate * scores, naive=prec, flush=float(arrays.finfo(prec.accumulate).tiny),
                            d_terms=d_terms))
        ref_grads = {n: per_head(n, np.asarray(arrays.as_numpy(g, n), dtype=np.float64)) for n, g in zip(names, grads)}
        rss = {n: per_head(n, np.asarray(arrays.as_numpy(g, n), dtype=np.float64)) for n, g in zip(names, rss)}
        flushed = {n: per_head(n, np.asarray(arrays.as_numpy(g, n), dtype=np.float64)) for n, g in zip(names, flushed)}
        expanded = True
        units = {n: unit(np.abs(ref_grads[n]) + rss[n], prec.compute) for n in names}
        # The positions that count (a visible key or row) and the kernel's worst (they join the sample).
        seen = {"dq": np.isfinite(ref_lse).reshape(-1, sq).any(axis=0),
                "dk": ((rss["dk"] > 0).any(axis=-1) | (rss["dv"] > 0).any(axis=-1)).reshape(-1, sk).any(axis=0)}
        def kernel_worst(n):  # the kernel's worst rows (keys) of gradient n, or None; on threads
            g = kernel_grads.get(n)
            g = None if g is None or qv_dim is not None else to_bhsd(np.asarray(g, dtype=np.float64), layout)
            if g is not None and g.shape == ref_grads[n].shape:
                return worst_rows(g, ref_grads[n], np.abs(ref_grads[n]) + rss[n], prec.compute)
            return None

        worst = {}
        for at, found in zip(("dq", "dk", "dk"), _in_threads([functools.partial(kernel_worst, n) for n in ("dq", "dk", "dv")],
                                                            validate.workers(workers))):
            if found is not None:
                worst[at] = found if at not in worst else np.union1d(worst[at], found)
        # The sampled keys' rows as the naive backward has them: the reference's, and its own shift and D_i.
        stats = (ref_lse, ref) + tuple(np.asarray(arrays.as_numpy(x, "the naive rows"), dtype=np.float64)
                                       for x in naive_rows)
        naive_errs, draws = naive_gradient_errors(qh, kh, vh, douth, opts, mod_grad, prec, ref_grads, stats, seen,
                                                  worst, workers, dlse=dlse)
        top = float(arrays.finfo(prec.compute).max)
        allowances = {}
        for n in names:
            biggest = float(np.abs(ref_grads[n]).max(initial=0.0))
            if biggest > top:
                unjudged[n] = (f"the true {n} reaches {biggest:.3g}, beyond {prec.name}'s range "
                               f"({top:.5g}): no {prec.name} kernel can hold it; scale dout or v down")
            elif naive_errs[n] is None:
                unjudged[n] = (f"plain attention's {n} in {prec.name} overflows in every formulation "
                               f"(dp = dout . v or ds beyond the type's range): there is no "
                               f"{prec.name} baseline to judge it by; scale dout or v down")
            else:
                at = seen["dq"] if n == "dq" else (seen["dk"] if n != "dsinks" else np.ones(1, bool))
                r = sampled_ratio(draws[n], units[n], at[:, None], "head")
                # and twice what a kernel that flushes the weights below float32's normal range drops (a
                # naive that flushed would err that much; numpy's keeps them): a float32 decode's dv from
                # such a kernel failed at 7,760 allowances without it
                allowances[n] = (2 * r + FINAL_ROUNDINGS) * units[n] + 2 * flushed[n]
    else:
        grads = tiled_backward(qh, kh, vh, ref, ref_lse, douth, opts, mod_grad, workers=workers, dev=device, dlse=dlse)
        ref_grads = {n: arrays.as_numpy(g, n) for n, g in zip(names, grads)}
        # float64 softcap: against a long double reference, so the naive errs for real.
        ext = problem.extended_precision()
        if ext is None or heads * sq * sk * qh.shape[-1] > EXTENDED_MAX_WORK:
            why = ("float64 softcap gradients are judged against a long double dense gradient, "
                   "which this platform lacks or which has no BLAS at this size")
        elif dense:
            ref_grads = dict(zip(names, dense_backward(qh, kh, vh, douth, opts, mod_grad, compute_dtype=ext, dlse=dlse)))
            naive, rss = dense_backward(qh, kh, vh, douth, opts, mod_grad, return_rss=True, dlse=dlse)
            naive_errs = {n: np.abs(x - ref_grads[n]).astype(np.float64) for n, x in zip(names, naive)}
            units = {n: unit(np.abs(ref_grads[n].astype(np.float64)) + r, np.float64) for n, r in zip(names, rss)}
            allowances = {n: naive_allowance(naive_errs[n], units[n]) for n in names}
    if allowances is not None and not expanded:
        allowances = {n: per_head(n, np.asarray(a)) for n, a in allowances.items()}
        naive_errs = {n: None if e is None else per_head(n, np.asarray(e)) for n, e in naive_errs.items()}
        units = {n: per_head(n, np.asarray(x)) for n, x in units.items()}
    if not expanded:
        ref_grads = {n: per_head(n, np.asarray(r, dtype=np.float64)) for n, r in ref_grads.items()}
    if qv_dim is not None:
        ref_grads, allowances, naive_errs, unjudged, units = _split_qv(qv_dim, ref_grads, allowances, naive_errs,
                                                                       unjudged, units)
    return ExpectedGrads(ref_grads, allowances, naive_errs, unjudged, units, why)
