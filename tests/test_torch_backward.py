"""The backward on a torch device (the one kernel on `core/torch_backend.py`) against numpy.

Every case computes the numpy backward on the same values (the torch inputs converted to
float64) and measures the torch gradients against it with the project's gradient metric:
`rel_error` against the componentwise sizes of what each entry sums
(`reference_attention_backward(..., return_abs=True)`).  Torch CPU tensors stand in for a
device; the code is the same on a GPU (every head at once instead of threads).
"""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attnlib import (attention, attention_backward, attention_vjp, create_block_mask, random_qkv,  # noqa: E402
                     reference_attention, reference_attention_backward)
from attnlib.core import backward as backward_mod  # noqa: E402
from attnlib.judge.metrics import rel_error  # noqa: E402

#: The torch backward against the numpy one, both float64: rounding only.
BOUND = 1e-13
NAMES = ("dq", "dk", "dv", "dsinks")
#: Ragged tiles: neither Sq = 37 nor Sk = 45 is a multiple of them.
TILES = dict(block_q=8, block_k=12)
IDS_Q = [[0] * 10 + [1] * 15 + [2] * 12, [0] * 20 + [2] * 17]
IDS_K = [[0] * 15 + [1] * 10 + [2] * 20, [0] * 5 + [1] * 20 + [2] * 20]

OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal top_left": dict(causal=True, causal_align="top_left"),
    "window": dict(window=(6, 3)),
    "causal window": dict(causal=True, window=(9, None)),
    "lengths": dict(q_lengths=[30, 37], kv_lengths=[45, 21]),
    "lengths causal": dict(q_lengths=[30, 12], kv_lengths=[40, 21], causal=True),
    "segments": dict(q_segment_ids=IDS_Q, kv_segment_ids=IDS_K),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes=[0.3, 0.1, 0.5, 0.05]),
    "sinks": dict(sinks=[0.5, -1.0, 2.0, 0.0]),
    "sinks per entry": dict(sinks=np.arange(8.0).reshape(2, 4) / 4 - 1),
    "scale": dict(scale=0.7),
    "all": dict(causal=True, window=(20, None), kv_lengths=[45, 30], q_segment_ids=IDS_Q, kv_segment_ids=IDS_K,
                softcap=2.0, alibi_slopes=[0.3, 0.1, 0.5, 0.05], sinks=[0.5, -1.0, 2.0, 0.0], scale=0.4),
    "softcap alibi window": dict(window=(4, 4), softcap=0.8, alibi_slopes=[0.2, 0.2, 0.7, 0.7]),
}


def problem(sq=37, sk=45, d=8, dv=6, *, batch=(2,), heads=4, kv_heads=2, seed=0, scale=1.0):
    q, k, v = random_qkv(sq, sk, d, dv, batch=batch, heads=heads, kv_heads=kv_heads, seed=seed)
    dout = np.random.default_rng(seed + 100).standard_normal(q.shape[:-1] + (dv,))
    return q * scale, k, v, dout


def numpy_side(q, k, v, dout, kw):
    out, lse = attention(q, k, v, return_lse=True, **kw)
    return out, lse, attention_backward(q, k, v, out, lse, dout, **TILES, **kw)


def errors(got, want, q, k, v, dout, kw):
    """``{name: rel_error}`` of torch gradients against the numpy ones, per gradient."""
    sizes = reference_attention_backward(q, k, v, dout, return_abs=True, **kw)[1]
    assert len(got) == len(want) == len(sizes)
    return {n: rel_error(g, w, a, n) for n, g, w, a in zip(NAMES, got, want, sizes)}


def tensors(*xs, dtype=torch.float64):
    return [torch.from_numpy(np.asarray(x)).to(dtype) for x in xs]


def check(got, want, q, k, v, dout, kw):
    for g, w in zip(got, want):
        assert isinstance(g, torch.Tensor) and g.dtype == torch.float64 and g.device.type == "cpu"
        assert tuple(g.shape) == w.shape
    errs = errors(got, want, q, k, v, dout, kw)
    assert max(errs.values()) < BOUND, errs
    return errs


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_option_matches_the_numpy_backward(name):
    kw = OPTIONS[name]
    q, k, v, dout = problem()
    out, lse, want = numpy_side(q, k, v, dout, kw)
    got = attention_backward(*tensors(q, k, v, out, lse, dout), **TILES, **kw)
    assert len(got) == (4 if "sinks" in kw else 3)
    check(got, want, q, k, v, dout, kw)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 1), (6, 2)])
