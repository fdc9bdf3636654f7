"""Measurements of `attnlib.distributed` for the scale-out report.

Everything here runs on a real Dask cluster (a `LocalCluster` of worker processes,
one thread each) and measures: the time against the number of workers, the task counts
and bytes each piece reads against ``n``, the scheduler's share of the wall time, each
worker's peak of traced memory (tracemalloc, inside the worker), and a cost model fitted
to the measured runs that projects contexts no one machine can finish.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time
import tracemalloc

import numpy as np

from ..evidence.inputs import random_qkv
# The cost model and the plan's statistics live in .costmodel; the report reads them here.
from .costmodel import (  # noqa: F401
    MODEL_TERMS, _design, bootstrap_models, fit_cost_model, heldout_error_range, kernel_slowdown,
    model_errors, percentile_range, plan_stats, predict, project, project_range)


def save_case(folder, b: int, h: int, n: int, d: int, seed: int = 0) -> tuple:
    """q, k, v of ``(b, h, n, d)`` saved as ``.npy`` in ``folder``: their paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, x in zip("qkv", random_qkv(n, n, d, batch=(b,), heads=h, seed=seed)):
        path = os.path.join(folder, f"{name}_{b}x{h}x{n}x{d}.npy")
        np.save(path, x)
        paths.append(path)
    return tuple(paths)


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
    by_label = {"executor": "dask", "other": "dask", "read": "read"}  # other labels: by the task's kind
    for worker, totals in after.items():
        for key, value in totals.items():
            if not (isinstance(key, tuple) and key[-1] == "seconds"):
                continue
            delta = value - before.get(worker, {}).get(key, 0.0)
            label = key[-2]
            if key[0] == "execute":  # ("execute", [span id,] task prefix, label, "seconds")
                out[by_label.get(label) or kind.get(key[-3], "dask")] += delta
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


def time_single_vs_cluster(paths, block, worker_counts=(1, 2), repeats=5, causal=True, clients=None) -> dict:
    """The single-process kernel (`attnlib.attention` with its default threads, inputs in
    memory) and `attnlib.distributed.attention` on clusters of ``worker_counts`` (inputs as
    ``.npy`` files), started once each, timed in turn repeat after repeat in the same
    window (the order reversed every other repeat, so that a drift of the machine's speed
    over the window weighs on each the same), with the machine's load over each run
    (`load_watch`) and each cluster call's phases (`phases`).  The per-core efficiency of a
    cluster of ``w`` workers is ``single x cores / (cluster x w)``, ``cores`` the single
    process's threads: the median over the repeats of each repeat's own ratio (its runs
    seconds apart, where the medians of the two may be minutes apart), its noise half the
    range of those ratios; ``efficiency_of_medians`` is the same of the medians.

    ``clients`` (``{workers: client}``, warm or not): clusters started once by the caller and
    kept for its other measurements; without it the clusters are started here and closed
    after.  ``kernel_by_run``: each cluster run's kernel seconds (`phases`), for a resampled
    `kernel_slowdown` (`bootstrap_models`); ``phases``: each phase's median over the runs,
    ``phases_by_run``: its seconds run by run (their spread)."""
    import attnlib

    from ..core.validate import available_cpus

    cores = available_cpus()
    q, k, v = (np.load(p) for p in paths)
    with (contextlib.nullcontext(clients) if clients is not None else clusters(worker_counts)) as clients:
        clients = {w: clients[w] for w in worker_counts}
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
                before = _digests(clients[name]) if name != "single" else None
                with load_watch(pids) as rec:
                    value = runs[name]()
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
        "min": {name: min(s) for name, s in samples.items()}, "max": {name: max(s) for name, s in samples.items()},
        "kernel_by_run": {w: [r["kernel"] for r in rs] for w, rs in phase_runs.items()},
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
        "phases_by_run": {w: {k: [r[k] for r in rs] for k in rs[0] if k != "tasks"}
                          for w, rs in phase_runs.items()},
        "tasks": {w: rs[0]["tasks"] for w, rs in phase_runs.items()},
        "bitwise_identical": bool(all(np.array_equal(r, first) for r in results.values())),
    }


def _trace_start():
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    tracemalloc.reset_peak()


