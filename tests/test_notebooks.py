"""The evidence notebooks, executed through papermill at tiny parameters, and the runner."""

import json
import os
import re
import shutil
from pathlib import Path

import nbformat
import papermill
import pytest

import attnlib
from attnlib import BOUND, check, report
from attnlib.report import notebook as report_notebook
from attnlib.report import runner as report_runner
from attnlib.evidence.defects import BACKWARD_DEFECTS, DEFECTS
from attnlib.evidence.memory import CAP_BYTES

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


#: The notebooks that measure the machine (timings, clusters) run in
#: test_notebooks_measured.py, a file of their own: pytest-xdist runs it beside this one.
MEASURED = ("performance", "scaleout")
HERE = [n for n in report.NOTEBOOKS if n not in MEASURED]


def run_quick(tmp_path_factory, names):
    out = tmp_path_factory.mktemp("reports")
    lines = []
    status = report.run(names, quick=True, out_dir=out, log=lines.append)
    return status, out, lines


@pytest.fixture(scope="module")
def quick_reports(tmp_path_factory):
    return run_quick(tmp_path_factory, HERE)


def results(out, name):
    return json.loads((out / f"{name}.json").read_text())


def check_quick_run(quick_reports, names):
    status, out, lines = quick_reports
    assert status == 0, lines
    for i, name in enumerate(names, 1):
        label = "INFO" if name == "performance" else "PASS"  # timings are measurements
        assert any(line.startswith(f"[{i}/{len(names)}] {name}: {label}") for line in lines), lines


def test_quick_run_passes_and_reports_progress(quick_reports):
    check_quick_run(quick_reports, HERE)


def test_equivalence_figures(quick_reports):
    data = results(quick_reports[1], "equivalence")
    figs = data["figures"]
    assert len(figs["cases"]) == report.NOTEBOOKS["equivalence"].quick["n_cases"]
    assert len(figs["broad"]) == report.NOTEBOOKS["equivalence"].quick["broad_cases"]
    assert len(figs["features"]) == report.NOTEBOOKS["equivalence"].quick["feature_cases"]
    everything = figs["cases"] + figs["broad"] + figs["features"] + figs["adversarial"]
    assert all(c["passed"] and c["rel_error"] < BOUND for c in everything)
    # The gate is far tighter than the contract's 1e-9, and the real kernel far inside it.
    assert max(max(c["out_ratio"], c["lse_ratio"]) for c in everything) < 0.1
    assert all(c["d"] == 64 and c["crossing_fraction"] > 0 and c["total_rescales"] >= 1 for c in figs["cases"])
    assert {a["family"] for a in figs["adversarial"]} == set(attnlib.FAMILIES)
    accuracy = [a for a in figs["adversarial"] if a["purpose"] == "accuracy"]
    assert len(accuracy) == 5 and all(a["oracle_passed"] for a in accuracy)
    assert [p["defect"] for p in figs["power"]] == list(DEFECTS)
    assert all(p["verdict"] == "caught" and p["caught"] >= 1 for p in figs["power"])
    assert data["params"]["n_cases"] == 6 and data["seconds"] > 0 and data["strict"] is True
    # Attention sinks: every problem passes, and the rescale counts equal the recount at every sink.
    assert len(figs["sinks"]) == report.NOTEBOOKS["equivalence"].quick["sink_cases"]
    assert all(r["passed"] and "sinks" in r["features"] for r in figs["sinks"])
    sweep = figs["sink_sweep"]
    assert sweep[0]["sink"] == "none" and all(r["agree"] and r["passed"] for r in sweep)
    high = [r for r in sweep if r["sink"] != "none" and r["sink"] >= 8]
    assert high and all(r["total_rescales"] == 0 for r in high)  # a sink above every score holds the max
    # Varlen and paged: every problem passes the gate; the paged peak does not follow the cache.
    quick = report.NOTEBOOKS["equivalence"].quick
    assert len(figs["varlen"]) == len(figs["paged"]) == quick["layout_cases"]
    assert all(r["passed"] for r in figs["varlen"] + figs["paged"])
    assert [r["cache pages"] for r in figs["paged_memory"]] == quick["paged_pages"]
    assert 0 <= figs["paged_spread_bytes"] <= 1024
    # The headline: at most 40 words, naming every defect caught on fewer than all it changes.
    assert len(data["verdict"].split()) <= report.HEADLINE_WORDS
    for p in figs["power"]:
        named = f"{p['defect']} {p['caught']}/{p['affected']}" in data["verdict"]
        assert named == (p["caught"] < p["affected"]), p["defect"]
    assert figs["partly_caught"] == {p["defect"]: [p["caught"], p["affected"]] for p in figs["power"]
                                     if p["caught"] < p["affected"]}
    # Problems with no visible key, and single-tile ones (the reference's own arithmetic and
    # bits), are shown apart, not counted as the gate holding.
    counted = sum(figs["counted"].values())
    assert counted + figs["empty_problems"] + figs["single_tile_problems"] == sum(
        len(figs["cases" if g == "differential" else g]) for g in figs["counted"])
    from attnlib.evidence.differential import single_tile
    for g, n in figs["single_tile_by_run"].items():
        rs = [r for r in figs["cases" if g == "differential" else g] if single_tile(r)]
        assert len(rs) == n
        assert all(r["rel_error"] == r["lse_error"] == 0 and min(r["key_tiles"], r["visible_keys_max"]) <= 1
                   for r in rs)
    assert figs["single_tile_by_run"]["differential"] == 0  # every differential problem crosses two key tiles
    if figs["single_tile_problems"]:
        assert "single-tile" in data["verdict"]
    assert all(c["met"] in ("yes", "shown, not gated") for c in data["claims"])
    html = (quick_reports[1] / "equivalence.html").read_text()
    assert "Injected defects through the gate" in html  # the power table is on the page


