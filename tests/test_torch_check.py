"""The check and the pytest helper on a torch device: torch tensors are judged with the
reference computed by torch where they live (tested on torch CPU tensors), with the same
verdicts and the same power as the host check."""

import math

import numpy as np
import pytest

import attnlib
from attnlib import check
from attnlib.check import check_kernel
from attnlib.core.arrays import as_numpy
from attnlib.testing import assert_attention_close

torch = pytest.importorskip("torch")
F = torch.nn.functional

B, H, S, D = 2, 4, 192, 32


def _qkv(dtype, scale=1.0, seed=0):
    q, k, v = attnlib.random_qkv(S, S, D, heads=H, batch=(B,), seed=seed)
    return [torch.from_numpy(x * s).to(dtype) for x, s in zip((q, k, v), (1.0, 1.0, scale))]


def _host(*xs):
    return [as_numpy(x, "x") for x in xs]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v_scale", [1.0, 1e-150, 1e150], ids=["unit", "tiny", "huge"])
def test_a_correct_kernel_passes_and_a_defect_fails_on_the_device(dtype, v_scale):
    if v_scale != 1.0 and dtype != torch.float64:
        v_scale = {1e-150: 1e-3, 1e150: 1e3}[v_scale]  # within the 16-bit types' range
    q, k, v = _qkv(dtype, v_scale)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    kw = dict(layout="bhsd", causal=True, causal_align="top_left")
    on_device = check_kernel(q, k, v, out, **kw)
    on_host = check_kernel(*_host(q, k, v, out), **kw)
    assert on_device.passed and on_host.passed
    # The same rule, the reference computed elsewhere: the figures agree to the baselines' rounding.
    assert on_device.out.ratio == pytest.approx(on_host.out.ratio, rel=0.2)
    # A defect a few times the allowance (float64: 1e-10 of the values; below: 16 ulps of the
    # type) fails here as on the host, at every magnitude of the values.
    size = (1e-10 if dtype == torch.float64 else 16 * torch.finfo(dtype).eps) * v_scale
    bad = out.clone()
    bad[1, 2, 100] += size
    bad_device, bad_host = check_kernel(q, k, v, bad, **kw), check_kernel(*_host(q, k, v, bad), **kw)
    assert not bad_device.passed and not bad_host.passed
    assert bad_device.out.ratio == pytest.approx(bad_host.out.ratio, rel=0.2)
    wrong = F.scaled_dot_product_attention(q, k, v)  # not causal at all
    assert not check_kernel(q, k, v, wrong, **kw).passed


@pytest.mark.slow
def test_the_pytest_helper_computes_the_reference_with_torch(monkeypatch):
    """The numpy kernel made unusable and the score sizes' pass (the shared `tile_scores`)
    refusing numpy arrays: torch tensors still pass."""
    q, k, v = _qkv(torch.float64)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def refuse(*args, **kwargs):
        raise AssertionError("computed with numpy")

    from attnlib.check import rule
    from attnlib.judge import gate
    shipped = gate.tile_scores

    def tensors_only(q_i, *args, **kwargs):  # the one kernel's step, on the device's tensors
        if not isinstance(q_i, torch.Tensor):
            refuse()
        return shipped(q_i, *args, **kwargs)

    shipped_forward = rule.forward_on

    def device_only(*args, device=None, **kwargs):  # the forward on the host: refused
        if device is None:
            refuse()
        return shipped_forward(*args, device=device, **kwargs)

    monkeypatch.setattr(rule, "forward_on", device_only)
    monkeypatch.setattr(gate, "tile_scores", tensors_only)
    assert_attention_close(out, q, k, v, layout="bhsd", causal=True, causal_align="top_left")
    with pytest.raises(AssertionError, match="computed with numpy"):
        assert_attention_close(*_host(out, q, k, v), layout="bhsd", causal=True, causal_align="top_left")
    # device= sends numpy inputs there too
    assert_attention_close(*_host(out, q, k, v), layout="bhsd", causal=True, causal_align="top_left",
                           device="cpu")
    bad = out.clone()
    bad[0, 0, 7, 3] += 1e-9
    with pytest.raises(AssertionError, match="not close"):
        assert_attention_close(bad, q, k, v, layout="bhsd", causal=True, causal_align="top_left")


@pytest.mark.slow
def test_options_and_layouts_on_the_device():
    q, k, v = _qkv(torch.float32, seed=3)
    lengths = np.array([150, 60])
    sinks = np.linspace(-1.0, 1.0, H)
    ref = attnlib.attention(q, k, v, window=(40, 8), kv_lengths=lengths, sinks=sinks, softcap=20.0)
    out = ref.to(torch.float32)
    kw = dict(layout="bhsd", window=(40, 8), kv_lengths=lengths, sinks=sinks, softcap=20.0)
    assert check_kernel(q, k, v, out, **kw).passed
    assert not check_kernel(q, k, v, out, **{**kw, "window": (40, 7)}).passed
    bshd = [x.transpose(1, 2).contiguous() for x in (q, k, v, out)]
    assert check_kernel(*bshd, **{**kw, "layout": "bshd"}).passed


def test_bad_devices_are_unusable_input():
    q, k, v = _qkv(torch.float64)
    out = F.scaled_dot_product_attention(q, k, v)
    for device in ("nonsense", "meta"):
        with pytest.raises(check.UnusableInput, match="device"):
            check_kernel(q, k, v, out, layout="bhsd", device=device)


