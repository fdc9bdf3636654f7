"""The LSE conventions kernels disagree on (base 2, the sink in or out, the empty rows'
infinity): a kernel that follows the one it is told passes, one that follows another fails
with that convention named, and a real error in a told convention still fails."""

import math

import numpy as np
import pytest

from attnlib import attention, check
from attnlib.core.lse_conventions import LN2, LseConvention
from attnlib.testing import assert_attention_close

B, S, H, D = 2, 48, 4, 32


def _problem(dtype, magnitude=1.0, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, H, S, D)) for _ in range(3))
    return q * magnitude, k * magnitude, v, rng.standard_normal(H)


def _kernel(q, k, v, dtype, **opts):
    """A correct kernel in ``dtype``: attnlib's own in that precision (its lse natural, the
    sink included, -inf on empty rows)."""
    prec = None if dtype == "float64" else dtype
    out, lse = attention(q, k, v, return_lse=True, compute_dtype=prec, **opts)
    return out, lse.astype(np.float64)


def _judge(q, k, v, out, lse, dtype, **kw):
    return check.check_kernel(q, k, v, out, lse=lse, layout="bhsd", dtype=dtype, **kw)


def _notes(r):
    return " | ".join(r.lse.notes)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("magnitude", [1.0, 12.0])
def test_a_base_2_lse_passes_when_told_and_fails_named_when_not(dtype, magnitude):
    q, k, v, _ = _problem(dtype, magnitude)
    out, lse = _kernel(q, k, v, dtype, causal=True)
    lse2 = lse / LN2  # FlashInfer's, JAX Pallas's
    told = _judge(q, k, v, out, lse2, dtype, causal=True, lse_base=2)
    assert told.lse.passed is True, _notes(told)
    assert _judge(q, k, v, out, lse, dtype, causal=True).lse.passed is True
    untold = _judge(q, k, v, out, lse2, dtype, causal=True)
    assert untold.lse.passed is False and "base 2" in _notes(untold) and "lse_base=2" in _notes(untold)
    backwards = _judge(q, k, v, out, lse, dtype, causal=True, lse_base=2)  # natural, told base 2
    assert backwards.lse.passed is False and "natural log (base e), not base 2" in _notes(backwards)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("magnitude", [1.0, 12.0])
def test_a_wrong_lse_still_fails_in_base_2(dtype, magnitude):
    """Power: an error of a few allowances in a base-2 lse (one row, or all rows by a
    relative 1e-5 / 1e-12) fails when the base is told."""
    q, k, v, _ = _problem(dtype, magnitude)
    out, lse = _kernel(q, k, v, dtype, causal=True)
    ok = _judge(q, k, v, out, lse / LN2, dtype, causal=True, lse_base=2)
    worst = max(w["allowance"] for w in ok.lse.worst)
    one_row = lse / LN2
    one_row[1, 2, 30] += 3 * worst / LN2
    assert _judge(q, k, v, out, one_row, dtype, causal=True, lse_base=2).lse.passed is False
    rel = 1e-12 if dtype == "float64" else 1e-5
    assert _judge(q, k, v, out, lse / LN2 * (1 + rel) + rel, dtype, causal=True, lse_base=2).lse.passed is False


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_sink_in_or_out_of_the_lse(dtype):
    q, k, v, sinks = _problem(dtype)
    out, with_sink = _kernel(q, k, v, dtype, causal=True, sinks=sinks)
    _, keys_only = _kernel(q, k, v, dtype, causal=True)  # FlashMLA's lse: the keys' only
    assert _judge(q, k, v, out, with_sink, dtype, causal=True, sinks=sinks).lse.passed is True
    told = _judge(q, k, v, out, keys_only, dtype, causal=True, sinks=sinks, lse_sink="excluded")
    assert told.passed is True, _notes(told)
    untold = _judge(q, k, v, out, keys_only, dtype, causal=True, sinks=sinks)
    assert untold.lse.passed is False and "excludes the sink (FlashMLA" in _notes(untold)
    wrong_way = _judge(q, k, v, out, with_sink, dtype, causal=True, sinks=sinks, lse_sink="excluded")
    assert wrong_way.lse.passed is False and "includes the sink (FlashAttention 4" in _notes(wrong_way)
    both = _judge(q, k, v, out, keys_only / LN2, dtype, causal=True, sinks=sinks)
    assert "excludes the sink" in _notes(both) and "lse_base=2" in _notes(both)
    assert _judge(q, k, v, out, keys_only / LN2, dtype, causal=True, sinks=sinks, lse_sink="excluded",
                  lse_base=2).passed is True


