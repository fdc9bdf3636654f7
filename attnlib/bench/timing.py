"""Interleaved timing: every implementation on every case, in turn, repeat after repeat.

This machine is shared and noisy, so nothing is timed alone: each repeat runs every
implementation once on the same inputs, and medians (and their ratios) are reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from ..evidence.inputs import random_qkv
from ..judge.sizing import dense_fits


@dataclass(frozen=True)
class BenchCase:
    """One timing problem, ``(B, H, S, D)`` in torch's words (``Sq = Sk = S``)."""

    b: int
    h: int
    n: int
    d: int = 64
    causal: bool = True

    @property
    def name(self) -> str:
        return f"({self.b}, {self.h}, {self.n}, {self.d}) {'causal' if self.causal else 'full'}"

    @property
    def pairs(self) -> float:
        """Visible (query, key) pairs: the work that cannot be skipped (causal:
        ``n (n + 1) / 2`` per head; the diagonal tiles' masked half is not counted)."""
        return self.b * self.h * (self.n * (self.n + 1) / 2 if self.causal else float(self.n) ** 2)

    @property
    def flops(self) -> float:
        """Matmul flops of the forward pass: ``q k^T`` and ``p v``, ``2 d`` per pair each."""
        return self.pairs * 4.0 * self.d

    @property
    def exps(self) -> float:
        return self.pairs


#: The shapes of the performance issue, causal and not: multi-head prefill at D = 64 and 128.
SHAPES = ((1, 1, 4096, 64), (1, 8, 4096, 64), (1, 4, 8192, 128), (2, 16, 2048, 128))
CASES = tuple(BenchCase(b, h, n, d, causal) for causal in (True, False) for b, h, n, d in SHAPES)
QUICK_CASES = (BenchCase(1, 1, 1024), BenchCase(1, 2, 1024), BenchCase(1, 1, 1024, causal=False))
BACKWARD_CASES = tuple(BenchCase(b, h, n, d) for b, h, n, d in SHAPES)
QUICK_BACKWARD_CASES = (BenchCase(1, 1, 1024),)


def spread(times) -> dict:
    """``{"min", "median", "max", "n"}`` of a list of seconds (or of ratios)."""
    times = [float(t) for t in times]
    return {"min": min(times), "median": statistics.median(times), "max": max(times), "n": len(times)}


def ratio_spread(numerators, denominators) -> dict:
    """`spread` of the ratios of paired repeats: ``a[i] / b[i]``, repeat by repeat (both timed
    in the same interleaved round, so the ratio of a round cancels what loaded that round)."""
    return spread([a / b for a, b in zip(numerators, denominators)])


def interleaved(runs: dict, repeats: int, args: dict | None = None) -> dict:
    """Every repeat's seconds of each ``runs[name](args[name])`` (``runs[name]()`` without
    ``args``): each repeat calls every one once, in turn."""
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            a = () if args is None else (args[name],)
            start = time.perf_counter()
            run(*a)
            times[name].append(time.perf_counter() - start)
    return times


def time_cases(cases, impls, repeats=5, log=None) -> list[dict]:
    """Median seconds of every implementation on every case, interleaved over repeats;
    ``row["times"][name]`` holds every repeat's seconds (for `spread` and `ratio_spread`).

    ``impls`` maps a name to ``(prepare, run)``: ``prepare(q, k, v, causal)`` turns numpy
    inputs into the callee's arguments (untimed), ``run(args)`` is timed.  "dense numpy"
    runs only where its score matrix fits in memory.
    """
    rows = []
    for case in cases:
        q, k, v = random_qkv(case.n, d=case.d, batch=(case.b,), heads=case.h, seed=0)
        runnable = {name: (prep, run) for name, (prep, run) in impls.items()
                    if name != "dense numpy" or dense_fits(case.n, heads=case.b * case.h)}
        args = {name: prep(q, k, v, case.causal) for name, (prep, _) in runnable.items()}
        for name, (_, run) in runnable.items():
            run(args[name])  # warm-up
        times = interleaved({name: run for name, (_, run) in runnable.items()}, repeats, args)
        row = {"case": case.name, **asdict(case)}
        row.update({name: statistics.median(t) for name, t in times.items()})
        row["times"] = times
        rows.append(row)
        if log:
            log(case.name + ": " + ", ".join(f"{n} {row[n]:.3f} s" for n in runnable))
    return rows
