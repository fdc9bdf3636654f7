"""Where the tiled forward's time goes: a breakdown by phase.

The kernel's steps for one tile (`tiles.tile_scores` and `OnlineSoftmax.update` with the
keys-first layout) are replayed one at a time on a tile of the case's own data, on one
thread, each timed over many repetitions; multiplied by the number of FULL and PARTIAL
tiles the case processes, they predict the serial time of everything the kernel does with
numpy.  What the measured serial time holds beyond the sum is the rest: Python's per-tile
work, per-unit setup (tile classes, the query tile's copy, ``finalize``) and cache effects
of running the steps back to back.  The replay is one head per tile; the kernel batches
up to `parallel._UNIT_BYTES` of heads into one tile, which changes the Python work per
head, not the numpy work.
"""

from __future__ import annotations

import time

import numpy as np

from ..evidence.inputs import random_qkv
from ..core.masks import FULL, PARTIAL, MaskSpec
from ..core.online import OnlineSoftmax, _shift
from ..core.tilesizes import TileSizes, default_tiles
from ..core.parallel import _parallel_settings
from ..core.tiled import attention
from .timing import interleaved

#: The phases, in the order the kernel runs them.
PHASES = ("q k^T matmul", "mask (PARTIAL tiles)", "row max", "shift s - m", "exp",
          "row sum", "rescale l, acc", "p @ v matmul")


def _per_call(fn, budget=0.05, repeats=5) -> np.ndarray:
    """``(median, min, max)`` seconds of one ``fn()`` over ``repeats`` samples, each a loop of
    about ``budget`` seconds."""
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < budget / 5:
        fn()
        calls += 1
    loops = max(1, calls * 5)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - t0) / loops)
    return np.array([np.median(samples), np.min(samples), np.max(samples)])


def _tile_phases(q_i, k_j, v_j, spec, rows, cols, state, partial) -> dict:
    """Seconds of each phase on one tile (``state`` is a row's mid-way state, reused)."""
    s = np.empty((k_j.shape[0], q_i.shape[0]))
    np.matmul(k_j, q_i.T, out=s)
    cache = {}  # the kernel's band masks (MaskSpec.tile_visible), built once per diagonal
    visible = spec.tile_visible(rows, int(cols[0]), int(cols[-1]) + 1, True, contiguous=True, cache=cache)
    if partial:
        np.copyto(s, -np.inf, where=~visible)
    scores = s.copy()  # the tile as the max sees it
    m_new = np.maximum(state.m, scores.max(axis=-2))
    shift = _shift(m_new)
    shifted = scores - shift
    p = np.maximum(np.exp(shifted, where=visible, out=np.full_like(shifted, -np.inf)), 0.0)

    def exp():  # as OnlineSoftmax.update: exp only where visible, then -inf -> 0
        if partial:
            np.exp(shifted, out=work, where=visible)
            np.maximum(work, 0.0, out=work)
        else:
            np.exp(shifted, out=work)

    ones = np.ones(k_j.shape[0])
    pv = np.empty((v_j.shape[1], q_i.shape[0]))
    acc, l = state.acc.copy(), state.l.copy()
    # The tile's alpha, kept >= 0.999: applied thousands of times over, a smaller one would
    # drive acc into subnormal numbers, whose arithmetic is many times slower.
    alpha = np.maximum(np.exp(state.m - shift), 0.999)
    work = np.empty_like(s)
    return {
        "q k^T matmul": _per_call(lambda: np.matmul(k_j, q_i.T, out=work)),
        "mask (PARTIAL tiles)": (_per_call(lambda: np.copyto(work, -np.inf, where=~spec.tile_visible(
            rows, int(cols[0]), int(cols[-1]) + 1, True, contiguous=True, cache=cache))) if partial else np.zeros(3)),
        "row max": _per_call(lambda: scores.max(axis=-2)),
        "shift s - m": _per_call(lambda: np.subtract(scores, shift, out=work)),
        "exp": _per_call(exp),
        "row sum": _per_call(lambda: np.matmul(ones, p)),
        "rescale l, acc": _per_call(lambda: (np.maximum(state.m, state.m), np.isfinite(state.m),
                                             _shift(state.m), np.exp(state.m - shift),
                                             np.multiply(l, alpha, out=l),
                                             np.multiply(acc, alpha[:, None], out=acc))),
        "p @ v matmul": _per_call(lambda: np.add(acc, np.matmul(v_j.T, p, out=pv).T, out=acc)),
    }