def test_rescales_figures(quick_reports):
    figs = results(quick_reports[1], "rescales")["figures"]
    assert figs["recount_agrees"] is True
    assert figs["families"]["first_tile"] == 0
    assert figs["families"]["growing"] == figs["maximum"]
    assert 0 < figs["total_rescales"] < figs["maximum"]
    # The i.i.d. model's sigma of the count, and the distance of the measurement in it.
    assert 0 < figs["expected_sigma"] < figs["expected"] ** 0.5 + 1e-9  # sum p(1-p) <= sum p
    assert figs["z"] == pytest.approx((figs["total_rescales"] - figs["expected"]) / figs["expected_sigma"])


def test_memory_figures(quick_reports):
    data = results(quick_reports[1], "memory")
    figs, quick = data["figures"], report.NOTEBOOKS["memory"].quick
    assert figs["tiled_working_bytes"] < CAP_BYTES < figs["dense_working_bytes"]
    assert figs["flatness"] <= 1.10
    # The largest n's peak includes the output (out and lse: n*d*8 + n*8 bytes), stated apart.
    n, d = quick["sweep"][-1], data["params"]["d"]
    assert figs["largest_n"] == n and figs["largest_output_bytes"] == n * d * 8 + n * 8
    assert figs["largest_peak_above_cap"] == (figs["largest_peak_incl_output_bytes"] > CAP_BYTES)
    assert figs["sweep"][-1]["tiled peak incl. output (MiB)"] * 2**20 == figs["largest_peak_incl_output_bytes"]
    assert "working = traced peak - output" in data["verdict"]
    assert len(data["verdict"].split()) <= report.HEADLINE_WORDS
    claims = {c["claim"]: c for c in data["claims"]}
    peak = [c for name, c in claims.items() if name.startswith("tiled traced peak incl.")]
    assert len(peak) == 1 and peak[0]["measured"] == f"{figs['largest_peak_incl_output_bytes'] / 2**20:.2f} MiB"
    assert peak[0]["met"] == "shown, not gated"
    # Decode: tracemalloc and RSS side by side; anonymous RSS gated, file-backed shown.
    cache = 2 * quick["decode_keys"] * d * 8
    assert [r["queries"] for r in figs["decode"]] == quick["decode_queries"]
    assert all(r["KV cache on disk (MiB)"] * 2**20 == cache for r in figs["decode"])
    assert figs["decode_traced_ok"] is True and figs["decode_ok"] is True
    assert all(r["cache / traced working"] > 100 for r in figs["decode"])
    assert "traced <=" in data["verdict"] and "anonymous RSS" in data["verdict"]
    if figs["rss_split"].startswith("not measured"):
        assert figs["decode_rss_ok"] is None and "not measured" in data["verdict"]
        assert all(r["RSS anonymous growth (MiB)"] is None for r in figs["decode"])
    else:
        assert figs["decode_rss_ok"] is True
        assert 0 <= figs["decode_anon_max_bytes"] < min(CAP_BYTES, cache / 100)
        # Reading the whole cache maps it in: the file-backed RSS is about the cache size.
        assert all(0.95 * cache <= r["RSS file-backed growth (MiB)"] * 2**20 <= 1.05 * cache
                   for r in figs["decode"])
        assert all(r["RSS total growth (MiB)"] * 2**20 >= 0.95 * cache for r in figs["decode"])


def test_gradients_figures(quick_reports):
    figs = results(quick_reports[1], "gradients")["figures"]
    assert len(figs["cases"]) == report.NOTEBOOKS["gradients"].quick["n_cases"]
    errors = [r[f"{g}_error"] for r in figs["cases"] + figs["adversarial"] for g in ("dq", "dk", "dv")]
    assert max(errors) < BOUND
    assert figs["tiled_working_max"] < CAP_BYTES < figs["dense_working_largest"]
    # The dense gradient beyond the runs is a projection, shown with its range (the n^2 model
    # from each measured run), which holds the value in the table.
    for row in figs["memory"]:
        if row["dense"] != "measured":
            assert row["dense"].startswith("projected")
            lo, hi = figs["dense_projection_range_bytes"][str(row["n"])]
            assert lo * (1 - 1e-12) <= row["dense working (MiB)"] * 2**20 <= hi * (1 + 1e-12)
    sinks = figs["sinks"]
    assert len(sinks) == report.NOTEBOOKS["gradients"].quick["sink_cases"]
    assert all("sinks" in r["features"] and max(r[f"{g}_error"] for g in ("dq", "dk", "dv", "dsinks")) < 1e-13
               for r in sinks)
    varlen = figs["varlen"]
    assert len(varlen) == report.NOTEBOOKS["gradients"].quick["varlen_cases"]
    assert all(max(r[f"{g}_error"] for g in ("dq", "dk", "dv")) < 1e-13 for r in varlen)
    # The gradient gate: every problem within it, far inside; the defects caught where required.
    assert figs["gate_worst_ratio"] < 0.1
    assert all(r["gate_passed"] for r in figs["cases"] + sinks + figs["adversarial"])
    power = {(p["defect"], p["problems"]): p for p in figs["defect_power"]}
    assert all(p["of"] > 0 for p in figs["defect_power"])  # a defect that changes nothing is listed apart
    assert any(s.startswith("dsinks_sign on the random shapes") for s in figs["not_counted"])
    for name in BACKWARD_DEFECTS:
        if name == "dsinks_sign":
            continue
        random = power[(name, "random shapes")]
        assert random["caught"] == random["of"] or name == "delta_1e-11", random
    data = results(quick_reports[1], "gradients")
    assert len(data["verdict"].split()) <= report.HEADLINE_WORDS and data["claims"]
    for p in figs["defect_power"]:  # every miss is named in the headline with its count
        if p["caught"] < p["of"]:
            assert f"{p['defect']} {p['caught']}/{p['of']}" in data["verdict"], (p, data["verdict"])
    assert power[("bwd_matmul_3e-12", "random shapes")]["of"] == len(figs["cases"])
    assert power[("dsinks_sign", "attention sinks")]["caught"] == len(sinks)


