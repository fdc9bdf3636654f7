"""The gradients report judges varlen packing by the gradient gate too (its quick run's pages:
tests/test_notebooks.py)."""

import numpy as np

from attnlib.evidence import differential, inputs
from attnlib.evidence.defects import BACKWARD_DEFECTS


def test_varlen_gradients_are_judged_by_the_gradient_gate():
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        case = inputs.varlen_cases(1, seed=0, max_len=128)[0]
        row = differential.run_varlen_gradients(case, seed=0, defects=[BACKWARD_DEFECTS["bwd_matmul_3e-12"]])
    assert row["gate_passed"] and 0 < row["gate_ratio"] < 0.1 and row["gate_e"] > 0
    assert row["defects_caught"] == {"bwd_matmul_3e-12": True}  # the same gate fails a real defect
