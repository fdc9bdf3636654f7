"""The verdict gate (attnlib.judge.gate), the injected defects and the differential run."""

import numpy as np
import pytest

import attnlib
from attnlib import FAMILIES, Gate, adversarial_qkv, attention, differential_cases, reference_scores
from attnlib.evidence.defects import DEFECTS
from attnlib.judge.gate import U, tolerance
from attnlib.evidence.inputs import DIFFERENTIAL_BLOCKS, longest_row

STRICT = dict(divide="raise", over="raise", invalid="raise")


def _judge(q, k, v, block_k=64, **options):
    gate = Gate(q, k, v, block_k=block_k, **options)
    with np.errstate(**STRICT):
        out, lse = attention(q, k, v, block_q=48, block_k=block_k, return_lse=True, **options)
    return gate, out, lse


OPTIONS = [
    dict(causal=True),
    dict(causal=True, causal_align="top_left"),
    dict(window=(40, 7)),
    dict(causal=True, softcap=5.0),
    dict(alibi_slopes=[0.5, 0.25]),
    dict(kv_lengths=[300, 120]),
    dict(q_segment_ids=np.repeat([[0, 1, 2]], 2, 0).repeat(70, 1)[:, :200],
         kv_segment_ids=np.repeat([[0, 1, 2]], 2, 0).repeat(100, 1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o))
def test_real_kernel_passes_far_below_the_gate(options):
    q, k, v = attnlib.random_qkv(200, 300, 64, batch=(2,), heads=2, kv_heads=1, seed=5)
    gate, out, lse = _judge(q, k, v, **options)
    judged = gate.judge(out, lse)
    assert judged["passed"], judged
    # Correct float64 code sits orders of magnitude under the bound (measured: < 1e-2).
    assert judged["out_ratio"] < 0.05 and judged["lse_ratio"] < 0.05, judged


@pytest.mark.slow
def test_tolerance_is_tight_enough_to_fail_a_1e12_defect():
    # The contract: a real defect of size 1e-12 must fail the gate.  On standard normal
    # inputs at d = 64 the per-row tolerance stays under 1e-12 up to n = 4096.
    q, k, v = attnlib.random_qkv(4096, d=64, seed=0)
    ref, lse = attnlib.reference_attention(q, k, v, causal=True, return_lse=True)
    tol = tolerance(q, k, v, lse, block_k=32, causal=True)
    assert tol.out.max() < 1e-12 and tol.lse.max() < 1e-12
    assert tol.out.min() > 100 * U  # and never below what a handful of roundings make


def test_rows_without_keys_must_be_exactly_empty():
    q, k, v = attnlib.random_qkv(6, 4, 8, seed=1)
    gate, out, lse = _judge(q, k, v, causal=True)  # bottom_right, Sq > Sk: rows 0, 1 see nothing
    assert np.all(gate.tol.out[:2] == 0) and np.all(gate.tol.out[2:] > 0)
    assert gate.judge(out, lse)["passed"]
    bad = out.copy()
    bad[0, 0] = 1e-300
    assert gate.judge(bad, lse)["out_ratio"] == np.inf
    bad_lse = lse.copy()
    bad_lse[1] = -1e300
    assert not gate.judge(out, bad_lse)["passed"]


def test_judge_checks_shapes():
    q, k, v = attnlib.random_qkv(10, 10, 8, seed=1)
    gate, out, lse = _judge(q, k, v)
    with pytest.raises(ValueError, match="shapes"):
        gate.judge(out[:-1], lse)


@pytest.mark.slow
def test_both_implementations_within_their_share_against_the_oracle():
    # The analysis bounds each implementation's own error: checked against long double.
    for q, k, v in (attnlib.random_qkv(512, d=64, seed=2),
                    adversarial_qkv("plateau", 512, d=64, block_k=64, seed=2)):
        gate = Gate(q, k, v, block_k=64, causal=True, oracle=True)
        with np.errstate(**STRICT):
            tiled = attention(q, k, v, causal=True, block_k=64, return_lse=True)
            dense = attnlib.reference_attention(q, k, v, causal=True, return_lse=True)
        for result in (gate.judge(*tiled), gate.judge(*dense)):
            assert result["passed"], result




@pytest.fixture(scope="module")
def causal_problem():
    q, k, v = attnlib.random_qkv(320, d=64, heads=2, seed=11)
    return q, k, v, Gate(q, k, v, block_k=64, causal=True)


def _run(q, k, v, **options):
    with np.errstate(**STRICT):
        return attention(q, k, v, block_q=64, block_k=64, return_lse=True, **(options or dict(causal=True)))


#: The problem options a defect needs to show at all (default: causal).
NEEDS = {"window_edge": dict(causal=True, window=(50, None)),
         "alibi_signed": dict(alibi_slopes=[0.5, 0.25]),
         "softcap_after_mask": dict(causal=True, softcap=5.0),
         "sink_weight_dropped": dict(causal=True, sinks=[0.5, -1.0]),
         "sink_first_tile_unscaled": dict(causal=True, sinks=[-3.0, 1.0])}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_every_defect_fails_the_gate(name, causal_problem):
    if name == "skip_far_tiles":  # shows only where tiles sit far below an attention sink
        q, k, v = adversarial_qkv("sink", 320, d=64, block_k=64, heads=2, seed=11)
        options = dict(causal=True)
    else:
        q, k, v = causal_problem[:3]
        options = NEEDS.get(name, dict(causal=True))
    gate = Gate(q, k, v, block_k=64, **options)
    assert gate.judge(*_run(q, k, v, **options))["passed"]
    with DEFECTS[name].active():
        judged = gate.judge(*_run(q, k, v, **options))
    assert not judged["passed"], (name, judged)
    # ... and the real kernel is back, to the bit.
    assert gate.judge(*_run(q, k, v, **options))["passed"]


def test_defect_restores_the_kernel_after_an_error(causal_problem):
    q, k, v, _ = causal_problem
    before = _run(q, k, v)
    with pytest.raises(RuntimeError):
        with DEFECTS["no_acc_rescale"].active():
            raise RuntimeError("boom")
    after = _run(q, k, v)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])


