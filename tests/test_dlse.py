"""Gradients through the LSE (`dlse=`): a loss of both `out` and `lse` (docs/semantics.md,
"Gradients through the LSE"), against PyTorch's autograd through `logsumexp` in float64, on
every backward path and in the check."""

import math
import subprocess
import sys

import numpy as np
import pytest

import attnlib
from attnlib import attention_backward, attention_vjp, reference_attention_backward
from attnlib.check import check_kernel
from attnlib.judge.gate import GradientGate

torch = pytest.importorskip("torch")

#: (q heads, k heads, Sq, Sk, D, options)
PROBLEMS = [
    (4, 2, 37, 53, 16, dict(causal=True)),
    (4, 4, 1, 70, 32, dict()),  # decode
    (2, 1, 45, 45, 8, dict(causal=True, sinks=np.array([0.5, -1.0]))),
    (2, 2, 30, 41, 16, dict(window=(5, 3), softcap=3.0)),
    (2, 2, 33, 40, 16, dict(kv_lengths=np.array([0, 17]), sinks=np.array([1.0, 2.0]))),  # rows of the sink alone
    (4, 2, 29, 29, 16, dict(causal=True, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), scale=0.3)),
]


def torch_grads(q, k, v, dout, dlse, options, dtype=torch.float64):
    """PyTorch autograd of ``sum(out * dout) + sum(lse * dlse)`` for dense attention written out
    (the sink a last logit with no value): ``(out, lse, dq, dk, dv[, dsinks])``."""
    opts = dict(options)
    tq, tk, tv = (torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v))
    sinks = opts.pop("sinks", None)
    ts = None if sinks is None else torch.tensor(sinks, dtype=torch.float64, requires_grad=True)
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    kk, vv = tk.repeat_interleave(h // hk, 1), tv.repeat_interleave(h // hk, 1)
    scale = opts.pop("scale", 1.0 / math.sqrt(d))
    s = (tq.double() @ kk.double().transpose(-1, -2)) * scale
    if "softcap" in opts:
        c = opts.pop("softcap")
        s = c * torch.tanh(s / c)
    i = torch.arange(sq)[:, None] + (sk - sq)  # bottom-right alignment
    j = torch.arange(sk)[None, :]
    if "alibi_slopes" in opts:
        s = s - torch.tensor(opts.pop("alibi_slopes"))[None, :, None, None] * (i - j).abs()
    vis = torch.ones(b, 1, sq, sk, dtype=torch.bool)
    if opts.pop("causal", False):
        vis &= j <= i
    if "window" in opts:
        left, right = opts.pop("window")
        vis &= (j >= i - left) & (j <= i + right)
    if "kv_lengths" in opts:
        vis &= j < torch.tensor(opts.pop("kv_lengths"))[:, None, None, None]
    assert not opts, opts
    s = s.masked_fill(~vis, -torch.inf)
    if ts is not None:
        s = torch.cat([s, ts[None, :, None, None].expand(b, h, sq, 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows with no key and no sink: 0
    p = p if ts is None else p[..., :-1]
    out = (p.to(dtype).double() @ vv.double()).to(dtype)
    loss = (out.double() * torch.tensor(dout).double()).sum() + (
        torch.where(torch.isfinite(lse), lse, 0.0).double() * torch.tensor(dlse).double()).sum()
    loss.backward()
    grads = [tq.grad, tk.grad, tv.grad] + ([ts.grad] if ts is not None else [])
    return (out.detach(), lse.detach(), *grads)


def problem(hq, hk, sq, sk, d, seed=0, batch=2):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, hq, sq, d))
    k, v = (rng.standard_normal((batch, hk, sk, d)) for _ in range(2))
    dout = rng.standard_normal((batch, hq, sq, d))
    dlse = 3 * rng.standard_normal((batch, hq, sq))
    return q, k, v, dout, dlse


@pytest.mark.parametrize("hq,hk,sq,sk,d,options", PROBLEMS)
def test_tiled_dense_and_torch_paths_equal_autograd_through_logsumexp(hq, hk, sq, sk, d, options):
    q, k, v, dout, dlse = problem(hq, hk, sq, sk, d)
    given = [x.copy() for x in (q, k, v, dout, dlse)]
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        out, lse = attnlib.attention(q, k, v, return_lse=True, **options)
        tiled = attention_backward(q, k, v, out, lse, dout, dlse=dlse, block_q=16, block_k=16, **options)
        dense = reference_attention_backward(q, k, v, dout, dlse=dlse, **options)
        sizes = reference_attention_backward(q, k, v, dout, dlse=dlse, return_abs=True, **options)[1]
        _, vjp = attention_vjp(q, k, v, dout, dlse=dlse, **options)
    on_torch = attention_backward(*(torch.tensor(x) for x in (q, k, v, out, lse, dout)), dlse=torch.tensor(dlse),
                                  block_q=16, block_k=16, **options)
    autograd = torch_grads(q, k, v, dout, dlse, options)[2:]
    assert all(np.array_equal(a, b) for a, b in zip(given, (q, k, v, dout, dlse)))  # never modified
    for name, size, want, *got in zip(("dq", "dk", "dv", "dsinks"), sizes, autograd, tiled, dense, vjp, on_torch):
        want = want.numpy()
        for g in got:
            g = g.numpy() if isinstance(g, torch.Tensor) else g
            assert np.all(np.abs(g - want) <= 1e-13 * np.maximum(size, 1e-300)), name
    # dlse matters on every gradient but dv (which sums p dout alone)
    plain = attention_backward(q, k, v, out, lse, dout, block_q=16, block_k=16, **options)
    assert all(not np.allclose(a, b) for a, b in zip(plain[:2], tiled[:2]))
    assert np.array_equal(plain[2], tiled[2])


def test_zero_dlse_is_no_dlse_bit_for_bit_and_dlse_scales_with_dout_near_the_range():
    q, k, v, dout, dlse = problem(4, 2, 40, 60, 16, seed=1)
    out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True)
    for fn in (lambda **kw: attention_backward(q, k, v, out, lse, dout, causal=True, **kw),
               lambda **kw: reference_attention_backward(q, k, v, dout, causal=True, **kw),
               lambda **kw: reference_attention_backward(q, k, v, dout, causal=True, compute_dtype="bfloat16",
                                                         formulation="flash", **kw)):
        assert all(np.array_equal(a, b) for a, b in zip(fn(), fn(dlse=np.zeros_like(dlse))))
    # linear in (dout, dlse): both times 2**1000 give the gradients times 2**1000, bit for bit
    big = 2.0 ** 1000
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        scaled = attention_backward(q, k, v, out, lse, dout * big, dlse=dlse * big, causal=True)
        dense = reference_attention_backward(q, k, v, dout * big, dlse=dlse * big, causal=True)
    base = attention_backward(q, k, v, out, lse, dout, dlse=dlse, causal=True)
    assert all(np.array_equal(a, b * big) for a, b in zip(scaled, base))
    base = reference_attention_backward(q, k, v, dout, dlse=dlse, causal=True)
    assert all(np.array_equal(a, b * big) for a, b in zip(dense, base))
    # dlse alone near the range (dout small): the exponent comes from dlse
    huge = attention_backward(q, k, v, out, lse, dout * 2.0 ** -1000, dlse=dlse * big, causal=True)
    assert all(np.isfinite(g).all() for g in huge)


def test_bad_dlse_is_refused_naming_it():
    q, k, v, dout, dlse = problem(2, 2, 10, 12, 8)
    out, lse = attnlib.attention(q, k, v, return_lse=True)
    for bad, words in ((dlse[..., :-1], "dlse must have shape"), (np.where(dlse > 0, np.nan, dlse), "dlse")):
        for fn in (lambda: attention_backward(q, k, v, out, lse, dout, dlse=bad),
                   lambda: reference_attention_backward(q, k, v, dout, dlse=bad),
                   lambda: attention_backward(*(torch.tensor(x) for x in (q, k, v, out, lse, dout)),
                                              dlse=torch.tensor(bad))):
            with pytest.raises(ValueError, match=words):
                fn()


def test_gradient_gate_takes_dlse():
    q, k, v, dout, dlse = problem(4, 2, 50, 50, 16, seed=2)
    out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True)
    gate = GradientGate(q, k, v, dout, dlse=dlse, causal=True)
    grads = attention_backward(q, k, v, out, lse, dout, dlse=dlse, causal=True)
    assert gate.judge(grads)["passed"]
    assert not gate.judge(attention_backward(q, k, v, out, lse, dout, causal=True))["passed"]
    assert not gate.judge([g * (1 + 3e-12) for g in grads])["passed"]


