"""The tile-size sweep: the tiled forward's time for every ``(block_q, block_k)``."""

from __future__ import annotations

import time

import numpy as np

from ..evidence.inputs import random_qkv
from ..core.tiled import attention
from .timing import BenchCase


def tile_sweep(case=BenchCase(1, 1, 4096), sizes=(64, 128, 256, 512), workers=None, repeats=3):
    """Best seconds of the tiled forward for every ``(block_q, block_k)`` in ``sizes``^2,
    interleaved: each repeat visits every tile shape once."""
    q, k, v = random_qkv(case.n, d=case.d, batch=(case.b,), heads=case.h, seed=0)
    grid = np.full((len(sizes), len(sizes)), np.inf)
    for _ in range(repeats):
        for i, bq in enumerate(sizes):
            for j, bk in enumerate(sizes):
                start = time.perf_counter()
                attention(q, k, v, causal=case.causal, block_q=bq, block_k=bk, workers=workers)
                grid[i, j] = min(grid[i, j], time.perf_counter() - start)
    from ..core.validate import workers as resolve

    return {"sizes": list(sizes), "seconds": grid.tolist(), "case": case.name, "workers": resolve(workers)}