def test_differential_cases_cross_tiles_at_the_seeds_shape():
    cases = differential_cases(50, seed=0, max_len=4096, d=64)
    assert len(cases) == 50 and {c.d for c in cases} == {64}
    assert (cases[0].sq, cases[0].sk) == (4096, 4096)
    assert cases[1].sq > cases[1].sk and cases[2].sq < cases[2].sk
    for c in cases:
        assert 64 <= min(c.sq, c.sk) and max(c.sq, c.sk) <= 4096
        assert c.block_k in DIFFERENTIAL_BLOCKS and c.block_q in DIFFERENTIAL_BLOCKS
        assert 2 * c.block_k <= longest_row(c.sq, c.sk, c.causal, c.causal_align)
    assert {c.mask_name for c in cases} == {"none", "causal/bottom_right", "causal/top_left"}
    with pytest.raises(ValueError, match="min_len"):
        differential_cases(3, max_len=40)


def test_run_case_and_power_table():
    case = differential_cases(3, seed=4, max_len=256)[2]
    row = attnlib.run_case(case, defects=["lse_1e-12", "off_by_one_mask"])
    assert row["passed"] and row["total_rescales"] >= 1 and 0 < row["crossing_fraction"] <= 1
    power = {p["defect"]: p for p in attnlib.power_table([row], ["lse_1e-12", "off_by_one_mask"])}
    assert power["lse_1e-12"]["caught"] == 1 and power["lse_1e-12"]["verdict"] == "caught"
    assert power["lse_1e-12"]["worst lse_error"] == pytest.approx(1e-12, rel=0.01)
    expect = 1 if case.causal else 0  # an off-by-one causal mask cannot touch an unmasked case
    assert power["off_by_one_mask"]["cases"] == f"{expect}/{expect}" and power["off_by_one_mask"]["judged"] == 1
    assert power["off_by_one_mask"]["caught"] == expect
    grouped = attnlib.power_table({"a": [row], "b": [row, row]}, ["lse_1e-12"])[0]
    assert (grouped["a"], grouped["b"], grouped["caught"]) == ("1/1", "2/2", 3)


@pytest.mark.slow
def test_feature_cases_exercise_every_option_and_pass():
    cases = attnlib.evidence.inputs.feature_cases(16, seed=2, max_len=256)
    labels = {"documents": "documents=", "kv_splits": "kv_splits=", "lazy": "lazy tau="}
    for i, feature in enumerate(attnlib.evidence.inputs.FEATURES):  # case c always has FEATURES[c % 9]
        assert labels.get(feature, feature) in cases[i].features
    for i, label in enumerate(("key_leftpad", "chunk=", "sink tokens=", "qv")):  # case 3 i: VARIANTS[i]
        assert label in cases[3 * i].features
    for case in cases:
        row = attnlib.run_case(case, defects=["window_edge", "alibi_signed", "softcap_after_mask"])
        assert row["passed"], row
        for name, judged in row["defects"].items():
            changed = judged["rel_error"] != row["rel_error"] or judged["lse_error"] != row["lse_error"]
            assert judged["passed"] != changed or judged["rel_error"] < 1e-12, (name, case.features)


def test_sink_family_catches_a_block_sparse_shortcut():
    row = attnlib.run_family("sink", 512, 64, defects=["skip_far_tiles"])
    assert row["passed"] and not row["defects"]["skip_far_tiles"]["passed"], row