def kernel_result(prec, q, k, v, dout, dlse, options, dlse_factor=1.0):
    """PyTorch autograd in ``prec`` (float32 or bfloat16) through logsumexp: a correct kernel (or,
    with ``dlse_factor``, one that takes ``dlse`` times it)."""
    dt = getattr(torch, prec)
    inputs = [torch.tensor(x).to(dt).double().numpy() for x in (q, k, v, dout)]
    dlse = torch.tensor(dlse).float().double().numpy()  # as stored: float32, FlashAttention's
    out, lse, *grads = torch_grads(*inputs[:3], inputs[3], dlse * dlse_factor, options, dtype=dt)
    return inputs, dlse, out, lse, grads


@pytest.mark.parametrize("prec", ["float32", "bfloat16"])
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, sinks=np.array([0.5, 1.5]))])
def test_check_passes_the_gradients_of_a_loss_of_lse_and_names_the_mixups(prec, options):
    q, k, v, dout, dlse = problem(2, 2, 150, 150, 32, seed=3, batch=1)
    (q, k, v, dout), dlse, out, lse, grads = kernel_result(prec, q, k, v, dout, dlse, options)
    dt = getattr(torch, prec)
    tensors = dict(q=torch.tensor(q).to(dt), k=torch.tensor(k).to(dt), v=torch.tensor(v).to(dt), out=out,
                   lse=lse.float(), dout=torch.tensor(dout).to(dt))
    names = ("dq", "dk", "dv", "dsinks")

    def check(grads, dlse, **extra):
        return check_kernel(**tensors, dlse=dlse, layout="bhsd", **dict(zip(names, grads)), **options, **extra)

    verdict = check(grads, torch.tensor(dlse))
    assert verdict.passed, verdict
    # told base 2: the kernel's dlse is that of its base-2 LSE (the natural one's times ln 2)
    base2 = check([g for g in grads], torch.tensor(dlse * math.log(2)), lse_base=2)
    assert base2.grads["dq"].passed and base2.grads["dk"].passed
    for factor, words in ((0.0, "dlse ignored"), (-1.0, "sign flipped"), (math.log(2), "times ln 2")):
        wrong = kernel_result(prec, *problem(2, 2, 150, 150, 32, seed=3, batch=1), options, dlse_factor=factor)[4]
        verdict = check(wrong, torch.tensor(dlse))
        assert not verdict.passed
        for n in ("dq", "dk") + (("dsinks",) if "sinks" in options else ()):
            assert verdict.grads[n].passed is False and any(words in note for note in verdict.grads[n].notes), n
        assert verdict.grads["dv"].passed  # dv sums no dlse


