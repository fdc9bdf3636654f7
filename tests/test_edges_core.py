"""Edges of issue 24 in the numerical core: a correct result or a clear error, never a
silently wrong number (mask_mod with another function's block mask, values near float64's
range, wrongly shaped outputs in the metrics, merge_attention's inputs, zero-size batches,
kv_splits beyond the key tiles, strict mode on extreme finite inputs, torch-written mods
and FlexAttention block masks)."""

import numpy as np
import pytest

import attnlib
from attnlib.core import problem
from attnlib import create_block_mask
from attnlib.core.backward import attention_backward, reference_attention_backward
from attnlib.judge.metrics import expected_rescales, max_rescales
from attnlib.core.reference import reference_rescales

STRICT = dict(divide="raise", over="raise", invalid="raise")


def causal_mod(b, h, i, j):
    return j <= i


# -- 1. mask_mod with a block mask made from another function ----------------------------------


@pytest.mark.parametrize("other", [lambda b, h, i, j: j >= 0, lambda b, h, i, j: (j % 3) != 1])
def test_mask_mod_and_another_block_mask_apply_both(other):
    q, k, v = attnlib.random_qkv(40, 40, 8, seed=0)
    bm = create_block_mask(other, None, None, 40, 40, 16, 16)
    want = attnlib.reference_attention(
        q, k, v, mask_mod=lambda b, h, i, j: causal_mod(b, h, i, j) & other(b, h, i, j))
    with np.errstate(**STRICT):
        out = attnlib.attention(q, k, v, mask_mod=causal_mod, block_mask=bm)
        ref = attnlib.reference_attention(q, k, v, mask_mod=causal_mod, block_mask=bm)
    assert np.abs(ref - want).max() == 0
    assert np.abs(out - want).max() < 1e-15
    dout = np.random.default_rng(1).standard_normal(out.shape)
    o, lse = attnlib.attention(q, k, v, mask_mod=causal_mod, block_mask=bm, return_lse=True)
    grads = attention_backward(q, k, v, o, lse, dout, mask_mod=causal_mod, block_mask=bm)
    ref_grads = reference_attention_backward(
        q, k, v, dout, mask_mod=lambda b, h, i, j: causal_mod(b, h, i, j) & other(b, h, i, j))
    for g, r in zip(grads, ref_grads):
        assert np.abs(g - r).max() < 1e-14


def test_block_mask_of_the_same_mask_mod_keeps_its_full_tiles():
    q, k, v = attnlib.random_qkv(64, 64, 8, seed=2)
    bm = create_block_mask(causal_mod, None, None, 64, 64, 16, 16)
    _, stats = attnlib.attention(q, k, v, mask_mod=causal_mod, block_mask=bm, return_stats=True)
    assert (stats.tile_kind == 2).sum() == 6  # the FULL tiles below the diagonal stay FULL
    other = create_block_mask(lambda b, h, i, j: j >= 0, None, None, 64, 64, 16, 16)
    _, stats = attnlib.attention(q, k, v, mask_mod=causal_mod, block_mask=other, return_stats=True)
    assert (stats.tile_kind == 2).sum() == 0  # mask_mod is evaluated on every tile


def test_check_judges_mask_mod_and_another_block_mask_together():
    from attnlib.check import check_kernel

    q, k, v = (x.astype(np.float32)[None, None] for x in attnlib.random_qkv(40, 40, 8, seed=0))
    bm = create_block_mask(lambda b, h, i, j: j >= 0, None, None, 40, 40, 16, 16)
    right = attnlib.reference_attention(q, k, v, causal=True).astype(np.float32)
    wrong = attnlib.reference_attention(q, k, v).astype(np.float32)  # the block mask's mask alone
    assert check_kernel(q, k, v, right, mask_mod=causal_mod, block_mask=bm, layout="bhsd").passed
    assert not check_kernel(q, k, v, wrong, mask_mod=causal_mod, block_mask=bm, layout="bhsd").passed


# -- 2. values near float64's range --------------------------------------------------------------