@pytest.mark.parametrize("per_head", [False, True])
def test_gqa_sums_dk_dv_over_the_group(heads, kv_heads, per_head):
    kw = dict(causal=True)
    if per_head:  # ALiBi slopes and sinks differ between the heads of a group
        kw = dict(alibi_slopes=np.linspace(0.1, 0.6, heads), sinks=np.linspace(-1.0, 1.0, heads))
    q, k, v, dout = problem(batch=(), heads=heads, kv_heads=kv_heads, seed=3)
    out, lse, want = numpy_side(q, k, v, dout, kw)
    got = attention_backward(*tensors(q, k, v, out, lse, dout), **TILES, **kw)
    assert tuple(got[1].shape) == (kv_heads, 45, 8)
    check(got, want, q, k, v, dout, kw)


@pytest.mark.parametrize("tiles", [dict(block_q=1, block_k=1), dict(block_q=5, block_k=7), dict(block_q=64, block_k=64),
                                   dict()])
def test_ragged_and_default_tiles(tiles):
    kw = dict(causal=True, softcap=3.0)
    q, k, v, dout = problem(sq=19, sk=23, batch=(1,))
    out, lse = attention(q, k, v, return_lse=True, **kw)
    want = attention_backward(q, k, v, out, lse, dout, **kw)
    got = attention_backward(*tensors(q, k, v, out, lse, dout), **tiles, **kw)
    check(got, want, q, k, v, dout, kw)


def test_two_dimensional_inputs():
    q, k, v = random_qkv(21, 30, 5, 3, seed=4)
    dout = np.random.default_rng(5).standard_normal((21, 3))
    for kw in (dict(causal=True), dict(sinks=[0.3], alibi_slopes=[0.2])):
        out, lse, want = numpy_side(q, k, v, dout, kw)
        got = attention_backward(*tensors(q, k, v, out, lse, dout), **TILES, **kw)
        assert tuple(got[0].shape) == (21, 5) and tuple(got[2].shape) == (30, 3)
        check(got, want, q, k, v, dout, kw)


@pytest.mark.parametrize("kw", [dict(causal=True),  # Sq > Sk, bottom_right: the first rows see nothing
                                dict(kv_lengths=[0, 20], q_lengths=[45, 30]),
                                dict(kv_lengths=[0, 20], q_lengths=[45, 30], sinks=[0.2, 0.4, 0.6, 0.8]),
                                dict(q_segment_ids=[[5] * 45, [0] * 45], kv_segment_ids=[[1] * 30, [0] * 30])])
def test_rows_without_a_key_contribute_nothing(kw):
    q, k, v, dout = problem(sq=45, sk=30)
    out, lse, want = numpy_side(q, k, v, dout, kw)
    if "sinks" not in kw:
        assert np.isneginf(lse).any()
    got = attention_backward(*tensors(q, k, v, out, lse, dout), **TILES, **kw)
    check(got, want, q, k, v, dout, kw)
    empty = np.isneginf(lse) | (out == 0).all(axis=-1)
    assert (got[0].numpy()[empty] == 0).all()


@pytest.mark.parametrize("sq, sk", [(0, 9), (9, 0), (0, 0)])
def test_nothing_to_compute_gives_zeros(sq, sk):
    q, k, v, dout = problem(sq=sq, sk=sk, batch=(2,))
    out, lse, want = numpy_side(q, k, v, dout, dict(sinks=[1.0] * 4))
    got = attention_backward(*tensors(q, k, v, out, lse, dout), sinks=[1.0] * 4)
    for g, w in zip(got, want):
        assert g.dtype == torch.float64 and tuple(g.shape) == w.shape and not g.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_read_as_stored(dtype):
    kw = dict(causal=True, sinks=[0.5, 0.0, -0.5, 1.0])
    q, k, v, dout = problem(seed=7)
    out, lse = attention(q, k, v, return_lse=True, **kw)
    low = tensors(q, k, v, out, lse, dout, dtype=dtype)
    exact = [x.double().numpy() for x in low]  # the same values, in float64
    want = attention_backward(*exact, **TILES, **kw)
    got = attention_backward(*low, **TILES, **kw)
    assert all(x.dtype == dtype for x in low)
    check(got, want, exact[0], exact[1], exact[2], exact[5], kw)


