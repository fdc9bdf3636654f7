"""A verdict on someone else's attention kernel, from the tensors it read and wrote.

The rule is the one FlashAttention's tests apply and its maintainers answer with by hand:
a kernel computing in a low precision is correct when its error against an exact
reference is at most twice the error of plain attention in the same precision, plus that
precision's epsilon::

    max |kernel - ref| <= 2 * max |naive - ref| + eps(dtype)

Here ``ref`` is attnlib's float64 tiled kernel (any length, bounded memory) on the
kernel's own inputs, and ``naive`` is the dense reference in the kernel's precision
(`reference_attention` with ``compute_dtype``), or the tiled kernel in that precision where
the dense one would not fit.  The rule is applied per head, so that a bug in one head is
not hidden by another head's larger rounding.  When the output fails, the check looks for
the usual causes: other scales, masks and layouts the output would match, and where along
the query positions the error starts and how it grows.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _args
from .backward import attention_backward, reference_attention_backward
from .memory import dense_fits
from .reference import reference_attention
from .tensorio import TensorFileError, load_tensor, split_spec
from .tiled import attention

LAYOUTS = ("bshd", "bhsd")
TENSORS = ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv")
_AXES = {"bshd": "(batch, seqlen, nheads, headdim)", "bhsd": "(batch, nheads, seqlen, headdim)"}


class UnusableInput(ValueError):
    """Inputs the check cannot judge (exit code 2); the message names the tensor and why."""


@dataclass
class TensorVerdict:
    """The rule applied to one output tensor (``out``, ``lse``, ``dq``, ``dk`` or ``dv``)."""

    name: str
    max_err: float
    median_err: float
    naive_max: float | None  # None: no naive baseline (no verdict)
    bound: float | None
    passed: bool | None  # None: reported, not judged
    heads: list = field(default_factory=list)  # per head: head, max, median, naive_max, passed
    worst: list = field(default_factory=list)  # the largest errors: position, kernel, ref, err
    nonfinite: int = 0
    nonfinite_at: list = field(default_factory=list)
    notes: list = field(default_factory=list)


@dataclass
class KernelCheck:
    """Everything `check_kernel` found; `format_text` prints it."""

    shape: dict
    options: dict
    dtype: str
    eps: float
    baseline: str
    out: TensorVerdict
    lse: TensorVerdict | None
    grads: dict
    row_err: np.ndarray  # (Sq,) max kernel error per query position
    row_naive: np.ndarray  # (Sq,) the naive baseline's
    head_row_err: np.ndarray  # (Hq, Sq) max kernel error per head and query position
    errors: np.ndarray  # a sample of kernel |out - ref| (for histograms)
    naive_errors: np.ndarray  # the naive baseline's, same positions
    trend: str
    diagnosis: list

    @property
    def passed(self) -> bool:
        judged = [self.out] + ([self.lse] if self.lse else []) + list(self.grads.values())
        return all(v.passed is not False for v in judged)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1


def to_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    """A view of ``x`` in attnlib's ``(..., H, S, D)`` layout."""
    return np.swapaxes(x, -2, -3) if layout == "bshd" and x.ndim >= 3 else x