@pytest.mark.parametrize("size", [1e308, float(np.finfo(np.float64).max)])
def test_values_near_the_range_give_a_finite_exact_output(size):
    q, k, v = attnlib.random_qkv(50, 70, 8, seed=0)
    v = np.sign(v) * size
    with np.errstate(**STRICT):
        ref = attnlib.reference_attention(q, k, v, causal=True)
        for options in (dict(), dict(kv_splits=3), dict(rescale_threshold=8.0)):
            out = attnlib.attention(q, k, v, causal=True, block_q=16, block_k=16, **options)
            assert np.isfinite(out).all()
            assert np.abs(out - ref).max() / size < 1e-15
        with_sink = attnlib.attention(q, k, v, causal=True, block_q=16, block_k=16, sinks=np.array([1.0]))
        ref_sink = attnlib.reference_attention(q, k, v, causal=True, sinks=np.array([1.0]))
    assert np.abs(with_sink - ref_sink).max() / size < 1e-15
    assert np.isfinite(ref).all() and np.abs(ref).max() <= size


def test_values_near_the_range_stream_and_low_precision():
    q, k, v = attnlib.random_qkv(8, 64, 4, seed=3)
    big = np.sign(v) * 1e308
    with np.errstate(**STRICT):
        out = attnlib.attention_stream(q, [(k[:32], big[:32]), (k[32:], big[32:])])
    ref = attnlib.reference_attention(q, k, big)
    assert np.isfinite(out).all() and np.abs(out - ref).max() / 1e308 < 1e-15
    bf = np.sign(v).astype(np.float32) * np.float32(3e38)  # float32's range, summed in float32
    with np.errstate(**STRICT):
        low = attnlib.attention(q, k, bf, compute_dtype="float32")
        naive = attnlib.reference_attention(q, k, bf, compute_dtype="float32")
    assert np.isfinite(low).all() and np.isfinite(naive).all()


def test_ordinary_values_are_not_scaled():
    assert problem.value_exponent(1e3, 10**6) == 0
    assert problem.value_exponent(1e308, 2) > 0
    q, k, v = attnlib.random_qkv(30, 30, 4, seed=4)
    a = attnlib.attention(q, k, v, block_k=8)
    b = attnlib.attention(q, k, v * 2.0 ** 100, block_k=8) / 2.0 ** 100
    assert np.array_equal(a, b)  # no scaling: the power of two passes through exactly


def test_gradients_with_values_near_the_range():
    rng = np.random.default_rng(0)
    q, k, _ = attnlib.random_qkv(5, 7, 8, seed=0)
    v = rng.standard_normal((7, 8)) * 1e307
    dout = rng.standard_normal((5, 8))
    out, lse = attnlib.attention(q, k, v, return_lse=True)
    with np.errstate(**STRICT):
        grads = attention_backward(q, k, v, out, lse, dout)
        ref = reference_attention_backward(q, k, v, dout)
        small = reference_attention_backward(q, k, v / 1e300, dout)
    for g, r, s in zip(grads, ref, small):
        assert np.isfinite(g).all()
        assert np.abs(g - r).max() <= 1e-14 * np.abs(r).max()
    assert np.abs(ref[0] / 1e300 - small[0]).max() <= 1e-14 * np.abs(small[0]).max()
    assert np.array_equal(ref[2], small[2])  # dv does not depend on v


def test_gradients_beyond_the_range_are_an_error_naming_them():
    rng = np.random.default_rng(0)
    q, k, _ = attnlib.random_qkv(5, 7, 8, seed=0)
    v = rng.standard_normal((7, 8)) * 1e307
    dout = rng.standard_normal((5, 8)) * 1e300  # dv = P^T dout is fine, dq ~ 1e307 * 1e300 is not
    out, lse = attnlib.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="dq exceeds float64's range"):
        attention_backward(q, k, v, out, lse, dout)
    with pytest.raises(ValueError, match="lse does not match"):
        attention_backward(q, k * 1e150, v / 1e307, out, lse, dout / 1e300)


# -- 3. metrics refuse wrongly shaped outputs -----------------------------------------------------