@pytest.mark.parametrize("qk, v_dout, kw", [
    (1.0, (1e305, 1.0), dict(causal=True, softcap=5.0, sinks=[0.5, -1.0, 2.0, 0.0])),  # e of a few
    (1e-300, (1e300, 1e300), dict(causal=True, softcap=5.0)),  # e near 2000: scaled in steps
])
def test_huge_magnitudes_are_scaled_as_the_numpy_backward_does(qk, v_dout, kw):
    # dout . v beyond float64's range: the gradients are summed with dout / 2**e.
    q, k, v, dout = problem(seed=8)
    q, k, v, dout = q * qk, k * qk, v * v_dout[0], dout * v_dout[1]
    out, lse, want = numpy_side(q, k, v, dout, kw)
    inputs = tensors(q, k, v, out, lse, dout)
    before = [x.clone() for x in inputs]
    got = attention_backward(*inputs, **TILES, **kw)
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))  # never modified
    assert np.abs(want[0]).max() > 1e290
    check(got, want, q, k, v, dout, kw)


def test_gradients_beyond_the_range_are_refused_naming_them():
    q, k, v, dout = problem(seed=9)
    v, dout = v * 1e300, dout * 1e300
    out, lse = attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="dq exceeds float64's range") as host:
        attention_backward(q, k, v, out, lse, dout)
    with pytest.raises(ValueError, match="dq exceeds float64's range") as dev:
        attention_backward(*tensors(q, k, v, out, lse, dout))
    assert str(host.value) == str(dev.value)


def test_scores_that_overflow_only_where_hidden_are_masked_and_visible_ones_refused():
    # Row i < last sees keys j <= i (top_left); q[i] . k[last] overflows but is hidden.
    rng = np.random.default_rng(10)
    q, k, v = rng.standard_normal((3, 40, 8)) * 1e10, rng.standard_normal((3, 40, 8)) * 1e-10, rng.standard_normal((3, 40, 8))
    q[:, -1] *= 1e-310 / 1e10
    k[:, -1] = 1e300
    dout = rng.standard_normal((3, 40, 8))
    kw = dict(causal=True, causal_align="top_left")
    out, lse, want = numpy_side(q, k, v, dout, kw)
    got = attention_backward(*tensors(q, k, v, out, lse, dout), **TILES, **kw)
    check(got, want, q, k, v, dout, kw)
    message = "scores overflow float64"
    with pytest.raises(ValueError, match=message):
        attention_backward(*tensors(q, k, v, out, lse, dout), **TILES)  # no mask: visible


def test_strict_floating_point_mode():
    q, k, v, dout = problem(sq=45, sk=30, seed=11)
    for kw in (dict(causal=True), dict(kv_lengths=[0, 20], sinks=[0.2, 0.4, 0.6, 0.8], softcap=2.0)):
        out, lse, want = numpy_side(q, k, v, dout, kw)
        with np.errstate(divide="raise", over="raise", invalid="raise"):
            got = attention_backward(*tensors(q, k, v, out, lse, dout), **TILES, **kw)
            huge = attention_backward(*tensors(q, k, v * 1e305, out * 1e305, lse, dout), **TILES, **kw)
        check(got, want, q, k, v, dout, kw)
        assert all(torch.isfinite(g).all() for g in huge)


def test_numpy_inputs_with_device_return_numpy():
    kw = dict(causal=True, alibi_slopes=[0.3, 0.1, 0.5, 0.05], sinks=[0.5, -1.0, 2.0, 0.0])
    q, k, v, dout = problem(seed=12)
    out, lse, want = numpy_side(q, k, v, dout, kw)
    copies = [x.copy() for x in (q, k, v, out, lse, dout)]
    got = attention_backward(q, k, v, out, lse, dout, device="cpu", **TILES, **kw)
    assert all(isinstance(g, np.ndarray) and g.dtype == np.float64 for g in got)
    assert all(np.array_equal(a, b) for a, b in zip(copies, (q, k, v, out, lse, dout)))
    assert max(errors(got, want, q, k, v, dout, kw).values()) < BOUND


