"""Property tests: any valid shapes, tiles and flags agree with the reference."""

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnlib import Gate, attention, reference_attention

problems = st.fixed_dictionaries({
    "batch": st.lists(st.integers(1, 2), max_size=2).map(tuple),
    "hk": st.integers(1, 3),
    "group": st.integers(1, 3),
    "sq": st.integers(0, 70),
    "sk": st.integers(0, 70),
    "d": st.integers(1, 9),
    "dv": st.integers(1, 9),
    "causal": st.booleans(),
    "align": st.sampled_from(["bottom_right", "top_left"]),
    "block_q": st.integers(1, 80),
    "block_k": st.integers(1, 80),
    "logit_scale": st.sampled_from([1.0, 30.0, 1e3]),
    "seed": st.integers(0, 2**32 - 1),
    "window": st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 40)),
                                             st.one_of(st.none(), st.integers(0, 40)))),
    "padding": st.booleans(),
    "segments": st.booleans(),
    "softcap": st.sampled_from([None, 5.0, 50.0]),
    "alibi": st.booleans(),
    "kv_splits": st.integers(1, 4),
})


def make(p):
    rng = np.random.default_rng(p["seed"])
    hq = p["hk"] * p["group"]
    q = rng.standard_normal(p["batch"] + (hq, p["sq"], p["d"])) * np.sqrt(p["logit_scale"])
    k = rng.standard_normal(p["batch"] + (p["hk"], p["sk"], p["d"])) * np.sqrt(p["logit_scale"])
    v = rng.standard_normal(p["batch"] + (p["hk"], p["sk"], p["dv"]))
    return q, k, v


def options(p):
    """The masking and score options of a drawn problem."""
    rng = np.random.default_rng(p["seed"] + 1)
    kw = dict(causal=p["causal"], causal_align=p["align"], window=p["window"], softcap=p["softcap"])
    if p["padding"]:
        kw["kv_lengths"] = rng.integers(0, p["sk"] + 1, p["batch"])
        kw["q_lengths"] = rng.integers(0, p["sq"] + 1, p["batch"])
    if p["segments"]:
        kw["q_segment_ids"] = np.sort(rng.integers(0, 3, p["batch"] + (p["sq"],)), axis=-1)
        kw["kv_segment_ids"] = np.sort(rng.integers(0, 3, p["batch"] + (p["sk"],)), axis=-1)
    if p["alibi"]:
        kw["alibi_slopes"] = rng.uniform(0, 1, p["hk"] * p["group"])
    return kw


@pytest.mark.slow
@given(problems)
def test_agrees_with_reference_in_strict_mode(p):
    q, k, v = make(p)
    copies = [x.copy() for x in (q, k, v)]
    kw = options(p)
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        out, lse = attention(q, k, v, block_q=p["block_q"], block_k=p["block_k"], return_lse=True,
                             kv_splits=p["kv_splits"], **kw)
        ref, ref_lse = reference_attention(q, k, v, return_lse=True, **kw)
        # The verdict gate: per row, what float64 rounding allows between two correct
        # implementations, on out and lse (logits here reach ~1e3, so a fixed 1e-13 on lse
        # would be below the rounding of the scores themselves).
        judged = Gate(q, k, v, block_k=p["block_k"], **kw).judge(out, lse)
        assert judged["passed"], judged
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.all(out[~fin] == 0)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)
    again = attention(q, k, v, block_q=p["block_q"], block_k=p["block_k"], kv_splits=p["kv_splits"], **kw)
    assert again.tobytes() == out.tobytes()


# Each defect is refused by its own check, not by whatever numpy raises further on.
SHAPE_ERRORS = {"hq": "Hq % Hk == 0", "d": "same head dim D", "batch": "same number of dimensions",
                "sk_v": "same heads and keys"}


@given(problems, st.sampled_from(sorted(SHAPE_ERRORS)))
def test_inconsistent_shapes_raise_value_error(p, what):
    q, k, v = make(p)
    if what == "hq":
        # Hk * group + 1 query heads; Hk >= 2, since one kv head divides every Hq.
        hk = max(k.shape[-3], 2)
        k = np.ones(k.shape[:-3] + (hk,) + k.shape[-2:])
        v = np.ones(v.shape[:-3] + (hk,) + v.shape[-2:])
        q = np.ones(q.shape[:-3] + (hk * p["group"] + 1,) + q.shape[-2:])
    elif what == "d":
        k = np.ones(k.shape[:-1] + (k.shape[-1] + 1,))
    elif what == "batch":
        q = q[None]
    else:
        v = np.ones(v.shape[:-2] + (v.shape[-2] + 1, v.shape[-1]))
    for fn in (attention, reference_attention):
        with pytest.raises(ValueError, match=re.escape(SHAPE_ERRORS[what])):
            fn(q, k, v)