def test_error_metrics_refuse_outputs_that_would_broadcast():
    q = np.ones((4, 3))
    k, v = attnlib.random_qkv(4, 5, 3, seed=0)[1:]
    ref = attnlib.reference_attention(q, k, v)
    assert attnlib.attention_errors(ref, q, k, v).rel_error == 0.0
    for bad in (ref[:1], ref[None], ref[:, :1], ref.T):
        with pytest.raises(ValueError, match="out has shape"):
            attnlib.attention_errors(bad, q, k, v)
    for fn in (attnlib.judge.metrics.naive_rel_error, attnlib.judge.metrics.max_abs_error, attnlib.judge.metrics.normwise_error):
        with pytest.raises(ValueError, match="out has shape"):
            fn(ref[:1], ref)
    dout = np.ones_like(ref)
    grads = reference_attention_backward(q, k, v, dout)
    with pytest.raises(ValueError, match="dk has shape"):
        attnlib.gradient_errors((grads[0], grads[1][:1], grads[2]), q, k, v, dout)
    with pytest.raises(TypeError, match="out must have a real floating dtype"):
        attnlib.attention_errors(ref.astype(complex), q, k, v)


# -- 4. merge_attention ----------------------------------------------------------------------------


def test_merge_attention_refuses_non_finite_outs_and_0d():
    out, lse = np.ones((3, 2)), np.zeros(3)
    for bad in (np.nan, np.inf):
        o = out.copy()
        o[1, 0] = bad
        with pytest.raises(ValueError, match=r"outs\[1\] contains NaN or inf"):
            attnlib.merge_attention([out, o], [lse, lse])
    with pytest.raises(ValueError, match=r"outs\[0\] must have shape"):
        attnlib.merge_attention([np.float64(1.0)], [np.float64(0.0)])
    with pytest.raises(ValueError, match=r"outs\[0\] must have shape"):
        attnlib.merge_attention([np.ones(2)], [np.float64(0.0)])


def test_merge_attention_at_the_range():
    big = float(np.finfo(np.float64).max)
    with np.errstate(**STRICT):
        out, lse = attnlib.merge_attention([np.full((2, 3), big), np.full((2, 3), big)],
                                           [np.zeros(2), np.zeros(2)])
        assert np.array_equal(out, np.full((2, 3), big)) and np.allclose(lse, np.log(2))
        out, lse = attnlib.merge_attention([np.ones((2, 3)), np.zeros((2, 3))],
                                           [np.array([-1.7e308, 1.7e308]), np.array([1.7e308, -1.7e308])])
    assert np.array_equal(out, [[0, 0, 0], [1, 1, 1]]) and np.array_equal(lse, [1.7e308, 1.7e308])


# -- 6. zero-size batch axes ------------------------------------------------------------------------


@pytest.mark.parametrize("options", [dict(return_stats=True, return_lse=True), dict(kv_splits=3, return_stats=True),
                                     dict(mask_mod=causal_mod), dict(mask_mod=causal_mod, return_stats=True),
                                     dict(kv_lengths=np.zeros(0, int), return_stats=True)])
def test_zero_size_batch(options):
    q, k = np.zeros((0, 2, 5, 4)), np.zeros((0, 2, 6, 4))
    result = attnlib.attention(q, k, k, **options)
    out = result[0] if isinstance(result, tuple) else result
    assert out.shape == (0, 2, 5, 4)
    if options.get("return_stats"):
        stats = result[-1]
        assert stats.processed_tiles == 0 and stats.rescales.shape[0] == 0
    ref = attnlib.reference_attention(q, k, k, **{n: x for n, x in options.items() if not n.startswith(("return", "kv_s"))})
    assert ref.shape == (0, 2, 5, 4)


# -- 7. kv_splits is capped at the key tiles ----------------------------------------------------------


def test_kv_splits_beyond_the_key_tiles():
    q, k, v = attnlib.random_qkv(3, 12, 4, seed=0)
    ref = attnlib.reference_attention(q, k, v)
    one = attnlib.attention(q, k, v, kv_splits=6, block_k=2)
    huge = attnlib.attention(q, k, v, kv_splits=10 ** 9, block_k=2, return_stats=True)
    assert np.array_equal(one, huge[0]) and np.abs(one - ref).max() < 1e-15


# -- 8. strict mode on extreme finite inputs ------------------------------------------------------------


