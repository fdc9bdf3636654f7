"""Measurements of `attnlib.distributed` for the scale-out report.

Everything here runs on a real Dask cluster (a `LocalCluster` of worker processes,
one thread each) and measures: the time against the number of workers, the task counts
and bytes each piece reads against ``n``, the scheduler's share of the wall time, each
worker's peak of traced memory (tracemalloc, inside the worker), and a cost model fitted
to the measured runs that projects contexts no one machine can finish.
"""

from __future__ import annotations

import contextlib
import numbers
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
    """Task counts of the plan, the bytes each piece reads (q block, k and v ranges), the
    visible pairs and their flops, and the flops of the plan's largest piece (its whole
    ``block_q x kv_block`` rectangle)."""
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


#: What the timed calls' pieces run on: the numpy kernel always, whatever a worker's
#: ``attnlib.device`` setting says (the single process they are compared with is numpy).
NUMPY = "numpy"


@contextlib.contextmanager
def clusters(worker_counts):
    """A `local_cluster` of each size in ``worker_counts``, all started at once:
    ``{workers: client}``."""
    with contextlib.ExitStack() as stack:
        yield {w: stack.enter_context(local_cluster(w)) for w in worker_counts}


def timed_run(client, paths, block, causal=True, out=None) -> dict:
    """One `attnlib.distributed.attention` call: wall seconds, the seconds the workers
    spent inside tasks (Dask's task stream), summed by task kind, and the task counts."""
    from distributed import get_task_stream

    from ..distributed import attention

    with get_task_stream(client=client) as stream:
        start = time.perf_counter()
        result = attention(*paths, client=client, causal=causal, block_q=block, kv_block=block, out=out,
                           device=NUMPY)
        wall = time.perf_counter() - start
    busy = {"piece": 0.0, "merge": 0.0, "other": 0.0}
    tasks = {"piece": 0, "merge": 0, "other": 0}
    for task in stream.data:
        kind = next((k for k in ("piece", "merge") if str(task["key"]).startswith(f"attnlib-{k}")), "other")
        busy[kind] += sum(s["stop"] - s["start"] for s in task["startstops"] if s["action"] == "compute")
        tasks[kind] += 1
    return {"wall": wall, "busy": busy, "tasks": tasks, "result": result}


def worker_pids(client) -> list:
    """The process ids of the cluster's workers."""
    return sorted(client.run(os.getpid).values())


def _cpu_seconds(pids) -> tuple:
    """(seconds the machine's CPUs were busy, of them stolen by the hypervisor, and used by
    ``pids`` and their children), since boot (psutil; Linux counts in 10 ms ticks)."""
    import psutil

    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)
    procs = {}  # by pid: a worker is this process's child and in ``pids``, counted once
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs.update((p.pid, p) for p in [proc] + proc.children(recursive=True))
        except psutil.Error:  # a process that ended: its time is no longer counted
            pass
    own = 0.0
    for p in procs.values():
        try:
            c = p.cpu_times()
            own += c.user + c.system
        except psutil.Error:
            pass
    return busy, getattr(t, "steal", 0.0), own


@contextlib.contextmanager
def load_watch(pids):
    """Measure the machine's load over the block: ``record`` gets ``wall`` (s), ``others``
    (CPUs kept busy on average by processes other than ``pids``, which are this process
    and the workers), ``steal`` (CPUs taken by the hypervisor) and the 1-minute load
    average at the end."""
    record = {}
    busy0, steal0, own0 = _cpu_seconds(pids)
    start = time.perf_counter()
    yield record
    wall = time.perf_counter() - start
    busy1, steal1, own1 = _cpu_seconds(pids)
    record.update(wall=wall, others=max(0.0, (busy1 - busy0) - (own1 - own0)) / wall,
                  steal=(steal1 - steal0) / wall, loadavg=os.getloadavg()[0])


def _digests(client) -> dict:
    """Every worker's running totals of Dask's fine performance metrics."""
    return client.run(lambda dask_worker: dict(dask_worker.digests_total))


#: Dask's labels of the time it spends serialising and compressing results between
#: processes (``get-data`` on the sender, ``gather-dep`` on the receiver).
_SERIAL = ("serialize", "deserialize", "compress", "decompress", "pickle")


def phases(before, after, wall, threads) -> dict:
    """Seconds of one call by phase, summed over the workers, from the difference of Dask's
    fine performance metrics (``_digests``) around it.  On the worker threads: ``read`` (a
    piece's slices read, `engine._meter`), ``kernel`` (the rest of the piece tasks),
    ``merge``, ``write`` (the blocks written to an output file), ``dask`` (Dask's own time
    around each task there), and ``idle``: ``threads x wall`` less those.  Beside them, in
    the workers' event loops and overlapping them: ``serialisation`` (results pickled and
    compressed to move between processes) and ``transfer wait`` (results on the wire)."""
    out = dict.fromkeys(("read", "kernel", "merge", "write", "dask", "serialisation", "transfer wait"), 0.0)
    kind = {"attnlib-piece": "kernel", "attnlib-merge": "merge", "attnlib-write": "write"}
    for worker, totals in after.items():
        for key, value in totals.items():
            if not (isinstance(key, tuple) and key[-1] == "seconds"):
                continue
            delta = value - before.get(worker, {}).get(key, 0.0)
            label = key[-2]
            if key[0] == "execute":  # ("execute", [span id,] task prefix, label, "seconds")
                prefix = key[-3]
                if label in ("executor", "other"):
                    out["dask"] += delta
                elif label == "read":
                    out["read"] += delta
                else:
                    out[kind.get(prefix, "dask")] += delta
            elif key[0] in ("get-data", "gather-dep"):
                out["serialisation" if label in _SERIAL else "transfer wait"] += delta
    on_threads = sum(out[k] for k in ("read", "kernel", "merge", "write", "dask"))
    out["idle"] = max(0.0, threads * wall - on_threads)
    return out


