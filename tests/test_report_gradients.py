"""The gradients report as a reader gets it, from a quick run: the headline counts the
problems the gradient gate judged, which are all of them (varlen packing included)."""

import json
import re

import numpy as np
import pytest

from attnlib import report
from attnlib.evidence import differential, inputs
from attnlib.evidence.defects import BACKWARD_DEFECTS


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("gradients")
    assert report.run(["gradients"], quick=True, out_dir=out, log=lambda m: None) == 0
    return json.loads((out / "gradients.json").read_text())


def test_varlen_gradients_are_judged_by_the_gradient_gate():
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        case = inputs.varlen_cases(1, seed=0, max_len=128)[0]
        row = differential.run_varlen_gradients(case, seed=0, defects=[BACKWARD_DEFECTS["bwd_matmul_3e-12"]])
    assert row["gate_passed"] and 0 < row["gate_ratio"] < 0.1 and row["gate_e"] > 0
    assert row["defects_caught"] == {"bwd_matmul_3e-12": True}  # the same gate fails a real defect


def test_the_headline_counts_the_problems_the_gate_judged(quick):
    figs = quick["figures"]
    problems = len(figs["cases"]) + len(figs["sinks"]) + len(figs["varlen"]) + len(figs["adversarial"])
    assert figs["problems"] == problems and figs["gated_problems"] == problems
    assert all("gate_ratio" in r and r["gate_passed"] for r in figs["varlen"])
    said = re.match(r"all (\d+) problems' gradients within 1e-09 and the gradient gate", quick["verdict"])
    assert said and int(said.group(1)) == figs["gated_problems"], quick["verdict"]
    gate = next(c for c in quick["claims"] if c["claim"].startswith("every problem within the gradient gate"))
    assert gate["measured"].startswith(f"{problems}/{problems};") and gate["met"] == "yes"
    assert quick["key"].startswith(f"{problems}/{problems} problems within the gradient gate")


def test_the_claims_table_sums_up_the_defects_per_family(quick):
    page = [c for c in quick["claims"] if c["page"]]
    assert len(page) <= report.CLAIMS_SHOWN
    families = [c for c in page if c["claim"].startswith("injected defects caught on the")]
    assert len(families) == 4 and any("varlen" in c["claim"] for c in families)
    # Every (defect, family) row is kept, under the table; each is named in its family's row.
    details = [c for c in quick["claims"] if not c["page"]]
    for p in quick["figures"]["defect_power"]:
        assert any(c["claim"] == f"{p['defect']} caught on the {p['problems']} it changes" for c in details)
        row = next(c for c in families if c["claim"].startswith(f"injected defects caught on the {p['problems']}"))
        assert f"{p['defect']} {p['caught']}/{p['of']}" in row["measured"]