def test_the_torch_path_runs_the_one_kernel_with_torch(monkeypatch):
    backends = []
    real = backward_mod._backward_plan

    def plan(*args, **kwargs):
        backends.append(args[8].xp.name)  # the Setup's backend
        return real(*args, **kwargs)

    q, k, v, dout = problem(seed=13)
    out, lse, want = numpy_side(q, k, v, dout, dict(causal=True))
    monkeypatch.setattr(backward_mod, "_backward_plan", plan)
    attention_backward(q, k, v, out, lse, dout, causal=True)
    assert backends == ["numpy"]
    got = attention_backward(*tensors(q, k, v, out, lse, dout), causal=True, **TILES)
    assert backends == ["numpy", "torch"]
    check(got, want, q, k, v, dout, dict(causal=True))
    got = attention_backward(q, k, v, out, lse, dout, causal=True, device="cpu")
    assert max(errors(got, want, q, k, v, dout, dict(causal=True)).values()) < BOUND


def test_inputs_unchanged_and_requires_grad_accepted():
    q, k, v, dout = problem(seed=14)
    kw = dict(causal=True, softcap=2.0, sinks=[0.1, 0.2, 0.3, 0.4])
    out, lse, want = numpy_side(q, k, v, dout, kw)
    inputs = tensors(q, k, v, out, lse, dout)
    for x in inputs[:3]:
        x.requires_grad_()
    before = [x.detach().clone() for x in inputs]
    got = attention_backward(*inputs, **TILES, **kw)
    assert all(torch.equal(a.detach(), b) for a, b in zip(inputs, before))
    assert not any(g.requires_grad for g in got)
    check(got, want, q, k, v, dout, kw)


