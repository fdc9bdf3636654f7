"""The check's cost against the reference's: ``python -m attnlib.check.speed [N ...]``.

For each ``n`` and precision, a ``(1, 8, n, 64)`` causal problem: one float64
``attention(..., return_lse=True)`` and one `check_kernel` of a correct output in that
precision (attnlib's tiled kernel in it), interleaved, ``--repeats`` times after a warm-up
check; one JSON line each with the medians, the runs, their ratio and the issue's target
``4 x attention + 0.2 s``.  ``--gradients``: the check also judges ``dq, dk, dv`` (the float64
gradients rounded to the type), against one float64 ``attention`` and one tiled
``attention_backward``, target ``4 x (attention + backward) + 0.2 s``; and what the gradients
add, the check with them less the check of ``out`` alone (timed in the same rounds), against
``4 x backward + 0.2 s``.  The CPU is named on the first line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ..core import problem, validate
from ..core.backward import attention_backward
from ..core.tiled import attention
from .verdict import check_kernel

PRECISIONS = ("float32", "bfloat16", "float16")


def measure(n: int, prec: str, repeats: int = 3, heads: int = 8, d: int = 64, seed: int = 0,
            gradients: bool = False) -> dict:
    """``{n, precision, attention, check (medians, s), runs, ratio, target, within}``; with
    ``gradients``, ``attention`` is the forward and the backward's time, and ``backward``,
    ``forward_check`` (the check of ``out`` alone), ``added`` (the median of each round's check
    less its forward check), ``added_ratio`` (over ``backward``) and ``added_target`` too."""
    rng = np.random.default_rng(seed)
    dt = problem.precision(prec).compute  # ml_dtypes' bfloat16 for "bfloat16"
    q, k, v, dout = (rng.standard_normal((1, heads, n, d)).astype(dt) for _ in range(4))
    out = attention(q, k, v, causal=True, compute_dtype=prec).astype(dt)
    grads = {}
    if gradients:
        o64, lse = attention(q, k, v, causal=True, return_lse=True)
        grads = dict(zip(("dq", "dk", "dv"), (g.astype(dt) for g in attention_backward(q, k, v, o64, lse, dout,
                                                                                          causal=True))))
        grads["dout"] = dout

    def timed(fn):
        t = time.perf_counter()
        result = fn()
        return time.perf_counter() - t, result

    check_kernel(q, k, v, out, causal=True, layout="bhsd", **grads)  # warm-up: the allocator's first pages
    ta, tb, tc, tf = [], [], [], []
    for _ in range(repeats):
        fwd, (o, lse) = timed(lambda: attention(q, k, v, causal=True, return_lse=True))
        bwd = timed(lambda: attention_backward(q, k, v, o, lse, dout, causal=True))[0] if gradients else 0.0
        ta.append(fwd + bwd)
        tb.append(bwd)
        took, verdict = timed(lambda: check_kernel(q, k, v, out, causal=True, layout="bhsd", **grads))
        tc.append(took)
        if gradients:
            tf.append(timed(lambda: check_kernel(q, k, v, out, causal=True, layout="bhsd"))[0])
    a, c = statistics.median(ta), statistics.median(tc)
    row = dict(n=n, precision=prec, gradients=gradients, attention=round(a, 4), check=round(c, 4),
               attention_runs=[round(t, 4) for t in ta], check_runs=[round(t, 4) for t in tc],
               ratio=round(c / a, 2), target=round(4 * a + 0.2, 4), within=c <= 4 * a + 0.2,
               passed=verdict.passed)
    if gradients:
        b, added = statistics.median(tb), statistics.median([x - y for x, y in zip(tc, tf)])
        row |= dict(backward=round(b, 4), forward_check=round(statistics.median(tf), 4), added=round(added, 4),
                    added_ratio=round(added / b, 2), added_target=round(4 * b + 0.2, 4),
                    added_within=added <= 4 * b + 0.2)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnlib.check.speed", description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, nargs="*", default=[1024, 2048, 4096])
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gradients", action="store_true", help="judge dq, dk, dv too (against forward + backward)")
    a = parser.parse_args(argv)
    print(json.dumps({"cpu": validate.cpu_name()}), flush=True)
    for n in a.n:
        for prec in a.precisions.split(","):
            print(json.dumps(measure(n, prec, a.repeats, gradients=a.gradients)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