def rss_peak(client, since) -> dict:
    """Each worker's largest RSS (bytes) sampled by Dask's system monitor (every 0.5 s) since
    the monitor time ``since``, by worker address."""
    def peak(dask_worker, since=since):
        q = dask_worker.monitor.quantities
        return max((m for m, t in zip(q["memory"], q["time"]) if t >= since), default=0)

    return client.run(peak)


def monitor_now(client) -> float:
    """The workers' monitor clock now (they share this host's clock)."""
    return max(client.run(lambda dask_worker: dask_worker.monitor.last_time).values())


def spread(samples) -> float:
    """The noise of a median of ``samples``: half their range, relative to the median."""
    m = statistics.median(samples)
    return (max(samples) - min(samples)) / (2 * m) if m > 0 else 0.0


def time_single_vs_cluster(paths, block, worker_counts=(1, 2), repeats=5, causal=True) -> dict:
    """The single-process kernel (`attnlib.attention` with its default threads, inputs in
    memory) and `attnlib.distributed.attention` on clusters of ``worker_counts`` (inputs as
    ``.npy`` files), started once each, timed in turn repeat after repeat in the same
    window (the order reversed every other repeat, so that a drift of the machine's speed
    over the window weighs on each the same), with the machine's load over each run
    (`load_watch`) and each cluster call's phases (`phases`).  The per-core efficiency of a
    cluster of ``w`` workers is ``single x cores / (cluster x w)``, ``cores`` the single
    process's threads: the median over the repeats of each repeat's own ratio (its runs
    seconds apart, where the medians of the two may be minutes apart), its noise half the
    range of those ratios; ``efficiency_of_medians`` is the same of the medians."""
    import attnlib

    from ..core.validate import available_cpus

    cores = available_cpus()
    q, k, v = (np.load(p) for p in paths)
    with clusters(worker_counts) as clients:
        pids = [os.getpid()] + [p for c in clients.values() for p in worker_pids(c)]
        runs = {"single": lambda: attnlib.attention(q, k, v, causal=causal)}
        runs.update({w: (lambda c=c: timed_run(c, paths, block, causal)) for w, c in clients.items()})
        for run in runs.values():
            run()  # warm-up: imports, first reads, page cache
        samples = {name: [] for name in runs}
        load = {name: [] for name in runs}
        phase_runs = {w: [] for w in clients}
        results = {}
        order = list(runs)
        for r in range(repeats):
            for name in (order if r % 2 == 0 else order[::-1]):
                run = runs[name]
                before = _digests(clients[name]) if name != "single" else None
                with load_watch(pids) as rec:
                    value = run()
                samples[name].append(rec["wall"])
                load[name].append(rec)
                if name != "single":
                    results[name] = value["result"]
                    ph = phases(before, _digests(clients[name]), rec["wall"], threads=name)
                    phase_runs[name].append({**ph, "tasks": value["tasks"]})
    median = {name: statistics.median(s) for name, s in samples.items()}
    noise = {name: spread(s) for name, s in samples.items()}
    first = results[worker_counts[0]]
    paired = {w: [a * cores / (b * w) for a, b in zip(samples["single"], samples[w])] for w in clients}
    return {
        "cores": cores, "samples": samples, "median": median, "noise": noise,
        "efficiency": {w: statistics.median(e) for w, e in paired.items()},
        "efficiency_noise": {w: (max(e) - min(e)) / 2 for w, e in paired.items()},
        "efficiency_by_repeat": paired,
        "efficiency_of_medians": {w: median["single"] * cores / (median[w] * w) for w in clients},
        "others": {name: statistics.median(r["others"] for r in rs) for name, rs in load.items()},
        "others_max": max(r["others"] for rs in load.values() for r in rs),
        "steal_max": max(r["steal"] for rs in load.values() for r in rs),
        "loadavg": [r["loadavg"] for rs in load.values() for r in rs],
        "phases": {w: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "tasks"}
                   for w, rs in phase_runs.items()},
        "tasks": {w: rs[0]["tasks"] for w, rs in phase_runs.items()},
        "bitwise_identical": bool(all(np.array_equal(r, first) for r in results.values())),
    }


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
                  kv_block=block if kv_block is None else kv_block, out=out, device=NUMPY)
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


