"""The tile-size sweep: the tiled forward's time for every ``(block_q, block_k)``."""

from __future__ import annotations

import time

import numpy as np

from ..evidence.inputs import random_qkv
from ..core.tiled import attention
from .timing import BenchCase


def tile_sweep(case=BenchCase(1, 1, 4096), sizes=(64, 128, 256, 512), workers=None, repeats=3):
    """Seconds of the tiled forward for every ``(block_q, block_k)`` in ``sizes``^2,
    interleaved: each repeat visits every tile shape once.  ``seconds`` is the median of the
    repeats per shape (rows ``block_q``, columns ``block_k``), ``min`` and ``max`` their
    spread, ``times`` every repeat."""
    q, k, v = random_qkv(case.n, d=case.d, batch=(case.b,), heads=case.h, seed=0)
    times = np.zeros((len(sizes), len(sizes), repeats))
    attention(q, k, v, causal=case.causal, workers=workers)  # warm-up
    for r in range(repeats):
        for i, bq in enumerate(sizes):
            for j, bk in enumerate(sizes):
                start = time.perf_counter()
                attention(q, k, v, causal=case.causal, block_q=bq, block_k=bk, workers=workers)
                times[i, j, r] = time.perf_counter() - start
    from ..core.validate import workers as resolve

    return {"sizes": list(sizes), "seconds": np.median(times, axis=-1).tolist(),
            "min": times.min(axis=-1).tolist(), "max": times.max(axis=-1).tolist(),
            "times": times.tolist(), "repeats": repeats, "case": case.name, "d": case.d,
            "workers": resolve(workers)}