def test_cli_device(tmp_path, capsys):
    q, k, v = _host(*_qkv(torch.float64))
    out = attnlib.attention(q, k, v, causal=True)
    argv = []
    for name, x in dict(q=q, k=k, v=v, out=out).items():
        np.save(tmp_path / f"{name}.npy", x)
        argv += [f"--{name}", str(tmp_path / f"{name}.npy")]
    argv += ["--layout", "bhsd", "--causal"]
    assert check.main(argv + ["--device", "cpu"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert check.main(argv + ["--device", "nonsense"]) == 2
    assert "device" in capsys.readouterr().err
    assert check.main(argv + ["--device", "cpu", "--distributed"]) == 2
    if not torch.cuda.is_available():
        assert check.main(argv + ["--device", "cuda"]) == 2
        assert "CUDA" in capsys.readouterr().err


def _score_mod(s, b, h, i, j):
    return s * (1.0 + 0.25 * h) - 0.01 * (i - j)


#: The options of the long-gradient test: a built-in mask, and the programmable ones.
LONG = {
    "causal": (dict(causal=True), {}),
    "mods": (dict(mask_mod=lambda b, h, i, j: (j <= i) | ((i - j) % 7 == 0), score_mod=_score_mod),
             dict(score_mod_grad=lambda s, b, h, i, j: (1.0 + 0.25 * h) + 0 * s)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LONG))
def test_long_gradients_are_judged_with_the_device_backward(monkeypatch, case):
    """The float64 gradients and their componentwise sizes come from the tiled backward, on the
    device (the one kernel's torch backend): judged at any length, as on the host, and a
    gradient off by 1e-6 at one entry fails."""
    from attnlib.check import gradrule as rule

    fwd, grad = LONG[case]
    q, k, v = _qkv(torch.float64, seed=5)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out, lse = attnlib.attention(q, k, v, return_lse=True, **fwd)
    dq, dk, dv = attnlib.attention_backward(q, k, v, out, lse, dout, **fwd, **grad)
    host = check_kernel(*_host(q, k, v, out), layout="bhsd", dout=_host(dout)[0],
                        dq=_host(dq)[0], dk=_host(dk)[0], dv=_host(dv)[0], **fwd, **grad)

    devices = []
    real = rule.tiled_backward

    def recorded(*args, dev=None, **kwargs):
        devices.append(dev)
        return real(*args, dev=dev, **kwargs)

    monkeypatch.setattr(rule, "tiled_backward", recorded)
    on_device = check_kernel(q, k, v, out, layout="bhsd", dout=dout, dq=dq, dk=dk, dv=dv, **fwd, **grad)
    assert [str(d) for d in devices] == ["cpu"]
    assert set(on_device.grads) == set(host.grads) == {"dq", "dk", "dv"}
    for name in ("dq", "dk", "dv"):
        assert on_device.grads[name].passed and host.grads[name].passed, name  # judged
        assert on_device.grads[name].max_err < 1e-13 and host.grads[name].max_err < 1e-13
    bad = dk.clone()
    bad[1, 0, 50, 3] += 1e-6
    seen = check_kernel(q, k, v, out, layout="bhsd", dout=dout, dq=dq, dk=bad, dv=dv, **fwd, **grad).grads["dk"]
    assert seen.passed is False
    assert seen.max_err == pytest.approx(1e-6, rel=1e-6)


@pytest.mark.slow
def test_eager_half_precision_softcap_passes_forward_and_backward():
    """PyTorch's eager softcap in float16 (Hugging Face's Gemma 2: ``s / c``, ``tanh`` and ``c tanh``
    each stored in the type, and so each step of its backward) erred 1.08 of the forward's
    allowance and 1.32-1.57 of the gradients' at (1, 8/4, 633, 32) when the baselines kept the
    softcap in float32; with
    the eager formulations rounding each step it passes, and a gradient scaled by 1.05 still fails."""
    rng = np.random.default_rng(32)
    f16 = attnlib.core.problem.precision("float16")
    q, k = (f16.round(rng.standard_normal((1, h, 300, 32)) * 3).astype(float) for h in (4, 2))
    v = f16.round(rng.standard_normal((1, 2, 300, 32))).astype(float)
    dout = f16.round(rng.standard_normal((1, 4, 300, 32))).astype(float)
    tq, tk, tv = (torch.tensor(x, dtype=torch.float16, requires_grad=True) for x in (q, k, v))
    kk, vv = tk.repeat_interleave(2, 1), tv.repeat_interleave(2, 1)
    s = 50.0 * torch.tanh((tq @ kk.transpose(-1, -2)) * (1 / math.sqrt(32)) / 50.0)
    out = torch.softmax(s.float(), -1).to(torch.float16) @ vv
    out.backward(torch.tensor(dout, dtype=torch.float16))
    grads = [x.grad.double().numpy() for x in (tq, tk, tv)]
    kw = dict(dout=dout, softcap=50.0, layout="bhsd", dtype="float16")
    r = check_kernel(q, k, v, out.detach().double().numpy(), dq=grads[0], dk=grads[1], dv=grads[2], **kw)
    assert r.passed, {n: x.ratio for n, x in ({"out": r.out} | r.grads).items()}
    bad = check_kernel(q, k, v, out.detach().double().numpy(), dq=grads[0] * 1.05, dk=grads[1], dv=grads[2], **kw)
    assert bad.grads["dq"].passed is False
