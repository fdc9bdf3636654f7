"""Edges of issue 24 in the numerical core: a correct result or a clear error, never a
silently wrong number (mask_mod with another function's block mask, values near float64's
range, wrongly shaped outputs in the metrics, merge_attention's inputs, zero-size batches,
kv_splits beyond the key tiles, strict mode on extreme finite inputs, torch-written mods
and FlexAttention block masks)."""

import numpy as np
import pytest

import attnlib
from attnlib import _args, create_block_mask
from attnlib.backward import attention_backward, reference_attention_backward
from attnlib.metrics import expected_rescales, max_rescales
from attnlib.reference import reference_rescales

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
    assert _args.value_exponent(1e3, 10**6) == 0
    assert _args.value_exponent(1e308, 2) > 0
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
    for fn in (attnlib.metrics.naive_rel_error, attnlib.metrics.max_abs_error, attnlib.metrics.normwise_error):
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