def test_gradients_report_fails_under_a_3e_12_backward_defect(tmp_path):
    """The tiled backward with its matmuls off by a relative 3e-12, for the whole run."""
    lines = []
    # Fewer and smaller problems than quick: the defect is in every backward matmul.
    fewer = [f"{k}={v}" for k, v in dict(n_cases=2, sink_cases=1, varlen_cases=1, adversarial_n=128,
                                         sweep=[256, 512], dense_max_n=512).items()]
    status = report.run(["gradients"], overrides=["inject=bwd_matmul_3e-12", *fewer], quick=True,
                        out_dir=tmp_path, log=lines.append)
    data = results(tmp_path, "gradients")
    assert status == 1 and data["passed"] is False, lines
    assert "INJECTED: bwd_matmul_3e-12" in data["verdict"] and "NOT all within" in data["verdict"]


def test_numerics_figures(quick_reports):
    data = results(quick_reports[1], "numerics")
    figs = data["figures"]
    assert data["passed"] is True
    # Both float64 paths within one implementation's share of the rounding gate, against the oracle.
    assert all(max(r["dense_gate_ratio"], r["tiled_gate_ratio"]) <= 1 for r in figs["float64"])
    assert all(r["tiled_eps"] > 0 for r in figs["float64"])  # measured, not vacuous
    assert {r["dtype"] for r in figs["low_precision"]} == {"float32", "float16", "bfloat16"}
    random = {r["tau"]: r["rescales"] for r in figs["lazy"] if r["inputs"] == "random" and r["dtype"] == "float64"}
    assert random[8.0] < random[0.0]
    # Lazy rescaling judged by its precision's rule; the headline counts where tiled is worse than naive.
    assert all((r["gate_ratio"] if r["dtype"] == "float64" else r["rule_ratio"]) <= 1 for r in figs["lazy"])
    worse = sum(r["ratio"] > 1 for r in figs["low_precision"] + [r for r in figs["low_precision_vs_n"]
                                                                 if r["n"] != data["params"]["precision_n"]])
    assert f"tiled worse than naive on {worse} " in data["verdict"] and len(figs["tiled_worse_than_naive"]) == worse
    assert len(data["verdict"].split()) <= report.HEADLINE_WORDS and data["claims"]


def test_check_rule_figures(quick_reports):
    data = results(quick_reports[1], "check_rule")
    summary, rows = data["figures"]["summary"], data["figures"]["rows"]
    assert data["passed"] is True
    assert set(summary) == set(report.NOTEBOOKS["check_rule"].quick["precisions"])
    for s in summary.values():
        assert s["correct_runs"] > 0 and s["false_alarms"] == 0 and s["caught"] == s["defect_runs"] > 0
    assert all(r["worst_out_ratio"] <= 1 for r in rows if r["kind"] == "correct")
    assert all(r["worst_out_ratio"] > 1 for r in rows if r["kind"] == "defective")
    # The rule's own baseline (dense in the precision, below float64) is apart, not counted.
    assert {r["kind"] for r in rows if r["precision"] == "float64"} == {"correct", "defective"}
    assert any(r["kind"] == "baseline" for r in rows if r["precision"] == "float32")
    # The claims: the worst correct ratio per precision, every defect with its k/n, all met.
    claims = data["claims"]
    assert all(any(c["claim"].startswith(f"{p}: worst") for c in claims) for p in summary)
    assert all(c["met"] in ("yes", "shown, not gated") for c in claims)
    assert data["figures"]["misses"] == []
    # The power run: every wrong kernel failed and every correct one passed, at each magnitude.
    power = data["figures"]["power"]
    assert {r["magnitude"] for r in power} == set(report.NOTEBOOKS["check_rule"].quick["power_magnitudes"])
    assert {r["precision"] for r in power} == {"float32", "bfloat16", "float16"}
    assert all(r["passed"] == (r["kind"] == "correct") for r in power)
    assert sum(r["kind"] == "wrong" for r in power) >= 30
    long = data["figures"]["long_gradients"]
    assert [r["passed"] for r in long] == [r["kind"] == "correct" for r in long]
    # Every mix-up of the 2026 conventions and variants failed and was named.
    table = data["figures"]["mixup_table"]
    assert {t["precision"] for t in table} == {"float32", "bfloat16", "float8_e4m3fn"}
    assert len(table) == 2 * 35 + 4  # 35 mix-ups in float32 and bfloat16, the 4 fp8 descale ones
    assert all(t["hit_rate"] == 1.0 and t["failed"] == t["runs"] for t in table)


def check_html(out, names):
    index = (out / "index.html").read_text()
    for name in names:
        page = (out / f"{name}.html").read_text()
        assert f'href="{name}.html"' in index
        assert "data:image/png;base64," in page  # plots embedded
        # Nothing the reader needs is fetched: no external scripts, styles or images.
        assert not re.search(r'<(script|img|link)[^>]+(src|href)="(https?:)?//', page)
        assert "attnlib" in page and "git commit" in page and "numpy" in page and "CPU" in page
    assert index.count("PASS") == len(set(names) - {"performance"})
    assert index.count("INFO") == ("performance" in names)


def test_html_is_self_contained_and_indexed(quick_reports):
    check_html(quick_reports[1], HERE)


