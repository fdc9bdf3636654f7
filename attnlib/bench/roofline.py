"""The roofline: how fast the tiled forward could be on this machine, from measured rates.

The forward does two matmuls and one ``exp`` per visible (query, key) pair; everything
else (the row max, the shift, the sum, the rescale, masking, Python) is overhead on top.
The rates are measured at the kernel's own tile shapes, on as many threads as the kernel
runs, each thread on its own tile, as the kernel's threads are:

- ``k_j q_i^T``: ``(block_k, D) @ (D, block_q)``, ``q_i`` read transposed in place;
- ``v_j^T p``: ``(Dv, block_k) @ (block_k, block_q)``, ``v_j`` read transposed in place;
- ``exp`` of a ``(block_k, block_q)`` tile of exponents like the kernel's (``<= 0``),
  in place of a reused buffer (so in cache, as the kernel's tile is).

A tile-sized product runs well below BLAS's peak on large matrices, and the peak differs
between machines (and between runs on a shared one), so a roofline is only meaningful
when measured in the same run as the times it divides.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..core.tilesizes import TileSizes, default_tiles
from ..core.parallel import _parallel_settings


def tile_rates(workers: int | None = None, d: int = 64, dv: int | None = None, tiles: TileSizes | None = None,
               seconds: float = 0.2, repeats: int = 5) -> dict:
    """Throughput of the kernel's three tile operations on ``workers`` threads at once.

    Each operation runs on every thread concurrently for about ``seconds`` per repeat;
    the median of ``repeats`` gives the rate.  ``workers``: as the kernels take it (None:
    every available CPU, the kernels' default); ``tiles``: default, the forward's own
    (`tilesizes.default_tiles` of ``d``).  Returns ``qk_gflops`` and ``pv_gflops``
    (GFLOP/s over all threads), ``exp_gps`` (G exponentials/s over all threads), each the
    median of the repeats with their ``_min`` and ``_max``, and the shapes measured.
    """
    from ..core.validate import workers as resolve

    workers = resolve(workers)
    tiles = default_tiles(d) if tiles is None else tiles
    dv = d if dv is None else dv
    bq, bk = tiles.block_q, tiles.block_k
    rng = np.random.default_rng(0)

    def per_thread():  # each thread its own tile and operands
        q_i = rng.standard_normal((bq, d))
        k_j = rng.standard_normal((bk, d))
        v_j = rng.standard_normal((bk, dv))
        s = np.empty((bk, bq))
        exponents = -np.abs(rng.standard_normal((bk, bq))) * 4.0
        pv = np.empty((dv, bq))
        return {
            "qk": lambda: np.matmul(k_j, q_i.T, out=s),
            "pv": lambda: np.matmul(v_j.T, exponents, out=pv),
            "exp": lambda: np.exp(exponents, out=s),
        }

    ops = [per_thread() for _ in range(workers)]
    work = {"qk": 2.0 * bq * bk * d, "pv": 2.0 * bq * bk * dv, "exp": float(bq * bk)}
    out = {}
    with _parallel_settings(), ThreadPoolExecutor(workers) as pool:
        for name, key in (("qk", "qk_gflops"), ("pv", "pv_gflops"), ("exp", "exp_gps")):
            fn = ops[0][name]
            start = time.perf_counter()
            calls = 0
            while time.perf_counter() - start < seconds / 10:  # calibrate the loop length
                fn()
                calls += 1
            loops = max(1, calls * 10)
            barrier = threading.Barrier(workers)

            def run(t, loops=loops, name=name, barrier=barrier):
                f = ops[t][name]
                barrier.wait()
                begin = time.perf_counter()
                for _ in range(loops):
                    f()
                return time.perf_counter() - begin

            samples = []
            for _ in range(repeats):
                elapsed = max(pool.map(run, range(workers)))  # all threads at once
                samples.append(workers * loops * work[name] / elapsed)
            out[key] = statistics.median(samples) / 1e9
            out[key + "_min"], out[key + "_max"] = min(samples) / 1e9, max(samples) / 1e9  # the repeats' spread
    return out | {"workers": workers, "d": d, "dv": dv, "block_q": bq, "block_k": bk}


def roofline_seconds(case, rates: dict) -> float:
    """The time the forward's matmuls and exps alone would take at ``rates`` (`tile_rates`
    for the case's ``D``): ``2 D`` flops per visible pair in each matmul, one ``exp``."""
    return (case.pairs * 2.0 * case.d / (rates["qk_gflops"] * 1e9)
            + case.pairs * 2.0 * case.d / (rates["pv_gflops"] * 1e9)
            + case.exps / (rates["exp_gps"] * 1e9))
