"""The memory report as a reader gets it, from a quick run: the verdict section promises only
what the page shows."""

import html
import json
import re

import pytest

from attnlib import report


def _text(page: str) -> str:
    body = page[page.index("<body"):]
    body = re.sub(r"<(style|script)\b.*?</\1>", " ", body, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    assert report.run(["memory"], quick=True, out_dir=out, log=lambda m: None) == 0
    return json.loads((out / "memory.json").read_text()), _text((out / "memory.html").read_text())


def test_the_verdict_section_promises_what_the_page_shows(quick):
    data, text = quick
    section = text[text.rindex("Verdict"):]
    # The ungated figures are said to be in the claims table, and they are; the line states
    # only what is gated.
    assert "stated in the verdict" not in section and "in the claims table" in section
    shown = {c["claim"]: c for c in data["claims"] if c["met"] == "shown, not gated"}
    assert any(c.startswith("tiled traced peak incl.") for c in shown)
    assert any("file-backed RSS" in c for c in shown)
    for claim in shown.values():
        assert claim["page"]
    gated = [c for c in data["claims"] if c["met"] == "yes"]
    assert len(gated) >= 5 and report.notebook.words(data["key"]) <= report.KEY_WORDS