def test_scores_at_the_range_under_strict_mode():
    q = np.zeros((4, 8))
    k = np.zeros((6, 8))
    q[:, 0], k[:, 0] = 1.2e154, 1.2e154 * np.array([-1, 1, -1, 1, -1, 1])  # scores of +-1.44e308
    v = np.random.default_rng(0).standard_normal((6, 8))
    with np.errstate(**STRICT):
        out, lse = attnlib.attention(q, k, v, scale=1.0, return_lse=True)
        ref, ref_lse = attnlib.reference_attention(q, k, v, scale=1.0, return_lse=True)
        grads = attention_backward(q, k, v, out, lse, np.ones((4, 8)), scale=1.0)
    want = v[1::2].mean(axis=0)  # the three keys of score +1.44e308 share the weight
    assert np.abs(out - want).max() < 1e-15 and np.abs(ref - want).max() < 1e-15
    assert np.allclose(lse, 1.44e308 + np.log(3), rtol=1e-15) and np.array_equal(lse, ref_lse)
    assert all(np.isfinite(g).all() for g in grads)


def test_tiny_softcap_under_strict_mode():
    q, k, v = attnlib.random_qkv(10, 12, 4, seed=1)
    with np.errstate(**STRICT):
        out = attnlib.attention(q, k, v, softcap=1e-320)
        ref = attnlib.reference_attention(q, k, v, softcap=1e-320)
    assert np.abs(out - ref).max() < 1e-15


# -- 10. rescale counts refuse bad tile sizes --------------------------------------------------------


@pytest.mark.parametrize("call, name", [
    (lambda: reference_rescales(np.zeros((4, 4)), 0, 4), "block_q"),
    (lambda: reference_rescales(np.zeros((4, 4)), 2, -1), "block_k"),
    (lambda: reference_rescales(np.zeros(4), 2, 2), "scores"),
    (lambda: reference_rescales(np.zeros((4, 4)), 2, 2, threshold=-1.0), "threshold"),
    (lambda: expected_rescales(8, 8, 0, 4), "block_q"),
    (lambda: max_rescales(8, 8, 4, 0), "block_k"),
    (lambda: max_rescales(-1, 8, 4, 4), "sq"),
])
def test_rescale_counts_refuse_bad_sizes(call, name):
    with pytest.raises((ValueError, TypeError), match=name):
        call()


# -- 15. torch-written mods and FlexAttention block masks -----------------------------------------------


def test_torch_written_mods_and_block_masks_need_no_wrapper():
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    q, k, v = attnlib.random_qkv(40, 40, 8, seed=0)
    q, k, v = np.stack([q, q / 2]), np.stack([k, k]), np.stack([v, v])
    doc = torch.tensor([0] * 20 + [1] * 20)
    ids = np.repeat([0, 1], 20)
    want = attnlib.reference_attention(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids)

    def documents(b, h, i, j):
        return (doc[i] == doc[j]) & (i >= j)

    assert np.abs(attnlib.attention(q, k, v, mask_mod=documents) - want).max() < 1e-15
    block = torch_block_mask(documents, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    out, stats = attnlib.attention(q, k, v, block_mask=block, return_stats=True)
    assert np.abs(out - want).max() < 1e-15 and stats.block_q == 16
    assert np.abs(attnlib.reference_attention(q, k, v, block_mask=block) - want).max() < 1e-15
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)

    def alibi(score, b, h, i, j):
        return score - slopes[h] * (i - j).abs()

    got = attnlib.attention(q, k, v, score_mod=alibi)
    ref = attnlib.reference_attention(q, k, v, score_mod=lambda s, b, h, i, j: s - np.array([0.5, 0.25])[h] * np.abs(i - j))
    assert np.abs(got - ref).max() < 1e-15


def test_a_mod_that_fails_both_ways_names_from_torch():
    pytest.importorskip("torch")
    q, k, v = attnlib.random_qkv(8, 8, 4, seed=0)

    def broken(b, h, i, j):
        raise KeyError("no such table")

    with pytest.raises((TypeError, KeyError), match="from_torch|no such table"):
        attnlib.attention(q, k, v, mask_mod=broken)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        attnlib.attention(q, k, v, block_mask=object())


# -- the second adversarial pass ------------------------------------------------------------------


