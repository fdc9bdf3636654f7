"""The numerics report's study functions (attnlib.evidence.numerics), at tiny sizes."""

import numpy as np

from attnlib.evidence import numerics


def test_lazy_rescaling_is_judged_by_the_rule_of_its_precision():
    rows = numerics.lazy_rescaling([0, 8], ["float64", "float32"], n=128, families=("last_tile",), seed=0)
    assert {(r["inputs"], r["dtype"]) for r in rows} == {(i, dt) for i in ("random", "last_tile")
                                                          for dt in ("float64", "float32")}
    for r in rows:
        if r["dtype"] == "float64":  # the verdict gate against the oracle
            assert r["rule_ratio"] is None and 0 < r["gate_ratio"] <= 1
        else:  # FlashAttention's rule against naive float32
            # Against the oracle of the rounded inputs: out exact where the softmax is one-hot, the lse judged.
            eps = numerics.LOW_EPS["float32"]
            assert r["gate_ratio"] is None and (r["naive_error"] > 0) == (r["inputs"] == "random")
            assert r["naive_lse_error"] > 0 and r["lse_ratio"] > 0
            assert np.isclose(r["out_ratio"], r["error"] / (2 * r["naive_error"] + eps))
            assert np.isclose(r["lse_ratio"], r["lse_error"] / (2 * r["naive_lse_error"] + eps))
            assert r["rule_ratio"] == max(r["out_ratio"], r["lse_ratio"]) <= 1
    eager = {(r["inputs"], r["dtype"]): r["rescales"] for r in rows if r["tau"] == 0}
    assert all(r["rescales"] <= eager[(r["inputs"], r["dtype"])] for r in rows)


def test_precision_rows_at_precision_n_are_what_the_n_study_would_compute():
    # The notebook reuses the tile study's rows at precision_n for the study over n.
    a = numerics.precision_vs_oracle([128], [32, 64], [1], ["float32"], seed=0)
    b = numerics.precision_vs_oracle([128], [64], [1], ["float32"], seed=0)
    assert [r for r in a if r["block"] == 64] == b
