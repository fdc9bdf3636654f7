"""The check has power at every magnitude (issue 23): wrong kernels fail and correct ones pass
whatever the size of ``v`` and ``dout``, in every low precision, forward and backward.

Under the earlier rule an all-zero bfloat16 output passed every problem whose values were
1e-4 (FlashAttention's absolute term is anchored at 0.3), and float32 gradients scaled by
1 + 1e-3 passed (a worst-case ``8 N u`` bound)."""

import math

import ml_dtypes  # noqa: F401  (bfloat16; the test extra installs it)
import numpy as np
import pytest

import attnlib
from attnlib import check
from attnlib.core.backward import FORMULATIONS, reference_attention_backward
from attnlib.core.options import Options
from attnlib.check import power
from attnlib.check.rule import doubled_options, forward_rss

SMALL = (1, 4, 2, 128, 128, 32, True)  # batch, Hq, Hk, Sq, Sk, D, causal


@pytest.mark.parametrize("prec, magnitude", [("bfloat16", 1e-6), ("bfloat16", 1e2), ("float16", 1e-4),
                                             ("float32", 1e-4), ("float32", 1e4)])
@pytest.mark.slow
def test_wrong_kernels_fail_and_correct_ones_pass(prec, magnitude):
    rows = power.measure(precisions=(prec,), magnitudes=(magnitude,), shapes=(SMALL,))
    wrong = [r for r in rows if r["kind"] == "wrong"]
    correct = [r for r in rows if r["kind"] == "correct"]
    assert len(wrong) >= 10 and len(correct) >= 2
    missed = [(r["kernel"], r["ratio"]) for r in wrong if r["passed"]]
    alarms = [(r["kernel"], r["failed_tensors"], r["ratio"]) for r in correct if not r["passed"]]
    assert not missed and not alarms, (missed, alarms)


@pytest.mark.slow
def test_decode_wrong_kernels_fail_in_bfloat16_at_small_values():
    rows = power.measure(precisions=("bfloat16",), magnitudes=(1e-4,), shapes=((2, 4, 4, 1, 512, 64, False),))
    missed = [r["kernel"] for r in rows if r["kind"] == "wrong" and r["passed"]]
    alarms = [r["kernel"] for r in rows if r["kind"] == "correct" and not r["passed"]]
    assert not missed and not alarms, (missed, alarms)


@pytest.mark.slow
def test_zero_output_of_small_values_fails_as_it_did_not_before():
    """The issue's case: bfloat16, v scaled by 1e-4, (1, 4, 384, 64) causal."""
    q, k, v, _, _ = power.problem((1, 4, 4, 384, 384, 64, True), "bfloat16", 1e-4)
    right = attnlib.attention(q, k, v, causal=True)
    rounded = right.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert check.check_kernel(q, k, v, rounded, layout="bhsd", causal=True, dtype="bfloat16").passed
    r = check.check_kernel(q, k, v, np.zeros_like(right), layout="bhsd", causal=True, dtype="bfloat16")
    assert not r.passed and r.out.ratio > 10, check.format_text(r)


@pytest.mark.slow
def test_float32_gradients_off_by_1e_4_fail_at_long_rows():
    """A worst-case ``8 N u`` bound let 1e-3 through at n = 1024; in ulps of each entry's own
    size the rule catches 1e-4 at n = 2048 (the report runs 8192), while the correct
    gradient rounded to float32 passes."""
    n = 2048
    q, k, v, dout, _ = power.problem((1, 1, 1, n, n, 64, True), "float32", 1.0)
    out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True)
    grads = [g.astype(np.float32).astype(np.float64)
             for g in attnlib.attention_backward(q, k, v, out, lse, dout, causal=True)]
    kw = dict(layout="bhsd", causal=True, dtype="float32", dout=dout)
    good = check.check_kernel(q, k, v, out, dq=grads[0], dk=grads[1], dv=grads[2], **kw)
    assert all(g.passed for g in good.grads.values()), check.format_text(good)
    bad = [g * (1 + 1e-4) for g in grads]
    r = check.check_kernel(q, k, v, out, dq=bad[0], dk=bad[1], dv=bad[2], **kw)
    assert all(g.passed is False for g in r.grads.values()), check.format_text(r)


