"""The check's rule holds for every precision, float64 included, and its diagnoses name what
is wrong (issue 13): each case here failed, or was misdiagnosed, under the earlier rule
``2 * naive + eps``."""

import math

import ml_dtypes  # the test extra installs it
import numpy as np
import pytest

import attnlib
from attnlib import check
from attnlib.check import calibration
from attnlib.check.naive import SAMPLE_ROWS, naive_rows, sampled_ratio
from attnlib.check.rule import unit
from attnlib.core.oracle import oracle_attention


def verdict(out, q, k, v, **kw):
    return check.check_kernel(q, k, v, out, layout="bhsd", **kw)


def text(result):
    return check.format_text(result)


# -- float64: correct kernels pass ----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_float64_exact_answer_and_other_orders_pass(seed):
    """The old rule's bound collapsed to 2.2e-16 below one key tile: the exact answer rounded
    once to float64 failed on out and lse, as did PyTorch SDPA (4.4e-16)."""
    q, k, v = attnlib.random_qkv(128, d=64, batch=(1,), heads=2, seed=seed)
    exact, exact_lse = (x.astype(np.float64) for x in oracle_attention(q, k, v, causal=True, return_lse=True))
    for out, lse in [(exact, exact_lse),
                     attnlib.attention(q, k, v, causal=True, block_k=1, return_lse=True),  # key by key
                     attnlib.reference_attention(q, k, v, causal=True, return_lse=True)]:
        r = verdict(out, q, k, v, lse=lse, causal=True)
        assert r.passed, text(r)
        assert r.out.ratio < 0.05 and r.lse.ratio < 0.05  # far inside the rounding bound


def test_float64_correctly_rounded_answer_passes_decimal():
    """Exact products and exp, rounded once (the decimal oracle): error <= half an ulp."""
    q, k, v = attnlib.random_qkv(24, 40, 8, batch=(1,), heads=2, seed=3)
    out, lse = oracle_attention(q, k, v, causal=True, return_lse=True, method="decimal")
    r = verdict(out, q, k, v, lse=lse, causal=True)
    assert r.passed, text(r)


def test_float64_rule_keeps_its_power():
    """Off by one, a wrong scale and one head off by 1e-10 still fail; the allowance is the
    rounding bound, ~1e-13 of P @ |V| here, not the contract's 1e-9."""
    q, k, v = attnlib.random_qkv(256, d=64, batch=(2,), heads=4, seed=0)
    good = attnlib.attention(q, k, v, causal=True)
    head = good.copy()
    head[:, 1] *= 1 + 1e-10
    for out, words in [(attnlib.attention(q, k, v, window=(None, 1)), "one future key (off by one)"),
                       (attnlib.attention(q, k, v, causal=True, scale=1 / 64), "scale 1/D"),
                       (head, "only heads [1] fail")]:
        r = verdict(out, q, k, v, causal=True)
        assert not r.passed and any(words in d for d in r.diagnosis), text(r)


# -- below float64: FlashAttention's rule, both summation orders --------------------------------

def sequential_decode(q, k, v, dtype=np.float32):
    """A float32 kernel as PyTorch's math path writes it: q and k each scaled by
    sqrt(scale), p @ v summed one key after another in float32."""
    c = dtype(math.sqrt(1 / math.sqrt(q.shape[-1])))
    qf, kf = ((x.astype(dtype) * c).astype(dtype) for x in (q, k))
    vf = v.astype(dtype)
    s = qf @ np.swapaxes(kf, -1, -2)  # (..., 1, Sk)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    acc = np.zeros(q.shape[:-1] + (v.shape[-1],), dtype)
    for j in range(k.shape[-2]):
        acc += p[..., j:j + 1] * vf[..., j:j + 1, :]
    return (acc / p.sum(axis=-1, keepdims=True, dtype=dtype)).astype(np.float64)


@pytest.mark.parametrize("seed", range(4))
def test_float32_decode_summed_key_by_key_passes(seed):
    """Decode (one query, long keys): a kernel summing key by key errs ~2x BLAS's order; a
    baseline in one order alone failed such kernels."""
    q, k, v = (x.astype(np.float32).astype(np.float64) for x in attnlib.random_qkv(
        1, 2048, 128, batch=(2,), heads=4, seed=seed))
    r = verdict(sequential_decode(q, k, v), q, k, v, dtype="float32")
    assert r.passed, text(r)