def phase_breakdown(case, tiles: TileSizes | None = None, repeats: int = 5, workers=None) -> dict:
    """Predicted seconds per phase for ``case`` against its measured time.

    Returns ``phases`` (rows of phase, seconds over the whole case on one thread, the median
    of 5 replays with their ``min`` and ``max``, share of the measured serial time), ``measured_serial`` (``workers=1``), ``measured`` (with
    ``workers``; None: the default, every CPU), ``workers``, ``tiles`` (FULL and PARTIAL
    tile counts over all heads) and ``rest`` (measured serial minus the phases' sum).
    """
    from ..core.validate import workers as resolve

    threads = resolve(workers)
    tiles = default_tiles(case.d) if tiles is None else tiles  # the forward's own
    bq, bk = tiles.block_q, tiles.block_k
    q, k, v = random_qkv(case.n, d=case.d, batch=(case.b,), heads=case.h, seed=0)
    spec = MaskSpec(case.n, case.n, case.causal)
    kinds = spec.tile_kinds(bq, bk)
    heads = case.b * case.h
    counts = {"FULL": int((kinds == FULL).sum()) * heads, "PARTIAL": int((kinds == PARTIAL).sum()) * heads}
    a = kinds.shape[0] - 1  # the last query tile sees every kind there is
    q0, q1 = a * bq, min(case.n, (a + 1) * bq)
    q_i = q[0, 0, q0:q1] * case.d ** -0.5
    rows = np.arange(q0, q1)
    with _parallel_settings():
        state = OnlineSoftmax.empty((q1 - q0,), case.d, keys_first=True)  # acc as the kernel keeps it
        state.update(k[0, 0, :bk] @ q_i.T, v[0, 0, :bk], keys_first=True)  # a mid-row state
        per_kind = {}
        for kind, name in ((FULL, "FULL"), (PARTIAL, "PARTIAL")):
            found = np.flatnonzero(kinds[a] == kind)
            if found.size and counts[name]:
                b = int(found[-1])
                k0, k1 = b * bk, min(case.n, (b + 1) * bk)
                per_kind[name] = _tile_phases(q_i, k[0, 0, k0:k1], v[0, 0, k0:k1], spec, rows,
                                              np.arange(k0, k1), state, kind == PARTIAL)
        run = {w: (lambda w=w: attention(q, k, v, causal=case.causal, workers=w, block_q=bq, block_k=bk))
               for w in (1, threads)}
        for fn in run.values():
            fn()  # warm-up
        times = interleaved(run, repeats)
    serial, measured = float(np.median(times[1])), float(np.median(times[threads]))
    # (median, min, max) per phase: each replay's spread times the tile counts
    spread = {p: sum(per_kind[kind][p] * counts[kind] for kind in per_kind) for p in PHASES}
    total = {p: float(spread[p][0]) for p in PHASES}
    rest = serial - sum(total.values())
    phases = [{"phase": p, "seconds": total[p], "min": float(spread[p][1]), "max": float(spread[p][2]),
               "share": total[p] / serial} for p in PHASES]
    phases.append({"phase": "rest (Python, setup, cache)", "seconds": rest, "min": None, "max": None,
                   "share": rest / serial})
    return {"case": case.name, "phases": phases, "measured_serial": serial, "measured": measured,
            "workers": threads, "tiles": counts, "rest": rest,
            "serial_times": times[1], "times": times[threads],
            "parallel_efficiency": serial / (threads * measured)}
