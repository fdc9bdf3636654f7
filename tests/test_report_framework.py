"""What every report is held to, pinned: the verdict in at most 40 words, under the title,
with its claims table; no code in the rendered HTML; long tables summarised, every row kept;
the index one line per report; the full runs apart, in reports/full/."""

import json
import re
from pathlib import Path

import nbformat
import pytest

from attnlib import report
from attnlib.evidence import plots
from attnlib.report import runner as report_runner

from test_notebooks import tiny_notebook


def test_a_long_verdict_line_is_refused(tmp_path):
    line = " ".join(["word"] * (report.HEADLINE_WORDS + 1))
    with pytest.raises(ValueError, match="41 words, more than 40"):
        report.save_results(str(tmp_path / "r.json"), "rescales", {}, True, line, {})
    assert not (tmp_path / "r.json").exists()
    # A FAIL is reported whatever its length: cut at 40 words, saying where the rest is.
    report.save_results(str(tmp_path / "r.json"), "rescales", {}, False, line, {})
    cut = json.loads((tmp_path / "r.json").read_text())["verdict"]
    assert report.notebook.words(cut) == report.HEADLINE_WORDS and cut.endswith("(the claims table has the rest)")


def test_a_pass_with_a_claim_not_met_is_refused(tmp_path):
    claims = [report.Claim("errors below the bound", "2e-9", "<= 1e-9", False)]
    with pytest.raises(ValueError, match="errors below the bound"):
        report.save_results(str(tmp_path / "r.json"), "rescales", {}, True, "all good", {}, claims=claims)
    # The same claim under a FAIL (or INFO with a shown claim) is what the data says.
    report.save_results(str(tmp_path / "r.json"), "rescales", {}, False, "errors above the bound", {},
                        claims=claims + [report.Claim("time", "1.0 s")])
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["claims"] == [
        {"claim": "errors below the bound", "measured": "2e-9", "bound": "<= 1e-9", "met": "NO"},
        {"claim": "time", "measured": "1.0 s", "bound": "-", "met": "shown, not gated"}]


def _tiny_with_claims(nb_dir):
    tiny_notebook(nb_dir, "print('SECRET_SOURCE_MARKER' + '_printed')")
    path = Path(nb_dir) / "rescales.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    nb.cells[-1].source = (
        'report.save_results(results_json, "rescales", {"seed": seed, "n": n}, passed=True, line="tiny verdict", '
        'figures={}, claims=[report.Claim("the tiny claim", "3 of 3", "all", True)])')
    nbformat.write(nb, str(path))


def test_the_verdict_and_claims_come_first_and_no_code_is_shown(tmp_path):
    _tiny_with_claims(tmp_path / "notebooks")
    out = tmp_path / "out"
    assert report.run(["rescales"], nb_dir=tmp_path / "notebooks", out_dir=out, log=lambda m: None) == 0
    page = (out / "rescales.html").read_text()
    text = re.sub(r"<[^>]+>", " ", page[page.index("<body"):])
    # The title, then at once the verdict and the claims table.
    title, verdict, claim = (text.index(s) for s in ("A tiny notebook", "tiny verdict", "the tiny claim"))
    assert title < verdict < claim < text.index("SECRET_SOURCE_MARKER_printed")
    assert "PASS" in text[title:verdict]
    # Outputs are shown, the code that made them is not.
    assert "SECRET_SOURCE_MARKER_printed" in text
    assert "SECRET_SOURCE_MARKER' + '_printed" not in page and "report.save_results" not in page
    index = (out / "index.html").read_text()
    assert len(re.findall(r"<li>", index)) == len(report.NOTEBOOKS)
    assert index.count(report.STRICT_TEXT.replace("'", "&#x27;")) == 1  # said once, not per report


def test_long_tables_show_the_worst_rows_and_keep_every_row():
    rows = [{"case": i, "error": float(i % 7) + i / 1000} for i in range(40)]
    page = plots.Table(rows, ["case", "error"], title="errors", worst="error")._repr_html_()
    shown, hidden = page.split("<details>")
    assert "40 rows; the 15 largest by error shown" in shown
    assert shown.count("<tr>") == 16  # the header and 15 rows
    assert "<td style=\"text-align: right\">6.034</td>" in shown  # the largest first
    assert hidden.count("<tr>") == 41  # every row
    short = plots.Table(rows[:15], ["case", "error"])._repr_html_()
    assert "<details>" not in short and short.count("<tr>") == 16


def test_full_runs_go_to_reports_full_and_are_linked_from_the_index(tmp_path, monkeypatch):
    _tiny_with_claims(tmp_path / "notebooks")
    monkeypatch.setattr(report_runner, "ROOT", tmp_path)
    monkeypatch.setattr(report_runner, "REPORTS", tmp_path / "reports")
    monkeypatch.setattr(report_runner, "LOCAL_REPORTS", tmp_path / "reports-local")
    nb = report.NOTEBOOKS["rescales"]
    monkeypatch.setitem(report.NOTEBOOKS, "rescales", report.Notebook(
        nb.title, nb.parameters, nb.quick, nb.dense_runs, nb.costs, full={"n": 512}))
    lines = []
    assert report.run(["rescales"], full=True, nb_dir=tmp_path / "notebooks", log=lines.append) == 0, lines
    data = json.loads((tmp_path / "reports" / "full" / "rescales.json").read_text())
    assert data["params"]["n"] == 512 and data["default_params"] is True  # the full values are its reference
    index = (tmp_path / "reports" / "index.html").read_text()
    assert 'href="full/rescales.html"' in index
    # --quick and --full exclude each other; a full run names only the notebooks with full values.
    assert report.run(["rescales"], full=True, quick=True, log=lines.append) == 2
    real = Path(__file__).resolve().parent.parent / "notebooks"
    assert ([n for n, _, _ in report.plan(full=True, nb_dir=real)]
            == [n for n, b in report.NOTEBOOKS.items() if b.has_full])
