"""The gradient gate (issue 23): a per-entry float64 rounding bound on the backward, with power.

The gradients report judged the tiled backward at the contract's 1e-9 only, so a 3e-12
relative defect in its matmuls passed.  `GradientGate` bounds two correct float64 backward
passes by ``2 e_g (|ref| + rss)``; each injected backward defect must fail it."""

import numpy as np
import pytest

import attnlib
from attnlib.core.backward import attention_backward
from attnlib.evidence.defects import BACKWARD_DEFECTS
from attnlib.judge.gate import GradientGate

OPTIONS = [
    dict(),
    dict(causal=True),
    dict(causal=True, window=(40, 0), sinks=np.array([0.5, -1.0, 2.0, 0.0])),
    dict(softcap=5.0, causal=True),
    dict(alibi_slopes=2.0 ** -np.arange(1, 5), kv_lengths=[150, 0], q_lengths=[100, 130]),
    dict(mask_mod=lambda b, h, i, j: (i // 37) == (j // 37)),
]


def problem(seed=0, sq=130, sk=150):
    q, k, v = attnlib.random_qkv(sq, sk, 32, batch=(2,), heads=4, kv_heads=2, seed=seed)
    dout = np.random.default_rng(seed + 1).standard_normal((2, 4, sq, 32))
    return q, k, v, dout


def tiled(q, k, v, dout, **options):
    out, lse = attnlib.attention(q, k, v, return_lse=True, **options)
    return attention_backward(q, k, v, out, lse, dout, block_q=32, block_k=48, **options)


@pytest.mark.slow
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_the_tiled_backward_passes_far_inside(options, strict):
    q, k, v, dout = problem()
    gate = GradientGate(q, k, v, dout, **options)
    verdict = gate.judge(tiled(q, k, v, dout, **options))
    assert verdict["passed"], verdict
    assert max(verdict[f"{n}_ratio"] for n in gate.names) < 0.05, verdict


# Every defect on a causal problem and on one with a window and sinks (dsinks: that one only).
DEFECT_CASES = [(name, options) for name in BACKWARD_DEFECTS for options in OPTIONS[1:3]
                if name != "dsinks_sign" or "sinks" in options]


@pytest.mark.slow
@pytest.mark.parametrize("name, options", DEFECT_CASES, ids=[f"{n}-{','.join(o)}" for n, o in DEFECT_CASES])
def test_every_backward_defect_fails(name, options, strict):
    q, k, v, dout = problem(seed=3)
    gate = GradientGate(q, k, v, dout, **options)
    with BACKWARD_DEFECTS[name].active():
        bad = tiled(q, k, v, dout, **options)
    assert not gate.judge(bad)["passed"]


def test_a_3e_12_matmul_error_fails_where_1e_9_passed():
    q, k, v, dout = problem(seed=4)
    with BACKWARD_DEFECTS["bwd_matmul_3e-12"].active():
        bad = tiled(q, k, v, dout, causal=True)
    errors = attnlib.gradient_errors(bad, q, k, v, dout, causal=True)
    assert max(errors["dq"], errors["dk"], errors["dv"]) < attnlib.BOUND  # the contract's 1e-9 passes it
    assert not GradientGate(q, k, v, dout, causal=True).judge(bad)["passed"]


def test_the_hook_is_off_outside_a_defect():
    q, k, v, dout = problem(seed=5)
    before = tiled(q, k, v, dout, causal=True)
    with BACKWARD_DEFECTS["ds_1e-11"].active():
        tiled(q, k, v, dout, causal=True)
    after = tiled(q, k, v, dout, causal=True)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_logits_of_1e4_state_the_bound_instead_of_claiming_a_1e_12_catch():
    """At logits of 1e4 float64's own exponent error is ~1e4 u per score: the bound says so
    (e_g ~ 3e-10), and the real backward sits far inside it."""
    q, k, v = attnlib.adversarial_qkv("plateau", 512, d=64, block_k=64, seed=0)
    dout = np.random.default_rng(1).standard_normal((512, 64))
    gate = GradientGate(q, k, v, dout, causal=True)
    assert gate.e > 1e-11
    out, lse = attnlib.attention(q, k, v, return_lse=True, causal=True)
    verdict = gate.judge(attention_backward(q, k, v, out, lse, dout, block_q=64, block_k=64, causal=True))
    assert verdict["passed"] and max(verdict["dq_ratio"], verdict["dk_ratio"], verdict["dv_ratio"]) < 0.01


def test_judge_refuses_wrong_shapes_and_counts():
    q, k, v, dout = problem(seed=6, sq=20, sk=30)
    gate = GradientGate(q, k, v, dout)
    grads = tiled(q, k, v, dout)
    with pytest.raises(ValueError, match="3 arrays"):
        gate.judge(grads[:2])
    with pytest.raises(ValueError, match="dk must have"):
        gate.judge((grads[0], grads[1][:, :1], grads[2]))
    nan = grads[0].copy()
    nan[0, 0, 0, 0] = np.nan
    assert gate.judge((nan, grads[1], grads[2]))["dq_ratio"] == np.inf
