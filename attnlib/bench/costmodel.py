"""The scale-out report's cost model: the plan's task counts and bytes (`plan_stats`), a
non-negative least-squares fit of the measured runs' times to per-flop, per-task and fixed
terms (`fit_cost_model`), its predictions, resampled refits for the ranges, and the
projection to contexts no one machine can finish (`project`, `project_range`).  Pure
arithmetic on measured rows: no cluster is started here (`attnlib.bench.scaleout` measures).
"""

from __future__ import annotations

import functools
import numbers

import numpy as np

from ..core.masks import mask_specs


def plan_stats(b, h, n, d, block, causal=True, heads_per_task=1) -> dict:
    """Task counts of the plan, the bytes each piece reads (q block, k and v ranges), the
    visible pairs and their flops, and the flops of the plan's largest piece (its whole
    ``block_q x kv_block`` rectangle)."""
    return dict(_plan_stats(b, h, n, d, block, causal, heads_per_task))


@functools.lru_cache(maxsize=64)
def _plan_stats(b, h, n, d, block, causal, heads_per_task) -> dict:
    # Made once per shape: a projection's plan (2^20 keys, 32 heads) holds ~10^6 pieces, and
    # each projected cluster size and its range asked for it again (17 plans, 10 s, in a test).
    from ..distributed import count_tasks, make_plan

    specs = mask_specs((b,), n, n, causal=causal)
    blocks = make_plan((b,), h, n, n, specs, block, block, heads_per_task)
    counts = count_tasks(blocks)
    piece_bytes = [8 * heads_per_task * ((p.q1 - p.q0) * d + 2 * (p.k1 - p.k0) * d)
                   for blk in blocks for p in blk.pieces]
    piece_flops = 4 * d * heads_per_task * max((p.q1 - p.q0) * (p.k1 - p.k0)
                                               for blk in blocks for p in blk.pieces)
    visible = b * h * (n * (n + 1) // 2 if causal else n * n)
    return {**counts, "bytes_per_piece": int(max(piece_bytes)), "bytes_read": int(sum(piece_bytes)),
            "visible_pairs": visible, "flops": 4 * d * visible, "piece_flops": int(piece_flops)}


#: The cost model's terms: a run's wall seconds on ``w`` workers, ``w_m`` of them on each
#: machine of ``c`` cores, with ``tasks`` pieces and merges, are
#: ``flops / w (t_flop + t_shared (w_m - 1) / (c - 1)) + tasks t_task / w + tasks t_serial
#: + latency + piece_flops (w - 1) / w t_tail``: a worker's time per flop alone on its
#: machine, what the other busy workers of its machine add to it (shared caches, memory
#: bandwidth, hyperthreads), a cost per task spread over the workers, a cost per task that
#: no worker count divides (the client submitting the tasks one by one, the scheduler), a
#: fixed latency per call, and the call's tail: its last pieces, run while the other
#: workers have nothing left (about one piece's seconds of ``w - 1`` of the ``w``
#: workers; none on one worker).
MODEL_TERMS = ("seconds_per_flop", "shared_seconds_per_flop", "seconds_per_task",
               "serial_seconds_per_task", "latency_seconds", "tail_seconds_per_flop")


def _shared(row) -> float:
    """``(w_m - 1) / (c - 1)``: the share of a machine's other cores busy beside a worker."""
    c = row["machine_cores"]
    return (row["workers_per_machine"] - 1) / (c - 1) if c > 1 else 0.0


def _design(row) -> list:
    w, tasks = row["workers"], row["pieces"] + row["merges"]
    return [row["flops"] / w, row["flops"] / w * _shared(row), tasks / w, tasks, 1.0,
            row["piece_flops"] * (w - 1) / w]


def _nnls(a, y, keep=0):
    """Least squares with every coefficient >= 0 (a negative cost is noise), exactly: the
    best of the fits on every subset of the terms that holds ``keep`` (the work's) and gives
    no negative coefficient (a handful of terms: 2^5 subsets)."""
    n = a.shape[1]
    best, best_res = None, np.inf
    others = [i for i in range(n) if i != keep]
    for mask in range(1 << len(others)):
        active = [keep] + [i for j, i in enumerate(others) if mask >> j & 1]
        coef = np.zeros(n)
        coef[active] = np.linalg.lstsq(a[:, active], y, rcond=None)[0]
        if coef.min() < 0 or coef[keep] <= 0:
            continue
        res = float(np.sum((a @ coef - y) ** 2))
        if res < best_res:
            best, best_res = coef, res
    return best


def fit_cost_model(rows, shared_slowdown=None) -> dict:
    """The model (`MODEL_TERMS`) fitted to measured runs (``rows``: dicts with ``flops``,
    ``piece_flops``, ``pieces``, ``merges``, ``workers``, ``workers_per_machine``,
    ``machine_cores`` and ``wall``) by least squares of the relative error (each run weighs
    the same, whatever its length), every term >= 0 (`_nnls`); with the rates per worker it
    implies, alone and on a full machine.

    ``shared_slowdown``: what a machine's other busy cores add to a worker's seconds per
    flop, as a fraction, measured apart (`kernel_slowdown`); the fit then holds
    ``t_shared = shared_slowdown x t_flop`` and fits the other terms.  Fitted from the walls
    instead, it takes on the per-call costs of short runs on many workers (which time
    does not divide by the workers) and is too slow on long ones.

    Refused where the runs cannot tell the terms apart: no more runs than terms, or runs
    whose design is rank-deficient (one cluster size only, one problem size only)."""
    a = np.array([_design(r) for r in rows], dtype=float)
    y = np.array([r["wall"] for r in rows], dtype=float)
    free = list(range(len(MODEL_TERMS)))
    if shared_slowdown is not None:
        if isinstance(shared_slowdown, bool) or not isinstance(shared_slowdown, numbers.Real):
            raise TypeError(f"shared_slowdown must be a real number, got {shared_slowdown!r}")
        shared_slowdown = float(shared_slowdown)
        if not 0 <= shared_slowdown < np.inf:
            raise ValueError(f"shared_slowdown must be a finite fraction >= 0, got {shared_slowdown!r}")
        a[:, 0] += shared_slowdown * a[:, 1]  # t_shared = shared_slowdown x t_flop
        free.remove(1)
    a = a[:, free]
    if len(rows) <= len(free) or np.linalg.matrix_rank(a / y[:, None]) < len(free):
        raise ValueError(f"{len(rows)} runs do not determine the model's {len(free)} fitted terms: give "
                         "more runs than terms, on at least two cluster sizes, of several sizes and blocks")
    if not (a[:, 0] > 0).all():
        raise ValueError("every run must have work (flops > 0) to determine a rate")
    fitted = _nnls(a / y[:, None], np.ones(len(rows)))
    if fitted is None:
        raise ValueError("the runs do not determine a positive rate: their times do not grow with the work")
    coef = np.zeros(len(MODEL_TERMS))
    coef[free] = fitted
    if shared_slowdown is not None:
        coef[1] = shared_slowdown * coef[0]
    model = dict(zip(MODEL_TERMS, map(float, coef)))
    model["shared_slowdown"] = shared_slowdown
    model["rate_alone"] = 1 / model["seconds_per_flop"]
    model["rate_full_machine"] = 1 / (model["seconds_per_flop"] + model["shared_seconds_per_flop"])
    return model


def kernel_slowdown(phases, cores) -> float:
    """What the machine's other busy cores add to a worker's seconds per flop, as a fraction
    per unit of `_shared`'s share: from the kernel seconds (Dask's metrics, `phases`) of the
    same problem on the smallest and the largest cluster of ``phases`` (``{workers:
    phases}``), timed in turn (`time_single_vs_cluster`); never below 0 (a faster kernel on
    a busier machine is noise)."""
    phases = {int(w): p for w, p in phases.items()}  # keys as read back from a report's JSON too
    if len(phases) < 2:
        raise ValueError("kernel_slowdown needs the phases of at least two cluster sizes")
    lo, hi = min(phases), max(phases)
    if not (phases[lo]["kernel"] > 0 and phases[hi]["kernel"] > 0):
        raise ValueError(f"kernel_slowdown needs kernel seconds > 0 on both clusters (Dask's fine metrics), got "
                         f"{phases[lo]['kernel']!r} and {phases[hi]['kernel']!r}")

    def share(w):
        return _shared({"workers_per_machine": w, "machine_cores": cores})

    if share(hi) == share(lo):
        raise ValueError(f"clusters of {lo} and {hi} workers on {cores} cores share the machine alike")
    # seconds per flop t (1 + slowdown x share): the ratio of the two solved for the slowdown
    ratio = phases[hi]["kernel"] / phases[lo]["kernel"]
    if share(hi) - ratio * share(lo) <= 0:
        raise ValueError(f"the kernel's seconds on {lo} and {hi} workers ({ratio:.2f}x) fit no slowdown")
    return max(0.0, (ratio - 1) / (share(hi) - ratio * share(lo)))


def predict(model, row) -> float:
    """Wall seconds the model gives for ``row`` (as `fit_cost_model`'s, without ``wall``)."""
    return float(np.dot([model[t] for t in MODEL_TERMS], _design(row)))


def model_errors(model, rows) -> list:
    """``predicted / measured - 1`` for each run."""
    return [predict(model, r) / r["wall"] - 1 for r in rows]


def project(model, n, heads, d, machines, cores, block, scheduler_tps, causal=True) -> dict:
    """The model's wall time for ``(1, heads, n, d)`` on ``machines`` x ``cores`` workers,
    never below either floor: the flops at the fitted rate of a worker on a full machine on
    every worker, and the task count at the measured scheduler throughput
    (``scheduler_tps``)."""
    stats = plan_stats(1, heads, n, d, block, causal)
    workers = machines * cores
    row = {**stats, "workers": workers, "workers_per_machine": cores, "machine_cores": cores}
    model_s = predict(model, row)
    per_flop = model["seconds_per_flop"] + model["shared_seconds_per_flop"] * _shared(row)
    compute_floor = stats["flops"] * per_flop / workers
    scheduler_floor = (stats["pieces"] + stats["merges"]) / scheduler_tps
    seconds = max(model_s, compute_floor, scheduler_floor)
    bound = ("scheduler" if seconds == scheduler_floor and scheduler_floor > model_s
             else "compute floor" if seconds == compute_floor and compute_floor > model_s else "model")
    return {"n": n, "heads": heads, "d": d, "machines": machines, "workers": workers,
            "pieces": stats["pieces"], "merges": stats["merges"], "flops": stats["flops"],
            "bytes_per_piece": stats["bytes_per_piece"], "model_hours": model_s / 3600,
            "compute_floor_hours": compute_floor / 3600, "scheduler_floor_hours": scheduler_floor / 3600,
            "hours": seconds / 3600, "bound": bound}


def _resampled(rows, rng) -> list:
    """``rows`` with each ``wall`` the median of its ``walls`` drawn again with replacement."""
    return [{**r, "wall": float(np.median(rng.choice(r["walls"], len(r["walls"]))))} for r in rows]


def bootstrap_models(fit_rows, kernel_by_run, cores, draws=200, seed=0) -> dict:
    """The cost model's parameter uncertainty: ``draws`` refits, each to the fitted runs'
    repeats drawn again with replacement (each row's median of its redrawn ``walls``), with
    `kernel_slowdown` from the timing runs' kernel seconds drawn again the same way
    (``kernel_by_run``: ``{workers: [seconds, ...]}``).  ``models``: the refits; ``skipped``:
    draws whose runs determined no model (a redraw that fits no slowdown or no rate);
    ``seed`` fixes the draws."""
    rng = np.random.default_rng(seed)
    models, skipped = [], 0
    for _ in range(draws):
        kernel = {w: {"kernel": float(np.median(rng.choice(ks, len(ks))))} for w, ks in kernel_by_run.items()}
        try:
            slowdown = kernel_slowdown(kernel, cores)
            models.append(fit_cost_model(_resampled(fit_rows, rng), shared_slowdown=slowdown))
        except ValueError:
            skipped += 1
    return {"models": models, "skipped": skipped, "draws": draws}


def percentile_range(values, q=(5, 95)) -> tuple:
    """The ``q`` percentiles of ``values``, as floats."""
    lo, hi = np.percentile(np.asarray(values, dtype=float), q)
    return float(lo), float(hi)


def heldout_error_range(models, rows, seed=1, q=(5, 95)) -> tuple:
    """The worst ``|predicted / measured - 1|`` over ``rows`` (with ``walls``), across the
    refits ``models`` (`bootstrap_models`), each against the rows' repeats drawn again with
    replacement: its ``q`` percentiles."""
    rng = np.random.default_rng(seed)
    worst = [max(abs(e) for e in model_errors(m, _resampled(rows, rng))) for m in models]
    return percentile_range(worst, q)


def project_range(models, heldout_error, n, heads, d, machines, cores, block, rates, q=(5, 95)) -> dict:
    """The range of `project`'s hours: the model's seconds from the ``q`` percentiles over
    the refits ``models`` (`bootstrap_models`: the fit's parameter uncertainty), widened by
    the worst held-out error ``heldout_error`` (``e = predicted / measured - 1``, so a run
    takes between ``predicted / (1 + e)`` and ``predicted / (1 - e)``; unbounded above when
    ``e >= 1``); the compute floor over the refits' rates; the scheduler floor at the
    fastest and the slowest of the measured ``rates`` (tasks per second).  Each end is the
    largest of the three, as in `project`: ``{"low_hours", "high_hours", "model_low_hours",
    "model_high_hours", "low_floor_hours", "high_floor_hours"}`` (the last two: the larger
    floor at each end; the low one can be under `project`'s, which is at the fitted rate)."""
    stats = plan_stats(1, heads, n, d, block)
    workers = machines * cores
    row = {**stats, "workers": workers, "workers_per_machine": cores, "machine_cores": cores}
    lo_m, hi_m = percentile_range([predict(m, row) for m in models], q)
    e = float(heldout_error)
    lo_m, hi_m = lo_m / (1 + e), (hi_m / (1 - e) if e < 1 else float("inf"))
    per_flop = [m["seconds_per_flop"] + m["shared_seconds_per_flop"] * _shared(row) for m in models]
    lo_c, hi_c = (stats["flops"] * x / workers for x in percentile_range(per_flop, q))
    tasks = stats["pieces"] + stats["merges"]
    lo_s, hi_s = tasks / max(rates), tasks / min(rates)
    return {"low_hours": max(lo_m, lo_c, lo_s) / 3600, "high_hours": max(hi_m, hi_c, hi_s) / 3600,
            "model_low_hours": lo_m / 3600, "model_high_hours": hi_m / 3600,
            "low_floor_hours": max(lo_c, lo_s) / 3600, "high_floor_hours": max(hi_c, hi_s) / 3600}
