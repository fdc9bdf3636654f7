"""The mix-ups of the 2026 conventions and variants fail and are named (`attnlib.check.mixups`),
and a correct kernel of each problem passes (so the failures are the mix-ups')."""

import numpy as np

import pytest

from attnlib.check import check_kernel, mixups

pytest.importorskip("ml_dtypes")


@pytest.mark.slow
@pytest.mark.parametrize("prec", ["float32", "float8_e4m3fn"])
def test_every_mixup_fails_and_is_named(prec):
    rows = mixups.measure(precisions=(prec,), magnitudes=(1e-2, 1e2), seeds=(0,))
    assert rows and all(r["failed"] and r["named"] for r in rows), [r for r in rows if not r["named"]]
    assert all(t["hit_rate"] == 1.0 for t in mixups.hit_rates(rows))


@pytest.mark.slow
def test_the_right_answer_to_each_mixups_problem_passes():
    """The problems as told, answered right: no mix-up, no failure (`mixups.right_answers`)."""
    rows = mixups.right_answers(precisions=("float32", "float8_e4m3fn"), magnitudes=(1.0,), seeds=(0,))
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    problems = {r["problem"] for r in rows}
    assert {"dlse ignored", "NSA gates swapped (compressed <-> window)", "a KV source left out",
            "block lists read transposed", "dropout without 1 / (1 - p)"} <= problems