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