def test_forward_rss_is_the_root_sum_square_of_the_terms():
    q, k, v = attnlib.random_qkv(9, 13, 4, batch=(2,), heads=2, seed=3)
    sinks = np.array([0.5, -1.0])
    for options in (dict(causal=True), dict(softcap=2.0, sinks=sinks), dict(window=(3, 1), scale=0.7)):
        full = dict(causal=False, causal_align="bottom_right", window=None, softcap=None, scale=None,
                    kv_lengths=None, sinks=None) | options
        out, lse = attnlib.attention(q, k, v, return_lse=True, **full)
        rss = forward_rss(lambda q, k, v, o: attnlib.attention(q, k, v, return_lse=True, **o.given()),
                          q, k, v, Options.parse(**full), lse)
        p = np.exp(_scores(q, k, full) - lse[..., None])  # the weights, sink column excluded
        assert np.allclose(rss, np.sqrt((p * p) @ (v * v)), rtol=1e-12, atol=0)


def test_reference_sizes_come_with_the_reference_bits_in_one_pass():
    """The reference of `reference_sizes` is the tiled kernel's, bit for bit, and its sizes are
    the root-sum-squares of the terms: ``sqrt(sum p**2 v**2)`` and ``sqrt(sum p**2 (v - out)**2)``,
    on every path a state takes (GQA packing, sinks, document blocks, padding; torch)."""
    from attnlib.check.sizes import reference_sizes
    q, k, v = attnlib.random_qkv(300, d=16, batch=(2,), heads=4, kv_heads=2, seed=3)
    docs = np.repeat(np.arange(6), 50)[None].repeat(2, 0)
    cases = (dict(causal=True), dict(softcap=2.0, sinks=np.array([0.5, -1.0, 2.0, 0.0])), dict(window=(40, 3)),
             dict(q_segment_ids=docs, kv_segment_ids=docs), dict(kv_lengths=np.array([120, 300])))
    for options in cases:
        opts = Options.parse(**options)
        ref, lse, rss, dev = reference_sizes(q, k, v, opts, workers=2)
        out, lse0 = attnlib.attention(q, k, v, return_lse=True, **options)
        assert np.array_equal(ref, out) and np.array_equal(lse, lse0), options
        s = attnlib.core.reference.reference_scores(q, k, **{n: x for n, x in options.items() if n != "sinks"})
        p = np.exp(s - lse[..., None])  # normalised weights (a sink's: no value)
        vg = np.repeat(v, 2, axis=-3)
        assert np.allclose(rss, np.sqrt((p * p) @ (vg * vg)), rtol=1e-12, atol=0), options
        want = np.einsum("...ij,...ijc->...ic", p * p, (vg[..., None, :, :] - out[..., :, None, :]) ** 2)
        if "sinks" in options:  # the sink's weight, with v = 0
            want += (np.exp(options["sinks"][:, None] - lse) ** 2)[..., None] * out ** 2
        want = np.sqrt(want)
        assert np.allclose(dev, want, rtol=1e-9, atol=1e-7 * rss.max()), options
    torch = pytest.importorskip("torch")
    on_device = reference_sizes(q, k, v, Options.parse(causal=True), 2, torch.device("cpu"))
    for x, y in zip(on_device, reference_sizes(q, k, v, Options.parse(causal=True), 2)):
        assert np.allclose(x, y, rtol=1e-13, atol=1e-13 * np.abs(y).max())


def _scores(q, k, options):
    s = attnlib.core.reference.reference_scores(q, k, **{key: options[key] for key in (
        "causal", "causal_align", "window", "softcap", "scale")})
    return s