def check_kernel(q, k, v, out, *, lse=None, dout=None, dq=None, dk=None, dv=None,
                 layout="bshd", dtype=None, causal=False, causal_align="bottom_right",
                 window=None, softcap=None, scale=None, kv_lengths=None, workers=1,
                 names=None) -> KernelCheck:
    """Judge a kernel's ``out`` (and ``lse``, gradients) against the float64 reference.

    Parameters
    ----------
    q, k, v : ndarray
        The kernel's inputs, as it read them: ``(batch, seqlen, nheads, headdim)`` for
        ``layout="bshd"`` (FlashAttention's), ``(batch, nheads, seqlen, headdim)`` for
        ``"bhsd"`` (PyTorch SDPA's); 3-D without the batch axis, 2-D ``(seqlen, headdim)``.
    out : ndarray
        The kernel's output, in the layout of ``q`` with ``headdim`` of ``v``.  NaN or inf
        in it is a failure, reported with its positions.
    lse : ndarray, optional
        ``(batch, nheads, seqlen_q)`` in both layouts (as FlashAttention and PyTorch return
        it); rows without a visible key may hold ``-inf`` or ``+inf``.
    dout, dq, dk, dv : ndarray, optional
        The upstream gradient and the kernel's gradients (layouts of out, q, k, v).
    layout : {"bshd", "bhsd"}
    dtype : {None, "float64", "float32", "float16", "bfloat16"}
        The kernel's compute precision; default: the type ``q`` is held in.
    causal, causal_align, window, softcap, scale, kv_lengths
        The attention the kernel computes, as in `attention`.
    workers : int
        Threads for the float64 reference.
    names : dict, optional
        How messages name each tensor (e.g. ``{"q": "--q q.npy"}``).

    Returns
    -------
    KernelCheck

    Raises
    ------
    UnusableInput
        Inconsistent shapes (with a hint when the layout looks swapped), non-float data,
        NaN or inf in the inputs.
    """
    names = {n: n for n in TENSORS} | (names or {})
    if layout not in LAYOUTS:
        raise UnusableInput(f"layout must be one of {LAYOUTS}, got {layout!r}")
    given = {n: x for n, x in dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, dq=dq, dk=dk,
                                   dv=dv).items() if x is not None}
    for n, x in given.items():
        if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
            raise UnusableInput(f"{names[n]}: expected a floating-point array, got "
                                f"{getattr(x, 'dtype', type(x).__name__)}")
    shape = _check_shapes(given, layout, names)
    for n in ("q", "k", "v", "dout"):
        if n in given and not np.isfinite(given[n]).all():
            bad = np.argwhere(~np.isfinite(given[n]))[:3].tolist()
            raise UnusableInput(f"{names[n]}: holds NaN or inf (first at {bad}); the inputs must be finite")
    if (dq is not None or dk is not None or dv is not None) and dout is None:
        raise UnusableInput("gradients were given without dout (the upstream gradient they answer)")
    try:
        prec = _args.precision(dtype if dtype is not None else q.dtype.name)
    except ValueError as e:
        raise UnusableInput(str(e)) from None
    options = dict(causal=causal, causal_align=causal_align, window=window, softcap=softcap,
                   scale=scale, kv_lengths=kv_lengths)
    qh, kh, vh = (to_bhsd(x, layout).astype(np.float64) for x in (q, k, v))
    try:
        ref, ref_lse = attention(qh, kh, vh, return_lse=True, workers=workers, **options)
    except (ValueError, TypeError) as e:  # e.g. kv_lengths of the wrong shape
        raise UnusableInput(str(e)) from None
    heads = shape["batch"] * shape["hq"]
    dense = dense_fits(max(shape["sq"], shape["sk"]), heads=heads)
    if dense:
        naive, naive_lse = reference_attention(qh, kh, vh, return_lse=True, compute_dtype=prec.name, **options)
        baseline = f"dense {prec.name}"
    else:
        naive, naive_lse = attention(qh, kh, vh, return_lse=True, compute_dtype=prec.name,
                                     workers=workers, **options)
        baseline = f"tiled {prec.name} (dense would not fit in memory)"
    kernel = to_bhsd(out, layout).astype(np.float64)
    naive = naive.astype(np.float64)
    verdict, err, naive_err = _judge("out", kernel, ref, naive, prec.eps, _positions())
    row_err = _max_over(err, keep=-2)  # (Sq,)
    row_naive = _max_over(naive_err, keep=-2)
    head_row_err = err.max(axis=-1) if err.ndim >= 3 else err.max(axis=-1)[None]
    head_row_err = head_row_err.reshape((-1,) + head_row_err.shape[-2:]).max(axis=0)  # (Hq, Sq)
    if verdict.nonfinite:
        empty = ~np.isfinite(ref_lse)[..., None] & ~np.isfinite(kernel)
        if empty.sum() == verdict.nonfinite:
            verdict.notes.append("all of them in rows with no visible key, where the output must be 0 "
                                 "(typically a 0 / 0 in the kernel's final normalisation)")
    trend = _trend(row_err, row_naive)
    diagnosis = []
    if verdict.passed is False:
        diagnosis = _diagnose(kernel, qh, kh, vh, options, verdict, row_err, shape, layout, given, prec,
                              dense, workers)
    lse_verdict = None
    if lse is not None:
        lse_verdict = _judge_lse(np.asarray(lse, dtype=np.float64), ref_lse, naive_lse, prec)
    grads = {}
    if dout is not None and any(x is not None for x in (dq, dk, dv)):
        # The dense gradient holds about twice the forward's (heads, Sq, Sk) arrays
        # (measured: 528 MiB against 384 MiB at n = 4096).
        dense_grad = dense_fits(max(shape["sq"], shape["sk"]), heads=2 * heads)
        grads = _judge_grads(dict(dq=dq, dk=dk, dv=dv), qh, kh, vh, ref, ref_lse,
                             to_bhsd(dout, layout).astype(np.float64), prec, options, layout,
                             dense_grad, workers)
    rng = np.random.default_rng(0)
    sample = rng.choice(err.size, size=min(err.size, 200_000), replace=False) if err.size > 200_000 else slice(None)
    return KernelCheck(shape=shape, options=options, dtype=prec.name, eps=prec.eps, baseline=baseline,
                       out=verdict, lse=lse_verdict, grads=grads, row_err=row_err, row_naive=row_naive,
                       head_row_err=head_row_err, errors=err.ravel()[sample],
                       naive_errors=naive_err.ravel()[sample], trend=trend, diagnosis=diagnosis)


