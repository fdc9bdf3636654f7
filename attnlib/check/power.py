"""The check's power at every magnitude: wrong kernels fail, correct kernels pass.

A verdict is only as good as the smallest real bug it catches.  This module runs
`check_kernel` on problems whose values (``v``, and ``dout`` for the gradients) are scaled
by magnitudes from ``1e-6`` to ``1e4`` in each low precision, with

* **correct kernels**: PyTorch SDPA's math and flash backends (forward and autograd) and
  FlexAttention's eager forward when torch is installed, attnlib's tiled kernel in the
  precision, and the float64 answer rounded once to the kernel's type;
* **wrong kernels**: the bugs the check exists for, forward (an all-zero output, the
  non-causal problem, the softmax scale doubled, each query's own key dropped, uniform
  weights over the visible keys; a base-2 LSE, the next row's LSE) and backward (zero
  gradients, ``dv`` of the wrong kv head, ``dq`` without the softmax scale, the non-causal
  problem's gradients, the gradients' sign flipped, and every gradient scaled by
  ``1 + SCALED[precision]``).

Every wrong kernel's output is the float64 answer to the *wrong* problem rounded once to
the kernel's type, so that only the defect separates it from a correct kernel.  Each run
is one row: precision, magnitude, kernel, the tensor judged, passed, and the worst ratio
of error to allowance.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings

import numpy as np

from ..core.problem import precision
from ..core.backward import tiled_backward
from ..core.device import warm_vml
from ..core.options import Options
from ..core.tiled import attention, forward_on
from . import memo
from .calibration import _to_numpy, _to_torch
from .rule import FINAL_ROUNDINGS, unit
from .verdict import check_kernel

#: Scales of ``v`` and ``dout``: value projections, residual branches and backprop
#: gradients are often 1e-4 and below; 1e4 is near float16's range for sums of them.
MAGNITUDES = (1e-6, 1e-4, 1e-2, 1.0, 1e2, 1e4)

#: (batch, Hq, Hk, Sq, Sk, D, causal): a causal prefill with GQA, and a decode.
SHAPES = ((1, 4, 2, 384, 384, 64, True), (2, 4, 4, 1, 1024, 64, False))

#: The relative error of the "scaled gradients" wrong kernel: 1e-4 in float32 (the
#: issue's bar up to n = 8192); 8 ulps (8 eps, the rule's unit) of the 16-bit types.
SCALED = {"float32": 1e-4, "bfloat16": 16 * 2.0 ** -8, "float16": 16 * 2.0 ** -11}

GRADS = ("dq", "dk", "dv")


def problem(shape, prec_name, magnitude, seed=0):
    """``(q, k, v, dout, causal)`` in bhsd, rounded to the precision (float64 values)."""
    b, hq, hk, sq, sk, d, causal = shape
    prec = precision(prec_name)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, sq, d))
    k = rng.standard_normal((b, hk, sk, d))
    v = magnitude * rng.standard_normal((b, hk, sk, d))
    dout = magnitude * rng.standard_normal((b, hq, sq, d))
    return tuple(_round(prec, x) for x in (q, k, v, dout)) + (causal,)


def _round(prec, x) -> np.ndarray:
    """``x`` rounded to the kernel's type, as float64 values; beyond the type's range, inf
    (what a kernel of that type holds there: the check then reports such a tensor, not judges it)."""
    with np.errstate(over="ignore"):
        return prec.round(np.asarray(x)).astype(np.float64)


def _exact(q, k, v, dout, prec, opts: Options) -> dict:
    """The float64 answer to the problem ``opts`` describe, rounded once to ``prec``:
    ``out, lse, dq, dk, dv`` by name (the lse in float32, as 16-bit kernels keep it)."""
    out, lse = forward_on(q, k, v, opts, return_lse=True)
    grads = tiled_backward(q, k, v, out, lse, dout, opts)
    lse = lse.astype(np.float32).astype(np.float64) if not prec.is_float64 else lse
    return {"out": _round(prec, out), "lse": lse} | {n: _round(prec, g) for n, g in zip(GRADS, grads)}


def _own_key_dropped(causal, sq, sk):
    o = sk - sq  # bottom-right alignment
    return lambda b, h, i, j: (j != i + o) & ((j <= i + o) if causal else True)


def wrong_kernels(shape, prec_name) -> dict:
    """``name -> (tensor, fn(q, k, v, dout, causal) -> dict of the kernel's tensors)``."""
    prec = precision(prec_name)
    _, hq, hk, sq, sk, d, _ = shape
    s0 = 1.0 / math.sqrt(d)

    def forward(**change):
        def run(q, k, v, dout, c):
            t = _exact(q, k, v, dout, prec, Options.parse(**({"causal": c} | change)))
            return dict(out=t["out"], lse=t["lse"])
        return run

    def grads(edit):
        def run(q, k, v, dout, c):
            t = _exact(q, k, v, dout, prec, Options.parse(causal=c))
            return t | edit(t, q, k, v, dout, c)
        return run

    def lse_edit(edit):
        def run(q, k, v, dout, c):
            t = forward()(q, k, v, dout, c)
            return t | dict(lse=edit(t["lse"]))
        return run

    log2e = 1.0 / math.log(2.0)
    kernels = {
        "all-zero output": ("out", lambda q, k, v, dout, c: dict(out=np.zeros(q.shape[:-1] + v.shape[-1:]))),
        "softmax scale x2": ("out", forward(scale=2 * s0)),
        "own key dropped": ("out", lambda q, k, v, dout, c: forward(
            mask_mod=_own_key_dropped(c, q.shape[-2], k.shape[-2]))(q, k, v, dout, c)),
        "uniform weights over the visible keys": ("out", forward(scale=0.0)),
        "lse in base 2": ("lse", lse_edit(lambda lse: lse * log2e)),
        "lse of the next query row": ("lse", lse_edit(lambda lse: np.roll(lse, -1, axis=-1))),
        "all-zero gradients": ("grads", grads(lambda t, *a: {n: np.zeros_like(t[n]) for n in GRADS})),
        "dq without the softmax scale": ("grads", grads(lambda t, *a: dict(dq=_round(prec, t["dq"] / s0)))),
        "gradients with the sign flipped": ("grads", grads(lambda t, *a: {n: -t[n] for n in GRADS})),
        f"gradients x (1 + {SCALED.get(prec_name, 0):.3g})": ("grads", grads(
            lambda t, *a: {n: _round(prec, t[n] * (1 + SCALED.get(prec_name, 0))) for n in GRADS})),
    }
    if shape[-1]:  # causal
        kernels["no causal mask"] = ("out", forward(causal=False))

        def noncausal(t, q, k, v, dout, c):
            return {n: x for n, x in _exact(q, k, v, dout, prec, Options.parse(causal=False)).items() if n in GRADS}
        kernels["gradients of the non-causal problem"] = ("grads", grads(noncausal))
    if hk > 1:
        kernels["dv of the wrong kv head"] = ("grads", grads(lambda t, *a: dict(dv=np.roll(t["dv"], 1, axis=-3))))
    return kernels


def correct_kernels(shape, prec_name) -> dict:
    """``name -> fn(q, k, v, dout, causal) -> dict of the kernel's tensors``."""
    prec = precision(prec_name)

    def rounded_once(q, k, v, dout, c):
        return _exact(q, k, v, dout, prec, Options.parse(causal=c))

    def tiled(q, k, v, dout, c):
        out, lse = attention(q, k, v, causal=c, compute_dtype=prec_name, return_lse=True)
        return dict(out=out.astype(np.float64), lse=lse.astype(np.float64))

    return {"float64 answer rounded once": rounded_once,
            f"attnlib tiled in {prec_name}": tiled} | _torch_kernels(prec_name)


def _torch_kernels(prec_name) -> dict:
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {}
    warm_vml()  # before these kernels' first torch ops (`device.warm_vml`)

    def sdpa(backend):
        def run(q, k, v, dout, c):
            tq, tk, tv = _to_torch(prec_name, q, k, v, grad=True)
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=c, enable_gqa=True)
            out.backward(_to_torch(prec_name, dout)[0])
            return dict(out=_to_numpy(out), dq=_to_numpy(tq.grad), dk=_to_numpy(tk.grad), dv=_to_numpy(tv.grad))
        return run

    def flex(q, k, v, dout, c):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        sq, sk = q.shape[-2], k.shape[-2]
        mask = None
        if c:
            mask = create_block_mask(lambda b, h, i, j: j <= i + (sk - sq), None, None, sq, sk, device="cpu")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager (unfused) on the CPU; return_lse's deprecation
            out, lse = flex_attention(*_to_torch(prec_name, q, k, v), block_mask=mask, enable_gqa=True,
                                      return_lse=True)
        return dict(out=_to_numpy(out), lse=_to_numpy(lse))

    v = torch.__version__
    return {f"torch {v} SDPA math (autograd)": sdpa(SDPBackend.MATH),
            f"torch {v} SDPA flash (autograd)": sdpa(SDPBackend.FLASH_ATTENTION),
            f"torch {v} FlexAttention eager": flex}