def test_doubled_options_double_every_score():
    mod = lambda s, b, h, i, j: s - 0.1 * (i - j)  # noqa: E731
    d = doubled_options(Options.parse(softcap=3.0, sinks=np.array([1.0]), score_mod=mod), 16)
    assert d.scale == 2 / math.sqrt(16) and d.softcap == 6.0 and d.sinks[0] == 2.0
    assert d.score_mod(np.array(4.0), 0, 0, 5, 2) == pytest.approx(2 * mod(2.0, 0, 0, 5, 2))


def test_gradient_rss_by_brute_force():
    """``sqrt(sum_j t_j^2)`` over the terms each gradient entry sums, one entry at a time;
    ``return_rss="dot"`` is the dot products' part alone."""
    q, k, v = attnlib.random_qkv(5, 6, 3, heads=2, kv_heads=1, seed=1)
    dout = np.random.default_rng(1).standard_normal((2, 5, 3))
    _, rss = reference_attention_backward(q, k, v, dout, return_rss=True)
    s = q @ k[0].T / math.sqrt(3)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # (2, 5, 6)
    dp = dout @ v[0].T
    dp_abs = np.abs(dout) @ np.abs(v[0]).T  # what each dp sums, componentwise (rss_accumulate=1)
    a = p * (np.abs(dp) + dp_abs + (p * (np.abs(dp) + dp_abs)).sum(-1, keepdims=True)) / math.sqrt(3)
    dq = np.sqrt(np.einsum("hij,jc->hic", a ** 2, k[0] ** 2))
    dk = np.sqrt(np.einsum("hij,hic->jc", a ** 2, q ** 2))[None]
    dv = np.sqrt(np.einsum("hij,hic->jc", p ** 2, dout ** 2))[None]
    for got, want in zip(rss, (dq, dk, dv)):
        assert np.allclose(got, want, rtol=1e-12)
    _, dot = reference_attention_backward(q, k, v, dout, return_rss="dot")
    a = p * (dp_abs + (p * dp_abs).sum(-1, keepdims=True)) / math.sqrt(3)
    assert np.allclose(dot[0], np.sqrt(np.einsum("hij,jc->hic", a ** 2, k[0] ** 2)), rtol=1e-12)
    assert not dot[2].any()  # dv sums p dout: no dot product's result


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_naive_backward_formulations_are_the_gradient_in_the_type(formulation):
    q, k, v = (x.astype(np.float32).astype(np.float64) for x in attnlib.random_qkv(40, 50, 8, heads=2, seed=2))
    dout = np.random.default_rng(2).standard_normal((2, 40, 8))
    exact = reference_attention_backward(q, k, v, dout, causal=True)
    naive = reference_attention_backward(q, k, v, dout, causal=True, compute_dtype="float32",
                                         formulation=formulation)
    for e, g in zip(exact, naive):
        assert g.dtype == np.float32
        assert np.abs(g - e).max() <= 1e-4 * np.abs(e).max()


@pytest.mark.slow
def test_gradients_beyond_float16s_range_are_reported_not_judged():
    q, k, v, dout, _ = power.problem(SMALL, "float16", 1e4)
    out = attnlib.attention(q, k, v, causal=True)
    r = check.check_kernel(q, k, v, out, dout=dout, dq=np.zeros(q.shape), dk=np.zeros(k.shape),
                           dv=np.zeros(v.shape), layout="bhsd", causal=True, dtype="float16")
    assert r.grads["dq"].passed is None and "beyond float16's range" in r.grads["dq"].notes[0]
    assert r.grads["dv"].passed is False  # dv fits: judged, and the zeros fail