# -- shapes ----------------------------------------------------------------------------------

def _dims(x, layout):
    """``(batch, s, h, d)`` of a tensor in ``layout`` (batch ``()`` below 4-D, h 1 at 2-D)."""
    if x.ndim == 2:
        return (), x.shape[0], 1, x.shape[1]
    if x.ndim == 3:
        s, h = (x.shape[0], x.shape[1]) if layout == "bshd" else (x.shape[1], x.shape[0])
        return (), s, h, x.shape[2]
    if x.ndim == 4:
        b = x.shape[0]
        s, h = (x.shape[1], x.shape[2]) if layout == "bshd" else (x.shape[2], x.shape[1])
        return (b,), s, h, x.shape[3]
    return None


def _shape_problem(given, layout):
    """The first inconsistency as ``(tensor, message)``, or ``(None, dims)`` when consistent."""
    q, k, v = given["q"], given["k"], given["v"]
    if not (q.ndim == k.ndim == v.ndim) or q.ndim not in (2, 3, 4):
        return "q", (f"q, k and v must all be 4-D {_AXES[layout]}, 3-D without batch or 2-D "
                     f"(seqlen, headdim); got q {q.shape}, k {k.shape}, v {v.shape}")
    (bq, sq, hq, d), (bk, sk, hk, dk), (bv, sv, hv, dv) = (_dims(x, layout) for x in (q, k, v))
    if bq != bk or bq != bv:
        return "k", f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}"
    if dk != d:
        return "k", f"k has head dim {dk}, q has {d} ({layout} shapes q {q.shape}, k {k.shape})"
    if (sv, hv) != (sk, hk):
        return "v", f"v {v.shape} must have the seqlen and heads of k {k.shape} ({layout})"
    if hq % hk:
        return "q", f"q has {hq} heads, not a multiple of k's {hk} ({layout} shapes q {q.shape}, k {k.shape})"
    dims = dict(batch=int(np.prod(bq, dtype=np.int64)), sq=sq, sk=sk, hq=hq, hk=hk, d=d, dv=dv,
                squeeze=q.ndim == 2)
    expected = {"out": _like(q, dv), "dq": q.shape, "dk": k.shape, "dv": v.shape, "dout": _like(q, dv),
                "lse": bq + ((hq,) if q.ndim > 2 else ()) + (sq,)}
    for n, shape in expected.items():
        if n in given and given[n].shape != tuple(shape):
            return n, f"{n} must have shape {tuple(shape)} (like {'q' if n != 'lse' else '(batch, nheads, seqlen_q)'} in {layout}), got {given[n].shape}"
    return None, dims


def _like(q, dv):
    return q.shape[:-1] + (dv,)