def trace_stop():
    """Stop tracemalloc in this process (run on the workers, `client.run`, once the memory
    measurements are done: the calls timed after them run untraced)."""
    tracemalloc.stop()


def worker_calls(client, paths, block, out, causal=True, kv_block=None, calls=2) -> list:
    """Per call of ``calls``, per worker: the peak of traced memory (tracemalloc, in the
    worker process) over a call that writes its output to ``out`` (the caller has warmed the
    cluster up with the same call), what is still traced after it (what Dask keeps: task
    records, logs), and their difference, the call's working memory.  ``[[(peak, left,
    working), ...by worker], ...by call]`` in bytes.  ``kv_block`` (default ``block``) sets
    the pieces' key ranges."""
    from ..distributed import attention

    result = []
    for _ in range(calls):
        client.run(_trace_start)
        attention(*paths, client=client, causal=causal, block_q=block,
                  kv_block=block if kv_block is None else kv_block, out=out, device=NUMPY)
        traced = client.run(tracemalloc.get_traced_memory)  # (current, peak) by worker address, as each answers
        if not traced:
            raise RuntimeError("no worker answered the memory trace (the cluster lost its workers)")
        result.append([(peak, left, peak - left) for left, peak in (traced[w] for w in sorted(traced))])
    return result


def smallest_call(calls) -> list:
    """The `worker_calls` call whose largest working memory over its workers is the
    smallest: what a call always needs, without a burst of Dask's own messages that one call
    may catch and the next not (a few hundred KiB, seen at small ``n``).  One call, all its
    workers: never a mix of two calls' workers."""
    return min(calls, key=lambda call: max(w for _, _, w in call))


def worker_peaks(client, paths, block, out, causal=True, kv_block=None, calls=2) -> list:
    """`smallest_call` of `worker_calls`: ``[(peak, left, working), ...]`` by worker, of one call."""
    return smallest_call(worker_calls(client, paths, block, out, causal, kv_block, calls))


def growth_bound(n_before: int, n_after: int, d: int) -> int:
    """The smallest memory a worker could hold that grows with ``n``: one head's keys for
    the positions added from ``n_before`` to ``n_after`` (``(n_after - n_before) * d``
    float64s).  A worker whose working memory grows by this much or more between the two
    runs holds something of the size of the sequence (a whole key range, every partial
    result); a flat one grows by less."""
    return 8 * (n_after - n_before) * d


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
    return [_model_row(*cases[i], w, ws) for (i, w), ws in walls.items()]


def _model_row(h, n, d, block, w, walls) -> dict:
    """A run of the cost model: the plan's counts, the case on ``w`` workers of this machine,
    and the median and `spread` of its ``walls``."""
    from ..core.validate import available_cpus

    return {**plan_stats(1, h, n, d, block), "n": n, "heads": h, "d": d, "block": block, "workers": w,
            "workers_per_machine": w, "machine_cores": available_cpus(), "wall": statistics.median(walls),
            "noise": spread(walls), "walls": list(walls)}


def _noop(i):
    return i


def scheduler_rates(client, tasks=500, batches=5) -> list:
    """Tasks per second the cluster's scheduler completes when each does nothing, one rate
    per batch of ``tasks``: the ceiling of a task graph's throughput, whatever the workers'
    speed (measured)."""
    from distributed import wait

    rates = []
    for _ in range(batches):
        start = time.perf_counter()
        futures = client.map(_noop, range(tasks), pure=False)
        wait(futures)
        rates.append(tasks / (time.perf_counter() - start))
        del futures
    return rates


def scheduler_rate(client, tasks=2000) -> float:
    """The median of three `scheduler_rates` batches of ``tasks``."""
    return statistics.median(scheduler_rates(client, tasks, 3))


def rss_of_call(client, paths, block, out=None) -> dict:
    """One causal `timed_run` (written to ``out`` when given) and each worker's peak RSS over
    it (`rss_peak`), by worker, as ``"rss_peak"``."""
    since = monitor_now(client)
    run = timed_run(client, paths, block, out=out)
    time.sleep(0.6)  # the monitor's next sample (every 0.5 s): the call's last moments
    return {**run, "rss_peak": rss_peak(client, since)}