def test_stored_notebooks_have_no_outputs_and_a_parameters_cell():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")) + [check.cli.NOTEBOOK]:
        nb = nbformat.read(str(path), as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), path.name
        tagged = [i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", [])]
        assert tagged == [0], path.name
        declared = set(papermill.inspect_notebook(str(path)))
        if path.stem == "kernel_check":  # run by `attnlib check --html`, not by make report
            assert declared == set(check.NOTEBOOK_PARAMETERS)
            continue
        # The cell after the parameters validates them through attnlib.
        assert f'report.check_params(\n    "{path.stem}"' in code[1].source, path.name
        assert declared == set(report.NOTEBOOKS[path.stem].parameters)
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == set(report.NOTEBOOKS)


def test_validation_cell_fails_with_a_clear_message(tmp_path):
    with pytest.raises(papermill.PapermillExecutionError, match="parameter n_cases must be >= 1, got -3"):
        papermill.execute_notebook(str(NOTEBOOKS / "equivalence.ipynb"), str(tmp_path / "out.ipynb"),
                                   parameters={"n_cases": -3}, kernel_name="python3", progress_bar=False)


@pytest.mark.parametrize("override, message", [
    (["n_cases=-1"], "equivalence: parameter n_cases must be >= 1, got -1"),
    (["n_case=5"], "unknown parameter 'n_case'"),
    (["rescales.n_cases=5"], "unknown parameter 'n_cases' for rescales"),
    (["memory.sweep=[4096, 1024]"], "parameter sweep must be strictly increasing"),
    (["memory.dense_max_n=10**9"], "parameter dense_max_n must be an integer"),
    (["memory.dense_max_n=1000000"], "would run the dense reference out of memory"),
    (["nonsense"], "parameters are given as key=value"),
])
def test_bad_parameters_are_refused_before_running(tmp_path, override, message):
    lines = []
    status = report.run(overrides=override, out_dir=tmp_path, log=lines.append)
    assert status == 2 and message in lines[0], lines
    assert not list(tmp_path.iterdir())  # nothing was run or written


def test_parameter_targeting():
    runs = {name: params for name, _, params in report.plan(
        ["equivalence", "rescales"], ["seed=7", "rescales.n=128", "block_q=32"], quick=True)}
    assert runs["equivalence"]["seed"] == runs["rescales"]["seed"] == 7
    assert runs["rescales"]["n"] == 128 and runs["equivalence"]["max_len"] == 300
    assert runs["equivalence"]["block_q"] == runs["rescales"]["block_q"] == 32


def test_failing_cell_keeps_the_previous_report(tmp_path):
    nb_dir = tmp_path / "notebooks"
    nb_dir.mkdir()
    shutil.copy(NOTEBOOKS / "equivalence.ipynb", nb_dir)
    nb = nbformat.read(str(nb_dir / "equivalence.ipynb"), as_version=4)
    nb.cells.insert(5, nbformat.v4.new_code_cell('raise RuntimeError("boom")'))
    nbformat.write(nb, str(nb_dir / "equivalence.ipynb"))
    out = tmp_path / "reports"
    out.mkdir()
    (out / "equivalence.html").write_text("previous report")
    lines = []
    status = report.run(["equivalence"], quick=True, out_dir=out, nb_dir=nb_dir, log=lines.append)
    assert status == 1
    assert any("equivalence.ipynb failed in cell 5 ('raise RuntimeError(\"boom\")'): RuntimeError: boom" in line
               for line in lines), lines
    assert (out / "equivalence.html").read_text() == "previous report"
    assert not (out / "equivalence.json").exists()


def test_cli_entry_point(capsys):
    from attnlib.__main__ import main

    assert main(["report", "--only", "memory", "-p", "sweep=[]"]) == 2
    captured = capsys.readouterr()  # errors go to stderr, progress to stdout
    assert "parameter sweep must be a non-empty list" in captured.err and not captured.out
    assert main([]) == 2


# -- the runner on tiny notebooks: where reports go, what marks them, failures ----------------

def tiny_notebook(nb_dir, *cells, name="rescales"):
    """``nb_dir/<name>.ipynb``: the real parameters cell, a strict setup with one `stage`,
    then ``cells``, then `save_results`; seconds to run, whatever the parameters."""
    real = nbformat.read(str(NOTEBOOKS / f"{name}.ipynb"), as_version=4)
    parameters = next(c for c in real.cells if "parameters" in c.metadata.get("tags", []))
    nb = nbformat.v4.new_notebook(metadata=real.metadata)
    nb.cells = [nbformat.v4.new_markdown_cell("# A tiny notebook"),
                nbformat.v4.new_code_cell(parameters.source, metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("from attnlib import report\nreport.strict()\n"
                                          "report.stage('the tiny stage')")]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in cells]
    params = '{"seed": seed}' if "seed" in parameters.source else "{}"
    nb.cells.append(nbformat.v4.new_code_cell(
        f'report.save_results(results_json, "{name}", {params}, passed=True, line="tiny verdict", '
        'figures={})'))
    Path(nb_dir).mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(Path(nb_dir) / f"{name}.ipynb"))


@pytest.fixture
def tiny_root(tmp_path, monkeypatch):
    """A checkout of its own: notebooks/ with a tiny rescales notebook, reports/, reports-local/."""
    tiny_notebook(tmp_path / "notebooks")
    monkeypatch.setattr(report_runner, "ROOT", tmp_path)
    monkeypatch.setattr(report_runner, "REPORTS", tmp_path / "reports")
    monkeypatch.setattr(report_runner, "LOCAL_REPORTS", tmp_path / "reports-local")
    return tmp_path


def run_tiny(**kwargs):
    lines, errors = [], []
    status = report.run(["rescales"], log=lines.append, error=errors.append, **kwargs)
    return status, lines, errors


