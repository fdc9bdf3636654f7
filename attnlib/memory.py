"""Memory measurement: numpy-allocated bytes of one attention call, in a fresh process.

numpy reports its allocations to `tracemalloc`, so the traced peak of a call is exact
(bytes, not pages).  Each measurement runs in a new Python process after a warm-up call
at a small size, so that BLAS buffers, imports and earlier runs do not pollute it.  The
inputs are created before tracing starts; the peak therefore counts the call's working
memory plus its output, and ``working_bytes`` subtracts the output.
"""

from __future__ import annotations

import json
import subprocess
import sys

PATHS = ("tiled", "dense")

#: The fixed cap on the tiled forward's working memory (over inputs and output).
CAP_BYTES = 32 * 2**20


def peak_memory(path: str, sq: int, sk: int | None = None, d: int = 64, *,
                causal: bool = True, block_q: int | None = None, block_k: int | None = None,
                seed: int = 0, timeout: float = 600.0) -> dict:
    """Traced peak of one ``path`` call ("tiled" or "dense") on random inputs.

    Returns a dict with ``peak_bytes`` (traced peak during the call), ``output_bytes``
    (``out`` and ``lse``), ``working_bytes`` (peak minus output) and ``input_bytes``.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    case = dict(path=path, sq=sq, sk=sq if sk is None else sk, d=d, causal=causal,
                block_q=block_q, block_k=block_k, seed=seed)
    proc = subprocess.run(
        [sys.executable, "-m", "attnlib.memory", json.dumps(case)],
        capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement {case} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _call(case, q, k, v):
    from . import attention, reference_attention

    if case["path"] == "tiled":
        return attention(q, k, v, causal=case["causal"], block_q=case["block_q"],
                         block_k=case["block_k"], return_lse=True)
    return reference_attention(q, k, v, causal=case["causal"], return_lse=True)


def _measure(case: dict) -> dict:
    import tracemalloc

    from .inputs import random_qkv

    warm = random_qkv(256, 256, case["d"], seed=1)
    _call(case, *warm)  # warm-up: imports, BLAS buffers, code paths
    q, k, v = random_qkv(case["sq"], case["sk"], case["d"], seed=case["seed"])
    tracemalloc.start()
    tracemalloc.reset_peak()
    out, lse = _call(case, q, k, v)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    output = out.nbytes + lse.nbytes
    return dict(case, peak_bytes=peak, output_bytes=output, working_bytes=peak - output,
                input_bytes=q.nbytes + k.nbytes + v.nbytes)


if __name__ == "__main__":
    print(json.dumps(_measure(json.loads(sys.argv[1]))))
