"""The scale-out report's measurements (`attnlib.bench.scaleout`): the load record, the
phases from Dask's metrics, the cost model and its projection, the long run's checks."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("distributed")

from attnlib.bench import scaleout  # noqa: E402


def _row(flops, pieces, merges, workers, cores=2, piece_flops=0, **kw):
    return {"flops": flops, "piece_flops": piece_flops, "pieces": pieces, "merges": merges, "workers": workers,
            "workers_per_machine": workers, "machine_cores": cores, **kw}


TRUE = {"seconds_per_flop": 4e-11, "shared_seconds_per_flop": 1e-11, "seconds_per_task": 3e-3,
        "serial_seconds_per_task": 1e-3, "latency_seconds": 0.05, "tail_seconds_per_flop": 3e-11}


def _synthetic(cases, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for h, n, block in cases:
        st = scaleout.plan_stats(1, h, n, 64, block)
        for w in (1, 2):
            r = _row(st["flops"], st["pieces"], st["merges"], w, piece_flops=st["piece_flops"])
            r["wall"] = scaleout.predict(TRUE, r) * (1 + noise * rng.uniform(-1, 1))
            rows.append(r)
    return rows


FIT = [(1, 8192, 1024), (1, 8192, 2048), (2, 8192, 2048), (1, 16384, 1024), (1, 16384, 4096)]
HELD = [(1, 32768, 2048), (2, 16384, 2048), (1, 65536, 4096)]


def test_cost_model_recovers_its_terms_and_predicts_held_out_runs():
    model = scaleout.fit_cost_model(_synthetic(FIT))
    for term, value in TRUE.items():
        assert model[term] == pytest.approx(value, rel=1e-6), term
    assert model["rate_alone"] == pytest.approx(1 / 4e-11)
    assert model["rate_full_machine"] == pytest.approx(1 / 5e-11)
    assert max(map(abs, scaleout.model_errors(model, _synthetic(HELD)))) < 1e-9
    # Measured with 5% noise, the held-out runs stay within about that.
    noisy = scaleout.fit_cost_model(_synthetic(FIT, noise=0.05))
    assert max(map(abs, scaleout.model_errors(noisy, _synthetic(HELD)))) < 0.15


def test_cost_model_with_the_shared_slowdown_measured_apart():
    """Given what a busy machine adds to a worker's seconds per flop (here the true 1/4),
    the fit holds it and recovers the other terms; `kernel_slowdown` reads it from the
    kernel seconds of the same problem on 1 and 2 workers, and on 2 and 4 of 4 cores."""
    model = scaleout.fit_cost_model(_synthetic(FIT), shared_slowdown=0.25)
    for term, value in TRUE.items():
        assert model[term] == pytest.approx(value, rel=1e-6), term
    assert model["shared_slowdown"] == 0.25
    # A wrong slowdown is not taken back by the fit: the runs on 2 workers show it.
    wrong = scaleout.fit_cost_model(_synthetic(FIT), shared_slowdown=1.0)
    assert max(map(abs, scaleout.model_errors(wrong, _synthetic(HELD)))) > 0.05
    assert scaleout.kernel_slowdown({1: {"kernel": 8.0}, 2: {"kernel": 10.0}}, 2) == pytest.approx(0.25)
    # 4 cores: 2 workers share 1/3 of the others, 4 all of them; 1 + k/3 : 1 + k = 10 : 12.
    k = scaleout.kernel_slowdown({2: {"kernel": 10.0}, 4: {"kernel": 12.0}}, 4)
    assert (1 + k) / (1 + k / 3) == pytest.approx(1.2)
    assert scaleout.kernel_slowdown({1: {"kernel": 8.0}, 2: {"kernel": 7.5}}, 2) == 0.0  # noise
    with pytest.raises(ValueError, match="shared_slowdown"):
        scaleout.fit_cost_model(_synthetic(FIT), shared_slowdown=-0.1)
    with pytest.raises(ValueError, match="two cluster sizes"):
        scaleout.kernel_slowdown({2: {"kernel": 1.0}}, 2)
    with pytest.raises(ValueError, match="kernel seconds > 0"):
        scaleout.kernel_slowdown({1: {"kernel": 0.0}, 2: {"kernel": 1.0}}, 2)
    with pytest.raises(TypeError, match="shared_slowdown"):
        scaleout.fit_cost_model(_synthetic(FIT), shared_slowdown="0.1")
    # Keys as a report's JSON gives them back; numpy scalars taken as numbers.
    assert scaleout.kernel_slowdown({"1": {"kernel": 8.0}, "10": {"kernel": 10.0}}, 10) == pytest.approx(0.25)
    assert scaleout.fit_cost_model(_synthetic(FIT), shared_slowdown=np.float32(0.25))["shared_slowdown"] == 0.25


def test_cost_model_keeps_its_rate_when_latency_dominates():
    """Tiny runs on a loaded machine, whose wall is mostly latency: the rate term stays in
    the fit (another term is dropped), not the other way round."""
    rows = _synthetic([(1, 1024, 256), (1, 2048, 256), (1, 2048, 512), (1, 1024, 512)])
    rng = np.random.default_rng(1)
    for r in rows:
        r["wall"] = 0.5 * (1 + 0.3 * rng.uniform(-1, 1)) + 1e-3 * r["wall"]
    model = scaleout.fit_cost_model(rows)
    assert model["seconds_per_flop"] > 0 and all(model[t] >= 0 for t in scaleout.MODEL_TERMS)


def test_cost_model_terms_are_never_negative_and_a_model_without_a_rate_is_refused():
    rows = _synthetic(FIT)
    for r in rows:  # tasks that seem to save time: noise, not a negative cost
        r["wall"] -= 5e-3 * (r["pieces"] + r["merges"]) / r["workers"]
    model = scaleout.fit_cost_model(rows)
    assert all(model[t] >= 0 for t in scaleout.MODEL_TERMS)
    # The exact non-negative fit: no subset of the terms fits the runs better.
    import itertools

    a = np.array([scaleout._design(r) for r in rows]) / np.array([r["wall"] for r in rows])[:, None]
    best = float(np.sum((a @ [model[t] for t in scaleout.MODEL_TERMS] - 1) ** 2))
    terms = len(scaleout.MODEL_TERMS)
    for k in range(1, terms + 1):
        for cols in itertools.combinations(range(terms), k):
            c = np.linalg.lstsq(a[:, cols], np.ones(len(rows)), rcond=None)[0]
            if (c >= 0).all() and 0 in cols and c[0] > 0:
                assert float(np.sum((a[:, cols] @ c - 1) ** 2)) >= best - 1e-12
    one_size = [r for r in _synthetic(FIT) if r["workers"] == 2]  # shared term = rate term
    with pytest.raises(ValueError, match="cluster sizes"):
        scaleout.fit_cost_model(one_size)
    with pytest.raises(ValueError, match="more runs than terms"):
        scaleout.fit_cost_model(_synthetic(FIT[:2]))
    flat = _synthetic(FIT)
    for r in flat:
        r["wall"] = 1.0 / (1 + (r["pieces"] % 3)) + 0.01 * r["workers"]  # no trace of the work
    with pytest.raises(ValueError, match="rate|determine"):
        scaleout.fit_cost_model([{**r, "flops": 0} for r in flat])


def test_projection_never_goes_below_its_floors():
    model = dict(TRUE, rate_alone=1 / 4e-11, rate_full_machine=1 / 5e-11)
    small = scaleout.project(model, 2**18, 32, 128, 1, 32, 8192, scheduler_tps=1000.0)
    huge = scaleout.project(model, 2**18, 32, 128, 10**6, 32, 8192, scheduler_tps=100.0)
    for p in (small, huge):
        assert p["hours"] >= max(p["model_hours"], p["compute_floor_hours"], p["scheduler_floor_hours"])
        assert p["scheduler_floor_hours"] == pytest.approx((p["pieces"] + p["merges"]) / (1000 if p is small else 100) / 3600)
    assert small["bound"] == "model" and huge["bound"] == "scheduler"
    assert huge["model_hours"] < huge["scheduler_floor_hours"] == huge["hours"]
    # The full-machine rate sets the compute floor (32 busy workers per machine); a machine
    # of one core shares nothing.
    assert small["compute_floor_hours"] == pytest.approx(small["flops"] * 5e-11 / 32 / 3600)
    lone = scaleout.project(model, 2**18, 32, 128, 4, 1, 8192, scheduler_tps=1000.0)
    assert lone["compute_floor_hours"] == pytest.approx(lone["flops"] * 4e-11 / 4 / 3600)
    assert lone["bound"] == "model"


def test_phases_sort_dasks_metrics_by_kind_and_leave_the_rest_idle():
    before = {"w1": {("execute", "s", "attnlib-piece", "thread-cpu", "seconds"): 1.0}}
    after = {"w1": {("execute", "s", "attnlib-piece", "thread-cpu", "seconds"): 3.0,
                    ("execute", "s", "attnlib-piece", "thread-noncpu", "seconds"): 0.5,
                    ("execute", "s", "attnlib-piece", "read", "seconds"): 0.25,
                    ("execute", "s", "attnlib-piece", "executor", "seconds"): 0.1,
                    ("execute", "s", "attnlib-merge", "thread-cpu", "seconds"): 0.4,
                    ("execute", "s", "attnlib-piece", "memory-read", "bytes"): 10**9,
                    ("get-data", "serialize", "seconds"): 0.05,
                    ("get-data", "network", "seconds"): 0.7,
                    "tick-duration": 5.0},
             "w2": {("execute", "t", "attnlib-write", "thread-cpu", "seconds"): 0.2,
                    ("gather-dep", "deserialize", "seconds"): 0.05}}
    ph = scaleout.phases(before, after, wall=2.0, threads=2)
    assert ph["kernel"] == pytest.approx(2.5) and ph["read"] == 0.25 and ph["merge"] == 0.4
    assert ph["write"] == 0.2 and ph["dask"] == 0.1 and ph["serialisation"] == pytest.approx(0.1)
    assert ph["transfer wait"] == 0.7
    # In the event loops, overlapping the threads: not taken from idle.
    assert ph["idle"] == pytest.approx(4.0 - (2.5 + 0.25 + 0.4 + 0.2 + 0.1))
    # Dask before spans: ("execute", prefix, label, unit).
    old = scaleout.phases({}, {"w": {("execute", "attnlib-merge", "thread-cpu", "seconds"): 0.3}}, 1.0, 1)
    assert old["merge"] == 0.3 and old["dask"] == 0


def _spinner(seconds):
    """A process that keeps one CPU busy for ``seconds``, not a child of this one (its
    shell exits at once): its pid."""
    spin = f"import time\nt = time.time()\nwhile time.time() - t < {seconds}: pass"
    out = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{spin}" > /dev/null 2>&1 & echo $!'],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1])


@pytest.mark.serial  # it measures the machine's other load: pytest-xdist's other worker is that
def test_load_watch_sees_another_process_keep_a_cpu_busy():
    with scaleout.load_watch([os.getpid()]) as quiet:
        time.sleep(0.5)
    _spinner(1.5)
    with scaleout.load_watch([os.getpid()]) as busy:
        time.sleep(1.0)
    assert set(busy) == {"wall", "others", "steal", "loadavg"}
    assert busy["others"] > 0.6 > quiet["others"], (quiet, busy)
    time.sleep(0.6)
    # A process counted as the caller's is not someone else's load.
    pid = _spinner(1.5)
    with scaleout.load_watch([os.getpid(), pid]) as own:
        time.sleep(1.0)
    assert own["others"] < 0.4, own
    time.sleep(0.6)
    # A child of this process (as LocalCluster's workers are), also named in pids: once.
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    try:
        time.sleep(0.2)
        with scaleout.load_watch([os.getpid(), spin.pid]) as child:
            _spinner(1.5)
            time.sleep(1.0)
    finally:
        spin.wait()
    assert child["others"] > 0.6, child  # the other spinner, not hidden by counting the child twice


def test_check_blocks_samples_the_first_and_last_blocks_and_catches_a_wrong_one(tmp_path):
    import attnlib

    paths = scaleout.save_case(str(tmp_path), 1, 1, 1000, 16, seed=0)
    q, k, v = (np.load(p) for p in paths)
    out = attnlib.attention(q, k, v, causal=True)
    checks = scaleout.check_blocks(out, paths, 256, 3)
    assert [c["rows"] for c in checks] == ["0..255", "512..767", "768..999"]
    assert max(c["rel_error"] for c in checks) < 1e-13
    wrong = out.copy()
    wrong[..., 900, :] += 1e-9  # one row of the last block
    assert max(c["rel_error"] for c in scaleout.check_blocks(wrong, paths, 256, 3)) > 1e-11
    between = out.copy()
    between[..., 300, :] += 1.0  # a block between the samples: a sample does not see it
    assert max(c["rel_error"] for c in scaleout.check_blocks(between, paths, 256, 3)) < 1e-13


def test_interleaved_timing_model_runs_and_long_run_on_a_cluster(tmp_path, monkeypatch):
    """One small pass of everything the report runs on clusters: the same bits on 1 and 2
    workers, the phases of each call (the piece's slices read are metered inside the task),
    the load beside each median, the model's runs, the scheduler's rate and the long run's
    check."""
    paths = scaleout.save_case(str(tmp_path), 1, 2, 1024, 32, seed=0)
    with scaleout.clusters((1, 2)) as clients:  # started once for every run below, as the report does
        t = scaleout.time_single_vs_cluster(paths, 256, (1, 2), repeats=2, clients=clients)
        assert t["bitwise_identical"]
        assert set(t["median"]) == {"single", 1, 2} and all(len(s) == 2 for s in t["samples"].values())
        for w in (1, 2):
            paired = [a * t["cores"] / (b * w) for a, b in zip(t["samples"]["single"], t["samples"][w])]
            assert t["efficiency_by_repeat"][w] == pytest.approx(paired)
            assert t["efficiency"][w] == pytest.approx(np.median(paired))
            assert t["efficiency_noise"][w] == pytest.approx((max(paired) - min(paired)) / 2)
            assert t["efficiency_of_medians"][w] == pytest.approx(
                t["median"]["single"] * t["cores"] / (t["median"][w] * w))
            ph = t["phases"][w]
            assert ph["read"] > 0 and ph["kernel"] > ph["read"] and ph["merge"] > 0, ph
            # Every phase run by run (its spread on the page), its median the one above.
            assert set(t["phases_by_run"][w]) == set(ph) and t["phases_by_run"][w]["kernel"] == t["kernel_by_run"][w]
            assert all(len(v) == 2 and ph[k] == pytest.approx(np.median(v)) for k, v in t["phases_by_run"][w].items())
            assert t["tasks"][w]["piece"] == scaleout.plan_stats(1, 2, 1024, 32, 256)["pieces"]
        assert t["others_max"] >= 0 and len(t["loadavg"]) == 3 * 2
        cases = [(1, 512, 32, 128), (1, 1024, 32, 256), (1, 512, 32, 256)]
        runs, before = [], []  # the timed runs, and how many came before `middle`
        timed_run = scaleout.timed_run

        def counted(*a, **kw):
            runs.append(1)
            return timed_run(*a, **kw)

        monkeypatch.setattr(scaleout, "timed_run", counted)
        rows = scaleout.model_runs(clients, cases, str(tmp_path), repeats=2, middle=lambda: before.append(len(runs)))
        assert before == [len(cases) * 2] and len(runs) == 2 * len(cases) * 2  # once, between the repeats
        assert [(r["n"], r["block"], r["workers"]) for r in rows] == [
            (512, 128, 1), (512, 128, 2), (1024, 256, 1), (1024, 256, 2), (512, 256, 1), (512, 256, 2)]
        assert not list(tmp_path.glob("*_1x1x*.npy"))  # the cases' files are removed
        assert all(r["wall"] > 0 and r["machine_cores"] >= 1 for r in rows)
        assert scaleout.scheduler_rate(clients[2], tasks=200) > 10
        long_paths = scaleout.save_case(str(tmp_path), 1, 1, 2048, 32, seed=3)
        long = scaleout.long_run(clients[2], long_paths, 512, str(tmp_path / "out.npy"), samples=2)
    assert [c["rows"] for c in long["checks"]] == ["0..511", "1536..2047"]
    assert max(c["rel_error"] for c in long["checks"]) < 1e-13
    assert len(long["rss_peak"]) == 2 and all(v > 0 for v in long["rss_peak"].values())


def test_long_run_rss_gate_has_power(tmp_path):
    """The long run's flatness verdict (peak worker RSS, Dask's monitor, grows from one n to
    a longer one by less than one head's keys for the added positions) passes the planned
    pieces and fails pieces that read whole key ranges."""
    import dask

    import attnlib.distributed

    d, block, ns = 64, 1024, (4096, 16384)
    growth = {}
    with dask.config.set({"distributed.admin.system-monitor.interval": "20ms"}), \
            scaleout.local_cluster(2) as client:
        for label in ("planned", "whole key range"):
            peaks = []
            for n in ns:
                paths = scaleout.save_case(str(tmp_path), 1, 1, n, d, seed=1)
                kv = block if label == "planned" else n
                out = str(tmp_path / f"out_{n}.npy")
                call = dict(client=client, causal=True, block_q=block, kv_block=kv, out=out)
                if not peaks and label == "planned":
                    attnlib.distributed.attention(*paths, **call)  # warm-up: the workers' imports
                since = scaleout.monitor_now(client)
                attnlib.distributed.attention(*paths, **call)
                time.sleep(0.1)  # the monitor's last sample
                peaks.append(max(scaleout.rss_peak(client, since).values()))
            growth[label] = peaks[1] - peaks[0]
    bound = scaleout.growth_bound(*ns, d)
    assert growth["planned"] < bound <= growth["whole key range"], (growth, bound)


def test_the_docs_task_counts_of_the_projection_are_the_plans():
    from pathlib import Path

    st = scaleout.plan_stats(1, 32, 2**20, 128, 8192)
    readme = (Path(__file__).resolve().parent.parent / "docs" / "distributed.md").read_text()
    assert f"{st['pieces']:,} piece tasks and {st['merges']:,} merges" in readme