def _check_shapes(given, layout, names):
    bad, found = _shape_problem(given, layout)
    if bad is None:
        return found
    other = LAYOUTS[1 - LAYOUTS.index(layout)]
    hint = ""
    if _shape_problem(given, other)[0] is None:
        hint = f"; these shapes fit --layout {other} {_AXES[other]}"
    elif bad in ("out", "dout", "dq") and given[bad].ndim >= 3:
        swapped = dict(given)
        swapped[bad] = np.swapaxes(given[bad], -2, -3)
        if _shape_problem(swapped, layout)[0] is None:
            hint = (f"; {bad} looks like {other} {_AXES[other]} while the inputs are {layout}: "
                    "the kernel wrote it in the other layout")
    raise UnusableInput(f"{names[bad]}: {found}{hint}")


def _positions(pos="query"):
    """Maps an index into the ``(..., H, S, X)`` arrays to the user's words."""
    def describe(idx):
        *lead, s, x = (int(i) for i in idx)
        return {"batch": lead[0] if len(lead) > 1 else 0, pos: s, "head": lead[-1] if lead else 0, "dim": x}
    return describe


# -- the rule --------------------------------------------------------------------------------

def _max_over(err, keep):
    """Max over every axis but ``keep``."""
    axes = tuple(a for a in range(err.ndim) if a != err.ndim + keep)
    return err.max(axis=axes)


def _judge(name, kernel, ref, naive, eps, describe):
    """The rule on one tensor: ``(verdict, |kernel - ref|, |naive - ref|)``; NaN/inf in the
    kernel count as failures and as error 0 in the arrays (their positions are listed)."""
    finite = np.isfinite(kernel)
    nonfinite = int(finite.size - np.count_nonzero(finite))
    err = np.abs(np.where(finite, kernel, 0.0) - ref)
    naive_err = None if naive is None else np.abs(naive - ref)
    naive_max = None if naive_err is None else float(naive_err.max(initial=0.0))
    bound = None if naive_max is None else 2 * naive_max + eps
    max_err = float(err.max(initial=0.0))
    heads = []
    if err.ndim >= 3:
        h_err = np.moveaxis(err, -3, 0).reshape(err.shape[-3], -1)
        h_fin = np.moveaxis(finite, -3, 0).reshape(err.shape[-3], -1)
        h_naive = None if naive_err is None else np.moveaxis(naive_err, -3, 0).reshape(err.shape[-3], -1)
        for h in range(err.shape[-3]):
            nm = None if h_naive is None else float(h_naive[h].max(initial=0.0))
            hm = float(h_err[h].max(initial=0.0))
            heads.append({"head": h, "max": hm, "median": float(np.median(h_err[h])), "naive_max": nm,
                          "passed": None if nm is None else bool(hm <= 2 * nm + eps and h_fin[h].all())})
    if bound is None:
        passed = None
    elif heads:
        passed = all(h["passed"] for h in heads)
    else:
        passed = bool(max_err <= bound and nonfinite == 0)
    flat = err.ravel()
    top = np.argsort(flat)[::-1][:5] if flat.size <= 5 else np.argpartition(flat, -5)[-5:]
    top = top[np.argsort(flat[top])[::-1]]
    worst = [dict(describe(np.unravel_index(i, err.shape)), kernel=float(kernel.ravel()[i]),
                  ref=float(ref.ravel()[i]), err=float(flat[i])) for i in top]
    at = [describe(ix) for ix in np.argwhere(~finite)[:5]]
    verdict = TensorVerdict(name=name, max_err=max_err, median_err=float(np.median(err)), naive_max=naive_max,
                            bound=bound, passed=passed if nonfinite == 0 else False, heads=heads,
                            worst=worst, nonfinite=nonfinite, nonfinite_at=at)
    return verdict, err, naive_err