def test_quick_and_overridden_runs_write_outside_reports_and_are_marked(tiny_root, capfd):
    status, lines, errors = run_tiny(quick=True)
    assert status == 0 and not errors, (lines, errors)
    assert not (tiny_root / "reports").exists()  # the committed reports are not touched
    local = tiny_root / "reports-local"
    data = results(local, "rescales")
    quick = report.NOTEBOOKS["rescales"].quick
    defaults = report_runner._notebook_defaults(tiny_root / "notebooks" / "rescales.ipynb")
    assert data["default_params"] is False and data["strict"] is True
    assert data["overrides"] == {k: {"default": defaults[k], "actual": v} for k, v in quick.items()}
    banner = "NON-DEFAULT PARAMETERS</b>: n=256 (default 4096), block_q=32 (default 64)"
    assert banner in (local / "rescales.html").read_text()
    index = (local / "index.html").read_text()
    assert '<span class="nondefault">NON-DEFAULT PARAMETERS</span> n=256 (default 4096)' in index
    # The verdict line, strict (the index says once, at its top, what strict means).
    assert "tiny verdict <small>" in index and ", NOT strict)" not in index
    assert "ran under\n<code>np.errstate(divide=&#x27;raise&#x27;" in index
    # Progress: the notebook's stage reached the runner; nothing else reached the terminal
    # (no kernel transport warnings, no debugger warnings).
    assert any(line.startswith("[1/1] rescales:   the tiny stage (") for line in lines), lines
    assert capfd.readouterr() == ("", "")

    status, lines, errors = run_tiny(overrides=["seed=3"])
    assert status == 0 and not (tiny_root / "reports").exists()
    assert results(local, "rescales")["overrides"] == {"seed": {"default": 0, "actual": 3}}

    # reports/ takes a non-default run only when asked to, explicitly.
    status, lines, errors = run_tiny(quick=True, out_dir=tiny_root / "reports")
    assert status == 2 and "--allow-nondefault-reports" in errors[0] and not lines
    assert not (tiny_root / "reports").exists()

    # The defaults go to reports/, unmarked.
    status, lines, errors = run_tiny()
    assert status == 0 and not errors
    data = results(tiny_root / "reports", "rescales")
    assert data["default_params"] is True and data["overrides"] == {}
    assert "NON-DEFAULT" not in (tiny_root / "reports" / "rescales.html").read_text()
    assert "NON-DEFAULT" not in (tiny_root / "reports" / "index.html").read_text()