def test_unit_is_an_ulp_at_the_entrys_own_size():
    """No constant anchors the absolute term (FlashAttention's 0.3 made it ~2 |ref| below
    1e-3 in bfloat16): a unit is at least the type's spacing at the size, proportional
    to it in the normal range, the type's resolution below it."""
    sizes = np.array([1e-30, 1e-6, 1e-4, 0.3, 30.0, 3e4])
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        u = unit(sizes, dtype)
        rounded = sizes.astype(dtype)
        assert (u >= np.abs(np.spacing(rounded).astype(np.float64))).all()
    assert unit(1e-4, ml_dtypes.bfloat16) == pytest.approx(2 ** -7 * 1e-4, rel=1e-6)  # not ulp(0.3)
    assert unit(0.0, np.float16) == 2.0 ** -24  # float16's absolute resolution


def test_empty_rows_must_be_zero_in_low_precision_too():
    q, k, v = (x.astype(np.float32) for x in attnlib.random_qkv(64, d=16, batch=(2,), heads=2, seed=0))
    out = attnlib.attention(q, k, v, kv_lengths=[64, 0], compute_dtype="float32").astype(np.float32)
    assert verdict(out, q, k, v, kv_lengths=[64, 0]).passed
    out[1] = 1e-6  # tiny, but the contract says 0
    r = verdict(out, q, k, v, kv_lengths=[64, 0])
    assert not r.passed and any("rows without a visible key" in d for d in r.diagnosis), text(r)


# -- lse: its storage type's rounding ------------------------------------------------------------

def test_lse_stored_in_bfloat16_is_judged_with_its_rounding():
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in attnlib.random_qkv(128, d=64, batch=(1,), heads=2, seed=0))
    out, lse = attnlib.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True, return_lse=True,
                                 compute_dtype="bfloat16")
    stored = lse.astype(ml_dtypes.bfloat16)  # the exact LSE rounded, as XLA keeps it
    r = check.check_kernel(q, k, v, out.astype(ml_dtypes.bfloat16), lse=stored, layout="bhsd", causal=True)
    assert r.passed and r.lse.passed, text(r)
    two_ulps = (stored.astype(np.float32) + 2 * np.spacing(stored).astype(np.float32)).astype(ml_dtypes.bfloat16)
    r = check.check_kernel(q, k, v, out.astype(ml_dtypes.bfloat16), lse=two_ulps, layout="bhsd", causal=True)
    assert not r.lse.passed


def test_nan_lse_on_an_empty_row_is_named_nan():
    q, k, v = attnlib.random_qkv(32, d=16, batch=(2,), heads=1, seed=0)
    out, lse = attnlib.attention(q, k, v, kv_lengths=[32, 0], return_lse=True)
    lse[1, 0, 3] = np.nan
    r = verdict(out, q, k, v, lse=lse, kv_lengths=[32, 0])
    assert not r.lse.passed and r.lse.nan == 1
    assert "1 hold NaN" in text(r) and "finite" not in r.lse.notes[0]


# -- diagnoses ----------------------------------------------------------------------------------

def test_single_nan_is_named_not_a_missing_rescale():
    q, k, v = attnlib.random_qkv(300, d=32, batch=(1,), heads=2, seed=0)
    out = attnlib.attention(q, k, v, causal=True)
    out[0, 1, 200, 5] = np.nan
    r = verdict(out, q, k, v, causal=True)
    assert not r.passed and r.out.nan == 1
    assert r.diagnosis[0].startswith("1 NaN and 0 inf values in 1 rows")
    assert "every finite row is within the allowance" in r.diagnosis[0]
    assert not any("rescale" in d or "head indexing" in d for d in r.diagnosis), r.diagnosis


def test_mask_sentinel_rows_are_named():
    """A finite mask value (-1e30) turns a row with no visible key into the mean of v."""
    q, k, v = attnlib.random_qkv(48, 40, 16, batch=(2,), heads=2, seed=1)
    out = attnlib.attention(q, k, v, kv_lengths=[40, 0])
    out[1] = v[1].mean(axis=-2)[:, None, :]
    r = verdict(out, q, k, v, kv_lengths=[40, 0])
    d = " ".join(r.diagnosis)
    assert "rows without a visible key" in d and "mean of v over all keys" in d
    assert "rescale" not in d, r.diagnosis


