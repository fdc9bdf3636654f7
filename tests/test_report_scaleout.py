"""The scale-out report's statistics that need no cluster: the memory rule on every step of
a sweep, the cost model's refits (bootstrap) and the ranges they give the held-out error and
the projection."""

import numpy as np
import pytest

pytest.importorskip("distributed")

from attnlib.bench import scaleout  # noqa: E402

TRUE = {"seconds_per_flop": 5e-11, "shared_seconds_per_flop": 6e-12, "seconds_per_task": 1.5e-3,
        "serial_seconds_per_task": 6e-3, "latency_seconds": 0.04, "tail_seconds_per_flop": 3e-11}
FIT = [(1, 4096, 512), (1, 4096, 1024), (2, 4096, 1024), (1, 8192, 2048), (1, 8192, 4096)]


def _rows(cases, noise=0.05, repeats=5, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for h, n, block in cases:
        for w in (1, 2):
            st = scaleout.plan_stats(1, h, n, 64, block)
            r = {**st, "n": n, "heads": h, "d": 64, "block": block, "workers": w, "workers_per_machine": w,
                 "machine_cores": 2}
            walls = [scaleout.predict(TRUE, r) * (1 + noise * rng.uniform(-1, 1)) for _ in range(repeats)]
            rows.append({**r, "walls": walls, "wall": float(np.median(walls))})
    return rows


def test_memory_rule_is_applied_to_every_step():
    d, mib = 64, 2**20
    ns = [4096, 8192, 16384, 32768]
    # Grows past the bound (2 MiB) on the first step, then stays under it: bounded from 8192.
    m = scaleout.memory_steps(ns, [5 * mib, 8.4 * mib, 10.4 * mib, 10.9 * mib], d)
    assert [s["under"] for s in m["steps"]] == [False, True, True]
    assert [s["bound"] for s in m["steps"]] == [scaleout.growth_bound(a, b, d) for a, b in zip(ns, ns[1:])]
    assert m["bounded_from"] == 8192
    assert scaleout.memory_steps(ns, [1 * mib, 1.1 * mib, 1.2 * mib, 1.3 * mib], d)["bounded_from"] == 4096
    # Over on the last step: not bounded, whatever came before.
    assert scaleout.memory_steps(ns, [1 * mib, 1.1 * mib, 1.2 * mib, 20 * mib], d)["bounded_from"] is None
    # Without the plan's pieces the last step alone is gated.
    assert [s["gated"] for s in m["steps"]] == [False, False, True]
    # With them: every step from an n whose plan fills the client's throttle is gated, the ramp
    # below it (the partials in flight still growing with the plan) is not.
    from attnlib.distributed.engine import unmerged_limit
    limit = unmerged_limit(2)
    assert limit == 8
    pieces = [3, 10, 36, 136]
    g = scaleout.memory_steps(ns, [5 * mib, 8.4 * mib, 10.4 * mib, 10.9 * mib], d, pieces=pieces, limit=limit)
    assert [s["gated"] for s in g["steps"]] == [False, True, True]
    assert [s["throttle_full"] for s in g["steps"]] == [False, True, True]
    # No step from a full throttle: the last step is gated, and says so.
    few = scaleout.memory_steps(ns, [5 * mib] * 4, d, pieces=[1, 2, 3, 4], limit=limit)
    assert [s["gated"] for s in few["steps"]] == [False, False, True] and not few["steps"][-1]["throttle_full"]


def test_refits_cover_the_true_model_and_give_ranges():
    rows = _rows(FIT)
    kernel = {1: [8.0, 8.1, 7.9, 8.05, 8.2], 2: [9.0, 9.1, 8.9, 9.2, 9.0]}  # t_shared / t_flop ~ 0.12
    boot = scaleout.bootstrap_models(rows, kernel, cores=2, draws=100)
    assert len(boot["models"]) + boot["skipped"] == 100 and len(boot["models"]) > 90
    lo, hi = scaleout.percentile_range([m["seconds_per_flop"] for m in boot["models"]])
    assert lo <= hi and 0.8 * TRUE["seconds_per_flop"] < lo and hi < 1.2 * TRUE["seconds_per_flop"]
    held = _rows([(1, 16384, 4096)], seed=1)
    e_lo, e_hi = scaleout.heldout_error_range(boot["models"], held)
    assert 0 <= e_lo <= e_hi < 0.3
    # The projection's range holds the model's own projection and never goes below the floors.
    model = scaleout.fit_cost_model(rows, shared_slowdown=scaleout.kernel_slowdown(
        {w: {"kernel": float(np.median(k))} for w, k in kernel.items()}, 2))
    rates = [900.0, 1000.0, 1100.0, 950.0, 1050.0]
    for machines in (1, 512):
        p = scaleout.project(model, 2**20, 32, 128, machines, 32, 8192, float(np.median(rates)))
        r = scaleout.project_range(boot["models"], e_hi, 2**20, 32, 128, machines, 32, 8192, rates)
        assert r["low_hours"] <= p["hours"] <= r["high_hours"]
        assert r["low_hours"] >= (p["pieces"] + p["merges"]) / max(rates) / 3600
        assert r["high_hours"] >= (p["pieces"] + p["merges"]) / min(rates) / 3600
    wide = scaleout.project_range(boot["models"], 1.0, 2**20, 32, 128, 1, 32, 8192, rates)
    assert wide["high_hours"] == float("inf")


def test_timing_case_rows_are_model_rows():
    timing = {"samples": {"single": [1.0] * 5, 1: [2.0, 2.1, 1.9, 2.2, 2.0], 2: [1.2, 1.3, 1.1, 1.2, 1.25]},
              "median": {1: 2.0, 2: 1.2}, "noise": {1: 0.075, 2: 0.083}}
    rows = scaleout.timing_rows(timing, 1, 16384, 64, 2048)
    assert [r["workers"] for r in rows] == [1, 2] and rows[1]["walls"] == timing["samples"][2]
    assert rows[0]["pieces"] == scaleout.plan_stats(1, 1, 16384, 64, 2048)["pieces"]
    assert all(np.isfinite(scaleout.predict(TRUE, r)) for r in rows)
