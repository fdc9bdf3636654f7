"""The rescales report as a reader gets it, from a quick run: what its words count comes
from its data."""

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
    out = tmp_path_factory.mktemp("rescales")
    assert report.run(["rescales"], quick=True, out_dir=out, log=lambda m: None) == 0
    return json.loads((out / "rescales.json").read_text()), _text((out / "rescales.html").read_text())


def test_the_families_are_counted_from_the_data(quick):
    data, text = quick
    families = data["figures"]["families"]
    assert len(families) == 8
    assert f"the {len(families)} adversarial families" in text
    assert not re.search(r"\b(two|three|four|five|six|seven|eight) adversarial families", text)
    for name, total in families.items():
        assert f"{name} {total:,}" in text


def test_the_key_figure_is_short_and_from_the_data(quick):
    data, _ = quick
    assert data["key"] == f"counts equal the dense recount in all {(256 // 32) ** 2:,} tiles"
    assert report.notebook.words(data["key"]) <= report.KEY_WORDS
