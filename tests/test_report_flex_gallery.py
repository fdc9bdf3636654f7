"""The flex_gallery report's helpers (attnlib.bench.gallery), at tiny sizes."""

import pytest

from attnlib.bench import gallery


def test_run_entry_judges_gradients_by_the_gradient_gate_and_keeps_its_gate():
    entries = gallery.gallery(128, 2)
    gates = {}
    row = gallery.run_entry(entries[0], 128, 2, 16, 64, gates=gates)
    assert row["passed"] and 0 < row["grad_gate_ratio"] <= 1 and row["grad_gate_e"] > 0
    assert row["vs_built_in"] == 0  # the same arithmetic on the same tiles
    assert set(gates) == {entries[0].name}


def test_versus_flex_times_with_spread_and_judges_flex_by_the_gate():
    pytest.importorskip("torch")
    entries = gallery.gallery(128, 2)[:2]
    gates = {}
    for e in entries[:1]:  # one entry with run_entry's gate, one building its own
        gallery.run_entry(e, 128, 2, 16, 64, gates=gates)
    rows = gallery.versus_flex(entries, 128, 2, 16, 64, repeats=5, gates=gates)
    for r in rows:
        assert 0 < r["flex_gate_ratio"] <= 1 and r["vs_flex"] >= 0
        for impl in ("attnlib", "FlexAttention eager"):
            assert 0 < r[f"{impl} min (s)"] <= r[f"{impl} median (s)"] <= r[f"{impl} max (s)"]


def test_the_title_and_the_headline_say_what_was_measured(tmp_path):
    """No "exact" the page does not support: the title names the reference the entries are
    judged against, the headline's tile counts are "= dense count"; FlexAttention's times are
    read by the rule of every timing (slower or faster only by the whole range)."""
    import json
    from pathlib import Path

    import nbformat

    from attnlib import report

    path = Path(__file__).resolve().parent.parent / "notebooks" / "flex_gallery.ipynb"
    title = nbformat.read(str(path), as_version=4).cells[0].source.splitlines()[0]
    assert title == "# " + report.NOTEBOOKS["flex_gallery"].title and "exact" not in title
    assert report.run(["flex_gallery"], quick=True, out_dir=tmp_path, log=lambda m: None) == 0
    data = json.loads((tmp_path / "flex_gallery.json").read_text())
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