def test_check_refuses_dlse_where_it_is_not_judged():
    q, k, v, dout, dlse = problem(2, 2, 20, 20, 8, batch=1)
    out, lse = attnlib.attention(q, k, v, return_lse=True)
    base = dict(q=q, k=k, v=v, out=out, lse=lse, layout="bhsd")
    with pytest.raises(attnlib.check.UnusableInput, match="dlse was given without dout"):
        check_kernel(**base, dlse=dlse)
    with pytest.raises(attnlib.check.UnusableInput, match="lse_sink='excluded'"):
        check_kernel(**base, dout=dout, dlse=dlse, sinks=np.zeros(2), lse_sink="excluded")
    with pytest.raises(attnlib.check.UnusableInput, match="dlse must have shape"):
        check_kernel(**base, dout=dout, dq=q, dlse=dlse[..., 1:])
    packed = dict(q=q[0].transpose(1, 0, 2), k=k[0].transpose(1, 0, 2), v=v[0].transpose(1, 0, 2),
                  out=out[0].transpose(1, 0, 2), layout="thd", cu_seqlens_q=np.array([0, 20]),
                  cu_seqlens_k=np.array([0, 20]))
    with pytest.raises(attnlib.check.UnusableInput, match="not with varlen"):
        check_kernel(**packed, dout=out[0].transpose(1, 0, 2), dq=q[0].transpose(1, 0, 2), dlse=dlse[0])


