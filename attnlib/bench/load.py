"""The default call on a busy machine: quiet against beside a CPU-bound process.

A shared machine is the normal case (CI runners, a laptop compiling, another benchmark).
A kernel that spins BLAS threads or pins every core to itself collapses there: with one
worker and a two-thread OpenBLAS, (1, 1, 4096, 64) causal took 1393 ms instead of 55 ms
while one other process kept a core busy.  attnlib's kernels hold BLAS to one thread
while their own threads run, so a busy core only takes its share.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from ..evidence.inputs import random_qkv
from ..core.tiled import attention

#: The busy process: pure Python, one core, until killed.
HOG = "while True: pass"


def under_load(case, repeats: int = 5, settle: float = 0.3) -> dict:
    """Median seconds of ``attention`` with default arguments on ``case``, quiet and with a
    CPU-bound process running, interleaved (quiet, loaded, quiet, ...); a new busy process
    for every loaded repeat, started ``settle`` seconds before the clock."""
    q, k, v = random_qkv(case.n, d=case.d, batch=(case.b,), heads=case.h, seed=0)

    def call():  # its seconds
        start = time.perf_counter()
        attention(q, k, v, causal=case.causal)
        return time.perf_counter() - start

    call()  # warm-up
    quiet, loaded = [], []
    for _ in range(repeats):
        quiet.append(call())
        hog = subprocess.Popen([sys.executable, "-c", HOG])
        try:
            time.sleep(settle)
            loaded.append(call())
        finally:
            hog.kill()
            hog.wait()
    q_med, l_med = statistics.median(quiet), statistics.median(loaded)
    return {"case": case.name, "quiet": q_med, "loaded": l_med, "slowdown": l_med / q_med,
            "repeats": repeats, "quiet_times": quiet, "loaded_times": loaded}