def test_failed_notebook_is_an_error_in_the_index_until_it_runs_again(tmp_path):
    nb_dir, out = tmp_path / "notebooks", tmp_path / "out"
    tiny_notebook(nb_dir)
    assert run_tiny(nb_dir=nb_dir, out_dir=out)[0] == 0
    previous = (out / "rescales.html").read_bytes()
    tiny_notebook(nb_dir, 'raise RuntimeError("boom")')
    status, lines, errors = run_tiny(nb_dir=nb_dir, out_dir=out)
    assert status == 1
    message = "rescales.ipynb failed in cell 3 ('raise RuntimeError(\"boom\")'): RuntimeError: boom"
    assert len(errors) == 1 and message in errors[0] and str(out.resolve() / "failed" / "rescales.ipynb") in errors[0]
    assert not any("ERROR" in line for line in lines)  # errors on the error channel only
    assert (out / "rescales.html").read_bytes() == previous  # the previous report is kept
    kept = nbformat.read(str(out / "failed" / "rescales.ipynb"), as_version=4)
    assert any(o.get("ename") == "RuntimeError" for c in kept.cells for o in c.get("outputs", []))
    status_json = json.loads((out / "rescales.status.json").read_text())
    assert status_json["status"] == "ERROR" and status_json["error"] == "RuntimeError: boom"
    index = (out / "index.html").read_text()
    assert ('<span class="error">ERROR</span> in rescales.ipynb, cell 3 (&#x27;raise RuntimeError'
            in index and "the report below is from the previous run that completed" in index)
    assert 'href="rescales.html"' in index  # still linked

    tiny_notebook(nb_dir)  # fixed: the next run clears the marker and the kept notebook
    assert run_tiny(nb_dir=nb_dir, out_dir=out)[0] == 0
    assert not (out / "rescales.status.json").exists() and not (out / "failed").exists()
    assert "ERROR" not in (out / "index.html").read_text()


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGKILL"), reason="needs SIGKILL")
def test_dead_kernel_is_an_error_naming_notebook_and_cell(tmp_path, capfd):
    nb_dir, out = tmp_path / "notebooks", tmp_path / "out"
    tiny_notebook(nb_dir, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    status, lines, errors = run_tiny(nb_dir=nb_dir, out_dir=out)
    assert status == 1
    assert len(errors) == 1 and ("rescales.ipynb lost its kernel in cell 3 ('import os, signal; "
                                 "os.kill(os.getpid(), signal.SIGKILL)'): DeadKernelError") in errors[0], errors
    assert json.loads((out / "rescales.status.json").read_text())["kernel_died"] is True
    assert (out / "failed" / "rescales.ipynb").exists() and not (out / "rescales.html").exists()
    index = (out / "index.html").read_text()
    assert '<span class="error">ERROR</span> in rescales.ipynb, cell 3' in index
    assert "there is no earlier report" in index
    assert capfd.readouterr() == ("", "")  # no raw traceback, no duplicate log line


def test_help_and_usage_exit_codes(capsys):
    import subprocess
    import sys

    from attnlib.__main__ import main

    for flag in ("--help", "-h"):
        assert main([flag]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("usage: attnlib") and not captured.err
    assert main(["nonsense"]) == 2
    captured = capsys.readouterr()
    assert "unknown command 'nonsense'" in captured.err and "usage:" in captured.err and not captured.out
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--help"])
    assert exit_info.value.code == 0 and "reports-local/" in capsys.readouterr().out
    cli = subprocess.run([sys.executable, "-m", "attnlib", "--help"], capture_output=True, text=True)
    assert cli.returncode == 0 and "report" in cli.stdout
    # The console command pip installs beside the interpreter.
    script = Path(sys.executable).with_name("attnlib")
    cli = subprocess.run([str(script), "check", "--help"], capture_output=True, text=True)
    assert cli.returncode == 0 and "--sinks" in cli.stdout


def test_strict_mode_is_claimed_only_when_on(tmp_path):
    import numpy as np

    with np.errstate(divide="warn", over="warn", invalid="warn"):
        loose = report.save_results(str(tmp_path / "loose.json"), "rescales", {}, True, "line", {})
        assert not report.is_strict() and not loose.strict and "errstate" not in loose._repr_markdown_()
        assert json.loads((tmp_path / "loose.json").read_text())["strict"] is False
        report.strict()
        assert report.is_strict()
        strict = report.save_results(str(tmp_path / "strict.json"), "rescales", {}, True, "line", {})
        assert strict._repr_markdown_() == (
            "**PASS**: line — all kernel calls under `np.errstate(divide='raise', over='raise', invalid='raise')`")
        assert json.loads((tmp_path / "strict.json").read_text())["strict"] is True
    assert not report.is_strict()  # errstate restored what strict() set


def test_quick_reports_ran_strict_and_are_marked(quick_reports):
    status, out, lines = quick_reports
    for name in ("rescales", "gradients", "numerics"):
        data = results(out, name)
        assert data["strict"] is True and data["default_params"] is False, name
        assert "NON-DEFAULT PARAMETERS" in (out / f"{name}.html").read_text()
    assert any("] rescales:   the adversarial families (" in line for line in lines), lines


def test_equivalence_report_fails_with_a_defect_in_the_kernel(tmp_path, monkeypatch):
    # The notebook's kernel is another process: a sitecustomize module on its PYTHONPATH
    # injects the defect there (an exp off by a relative 1e-12 * x, in the tiled kernel only).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "from attnlib.evidence.defects import DEFECTS\n"
        "ACTIVE = DEFECTS['exp_1e-12x'].active()  # kept alive: the defect stays in\n"
        "ACTIVE.__enter__()\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    lines = []
    # Fewer problems than quick: each one must fail, so two of each run show it.
    fewer = [f"{k}={v}" for k, v in dict(n_cases=2, broad_cases=2, feature_cases=2, sink_cases=1,
                                         document_cases=1, layout_cases=2, max_len=128, broad_max_len=128,
                                         feature_max_len=128, sink_n=128, document_max_len=256,
                                         adversarial_n=128, paged_pages=[256]).items()]
    status = report.run(["equivalence"], overrides=fewer, quick=True, out_dir=tmp_path / "out", log=lines.append)
    assert status == 1, lines
    data = results(tmp_path / "out", "equivalence")
    assert data["passed"] is False and any("equivalence: FAIL" in line for line in lines), lines
    assert not any(c["passed"] for c in data["figures"]["cases"])


def test_runs_that_cannot_be_honest_are_refused_or_marked(tmp_path, monkeypatch):
    nb_dir, out = tmp_path / "nb", tmp_path / "out"
    tiny_notebook(nb_dir)
    # results_json is the runner's, never a parameter
    status, _, errors = run_tiny(overrides=["results_json='/tmp/x.json'"], out_dir=out)
    assert status == 2 and "results_json" in errors[0]
    # a notebook from another folder is marked even at its own defaults
    status, lines, errors = run_tiny(nb_dir=nb_dir, out_dir=out)
    assert status == 0, (lines, errors)
    data = results(out, "rescales")
    assert data["default_params"] is False and data["overrides"]["notebook"]["actual"] == str(nb_dir / "rescales.ipynb")
    assert "NON-DEFAULT PARAMETERS" in (out / "index.html").read_text()
    # a subfolder of reports/ counts as reports/
    monkeypatch.setattr(report_runner, "REPORTS", tmp_path / "reports")
    status, _, errors = run_tiny(nb_dir=nb_dir, out_dir=tmp_path / "reports" / "sub")
    assert status == 2 and "allow-nondefault-reports" in errors[0]


def test_a_report_that_cannot_be_written_is_an_error(tmp_path, monkeypatch):
    nb_dir, out = tmp_path / "nb", tmp_path / "out"
    tiny_notebook(nb_dir)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_runner, "render_html", full_disk)
    status, _, errors = run_tiny(nb_dir=nb_dir, out_dir=out)
    assert status == 1 and "writing its report failed" in errors[0] and "No space left" in errors[0]
    assert json.loads((out / "rescales.status.json").read_text())["status"] == "ERROR"
    assert "ERROR" in (out / "index.html").read_text()


def test_one_run_at_a_time_per_folder(tmp_path):
    import fcntl

    nb_dir, out = tmp_path / "nb", tmp_path / "out"
    tiny_notebook(nb_dir)
    out.mkdir()
    with open(out / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        status, _, errors = run_tiny(nb_dir=nb_dir, out_dir=out)
    assert status == 2 and "another report run" in errors[0]
    assert run_tiny(nb_dir=nb_dir, out_dir=out)[0] == 0  # released


def test_flex_gallery_figures(quick_reports):
    data = results(quick_reports[1], "flex_gallery")
    figs, quick = data["figures"], report.NOTEBOOKS["flex_gallery"].quick
    assert data["passed"] is True
    entries = figs["entries"]
    assert len(entries) == 10 and all(r["passed"] and r["grad_error"] < 1e-13 for r in entries)
    assert sum(r["vs_built_in"] is not None for r in entries) == 5
    assert all(r["vs_built_in"] < 1e-13 and r["same_tile_map"] is not False for r in entries
               if r["vs_built_in"] is not None)
    assert all(r["count_agrees"] for r in entries if r["count_agrees"] is not None)
    assert all(r["vs_flex"] < 1e-13 for r in figs["versus_flex"])  # torch is a test dependency
    assert [r["n"] for r in figs["long"]] == quick["long_ns"] * 2
    assert len(figs["memory"]) == quick["memory_entries"]
    assert all(r["attnlib (MiB)"] is not None for r in figs["memory"])
    # "flat" only by the memory report's rule; the gate is the growth bound; timings with spread.
    flat = all(s <= figs["flat_rule"] for s in figs["long_spread"].values())
    assert (", flat (x" in data["verdict"]) == flat and ("not flat" in data["verdict"]) == (not flat)
    assert all(r["flex_gate_ratio"] <= 1 and r["attnlib min (s)"] <= r["attnlib max (s)"] for r in figs["versus_flex"])
    assert len(data["verdict"].split()) <= report.HEADLINE_WORDS and data["claims"]


# The pages as a reader gets them, from the same quick run (one run per notebook per pytest run).
def page_text(out, name) -> str:
    import html as html_

    page = (out / f"{name}.html").read_text()
    body = page[page.index("<body"):]
    body = re.sub(r"<(style|script)\b.*?</\1>", " ", body, flags=re.S)
    return " ".join(html_.unescape(re.sub(r"<[^>]+>", " ", body)).split())


def test_gradients_headline_counts_the_problems_the_gate_judged(quick_reports):
    quick = results(quick_reports[1], "gradients")
    figs = quick["figures"]
    everything = figs["cases"] + figs["sinks"] + figs["varlen"] + figs["adversarial"]
    # A problem with no visible key (every gradient exactly 0) tests nothing: apart, not counted.
    empty = sum(r["visible_pairs"] == 0 for r in everything)
    problems = len(everything) - empty
    assert figs["problems"] == len(everything) and figs["empty_problems"] == empty
    assert figs["gated_problems"] == problems
    assert all("gate_ratio" in r and r["gate_passed"] for r in figs["varlen"])
    said = re.match(r"(\d+) problems' gradients within 1e-09 and the gradient gate", quick["verdict"])
    assert said and int(said.group(1)) == figs["gated_problems"], quick["verdict"]
    gate = next(c for c in quick["claims"]
                if c["claim"].startswith("every problem with a visible key within the gradient gate"))
    assert gate["measured"].startswith(f"{problems}/{problems};") and gate["met"] == "yes"
    assert quick["key"].startswith(f"{problems}/{problems} problems within the gradient gate")
    # The claims table sums up the defects per family; every (defect, family) row is kept under it.
    page = [c for c in quick["claims"] if c["page"]]
    assert len(page) <= report.CLAIMS_SHOWN
    families = [c for c in page if c["claim"].startswith("injected defects caught on the")]
    assert len(families) == 4 and any("varlen" in c["claim"] for c in families)
    details = [c for c in quick["claims"] if not c["page"]]
    for p in figs["defect_power"]:
        assert any(c["claim"] == f"{p['defect']} caught on the {p['problems']} it changes" for c in details)
        row = next(c for c in families if c["claim"].startswith(f"injected defects caught on the {p['problems']}"))
        assert f"{p['defect']} {p['caught']}/{p['of']}" in row["measured"]


def test_memory_verdict_section_promises_what_the_page_shows(quick_reports):
    data, text = results(quick_reports[1], "memory"), page_text(quick_reports[1], "memory")
    section = text[text.rindex("Verdict"):]
    # The ungated figures are said to be in the claims table, and they are; the line states only what is gated.
    assert "stated in the verdict" not in section and "in the claims table" in section
    shown = {c["claim"]: c for c in data["claims"] if c["met"] == "shown, not gated"}
    assert any(c.startswith("tiled traced peak incl.") for c in shown)
    assert any("file-backed RSS" in c for c in shown)
    assert all(claim["page"] for claim in shown.values())
    gated = [c for c in data["claims"] if c["met"] == "yes"]
    assert len(gated) >= 5 and report.notebook.words(data["key"]) <= report.KEY_WORDS


def test_rescales_families_are_counted_from_the_data(quick_reports):
    data, text = results(quick_reports[1], "rescales"), page_text(quick_reports[1], "rescales")
    families = data["figures"]["families"]
    assert len(families) == 8
    assert f"the {len(families)} adversarial families" in text
    assert not re.search(r"\b(two|three|four|five|six|seven|eight) adversarial families", text)
    for name, total in families.items():
        assert f"{name} {total:,}" in text
    # The recount is counted over the processed tiles; the SKIP ones (no visible pair) are apart.
    figs = data["figures"]
    assert figs["processed_tiles"] + figs["skipped_tiles"] == (256 // 32) ** 2 and figs["skipped_tiles"] > 0
    assert figs["recount_tiles"] == figs["processed_tiles"] and figs["skip_tile_rescales"] == 0
    assert data["key"] == f"counts equal the dense recount in {figs['processed_tiles']:,} processed tiles"
    assert report.notebook.words(data["key"]) <= report.KEY_WORDS


def test_flex_gallery_title_and_headline_say_what_was_measured(quick_reports):
    """No "exact" the page does not support: the title names the reference the entries are
    judged against, the headline's tile counts are "= dense count"; FlexAttention's times are
    read by the rule of every timing (slower or faster only by the whole range)."""
    title = nbformat.read(str(NOTEBOOKS / "flex_gallery.ipynb"), as_version=4).cells[0].source.splitlines()[0]
    assert title == "# " + report.NOTEBOOKS["flex_gallery"].title and "exact" not in title
    data = results(quick_reports[1], "flex_gallery")
    assert "exact" not in data["verdict"] and "tile counts = dense count" in data["verdict"]
    assert sum(c["page"] for c in data["claims"]) <= report.CLAIMS_SHOWN
    if any("vs_flex" in r for r in data["figures"]["versus_flex"]):
        said = [report.compare(report.ratio_range(
            {k: r[f"FlexAttention eager {k} (s)"] for k in ("min", "median", "max")},
            {k: r[f"attnlib {k} (s)"] for k in ("min", "median", "max")})) for r in data["figures"]["versus_flex"]]
        times = next(c for c in data["claims"] if c["page"] and c["claim"].startswith("FlexAttention eager / attnlib"))
        for word in ("slower", "faster", "within noise"):
            if said.count(word):
                assert f"{word} on {said.count(word)}" in times["measured"]


def test_side_by_side_runs_share_the_cpus_and_time_nothing_beside_another(tmp_path, all_cpus):
    """``jobs=2``: the notebooks that time nothing run two at a time, each in a process pinned
    to its share of the CPUs with as many BLAS threads; a notebook that times things
    (`Notebook.alone`) runs after them, on every CPU; a failing notebook and a killed process
    are errors of their own notebook only."""
    nb_dir, out = tmp_path / "notebooks", tmp_path / "out"
    seen = tmp_path / "seen"
    seen.mkdir()
    record = ("import json, os, time\nfrom attnlib.report.notebook import environment\n"
              f"json.dump({{'cpus': sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else [],"
              f" 'omp': os.environ.get('OMP_NUM_THREADS'), 'start': time.time(), 'env': environment()['CPU']}}, "
              f"open(r'{seen}/' + '{{name}}.json', 'w'))")
    for name in ("rescales", "gradients", "performance"):
        tiny_notebook(nb_dir, record.replace("{name}", name), name=name)
    tiny_notebook(nb_dir, 'raise RuntimeError("boom")', name="numerics")
    tiny_notebook(nb_dir, "import os, signal; os.kill(os.getppid(), signal.SIGKILL)", name="memory")
    names = ["rescales", "gradients", "performance", "numerics", "memory"]
    lines, errors = [], []
    status = report.run(names, nb_dir=nb_dir, out_dir=out, log=lines.append, error=errors.append, jobs=2)
    assert status == 1
    assert any(line.startswith("4 notebooks run up to 2 at a time") and line.endswith("alone (they time "
               "things): performance") for line in lines), lines
    assert sorted(e.split(":")[0] for e in errors) == ["[4/5] numerics", "[5/5] memory"], errors
    assert "RuntimeError: boom" in next(e for e in errors if "numerics" in e)
    assert "ended with exit code -9 before the notebook did" in next(e for e in errors if "memory" in e)
    # Both errors are recorded as any notebook's are: the index shows them over no earlier report.
    killed = json.loads((out / "memory.status.json").read_text())
    assert killed["status"] == "ERROR" and killed["kernel_died"] is True and "exit code -9" in killed["error"]
    assert json.loads((out / "numerics.status.json").read_text())["error"] == "RuntimeError: boom"
    assert (out / "failed" / "numerics.ipynb").exists()  # kept, whatever the other processes did
    index = (out / "index.html").read_text()
    assert index.count('<span class="error">ERROR</span>') == 2
    for i, name in ((1, "rescales"), (2, "gradients"), (3, "performance")):
        assert any(line.startswith(f"[{i}/5] {name}: PASS: tiny verdict") for line in lines), lines
        assert results(out, name)["passed"] is True
    ran = {name: json.loads((seen / f"{name}.json").read_text()) for name in ("rescales", "gradients", "performance")}
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    assert ran["performance"]["cpus"] == cpus  # alone: every CPU, the caller's threads
    assert ran["performance"]["start"] > max(ran["rescales"]["start"], ran["gradients"]["start"])
    if len(cpus) >= 2:
        shares = [ran[name]["cpus"] for name in ("rescales", "gradients")]
        assert all(shares) and sorted(sum(shares, [])) == cpus  # disjoint, together every CPU
        assert [ran[name]["omp"] for name in ("rescales", "gradients")] == [str(len(s)) for s in shares]
        assert all(ran[name]["env"].endswith(f"logical cores; this run on {len(share)} of them)")
                   for name, share in zip(("rescales", "gradients"), shares))  # the page says so
        assert ran["performance"]["env"] == report_notebook.environment()["CPU"]  # the caller's
    assert (out / "index.html").exists()


def test_jobs_must_be_a_positive_integer(tmp_path):
    errors = []
    for bad in (0, -1, 1.5, True, "2"):
        assert report.run(["rescales"], out_dir=tmp_path, log=errors.append, jobs=bad) == 2
    assert len(errors) == 5 and all(e.startswith("error: jobs must be a positive integer") for e in errors)


def test_a_caller_that_stops_reading_ends_the_side_by_side_processes(tmp_path):
    """A ``log`` that raises (a closed pipe under ``make report | head``) ends the run at once:
    its notebooks' processes are terminated, not waited for."""
    import multiprocessing
    import time

    nb_dir = tmp_path / "notebooks"
    for name in ("rescales", "gradients"):
        tiny_notebook(nb_dir, "import time; time.sleep(60)", name=name)

    def log(line):
        if "running" in line:
            raise BrokenPipeError("the reader is gone")

    started = time.perf_counter()
    with pytest.raises(BrokenPipeError):
        report.run(["rescales", "gradients"], nb_dir=nb_dir, out_dir=tmp_path / "out", log=log, jobs=2)
    assert time.perf_counter() - started < 30 and not multiprocessing.active_children()
