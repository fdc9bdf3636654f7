"""Failures get a cause (issue 23): gradients, the LSE, mask_mods and a softcap after masking.

Before, LSE and gradient failures had no diagnosis, bugs in a mask_mod ended in "no known cause
matched", and a softcap applied after masking was told it "passes judged as bfloat16"."""

import ml_dtypes  # the test extra installs it
import numpy as np
import pytest

import attnlib
from attnlib import check
from attnlib.check import power

SHAPE = (1, 4, 2, 96, 96, 32, True)  # batch, Hq, Hk, Sq, Sk, D, causal
WANT = {
    "all-zero gradients": "is all zeros",
    "dq without the softmax scale": "dq is missing the softmax scale",
    "gradients with the sign flipped": "has the wrong sign",
    "gradients of the non-causal problem": "matches the gradient of attention with no causal mask",
    "dv of the wrong kv head": "dv of kv head 0 holds kv head 1's gradient",
    "lse in base 2": "the lse is in base 2",
    "lse of the next query row": "each row holds the next query row's lse",
}


def notes(result):
    verdicts = ([result.lse] if result.lse else []) + list(result.grads.values())
    return [n for v in verdicts if v.passed is False for n in v.notes]


@pytest.mark.slow
@pytest.mark.parametrize("prec", ["float32", "bfloat16"])
def test_wrong_gradients_and_lse_are_named(prec):
    q, k, v, dout, causal = power.problem(SHAPE, prec, 1e-3)
    kernels = power.wrong_kernels(SHAPE, prec)
    scaled = next(name for name in kernels if name.startswith("gradients x"))
    for name, (judged, fn) in kernels.items():
        if judged == "out":
            continue
        t = fn(q, k, v, dout, causal)
        grads = {g: t.get(g) for g in ("dq", "dk", "dv")} if judged == "grads" else {}
        r = check.check_kernel(q, k, v, t["out"], lse=t.get("lse"), dout=dout if grads else None,
                               layout="bhsd", causal=True, dtype=prec, **grads)
        found = notes(r)
        want = "is the right gradient times 1.0" if name == scaled else WANT[name]
        assert any(want in n for n in found), (name, found)


def test_an_lse_without_its_sink_is_named():
    q, k, v, _, _ = power.problem(SHAPE, "float32", 1.0)
    sinks = np.array([1.0, 2.0, -0.5, 3.0])
    out = attnlib.attention(q, k, v, causal=True, sinks=sinks, compute_dtype="float32").astype(np.float64)
    _, lse = attnlib.attention(q, k, v, causal=True, return_lse=True)  # the sink left out
    r = check.check_kernel(q, k, v, out, lse=lse, layout="bhsd", causal=True, sinks=sinks, dtype="float32")
    assert r.lse.passed is False
    assert any("the lse excludes the sink (FlashMLA's convention" in n for n in r.lse.notes), r.lse.notes


DOC = np.repeat(np.arange(4), 32)


@pytest.mark.parametrize("right, wrong, want", [
    (lambda b, h, i, j: j <= i, lambda b, h, i, j: j <= i + 1, "mask_mod at kv_idx - 1"),
    (lambda b, h, i, j: (j <= i) & (j >= i - 16), lambda b, h, i, j: (j <= i) & (j >= i - 15),
     "one key narrower on the left"),
    (lambda b, h, i, j: DOC[i] == DOC[j], lambda b, h, i, j: DOC[i] == DOC[np.clip(j - 1, 0, 127)],
     "mask_mod at kv_idx - 1"),
], ids=["off by one", "window one key narrow", "document ids shifted"])
@pytest.mark.slow
def test_mask_mod_bugs_are_named_by_their_neighbour(right, wrong, want):
    q, k, v = (x.astype(np.float32).astype(np.float64)
               for x in attnlib.random_qkv(128, d=32, batch=(1,), heads=2, seed=0))
    out = attnlib.attention(q, k, v, mask_mod=wrong, compute_dtype="float32").astype(np.float64)
    r = check.check_kernel(q, k, v, out, layout="bhsd", mask_mod=right, dtype="float32")
    assert not r.passed and want in r.diagnosis[0], r.diagnosis


@pytest.mark.slow
def test_a_softcap_after_masking_is_named_not_a_lower_precision():
    from attnlib.check.diagnosis import _softcap_after_mask
    from attnlib.core.options import Options

    q, k, v = (x.astype(np.float32).astype(np.float64)
               for x in attnlib.random_qkv(128, d=32, batch=(1,), heads=2, seed=1))
    options = Options.parse(causal=True, softcap=2.0)
    out = attnlib.attention(q, k, v, softcap=2.0, compute_dtype="float32",
                            **_softcap_after_mask(options, dict(sq=128, sk=128))).astype(np.float64)
    r = check.check_kernel(q, k, v, out, layout="bhsd", causal=True, softcap=2.0, dtype="float32")
    assert not r.passed
    assert r.diagnosis[0].endswith("the softcap applied after masking (masked pairs get -softcap, not -inf)")
    assert not any("judged as a" in d for d in r.diagnosis)


def test_one_gradient_rounded_to_a_lower_precision_is_named():
    q, k, v, dout, causal = power.problem(SHAPE, "float32", 1.0)
    right = power.correct_kernels(SHAPE, "float32")["float64 answer rounded once"](q, k, v, dout, causal)
    dv = right["dv"].astype(ml_dtypes.bfloat16).astype(np.float64)  # dv kept in bfloat16
    r = check.check_kernel(q, k, v, right["out"], dout=dout, dq=right["dq"], dk=right["dk"], dv=dv,
                           layout="bhsd", causal=True, dtype="float32")
    assert r.grads["dq"].passed and r.grads["dk"].passed and r.grads["dv"].passed is False
    assert any("dv is the right gradient to within bfloat16's rounding" in n for n in r.grads["dv"].notes), \
        r.grads["dv"].notes


def test_a_whole_explanation_leaves_out_the_partial_ones():
    import ml_dtypes
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in attnlib.random_qkv(512, 512, 64, heads=4, batch=(1,), seed=0))
    # The mask forgotten; before, 71%, 68% and 67% of the failing rows also 'matched' three other problems.
    wrong = attnlib.attention(q, k, v, compute_dtype="bfloat16").astype(ml_dtypes.bfloat16)
    diagnosis = attnlib.check.check_kernel(q, k, v, wrong, layout="bhsd", causal=True).diagnosis
    assert diagnosis == ["the output matches attention with no causal mask"]
