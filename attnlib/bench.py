"""Benchmarks: the tiled kernel against dense numpy and (when installed) PyTorch SDPA.

Everything is timed in one process, interleaved (each repeat runs every implementation on
every case once, in turn), and summarised by medians and ratios, because this machine is
shared and noisy.  The machine's own float64 matmul and ``exp`` rates are measured too, and
give the roofline of the causal forward pass: ``2 * Sq * Sk * D`` matmul flops and
``Sq * Sk / 2`` exponentials.  The backward pass is timed the same way (gradients only).
``python -m attnlib bench`` prints the tables; torch is an optional peer
(``pip install .[peers]``), never a dependency.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from .backward import attention_backward, reference_attention_backward
from .inputs import random_qkv
from .memory import dense_fits
from .reference import reference_attention
from .tiled import _parallel_settings as _one_blas_thread, attention  # refcounted guard


@dataclass(frozen=True)
class BenchCase:
    """One timing problem, ``(B, H, S, D)`` in torch's words."""

    b: int
    h: int
    n: int
    d: int = 64
    causal: bool = True

    @property
    def name(self) -> str:
        return f"({self.b}, {self.h}, {self.n}, {self.d}) {'causal' if self.causal else 'full'}"

    @property
    def flops(self) -> float:
        """Matmul flops of the forward pass: 2 matmuls of 2*n*n*d, halved when causal."""
        return self.b * self.h * 4.0 * self.n * self.n * self.d * (0.5 if self.causal else 1.0)

    @property
    def exps(self) -> float:
        return self.b * self.h * self.n * self.n * (0.5 if self.causal else 1.0)


CASES = (BenchCase(1, 1, 4096), BenchCase(1, 8, 4096), BenchCase(1, 1, 16384),
         BenchCase(1, 1, 4096, causal=False))
QUICK_CASES = (BenchCase(1, 1, 1024), BenchCase(1, 2, 1024), BenchCase(1, 1, 1024, causal=False))
BACKWARD_CASES = (BenchCase(1, 1, 4096),)
QUICK_BACKWARD_CASES = (BenchCase(1, 1, 1024),)


