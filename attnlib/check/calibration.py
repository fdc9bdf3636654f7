"""The rule, measured: how often correct kernels fail it, and which defects it catches.

A false alarm is a correct kernel failing `check_kernel`; its rate over many seeds and
shapes is what the rule promises its users.  The correct kernels are independent
implementations of the contract in the kernel's precision (attnlib's tiled kernel with
other tiles or split keys, the dense reference, the exact answer rounded once to the
kernel's type, and PyTorch SDPA when torch is installed); the defective ones are the
bugs the check exists for.  Everything goes through the check's own code path
(`rule.expect`, `rule.judge_out`, `rule.judge_lse`), one reference per problem.
"""

from __future__ import annotations

import math

import numpy as np

from ..core import problem
from ..core.options import Options
from ..evidence.inputs import random_qkv
from ..core.device import warm_vml
from ..core.oracle import ORACLE_PRECISION, oracle_attention
from ..core.reference import reference_attention
from ..core.tiled import attention
from .naive import SAMPLE_ROWS
from .rule import expect, judge_lse, judge_out

#: (batch, heads, seqlen_q, seqlen_k, headdim, causal): prefill shapes and decode shapes.
SHAPES = ((1, 1, 128, 128, 64, True), (2, 8, 1024, 1024, 64, True), (1, 4, 512, 512, 128, False),
          (4, 8, 1, 4096, 128, False), (8, 32, 1, 1024, 128, True))


#: The largest ``batch * Hq * Sq * Sk * D`` the long double "exact answer" runs at (~1 s).
ORACLE_MAX_WORK = 1 << 28


def _to_torch(prec_name, *xs, grad=False) -> list:
    """The arrays ``xs`` as torch tensors of the precision's type (leaves taking a gradient with ``grad``)."""
    import torch
    dtype = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
             "bfloat16": torch.bfloat16}[prec_name]
    return [torch.from_numpy(np.ascontiguousarray(x)).to(dtype).requires_grad_(grad) for x in xs]


def _to_numpy(t) -> np.ndarray:
    """A torch tensor's values as a float64 array."""
    return t.detach().double().numpy()


def correct_kernels(prec_name: str) -> dict:
    """``name -> fn(q, k, v, causal) -> (out, lse or None)``: bhsd arrays in the kernel's
    type (float64 values), results as float64 values of the kernel's output type."""
    prec = problem.precision(prec_name)
    kernels = {
        "attnlib tiled, 32 x 32 tiles": lambda q, k, v, c: attention(
            q, k, v, causal=c, block_q=32, block_k=32, compute_dtype=prec_name, return_lse=True),
        "attnlib tiled, keys split 4 ways (flash-decoding)": lambda q, k, v, c: attention(
            q, k, v, causal=c, kv_splits=4, compute_dtype=prec_name, return_lse=True),
        "dense, same precision": lambda q, k, v, c: reference_attention(
            q, k, v, causal=c, compute_dtype=prec_name, return_lse=True),
    }
    if prec.is_float64 and ORACLE_PRECISION["method"] == "longdouble":
        def exact(q, k, v, c):
            if q.size // q.shape[-1] * k.shape[-2] * q.shape[-1] > ORACLE_MAX_WORK:
                return None  # long double has no BLAS: too slow at this shape
            return tuple(x.astype(np.float64) for x in oracle_attention(q, k, v, causal=c, return_lse=True))
        kernels["exact answer rounded once to float64 (long double oracle)"] = exact
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return kernels
    from torch.nn.attention import SDPBackend, sdpa_kernel
    warm_vml()  # before these kernels' first torch ops (`device.warm_vml`)

    def sdpa(backend):
        def run(q, k, v, c):
            with torch.no_grad(), sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(*_to_torch(prec_name, q, k, v), is_causal=c and q.shape[-2] > 1)
            return _to_numpy(out), None
        return run
    kernels[f"torch {torch.__version__} SDPA, flash backend"] = sdpa(SDPBackend.FLASH_ATTENTION)
    kernels[f"torch {torch.__version__} SDPA, math backend"] = sdpa(SDPBackend.MATH)
    return kernels