def _judge_lse(lse, ref_lse, naive_lse, prec) -> TensorVerdict:
    """``lse``: rows without a visible key have ``ref = -inf``; the kernel may write -inf
    (attnlib, PyTorch) or +inf (FlashAttention) there."""
    ref_lse = ref_lse.reshape(lse.shape)
    naive_lse = np.asarray(naive_lse, dtype=np.float64).reshape(lse.shape)
    empty = np.isneginf(ref_lse)
    wrong_empty = int(np.count_nonzero(empty & ~np.isinf(lse)))
    k = np.where(empty, 0.0, lse)  # empty rows are judged by wrong_empty alone
    r = np.where(empty, 0.0, ref_lse)
    n = np.where(empty, 0.0, naive_lse)
    eps = float(np.finfo(prec.accumulate).eps)
    # As (..., H, S, 1) arrays, so that the per-head rule and positions work as for out.
    k, r, n = ((x[None] if x.ndim == 1 else x)[..., None] for x in (k, r, n))
    verdict = _judge("lse", k, r, n, eps, _positions())[0]
    for w in verdict.worst:
        w.pop("dim")
    if wrong_empty:
        verdict.passed = False
        verdict.notes.append(f"{wrong_empty} rows without a visible key have a finite lse (expected -inf or +inf)")
    return verdict


def _judge_grads(kernel_grads, qh, kh, vh, ref, ref_lse, douth, prec, options, layout, dense,
                 workers) -> dict:
    ref_grads = dict(zip(("dq", "dk", "dv"), attention_backward(
        qh, kh, vh, ref, ref_lse, douth, workers=workers, **options)))
    naive_grads = None
    if dense:
        naive_grads = dict(zip(("dq", "dk", "dv"), reference_attention_backward(
            qh, kh, vh, douth, compute_dtype=prec.name, **options)))
    verdicts = {}
    for name, g in kernel_grads.items():
        if g is None:
            continue
        naive = None if naive_grads is None else naive_grads[name].astype(np.float64)
        v = _judge(name, to_bhsd(g, layout).astype(np.float64), ref_grads[name], naive, prec.eps,
                   _positions("query" if name == "dq" else "key"))[0]
        if naive is None:
            v.notes.append("no verdict: the naive baseline is the dense gradient, which would not "
                           "fit in memory at this length")
        verdicts[name] = v
    return verdicts


# -- diagnosis -------------------------------------------------------------------------------

def _trend(row_err, row_naive) -> str:
    """How the kernel's error runs along the query positions, relative to the naive baseline.

    Rounding alone makes errors depend on the position (early rows average fewer keys), for
    the naive baseline too; a bug shows as the kernel/naive ratio growing or shrinking by
    10x or more between the first and the last eighth of the positions.
    """
    if row_err.size < 16:
        return "too few query positions to tell"
    tiny = np.finfo(np.float64).tiny
    eighths = np.array_split(np.arange(row_err.size), 8)
    ratio = [max(row_err[e].max(), tiny) / max(row_naive[e].max(), tiny) for e in (eighths[0], eighths[-1])]
    words = "kernel/naive: first eighth of the positions {:.3g}x, last {:.3g}x".format(*ratio)
    if ratio[1] >= 10 * ratio[0]:
        return f"grows with the query position ({words})"
    if ratio[0] >= 10 * ratio[1]:
        return f"shrinks with the query position ({words})"
    if max(ratio) <= 2:
        return f"tracks the naive baseline ({words})"
    return f"no trend ({words})"