#: A wrong kernel counts where it moves an entry by more than this many ulps of the correctly
#: rounded answer ("more than a few"): the rule's own floor is ``2 + 2 r`` ulps of an entry's
#: size with ``r`` the naive baseline's ulps, so a defect of a few ulps (a gradient that
#: underflows to float16's subnormals, the next row's lse at decode) is below what it resolves.
RESOLVED_ULPS = 2 * FINAL_ROUNDINGS


def _changed(tensors, right, judged, prec_name) -> list:
    """The judged tensors a wrong kernel moves by more than `RESOLVED_ULPS` ulps of the
    correctly rounded answer at some entry; the others hold a defect below the type's
    resolution there."""
    names = GRADS if judged == "grads" else (judged,)
    dtype = np.float32 if judged == "lse" else precision(prec_name).compute
    with np.errstate(invalid="ignore", over="ignore"):
        return [n for n in names if n in tensors and not np.all(
            np.abs(tensors[n] - right[n]) <= RESOLVED_ULPS * unit(np.abs(right[n]), dtype))]


def _judge(q, k, v, dout, causal, prec_name, tensors):
    grads = {n: tensors.get(n) for n in GRADS}
    with_grads = any(g is not None for g in grads.values())
    return check_kernel(q, k, v, tensors["out"] if "out" in tensors else attention(q, k, v, causal=causal),
                        lse=tensors.get("lse"), dout=dout if with_grads else None, layout="bhsd",
                        dtype=prec_name, causal=causal, workers=1, **grads)


