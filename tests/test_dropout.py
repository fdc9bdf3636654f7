"""Dropout (docs/semantics.md, "Dropout"): exact with the keep mask against PyTorch's autograd of
FlashAttention's reference formula in float64, the check of a kernel's output with its mask, and
the statistics of a kernel's own random dropout."""

import math

import numpy as np
import pytest

import attnlib
from attnlib import attention_dropout, attention_dropout_backward
from attnlib.check import check_kernel
from attnlib.check.dropout import calibrate_statistics, dropout_statistics, keep_rows_from_output

torch = pytest.importorskip("torch")

B, H, HK, SQ, SK, D = 2, 4, 2, 37, 53, 16
RATE = 0.3
OPTIONS = [dict(causal=True), dict(causal=True, sinks=np.array([0.5, -1.0, 2.0, 0.0])),
           dict(window=(5, 3), softcap=3.0), dict(kv_lengths=np.array([0, 20]))]


def reference(q, k, v, keep, dout, dlse, options):
    """FlashAttention's attention_ref with a dropout mask (weights masked after the softmax, v
    scaled by 1 / (1 - p)), written out in torch float64, and its autograd gradients."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    sinks = options.get("sinks")
    ts = None if sinks is None else torch.tensor(sinks, requires_grad=True)
    group = q.shape[1] // k.shape[1]
    s = tq @ tk.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if "softcap" in options:
        s = options["softcap"] * torch.tanh(s / options["softcap"])
    i = torch.arange(q.shape[2])[:, None] + (k.shape[2] - q.shape[2])
    j = torch.arange(k.shape[2])[None, :]
    vis = torch.ones(q.shape[0], 1, q.shape[2], k.shape[2], dtype=torch.bool)
    if options.get("causal"):
        vis &= j <= i
    if "window" in options:
        vis &= (j >= i - options["window"][0]) & (j <= i + options["window"][1])
    if "kv_lengths" in options:
        vis &= j < torch.tensor(options["kv_lengths"])[:, None, None, None]
    s = s.masked_fill(~vis, -torch.inf)
    if ts is not None:
        s = torch.cat([s, ts[None, :, None, None].expand(s.shape[:-1] + (1,))], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    p = p if ts is None else p[..., :-1]
    out = p.masked_fill(~torch.tensor(keep), 0.0) @ (tv.repeat_interleave(group, 1) / (1 - RATE))
    loss = (out * torch.tensor(dout)).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * torch.tensor(dlse)).sum()
    loss.backward()
    return out.detach().numpy(), lse.detach().numpy(), [tq.grad, tk.grad, tv.grad] + ([ts.grad] if ts is not None else [])


def problem(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, SQ, D))
    k, v = (rng.standard_normal((B, HK, SK, D)) for _ in range(2))
    keep = rng.random((B, H, SQ, SK)) >= RATE
    return rng, q, k, v, keep


@pytest.mark.parametrize("options", OPTIONS)
def test_dropout_equals_flash_attentions_reference_forward_and_backward(options):
    rng, q, k, v, keep = problem()
    dout, dlse = rng.standard_normal((B, H, SQ, D)), rng.standard_normal((B, H, SQ))
    want, want_lse, want_grads = reference(q, k, v, keep, dout, dlse, options)
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        out, lse = attention_dropout(q, k, v, RATE, keep, return_lse=True, **options)
        by_function = attention_dropout(q, k, v, RATE, lambda b, h, i, j: keep[b, h, i, j], **options)
        grads = attention_dropout_backward(q, k, v, out, lse, dout, RATE, keep, dlse=dlse, **options)
    # to 1e-13 of each tensor's size (P @ |V| <= max |v| / (1 - p); two float64 orders of summation,
    # measured ~1e-15 apart)
    size = np.abs(v).max() / (1 - RATE)
    assert np.abs(out - want).max() < 1e-13 * size and np.array_equal(out, by_function)
    seen = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), seen) and np.abs(np.subtract(lse, want_lse, where=seen, out=np.zeros_like(lse))).max() < 1e-14
    assert len(grads) == len(want_grads)
    assert all(np.abs(g - w.numpy()).max() < 1e-13 * np.abs(w.numpy()).max() for g, w in zip(grads, want_grads))
    on_torch = attention_dropout(*(torch.tensor(x) for x in (q, k, v)), RATE, torch.tensor(keep), **options)
    assert np.abs(on_torch.numpy() - out).max() < 1e-13 * size


def test_no_drop_is_plain_attention_and_bad_arguments_are_refused():
    _, q, k, v, keep = problem(1)
    everything = np.ones_like(keep)
    assert np.abs(attention_dropout(q, k, v, 0.0, everything, causal=True)
                  - attnlib.attention(q, k, v, causal=True)).max() < 1e-15
    with pytest.raises(ValueError, match="dropout_p must be a probability"):
        attention_dropout(q, k, v, 1.0, keep)
    with pytest.raises(TypeError, match="dropout_mask must be boolean"):
        attention_dropout(q, k, v, 0.1, keep.astype(float))
    with pytest.raises(TypeError, match="needs its keep mask"):
        attention_dropout(q, k, v, 0.1, None)
    with pytest.raises(ValueError, match="dropout_mask must broadcast to"):
        attention_dropout(q, k, v, 0.1, keep[..., :-1])
    # near p = 0 or 1 the spread tests step aside (too few expected per row): numpy's draws pass
    rng = np.random.default_rng(5)
    assert all(dropout_statistics(rng.random((2, 4, 64, 64)) >= p, p)["passed"] for p in (0.001, 0.999) for _ in range(20))


def torch_kernel(q, k, v, keep, prec, scale=None, mask=None):
    """A kernel in ``prec``: float32 scores and softmax, weights dropped and rounded, ``p @ v``."""
    dt = getattr(torch, prec)
    tq, tk, tv = (torch.tensor(x).to(dt) for x in (q, k, v))
    s = (tq.float() @ tk.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    s = s.masked_fill(~(j <= i), -torch.inf)
    p = torch.softmax(s, -1)
    kept = p.masked_fill(~torch.tensor(keep if mask is None else mask), 0.0)
    out = ((kept.to(dt).float() @ tv.float()) * (1 / (1 - RATE) if scale is None else scale)).to(dt)
    return [torch.tensor(x).to(dt) for x in (q, k, v)], out, torch.logsumexp(s, -1)


@pytest.mark.parametrize("prec", ["float32", "bfloat16"])
def test_the_check_passes_a_kernels_dropout_and_names_the_mistakes(prec):
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 4, 300, 64)) for _ in range(3))
    keep = rng.random((1, 4, 300, 300)) >= RATE
    inputs, out, lse = torch_kernel(q, k, v, keep, prec)
    verdict = check_kernel(*inputs, out, lse=lse, layout="bhsd", causal=True, dropout_p=RATE, dropout_mask=keep)
    assert verdict.passed, verdict
    assert verdict.out.notes[0].startswith("dropout (p = 0.3)")
    for words, scale, mask in (("1 / (1 - p) left out", 1.0, None), ("1 / p", 1 / RATE, None),
                               ("keep mask inverted", None, ~keep), ("no dropout", 1.0, np.ones_like(keep))):
        wrong = torch_kernel(q, k, v, keep, prec, scale=scale, mask=mask)[1]
        verdict = check_kernel(*inputs, wrong, layout="bhsd", causal=True, dropout_p=RATE, dropout_mask=keep)
        assert not verdict.passed and any(words in d for d in verdict.diagnosis), (words, verdict.diagnosis)
    with pytest.raises(attnlib.check.UnusableInput, match="max_scores: not yet"):
        check_kernel(*inputs, out, layout="bhsd", causal=True, dropout_p=RATE, dropout_mask=keep,
                     max_scores=lse)


def test_dropout_statistics_pass_torch_s_own_dropout_and_fail_structured_masks():
    torch.manual_seed(0)
    n = 512
    q = torch.zeros(1, 2, n, 8, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).expand(1, 2, n, n)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):  # uniform weights, v the identity: out > 0 is the keep mask
        out = torch.nn.functional.scaled_dot_product_attention(q, q, v, dropout_p=0.1)
    kept = keep_rows_from_output(out.numpy(), 0.1)
    assert np.array_equal(kept, out.numpy() > 0)
    assert dropout_statistics(kept, 0.1)["passed"]
    assert not dropout_statistics(kept, 0.2)["passed"]  # the rate told wrong
    row = np.random.default_rng(0).random((1, n)) >= 0.1
    assert not dropout_statistics(np.broadcast_to(row, (n, n)), 0.1)["passed"]  # one row's draws for every row


def test_the_statistics_false_alarm_rate_and_power_are_measured():
    found = calibrate_statistics(rows=64, cols=512, runs=300, errors=(0.004, 0.016))
    assert found["false_alarms"] <= 2 and found["rate_bound"] < 0.03
    assert found["detected"][0.016] == 1.0 and found["smallest_detected"] == 0.016
    assert found["row_repeat"] == 1.0 and found["column_repeat"] == 1.0


def autograd_kernel(q, k, v, dout, dlse, keep, rate, prec, causal, sinks, backward="right"):
    """A kernel in ``prec`` differentiated by torch: float32 scores and softmax (with ``sinks``), the
    weights dropped and scaled, rounded, ``@ v``; ``backward``: the right gradients, or the
    gradients of another forward (no dropout, the mask inverted, the ``1 / (1 - p)`` left out)
    under the right output."""
    dt = getattr(torch, prec)
    tq, tk, tv = (torch.tensor(x).to(dt).requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.float().repeat_interleave(g, 1) for t in (tk, tv))
    s = (tq.float() @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq), -torch.inf)
    sink = [] if sinks is None else [torch.tensor(sinks, dtype=torch.float32)[None, :, None, None].expand(*s.shape[:-1], 1)]
    lse = torch.logsumexp(torch.cat([s, *sink], -1), -1)
    p = torch.exp(s - lse[..., None])
    kept = torch.tensor(keep)
    right = p * kept / (1 - rate)
    other = {"right": right, "no dropout": p, "inverted": p * ~kept / (1 - rate), "unscaled": p * kept}[backward]
    weights = right.detach() + other - other.detach()  # the right values, the other's gradient
    out = (weights.to(dt).float() @ vv).to(dt)
    ((out.float() * torch.tensor(dout).to(dt).float()).sum() + (lse * torch.tensor(dlse, dtype=torch.float32)).sum()).backward()
    return [t.detach() for t in (tq, tk, tv)], out.detach(), lse.detach(), [t.grad for t in (tq, tk, tv)]


@pytest.mark.parametrize("prec", ["float32", "bfloat16"])
@pytest.mark.parametrize("sq, sk, hq, hk, causal, sinks, magnitude", [(1, 200, 4, 4, False, None, 1e-2),
                                                                      (40, 160, 4, 1, True, (0.5, 1.0, -1.0, 3.0), 1e2)])
def test_the_check_judges_dropout_gradients_and_names_the_mistakes(prec, sq, sk, hq, hk, causal, sinks, magnitude):
    """Measured over 32 configurations (decode, causal GQA, sinks, p = 0.1 and 0.5, v and dlse at
    1e-2 and 1e2): correct kernels at most 0.35, each wrong backward failing and named (here one
    magnitude a shape; the check-rule report's mix-ups run 1e-2, 1, 1e2)."""
    rate = 0.3
    sinks = None if sinks is None else np.array(sinks)
    for magnitude in (magnitude,):
        rng = np.random.default_rng(sq + sk)
        q = rng.standard_normal((1, hq, sq, 64))
        k, v = (rng.standard_normal((1, hk, sk, 64)) for _ in range(2))
        v, dout, dlse = v * magnitude, rng.standard_normal((1, hq, sq, 64)), magnitude * rng.standard_normal((1, hq, sq))
        keep = rng.random((1, hq, sq, sk)) >= rate
        told = dict(layout="bhsd", causal=causal, sinks=sinks, dropout_p=rate, dropout_mask=keep,
                    dlse=dlse.astype(np.float32))
        for backward, words in (("right", None), ("no dropout", "no dropout in the backward"),
                                ("inverted", "keep mask inverted"), ("unscaled", "1 / (1 - p) left out")):
            ins, out, lse, g = autograd_kernel(q, k, v, dout, dlse, keep, rate, prec, causal, sinks, backward)
            verdict = check_kernel(*ins, out, lse=lse, dout=torch.tensor(dout).to(getattr(torch, prec)),
                                   dq=g[0], dk=g[1], dv=g[2], **told)
            if words is None:
                assert verdict.passed and max(x.ratio for x in verdict.grads.values()) < 0.6, verdict.grads
            else:
                assert not verdict.passed
                notes = [n for x in verdict.grads.values() if x.passed is False for n in x.notes]
                assert any(words in n for n in notes), (backward, notes)


def test_float64_dropout_gradients_are_judged_by_the_gate():
    rng = np.random.default_rng(0)
    rate, sinks = 0.2, np.array([0.3, 1.0])
    q, k, v, dout = (rng.standard_normal((1, 2, n, 32)) for n in (100, 100, 100, 100))
    dlse = rng.standard_normal((1, 2, 100))
    keep = rng.random((1, 2, 100, 100)) >= rate
    out, lse = attention_dropout(q, k, v, rate, keep, return_lse=True, causal=True, sinks=sinks)
    dq, dk, dv, dsinks = attention_dropout_backward(q, k, v, out, lse, dout, rate, keep, dlse=dlse, causal=True,
                                                    sinks=sinks)
    told = dict(layout="bhsd", causal=True, sinks=sinks, dropout_p=rate, dropout_mask=keep, dlse=dlse, dout=dout,
                lse=lse, dq=dq, dv=dv, dsinks=dsinks)
    assert check_kernel(q, k, v, out, dk=dk, **told).passed
    assert not check_kernel(q, k, v, out, dk=dk * (1 + 1e-9), **told).grads["dk"].passed


def test_a_broadcast_keep_mask_is_read_as_broadcast():
    """A keep mask with size-1 axes (one row for every query, one column for every key)."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 16, 8)) for _ in range(3))
    for shape in ((1, 2, 1, 16), (1, 1, 16, 1)):
        keep = rng.random(shape) > 0.3
        full = np.broadcast_to(keep, (1, 2, 16, 16)).copy()
        assert np.array_equal(attention_dropout(q, k, v, 0.3, keep), attention_dropout(q, k, v, 0.3, full))


def flash_backward(ins, out, lse, dout, dlse, keep, rate, causal, mistake=None):
    """A FlashAttention-2-style backward in float32 from the stored ``out`` and ``lse``: ``D =
    rowsum(dout * out)``, ``ds = p (dp keep / (1 - p) - D + dlse)``; ``mistake``: the dropout
    left out of it, the mask inverted, or the ``1 / (1 - p)`` left out (D still the stored one)."""
    q, k, v = (t.float() for t in ins)
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(g, 1) for t in (k, v))
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(s.shape[-1] - s.shape[-2]), -torch.inf)
    p = torch.exp(s - lse.float()[..., None])
    kept = torch.tensor(keep)
    f = {None: kept / (1 - rate), "no dropout": torch.ones_like(p), "inverted": ~kept / (1 - rate),
         "unscaled": kept * 1.0}[mistake]
    dout = torch.tensor(dout).float()
    d = (dout * out.float()).sum(-1, keepdim=True)
    ds = p * ((dout @ vv.transpose(-1, -2)) * f - d + torch.tensor(dlse).float()[..., None])
    dq = ds @ kk / math.sqrt(q.shape[-1])
    dk = (ds.transpose(-1, -2) @ q / math.sqrt(q.shape[-1])).unflatten(1, (-1, g)).sum(2)
    dv = ((p * f).transpose(-1, -2) @ dout).unflatten(1, (-1, g)).sum(2)
    return dq, dk, dv


def test_a_flash_style_backward_with_dropout_is_judged_and_its_mistakes_named():
    rate, causal = 0.3, True
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 4, 64, 64))
    k, v = (rng.standard_normal((1, 2, 160, 64)) for _ in range(2))
    dout, dlse = rng.standard_normal((1, 4, 64, 64)), rng.standard_normal((1, 4, 64))
    keep = rng.random((1, 4, 64, 160)) >= rate
    ins, out, lse, _ = autograd_kernel(q, k, v, dout, dlse, keep, rate, "float32", causal, None)
    told = dict(layout="bhsd", causal=causal, dropout_p=rate, dropout_mask=keep, dlse=dlse.astype(np.float32),
                lse=lse, dout=dout.astype(np.float32))
    for mistake, words in ((None, None), ("no dropout", "no dropout in the backward, D = dout . out from the stored"),
                           ("inverted", "keep mask inverted in the backward, D = dout . out from the stored"),
                           ("unscaled", "1 / (1 - p) left out, D = dout . out from the stored")):
        dq, dk, dv = flash_backward(ins, out, lse, dout, dlse, keep, rate, causal, mistake)
        verdict = check_kernel(*ins, out, dq=dq, dk=dk, dv=dv, **told)
        if words is None:
            assert verdict.passed, verdict.grads
        else:
            notes = [n for x in verdict.grads.values() if x.passed is False for n in x.notes]
            assert not verdict.passed and any(words in n for n in notes), (mistake, notes)