def defective_kernels(prec_name: str, perturbation: float) -> dict:
    """``name -> fn(q, k, v, causal) -> (out, None)``: the bugs the check must catch."""
    def tiled(q, k, v, **kw):
        return attention(q, k, v, compute_dtype=prec_name, **kw).astype(np.float64), None

    def one_head(q, k, v, c):
        out = attention(q, k, v, causal=c, compute_dtype=prec_name).astype(np.float64)
        out[..., min(1, out.shape[-3] - 1), :, :] *= 1 + perturbation
        return out, None

    return {
        "causal mask off by one": lambda q, k, v, c: tiled(
            q, k, v, causal=False, window=(None, 1) if c else (None, 0)),
        "softmax scale 1/D instead of 1/sqrt(D)": lambda q, k, v, c: tiled(
            q, k, v, causal=c, scale=1.0 / q.shape[-1]),
        f"one head off by {perturbation:g} (relative)": one_head,
    }


def one_head_perturbation(prec_name: str) -> float:
    """The one-head defect's default relative size in ``prec_name``: 1e-9 in float64, 1e-4 in
    float32, else 64 eps (ulps of 1) of the type (see `measure`)."""
    return {"float64": 1e-9, "float32": 1e-4}.get(prec_name, 64 * problem.precision(prec_name).eps)


def _problem(shape, prec, seed):
    b, h, sq, sk, d, causal = shape
    q, k, v = random_qkv(sq, sk, d, batch=(b,), heads=h, seed=seed)
    # As the kernel reads them: rounded to its type (float64 values).
    q, k, v = (x.astype(prec.compute).astype(np.float64) for x in (q, k, v))
    return q, k, v, causal


def measure(prec_name: str, shapes=SHAPES, seeds=range(100), perturbation=None, kernels=None,
            defects=True) -> list[dict]:
    """One row per (shape, kernel): seeds run, failures and the worst ratios seen.

    ``perturbation``: the one-head defect's relative size (default: 1e-9 for float64,
    where the rule's allowance is ~1e-12 of ``P @ |V|``; 1e-4 for float32, whose decode over
    4096 keys summed key by key already errs ~64 eps; else 64 eps of the type).
    ``kernels``: substrings; only correct kernels whose name holds one run (default all);
    ``defects``: run the defective kernels too.
    """
    prec = problem.precision(prec_name)
    if perturbation is None:
        perturbation = one_head_perturbation(prec_name)
    good = correct_kernels(prec_name)
    if kernels:
        good = {name: fn for name, fn in good.items() if any(s in name for s in kernels)}
    bad = defective_kernels(prec_name, perturbation) if defects else {}
    exact_bad = defective_kernels("float64", perturbation)  # does a defect change the problem?
    # Below float64 the dense kernel in the precision is the rule's own naive baseline: its
    # ratio is at most ~0.5 by construction, a run that tests nothing (kind "baseline").
    baseline = None if prec.is_float64 else "dense, same precision"
    rows = {}
    for shape in map(tuple, shapes):
        b, h, sq, sk, d, causal = shape
        for seed in seeds:
            q, k, v, causal = _problem(shape, prec, seed)
            opts = Options.parse(causal=causal)
            expected = expect(q, k, v, opts, prec, 1)
            exact = attention(q, k, v, causal=causal)  # once per problem, for the defects' test
            for kind, kernels in (("correct", good), ("defective", bad)):
                for name, fn in kernels.items():
                    if kind == "defective" and np.array_equal(exact_bad[name](q, k, v, causal)[0], exact):
                        continue  # the defect changes nothing here (off by one in decode)
                    result = fn(q, k, v, causal)
                    if result is None:
                        continue
                    out, lse = result
                    out = np.asarray(out, dtype=np.float64)
                    # Sampled baselines (more rows than SAMPLE_ROWS) take the kernel's worst rows in.
                    judged = expected if sq <= SAMPLE_ROWS else expect(
                        q, k, v, opts, prec, 1, kernel=out,
                        kernel_lse=None if lse is None else np.asarray(lse, dtype=np.float64))
                    v_out = judge_out(out, judged)[0]
                    v_lse = None if lse is None else judge_lse(lse, judged, np.asarray(lse).dtype)
                    row = rows.setdefault((shape, name), dict(
                        precision=prec_name, shape=f"({b}, {h}, {sq}, {sk}, {d})",
                        causal=causal, kernel=name, kind="baseline" if name == baseline else kind,
                        seeds=0, failed=0, identical=0, worst_out_ratio=0.0, least_out_ratio=None,
                        worst_lse_ratio=None))
                    if kind == "correct" and np.array_equal(np.asarray(out, dtype=np.float64), expected.ref):
                        row["identical"] += 1  # the reference's own bits: a run that tests nothing
                        continue
                    row["seeds"] += 1
                    row["failed"] += int(not v_out.passed or (v_lse is not None and not v_lse.passed))
                    row["worst_out_ratio"] = max(row["worst_out_ratio"], v_out.ratio)
                    row["least_out_ratio"] = min(row["least_out_ratio"] or math.inf, v_out.ratio)
                    if v_lse is not None:
                        row["worst_lse_ratio"] = max(row["worst_lse_ratio"] or 0.0, v_lse.ratio)
    return list(rows.values())