def _diagnose(kernel, qh, kh, vh, options, verdict, row_err, shape, layout, given, prec, dense,
              workers) -> list:
    """Likely causes of a failing output: alternatives it matches, and where errors start."""
    found = []
    bad_rows = np.flatnonzero(row_err > verdict.bound)
    if bad_rows.size and bad_rows[0] >= 16:
        r = int(bad_rows[0])
        tile = 1 << (r.bit_length() - 1)  # the largest power of two <= r
        if r - tile < tile // 2:
            found.append(
                f"every row before query position {r} is within the bound, and {r} is just past "
                f"{tile}: rows whose keys fit in one tile of {tile} are right, so the error comes "
                "from combining key tiles (e.g. a missing rescale of the running sum and output "
                "when a later tile raises the row max)")
    # Alternatives, tried on the first batch entry (the full length, so causal alignment holds).
    q0, k0, v0, kern0 = (x[:1] if x.ndim == 4 else x for x in (qh, kh, vh, kernel))
    if options["kv_lengths"] is not None and qh.ndim == 4:
        options = options | {"kv_lengths": np.ravel(options["kv_lengths"])[:1]}
    d = qh.shape[-1]
    s0 = options["scale"] if options["scale"] is not None else 1.0 / math.sqrt(d)
    log2e = 1.0 / math.log(2.0)
    alternatives = [
        (dict(scale=1.0), "scale 1 (the softmax scale is never applied)"),
        (dict(scale=1.0 / d), f"scale 1/D = {1.0 / d:.4g} instead of {s0:.4g} (the scale applied twice, or 1/D for 1/sqrt(D))"),
        (dict(scale=s0 * log2e), "scale x log2(e) (an exp2-based softmax given a pre-multiplied scale)"),
        (dict(scale=s0 / log2e), "scale / log2(e) (an exp2-based softmax without the log2(e) factor)"),
    ]
    if options["causal"]:
        alternatives.append((dict(causal=False), "no causal mask"))
        left = (options["window"] or (None, None))[0]
        alternatives.append((dict(causal=False, window=(left, 1)),
                             "a causal mask that lets each query see one future key (off by one)"))
        if shape["sq"] != shape["sk"]:
            other = "top_left" if options["causal_align"] == "bottom_right" else "bottom_right"
            alternatives.append((dict(causal_align=other), f"causal alignment {other} instead of {options['causal_align']}"))
    else:
        alternatives.append((dict(causal=True), "a causal mask (bottom_right) that was not asked for"))
    if options["kv_lengths"] is not None:
        alternatives.append((dict(kv_lengths=None), "kv_lengths ignored (padding keys attended)"))

    def matches(kern, change, inputs=(q0, k0, v0)):
        """The rule again, for the problem changed by ``change`` (its own naive baseline)."""
        alt = attention(*inputs, workers=workers, **(options | change))
        if dense:
            naive = reference_attention(*inputs, compute_dtype=prec.name, **(options | change))
        else:
            naive = attention(*inputs, compute_dtype=prec.name, workers=workers, **(options | change))
        alt_bound = 2 * float(np.abs(naive.astype(np.float64) - alt).max(initial=0.0)) + prec.eps
        return float(np.nanmax(np.abs(kern - alt), initial=0.0)) <= alt_bound

    for change, words in alternatives:
        try:
            if matches(kern0, change):
                found.append(f"the output matches attention with {words}")
        except ValueError:
            continue
    other = LAYOUTS[1 - LAYOUTS.index(layout)]
    if given["out"].ndim >= 3 and _shape_problem(given, other)[0] is None:
        # Every tensor in the other layout (they fit it too): the kernel's own convention?
        q1, k1, v1, kern1 = (to_bhsd(given[n], other).astype(np.float64) for n in ("q", "k", "v", "out"))
        if given["out"].ndim == 4:
            q1, k1, v1, kern1 = (x[:1] for x in (q1, k1, v1, kern1))
        try:
            if matches(kern1, {}, (q1, k1, v1)):
                found.append(f"read as --layout {other} {_AXES[other]}, every tensor fits and the output "
                             f"passes: the files are in {other}, not {layout}")
        except ValueError:
            pass
    if shape["sq"] == shape["hq"] and given["out"].ndim >= 3:
        if matches(np.swapaxes(kern0, -2, -3), {}):
            found.append(f"the output matches the reference with its seqlen and heads axes swapped: "
                         f"the kernel writes {other} {_AXES[other]}, not {layout}")
    if verdict.heads and 0 < sum(not h["passed"] for h in verdict.heads) < len(verdict.heads):
        failing = [h["head"] for h in verdict.heads if not h["passed"]]
        found.append(f"only heads {failing} fail: look at the head indexing (GQA mapping, strides)")
    if not found:
        found.append("no known cause matched; see the worst positions and the error along the query position")
    return found


# -- text ------------------------------------------------------------------------------------

def _fmt(x):
    return "n/a" if x is None else f"{x:.2e}"


def _verdict_word(passed):
    return {True: "PASS", False: "FAIL", None: "INFO"}[passed]


