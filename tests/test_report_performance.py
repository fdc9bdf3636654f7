"""The performance report's helpers: every timing keeps its repeats (min, median, max), ratios
are paired repeat by repeat, and the parameters that choose the cases are checked."""

import numpy as np
import pytest

from attnlib import bench, report
from attnlib.bench.timing import ratio_spread, spread


def test_spread_and_paired_ratios():
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    # Ratios of the same round, not of medians: a round loaded for both cancels.
    s = ratio_spread([2.0, 4.0, 3.0], [1.0, 2.0, 3.0])
    assert s == {"min": 1.0, "median": 2.0, "max": 2.0, "n": 3}


def test_time_cases_keeps_every_repeat():
    impls = bench.implementations(workers=(1,), include_torch=False, include_dense=False)
    rows = bench.time_cases([bench.BenchCase(1, 1, 128, d=16)], impls, repeats=3)
    for name in impls:
        assert len(rows[0]["times"][name]) == 3
        assert rows[0][name] == pytest.approx(float(np.median(rows[0]["times"][name])))


def test_tile_sweep_has_its_spread():
    sweep = bench.tile_sweep(bench.BenchCase(1, 1, 128, d=16), sizes=(32, 64), repeats=2)
    med, lo, hi = (np.asarray(sweep[k]) for k in ("seconds", "min", "max"))
    assert med.shape == lo.shape == hi.shape == (2, 2) and np.asarray(sweep["times"]).shape == (2, 2, 2)
    assert (lo <= med).all() and (med <= hi).all() and sweep["repeats"] == 2


def test_load_keeps_its_repeats():
    load = bench.under_load(bench.BenchCase(1, 1, 128, d=16), repeats=2, settle=0.01)
    assert len(load["quiet_times"]) == len(load["loaded_times"]) == 2


def test_masks_without_flex_and_with_torch_tensors():
    torch = pytest.importorskip("torch")
    rows = bench.time_masks(bench.mask_cases(128, decode_batch=2), repeats=2, include_flex=False,
                            include_torch_tensors=True)
    tt = bench.masks.TORCH_TENSORS
    for row in rows:
        assert not any("FlexAttention" in k for k in row)
        assert len(row["times"][tt]) == 2 and row[f"{tt} max diff"] < 1e-13
        assert any(k.endswith("SDPA + mask") for k in row["times"])
    del torch


def test_peak_rss_of_every_implementation_in_one_fresh_process():
    pytest.importorskip("torch")
    names = [bench.DEFAULT, bench.masks.TORCH_TENSORS]
    measured = bench.masks.peak_rss_all(0, 512, names)
    assert set(measured) == set(names) and all(measured[n]["rss_bytes"] >= 0 for n in names), measured


def test_device_section_takes_explicit_cases_and_can_leave_cpu_masks_out():
    torch = pytest.importorskip("torch")
    from attnlib.bench.device import device_section

    result = device_section("cpu", repeats=2, cases=[(1, 1, 128, 16, True), (1, 1, 128, 16, False)],
                            mask_n=256, memory_ns=(256,), cpu_masks=False)
    assert [r["case"] for r in result["forward"]] == ["(1, 1, 128, 16) causal", "(1, 1, 128, 16) full"]
    assert all(len(r["times"]["attnlib (torch)"]) == 2 for r in result["forward"])
    assert result["masks"] == [] and len(result["gemm"]["tflops_repeats"]["tile"]) == 2
    del torch


def test_performance_parameters_check_the_cases():
    nb = report.NOTEBOOKS["performance"]
    assert len(nb.full["cases"]) == 8 and len(nb.full["backward_cases"]) == 4 and nb.full["flex"] is True
    assert [tuple(c[:4]) for c in nb.full["cases"][:4]] == list(bench.SHAPES)
    check = nb.parameters["cases"]
    assert check("cases", [[1, 2, 64, 16, False]]) == [[1, 2, 64, 16, False]]
    with pytest.raises((TypeError, ValueError)):
        check("cases", [[1, 2, 64, 16]])
    with pytest.raises((TypeError, ValueError)):
        check("cases", [[1, 2, 64, 16, "yes"]])


def _verdict_cell_on(figures_json):
    """The performance notebook's verdict cell, run on the figures of a report (its spreads as
    measured), without timing anything: its claims, headline and target rows."""
    import json
    from pathlib import Path

    import nbformat

    root = Path(__file__).resolve().parent.parent
    f = json.loads(Path(figures_json).read_text())["figures"]
    masks = f["masks"]
    names = [k[:-2] for k in masks[0] if k.endswith(" s")]
    growth = f["growth"]
    for i, g in enumerate(growth):  # reports written before the ranges: made from the spreads
        g.setdefault("x previous range", None if i == 0 else report.ratio_range(g["attnlib s"], growth[i - 1]["attnlib s"]))
    space = {"report": report, "bench": bench, "ratio_rows": f["ratios"], "mask_table": masks, "names": names,
             "sdpa": next((n for n in names if "SDPA" in n), None), "backward_ratios": f["backward"],
             "load": f["load"], "device_result": f["device"], "device_masks": f["device"]["mask_ratios"],
             "memory_rows": f["mask_memory"], "memory_names": [k[:-4] for k in f["mask_memory"][0] if k.endswith(" MiB")],
             "growth": growth, "sweep": f["sweep"], "best": f["sweep"]["best"], "sweep_line": f["sweep"]["line"],
             "per_pair": [(r["case"], r["attnlib per visible pair / SDPA per pair"]) for r in masks
                          if r.get("attnlib per visible pair / SDPA per pair")],
             "mask_n": 8192, "params": {}, "results_json": "", "rates_before": None, "rates_after": None,
             "rates": None, "phases": None, "n_rows": None, "torch_name": None}
    nb = nbformat.read(str(root / "notebooks" / "performance.ipynb"), as_version=4)
    exec([c for c in nb.cells if c.source.startswith("Claim = report.Claim")][0].source, space)
    return space


def test_every_timing_claim_follows_one_rule():
    """On the committed run's spreads: a target is met only where its whole spread meets it,
    "not resolved" where the spread crosses it; attnlib is called slower only where the
    whole spread of the paired ratios is above 1; the table under the verdict is short."""
    from pathlib import Path

    committed = Path(__file__).resolve().parent.parent / "reports" / "performance.json"
    if not committed.exists():
        pytest.skip("no committed performance report")
    space = _verdict_cell_on(committed)
    words = {True: "yes", False: "NO", report.UNRESOLVED: "not resolved"}
    rows = space["target_rows"]
    assert rows and all(r["met"] == words[report.against(r["spread"], r["bound"], r["at_most"])] for r in rows)
    line, claims = space["line"], space["claims"]
    assert len(line.split()) <= report.HEADLINE_WORDS
    assert ("Not resolved:" in line) == any(r["met"] == "not resolved" for r in rows)
    slower = [s["median"] for _, s in space["vs_torch"] if report.compare(s) == "slower"]
    noisy = [s["median"] for _, s in space["vs_torch"] if report.compare(s) == "within noise" and s["median"] > 1]
    if slower:
        assert f"forward {space['span'](slower)}×" in line
    for m in noisy:  # a median above 1 whose spread reaches below it is not called slower
        assert f"{m:.2f}" not in line.split("Missed:")[0]
    assert sum(report.on_page(claims)) <= report.CLAIMS_SHOWN
    for c in claims:  # every claim on the page that sums up a target says how its cases came out
        if c.met is not None and not c.detail and "case" in c.claim:
            assert any(w in c.measured for w in ("met ", "NOT met ", "not resolved "))
