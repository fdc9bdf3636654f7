"""check_rule's report: the rule's own baseline apart, and one reference per problem."""

import contextlib

import numpy as np

from attnlib.check import calibration, memo, mixups, power


def test_the_rules_own_baseline_is_shown_apart_and_not_counted():
    shape = (1, 2, 32, 32, 16, True)
    rows = calibration.measure("float32", shapes=[shape], seeds=range(1))
    base = [r for r in rows if r["kind"] == "baseline"]
    assert [r["kernel"] for r in base] == ["dense, same precision"]
    assert max(base[0]["worst_out_ratio"], base[0]["worst_lse_ratio"]) <= 0.5 + 1e-6  # by construction
    s = calibration.summary(rows)["float32"]
    correct = [r for r in rows if r["kind"] == "correct"]
    assert s["correct_runs"] == sum(r["seeds"] for r in correct) and s["baseline_runs"] == 1
    assert s["worst_ratio"] == max(max(r["worst_out_ratio"], r["worst_lse_ratio"] or 0.0) for r in correct)
    assert all(r["least_out_ratio"] <= r["worst_out_ratio"] for r in rows)
    # In float64 the allowance is the gate's rounding bound, not the dense kernel: it counts there.
    rows64 = calibration.measure("float64", shapes=[shape], seeds=range(1), defects=False)
    assert not any(r["kind"] == "baseline" for r in rows64)
    assert any(r["kernel"] == "dense, same precision" and r["kind"] == "correct" for r in rows64)


def _without_memo(monkeypatch):
    monkeypatch.setattr(memo, "shared", lambda *extra: contextlib.nullcontext({}))


def test_one_reference_per_problem_changes_no_bit(monkeypatch):
    shape = (1, 2, 2, 16, 16, 16, True)
    with_memo = power.measure(precisions=("float16",), magnitudes=(1e-4,), shapes=(shape,))
    mix = mixups.measure(precisions=("float32",), magnitudes=(1.0,), seeds=(0,))
    _without_memo(monkeypatch)
    assert power.measure(precisions=("float16",), magnitudes=(1e-4,), shapes=(shape,)) == with_memo
    assert mixups.measure(precisions=("float32",), magnitudes=(1.0,), seeds=(0,)) == mix


def test_memo_keys_by_value_copies_results_and_passes_functions_through():
    import types

    calls = []

    def f(x, opts=None):
        calls.append(1)
        return x * 2

    module = types.SimpleNamespace(f=f)
    x = np.arange(6.0)
    with memo.shared((module, "f")) as stats:
        a = module.f(x)
        a[0] = 99.0  # a caller writing into its result
        b = module.f(x.copy())  # equal values, another array: reused
        x[1] = 5.0  # the same array changed in place: computed again
        c = module.f(x)
        module.f(x, opts=lambda: 0)  # a function argument: no key, run as is
    assert b[0] == 0.0 and c[1] == 10.0 and len(calls) == 3
    assert stats == {"computed": 2, "reused": 1, "uncached": 1}
    assert module.f is f