def format_text(check: KernelCheck) -> str:
    """The verdict as the CLI prints it."""
    s, o = check.shape, check.options
    mask = "causal (" + o["causal_align"] + ")" if o["causal"] else "no causal mask"
    if o["window"] is not None:
        mask += f", window {o['window']}"
    extras = [f"softcap {o['softcap']}" if o["softcap"] else "", f"kv_lengths {list(np.ravel(o['kv_lengths']))}"
              if o["kv_lengths"] is not None else ""]
    dv = "" if s["dv"] == s["d"] else f" (v: {s['dv']})"
    lines = [
        "attnlib check: the kernel's output against attnlib's float64 reference",
        f"  batch {s['batch']}, seqlen_q {s['sq']}, seqlen_k {s['sk']}, heads {s['hq']} (kv heads "
        f"{s['hk']}), head dim {s['d']}{dv}; {mask}" + "".join(f", {e}" for e in extras if e),
        f"  kernel precision {check.dtype} (eps {check.eps:.1e}); naive baseline: {check.baseline}",
        "  rule: max|kernel - ref| <= 2 * max|naive - ref| + eps, per head",
        "",
    ]
    for v in [check.out] + ([check.lse] if check.lse else []) + list(check.grads.values()):
        lines += _format_tensor(v)
        if v is check.out:
            lines.append(f"  error along the query position: {check.trend}")
            lines += [f"  diagnosis: {d}" for d in check.diagnosis]
        lines.append("")
    lines.append(f"verdict: {'PASS' if check.passed else 'FAIL'} (exit {check.exit_code})")
    return "\n".join(lines)


def _format_tensor(v: TensorVerdict) -> list:
    lines = [f"{v.name}: {_verdict_word(v.passed)}  max |err| {_fmt(v.max_err)} (naive {_fmt(v.naive_max)}, "
             f"bound {_fmt(v.bound)}), median {_fmt(v.median_err)}"]
    if v.nonfinite:
        lines.append(f"  {v.nonfinite} NaN/inf values, first at " + "; ".join(_where(p) for p in v.nonfinite_at))
    lines += [f"  note: {n}" for n in v.notes]
    if len(v.heads) > 1:
        lines.append("  head   max |err|  median     naive max  verdict")
        shown = v.heads if len(v.heads) <= 16 else sorted(v.heads, key=lambda h: -h["max"])[:16]
        for h in shown:
            lines.append(f"  {h['head']:<5}  {h['max']:.2e}   {h['median']:.2e}   {_fmt(h['naive_max'])}   "
                         f"{_verdict_word(h['passed'])}")
        if len(v.heads) > 16:
            lines.append(f"  ({len(v.heads) - 16} more heads; the 16 worst shown)")
    lines.append("  worst: " + "; ".join(f"{_where(w)}: kernel {w['kernel']:.6g}, ref {w['ref']:.6g}"
                                         for w in v.worst[:3]))
    return lines


def _where(p):
    return ", ".join(f"{k} {p[k]}" for k in ("batch", "query", "key", "head", "dim") if k in p)


# -- files and the command line --------------------------------------------------------------

#: What ``notebooks/kernel_check.ipynb`` declares, and `_run_notebook` passes.
NOTEBOOK_PARAMETERS = TENSORS + ("dtype", "layout", "causal", "causal_align", "window", "softcap",
                                 "scale", "kv_lengths", "workers", "results_json")


def load_and_check(q, k, v, out, *, lse="", dout="", dq="", dk="", dv="", dtype="", **options) -> KernelCheck:
    """`check_kernel` on tensor files (``path`` or ``path:name``; "" = not given)."""
    specs = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, dq=dq, dk=dk, dv=dv)
    arrays, kinds, names = {}, {}, {}
    for name, spec in specs.items():
        if spec:
            arrays[name], kinds[name] = load_tensor(spec, f"--{name}", dtype or None)
            names[name] = f"--{name} {spec}"
    return check_kernel(**arrays, dtype=dtype or kinds["q"], names=names, **options)