def _rows(result, names=None):
    """``(tensor, passed, ratio)`` per judged tensor of a `KernelCheck` (only ``names``
    when given: the tensors a wrong kernel changed)."""
    verdicts = {"out": result.out, "lse": result.lse} | dict(result.grads)
    return [(name, bool(v.passed), float(v.ratio)) for name, v in verdicts.items()
            if v is not None and v.passed is not None and (names is None or name in names)]


def measure(precisions=("float32", "bfloat16", "float16"), magnitudes=MAGNITUDES, shapes=SHAPES,
            seeds=(0,), correct=True, wrong=True) -> list[dict]:
    """One row per (precision, shape, magnitude, seed, kernel): whether the check passed
    the tensors the kernel is judged on (``out``/``lse`` forward, the gradients), and the
    worst ratio of error to allowance among them."""
    rows = []
    for prec_name, shape, magnitude, seed in itertools.product(precisions, map(tuple, shapes), magnitudes, seeds):
        with memo.shared((sys.modules[__name__], "_exact")):  # one reference per problem
            rows += _measure_problem(prec_name, shape, magnitude, seed, correct, wrong)
    return rows


def _measure_problem(prec_name, shape, magnitude, seed, correct, wrong) -> list[dict]:
    """`measure`'s rows for one problem: every kernel judged against its one reference."""
    rows = []
    q, k, v, dout, causal = problem(shape, prec_name, magnitude, seed)
    cases = []
    if correct:
        cases += [(name, "correct", "all", fn) for name, fn in correct_kernels(shape, prec_name).items()]
    if wrong:
        cases += [(name, "wrong", judged, fn) for name, (judged, fn) in wrong_kernels(shape, prec_name).items()]
    right = _exact(q, k, v, dout, precision(prec_name), Options.parse(causal=causal))
    for name, kind, judged, fn in cases:
        tensors = fn(q, k, v, dout, causal)
        names = _changed(tensors, right, judged, prec_name) if kind == "wrong" else None
        if kind == "wrong" and not names:
            continue  # the defect vanishes in the type
        judged_rows = _rows(_judge(q, k, v, dout, causal, prec_name, tensors), names)
        if not judged_rows:
            continue
        rows.append(dict(
            precision=prec_name, shape=str(shape[:-1]), causal=shape[-1], magnitude=magnitude,
            seed=seed, kernel=name, kind=kind,
            tensors=[r[0] for r in judged_rows],
            passed=all(r[1] for r in judged_rows),
            failed_tensors=[r[0] for r in judged_rows if not r[1]],
            ratio=max(r[2] for r in judged_rows), ratios={r[0]: r[2] for r in judged_rows}))
    return rows


