"""Measurements of `attnlib.distributed` for the scale-out report.

Everything here runs on a real Dask cluster (a `LocalCluster` of worker processes,
one thread each) and measures: the time against the number of workers, the task counts
and bytes each piece reads against ``n``, the scheduler's share of the wall time, each
worker's peak of traced memory (tracemalloc, inside the worker), and a cost model fitted
to the measured runs that projects contexts no one machine can finish.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import numpy as np

from ..evidence.inputs import random_qkv
from ..core.masks import mask_specs


def save_case(folder, b: int, h: int, n: int, d: int, seed: int = 0) -> tuple:
    """q, k, v of ``(b, h, n, d)`` saved as ``.npy`` in ``folder``: their paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, x in zip("qkv", random_qkv(n, n, d, batch=(b,), heads=h, seed=seed)):
        path = os.path.join(folder, f"{name}_{b}x{h}x{n}x{d}.npy")
        np.save(path, x)
        paths.append(path)
    return tuple(paths)


def plan_stats(b, h, n, d, block, causal=True, heads_per_task=1) -> dict:
    """Task counts of the plan and the bytes each piece reads (q block, k and v ranges)."""
    from ..distributed import count_tasks, make_plan

    specs = mask_specs((b,), n, n, causal=causal)
    blocks = make_plan((b,), h, n, n, specs, block, block, heads_per_task)
    counts = count_tasks(blocks)
    piece_bytes = [8 * heads_per_task * ((p.q1 - p.q0) * d + 2 * (p.k1 - p.k0) * d)
                   for blk in blocks for p in blk.pieces]
    visible = b * h * (n * (n + 1) // 2 if causal else n * n)
    return {**counts, "bytes_per_piece": int(max(piece_bytes)), "bytes_read": int(sum(piece_bytes)),
            "visible_pairs": visible, "flops": 4 * d * visible}


#: Dask's own diagnostics, off in the clusters measured here: the workers' statistical
#: profiler and their per-task logs keep history that grows with run time and task count
#: (whatever the tasks do), up to their caps, and would be counted as the worker's memory.
QUIET_DASK = {"distributed.worker.profile.enabled": False,
              "distributed.admin.low-level-log-length": 100,
              "distributed.admin.log-length": 100}


@contextlib.contextmanager
def local_cluster(workers: int):
    """A `LocalCluster` of ``workers`` processes with one thread each (`QUIET_DASK`), and
    its client."""
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set(QUIET_DASK), LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True,
            dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


def timed_run(client, paths, block, causal=True, out=None) -> dict:
    """One `attnlib.distributed.attention` call: wall seconds, and the seconds the workers
    spent inside tasks (Dask's task stream), summed by task kind."""
    from distributed import get_task_stream

    from ..distributed import attention

    with get_task_stream(client=client) as stream:
        start = time.perf_counter()
        result = attention(*paths, client=client, causal=causal, block_q=block, kv_block=block, out=out)
        wall = time.perf_counter() - start
    busy = {"piece": 0.0, "merge": 0.0, "other": 0.0}
    for task in stream.data:
        kind = next((k for k in ("piece", "merge") if str(task["key"]).startswith(f"attnlib-{k}")), "other")
        busy[kind] += sum(s["stop"] - s["start"] for s in task["startstops"] if s["action"] == "compute")
    return {"wall": wall, "busy": busy, "result": result}


def time_workers(paths, block, worker_counts=(1, 2), repeats=3, causal=True) -> dict:
    """Median wall seconds per worker count: clusters started once each, runs interleaved."""
    clusters = {w: local_cluster(w) for w in worker_counts}
    clients = {w: cm.__enter__() for w, cm in clusters.items()}
    try:
        for c in clients.values():
            timed_run(c, paths, block, causal)  # warm-up: imports, first reads
        samples = {w: [] for w in worker_counts}
        busy = {w: [] for w in worker_counts}
        results = {}
        for _ in range(repeats):
            for w, c in clients.items():
                run = timed_run(c, paths, block, causal)
                samples[w].append(run["wall"])
                busy[w].append(sum(run["busy"].values()))
                results[w] = run["result"]
        same = all(np.array_equal(results[w], results[worker_counts[0]]) for w in worker_counts)
        return {"seconds": {w: statistics.median(s) for w, s in samples.items()},
                "busy": {w: statistics.median(s) for w, s in busy.items()},
                "bitwise_identical": bool(same)}
    finally:
        for cm in clusters.values():
            cm.__exit__(None, None, None)


def _trace_start():
    import tracemalloc

    if not tracemalloc.is_tracing():
        tracemalloc.start()
    tracemalloc.reset_peak()


def _trace_now():
    import tracemalloc

    return tracemalloc.get_traced_memory()  # (current, peak)


def worker_peaks(client, paths, block, out, causal=True, kv_block=None, calls=2) -> list:
    """Per worker: the peak of traced memory (tracemalloc, in the worker process) over a
    call that writes its output to ``out`` (the caller has warmed the cluster up with the
    same call), what is still traced after it (what Dask keeps: task records, logs), and
    their difference, the call's working memory.  ``[(peak, left, working), ...]`` in
    bytes, by worker, from the one of ``calls`` calls with the smallest working memory:
    what a call always needs, without a burst of Dask's own messages that one call may
    catch and the next not (a few hundred KiB, seen at small ``n``).  ``kv_block``
    (default ``block``) sets the pieces' key ranges."""
    from ..distributed import attention

    best = None
    for _ in range(calls):
        client.run(_trace_start)
        attention(*paths, client=client, causal=causal, block_q=block,
                  kv_block=block if kv_block is None else kv_block, out=out)
        now = [(peak, left, peak - left) for left, peak in
               (client.run(_trace_now)[w] for w in sorted(client.scheduler_info()["workers"]))]
        best = now if best is None else [min(a, b, key=lambda x: x[2]) for a, b in zip(best, now)]
    return best


def growth_bound(n_before: int, n_after: int, d: int) -> int:
    """The smallest memory a worker could hold that grows with ``n``: one head's keys for
    the positions added from ``n_before`` to ``n_after`` (``(n_after - n_before) * d``
    float64s).  A worker whose working memory grows by this much or more between the two
    runs holds something of the size of the sequence (a whole key range, every partial
    result); a flat one grows by less."""
    return 8 * (n_after - n_before) * d


def fit_cost_model(rows) -> dict:
    """Least squares of ``busy = flops / rate + pieces * c_piece`` over measured runs
    (``rows``: dicts with ``flops``, ``pieces``, ``busy``, ``wall``, ``workers``, all at one
    cluster size: a worker's rate is what it gets with every worker busy), and the time
    outside tasks per task, ``(wall * workers - busy) / tasks``, as their median."""
    a = np.array([[r["flops"], r["pieces"]] for r in rows], dtype=float)
    y = np.array([r["busy"] for r in rows])
    (per_flop, per_piece), *_ = np.linalg.lstsq(a, y, rcond=None)
    if per_piece < 0 or per_flop <= 0:  # a negative cost is noise: fit the flops alone
        per_flop, per_piece = float(a[:, 0] @ y / (a[:, 0] @ a[:, 0])), 0.0
    idle = [max(0.0, (r["wall"] * r["workers"] - r["busy"]) / (r["pieces"] + r["merges"])) for r in rows]
    return {"rate_flops_per_worker": 1.0 / per_flop, "seconds_per_piece": per_piece,
            "idle_seconds_per_task": statistics.median(idle)}


def predict(model, flops, pieces, merges, workers) -> float:
    """Wall seconds the model gives for a run on ``workers`` workers."""
    busy = flops / model["rate_flops_per_worker"] + pieces * model["seconds_per_piece"]
    return busy / workers + (pieces + merges) * model["idle_seconds_per_task"] / workers


def project(model, n, heads, d, machines, cores, block=8192, causal=True) -> dict:
    """The model's wall time for ``(1, heads, n, d)`` on ``machines`` x ``cores`` workers."""
    stats = plan_stats(1, heads, n, d, block, causal)
    workers = machines * cores
    return {"n": n, "heads": heads, "d": d, "machines": machines, "workers": workers,
            "pieces": stats["pieces"], "merges": stats["merges"], "flops": stats["flops"],
            "hours": predict(model, stats["flops"], stats["pieces"], stats["merges"], workers) / 3600}
