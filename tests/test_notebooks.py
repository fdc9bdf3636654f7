"""The evidence notebooks, executed through papermill at tiny parameters, and the runner."""

import json
import re
import shutil
from pathlib import Path

import nbformat
import papermill
import pytest

from attnlib import BOUND, check, report
from attnlib.memory import CAP_BYTES

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="module")
def quick_reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    lines = []
    status = report.run(quick=True, out_dir=out, log=lines.append)
    return status, out, lines


def results(out, name):
    return json.loads((out / f"{name}.json").read_text())


def test_quick_run_passes_and_reports_progress(quick_reports):
    status, out, lines = quick_reports
    assert status == 0, lines
    total = len(report.NOTEBOOKS)
    for i, name in enumerate(report.NOTEBOOKS, 1):
        label = "INFO" if name == "performance" else "PASS"  # timings are measurements
        assert any(line.startswith(f"[{i}/{total}] {name}: {label}") for line in lines), lines


def test_equivalence_figures(quick_reports):
    data = results(quick_reports[1], "equivalence")
    figs = data["figures"]
    assert len(figs["cases"]) == report.NOTEBOOKS["equivalence"].quick["n_cases"]
    assert all(c["rel_error"] < BOUND for c in figs["cases"] + figs["adversarial"])
    assert {a["family"] for a in figs["adversarial"]} == {"first_tile", "last_tile", "growing", "negative"}
    assert data["params"]["n_cases"] == 6 and data["seconds"] > 0


def test_rescales_figures(quick_reports):
    figs = results(quick_reports[1], "rescales")["figures"]
    assert figs["recount_agrees"] is True
    assert figs["families"]["first_tile"] == 0
    assert figs["families"]["growing"] == figs["maximum"]
    assert 0 < figs["total_rescales"] < figs["maximum"]


def test_memory_figures(quick_reports):
    figs = results(quick_reports[1], "memory")["figures"]
    assert figs["tiled_working_bytes"] < CAP_BYTES < figs["dense_working_bytes"]
    assert figs["flatness"] <= 1.10
    assert figs["decode_ok"] is True and [r["queries"] for r in figs["decode"]] == [1, 16]
    assert all(r["cache / working"] > 100 for r in figs["decode"])


def test_gradients_figures(quick_reports):
    figs = results(quick_reports[1], "gradients")["figures"]
    assert len(figs["cases"]) == report.NOTEBOOKS["gradients"].quick["n_cases"]
    errors = [r[f"{g}_error"] for r in figs["cases"] + figs["adversarial"] for g in ("dq", "dk", "dv")]
    assert max(errors) < BOUND
    assert figs["tiled_working_max"] < CAP_BYTES < figs["dense_working_largest"]


def test_performance_figures(quick_reports):
    data = results(quick_reports[1], "performance")
    figs = data["figures"]
    assert data["passed"] is None and "tiled/dense" in data["verdict"]
    assert [r["n"] for r in figs["time_vs_n"]] == report.NOTEBOOKS["performance"].quick["n_values"]
    assert all(r["tiled s"] > 0 and r["roofline fraction"] > 0 for r in figs["ratios"])
    assert {r["workers"] for r in figs["ratios"]} == {1, 2}
    assert len(figs["sweep"]["seconds"]) == len(report.NOTEBOOKS["performance"].quick["sweep_sizes"])


def test_numerics_figures(quick_reports):
    data = results(quick_reports[1], "numerics")
    figs = data["figures"]
    assert data["passed"] is True
    assert all(r["tiled_eps"] < 1e3 for r in figs["float64"])
    assert {r["dtype"] for r in figs["low_precision"]} == {"float32", "float16", "bfloat16"}
    random = {r["tau"]: r["rescales"] for r in figs["lazy"] if r["inputs"] == "random" and r["dtype"] == "float64"}
    assert random[8.0] < random[0.0]


def test_html_is_self_contained_and_indexed(quick_reports):
    out = quick_reports[1]
    index = (out / "index.html").read_text()
    for name in report.NOTEBOOKS:
        page = (out / f"{name}.html").read_text()
        assert f'href="{name}.html"' in index
        assert "data:image/png;base64," in page  # plots embedded
        # Nothing the reader needs is fetched: no external scripts, styles or images.
        assert not re.search(r'<(script|img|link)[^>]+(src|href)="(https?:)?//', page)
        assert "attnlib" in page and "git commit" in page and "numpy" in page and "CPU" in page
    assert index.count("PASS") == len(report.NOTEBOOKS) - 1 and index.count("INFO") == 1


def test_stored_notebooks_have_no_outputs_and_a_parameters_cell():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
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
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == set(report.NOTEBOOKS) | {"kernel_check"}


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
    assert "parameter sweep must be a non-empty list" in capsys.readouterr().out
    assert main([]) == 2