def test_the_excluded_sink_lse_has_empty_rows():
    """Without the sink, rows with no visible key have no lse: they must hold an infinity."""
    q, k, v, sinks = _problem("float32")
    lengths = np.array([S, 0])
    out, _ = _kernel(q, k, v, "float32", kv_lengths=lengths, sinks=sinks)
    _, keys_only = _kernel(q, k, v, "float32", kv_lengths=lengths)
    assert np.isneginf(keys_only[1]).all()
    kw = dict(kv_lengths=lengths, sinks=sinks, lse_sink="excluded")
    assert _judge(q, k, v, out, keys_only, "float32", **kw).passed is True
    filled = np.where(np.isneginf(keys_only), sinks[None, :, None], keys_only)  # the sink on empty rows
    r = _judge(q, k, v, out, filled, "float32", **kw)
    assert r.lse.passed is False and "finite value" in _notes(r)


def test_the_empty_rows_infinity():
    q, k, v, _ = _problem("float32")
    lengths = np.array([S, 0])
    out, lse = _kernel(q, k, v, "float32", kv_lengths=lengths)
    plus = np.where(np.isneginf(lse), np.inf, lse)  # FlashAttention's softmax_lse
    for given in (lse, plus):
        assert _judge(q, k, v, out, given, "float32", kv_lengths=lengths).lse.passed is True
    assert _judge(q, k, v, out, plus, "float32", kv_lengths=lengths, lse_empty="+inf").lse.passed is True
    r = _judge(q, k, v, out, plus, "float32", kv_lengths=lengths, lse_empty="-inf")
    assert r.lse.passed is False
    assert "hold +inf (FlashAttention's convention)" in _notes(r) and "lse_empty='+inf'" in _notes(r)
    assert "matches that of" not in _notes(r)  # the seen rows are right: only the empty rows are named
    r = _judge(q, k, v, out, lse, "float32", kv_lengths=lengths, lse_empty=math.inf)
    assert r.lse.passed is False and "hold -inf" in _notes(r)


def test_the_cli_and_the_pytest_helper_take_the_convention(tmp_path, capsys):
    q, k, v, _ = _problem("float32")
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    out, lse = _kernel(q, k, v, "float32", causal=True)
    argv = ["--layout", "bhsd", "--causal"]
    for n, x in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", (lse / LN2).astype(np.float32))):
        np.save(tmp_path / f"{n}.npy", x.astype(np.float32))
        argv += [f"--{n}", str(tmp_path / f"{n}.npy")]
    assert check.main(argv + ["--lse-base", "2"]) == 0
    assert "lse base 2" in capsys.readouterr().out
    assert check.main(argv) == 1
    assert "pass lse_base=2 (--lse-base 2)" in capsys.readouterr().out
    assert check.main(argv + ["--lse-base", "2", "--lse-empty=-inf"]) == 0
    assert_attention_close(out, q, k, v, lse=lse / LN2, layout="bhsd", causal=True, lse_base=2)
    with pytest.raises(AssertionError, match="base 2"):
        assert_attention_close(out, q, k, v, lse=lse / LN2, layout="bhsd", causal=True)


@pytest.mark.parametrize("kw, word", [(dict(lse_base=10), "lse_base"), (dict(lse_base="2.0"), "lse_base"),
                                      (dict(lse_sink="yes"), "lse_sink"), (dict(lse_empty=0.0), "lse_empty"),
                                      (dict(lse_empty="nan"), "lse_empty"), (dict(lse_base=True), "lse_base")])
def test_a_bad_convention_is_named(kw, word):
    with pytest.raises(ValueError, match=word):
        LseConvention.parse(**kw)
    q, k, v, _ = _problem("float32")
    out, lse = _kernel(q, k, v, "float32")
    with pytest.raises(check.UnusableInput, match=word):
        _judge(q, k, v, out, lse, "float32", **kw)


def test_the_convention_parses_its_spellings():
    assert LseConvention.parse() == LseConvention.parse("e", "included", None) == LseConvention.parse(math.e)
    assert LseConvention.parse(2).factor == LseConvention.parse("2").factor == LN2
    assert LseConvention.parse(lse_empty="+inf").empty == LseConvention.parse(lse_empty=math.inf).empty == math.inf
    assert LseConvention.parse(lse_empty="-inf").empty == -math.inf
    assert LseConvention.parse().is_default and not LseConvention.parse(2).is_default