def test_alternatives_are_tried_on_the_failing_batch_entry():
    """Batch 0 right, batch 1 with a wrong scale: the old check tried batch 0 only and said
    "kv_lengths ignored" (batch 0 has no padding)."""
    q, k, v = attnlib.random_qkv(64, 300, 32, batch=(2,), heads=2, seed=0)
    out = attnlib.attention(q, k, v, kv_lengths=[300, 200])
    out[1] = attnlib.attention(q[1:], k[1:], v[1:], kv_lengths=[200], scale=1.0)[0]
    r = verdict(out, q, k, v, kv_lengths=[300, 200])
    d = " ".join(r.diagnosis)
    assert "the output matches attention with scale 1" in d and "kv_lengths ignored" not in d, r.diagnosis


def test_partial_match_is_named_with_its_fraction():
    """Off by one everywhere except a few rows that are wrong another way."""
    q, k, v = attnlib.random_qkv(256, d=32, batch=(1,), heads=2, seed=0)
    out = attnlib.attention(q, k, v, causal=False, window=(None, 1))
    rows = np.arange(63, 255, 64)
    out[..., rows, :] *= 1.5
    r = verdict(out, q, k, v, causal=True)
    failing = 2 * 255  # every row but the last sees a future key
    assert any(d.startswith(f"{(failing - 2 * rows.size) / failing:.0%} of the failing rows "
                            f"({failing - 2 * rows.size} of {failing}) match attention with a causal "
                            "mask that lets each query see one future key") for d in r.diagnosis), r.diagnosis


def test_trend_never_divides_by_a_zero_baseline():
    """float64 below one key tile: the naive error was 0 and the trend printed 2e+292x."""
    q, k, v = attnlib.random_qkv(128, d=32, batch=(1,), heads=1, seed=0)
    out = attnlib.attention(q, k, v, causal=True)
    out[..., 64:, :] *= 1 + 1e-9
    r = verdict(out, q, k, v, causal=True)
    assert not r.passed and r.trend.startswith("grows with the query position"), r.trend
    assert "e+2" not in r.trend and "e+3" not in r.trend


# -- the measurement ----------------------------------------------------------------------------

def test_calibration_counts_false_alarms_and_catches_defects():
    shapes = ((1, 2, 64, 64, 32, True), (2, 2, 1, 300, 32, False))
    for prec in ("float64", "float32", "bfloat16"):
        rows = calibration.measure(prec, shapes=shapes, seeds=range(2))
        s = calibration.summary(rows)[prec]
        assert s["correct_runs"] > 0 and s["false_alarms"] == 0, rows
        assert s["caught"] == s["defect_runs"] > 0, rows
        # off by one changes nothing in decode (bottom-right): left out, not counted as caught
        assert not any(r["shape"].startswith("(2, 2, 1,") and "off by one" in r["kernel"] for r in rows)


def test_key_by_key_order_adds_one_key_after_another():
    """The key-by-key naive order is a sequential sum in the accumulator's type, bit for bit."""
    from attnlib.core.reference import _key_by_key
    rng = np.random.default_rng(0)
    p = rng.random((2, 3, 5, 300)).astype(np.float32)
    v = rng.standard_normal((2, 1, 300, 4)).astype(np.float32)
    acc, l = _key_by_key(p, v, p)
    want, total = np.zeros((2, 3, 5, 4), np.float32), np.zeros((2, 3, 5, 1), np.float32)
    for j in range(300):
        want = want + p[..., j:j + 1] * v[..., j:j + 1, :]
        total = total + p[..., j:j + 1]
    assert np.array_equal(acc, want) and np.array_equal(l, total)


def test_naive_rows_spread_over_the_rows_that_see_a_key():
    lse = np.full((2, 3, 5000), 1.0)
    lse[..., :1000] = -np.inf  # bottom-right causal, Sq > Sk: rows without a key
    assert naive_rows(lse[..., :SAMPLE_ROWS], SAMPLE_ROWS, 128) is None  # few rows: all of them
    rows = naive_rows(lse, SAMPLE_ROWS, 128)
    assert rows.size == SAMPLE_ROWS and rows[0] == 1000 and rows[-1] == 4999
    assert np.all(np.diff(rows) > 0) and np.ptp(np.diff(rows)) <= 1


def test_a_sampled_maximum_is_scaled_to_the_whole_tensor():
    """The largest of N normal errors grows as sqrt(2 ln N): a sample of N_s entries has its
    maximum scaled by sqrt(ln N / ln N_s), which brings it to the whole tensor's."""
    rng = np.random.default_rng(1)
    err = np.abs(rng.standard_normal((1, 8, 4096, 64)))
    u, seen = np.ones_like(err), np.ones(err.shape[:-1] + (1,), bool)
    whole = sampled_ratio([(None, err)], u, seen)[0, 0, 0, 0]
    assert whole == err.max()
    rows = np.arange(0, 4096, 64)
    scaled = sampled_ratio([(rows, err[..., rows, :])], u, seen)[0, 0, 0, 0]
    raw = err[..., rows, :].max()
    assert raw < whole and abs(scaled - whole) < 0.1 * whole, (raw, scaled, whole)


