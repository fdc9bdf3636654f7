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
        {"claim": "errors below the bound", "measured": "2e-9", "bound": "<= 1e-9", "met": "NO", "page": True, "detail": False},
        {"claim": "time", "measured": "1.0 s", "bound": "-", "met": "shown, not gated", "page": True, "detail": False}]
    # Nor can a gated claim whose spread crosses its bound: it is not met either.
    unresolved = [report.Claim("time at most 1 s", "0.9 (0.8-1.2) s", "<= 1 s", report.UNRESOLVED)]
    with pytest.raises(ValueError, match="time at most 1 s"):
        report.save_results(str(tmp_path / "r.json"), "rescales", {}, True, "all good", {}, claims=unresolved)


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


def test_one_rule_for_every_measured_spread():
    """A claim against a bound is met when its whole spread meets it, missed when its whole
    spread misses it, and not resolved when the spread crosses it; a ratio of times is
    "slower" or "faster" only when its whole spread is on one side of 1."""
    s = lambda lo, med, hi: {"min": lo, "median": med, "max": hi, "n": 5}
    assert report.against(s(0.80, 0.82, 1.00), 1.0) is True
    assert report.against(s(0.80, 0.82, 1.01), 1.0) == report.UNRESOLVED  # met at the median only
    assert report.against(s(0.96, 1.63, 1.73), 1.0) == report.UNRESOLVED  # missed at the median only
    assert report.against(s(1.05, 1.34, 1.43), 1.0) is False
    assert report.against(s(0.61, 0.71, 0.76), 0.75, at_most=False) == report.UNRESOLVED
    assert report.against(s(0.59, 0.65, 0.69), 0.75, at_most=False) is False
    assert report.against(s(12.6, 14.7, 15.3), 20, at_most=False) is False
    assert report.compare(s(1.05, 1.34, 1.43)) == "slower"
    assert report.compare(s(0.76, 0.84, 0.86)) == "faster"
    assert report.compare(s(0.96, 1.63, 1.73)) == "within noise"
    assert report.compare(s(0.80, 0.82, 1.00)) == "within noise"
    # Unpaired spreads: the widest ratio they allow.
    r = report.ratio_range(s(2.0, 2.5, 3.0), s(1.0, 1.2, 1.5))
    assert (r["min"], r["max"]) == (2.0 / 1.5, 3.0 / 1.0) and report.compare(r) == "slower"
    # The claim: gated, its met is the rule's; the crossing is said in the measured column.
    c = report.timing_claim("attnlib / torch", s(0.80, 0.82, 1.01), 1.0)
    assert c.met == report.UNRESOLVED and "crosses the bound" in c.measured and c.row()["met"] == "not resolved"
    assert c.measured.startswith("0.82× (0.80–1.01×)")
    c = report.timing_claim("efficiency", s(0.64, 0.70, 0.81), 0.80, at_most=False, gated=False, unit="")
    assert c.met is None and "target not resolved" in c.measured and "not gated" in c.bound
    assert report.timing_claim("t", s(1, 2, 3)).met is None
    # The digits put each end on its side of the bound and, for a ratio, of 1 (1.003 is not "1.00").
    assert report.spread_text(s(0.79, 0.94, 1.003)) == "0.940× (0.790–1.003×)"
    assert report.spread_text(s(0.79, 0.94, 0.9999)) == "0.9400× (0.7900–0.9999×)"
    assert report.timing_claim("t", s(2.3, 2.49, 2.4999), 2.5).measured.startswith("2.4900× (2.3000–2.4999×)")
    assert report.spread_text(s(0.7979, 0.81, 0.9), ".2f", "", bound=0.80) == "0.810 (0.798–0.900)"
    assert report.decided_format([0.7979, 0.81, 0.9], 0.80) == ".3f"
    assert report.decided_format([0.2499, 0.1, 0.2], 0.25, percent=True) == ".2%"
    assert report.combined([True, None, True]) is True
    assert report.combined([True, report.UNRESOLVED]) == report.UNRESOLVED
    assert report.combined([report.UNRESOLVED, False]) is False and report.combined([None]) is None
    with pytest.raises(ValueError):
        report.Claim("x", "1", "", "maybe")