def model_runs(clients, cases, folder, repeats=4, seed=1, middle=None) -> list:
    """The model's measurements: each case ``(heads, n, d, block)`` (one batch entry,
    causal) in ``.npy`` files, run on every cluster of ``clients`` (``{workers: client}``,
    all on this machine, warmed up).  Every case on every cluster runs once per repeat, the
    order reversed every other repeat, so that a drift of the machine's speed over the
    minutes this takes weighs on every case alike; each row is the median wall of its
    ``repeats`` runs, with its `spread` and the plan's counts.  ``middle``, when given, is
    called once halfway through the repeats (a long run the model is to predict: the runs
    it is fitted on then lie on both sides of it in time, and a drift of the machine's speed
    between the two does not fall on the long run alone)."""
    from ..core.validate import available_cpus

    files = {}
    try:
        for h, n, d, _ in cases:
            if (h, n, d) not in files:
                files[(h, n, d)] = save_case(folder, 1, h, n, d, seed=seed)
        runs = [(i, w) for i in range(len(cases)) for w in clients]
        walls = {run: [] for run in runs}
        for r in range(repeats):
            if middle is not None and r == repeats // 2:
                middle()
            for i, w in (runs if r % 2 == 0 else runs[::-1]):
                h, n, d, block = cases[i]
                walls[(i, w)].append(timed_run(clients[w], files[(h, n, d)], block)["wall"])
    finally:
        for paths in files.values():
            for path in paths:
                os.remove(path)
    rows = []
    for (i, w), ws in walls.items():
        h, n, d, block = cases[i]
        rows.append({**plan_stats(1, h, n, d, block), "n": n, "heads": h, "d": d, "block": block,
                     "workers": w, "workers_per_machine": w, "machine_cores": available_cpus(),
                     "wall": statistics.median(ws), "noise": spread(ws)})
    return rows


def _noop(i):
    return i


def scheduler_rate(client, tasks=2000) -> float:
    """Tasks per second the cluster's scheduler completes when each does nothing: the
    ceiling of a task graph's throughput, whatever the workers' speed (measured, median of
    three batches of ``tasks``)."""
    from distributed import wait

    rates = []
    for _ in range(3):
        start = time.perf_counter()
        futures = client.map(_noop, range(tasks), pure=False)
        wait(futures)
        rates.append(tasks / (time.perf_counter() - start))
        del futures
    return statistics.median(rates)


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


def rss_of_call(client, paths, block, out=None) -> dict:
    """One causal `timed_run` (written to ``out`` when given) and each worker's peak RSS over
    it (`rss_peak`), by worker, as ``"rss_peak"``."""
    since = monitor_now(client)
    run = timed_run(client, paths, block, out=out)
    time.sleep(0.6)  # the monitor's next sample (every 0.5 s): the call's last moments
    return {**run, "rss_peak": rss_peak(client, since)}


def long_run(client, paths, block, out, samples=3) -> dict:
    """One causal call on inputs too long for the rest of the report, written block by
    block to ``out``: its wall seconds, each worker's peak RSS over it (Dask's system
    monitor), and the result checked against `attnlib.attention` on ``samples`` query blocks
    (first, evenly spaced, last; each block's rows against the keys up to its last row,
    with bottom-right causal alignment: the same absolute-position mask), the contract's
    `rel_error` of each (`check_blocks`)."""
    pids = [os.getpid()] + worker_pids(client)
    with load_watch(pids) as rec:
        run = rss_of_call(client, paths, block, out)
    errors = check_blocks(run["result"], paths, block, samples)
    # The call's own wall (`timed_run`); the load record also spans the RSS monitor's wait.
    return {"wall": run["wall"], "others": rec["others"], "steal": rec["steal"],
            "rss_peak": run["rss_peak"], "checks": errors}


def check_blocks(result, paths, block, samples) -> list:
    """The causal ``result`` of the inputs at ``paths`` against `attnlib.attention` on
    ``samples`` query blocks of ``block`` rows (the first, evenly spaced, the last), each
    block's rows against the keys up to its last row with bottom-right causal alignment
    (the same absolute-position mask): ``[{"rows", "rel_error"}, ...]``.  A sample: a
    result wrong only in blocks between the samples passes."""
    import attnlib

    from ..evidence.metrics import rel_error

    q, k, v = (np.load(p, mmap_mode="r") for p in paths)
    n = q.shape[-2]
    last = (n - 1) // block  # the plan's query blocks start at multiples of block
    starts = sorted({round(i * last / max(1, samples - 1)) * block for i in range(samples)})
    errors = []
    for q0 in starts:
        q1 = min(n, q0 + block)
        rows = (Ellipsis, slice(q0, q1), slice(None))
        keys = (Ellipsis, slice(0, q1), slice(None))
        ref = attnlib.attention(np.asarray(q[rows]), np.asarray(k[keys]), np.asarray(v[keys]), causal=True)
        ref_abs = attnlib.attention(np.asarray(q[rows]), np.asarray(k[keys]), np.abs(v[keys]), causal=True)
        errors.append({"rows": f"{q0}..{q1 - 1}", "rel_error": rel_error(np.asarray(result[rows]), ref, ref_abs)})
    return errors