# -- gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gradients_in_other_orders_pass_and_a_perturbed_one_fails(dtype):
    """float64/float32 gradients are judged by a rounding bound on their componentwise size:
    FlashAttention's 2x rule failed PyTorch SDPA's correct gradients (up to 3x numpy's)."""
    from attnlib.core.backward import attention_backward, reference_attention_backward
    rnd = (lambda x: x.astype(np.float32).astype(np.float64)) if dtype == "float32" else (lambda x: x)
    q, k, v = (rnd(x) for x in attnlib.random_qkv(96, 130, 32, batch=(2,), heads=4, kv_heads=2, seed=5))
    dout = rnd(np.random.default_rng(5).standard_normal((2, 4, 96, 32)))
    out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True)
    for grads in (attention_backward(q, k, v, out, lse, dout, causal=True, block_q=16, block_k=16),
                  reference_attention_backward(q, k, v, dout, causal=True, compute_dtype=dtype)):
        grads = [rnd(np.asarray(g, dtype=np.float64)) for g in grads]
        r = verdict(rnd(out), q, k, v, dout=dout, dq=grads[0], dk=grads[1], dv=grads[2], causal=True, dtype=dtype)
        assert all(g.passed for g in r.grads.values()), text(r)
    bad = grads[1].copy()
    bad[1, 0, 7] *= 1 + (1e-9 if dtype == "float64" else 1e-2)
    r = verdict(rnd(out), q, k, v, dout=dout, dk=bad, causal=True, dtype=dtype)
    assert not r.grads["dk"].passed and r.grads["dk"].worst[0]["key"] == 7, text(r)


# -- found by review ------------------------------------------------------------------------------

def test_one_head_without_the_scale_is_diagnosed_not_a_crash():
    """An alternative explaining every failing row while the passing rows differ from it
    raised IndexError (a traceback and exit 1 from the CLI)."""
    q, k, v = attnlib.random_qkv(32, d=16, batch=(1,), heads=4, seed=0)
    out = attnlib.attention(q, k, v)
    out[:, 1] = attnlib.attention(q[:, 1], k[:, 1], v[:, 1], scale=1.0)
    r = verdict(out, q, k, v)
    assert not r.passed
    assert any(d.startswith("every failing row (32) matches attention with scale 1") for d in r.diagnosis), r.diagnosis
    assert any("only heads [1] fail" in d for d in r.diagnosis)


def test_float16_naive_overflow_is_left_out_not_nan():
    """Scores beyond 65504 overflow a float16 naive that stores them; a kernel keeping them
    in float32 (as FlashAttention does) is correct and passes."""
    q, k, v = attnlib.random_qkv(64, d=32, batch=(1,), heads=2, seed=1)
    q = q.copy()
    q[..., :8, :] *= 1000
    k = k * 50
    q, k, v = (x.astype(np.float16).astype(np.float64) for x in (q, k, v))
    out = attnlib.attention(q, k, v, compute_dtype="float16")  # float32 scores
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        r = verdict(out.astype(np.float64), q, k, v, dtype="float16")
    assert r.passed and np.isfinite(r.out.allowance), text(r)
    assert "BLAS order;" not in r.baseline  # the dense float16 naive overflowed and was left out


def test_tile_boundary_story_needs_rows_that_see_fewer_keys():
    """Every row sees every key (no mask): no "rows whose keys fit in one tile" story; nor
    from rows that see no key at all."""
    q, k, v = attnlib.random_qkv(128, 96, 32, batch=(1,), heads=2, seed=0)
    out = attnlib.attention(q, k, v)
    out[..., 70:, :] *= 1.001
    r = verdict(out, q, k, v)
    assert not r.passed and not any("tile of" in d for d in r.diagnosis), r.diagnosis
    q, k, v = attnlib.random_qkv(48, 32, 16, batch=(1,), heads=1, seed=0)
    out = attnlib.attention(q, k, v, causal=True) * 1.001  # rows 0-15 see no key (bottom right)
    r = verdict(out, q, k, v, causal=True)
    assert not r.passed and not any("tile of" in d for d in r.diagnosis), r.diagnosis