@pytest.mark.slow
def test_half_precision_eager_attention_with_a_small_dout_passes():
    """Hugging Face's eager attention: scores (q k^T) * scale in float16, the softmax upcast to
    float32; its autograd rounds scale * ds in float16, which in the subnormal range (dout
    1e-4) failed dq at 2.8x the allowance before the "eager" naive formulation."""
    import torch

    q, k, v, dout, _ = power.problem((1, 4, 1, 256, 256, 64, True), "float16", 1.0)
    dout = (dout * 1e-4).astype(np.float16).astype(np.float64)
    tq, tk, tv = (torch.from_numpy(x).half().requires_grad_() for x in (q, k, v))
    kk, vv = tk.repeat_interleave(4, 1), tv.repeat_interleave(4, 1)
    s = ((tq @ kk.transpose(-1, -2)) * 0.125).float()
    s = s.masked_fill(~torch.ones(256, 256, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(s, -1, dtype=torch.float32).half() @ vv
    out.backward(torch.from_numpy(dout).half())
    grads = {n: t.grad.double().numpy() for n, t in (("dq", tq), ("dk", tk), ("dv", tv))}
    r = check.check_kernel(q, k, v, out.detach().double().numpy(), dout=dout, layout="bhsd", causal=True,
                           dtype="float16", **grads)
    assert r.passed, check.format_text(r)


def test_tiled_gradient_sizes_are_the_dense_ones():
    """`GradSizes`: the tiled backward's gradients keep their bits and its root-sum-squares are
    `dense_backward`'s ``return_rss`` (any tiling, threads, GQA, every option that reaches ``ds``;
    torch)."""
    from attnlib.core.backward import dense_backward, tiled_backward
    from attnlib.core.gradsizes import GradSizes
    q, k, v = attnlib.random_qkv(150, 130, 12, batch=(2,), heads=4, kv_heads=2, seed=4)
    dout = np.random.default_rng(4).standard_normal(q.shape[:-1] + (12,))
    mod = lambda s, b, h, i, j: s * 0.5 - 0.01 * (i - j)  # noqa: E731
    grad = lambda s, b, h, i, j: 0.5 + 0 * s  # noqa: E731
    cases = (dict(causal=True), dict(window=(30, 5), sinks=np.array([0.5, -1.0, 2.0, 0.0])),
             dict(softcap=3.0, kv_lengths=np.array([60, 130])), dict(score_mod=mod, causal=True))
    for options in cases:
        opts = Options.parse(**options)
        mod_grad = grad if "score_mod" in options else None
        out, lse = attnlib.attention(q, k, v, return_lse=True, **options)
        w = np.abs(np.random.default_rng(5).standard_normal(lse.shape))
        grads, rss = tiled_backward(q, k, v, out, lse, dout, opts, mod_grad, block_q=32, block_k=48, workers=2,
                                    sizes=GradSizes(2.0 ** -13, w))
        plain = tiled_backward(q, k, v, out, lse, dout, opts, mod_grad, block_q=32, block_k=48, workers=2)
        assert all(np.array_equal(a, b) for a, b in zip(grads, plain)), options
        # The dense rss takes w from its own sigma and lse: scale w to match it through rss_scores=1.
        _, want = dense_backward(q, k, v, dout, opts, mod_grad, return_rss=True, rss_accumulate=2.0 ** -13)
        _, base = tiled_backward(q, k, v, out, lse, dout, opts, mod_grad, workers=1, sizes=GradSizes(2.0 ** -13))
        for got, x in zip(base, want):
            assert np.allclose(got, x, rtol=1e-12, atol=0), options
        # The float64 rule's componentwise sizes (return_abs) the same way.
        _, want = dense_backward(q, k, v, dout, opts, mod_grad, return_abs=True)
        _, got = tiled_backward(q, k, v, out, lse, dout, opts, mod_grad, workers=2, sizes=GradSizes(componentwise=True))
        for x, y in zip(got, want):
            assert np.allclose(x, y, rtol=1e-12, atol=0), options
    torch = pytest.importorskip("torch")
    opts = Options.parse(causal=True)
    out, lse = attnlib.attention(q, k, v, return_lse=True, causal=True)
    on_device = tiled_backward(q, k, v, out, lse, dout, opts, dev=torch.device("cpu"), sizes=GradSizes(0.5))
    on_host = tiled_backward(q, k, v, out, lse, dout, opts, sizes=GradSizes(0.5))
    for x, y in zip(on_device[1], on_host[1]):
        assert np.allclose(x.numpy(), y, rtol=1e-13, atol=0)


def test_dense_backward_parts_are_the_gradients_there():
    """``rows``: dq on those rows as the whole naive backward gives it; ``keys`` with the forward's
    rows (``stats``): dk, dv on those keys within the type's rounding of the whole one's."""
    from attnlib.core.backward import dense_backward
    q, k, v = attnlib.random_qkv(90, 70, 8, heads=4, kv_heads=2, seed=6)
    dout = np.random.default_rng(6).standard_normal(q.shape[:-1] + (8,))
    opts = Options.parse(causal=True, sinks=np.array([0.5, 0.0, -1.0, 1.0]))
    out, lse = attnlib.attention(q, k, v, return_lse=True, causal=True, sinks=opts.sinks)
    exact = dense_backward(q, k, v, dout, opts)
    rows, keys = np.array([0, 7, 50, 89]), np.array([1, 33, 69])
    for formulation in FORMULATIONS:
        whole = dense_backward(q, k, v, dout, opts, compute_dtype="float32", formulation=formulation)
        part = dense_backward(q, k, v, dout, opts, compute_dtype="float32", formulation=formulation, rows=rows)
        assert part[1:3] == (None, None) and np.allclose(part[0], whole[0][..., rows, :], rtol=0, atol=1e-6)
        exact_part = dense_backward(q, k, v, dout, opts, rows=rows)[3]  # dsinks: these rows' terms
        assert np.abs(part[3] - exact_part).max() <= 1e-5 * np.abs(exact[3]).max()
        part = dense_backward(q, k, v, dout, opts, compute_dtype="float32", formulation=formulation,
                              keys=keys, stats=(lse, out))
        assert part[0] is None
        for t in (1, 2):
            scale = np.abs(exact[t]).max()
            assert np.abs(part[t] - exact[t][..., keys, :]).max() <= 1e-5 * scale
        assert np.abs(part[3] - exact[3]).max() <= 1e-5 * np.abs(exact[3]).max()
    with pytest.raises(ValueError, match="part of the gradients"):
        dense_backward(q, k, v, dout, opts, keys=keys)  # keys need the forward's rows
    # Every formulation in one call (the scores rounded alike shared): each one's own bits.
    together = dense_backward(q, k, v, dout, opts, compute_dtype="bfloat16", formulation=FORMULATIONS, rows=rows)
    for formulation, got in zip(FORMULATIONS, together):
        alone = dense_backward(q, k, v, dout, opts, compute_dtype="bfloat16", formulation=formulation, rows=rows)
        assert np.array_equal(got[0], alone[0]) and np.array_equal(got[3], alone[3]), formulation


def test_the_flushed_terms_sizes_are_the_dense_ones():
    """`GradSizes(flush=)`: what the terms whose weight lies in ``(0, flush)`` add to each gradient
    entry (``|p| |dout|``, ``|ds| |q|``, ``|ds| |k|``, the sink's ``p_sink |D|``), summed tile by tile,
    equal to the dense sums (GQA, causal, sinks; logits large enough that some weights fall below
    float32's normal range)."""
    from attnlib.core.backward import tiled_backward
    from attnlib.core.gradsizes import GradSizes
    tiny = float(np.finfo(np.float32).tiny)
    q, k, v = attnlib.random_qkv(96, 96, 16, batch=(1,), heads=4, kv_heads=2, seed=9)
    q, k = 6 * q, 6 * k
    dout = np.random.default_rng(9).standard_normal(q.shape)
    sinks = np.array([3.0, -2.0, 40.0, 0.0])
    opts = Options.parse(causal=True, sinks=sinks)
    out, lse = attnlib.attention(q, k, v, return_lse=True, causal=True, sinks=sinks)
    got = tiled_backward(q, k, v, out, lse, dout, opts, block_q=32, block_k=16, workers=2,
                         sizes=GradSizes(2.0 ** -16, flush=tiny))[-1]
    scale = 1 / 4
    kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)  # a group's two query heads share a kv head
    s = scale * q @ np.swapaxes(kk, -1, -2)
    s = np.where(np.tril(np.ones((96, 96), bool)), s, -np.inf)
    with np.errstate(under="ignore"):
        p = np.exp(s - lse[..., None])
        p_sink = np.exp(sinks[:, None] - lse)
    low = (p > 0) & (p < tiny)
    assert 0 < low.sum() < low.size
    ds = np.abs(p * (dout @ np.swapaxes(vv, -1, -2) - np.sum(dout * out, -1, keepdims=True))) * low
    want_q = scale * ds @ np.abs(kk)
    want_k = (scale * np.swapaxes(ds, -1, -2) @ np.abs(q)).reshape(1, 2, 2, 96, 16).sum(2)
    want_v = (np.swapaxes(p * low, -1, -2) @ np.abs(dout)).reshape(1, 2, 2, 96, 16).sum(2)
    low_sink = (p_sink > 0) & (p_sink < tiny)
    want_sink = (p_sink * np.abs(np.sum(dout * out, -1)) * low_sink).sum(-1)[0]
    for x, y in zip(got, (want_q, want_k, want_v, want_sink)):
        assert np.allclose(x, y, rtol=1e-12, atol=0) and np.abs(y).max() > 0


def test_a_kernel_that_flushes_subnormal_weights_passes_and_a_wrong_one_still_fails():
    """GPU exponentials flush results below float32's normal range to zero (FlashAttention's
    ``ex2.approx.ftz``): at large logits a key whose every weight lies there gets ``dv = 0``
    against a reference near 1e-38. The rule allows twice what such flushing drops: that kernel's
    float32 decode gradients passed at 0.5 of the allowance (7,760 allowances before); a kernel off by
    1e-3 on the same problem still fails (1e-4 is within float32's resolution at these logits, whose
    scores reach ~100: their rounding moves the weights by ~1e-5)."""
    from attnlib.core.problem import precision
    prec = precision("float32")
    rng = np.random.default_rng(7)
    q, k, v, dout = (prec.round(rng.standard_normal((1, 2, n, 64)) * m).astype(np.float64)
                     for n, m in ((4, 5.0), (1024, 5.0), (1024, 1.0), (4, 1.0)))
    scale = 1 / 8
    out, lse = attnlib.attention(q, k, v, return_lse=True)
    with np.errstate(under="ignore"):
        p = np.exp(scale * q @ np.swapaxes(k, -1, -2) - lse[..., None])
    p = np.where(p < np.finfo(np.float32).tiny, 0.0, p)  # flushed
    ds = p * (dout @ np.swapaxes(v, -1, -2) - np.sum(dout * (p @ v), -1, keepdims=True))
    flushing = dict(dq=scale * ds @ k, dk=scale * np.swapaxes(ds, -1, -2) @ q, dv=np.swapaxes(p, -1, -2) @ dout)
    flushing = {n: prec.round(x).astype(np.float64) for n, x in flushing.items()}
    r = check.check_kernel(q, k, v, prec.round(out).astype(np.float64), dout=dout, layout="bhsd",
                           dtype="float32", **flushing)
    assert r.passed and max(t.ratio for t in r.grads.values()) <= 0.51, {n: t.ratio for n, t in r.grads.items()}
    wrong = dict(flushing, dv=prec.round(flushing["dv"] * (1 + 1e-3)).astype(np.float64))
    r = check.check_kernel(q, k, v, prec.round(out).astype(np.float64), dout=dout, layout="bhsd",
                           dtype="float32", **wrong)
    assert not r.grads["dv"].passed and r.grads["dv"].ratio > 2