@pytest.mark.parametrize("size", [1e8, 1e16, 1e100])
def test_split_partials_of_tied_large_scores_merge_exactly(size):
    q, k, v = np.array([[size]]), np.full((3, 1), 1.0), np.array([[1.0], [2.0], [3.0]])
    ref = attnlib.reference_attention(q, k, v, scale=1.0)
    assert ref[0, 0] == 2.0
    for splits in (2, 3):
        assert attnlib.attention(q, k, v, scale=1.0, kv_splits=splits, block_k=1)[0, 0] == 2.0
    with np.errstate(**STRICT):
        out, lse = attnlib.attention(q, k, v, scale=1.0, kv_splits=2, block_k=1, return_lse=True)
    assert lse[0] == size + np.log(3.0)


def test_backward_with_a_tiny_scale_and_a_huge_dout():
    q, k = np.full((1, 2, 1), 1e150), np.full((1, 3, 1), 1e150)
    v, dout = np.array([[[1.0], [2.0], [3.0]]]), np.full((1, 2, 1), 1e300)
    out, lse = attnlib.attention(q, k, v, scale=1e-300, return_lse=True)
    with np.errstate(**STRICT):
        grads = attention_backward(q, k, v, out, lse, dout, scale=1e-300)
        ref = reference_attention_backward(q, k, v, dout, scale=1e-300)
    want_dk = np.array([-2, 0, 2]) / 3 * 1e150  # ds_j = p_j (v_j - out) dout, times scale q
    for g, r in zip(grads, ref):
        assert np.isfinite(g).all() and np.isfinite(r).all()
    assert np.allclose(grads[1][0, :, 0], want_dk, rtol=1e-14) and np.allclose(grads[2], 2e300 / 3, rtol=1e-15)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cap", [1e-300, 1e300])
def test_a_softcap_beyond_float32_is_refused_for_low_precision(dtype, cap):
    pytest.importorskip("ml_dtypes")
    q, k, v = np.zeros((1, 1, 2)), np.eye(2)[None], np.eye(2)[None]
    for fn in (attnlib.attention, attnlib.reference_attention):
        with pytest.raises(ValueError, match="softcap"):
            fn(q, k, v, softcap=cap, compute_dtype=dtype)
        assert np.allclose(fn(q, k, v, softcap=cap), 0.5)


@pytest.mark.parametrize("mod, name", [
    (dict(score_mod=lambda s, b, h, i, j: s - s.mean()), "score_mod"),
    (dict(score_mod=lambda s, b, h, i, j: s.sum()), "score_mod"),
    (dict(mask_mod=lambda b, h, i, j: i >= j.max()), "mask_mod"),
])
def test_mods_that_are_not_elementwise_are_refused(mod, name):
    q, k, v = attnlib.random_qkv(16, 16, 4, seed=0)
    for fn in (attnlib.attention, attnlib.reference_attention):
        with pytest.raises(ValueError, match=f"{name} is not elementwise"):
            fn(q, k, v, **mod)
    # Constants and functions of the positions alone are elementwise.
    attnlib.attention(q, k, v, score_mod=lambda s, b, h, i, j: 0.0)
    attnlib.attention(q, k, v, score_mod=lambda s, b, h, i, j: -np.abs(i - j))


def test_sinks_and_slopes_are_bounded_by_the_type_the_scores_are_kept_in():
    from attnlib.check import check_kernel

    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 5, 2, 4)).astype(np.float32) for _ in range(3))
    sinks = np.full(2, 9e29)  # within float32's 1e30; the check's doubled scores go beyond it
    out = attnlib.attention(*(np.swapaxes(x, 1, 2) for x in (q, k, v)), sinks=sinks, compute_dtype="float32")
    assert check_kernel(q, k, v, np.swapaxes(out, 1, 2), sinks=sinks).passed
    assert not check_kernel(q, k, v, np.swapaxes(out, 1, 2) + np.float32(1e-3), sinks=sinks).passed  # out is 0