def test_marginal_failure_is_called_marginal_not_an_indexing_bug():
    q, k, v = (x.astype(np.float32).astype(np.float64) for x in attnlib.random_qkv(
        64, d=32, batch=(1,), heads=2, seed=0))
    good = verdict(attnlib.attention(q, k, v, compute_dtype="float32").astype(np.float64), q, k, v, dtype="float32")
    ref = attnlib.attention(q, k, v)
    out = ref.copy()
    out[0, 0, 5, 3] += 2 * good.out.allowance  # about twice an entry's allowance
    r = verdict(out, q, k, v, dtype="float32")
    assert not r.passed and 1 < r.out.ratio <= 4
    assert r.diagnosis[0].startswith("marginal: the worst finite error is")
    assert not any("head indexing" in d for d in r.diagnosis), r.diagnosis


def test_a_batch_entry_with_large_values_does_not_hide_another_entrys_error():
    """The naive error is pooled over a head in units of each entry's size: batch 1 with v
    x 1000 no longer lends its rounding to batch 0 computed in float16."""
    q, k, v = (x.astype(np.float32).astype(np.float64) for x in attnlib.random_qkv(
        256, d=64, batch=(2,), heads=2, seed=0))
    v = v.copy()
    v[1] *= 1000
    out = attnlib.attention(q, k, v, causal=True, compute_dtype="float32").astype(np.float64)
    assert verdict(out, q, k, v, causal=True, dtype="float32").passed
    out[0] = attnlib.attention(q[:1], k[:1], v[:1], causal=True, compute_dtype="float16")[0]
    r = verdict(out, q, k, v, causal=True, dtype="float32")
    assert not r.passed and r.out.worst[0]["batch"] == 0, text(r)


@pytest.mark.parametrize("cut", ["sq", "batch", "heads"])
def test_empty_problems_are_unusable_not_a_crash(cut):
    q, k, v = attnlib.random_qkv(8, d=4, batch=(2,), heads=2, seed=0)
    sl = {"sq": (slice(None), slice(None), slice(0, 0)), "batch": (slice(0, 0),),
          "heads": (slice(None), slice(0, 0))}[cut]
    with pytest.raises(check.UnusableInput):
        check.check_kernel(q[sl], k[sl] if cut != "sq" else k, v[sl] if cut != "sq" else v, q[sl], layout="bhsd")


def test_no_keys_at_all_is_judged():
    q, k, v = attnlib.random_qkv(8, d=4, batch=(1,), heads=2, seed=0)
    assert verdict(np.zeros_like(q), q, k[..., :0, :], v[..., :0, :]).passed
    r = verdict(np.ones_like(q), q, k[..., :0, :], v[..., :0, :])
    assert not r.passed and "rows without a visible key" in r.diagnosis[0]


def test_alternatives_name_their_scope_beyond_the_entries_tried():
    from attnlib.check.diagnosis import MAX_ENTRIES
    b = MAX_ENTRIES + 2
    q, k, v = attnlib.random_qkv(16, d=8, batch=(b,), heads=1, seed=0)
    out = attnlib.attention(q, k, v, scale=1.0)
    r = verdict(out, q, k, v)
    assert any(f"in the first {MAX_ENTRIES} failing batch entries (of {b})" in d for d in r.diagnosis), r.diagnosis


@pytest.mark.parametrize("claimed, actual", [("float32", "bfloat16"), ("float64", "float32")])
def test_a_kernel_in_a_lower_precision_is_named(claimed, actual):
    q, k, v = (x.astype(np.float32).astype(np.float64) for x in attnlib.random_qkv(
        128, d=64, batch=(1,), heads=2, seed=0))
    out = attnlib.attention(q, k, v, causal=True, compute_dtype=actual).astype(np.float64)
    r = verdict(out, q, k, v, causal=True, dtype=claimed)
    assert not r.passed
    assert r.diagnosis == [f"judged as a {actual} kernel the output passes: the kernel computes in {actual}, "
                           f"not {claimed}; check its input casts and matmul precision settings, or pass "
                           f"--dtype {actual}"]