def test_the_same_bits_for_every_thread_count():
    q, k, v, dout = problem(sq=64, sk=80, seed=15, batch=(3,))
    kw = dict(causal=True, alibi_slopes=[0.3, 0.1, 0.5, 0.05])
    out, lse = attention(q, k, v, return_lse=True, **kw)
    inputs = tensors(q, k, v, out, lse, dout)
    runs = [attention_backward(*inputs, block_q=8, block_k=8, workers=w, **kw) for w in (1, 2, 5)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_vjp_on_the_device():
    kw = dict(causal=True, softcap=2.0, sinks=[0.5, -1.0, 2.0, 0.0])
    q, k, v, dout = problem(seed=16)
    want_out, want = attention_vjp(q, k, v, dout, **TILES, **kw)
    out, got = attention_vjp(*tensors(q, k, v, dout), **TILES, **kw)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    check(got, want, q, k, v, dout, kw)
    host_out, host = attention_vjp(q, k, v, dout, device="cpu", **TILES, **kw)
    assert isinstance(host_out, np.ndarray) and all(isinstance(g, np.ndarray) for g in host)
    assert max(errors(host, want, q, k, v, dout, kw).values()) < BOUND
    assert np.abs(host_out - want_out).max() < 1e-14


def _block_mask(fn=lambda b, h, i, j: j <= i):
    return create_block_mask(fn, 2, 4, 37, 45, block_q=8, block_k=12)


def _tanh_mod(s, b, h, i, j):
    return torch.tanh(s) + 0.1 * (i - j) if isinstance(s, torch.Tensor) else np.tanh(s) + 0.1 * (i - j)


def _tanh_grad(s, b, h, i, j):
    t = torch.tanh(s) if isinstance(s, torch.Tensor) else np.tanh(s)
    return 1.0 - t * t


#: The programmable options (torch-written unless named numpy), each with the backward's extra
#: ``score_mod_grad``: a head- and entry-dependent mask whose block mask skips whole key tiles
#: for some units only (their own dq turns), a score_mod with its derivative, block masks.
MODS = {
    "mask_mod": (dict(mask_mod=lambda b, h, i, j: (j <= i) | ((i - j) % 5 == 0)), {}),
    "mask_mod numpy": (dict(mask_mod=lambda b, h, i, j: np.asarray((i - j) % 3 != 1)), {}),
    "mask_mod per head and entry": (dict(mask_mod=lambda b, h, i, j: ((h == 0) & (b == 0)) | (j < 20) | (j > i + 30)), {}),
    "score_mod": (dict(score_mod=_tanh_mod), dict(score_mod_grad=_tanh_grad)),
    "score_mod per head, masked -inf": (
        dict(score_mod=lambda s, b, h, i, j: torch.where((j > i + 5) & (h == 1), -torch.inf, s * (1.0 + 0.25 * h))),
        dict(score_mod_grad=lambda s, b, h, i, j: (1.0 + 0.25 * h) + 0 * s)),
    "block_mask": (dict(block_mask="causal"), {}),
    "mask_mod and another block_mask": (dict(block_mask="causal", mask_mod=lambda b, h, i, j: (i + j) % 4 != 0), {}),
    "all with mods": (dict(causal=True, q_segment_ids=IDS_Q, kv_segment_ids=IDS_K, softcap=2.0,
                           alibi_slopes=[0.3, 0.1, 0.5, 0.05], sinks=[0.5, -1.0, 2.0, 0.0],
                           mask_mod=lambda b, h, i, j: (h != 2) | (j % 2 == 0), score_mod=_tanh_mod),
                      dict(score_mod_grad=_tanh_grad)),
}


def _mods(name):
    fwd, grad = MODS[name]
    fwd = dict(fwd)
    if fwd.get("block_mask") == "causal":
        fwd["block_mask"] = _block_mask()
    return fwd, grad


@pytest.mark.parametrize("name", list(MODS))
def test_mods_equal_the_numpy_backward(name, all_cpus):
    fwd, grad = _mods(name)
    q, k, v, dout = problem(seed=17)
    tiles = {} if "block_mask" in fwd else TILES
    out, lse = attention(q, k, v, return_lse=True, **tiles, **fwd)
    want = attention_backward(q, k, v, out, lse, dout, **tiles, **fwd, **grad)
    got = attention_backward(*tensors(q, k, v, out, lse, dout), **tiles, **fwd, **grad)
    for g, w in zip(got, want):
        assert isinstance(g, torch.Tensor) and tuple(g.shape) == w.shape
    sizes = reference_attention_backward(q, k, v, dout, return_abs=True, **fwd, **grad)[1]
    errs = {n: rel_error(g, w, a, n) for n, g, w, a in zip(NAMES, got, want, sizes)}
    assert max(errs.values()) < BOUND, errs
    # Bit-identical for every thread count, each unit's dq turns its own.
    again = attention_backward(*tensors(q, k, v, out, lse, dout), workers=1, **tiles, **fwd, **grad)
    for g, h in zip(got, again):
        assert torch.equal(g, h)


def test_a_wrong_score_mod_grad_changes_the_device_gradients():
    # Power: the derivative is used (a score_mod_grad of 1 instead of 1 - tanh^2 moves dq, dk).
    fwd, grad = _mods("score_mod")
    q, k, v, dout = problem(seed=17)
    out, lse = attention(q, k, v, return_lse=True, **TILES, **fwd)
    t = tensors(q, k, v, out, lse, dout)
    right = attention_backward(*t, **TILES, **fwd, **grad)
    wrong = attention_backward(*t, **TILES, **fwd, score_mod_grad=lambda s, b, h, i, j: 1.0 + 0 * s)
    sizes = reference_attention_backward(q, k, v, dout, return_abs=True, **fwd, **grad)[1]
    assert rel_error(wrong[0], right[0], sizes[0], "dq") > 1e-3
    assert torch.equal(wrong[2], right[2])  # dv does not see it


def test_vjp_with_mods_on_the_device():
    fwd, grad = _mods("all with mods")
    q, k, v, dout = problem(seed=3)
    out, grads = attention_vjp(*tensors(q, k, v, dout), **TILES, **fwd, **grad)
    want_out, want = attention_vjp(q, k, v, dout, **TILES, **fwd, **grad)
    assert rel_error(out, want_out, reference_attention(q, k, np.abs(v), **fwd)) < BOUND  # against P @ |V|
    sizes = reference_attention_backward(q, k, v, dout, return_abs=True, **fwd, **grad)[1]
    assert max(rel_error(g, w, a, n) for n, g, w, a in zip(NAMES, grads, want, sizes)) < BOUND


@pytest.mark.parametrize("given, match", [
    (dict(score_mod=_tanh_mod), "needs its derivative"),
    (dict(score_mod_grad=_tanh_grad), "without a score_mod"),
    (dict(block_table=np.zeros((2, 1), dtype=np.int32), cache_seqlens=[45, 45]), "block_table"),
    (dict(score_mod=lambda s, b, h, i, j: torch.where((i == 20) & (j == 3), torch.nan, s),
          score_mod_grad=lambda s, b, h, i, j: 1.0 + 0 * s), r"score_mod returned NaN.*queries from 16, keys from 0"),
])
def test_bad_mod_options_are_refused_as_on_the_host(given, match):
    q, k, v, dout = problem(seed=17)
    out, lse = attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=match):
        attention_backward(*tensors(q, k, v, out, lse, dout), **TILES, **given)
    with pytest.raises(ValueError, match=match):
        attention_backward(q, k, v, out, lse, dout, device="cpu", **TILES, **given)