def test_float32_dsinks_of_a_loss_of_mostly_lse_pass():
    """dlse >> D_i (small v and dout): a float32 kernel's p_sink from its float32 lse is off by
    about u |lse|, which dsinks' size carries (the second reader's repro: 15/30 failed without it)."""
    def f(x):
        return x.astype(np.float32)

    worst = 0.0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        q = f(8 * rng.standard_normal((1, 8, 1, 64)))
        k, v = f(rng.standard_normal((1, 8, 128, 64))), f(1e-4 * rng.standard_normal((1, 8, 128, 64)))
        dout, dlse, sinks = f(1e-4 * rng.standard_normal((1, 8, 1, 64))), f(1e-3 * rng.standard_normal((1, 8, 1))), \
            f(2 * rng.standard_normal(8))
        wide = [x.astype(np.float64) for x in (q, k, v, dout, dlse, sinks)]
        out, lse = attnlib.attention(*wide[:3], sinks=wide[5], return_lse=True)
        grads = attention_backward(*wide[:3], out, lse, wide[3], dlse=wide[4], sinks=wide[5])
        lse32 = f(lse)  # the kernel's dsinks as FlashAttention forms it, in float32
        dsinks = -(np.exp(sinks[None, :, None] - lse32) * (f((wide[3] * out).sum(-1)) - dlse)).sum((0, 2))
        verdict = check_kernel(q, k, v, f(out), lse=lse32, dout=dout, dlse=dlse, dq=f(grads[0]), dk=f(grads[1]),
                               dv=f(grads[2]), dsinks=dsinks, sinks=sinks, layout="bhsd")
        worst = max(worst, verdict.grads["dsinks"].ratio)
        assert verdict.passed, verdict
        wrong = check_kernel(q, k, v, f(out), lse=lse32, dout=dout, dlse=dlse, dq=f(grads[0]), dk=f(grads[1]),
                             dv=f(grads[2]), dsinks=-dsinks, sinks=sinks, layout="bhsd")
        assert not wrong.grads["dsinks"].passed
    assert worst < 0.5


def test_cli_takes_dlse(tmp_path):
    q, k, v, dout, dlse = problem(2, 2, 64, 64, 32, seed=4, batch=1)
    out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True)
    grads = attention_backward(q, k, v, out, lse, dout, dlse=dlse, causal=True)
    files = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, dq=grads[0], dk=grads[1], dv=grads[2], dlse=dlse)
    for name, x in files.items():
        np.save(tmp_path / f"{name}.npy", x.astype(np.float32))
    args = [sys.executable, "-m", "attnlib", "check", "--layout", "bhsd", "--causal"]
    with_dlse = sum(([f"--{n}", str(tmp_path / f"{n}.npy")] for n in files), [])
    assert subprocess.run(args + with_dlse, capture_output=True).returncode == 0
    without = [a for a in with_dlse if not a.endswith("dlse.npy") and a != "--dlse"]
    result = subprocess.run(args + without, capture_output=True, text=True)
    assert result.returncode == 1 and "dq: FAIL" in result.stdout