def summary(rows: list[dict]) -> dict:
    """Per precision: false alarms (correct kernels failed / runs), the worst ratio of a
    correct kernel (``out`` and ``lse``) and where, and defects caught; the rule's own
    baseline (kind "baseline") apart: its runs, failures and worst ratio, not counted; runs
    whose output is the reference's own bits (``identical_runs``) neither."""
    out = {}
    for r in rows:
        s = out.setdefault(r["precision"], dict(correct_runs=0, identical_runs=0, false_alarms=0, worst_ratio=0.0,
                                                worst_out_ratio=0.0, worst_lse_ratio=None, worst_at="",
                                                defect_runs=0, caught=0, baseline_runs=0,
                                                baseline_failed=0, baseline_worst_ratio=None))
        s["identical_runs"] += r.get("identical", 0)
        if r["kind"] == "correct" and not r["seeds"]:
            continue  # every run gave the reference's own bits
        runs, failed = {"baseline": ("baseline_runs", "baseline_failed"),
                        "correct": ("correct_runs", "false_alarms")}.get(r["kind"], ("defect_runs", "caught"))
        s[runs] += r["seeds"]
        s[failed] += r["failed"]
        worst = max(r["worst_out_ratio"], r["worst_lse_ratio"] or 0.0)
        if r["kind"] == "baseline":
            s["baseline_worst_ratio"] = max(s["baseline_worst_ratio"] or 0.0, worst)
        elif r["kind"] == "correct":
            if worst >= s["worst_ratio"]:
                s["worst_at"] = f"{r['kernel']}, {r['shape']}{' causal' if r['causal'] else ''}"
            s["worst_ratio"] = max(s["worst_ratio"], worst)
            s["worst_out_ratio"] = max(s["worst_out_ratio"], r["worst_out_ratio"])
            if r["worst_lse_ratio"] is not None:
                s["worst_lse_ratio"] = max(s["worst_lse_ratio"] or 0.0, r["worst_lse_ratio"])
    return out


def main(argv=None) -> int:
    """``python -m attnlib.check.calibration [--seeds N] [--precisions ...] [--json PATH]``."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m attnlib.check.calibration",
                                description="Measure the check rule's false alarms and power.")
    p.add_argument("--seeds", type=int, default=100)
    p.add_argument("--precisions", nargs="+", default=["float64", "float32", "bfloat16", "float16"])
    p.add_argument("--kernels", nargs="+", default=None, metavar="TEXT",
                   help="only the correct kernels whose name holds one of these (e.g. torch exact)")
    p.add_argument("--no-defects", action="store_true", help="leave the defective kernels out")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    rows = []
    for prec in args.precisions:
        rows += measure(prec, seeds=range(args.seeds), kernels=args.kernels, defects=not args.no_defects)
        for r in (r for r in rows if r["precision"] == prec):
            lse = "" if r["worst_lse_ratio"] is None else f", lse {r['worst_lse_ratio']:.3g}"
            print(f"{prec:9} {r['shape']:24} {r['kind']:9} {r['kernel'][:52]:52} failed "
                  f"{r['failed']:3}/{r['seeds']:<3} worst ratio {r['worst_out_ratio']:.3g}{lse}", flush=True)
    print(json.dumps(summary(rows), indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


__all__ = ["measure", "summary", "correct_kernels", "defective_kernels", "one_head_perturbation", "SHAPES"]

if __name__ == "__main__":
    raise SystemExit(main())