def long_gradients(n, prec_name="float32", d=64, seed=0, relative=None) -> list[dict]:
    """float32 gradients at one long causal head ``(1, 1, n, n, d)``: the correct gradient
    rounded once, PyTorch's SDPA autograd (math backend) when installed, and every gradient
    scaled by ``1 + relative`` (default `SCALED`), each judged by `check_kernel`."""
    relative = SCALED[prec_name] if relative is None else relative
    shape = (1, 1, 1, n, n, d, True)
    q, k, v, dout, causal = problem(shape, prec_name, 1.0, seed)
    prec = precision(prec_name)
    right = _exact(q, k, v, dout, prec, Options.parse(causal=causal))
    cases = [("correct", "float64 answer rounded once", right)]
    cases += [("correct", name, fn(q, k, v, dout, causal)) for name, fn in _torch_kernels(prec_name).items()
              if "math" in name]
    scaled = {g: _round(prec, right[g] * (1 + relative)) for g in GRADS}
    cases.append(("wrong", f"gradients x (1 + {relative:.3g})", dict(right, **scaled)))
    rows = []
    for kind, name, tensors in cases:
        judged = _rows(_judge(q, k, v, dout, causal, prec_name, {g: tensors[g] for g in ("out",) + GRADS}), GRADS)
        rows.append(dict(precision=prec_name, n=n, kernel=name, kind=kind,
                         passed=all(r[1] for r in judged),
                         **{f"{r[0]}_ratio": r[2] for r in judged}))
    return rows


def by_kernel(rows) -> list[dict]:
    """One row per (kind, kernel, precision): over the magnitudes and shapes it ran at, how
    many runs the check got right (failed a wrong kernel, passed a correct one), the
    magnitudes it got wrong, and the ratio nearest the allowance."""
    table = {}
    for r in rows:
        t = table.setdefault((r["kind"], r["kernel"], r["precision"]), dict(
            kind=r["kind"], kernel=r["kernel"], precision=r["precision"], runs=0, right=0,
            wrong_at=[], nearest_ratio=None))
        right = r["passed"] == (r["kind"] == "correct")
        t["runs"] += 1
        t["right"] += int(right)
        if not right:
            t["wrong_at"].append(f"{r['magnitude']:g} {r['shape']}")
        pick = max if r["kind"] == "correct" else min  # the run nearest the line
        t["nearest_ratio"] = r["ratio"] if t["nearest_ratio"] is None else pick(t["nearest_ratio"], r["ratio"])
    return list(table.values())


def gradient_gap(rows) -> dict:
    """Per precision: the gap the gradients' rule leaves, ``min`` over the magnitudes of the
    least ratio of a wrong gradient kernel (the run nearest to passing) over the worst
    gradient ratio of a correct kernel at the same magnitude (where a wrong kernel's defect
    is below the type's resolution, `RESOLVED_ULPS`, it is not judged there, and that
    magnitude has no gap), with both ratios and where."""
    cells = {}
    for r in rows:
        grads = {n: x for n, x in r.get("ratios", {}).items() if n in GRADS}
        if not grads:
            continue
        c = cells.setdefault((r["precision"], r["magnitude"]), dict(correct=0.0, correct_at="", wrong=None, wrong_at=""))
        if r["kind"] == "correct" and max(grads.values()) >= c["correct"]:
            c["correct"], c["correct_at"] = max(grads.values()), r["kernel"]
        elif r["kind"] == "wrong" and set(r["tensors"]) <= {"dq", "dk", "dv"} and (
                c["wrong"] is None or r["ratio"] < c["wrong"]):
            c["wrong"], c["wrong_at"] = r["ratio"], r["kernel"]
    out = {}
    for (prec, magnitude), c in cells.items():
        if c["wrong"] is None or not c["correct"]:
            continue
        gap = c["wrong"] / c["correct"]
        if prec not in out or gap < out[prec]["gap"]:
            out[prec] = dict(gap=gap, magnitude=magnitude, least_wrong=c["wrong"], wrong_at=c["wrong_at"],
                             worst_correct=c["correct"], correct_at=c["correct_at"])
    return out


def summary(rows) -> dict:
    """Per precision and kind: runs, and how many of them the check passed."""
    out = {}
    for r in rows:
        s = out.setdefault(f"{r['precision']} {r['kind']}", dict(runs=0, passed=0))
        s["runs"] += 1
        s["passed"] += int(r["passed"])
    return out


__all__ = ["measure", "summary", "gradient_gap", "by_kernel", "long_gradients", "wrong_kernels", "correct_kernels", "problem", "MAGNITUDES", "SHAPES"]