def test_the_api_returns_each_convention():
    torch = pytest.importorskip("torch")
    from attnlib import merge_attention, reference_attention

    q, k, v, sinks = _problem("float64")
    ref_out, ref_lse = attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    _, keys_lse = attention(q, k, v, causal=True, return_lse=True)
    for run in (attention, reference_attention):
        out, lse = run(q, k, v, causal=True, sinks=sinks, return_lse=True, lse_sink="excluded", lse_base=2)
        assert np.abs(out - ref_out).max() < 1e-14 and np.abs(lse * LN2 - keys_lse).max() < 1e-13
        out, lse = run(q, k, v, causal=True, sinks=sinks, return_lse=True, lse_base="2")
        assert np.abs(lse * LN2 - ref_lse).max() < 1e-13
    t = [torch.tensor(x) for x in (q, k, v)]
    out, lse = attention(*t, causal=True, sinks=sinks, return_lse=True, lse_sink="excluded")
    assert isinstance(lse, torch.Tensor) and np.abs(lse.numpy() - keys_lse).max() < 1e-13
    assert np.abs(out.numpy() - ref_out).max() < 1e-14
    lengths = np.array([S, 0])
    _, lse = attention(q, k, v, kv_lengths=lengths, return_lse=True, lse_empty="+inf")
    assert np.isposinf(lse[1]).all() and np.isfinite(lse[0]).all()
    # A base-2 merge: the partials' lse in base 2 in, base 2 out, as the natural merge.
    halves = [attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True) for a, b in ((0, 20), (20, S))]
    out_e, lse_e = merge_attention([h[0] for h in halves], [h[1] for h in halves])
    out_2, lse_2 = merge_attention([h[0] for h in halves], [h[1] / LN2 for h in halves], lse_base=2)
    assert np.abs(out_2 - out_e).max() < 1e-15 and np.abs(lse_2 * LN2 - lse_e).max() < 1e-13
    with pytest.raises(ValueError, match="return_lse"):
        attention(q, k, v, lse_base=2)
    with pytest.raises(ValueError, match="lse_sink"):
        attention(q, k, v, lse_sink="no", return_lse=True)
    with pytest.raises(TypeError):
        merge_attention([halves[0][0]], [np.zeros((B, H, S), dtype=int)], lse_base=2)


def test_a_low_precision_keeps_its_output_type_with_the_sink_excluded():
    q, k, v, sinks = _problem("float32")
    out, lse = attention(q, k, v, causal=True, sinks=sinks, compute_dtype="float32", return_lse=True,
                         lse_sink="excluded")
    assert out.dtype == np.float32


def test_the_varlen_layout_judges_each_convention():
    """The padding rows of the thd layout hold what the told convention gives a row without
    keys (found by review: they held attnlib's own values, failing correct kernels)."""
    from attnlib import attention_varlen

    r = np.random.default_rng(0)
    cq, ck = np.array([0, 20, 50]), np.array([0, 30, 70])
    q = r.standard_normal((50, 4, 32)).astype(np.float32)
    k, v = (r.standard_normal((70, 2, 32)).astype(np.float32) for _ in range(2))
    sinks = r.standard_normal(4)
    out, lse = attention_varlen(q, k, v, cq, ck, return_lse=True, compute_dtype="float32", causal=True, sinks=sinks)
    out_k, keys = attention_varlen(q, k, v, cq, ck, return_lse=True, compute_dtype="float32", causal=True)
    kw = dict(layout="thd", cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True)
    assert check.check_kernel(q, k, v, out, lse=lse / LN2, sinks=sinks, lse_base=2, **kw).lse.passed is True
    assert check.check_kernel(q, k, v, out, lse=keys, sinks=sinks, lse_sink="excluded", **kw).lse.passed is True
    assert check.check_kernel(q, k, v, out_k, lse=keys, lse_empty="+inf", **kw).lse.passed is True
    assert check.check_kernel(q, k, v, out, lse=keys, sinks=sinks, **kw).lse.passed is False  # not told


def test_a_base_2_merge_reads_lists_and_bfloat16_in_base_2():
    """Found by review: lses that are no numpy float array were merged as natural ones."""
    import ml_dtypes
    from attnlib import merge_attention

    q, k, v, _ = _problem("float64")
    halves = [attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True) for a, b in ((0, 20), (20, S))]
    _, lse_e = merge_attention([h[0] for h in halves], [h[1] for h in halves])
    _, from_lists = merge_attention([h[0] for h in halves], [(h[1] / LN2).tolist() for h in halves], lse_base=2)
    assert np.abs(from_lists * LN2 - lse_e).max() < 1e-13
    b16 = [(h[1] / LN2).astype(ml_dtypes.bfloat16) for h in halves]
    _, from_b16 = merge_attention([h[0] for h in halves], b16, lse_base=2)
    want = merge_attention([h[0] for h in halves], [x.astype(np.float64) * LN2 for x in b16])[1]
    assert np.abs(from_b16 * LN2 - want).max() < 1e-12
    with pytest.raises(ValueError, match="lse_sink"):
        LseConvention.parse(lse_sink=np.array(["excluded"]))
