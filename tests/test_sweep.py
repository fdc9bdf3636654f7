"""`assert_invariant` / `sweep_kernel`: a kernel judged at every setting of its own knobs, and
its repeated runs compared bit for bit (FlashAttention issues 1647 and 2244)."""

import numpy as np
import pytest

import attnlib
from attnlib.check import UnusableInput
from attnlib.check.sweep import sweep_kernel
from attnlib.testing import assert_invariant

Q, K, V = (x.astype(np.float32) for x in attnlib.random_qkv(96, 96, 16, heads=4, kv_heads=2, batch=(1,), seed=3))
CHECK = dict(layout="bhsd", causal=True)


def good(q, k, v, num_splits=1, block_k=32):
    return attnlib.attention(q, k, v, causal=True, compute_dtype="float32", kv_splits=num_splits, block_k=block_k,
                             return_lse=True)


def split_bug(q, k, v, num_splits=1):
    """Right with one split; with more, the last split's keys are dropped (a merge bug)."""
    if num_splits == 1:
        return good(q, k, v)
    keep = q.shape[-2] - q.shape[-2] // num_splits
    return attnlib.attention(q, k, v, causal=True, compute_dtype="float32", window=(keep, 0), return_lse=True)


class Flaky:
    """Right, but the last bit of one entry flips on every other call (an atomic-add order)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, pack_gqa=False):
        out, lse = good(q, k, v)
        self.calls += 1
        if self.calls % 2 == 0:
            out = out.copy()
            out.view(np.uint32)[0, 0, 5, 3] ^= 1
        return out, lse


@pytest.mark.slow
def test_a_correct_kernel_passes_every_setting_and_is_deterministic():
    sweep = assert_invariant(good, Q, K, V, knobs={"num_splits": [1, 2, 3], "block_k": [16, 48]}, repeats=2,
                             deterministic=True, **CHECK)
    assert len(sweep.settings) == 6 and all(s.passed and not s.nondeterministic for s in sweep.settings)
    assert sweep.settings[0].spread == {} and all(s.spread["out"] < 1e-5 for s in sweep.settings[1:])
    assert "6 settings, each run 3 times" in sweep.summary()


def test_the_failing_settings_are_named():
    with pytest.raises(AssertionError) as e:
        assert_invariant(split_bug, Q, K, V, knobs={"num_splits": [1, 3]}, **CHECK)
    text = str(e.value)
    assert "1 of 2 settings fail: num_splits=3" in text and "num_splits=1: PASS" in text
    assert "the first failing setting's verdict" in text and "out: FAIL" in text


def test_repeated_runs_that_differ_are_found():
    flaky = Flaky()
    sweep = sweep_kernel(flaky, Q, K, V, knobs={"pack_gqa": [False, True]}, repeats=1, **CHECK)
    assert all(s.passed for s in sweep.settings)  # one ulp is within the allowance
    assert [s.nondeterministic for s in sweep.settings] == [["out"], ["out"]]
    assert_invariant(Flaky(), Q, K, V, knobs={"pack_gqa": [False]}, **CHECK)  # not asked to be deterministic
    with pytest.raises(AssertionError, match="not deterministic"):
        assert_invariant(Flaky(), Q, K, V, knobs={"pack_gqa": [False]}, deterministic=True, **CHECK)


def test_gradients_are_swept_too():
    dout = np.random.default_rng(4).standard_normal((1, 4, 96, 16)).astype(np.float32)

    def with_grads(q, k, v, dout, block_k):
        q64, k64, v64, d64 = (x.astype(np.float64) for x in (q, k, v, dout))
        out, lse = attnlib.attention(q64, k64, v64, causal=True, return_lse=True, block_k=block_k)
        dq, dk, dv = attnlib.attention_backward(q64, k64, v64, out, lse, d64, causal=True, block_k=block_k)
        scale = 1.001 if block_k == 48 else 1.0  # a wrong dk at one tile size
        return dict(out=out.astype(np.float32), dq=dq.astype(np.float32), dk=(dk * scale).astype(np.float32),
                    dv=dv.astype(np.float32))

    sweep = sweep_kernel(with_grads, Q, K, V, knobs={"block_k": [32, 48]}, dout=dout, **CHECK)
    assert [s.passed for s in sweep.settings] == [True, False]
    assert "dk: FAIL" in sweep.settings[1].text


@pytest.mark.parametrize("bad, word", [(dict(knobs=[1, 2]), "knobs must be a dict"),
                                       (dict(knobs={"num_splits": []}), "no values"),
                                       (dict(knobs={"num_splits": [1]}, repeats=-1), "repeats")])
def test_bad_sweeps_are_named(bad, word):
    with pytest.raises(UnusableInput, match=word):
        sweep_kernel(good, Q, K, V, **bad, **CHECK)


def test_a_kernel_returning_something_else_is_named():
    with pytest.raises(UnusableInput, match="must have 'out'"):
        sweep_kernel(lambda q, k, v, x: {"o": 1}, Q, K, V, knobs={"x": [1]}, **CHECK)
    with pytest.raises(UnusableInput, match="tuple of 3"):
        sweep_kernel(lambda q, k, v, x: (1, 2, 3), Q, K, V, knobs={"x": [1]}, **CHECK)


def test_a_kernel_writing_into_one_buffer_is_compared_run_by_run():
    """Found by review: results held by reference made every repeat equal to itself."""
    ref = good(Q, K, V)[0]
    buf, calls = np.empty_like(ref), [0]

    def in_place(q, k, v, s):
        calls[0] += 1
        buf[...] = ref
        buf.flat[calls[0]] = np.nextafter(buf.flat[calls[0]], np.float32(9))
        return buf

    sweep = sweep_kernel(in_place, Q, K, V, knobs={"s": [1]}, repeats=2, **CHECK)
    assert sweep.settings[0].nondeterministic == ["out"]


def test_a_raising_kernel_names_its_setting_and_strings_are_no_lists():
    def fails(q, k, v, num_splits):
        if num_splits == 3:
            raise IndexError("split out of range")
        return good(q, k, v)

    with pytest.raises(RuntimeError, match="the kernel raised at num_splits=3: IndexError: split out of range"):
        sweep_kernel(fails, Q, K, V, knobs={"num_splits": [1, 3]}, **CHECK)
    with pytest.raises(UnusableInput, match="list of values"):
        sweep_kernel(good, Q, K, V, knobs={"num_splits": "13"}, **CHECK)