def test_accuracy_families_spread_their_weight():
    n, bk = 512, 64
    for name in ("plateau", "ramp", "ties"):
        q, k, v = adversarial_qkv(name, n, d=64, block_k=bk, seed=0)
        s = reference_scores(q, k, causal=True)
        assert FAMILIES[name].purpose == "accuracy"
        visible = s[np.isfinite(s)]
        assert 9_000 < visible.min() and visible.max() < 10_000 + 2 * n / bk + 20
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        # The last row spreads its weight over many keys: no single key dominates.
        assert (p[-1] / p[-1].sum()).max() < 0.2
    ties = reference_scores(*adversarial_qkv("ties", n, d=64, block_k=bk, seed=0)[:2], causal=True)
    last = ties[-1]
    assert np.all(last == last[0])  # every key of the row ties, exactly
    ramp = reference_scores(*adversarial_qkv("ramp", n, d=64, block_k=bk, seed=0)[:2], causal=True)
    tile_max = ramp[-1].reshape(-1, bk).max(axis=-1)
    assert np.all(np.diff(tile_max) > 0)  # the max grows in every tile
    for name in ("first_tile", "last_tile", "growing"):
        assert FAMILIES[name].purpose == "overflow safety"


def _key_by_key(q, k, v, scale):
    """A textbook float64 attention that sums key after key (one query row)."""
    s = scale * (q @ k.T)[0]
    m = s.max()
    p = np.exp(s - m)
    acc, l = np.zeros(v.shape[1]), 0.0
    for j in range(len(p)):
        acc += p[j] * v[j]
        l += p[j]
    return (acc / l)[None], np.array([m + np.log(l)])


@pytest.mark.slow
def test_sequential_sums_on_structured_data_pass():
    # All weights but one just under u: a key-by-key sum stagnates and loses n * u of mass,
    # all with one sign.  The gate counts sequential steps at their worst case (review F1).
    n, gap = 4096, -np.log(0.99 * 2.0 ** -53)
    q = np.array([[1.0]])
    k = np.full((n, 1), -gap / 2)
    k[0, 0] = gap / 2
    v = np.full((n, 2), -0.49)
    v[0] = 1.0
    v[:, 1], v[0, 1] = 0.5, 1.0
    gate = Gate(q, k, v, block_k=1, scale=1.0)
    for out, lse in (_key_by_key(q, k, v, 1.0),
                     attention(q, k, v, block_k=1, scale=1.0, return_lse=True)):
        judged = gate.judge(out, lse)
        assert judged["passed"] and judged["rel_error"] > 100 * U, judged  # a real, large error


def test_subnormal_weights_are_judged_absolutely():
    # Column 0 lives only on keys ~744 below the max: its weights are subnormal, and no
    # float64 code can give it a relative precision (review F2).
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 64))
    q[:, 0] = 8.0
    k = rng.standard_normal((512, 64)) * 1e-3
    k[:256, 0], k[256:, 0] = -744.2 + 0.3 * rng.random(256), 0.0
    v = rng.standard_normal((512, 3))
    v[:256, 0] *= 1e6
    v[256:, 0] = 0.0
    gate, out, lse = _judge(q, k, v, block_k=256)
    judged = gate.judge(out, lse)
    assert 0 < np.abs(gate.ref[:, 0]).max() < attnlib.judge.metrics.TINY  # subnormal outputs
    assert judged["passed"] and judged["rel_error"] < attnlib.BOUND, judged
    bad = out.copy()
    bad[:, 1] *= 1 + 1e-8  # a normal column keeps its relative tolerance (~1e-11 at logits ~744)
    assert not gate.judge(bad, lse)["passed"]


def test_position_form_alibi_passes():
    # s + slope j - slope (i + o) equals -slope |i + o - j| on causal rows (BLOOM's form); its
    # rounding grows with the position, not the distance (review F3).
    n, slope = 4096, 2.0 ** (-8 / 12)
    q, k, v = attnlib.random_qkv(64, n, 32, seed=3)
    gate = Gate(q, k, v, block_k=64, causal=True, window=(128, None), alibi_slopes=[slope])
    s = attnlib.reference_scores(q, k, causal=True, window=(128, None))
    i, j = np.arange(64)[:, None] + (n - 64), np.arange(n)[None, :]
    s = s + slope * j - slope * i
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    judged = gate.judge((p @ v) / l, (m + np.log(l))[:, 0])
    assert judged["passed"], judged


def test_sink_cases_draw_no_qv():
    """The gradients report's sink problems stay within the head dims its defects are sized for."""
    cases = attnlib.evidence.inputs.sink_cases(24, seed=0, max_len=256)
    assert all(c.sinks is not None and not c.qv for c in cases)
    assert any(c.qv for c in attnlib.evidence.inputs.feature_cases(24, seed=0, max_len=256))


def test_sink_cases_are_no_problem_of_the_feature_run():
    """The equivalence and gradients reports run both: a sink problem equal to a feature one
    would count twice."""
    features = attnlib.feature_cases(24, seed=0, max_len=256)
    assert not set(attnlib.evidence.inputs.sink_cases(24, seed=0, max_len=256)) & set(features)