def _seconds(fn, repeats=5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_rates(workers: int = 1, size: int = 2048) -> dict:
    """Measured float64 rates: BLAS matmul (GFLOP/s) and numpy ``exp`` (G/s) on ``workers``
    threads, as the tiled kernel runs them."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((size, size)), rng.standard_normal((size, size))
    a @ b  # warm-up
    matmul = 2.0 * size**3 / _seconds(lambda: a @ b)
    # Values like the kernel's exponents (<= 0) in one tile-sized piece per thread (64K, as a
    # 256 x 256 tile), exponentiated in place of a reused buffer 64 times, as the kernel
    # does (so the data is in cache); the pool is started before the clock, as the
    # kernel's would be.
    pieces = [-np.abs(rng.standard_normal(1 << 16)) * 8 for _ in range(workers)]
    outs = [np.empty_like(p) for p in pieces]

    def exp_piece(i):
        for _ in range(64):
            np.exp(pieces[i], out=outs[i])

    with _one_blas_thread(), ThreadPoolExecutor(workers) as pool:
        exp_all = lambda: list(pool.map(exp_piece, range(workers)))  # noqa: E731
        exp_all()  # warm-up: the threads exist before the clock starts
        exp_rate = 64 * workers * (1 << 16) / _seconds(exp_all)
    return {"matmul_gflops": matmul / 1e9, "exp_gps": exp_rate / 1e9, "workers": workers}


def roofline_seconds(case: BenchCase, rates: dict) -> float:
    """The time the matmuls and exps alone would take at the machine's measured rates."""
    return case.flops / (rates["matmul_gflops"] * 1e9) + case.exps / (rates["exp_gps"] * 1e9)


def _torch_sdpa():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, None

    def run(q, k, v, causal, grad=False):
        with torch.set_grad_enabled(grad):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return torch, run


def implementations(workers=(1, 2), include_torch=True) -> dict:
    """The forward passes: ``{name: (prepare, run)}``; ``prepare(q, k, v, causal)`` turns
    numpy inputs into the callee's arguments (untimed), ``run(args)`` is timed."""
    impls = {}
    for w in workers:
        impls[f"tiled w={w}"] = (_as_is, lambda a, w=w: attention(*a[:3], causal=a[3], workers=w))
    impls["dense numpy"] = (_as_is, lambda a: reference_attention(*a[:3], causal=a[3]))
    torch, sdpa = _torch_sdpa() if include_torch else (None, None)
    if torch is not None:
        impls[f"torch {torch.__version__} SDPA"] = (
            lambda q, k, v, c: tuple(torch.from_numpy(x) for x in (q, k, v)) + (c,),
            lambda a: sdpa(*a))
    return impls


def backward_implementations(workers=(1, 2), include_torch=True) -> dict:
    """The backward passes, as `implementations`: the forward (with ``lse``, or torch's
    autograd graph) is built in ``prepare``, so only the gradient is timed."""
    def upstream(q, v):  # the same dout for every implementation: (..., Sq, Dv)
        return np.random.default_rng(1).standard_normal(q.shape[:-1] + v.shape[-1:])

    def prepare(q, k, v, c):
        out, lse = attention(q, k, v, causal=c, return_lse=True)
        return q, k, v, out, lse, upstream(q, v), c

    impls = {}
    for w in workers:
        impls[f"tiled w={w}"] = (prepare, lambda a, w=w: attention_backward(
            *a[:6], causal=a[6], workers=w))
    impls["dense numpy"] = (prepare, lambda a: reference_attention_backward(
        *a[:3], a[5], causal=a[6]))
    torch, sdpa = _torch_sdpa() if include_torch else (None, None)
    if torch is not None:
        def torch_prepare(q, k, v, c):
            dout = torch.from_numpy(upstream(q, v))
            q, k, v = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
            return sdpa(q, k, v, c, grad=True), (q, k, v), dout

        impls[f"torch {torch.__version__} SDPA"] = (torch_prepare, lambda a: torch.autograd.grad(
            a[0], a[1], a[2], retain_graph=True))
    return impls


def _as_is(*args):
    return args


def time_cases(cases, impls, repeats=5, log=None) -> list[dict]:
    """Median seconds of every implementation on every case, interleaved over repeats."""
    rows = []
    for case in cases:
        q, k, v = random_qkv(case.n, d=case.d, batch=(case.b,), heads=case.h, seed=0)
        runnable = {name: (prep, run) for name, (prep, run) in impls.items()
                    if name != "dense numpy" or dense_fits(case.n, heads=case.b * case.h)}
        args = {name: prep(q, k, v, case.causal) for name, (prep, _) in runnable.items()}
        for name, (_, run) in runnable.items():
            run(args[name])  # warm-up
        times = {name: [] for name in runnable}
        for _ in range(repeats):
            for name, (_, run) in runnable.items():
                start = time.perf_counter()
                run(args[name])
                times[name].append(time.perf_counter() - start)
        row = {"case": case.name, **asdict(case)}
        row.update({name: statistics.median(t) for name, t in times.items()})
        rows.append(row)
        if log:
            log(case.name + ": " + ", ".join(f"{n} {row[n]:.3f} s" for n in runnable))
    return rows


def tile_sweep(case=BenchCase(1, 1, 4096), sizes=(64, 128, 256, 512), workers=1, repeats=3):
    """Median seconds of the tiled forward for every ``(block_q, block_k)`` in ``sizes``^2."""
    q, k, v = random_qkv(case.n, d=case.d, batch=(case.b,), heads=case.h, seed=0)
    grid = np.zeros((len(sizes), len(sizes)))
    for _ in range(repeats):  # interleaved: each repeat visits every tile shape once
        for i, bq in enumerate(sizes):
            for j, bk in enumerate(sizes):
                start = time.perf_counter()
                attention(q, k, v, causal=case.causal, block_q=bq, block_k=bk, workers=workers)
                elapsed = time.perf_counter() - start
                grid[i, j] = elapsed if _ == 0 else min(grid[i, j], elapsed)
    return {"sizes": list(sizes), "seconds": grid.tolist(), "case": case.name, "workers": workers}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m attnlib bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small cases, a smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch out even if installed")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    rates = {w: machine_rates(w) for w in args.workers}
    for w, r in rates.items():
        log(f"machine, {w} thread(s): matmul {r['matmul_gflops']:.1f} GFLOP/s, exp {r['exp_gps']:.3f} G/s")
    impls = implementations(args.workers, include_torch=not args.no_torch)
    rows = time_cases(QUICK_CASES if args.quick else CASES, impls, args.repeats, log)
    log("\nratios (median times):")
    for row in rows:
        case = BenchCase(row["b"], row["h"], row["n"], row["d"], row["causal"])
        parts = []
        for w in args.workers:
            tiled = row[f"tiled w={w}"]
            fraction = roofline_seconds(case, rates[w]) / tiled
            parts.append(f"w={w}: roofline {fraction:.0%}")
            for other in impls:
                if not other.startswith("tiled") and other in row:
                    parts.append(f"w={w}/{other.split(' SDPA')[0]} {tiled / row[other]:.2f}")
        log(f"  {row['case']}: " + ", ".join(parts))
    log("\nbackward (gradients only; the forward is built beforehand):")
    backward_impls = backward_implementations(args.workers, include_torch=not args.no_torch)
    backward_rows = time_cases(QUICK_BACKWARD_CASES if args.quick else BACKWARD_CASES,
                               backward_impls, args.repeats, log)
    for row in backward_rows:
        log(f"  {row['case']}: " + ", ".join(
            f"w={w}/{other.split(' SDPA')[0]} {row[f'tiled w={w}'] / row[other]:.2f}"
            for w in args.workers for other in backward_impls
            if not other.startswith("tiled") and other in row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rates": rates, "rows": rows, "backward": backward_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
