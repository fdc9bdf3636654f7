"""The committed reports (`make report` into reports/) as a reader gets them: each one's
verdict in at most 40 words and first on the page, its claims table under it, no code, and
the index one line per report linking the full runs of reports/full/."""

import html
import json
import re
from pathlib import Path

import pytest

from attnlib import report

REPORTS = Path(__file__).resolve().parent.parent / "reports"
NAMES = [n for n in report.NOTEBOOKS if (REPORTS / f"{n}.json").exists()]


def _text(page: str) -> str:
    body = page[page.index("<body"):]
    body = re.sub(r"<(style|script)\b.*?</\1>", " ", body, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


def test_every_notebook_has_a_committed_report():
    assert NAMES == list(report.NOTEBOOKS)


@pytest.mark.parametrize("name", NAMES)
def test_the_verdict_reads_first_and_no_code_is_shown(name):
    data = json.loads((REPORTS / f"{name}.json").read_text())
    assert report.notebook.words(data["verdict"]) <= report.HEADLINE_WORDS
    assert data["default_params"] is True and data["claims"], name
    assert data["passed"] is not False, f"{name}: the committed report FAILS: {data['verdict']}"
    text = _text((REPORTS / f"{name}.html").read_text())
    title = report.NOTEBOOKS[name].title
    verdict = " ".join(data["verdict"].split())
    # The title, then the verdict and the claims table before the run's parameters.
    assert text.index(title.split(":")[0]) < text.index(verdict) < text.index("Parameters and environment")
    assert text.index(data["claims"][0]["claim"]) < text.index("Parameters and environment")
    # No code cell's source is on the page: the setup cell every notebook has is absent.
    assert "report.check_params(" not in text and "report.save_results(" not in text


def test_the_index_is_one_line_per_report_and_links_the_full_runs():
    index = (REPORTS / "index.html").read_text()
    items = re.findall(r"<li>(.*?)</li>", index, flags=re.S)
    assert len(items) == len(report.NOTEBOOKS)
    for name, item in zip(report.NOTEBOOKS, items):
        assert f'href="{name}.html"' in item
        if (REPORTS / "full" / f"{name}.json").exists():
            assert f'href="full/{name}.html"' in item
    assert index.count("np.errstate") == 1