def test_the_printed_rule_is_the_documented_one():
    import re
    from pathlib import Path
    from attnlib.check.rule import FINAL_ROUNDINGS
    from attnlib.check.text import rule_text
    doc = (Path(__file__).resolve().parent.parent / "docs" / "semantics.md").read_text()
    printed = rule_text("bfloat16")
    # The contract's size, its subscripts dropped, is the printed one; so are the + 2 and the pooling.
    size = re.search(r"size\s+= (.*)\n", doc).group(1).strip()
    assert re.sub(r"_(ij|jc|ic|i|j)\b", "", size) in printed
    allowance = re.search(r"allowance = (\(2 max\(\|naive - ref\| / unit\) \+ (\d+)\) unit)\s+\(max over the tensor\)",
                          doc)
    assert allowance and int(allowance.group(2)) == FINAL_ROUNDINGS
    assert f"(2 r + {FINAL_ROUNDINGS:g}) u per entry" in printed and "r = max over the tensor" in printed


def test_errors_are_given_in_ulps_of_each_entrys_size():
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in attnlib.random_qkv(128, 128, 32, heads=2, batch=(1,), seed=3))
    good = attnlib.attention(q, k, v, causal=True, compute_dtype="bfloat16").astype(ml_dtypes.bfloat16)
    bad = attnlib.attention(q, k, v, compute_dtype="bfloat16").astype(ml_dtypes.bfloat16)  # no causal mask
    for out, passed in ((good, True), (bad, False)):
        verdict = check.check_kernel(q, k, v, out, layout="bhsd", causal=True).out
        assert verdict.passed is passed
        for w in verdict.worst:  # err / allowance = (err / u) / (allowance / u): the same u
            assert w["ulps"] / w["allowance_ulps"] == pytest.approx(w["ratio"], rel=1e-12)
            assert w["ulps"] <= verdict.max_ulps
        # One pooled r: every entry's allowance is the same number of its own ulps, 2 r + 2.
        assert len({round(w["allowance_ulps"], 9) for w in verdict.worst}) == 1
    assert " u), allowance " in check.format_text(check.check_kernel(q, k, v, bad, layout="bhsd", causal=True))


def test_ulps_of_an_error_on_a_row_without_keys_run_in_strict_mode():
    q, k, v = attnlib.random_qkv(64, 64, 16, heads=2, batch=(1,), seed=1)  # float64: 1 / 5e-324 overflows
    out = np.zeros(q.shape)
    out[0, 0, 0, 0] = 1.0  # every row sees no key: out must be 0, its unit the smallest subnormal
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        verdict = check.check_kernel(q, k, v, out, kv_lengths=[0], layout="bhsd", causal=True).out
    assert verdict.passed is False and verdict.max_ulps == np.inf