def save_json(path: str, check: KernelCheck) -> None:
    """The verdict for the CLI: text, exit code and the headline figures."""
    data = {"text": format_text(check), "exit_code": check.exit_code, "passed": check.passed,
            "out_max_err": check.out.max_err, "out_bound": check.out.bound}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _window(values):
    if values is None:
        return None
    left, right = (None if x < 0 else x for x in values)  # -1: unbounded (FlashAttention's)
    return (left, right)


def _parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m attnlib check",
        description="Judge an attention kernel's saved output against attnlib's float64 reference "
                    "with FlashAttention's rule: max|kernel - ref| <= 2 * max|naive - ref| + eps. "
                    "Exit code 0: pass, 1: fail, 2: unusable input.")
    for name in TENSORS:
        required = name in ("q", "k", "v", "out")
        p.add_argument(f"--{name}", required=required, default="", metavar="FILE",
                       help=f"{name} tensor: .npy, .npz or .safetensors (path or path:name)"
                            + ("" if required else ", optional"))
    p.add_argument("--layout", choices=LAYOUTS, default="bshd",
                   help="bshd: (batch, seqlen, nheads, headdim), FlashAttention's (default); "
                        "bhsd: (batch, nheads, seqlen, headdim), PyTorch SDPA's")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--align", choices=("bottom_right", "top_left"), default="bottom_right",
                   help="causal alignment when seqlen_q != seqlen_k (default bottom_right, FlashAttention's)")
    p.add_argument("--window", nargs=2, type=int, metavar=("L", "R"),
                   help="sliding window: keys i-L .. i+R visible; -1 = unbounded")
    p.add_argument("--softcap", type=float, default=0.0, help="softcap C (0: off)")
    p.add_argument("--scale", type=float, default=None, help="softmax scale (default 1/sqrt(headdim))")
    p.add_argument("--kv-lengths", type=int, nargs="+", default=None, metavar="N",
                   help="valid keys per batch entry (padding)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32", "float64"), default=None,
                   help="the kernel's compute precision (default: the type q is stored in)")
    p.add_argument("--workers", type=int, default=1, help="threads for the float64 reference")
    p.add_argument("--html", default=None, metavar="PATH", help="also write the verdict as an HTML report")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    options = dict(layout=args.layout, causal=args.causal, causal_align=args.align,
                   window=_window(args.window), softcap=args.softcap or None, scale=args.scale,
                   kv_lengths=args.kv_lengths, workers=args.workers)
    files = {name: getattr(args, name) for name in TENSORS}
    try:
        if args.html:
            text, code = _run_notebook(files, args.dtype or "", options, args.html)
        else:
            check = load_and_check(**files, dtype=args.dtype or "", **options)
            text, code = format_text(check), check.exit_code
    except (TensorFileError, UnusableInput) as e:
        print(f"attnlib check: unusable input: {e}", file=sys.stderr)
        return 2
    print(text)
    if args.html:
        print(f"report: {args.html}")
    return code


def _run_notebook(files, dtype, options, target) -> tuple[str, int]:
    """Run the kernel-check notebook on the files and render it to ``target``."""
    from .report import ROOT, ReportError, execute

    notebook = ROOT / "notebooks" / "kernel_check.ipynb"
    if not notebook.exists():
        raise UnusableInput(f"--html needs {notebook} (a source checkout of attnlib)")
    # Fail fast, with the CLI's messages, on unusable files before starting a kernel.
    for name, spec in files.items():
        if spec:
            load_tensor(spec, f"--{name}", dtype or None)

    def absolute(spec):  # the notebook runs elsewhere: absolute paths, ":name" kept
        path, key = split_spec(spec)
        return os.path.abspath(path) + (f":{key}" if key else "")

    params = {**{n: absolute(s) if s else "" for n, s in files.items()}, "dtype": dtype, **options,
              "window": None if options["window"] is None else list(options["window"]),
              "softcap": options["softcap"] or 0.0, "scale": options["scale"] or 0.0}
    assert set(params) | {"results_json"} == set(NOTEBOOK_PARAMETERS)
    try:
        data = execute(notebook, params, Path(target))
    except ReportError as e:
        raise UnusableInput(f"the kernel check notebook failed: {e}") from None
    return data["text"], int(data["exit_code"])
