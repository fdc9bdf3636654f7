"""Dropout (docs/semantics.md, "Dropout"): exact with the keep mask against PyTorch's autograd of
FlashAttention's reference formula in float64, the check of a kernel's output with its mask, and
the statistics of a kernel's own random dropout."""

import math

import numpy as np
import pytest

import attnlib
from attnlib import attention_dropout, attention_dropout_backward
from attnlib.check import check_kernel
from attnlib.check.dropout import calibrate_statistics, dropout_statistics

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
    assert np.abs(out - want).max() < 3e-15 and np.array_equal(out, by_function)
    seen = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), seen) and np.abs(np.subtract(lse, want_lse, where=seen, out=np.zeros_like(lse))).max() < 1e-14
    assert len(grads) == len(want_grads)
    assert all(np.abs(g - w.numpy()).max() < 5e-15 for g, w in zip(grads, want_grads))
    on_torch = attention_dropout(*(torch.tensor(x) for x in (q, k, v)), RATE, torch.tensor(keep), **options)
    assert np.abs(on_torch.numpy() - out).max() < 3e-15


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
    with pytest.raises(attnlib.check.UnusableInput, match="with dropout the check judges out and lse"):
        check_kernel(*inputs, out, layout="bhsd", causal=True, dropout_p=RATE, dropout_mask=keep,
                     dout=inputs[0], dq=inputs[0])


def test_dropout_statistics_pass_torch_s_own_dropout_and_fail_structured_masks():
    torch.manual_seed(0)
    n = 512
    q = torch.zeros(1, 2, n, 8, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).expand(1, 2, n, n)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):  # uniform weights, v the identity: out > 0 is the keep mask
        out = torch.nn.functional.scaled_dot_product_attention(q, q, v, dropout_p=0.1)
    kept = out.numpy() > 0
    assert dropout_statistics(kept, 0.1)["passed"]
    assert not dropout_statistics(kept, 0.2)["passed"]  # the rate told wrong
    row = np.random.default_rng(0).random((1, n)) >= 0.1
    assert not dropout_statistics(np.broadcast_to(row, (n, n)), 0.1)["passed"]  # one row's draws for every row


def test_the_statistics_false_alarm_rate_and_power_are_measured():
    found = calibrate_statistics(rows=64, cols=512, runs=300, errors=(0.004, 0.016))
    assert found["false_alarms"] <= 2 and found["rate_bound"] < 0.03
    assert found["detected"][0.016] == 1.0 and found["smallest_detected"] == 0.016
    assert found["row_repeat"] == 1.0 and found["column_repeat"] == 1.0
