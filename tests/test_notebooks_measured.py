"""The notebooks that measure the machine (performance: timings; scaleout: clusters), executed
through papermill at tiny parameters: a file of their own, so that pytest-xdist runs them
beside test_notebooks.py's."""

import pytest

from attnlib import bench, report

from test_notebooks import check_html, check_quick_run, results, run_quick

MEASURED = ["performance", "scaleout"]


@pytest.fixture(scope="module")
def quick_reports(tmp_path_factory, all_cpus_module):
    return run_quick(tmp_path_factory, MEASURED)  # on every CPU: they measure the machine


def test_quick_run_passes_and_reports_progress(quick_reports):
    check_quick_run(quick_reports, MEASURED)


def test_html_is_self_contained_and_indexed(quick_reports):
    check_html(quick_reports[1], MEASURED)


def test_quick_reports_ran_strict_and_are_marked(quick_reports):
    data = results(quick_reports[1], "performance")
    assert data["strict"] is True and data["default_params"] is False
    assert "NON-DEFAULT PARAMETERS" in (quick_reports[1] / "performance.html").read_text()


def test_performance_figures(quick_reports):
    data = results(quick_reports[1], "performance")
    figs = data["figures"]
    assert data["passed"] is None and len(data["verdict"].split()) <= 40
    claims = [c["claim"] for c in data["claims"]]
    assert any(c.startswith("under load") for c in claims) and any("roofline" in c for c in claims)
    assert [r["n"] for r in figs["time_vs_n"]] == report.NOTEBOOKS["performance"].quick["n_values"]
    # Every time and ratio comes with its spread over the repeats: min <= median <= max.
    assert all(r[k]["min"] <= r[k]["median"] <= r[k]["max"] and r[k]["min"] > 0
               for r in figs["ratios"] for k in ("attnlib s", "w=1 s", "roofline fraction"))
    assert [r["case"] for r in figs["masks"]] == [c.name for c in bench.mask_cases(512)]
    assert all(r["attnlib MiB"] is not None for r in figs["mask_memory"])
    assert figs["phases"]["phases"][-1]["phase"].startswith("rest") and figs["load"]["slowdown"] > 0
    assert len(figs["sweep"]["seconds"]) == len(report.NOTEBOOKS["performance"].quick["sweep_sizes"])
    # Every tile shape of the sweep is on the page with its spread, not only in the heatmap.
    assert len(figs["sweep"]["rows"]) == len(report.NOTEBOOKS["performance"].quick["sweep_sizes"]) ** 2
    page = (quick_reports[1] / "performance.html").read_text()
    assert "every shape, seconds median (min–max)" in page and "costs what is visible" not in page
    # A visible pair's cost against SDPA's per pair: computed, repeat by repeat, never assumed.
    for r in figs["masks"]:
        s = r["attnlib per visible pair / SDPA per pair"]
        assert s is None or s["min"] <= s["median"] <= s["max"]
    assert "single run" in page  # the torch kernel's one-call seconds are labelled as such
    device = figs["device"]  # the device section: CUDA asked for, its CPU part run without it
    assert device["gemm"]["tile_tflops"] > 0 and all(r["max |torch - numpy|"] < 1e-13 for r in device["forward"])
    assert [r["n"] for r in device["memory"]] == report.NOTEBOOKS["performance"].quick["device_memory_ns"]
    assert any("attnlib torch / numpy kernel" in c for c in claims)
    # The headline names where attnlib is slower than a peer, and every gated claim it missed.
    assert data["verdict"].startswith("attnlib slower than SDPA")
    if any(c["met"] == "NO" for c in data["claims"]):
        assert "Missed:" in data["verdict"]
    # One rule for every target: met, missed or not resolved by the whole spread; the table
    # under the verdict sums each target up, its cases in the section under it.
    words = {True: "yes", False: "NO", report.UNRESOLVED: "not resolved"}
    assert all(r["met"] == words[report.against(r["spread"], r["bound"], r["at_most"])] for r in figs["targets"])
    assert sum(c["page"] for c in data["claims"]) <= report.CLAIMS_SHOWN
    assert report.notebook.words(data["key"]) <= report.KEY_WORDS


def test_scaleout_figures(quick_reports):
    data = results(quick_reports[1], "scaleout")
    figs, quick = data["figures"], report.NOTEBOOKS["scaleout"].quick
    assert data["passed"] is True
    assert figs["equal_rel_error"] < 1e-13 and figs["equal_lse_diff"] < 1e-13
    assert figs["timing"]["bitwise_identical"] is True
    assert [r["n"] for r in figs["sweep"]] == quick["sweep"]
    assert all(r["piece tasks"] > 0 and r["working = peak - left (MiB)"] > 0 for r in figs["sweep"])
    lo, hi = quick["sweep"][-2:]
    assert figs["growth_bound_mib"] == 8 * (hi - lo) * quick["d"] / 2**20 > figs["growth_mib"]
    assert figs["model"]["rate_alone"] >= figs["model"]["rate_full_machine"] > 0
    # The headline figures, as fractions.
    assert 0 < figs["per_core_efficiency"] and figs["per_core_efficiency_noise"] >= 0
    held = [r for r in figs["model_runs"] if str(r.get("runs")).startswith("held out")] + [figs["long"]]
    assert figs["model_heldout_error"] == max(abs(r["error"]) for r in held)  # the long run is held out too
    assert {"held out (timing case)"} <= {r["runs"] for r in figs["model_runs"]}
    lo, hi = figs["model_heldout_error_range"]
    assert 0 <= lo <= hi
    assert len(figs["long"]["walls"]) == quick.get("long_repeats", 5)
    assert [s["to n"] for s in figs["memory_steps"]] == quick["sweep"][1:]
    # Every gated step (from a full throttle) under its bound; the headline says which are gated,
    # and names the cluster sizes in words, not as a fraction.
    under, gated = figs["gated_steps_under"]
    assert gated >= 1 and under == gated and "gated" in data["verdict"]
    assert "same bits on 1 and 2 workers" in data["verdict"]
    assert all(len(v) == quick["repeats"] for ph in figs["timing"]["phases_by_run"].values() for v in ph.values())
    assert all(p["low_hours"] <= p["hours"] <= p["high_hours"] for p in figs["projection"])
    assert {r["runs"] for r in figs["model_runs"]} == {"fit", "held out", "held out (timing case)"}
    assert figs["long"]["n"] == quick["long_n"] and len(figs["long"]["checks"]) == quick["long_samples"]
    assert figs["long_rel_error"] < 1e-13
    # What was measured, never "exact": the long run against attnlib.attention on its sampled
    # blocks; the targets judged by the whole spread (every repeat; the refits).
    verdict = data["verdict"]
    assert " exact" not in verdict and f"n={quick['long_n']}: within" in verdict
    assert f"on {quick['long_samples']} sampled blocks" in verdict
    eff = report.outcome(report.against(figs["per_core_efficiency_spread"], 0.80, at_most=False))
    err = report.outcome(report.against(figs["model_heldout_error_spread"], 0.25))
    assert figs["per_core_efficiency_target"] == eff and f"target ≥0.80 {eff}" in verdict
    assert figs["model_heldout_error_target"] == err and f"target ≤25% {err}" in verdict
    assert all(set(ph) >= {"read", "kernel", "merge", "idle"} for ph in figs["timing"]["phases"].values())
    assert len(figs["projection"]) == len(report.NOTEBOOKS["scaleout"].quick.get(
        "project_machines", [1, 8, 64, 512]))
    assert all(p["hours"] >= max(p["model_hours"], p["scheduler_floor_hours"]) > 0 for p in figs["projection"])