@pytest.mark.parametrize("grad, match", [
    (lambda s, b, h, i, j: s > 0, "score_mod_grad must return numbers"),
    (lambda s, b, h, i, j: np.ones(3), "score_mod_grad returned shape"),
])
def test_a_bad_score_mod_grad_is_named_as_itself(grad, match):
    q, k, v, dout = problem(seed=4)
    out, lse = attention(q, k, v, return_lse=True, score_mod=_tanh_mod)
    for args in ((q, k, v, out, lse, dout), tensors(q, k, v, out, lse, dout)):
        with pytest.raises((TypeError, ValueError), match=match):
            attention_backward(*args, score_mod=_tanh_mod, score_mod_grad=grad)


def test_empty_problems_check_the_mods_as_the_host_does():
    q, k, v, dout = problem(seed=4)
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 7, 5, 4, 4)
    q0, o0, l0 = q[:, :, :0], np.zeros(q.shape[:2] + (0, 6)), np.zeros(q.shape[:2] + (0,))
    for args in ((q0, k, v, o0, l0, o0), tensors(q0, k, v, o0, l0, o0)):
        with pytest.raises(ValueError, match="block_mask is for Sq=7, Sk=5"):
            attention_backward(*args, block_mask=mask)



def test_bad_grad_inputs_are_refused_as_on_the_host():
    q, k, v, dout = problem(seed=18)
    out, lse = attention(q, k, v, return_lse=True)
    cases = {
        "shape": (q, k, v, out[..., :-1, :], lse, dout),
        "nan out": (q, k, v, np.where(out > 0.3, np.nan, out), lse, dout),
        "nan lse": (q, k, v, out, np.full_like(lse, np.nan), dout),
        "inf dout": (q, k, v, out, lse, np.where(dout > 2, np.inf, dout)),
        "wrong lse": (q, k, v, out, lse - 800.0, dout),
    }
    for case, args in cases.items():
        with pytest.raises(ValueError) as host:
            attention_backward(*args)
        with pytest.raises(ValueError) as dev:
            attention_backward(*tensors(*args))
        assert str(host.value) == str(dev.value), case
    with pytest.raises(ValueError, match="lse has -inf rows"):
        attention_backward(*tensors(q, k, v, out, np.full_like(lse, -np.inf), dout), sinks=[1.0] * 4)


def test_the_reference_reads_tensors_on_the_host():
    q, k, v, dout = problem(seed=19)
    kw = dict(causal=True, sinks=[0.5, -1.0, 2.0, 0.0])
    want = reference_attention_backward(q, k, v, dout, **kw)
    got = reference_attention_backward(*tensors(q, k, v, dout), **kw)
    assert all(isinstance(g, np.ndarray) and np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.slow
def test_numpy_inputs_never_import_torch():
    code = ("import sys, numpy as np, attnlib; q, k, v = attnlib.random_qkv(20, 30, 8, seed=0); "
            "out, lse = attnlib.attention(q, k, v, return_lse=True, causal=True); "
            "g = attnlib.attention_backward(q, k, v, out, lse, np.ones_like(out), causal=True); "
            "attnlib.attention_vjp(q, k, v, np.ones_like(out)); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