def test_metrics_gates_and_merge_read_tensors_or_name_the_argument():
    torch = pytest.importorskip("torch")
    from attnlib.judge.gate import Gate, GradientGate

    q, k, v = attnlib.random_qkv(6, 7, 4, seed=0)
    out, lse = attnlib.attention(q, k, v, return_lse=True)
    assert attnlib.attention_errors(out, q, k, torch.tensor(v, requires_grad=True)).rel_error < 1e-15
    assert Gate(q, k, v).judge(torch.tensor(out, requires_grad=True), torch.tensor(lse))["passed"]
    dout = np.ones_like(out)
    grads = attention_backward(q, k, v, out, lse, dout)
    assert GradientGate(q, k, v, dout).judge([torch.tensor(g, requires_grad=True) for g in grads])["passed"]
    merged = attnlib.merge_attention([torch.tensor(out, requires_grad=True)] * 2, [torch.tensor(lse)] * 2)
    assert np.allclose(merged[0], out, rtol=1e-15, atol=0)
    meta = torch.empty(7, 4, device="meta")
    with pytest.raises((TypeError, ValueError), match="v is a torch tensor on the meta device"):
        attnlib.attention_errors(out, q, k, meta)
    with pytest.raises(ValueError, match="v must have at least 2 dimensions"):
        attnlib.attention_errors(out, q, k, np.float64(1.0))
    with pytest.raises((TypeError, ValueError), match="lse is a torch tensor on the meta device"):
        Gate(q, k, v).judge(out, torch.empty(6, device="meta"))
    with pytest.raises((TypeError, ValueError), match=r"outs\[0\] is a numpy masked array"):
        attnlib.merge_attention([np.ma.masked_array(out, mask=True)], [lse])