def long_run(client, paths, block, out, samples=3, repeats=1) -> dict:
    """One causal call on inputs too long for the rest of the report, written block by
    block to ``out``: its wall seconds, each worker's peak RSS over it (Dask's system
    monitor), and the result checked against `attnlib.attention` on ``samples`` query blocks
    (first, evenly spaced, last; each block's rows against the keys up to its last row,
    with bottom-right causal alignment: the same absolute-position mask), the contract's
    `rel_error` of each (`check_blocks`).

    ``repeats`` calls in a row: ``wall`` is their median, ``walls`` each, ``noise`` their
    `spread`; ``rss_peak`` each worker's largest over all of them; ``same_bits`` whether
    every call wrote the same output file, byte for byte (None for one call: nothing
    compared); the checks are of the last call's output."""
    import hashlib

    pids = [os.getpid()] + worker_pids(client)
    walls, others, steal, peaks, digests = [], [], [], {}, []
    for _ in range(repeats):
        with load_watch(pids) as rec:
            run = rss_of_call(client, paths, block, out)
        # The call's own wall (`timed_run`); the load record also spans the RSS monitor's wait.
        walls.append(run["wall"])
        others.append(rec["others"])
        steal.append(rec["steal"])
        for w, v in run["rss_peak"].items():
            peaks[w] = max(peaks.get(w, 0), v)
        with open(out, "rb") as f:
            digests.append(hashlib.sha256(f.read()).hexdigest())
    errors = check_blocks(run["result"], paths, block, samples)
    return {"wall": statistics.median(walls), "walls": walls, "noise": spread(walls),
            "others": statistics.median(others), "steal": max(steal), "rss_peak": peaks, "checks": errors,
            "same_bits": None if repeats < 2 else len(set(digests)) == 1}


def check_blocks(result, paths, block, samples) -> list:
    """The causal ``result`` of the inputs at ``paths`` against `attnlib.attention` on
    ``samples`` query blocks of ``block`` rows (the first, evenly spaced, the last), each
    block's rows against the keys up to its last row with bottom-right causal alignment
    (the same absolute-position mask): ``[{"rows", "rel_error"}, ...]``.  A sample: a
    result wrong only in blocks between the samples passes."""
    import attnlib

    from ..judge.metrics import rel_error

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


def memory_steps(ns, working, d, pieces=None, limit=None) -> dict:
    """The memory rule applied to every step of a sweep: between each two consecutive ``n``
    the working memory (``working``, bytes, one per ``n``) grows by less than
    `growth_bound`.  ``steps``: ``[{"from", "to", "growth", "bound", "under", "gated"}, ...]``;
    ``bounded_from``: the smallest ``n`` from which every later step is under its bound
    (None when the last step is not).

    ``pieces`` (the plan's piece tasks at each ``n``) and ``limit`` (the client's throttle,
    `attnlib.distributed.engine.unmerged_limit`): a step is ``gated`` when its smaller ``n``
    already has at least ``limit`` pieces, so that the unmerged partials a worker holds are
    capped by the throttle at both ends of the step, and the rule asks only whether anything
    else grew with ``n``.  Below it (the *ramp*) the partials in flight still grow with the
    plan, by a block's partial results each, whatever the sequence.  Without ``pieces``, or
    when no step starts from a full throttle, the last step alone is gated."""
    steps = [{"from": a, "to": b, "growth": wb - wa, "bound": growth_bound(a, b, d), "under": wb - wa < growth_bound(a, b, d)}
             for a, b, wa, wb in zip(ns, ns[1:], working, working[1:])]
    for s, p in zip(steps, pieces if pieces is not None else [None] * len(steps)):
        s["throttle_full"] = None if p is None or limit is None else p >= limit
        s["gated"] = bool(s["throttle_full"])
    if steps and not any(s["gated"] for s in steps):
        steps[-1]["gated"] = True
    under = list(itertools.takewhile(lambda s: s["under"], reversed(steps)))  # the last steps under their bound
    return {"steps": steps, "bounded_from": under[-1]["from"] if under else None}


def timing_rows(timing, heads, n, d, block) -> list:
    """The timing case's cluster runs (`time_single_vs_cluster`) as runs of the cost model
    (`model_runs`'s rows): a case the model is not fitted on, timed interleaved."""
    return [_model_row(heads, n, d, block, w, s) for w, s in timing["samples"].items() if w != "single"]