def test_the_speed_benchmark_reports_its_ratio(capsys):
    """`python -m attnlib.check.speed` measures, it does not judge: a line per precision with
    the medians, the runs and the target (no timing asserted)."""
    import json
    from attnlib.check import speed
    assert speed.main(["160", "--precisions", "float32,bfloat16", "--repeats", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert "cpu" in lines[0] and [r["precision"] for r in lines[1:]] == ["float32", "bfloat16"]
    for r in lines[1:]:
        assert r["passed"] and r["ratio"] > 0 and abs(r["target"] - (4 * r["attention"] + 0.2)) < 1e-3
    assert speed.main(["160", "--precisions", "bfloat16", "--repeats", "1", "--gradients"]) == 0
    r = json.loads(capsys.readouterr().out.splitlines()[1])
    assert r["passed"] and r["gradients"] and 0 < r["backward"] < r["attention"]
    assert abs(r["added"] - (r["check"] - r["forward_check"])) < 2e-4 and abs(r["added_target"] - (4 * r["backward"] + 0.2)) < 1e-3


def test_the_sampled_naive_errors_are_kept_on_their_rows():
    """Above SAMPLE_ROWS rows the baselines run on a sample: their errors are reported on those
    rows (the verdict's naive maxima), 0 elsewhere, and the sample is named in the baseline."""
    from attnlib.check.naive import naive_errors
    from attnlib.core.options import Options
    from attnlib.core.problem import precision
    from attnlib.core.tiled import attention as tiled
    q, k, v = (precision("bfloat16").round(x).astype(np.float64)
               for x in attnlib.random_qkv(600, d=16, batch=(1,), heads=2, seed=4))
    ref, lse = tiled(q, k, v, causal=True, return_lse=True)
    err, lse_err, words, draws, _ = naive_errors(q, k, v, Options.parse(causal=True), precision("bfloat16"), ref, lse)
    rows = draws[0][0]
    assert rows is not None and rows.size == SAMPLE_ROWS and f"({SAMPLE_ROWS} of 600 rows)" in words
    drawn = np.unique(np.concatenate([at for at, _ in draws]))  # the key-by-key order's rows too
    assert (err[..., rows, :] > 0).any() and not err[..., np.setdiff1d(np.arange(600), drawn), :].any()
    assert err.max() == max(e.max() for _, e in draws)


def test_the_kernels_worst_rows_join_the_sample():
    """A row where the kernel errs most is among the baselines' rows, ranked by the whole size."""
    from attnlib.check.rule import worst_rows
    ref = np.ones((1, 2, 700, 4))
    kernel = ref.copy()
    kernel[0, 1, 613, 2] += 1e-5  # 84 float32 ulps at size 1
    kernel[0, 0, 5, 0] += 1e-6
    assert list(worst_rows(kernel, ref, np.abs(ref), np.float32, 32)) == [5, 613]
    kernel[0, 0, 9, 0] = np.nan  # fails anyway: not a row to sample for
    assert 9 not in worst_rows(kernel, ref, np.abs(ref), np.float32, 1)
    lse = np.zeros((1, 2, 700))
    assert {5, 613} <= set(naive_rows(lse, SAMPLE_ROWS, 128, worst_rows(kernel, ref, ref, np.float32, 32)))


def test_query_lengths_align_the_score_sizes():
    """Bottom-right causal with q_lengths: every row that sees a key has a score size (once
    aligned on Sq, rows 50-59 here had sigma = 0: a correct float32 LSE failed at 27 times its
    allowance where such a row's lse was near 0)."""
    from attnlib.check.sizes import score_size
    from attnlib.core.options import Options
    q, k, _ = attnlib.random_qkv(300, 240, 32, batch=(1,), heads=2, seed=1)
    opts = Options.parse(causal=True, q_lengths=np.array([290]))
    _, lse = attnlib.attention(q, k, k, return_lse=True, causal=True, q_lengths=np.array([290]))
    sizes = score_size(q, k, opts, lse)
    seen = np.isfinite(lse)
    assert seen[..., 50].all() and not seen[..., 49].any()
    sigma = sizes - np.abs(np.where(seen, lse, 0.0))
    assert (sigma[seen] > 0).all(), np.flatnonzero(sigma[0, 0] <= 0)


def test_no_keys_on_torch_tensors():
    torch = pytest.importorskip("torch")
    from attnlib.check import check_kernel
    q, k, v = torch.ones(1, 2, 3, 4), torch.ones(1, 2, 0, 4), torch.ones(1, 2, 0, 4)
    assert check_kernel(q, k, v, torch.zeros(1, 2, 3, 4), layout="bhsd").passed


def test_the_kernels_worst_lse_rows_join_the_sample_too():
    from attnlib.check import naive, rule
    from attnlib.core.options import Options
    from attnlib.core.problem import precision
    prec = precision("float16")
    q, k, v = (prec.round(x).astype(np.float64) for x in attnlib.random_qkv(400, d=16, batch=(1,), heads=2, seed=5))
    out, lse = attnlib.attention(q, k, v, return_lse=True)
    lse = lse.copy()
    lse[0, 1, 332] += 1e-3  # a row the even sample (128 of 400) leaves out
    seen = []
    real = naive.naive_errors

    def spy(*a, **kw):
        seen.append(a[8] if len(a) > 8 else kw.get("worst"))
        return real(*a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rule, "naive_errors", spy)
        rule.expect(q, k, v, Options.parse(), prec, 1, kernel=out, kernel_lse=lse)
    assert 332 not in naive.naive_rows(lse, naive.SAMPLE_ROWS, naive.SAMPLE_EVERY) and 332 in seen[0]


@pytest.mark.slow
def test_sampled_dsinks_keep_the_rows_that_hold_the_sum(monkeypatch):
    """``dsinks`` sums a term per row, and at large logits one row can hold nearly all of it
    (``exp(sink - lse_i)`` spans decades): an even sample of the rows missed it and a correct
    bfloat16 kernel's ``dsinks`` failed at 1.03-1.68 of the allowance (0.41 with every row); with
    the rows of the largest terms in the sample it sits where every row puts it."""
    from attnlib.core import problem
    from attnlib.core.backward import dense_backward
    from attnlib.core.options import Options
    from attnlib.check import naive

    rng = np.random.default_rng(43)
    bf = problem.precision("bfloat16")
    q, k = (bf.round(rng.standard_normal((2, 2, 581, 64)) * 5).astype(float) for _ in range(2))
    v, dout = (bf.round(rng.standard_normal((2, 2, 581, 16))).astype(float) for _ in range(2))
    sinks = np.array([3.03, 2.04])
    out = bf.round(attnlib.attention(q, k, v, sinks=sinks)).astype(float)
    grads = dense_backward(q, k, v, dout, Options.parse(sinks=sinks), compute_dtype="bfloat16", formulation="math")
    kw = dict(dout=dout, dq=grads[0], dk=grads[1], dv=grads[2], dsinks=grads[3], sinks=sinks, layout="bhsd",
              dtype="bfloat16")
    sampled = check.check_kernel(q, k, v, out, **kw).grads["dsinks"].ratio
    monkeypatch.setattr(naive, "SAMPLE_ROWS", 10 ** 9)  # every row and key
    whole = check.check_kernel(q, k, v, out, **kw).grads["dsinks"].ratio
    assert sampled < 0.6 and whole < 0.6 and abs(sampled - whole) < 0.1 * whole, (sampled, whole)


def _sinks_problem(prec_name, seed, sinks):
    """A causal (1, 2, 300, 16) problem with sinks, its values in ``prec_name``: ``(q, k, v, dout,
    options, out, grads)``, ``out`` attnlib's in the type and ``grads`` the float64 ones rounded
    (``dsinks`` kept in float64)."""
    from attnlib.core.problem import precision
    dt = precision(prec_name).compute
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal((1, 2, 300, 16)).astype(dt) for _ in range(4))
    kw = dict(causal=True, sinks=np.array(sinks))
    out = attnlib.attention(q, k, v, compute_dtype=prec_name, **kw).astype(dt)
    ref, lse = attnlib.attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv, dsinks = attnlib.attention_backward(q, k, v, ref, lse, dout, **kw)
    return q, k, v, dout, kw, out, dict(dq=dq.astype(dt), dk=dk.astype(dt), dv=dv.astype(dt), dsinks=dsinks)


def test_the_verdict_is_the_same_on_any_number_of_threads():
    """The baselines run on threads, their parts fixed (`NAIVE_THREADS`), not taken from ``workers``:
    every figure of the verdict is the same bit for bit on one thread or three (sampled rows and
    keys, ``dsinks`` summed over the parts)."""
    q, k, v, dout, kw, out, grads = _sinks_problem("bfloat16", 3, [0.5, -1.0])

    def figures(workers):
        r = check.check_kernel(q, k, v, out, dout=dout, layout="bhsd", workers=workers, **grads, **kw)
        return [(t.ratio, t.naive_max, t.max_ulps) for t in [r.out] + [r.grads[n] for n in sorted(r.grads)]]

    assert figures(1) == figures(3)


def test_the_naive_dsinks_do_not_depend_on_the_split_into_parts(monkeypatch):
    """A part of the naive backward leaves its ``dsinks`` (the sum over its rows) unrounded, and the
    parts add up before the one rounding of the sum: the naive's error, and with it the allowance,
    are those of one part (a second reader found +63% on the naive's ``dsinks`` when every part's sum
    was rounded to float16 before they were added)."""
    from attnlib.check import naive
    q, k, v, dout, kw, out, grads = _sinks_problem("float16", 5, [1.5, -0.5])

    def dsinks_figures():
        r = check.check_kernel(q, k, v, out, dout=dout, layout="bhsd", **grads, **kw).grads["dsinks"]
        return r.naive_max, r.allowance

    two = dsinks_figures()
    monkeypatch.setattr(naive, "NAIVE_CHUNK_BYTES", 32 * 2 * 300 * 8)  # parts of a few rows each
    many = dsinks_figures()
    assert np.allclose(two, many, rtol=1e-6, atol=0), (two, many)


@pytest.mark.parametrize("shape", [(1, 7), (3, 1), (8, 1000), (5, 1001), (2, 2), (4, 6)])
def test_the_verdicts_medians_are_numpys(shape):
    """`rule.medians`: each head's median and the whole's from one partition, bit for bit
    `np.median`'s, with ties, zeros, one head far from the others, odd and even counts."""
    from attnlib.check.rule import medians
    rng = np.random.default_rng(shape[1])
    for x in (rng.random(shape), np.round(rng.random(shape) * 3) / 3, np.zeros(shape),
              rng.random(shape) * np.logspace(-300, 300, shape[0])[:, None]):
        per_row, whole = medians(x)
        assert [float(m) for m in per_row] == [float(np.median(r)) for r in x]
        assert whole == float(np.median(x))