@pytest.mark.parametrize("call, words", [
    (lambda: attnlib.random_qkv(10 ** 9, d=4), "random_qkv"),
    (lambda: attnlib.random_qkv(10, d=10 ** 12), "random_qkv"),
    (lambda: attnlib.random_qkv(8, heads=10 ** 12), "random_qkv"),
    (lambda: expected_rescales(10 ** 15, 10 ** 15, 1, 1), "block_k"),
    (lambda: max_rescales(10 ** 15, 10 ** 15, 1, 1), "block_k"),
])
def test_sizes_beyond_the_machine_are_refused_before_allocating(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_rescale_recount_with_tiles_larger_than_the_scores():
    s = attnlib.reference_scores(*attnlib.random_qkv(6, 9, 4, seed=1)[:2], causal=True)
    assert np.array_equal(reference_rescales(s, 10 ** 15, 10 ** 15), reference_rescales(s, 6, 9))


# -- the third adversarial pass ---------------------------------------------------------------------


def test_sink_weights_below_the_range_under_strict_mode():
    q, k, v = np.array([[1.0], [0.5]]), np.array([[1.44e308], [-1.44e308], [1.0]]), np.array([[1.0], [2.0], [3.0]])
    sinks = np.array([-4e307])
    with np.errstate(**STRICT):
        ref = attnlib.reference_attention(q, k, v, scale=1.0, sinks=sinks)
        out, lse = attnlib.attention(q, k, v, scale=1.0, sinks=sinks, return_lse=True)
        grads = attention_backward(q, k, v, out, lse, np.ones_like(out), scale=1.0, sinks=sinks)
        ref_grads = reference_attention_backward(q, k, v, np.ones_like(out), scale=1.0, sinks=sinks)
    assert np.array_equal(ref, [[1.0], [1.0]]) and np.array_equal(out, ref)
    assert all(np.isfinite(g).all() for g in grads + ref_grads)


def test_alibi_past_the_range_is_refused_as_an_overflowing_score():
    q, k, v = np.ones((2, 1)), np.array([[-1.79e308], [0.5], [1.0], [2.0]]), np.arange(1.0, 5.0)[:, None]
    for fn in (lambda: attnlib.attention(q, k, v, scale=1.0, alibi_slopes=[2.8e306], block_k=1),
               lambda: attnlib.reference_attention(q, k, v, scale=1.0, alibi_slopes=[2.8e306])):
        with np.errstate(**STRICT), pytest.raises(ValueError, match="scores overflow float64"):
            fn()


def test_decimal_oracle_with_large_sinks_and_tiny_softcaps():
    q, k, v = np.array([[1.0]]), np.full((3, 1), 1e100), np.array([[1.0], [2.0], [3.0]])
    got = attnlib.oracle_attention(q, k, v, scale=1.0, sinks=np.array([1e100]), method="decimal")
    assert float(np.asarray(got)[0, 0]) == 1.5
    q, k, v = attnlib.random_qkv(3, 4, 2, seed=0)
    for cap in (1e-30, 1e-300):
        got = np.asarray(attnlib.oracle_attention(q, k, v, softcap=cap, method="decimal"), dtype=np.float64)
        assert np.abs(got - attnlib.reference_attention(q, k, v, softcap=cap)).max() < 1e-15


def test_check_judges_lse_at_scores_near_the_range():
    from attnlib.check import check_kernel

    q, k, v = np.array([[[[1.0], [0.5]]]]), np.array([[[[6e307], [-6e307], [1.0]]]]), np.array([[[[1.0], [2.0], [3.0]]]])
    out, lse = attnlib.attention(q, k, v, scale=1.0, return_lse=True)
    wrong = lse.copy()
    wrong[..., 0] = 0.0
    with np.errstate(**STRICT):
        assert check_kernel(q, k, v, out, lse=lse, layout="bhsd", scale=1.0).passed
        assert not check_kernel(q, k, v, out, lse=wrong, layout="bhsd", scale=1.0).passed


def test_torch_block_masks_without_full_lists_and_with_their_own_batch_and_heads():
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import BlockMask

    counts = torch.tensor([[[1, 2, 3]]], dtype=torch.int32)
    lists = torch.tensor([[[[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 2, 0]]]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(counts, lists, BLOCK_SIZE=16, seq_lengths=(40, 56))  # noop mask_mod
    q, k, v = attnlib.random_qkv(40, 56, 4, seed=0)
    want = attnlib.reference_attention(q, k, v, mask_mod=lambda b, h, i, j: (j // 16) <= (i // 16))
    assert np.abs(attnlib.attention(q, k, v, block_mask=bm) - want).max() < 1e-15
    assert np.abs(attnlib.reference_attention(q, k, v, block_mask=bm) - want).max() == 0


def test_functools_wrapped_mods_are_the_users_own():
    torch = pytest.importorskip("torch")
    import functools

    def deco(f):
        @functools.wraps(f)
        def g(*a):
            return f(*a)
        return g

    q, k, v = attnlib.random_qkv(20, 24, 4, seed=0)
    causal = attnlib.reference_attention(q, k, v, mask_mod=causal_mod)
    assert np.abs(attnlib.attention(q, k, v, mask_mod=deco(lambda b, h, i, j: torch.where(i >= j, True, False)))
                  - attnlib.reference_attention(q, k, v, mask_mod=lambda b, h, i, j: i >= j)).max() < 1e-15

    @functools.wraps(causal_mod)
    def near(b, h, i, j):
        return causal_mod(b, h, i, j) & (i - j <= 2)

    bm = create_block_mask(causal_mod, None, None, 20, 24, 4, 4)
    want = attnlib.reference_attention(q, k, v, mask_mod=lambda b, h, i, j: (j <= i) & (i - j <= 2))
    assert np.abs(attnlib.attention(q, k, v, block_mask=bm, mask_mod=near) - want).max() < 1e-15
    assert np.abs(causal - want).max() > 0.1


@pytest.mark.parametrize("mod", [lambda s, b, h, i, j: np.cumsum(s, -1) * 0.2, lambda s, b, h, i, j: s - s[..., :1]])
def test_prefix_reductions_are_not_elementwise(mod):
    q, k, v = attnlib.random_qkv(16, 16, 4, seed=0)
    with pytest.raises(ValueError, match="score_mod is not elementwise"):
        attnlib.attention(q, k, v, score_mod=mod)


def test_the_probe_takes_mods_valid_on_positive_scores():
    q, k, v = (np.abs(x) for x in attnlib.random_qkv(16, 16, 4, seed=0))
    with np.errstate(**STRICT):
        out = attnlib.attention(q, k, v, score_mod=lambda s, b, h, i, j: np.sqrt(s))
    ref = attnlib.reference_attention(q, k, v, score_mod=lambda s, b, h, i, j: np.sqrt(s))
    assert np.abs(out - ref).max() < 1e-15


def test_values_just_below_the_scaling_threshold_keep_their_bits():
    top = float(np.finfo(np.float64).max)
    assert problem.value_exponent(0.99 * (top / 16), 4) == 0  # 4 keys: n max|v| below a quarter
    assert problem.value_exponent(1.01 * (top / 16), 4) == 1