def test_the_claims_table_under_the_verdict_is_short(tmp_path):
    """At most CLAIMS_SHOWN claims on the page: the details of a claim that sums them up,
    and then the claims only shown, go to a collapsed section; gated claims and misses stay."""
    from attnlib.report.render import verdict_block

    gated = [report.Claim(f"gated {i}", "1", "1", True) for i in range(5)]
    details = [report.Claim(f"case {i}", "1", "1", True, detail=True) for i in range(30)]
    shown = [report.Claim(f"shown {i}", "1") for i in range(20)]
    miss = [report.Claim("missed", "2", "1", False)]
    claims = gated + details + shown + miss
    page = report.on_page(claims)
    assert sum(page) == report.CLAIMS_SHOWN
    assert all(page[:5]) and not any(page[5:35]) and page[-1]  # gated and the miss stay, details go
    report.save_results(str(tmp_path / "r.json"), "rescales", {}, None, "measured", {}, claims=claims)
    data = json.loads((tmp_path / "r.json").read_text())
    assert [c["page"] for c in data["claims"]] == page
    block = verdict_block(data, "rescales")
    # One time on the page and in the JSON: when the run finished (save_results stamps it).
    assert f"Run finished {data['environment'][report.notebook.FINISHED]} UTC" in block
    assert "date (UTC)" not in data["environment"]
    on_page, collapsed = block.split("<details>")
    assert on_page.count("<tr>") == 1 + report.CLAIMS_SHOWN
    assert collapsed.count("<tr>") == 1 + len(claims) - report.CLAIMS_SHOWN
    assert "30 summed up by the claims above" in collapsed and "11 only shown" in collapsed
    # A PASS whose gated claims cannot fit is the notebook's bug: it must sum them up.
    many = [report.Claim(f"gated {i}", "1", "1", True) for i in range(report.CLAIMS_SHOWN + 1)]
    with pytest.raises(ValueError, match="sum some up"):
        report.save_results(str(tmp_path / "s.json"), "rescales", {}, True, "fine", {}, claims=many)


def test_the_index_line_is_short_and_the_parameters_shown_once(tmp_path):
    _tiny_with_claims(tmp_path / "notebooks")
    path = tmp_path / "notebooks" / "rescales.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    nb.cells[-1].source = nb.cells[-1].source.replace("claims=[", 'key="3 of 3 tiny claims", claims=[')
    nb.cells[-1].source = nb.cells[-1].source.replace(
        'line="tiny verdict"', 'line="tiny verdict " + "with many more words " * 6')
    nbformat.write(nb, str(path))
    out = tmp_path / "out"
    assert report.run(["rescales"], nb_dir=tmp_path / "notebooks", out_dir=out, log=lambda m: None) == 0
    index = (out / "index.html").read_text()
    item = next(i for i in re.findall(r"<li>(.*?)</li>", index, flags=re.S) if "rescales.html" in i)
    visible = " ".join(re.sub(r"<[^>]+>", " ", item).split())
    assert "3 of 3 tiny claims" in visible and "with many more words" not in visible
    assert len(visible.split()) <= 20, visible
    assert "with many more words" in item  # the whole verdict line is on the link, on hover
    with pytest.raises(ValueError, match="key figure"):
        report.save_results("", "rescales", {}, True, "fine", {}, key=" ".join(["w"] * (report.KEY_WORDS + 1)))
    # A report without a key figure (written before them) gives its verdict's first words.
    from attnlib.report.render import key_figure
    assert key_figure({"verdict": "one two three"}) == "one two three"
    assert key_figure({"verdict": " ".join(map(str, range(30)))}).endswith("7 ...")
    # A parameters table longer than SHOWN rows: its summary line, then every row once.
    params = {f"p{i}": i for i in range(plots.SHOWN + 5)}
    page = report.provenance(params)._repr_html_()
    assert page.count("<details>") == 1 and page.count(">p0<") == 1 and page.count(">p19<") == 1
    shown, hidden = page.split("<details>")
    assert "20 parameters and 7 entries of the environment" in shown and "<tr>" not in shown
    assert "date (UTC)" not in page and "finished is under the verdict" in shown  # the page's one time: the end


def test_no_title_says_exact():
    """A title's word is a claim the page must support: none says "exact" (the pages show
    errors within a gate, bits equal to a built-in, samples of a long run), and each notebook's
    title is the one the index links."""
    nb_dir = Path(__file__).resolve().parent.parent / "notebooks"
    for name, nb in report.NOTEBOOKS.items():
        first = nbformat.read(str(nb_dir / f"{name}.ipynb"), as_version=4).cells[0].source.splitlines()[0]
        assert first == f"# {nb.title}" and "exact" not in nb.title.lower(), (name, first)
