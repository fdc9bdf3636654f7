"""The other forward entry points on a torch device, tested on torch CPU tensors:
`reference_attention` (the dense reference on the torch backend), `merge_attention`
(`attnlib.core.torch_merge`), `attention_stream` (`attnlib.core.torch_stream`) and
`attention_varlen`: the numpy path's results to rounding (``rel_error < 1e-13`` in float64,
the same ``-inf`` rows), the low-precision baselines within a few units of their precision,
torch tensors out (numpy with ``device=`` and numpy inputs), inputs left alone, the same
errors, and computed with torch."""

import gc
import re
import subprocess
import sys
import weakref

import numpy as np
import pytest

import attnlib
from attnlib.core import hooks, online, problem, reference, stream, varlen
from attnlib.core.torch_backend import Torch
from attnlib.judge.metrics import rel_error, reference_with_abs

torch = pytest.importorskip("torch")

TOL = 1e-13
B, HQ, HK, SQ, SK, D, DV = 2, 4, 2, 37, 53, 16, 8
RNG_SEED = 20240611


def _qkv(sq=SQ, sk=SK, hq=HQ, hk=HK, batch=(B,), d=D, dv=DV, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(batch + (hq, sq, d)), rng.standard_normal(batch + (hk, sk, d)),
            rng.standard_normal(batch + (hk, sk, dv)))


def _segments(rng, n, batch=B, docs=3):
    return np.sort(rng.integers(0, docs, (batch, n)), axis=-1)


_rng = np.random.default_rng(RNG_SEED)
#: Every option the device reference takes, alone and combined (B = 2, Hq = 4 over Hk = 2).
OPTION_CASES = {
    "none": {},
    "causal": {"causal": True},
    "causal_top_left": {"causal": True, "causal_align": "top_left"},
    "window": {"window": (9, 4)},
    "window_left": {"window": (12, None)},
    "causal_window": {"causal": True, "window": (7, None)},
    "lengths": {"kv_lengths": [40, 0], "q_lengths": [37, 12], "causal": True},
    "segments": {"q_segment_ids": _segments(_rng, SQ), "kv_segment_ids": _segments(_rng, SK)},
    "softcap": {"softcap": 2.5},
    "alibi": {"alibi_slopes": np.linspace(0.05, 0.6, HQ)},
    "alibi_per_batch": {"alibi_slopes": np.linspace(0.05, 0.6, B * HQ).reshape(B, HQ), "causal": True},
    "sinks": {"sinks": np.array([-1.0, 0.5, 2.0, 6.0])},
    "sinks_empty_rows": {"sinks": np.array([1.0, 2.0, 3.0, 4.0]), "kv_lengths": [0, 53]},
    "scale": {"scale": 0.7},
    "everything": {"causal": True, "window": (20, None), "softcap": 3.0, "scale": 0.4,
                   "alibi_slopes": np.linspace(0.1, 0.4, HQ), "sinks": np.array([0.0, 1.0, -2.0, 3.0]),
                   "q_segment_ids": _segments(_rng, SQ, docs=2), "kv_segment_ids": _segments(_rng, SK, docs=2),
                   "kv_lengths": [50, 31]},
}
#: What the stream takes of them (no padding, no documents).
STREAM_CASES = {n: kw for n, kw in OPTION_CASES.items()
                if not {"kv_lengths", "q_lengths", "q_segment_ids"} & set(kw)}
STREAM_CASES["everything"] = {n: x for n, x in OPTION_CASES["everything"].items()
                              if n not in ("kv_lengths", "q_segment_ids", "kv_segment_ids")}


def T(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def _assert_close(got_out, got_lse, out, lse, ref_abs, tol=TOL):
    """Out within ``tol`` of ``P @ |V|``, the same -inf rows of lse and its finite ones to
    rounding; returns (rel_error, max lse difference)."""
    assert isinstance(got_out, torch.Tensor) and got_out.dtype == torch.float64
    assert tuple(got_out.shape) == out.shape
    err = rel_error(got_out.numpy(), out, ref_abs)
    assert err < tol, err
    lse_err = 0.0
    if got_lse is not None:
        assert isinstance(got_lse, torch.Tensor) and tuple(got_lse.shape) == lse.shape
        got = got_lse.numpy()
        fin = np.isfinite(lse)
        np.testing.assert_array_equal(np.isfinite(got), fin)
        np.testing.assert_array_equal(got[~fin], lse[~fin])
        lse_err = float(np.abs(got[fin] - lse[fin]).max(initial=0.0))
        assert np.all(np.abs(got[fin] - lse[fin]) <= tol * np.maximum(1.0, np.abs(lse[fin])))
    return err, lse_err


# -- reference_attention ------------------------------------------------------------------------


def _inputs(dtype, seed):
    """q, k, v as numpy float64 and as torch tensors of ``dtype`` holding the same values."""
    tensors = [T(x).to(getattr(torch, dtype)) for x in _qkv(seed=seed)]
    return [x.double().numpy() for x in tensors], tensors


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(OPTION_CASES))
def test_reference_every_option_equals_numpy(name, dtype):
    kw = OPTION_CASES[name]
    (q, k, v), (tq, tk, tv) = _inputs(dtype, seed=1)
    out, lse = attnlib.reference_attention(q, k, v, return_lse=True, **kw)
    _, ref_abs = reference_with_abs(q, k, v, **kw)
    before = [x.clone() for x in (tq, tk, tv)]
    got, got_lse = attnlib.reference_attention(tq, tk, tv, return_lse=True, **kw)
    _assert_close(got, got_lse, out, lse, ref_abs)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(before, (tq, tk, tv)))  # left alone
    alone = attnlib.reference_attention(tq, tk, tv, **kw)  # without lse: out only
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, got)


@pytest.mark.parametrize("shape", [dict(sq=70, sk=20), dict(sq=0), dict(sk=0), dict(hk=1), dict(batch=(2, 1)),
                                   dict(batch=(0,))])
@pytest.mark.parametrize("kw", [{"causal": True}, {"sinks": np.array([0.5, 1.0, 1.5, 2.0])}, {}])
def test_reference_shapes_and_empty_rows(shape, kw):
    if shape.get("batch") == (2, 1) and "sinks" in kw:
        kw = {"sinks": np.ones((2, 1, HQ))}
    q, k, v = _qkv(**shape, seed=2)
    out, lse = attnlib.reference_attention(q, k, v, return_lse=True, **kw)
    _, ref_abs = reference_with_abs(q, k, v, **kw)
    got, got_lse = attnlib.reference_attention(T(q), T(k), T(v), return_lse=True, **kw)
    _assert_close(got, got_lse, out, lse, ref_abs)


def test_reference_two_dimensional_inputs():
    q, k, v = (x[0, 0] for x in _qkv(seed=3))
    for kw in ({}, {"causal": True, "softcap": 2.0, "alibi_slopes": [0.3], "sinks": [1.0]}):
        out, lse = attnlib.reference_attention(q, k, v, return_lse=True, **kw)
        got, got_lse = attnlib.reference_attention(T(q), T(k), T(v), return_lse=True, **kw)
        assert got.shape == (SQ, DV) and got_lse.shape == (SQ,)
        _assert_close(got, got_lse, out, lse, reference_with_abs(q, k, v, **kw)[1])


def test_reference_float16_inputs_are_read_exactly():
    (q, k, v), tensors = _inputs("float16", seed=4)
    kw = OPTION_CASES["everything"]
    out, lse = attnlib.reference_attention(q, k, v, return_lse=True, **kw)
    got, got_lse = attnlib.reference_attention(*tensors, return_lse=True, **kw)
    _assert_close(got, got_lse, out, lse, reference_with_abs(q, k, v, **kw)[1])


def _baselines_apart(q, k, kw, eps):
    """How far two baselines of one precision may lie apart, per query row, in units of each
    entry's ``P @ |V|`` (rounding analysis, u = eps / 2, gamma_n = n u / (1 - n u)): each
    one's scores are off by at most ``delta_i = gamma_{D+3} (sigma_i + |s|_i)`` (``sigma_i =
    max_j |scale| sum_c |q_ic k_jc|``; the scale, softcap and ALiBi steps round ``|s|``), so its
    weights by a factor ``exp(2 delta_i)``, and its sum over the keys and the division add
    ``gamma_{Sk+1}`` (the inputs are rounded to the type once, alike in both); twice that for
    two.  The CPU's BLAS sums in its own order (8 eps apart on one AMD EPYC, 4.8 on an Intel
    Xeon), which is why a measured constant is no bound."""
    u = eps / 2
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    d, sk = q.shape[-1], k.shape[-2]
    scale = kw.get("scale", 1 / np.sqrt(d))
    group = q.shape[-3] // k.shape[-3]
    kk = np.repeat(np.abs(k), group, axis=-3)
    sigma = abs(scale) * (np.abs(q) @ np.swapaxes(kk, -1, -2)).max(axis=-1)  # (..., Hq, Sq)
    slopes = np.abs(np.asarray(kw.get("alibi_slopes", 0.0))).max()
    size = sigma + (kw.get("softcap") or 0.0) + slopes * max(sk, q.shape[-2])  # |s| after every step
    delta = gamma(d + 3) * (sigma + size)
    return (2 * (np.expm1(2 * delta) + gamma(sk + 1)))[..., None]


@pytest.mark.parametrize("compute_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["none", "causal", "lengths", "segments", "softcap", "alibi", "sinks", "scale",
                                  "everything"])
def test_reference_compute_dtype_follows_the_numpy_baseline(compute_dtype, name):
    kw = OPTION_CASES[name]
    q, k, v = _qkv(seed=5)
    out, lse = attnlib.reference_attention(q, k, v, return_lse=True, compute_dtype=compute_dtype, **kw)
    got, got_lse = attnlib.reference_attention(T(q), T(k), T(v), return_lse=True, compute_dtype=compute_dtype,
                                               **kw)
    assert got.dtype == getattr(torch, compute_dtype) and got_lse.dtype == torch.float32
    eps = problem.precision(compute_dtype).eps
    _, ref_abs = reference_with_abs(q, k, v, **kw)
    bound = _baselines_apart(q, k, kw, eps)
    assert np.all(np.abs(got.double().numpy() - out.astype(np.float64)) <= bound * ref_abs)
    fin = np.isfinite(lse)
    np.testing.assert_array_equal(np.isfinite(got_lse.numpy()), fin)
    np.testing.assert_array_equal(got_lse.numpy()[~fin], lse[~fin])
    # lse = m + log(l): each off by its scores' delta_i and the sum's gamma, and by its float32 store.
    apart = bound[..., 0] + 2 * np.finfo(np.float32).eps * np.abs(lse)  # >= 2 (delta_i + gamma)
    assert np.all(np.abs(got_lse.numpy()[fin] - lse[fin]) <= apart[fin])
    host = attnlib.reference_attention(q, k, v, compute_dtype=compute_dtype, device="cpu", **kw)
    assert type(host) is np.ndarray and host.dtype == out.dtype  # bfloat16: an ml_dtypes array


def test_reference_compute_dtype_from_float64_rounds_once():
    """float64 inputs rounded to float16 as numpy rounds them, so that ties of the float32
    path do not move a score: with a single key per row the baseline is v rounded."""
    rng = np.random.default_rng(6)
    v16 = rng.standard_normal((1, 200, 1)).astype(np.float16).astype(np.float64)
    up = np.nextafter(v16.astype(np.float16), np.float16(np.inf)).astype(np.float64)
    v = (v16 + up) / 2 + np.abs(v16) * 2.0 ** -30  # just above a float16 tie: rounds up
    q, k = np.zeros((1, 200, 4)), np.zeros((1, 200, 4))
    kw = dict(window=(0, 0), compute_dtype="float16")
    want = attnlib.reference_attention(q, k, v, **kw)
    got = attnlib.reference_attention(T(q), T(k), T(v), **kw)
    np.testing.assert_array_equal(got.numpy(), want)


def test_reference_torch_compute_dtypes_are_taken():
    q, k, v = _qkv(seed=7)
    a = attnlib.reference_attention(T(q), T(k), T(v), compute_dtype=torch.float16)
    b = attnlib.reference_attention(T(q), T(k), T(v), compute_dtype="float16")
    assert torch.equal(a, b)
    for bad in (torch.int8, "float8", object()):
        with pytest.raises(ValueError, match="compute_dtype"):
            attnlib.reference_attention(T(q), T(k), T(v), compute_dtype=bad)


def test_reference_numpy_inputs_with_device_come_back_as_numpy():
    q, k, v = _qkv(seed=8)
    out, lse = attnlib.reference_attention(q, k, v, return_lse=True, device="cpu", causal=True)
    assert type(out) is np.ndarray and type(lse) is np.ndarray
    want, want_lse = attnlib.reference_attention(q, k, v, return_lse=True, causal=True)
    _assert_close(T(out), T(lse), want, want_lse, reference_with_abs(q, k, v, causal=True)[1])
    mixed = attnlib.reference_attention(T(q), k, v, causal=True)  # one tensor: torch out
    assert isinstance(mixed, torch.Tensor)


@pytest.mark.parametrize("name", ["mask_mod", "score_mod", "block_mask"])
def test_reference_programmable_options_on_the_device(name):
    q, k, v = _qkv(sq=16, sk=16, seed=9)
    mods = {"mask_mod": lambda b, h, i, j: i >= j, "score_mod": lambda s, b, h, i, j: s * 0.5,
            "block_mask": attnlib.create_block_mask(lambda b, h, i, j: i >= j, None, None, 16, 16,
                                                    block_q=8, block_k=8)}
    want = attnlib.reference_attention(q, k, v, **{name: mods[name]})  # the host
    got = attnlib.reference_attention(T(q), T(k), T(v), **{name: mods[name]})
    assert isinstance(got, torch.Tensor) and np.abs(got.numpy() - want).max() < 1e-14


def _shapes_as_tuples(text):
    """``torch.Size([2, 3])`` as numpy prints a shape, ``(2, 3)`` (`problem.group` prints the
    shape of what it is given)."""
    def tup(m):
        dims = [d.strip() for d in m.group(1).split(",") if d.strip()]
        return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
    return re.sub(r"torch\.Size\(\[(.*?)\]\)", tup, text)


def _same_error(host_call, device_call):
    """The exception of each call: the same type, and the messages (shapes printed alike)."""
    with pytest.raises(Exception) as host:
        host_call()
    with pytest.raises(Exception) as dev:
        device_call()
    assert type(dev.value) is type(host.value), (dev.value, host.value)
    return str(host.value), _shapes_as_tuples(str(dev.value))


def test_reference_errors_are_the_hosts():
    q, k, v = _qkv(seed=10)
    bad_q = q.copy()
    bad_q[1, 2, 5, 3] = np.nan
    big = q * 1e200
    cases = [
        ((bad_q, k, v), {}),
        ((q, k, np.where(v > 1, np.inf, v)), {}),
        ((q[0, 0, 0], k, v), {}),  # 1-D q
        ((q, k[..., :5], v), {}),  # head dims differ
        ((q[:, :3], k, v), {}),  # Hq % Hk
        ((big, big[:, :2], v), {}),  # scores overflow
        ((q * 1e5, k, v), {"compute_dtype": "float16"}),  # beyond float16
        ((q, k, v), {"compute_dtype": "float8"}),
        ((q, k, v), {"alibi_slopes": [1.0, 2.0]}),
        ((q, k, v), {"sinks": [np.nan] * HQ}),
        ((q, k, v), {"kv_lengths": [1, 2, 3]}),
        ((q, k, v), {"softcap": 1e-300, "compute_dtype": "float32"}),
    ]
    for (a, b, c), kw in cases:
        host, dev = _same_error(lambda: attnlib.reference_attention(a, b, c, **kw),
                                lambda: attnlib.reference_attention(T(a), T(b), T(c), **kw))
        assert host == dev


# -- merge_attention ----------------------------------------------------------------------------


def _partials(q, k, v, cuts, **kw):
    """numpy attention over each key range ``cuts[r]:cuts[r + 1]`` (empty ranges too)."""
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, l = attnlib.reference_attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True, **kw)
        outs.append(o)
        lses.append(l)
    return outs, lses


@pytest.mark.parametrize("cuts", [[0, 53], [0, 20, 20, 53], [0, 1, 2, 30, 53, 53]])
@pytest.mark.parametrize("kw", [{}, {"window": (3, 0), "causal_align": "top_left"}])
def test_merge_equals_numpy(cuts, kw):
    q, k, v = _qkv(seed=11)
    outs, lses = _partials(q, k, v, cuts, **kw)
    out, lse = attnlib.merge_attention(outs, lses)
    ref_abs = attnlib.merge_attention(*_partials(q, k, np.abs(v), cuts, **kw))[0]  # the same weights, of |v|
    tensors = ([T(o) for o in outs], [T(x) for x in lses])
    before = [x.clone() for x in tensors[0] + tensors[1]]
    got, got_lse = attnlib.merge_attention(*tensors)
    _assert_close(got, got_lse, out, lse, ref_abs)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors[0] + tensors[1]))
    if not kw:  # the partials merged are the whole attention
        full, full_lse = attnlib.reference_attention(q, k, v, return_lse=True)
        _assert_close(got, got_lse, full, full_lse, reference_with_abs(q, k, v)[1])


def test_merge_low_precision_partials_and_host_output():
    q, k, v = _qkv(seed=12)
    outs, lses = _partials(q, k, v, [0, 25, 53])
    outs32 = [o.astype(np.float32) for o in outs]
    lses32 = [x.astype(np.float32) for x in lses]
    out, lse = attnlib.merge_attention(outs32, lses32)
    got, got_lse = attnlib.merge_attention([T(o) for o in outs32], [T(x) for x in lses32])
    _assert_close(got, got_lse, out, lse, reference_with_abs(q, k, v)[1])
    host = attnlib.merge_attention(outs, lses, device="cpu")
    assert all(type(x) is np.ndarray for x in host)
    mixed = attnlib.merge_attention([outs[0], T(outs[1])], lses)
    assert all(isinstance(x, torch.Tensor) for x in mixed)


def test_merge_parts_empty_partials():
    rng = np.random.default_rng(13)
    outs = [T(rng.standard_normal((3, 9, 4))) for _ in range(3)]
    parts = [T(np.stack([rng.standard_normal((3, 9)) * 30, rng.random((3, 9)) * 3], -1)) for _ in range(3)]
    parts[1][0, :4] = -np.inf  # rows that saw no key in a partial
    parts[2][0, :2] = -np.inf
    parts[0][0, :2] = -np.inf
    out, merged = online.merge_parts(outs, parts, Torch(torch.device("cpu")))
    host_out, host_merged = attnlib.core.online.merge_parts([o.numpy() for o in outs], [p.numpy() for p in parts])
    np.testing.assert_allclose(out.numpy(), host_out, rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(np.isfinite(merged.numpy()), np.isfinite(host_merged))


def test_merge_errors_are_the_hosts():
    o, l = np.zeros((2, 5, 3)), np.zeros((2, 5))
    nan_l, inf_l, nan_o = l.copy(), l.copy(), o.copy()
    nan_l[0, 1] = np.nan
    inf_l[1, 2] = np.inf
    nan_o[1, 1, 1] = np.inf
    cases = [([], []), ([o, o], [l]), ([o[0, 0]], [l[0]]), ([o], [l[:, :4]]), ([o, o[:1]], [l, l[:1]]),
             ([o, o], [l, nan_l]), ([o], [inf_l]), ([nan_o], [l]), ([o, o[:1]], [nan_l, l[:1]]),
             ([o, o], [nan_l, l.astype(np.int64)]), ([o.astype(np.int64)], [l]), ([o], [l.astype(bool)])]
    for outs, lses in cases:
        host, dev = _same_error(lambda: attnlib.merge_attention(outs, lses),
                                lambda: attnlib.merge_attention([T(x) for x in outs], [T(x) for x in lses],
                                                                device="cpu"))
        assert host == dev
    with pytest.raises(TypeError, match="complex"):
        attnlib.merge_attention([T(o).to(torch.complex128)], [T(l)])


# -- attention_stream ---------------------------------------------------------------------------


def _chunks(k, v, cuts, conv=T):
    for a, b in zip(cuts[:-1], cuts[1:]):
        yield conv(k[..., a:b, :]), conv(v[..., a:b, :])


CUTS = [0, 7, 7, 30, 31, 53]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(STREAM_CASES))
def test_stream_every_option_equals_numpy(name, dtype):
    kw = STREAM_CASES[name]
    (q, k, v), (tq, tk, tv) = _inputs(dtype, seed=14)
    out, lse = attnlib.attention_stream(q, _chunks(k, v, CUTS, np.asarray), total_keys=SK, return_lse=True, **kw)
    _, ref_abs = reference_with_abs(q, k, v, **kw)
    before = [x.clone() for x in (tq, tk, tv)]
    got, got_lse = attnlib.attention_stream(tq, _chunks(tk, tv, CUTS, lambda x: x), total_keys=SK,
                                            return_lse=True, block_q=16, block_k=8, **kw)
    _assert_close(got, got_lse, out, lse, ref_abs)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(before, (tq, tk, tv)))
    default_tiles = attnlib.attention_stream(tq, _chunks(tk, tv, CUTS, lambda x: x), total_keys=SK, **kw)
    _assert_close(default_tiles, None, out, lse, ref_abs)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [dict(sq=70, sk=20), dict(sq=0), dict(hk=1), dict(batch=())])
def test_stream_shapes_empty_rows_and_no_total_keys(shape):
    q, k, v = _qkv(**shape, seed=15)
    if shape.get("batch") == ():  # 2-D: one head
        q, k, v = q[0], k[0], v[0]
    sk = k.shape[-2]
    cuts = [0, sk // 3, sk // 3, sk]
    for kw, total in (({"causal": True}, sk), ({"causal": True, "causal_align": "top_left"}, None),
                      ({"softcap": 2.0}, None)):
        out, lse = attnlib.attention_stream(q, _chunks(k, v, cuts, np.asarray), total_keys=total,
                                            return_lse=True, **kw)
        got, got_lse = attnlib.attention_stream(T(q), _chunks(k, v, cuts), total_keys=total, return_lse=True,
                                                block_q=8, block_k=8, **kw)
        _assert_close(got, got_lse, out, lse, reference_with_abs(q, k, v, **kw)[1])


def test_stream_of_empty_chunks_only_gives_empty_rows_and_sinks():
    q, k, v = _qkv(sk=0, seed=16)
    sinks = np.array([0.5, 1.0, 1.5, 2.0])
    out, lse = attnlib.attention_stream(q, [(k, v), (k, v)], sinks=sinks, return_lse=True)
    got, got_lse = attnlib.attention_stream(T(q), [(T(k), T(v)), (T(k), T(v))], sinks=sinks, return_lse=True)
    _assert_close(got, got_lse, out, lse, np.zeros(out.shape))
    np.testing.assert_array_equal(got_lse.numpy(), np.broadcast_to(sinks[:, None], lse.shape))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stream_numpy_chunks_and_host_output(dtype):
    q, k, v = _qkv(seed=17)
    tq, tk, tv = (T(x).to(getattr(torch, dtype)) for x in (q, k, v))
    q, k, v = (x.double().numpy() for x in (tq, tk, tv))
    kw = STREAM_CASES["everything"]
    out, lse = attnlib.attention_stream(q, _chunks(k, v, CUTS, np.asarray), total_keys=SK, return_lse=True, **kw)
    ref_abs = reference_with_abs(q, k, v, **kw)[1]
    got, got_lse = attnlib.attention_stream(tq, _chunks(tk, tv, CUTS, lambda x: x), total_keys=SK,
                                            return_lse=True, **kw)
    _assert_close(got, got_lse, out, lse, ref_abs)
    # A torch q with numpy chunks computes on q's device; numpy q with device= gives numpy.
    mixed = attnlib.attention_stream(tq, _chunks(k, v, CUTS, np.asarray), total_keys=SK, **kw)
    _assert_close(mixed, None, out, lse, ref_abs)
    host = attnlib.attention_stream(q, _chunks(k, v, CUTS, np.asarray), total_keys=SK, return_lse=True,
                                    device="cpu", **kw)
    assert all(type(x) is np.ndarray for x in host)
    _assert_close(T(host[0]), T(host[1]), out, lse, ref_abs)


@pytest.mark.slow
def test_stream_consumes_one_chunk_at_a_time():
    q, k, v = _qkv(seed=18)
    refs = []

    def chunks():
        for t, (a, b) in enumerate(zip(CUTS[:-1], CUTS[1:])):
            if t >= 2:  # the chunk before the last one is gone: nothing keeps the chunks
                gc.collect()
                assert refs[t - 2]() is None, f"chunk {t - 2} is still held when chunk {t} is asked for"
            kc = T(k[..., a:b, :].copy())
            refs.append(weakref.ref(kc))
            yield kc, T(v[..., a:b, :].copy())

    got = attnlib.attention_stream(T(q), chunks(), total_keys=SK, causal=True)
    want = attnlib.attention_stream(q, _chunks(k, v, CUTS, np.asarray), total_keys=SK, causal=True)
    _assert_close(got, None, want, None, reference_with_abs(q, k, v, causal=True)[1])


def test_stream_errors_are_the_hosts():
    q, k, v = _qkv(seed=19)
    bad_k = k.copy()
    bad_k[0, 1, 40, 2] = np.nan

    def cases():
        yield 3, {}  # not iterable
        yield [], {}
        yield [(k, v, v)], {}
        yield [(k, v), (k[:, :1], v[:, :1])], {}
        yield [(k[..., :30, :], v[..., :30, :]), (bad_k[..., 30:, :], v[..., 30:, :])], {}
        yield [(k, v)], {"total_keys": SK - 1}
        yield [(k[..., :5, :], v[..., :5, :])], {"total_keys": SK}
        yield [(k, v)], {"causal": True}  # bottom_right needs total_keys
        yield [(k, v)], {"sinks": [1.0]}
        yield [(k[..., :3], v)], {}

    for chunks, kw in cases():
        conv = (lambda c: c) if not isinstance(chunks, list) else \
            (lambda c: [tuple(T(x) for x in pair) for pair in c])
        host, dev = _same_error(lambda: attnlib.attention_stream(q, chunks, **kw),
                                lambda: attnlib.attention_stream(T(q), conv(chunks), **kw))
        assert host == dev
    bad_q = q.copy()
    bad_q[1, 0, 3, 3] = np.inf
    host, dev = _same_error(lambda: attnlib.attention_stream(bad_q, [(k, v)]),
                            lambda: attnlib.attention_stream(T(bad_q), [(T(k), T(v))]))
    assert host == dev


# -- attention_varlen ---------------------------------------------------------------------------

CU_Q = np.array([0, 5, 5, 30, 42, 42])
CU_K = np.array([0, 9, 20, 20, 60, 60])
VARLEN_CASES = {
    "none": {},
    "causal": {"causal": True},
    "causal_top_left": {"causal": True, "causal_align": "top_left"},
    "window": {"window": (3, 2)},
    "softcap": {"softcap": 2.0},
    "alibi_per_sequence": {"alibi_slopes": np.linspace(0.1, 1.0, 5 * HQ).reshape(5, HQ), "causal": True},
    "sinks": {"sinks": np.array([0.3, -1.0, 2.0, 0.0])},
    "seqused_k": {"seqused_k": [5, 11, 0, 30, 0], "causal": True},
    "everything": {"seqused_k": [9, 3, 0, 40, 0], "window": (6, None), "causal": True, "softcap": 3.0,
                   "scale": 0.5, "alibi_slopes": np.linspace(0.1, 0.4, HQ),
                   "sinks": np.linspace(-1, 1, 5 * HQ).reshape(5, HQ)},
}


def _packed_qkv(seed, hk=HK):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((42, HQ, D)), rng.standard_normal((60, hk, D)), rng.standard_normal((60, hk, DV))


def _varlen_ref_abs(q, k, v, kw):
    """``P @ |V|`` per sequence, packed like out."""
    both = varlen.reference_attention_varlen(q, k, np.concatenate([v, np.abs(v)], -1), CU_Q, CU_K, **kw)
    return both[..., DV:]


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(VARLEN_CASES))
def test_varlen_equals_numpy_with_stats(name, dtype):
    kw = VARLEN_CASES[name]
    q, k, v = (T(x).to(getattr(torch, dtype)).double().numpy() for x in _packed_qkv(20))
    out, lse, stats = attnlib.attention_varlen(q, k, v, CU_Q, CU_K, return_lse=True, return_stats=True,
                                               block_q=4, block_k=8, **kw)
    tensors = [T(x).to(getattr(torch, dtype)) for x in (q, k, v)]
    got, got_lse, got_stats = attnlib.attention_varlen(*tensors, T(CU_Q), T(CU_K), return_lse=True,
                                                       return_stats=True, block_q=4, block_k=8, **kw)
    _assert_close(got, got_lse, out, lse, _varlen_ref_abs(q, k, v, kw))
    assert all(torch.equal(a.double(), T(b)) and a.dtype == getattr(torch, dtype) for a, b in zip(tensors, (q, k, v)))
    assert len(got_stats) == len(stats)
    for a, b in zip(got_stats, stats):
        np.testing.assert_array_equal(a.tile_kind, b.tile_kind)
        np.testing.assert_array_equal(a.rescales, b.rescales)
        assert (a.processed_tiles, a.skipped_tiles, a.total_rescales) == \
            (b.processed_tiles, b.skipped_tiles, b.total_rescales)
    ref, ref_lse = attnlib.reference_attention_varlen(*tensors, CU_Q, CU_K, return_lse=True, **kw)
    _assert_close(ref, ref_lse, out, lse, _varlen_ref_abs(q, k, v, kw))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_low_precision_gqa_and_host_output(dtype):
    q, k, v = _packed_qkv(21, hk=1)
    tensors = [T(x).to(getattr(torch, dtype)) for x in (q, k, v)]
    q, k, v = (x.double().numpy() for x in tensors)
    kw = VARLEN_CASES["everything"]
    out, lse = attnlib.attention_varlen(q, k, v, CU_Q, CU_K, return_lse=True, **kw)
    got, got_lse = attnlib.attention_varlen(*tensors, CU_Q, CU_K, return_lse=True, **kw)
    _assert_close(got, got_lse, out, lse, _varlen_ref_abs(q, k, v, kw))
    host = attnlib.attention_varlen(q, k, v, CU_Q, CU_K, return_lse=True, return_stats=True, device="cpu", **kw)
    assert type(host[0]) is np.ndarray and type(host[1]) is np.ndarray and isinstance(host[2], list)
    _assert_close(T(host[0]), T(host[1]), out, lse, _varlen_ref_abs(q, k, v, kw))
    alone = attnlib.attention_varlen(*tensors, CU_Q, CU_K, **kw)
    assert isinstance(alone, torch.Tensor)


def test_varlen_errors_are_the_hosts():
    q, k, v = _packed_qkv(22)
    bad = q.copy()
    bad[7, 1, 2] = np.nan
    cases = [((q[None], k, v), CU_Q, CU_K, {}), ((q, k, v[:50]), CU_Q, CU_K, {}),
             ((bad, k, v), CU_Q, CU_K, {}), ((q, k, v), CU_Q[:-1], CU_K, {}),
             ((q, k, v), CU_Q, CU_K, {"kv_lengths": [1]}), ((q, k, v), CU_Q, CU_K, {"seqused_k": [99] * 5}),
             ((q, k, v), CU_Q, CU_K, {"mask_mod": lambda b, h, i, j: i >= j}),
             ((q, k, v), CU_Q, CU_K, {"unknown_option": 1})]
    for (a, b, c), cq, ck, kw in cases:
        host, dev = _same_error(lambda: attnlib.attention_varlen(a, b, c, cq, ck, **kw),
                                lambda: attnlib.attention_varlen(T(a), T(b), T(c), cq, ck, **kw))
        assert host == dev


# -- computed with torch; numpy untouched --------------------------------------------------------


def _refuse(*args, **kwargs):
    raise AssertionError("the numpy implementation was called")


def test_each_torch_path_computes_with_torch(monkeypatch):
    q, k, v = _qkv(seed=23)
    tq, tk, tv = T(q), T(k), T(v)
    want, want_lse = attnlib.reference_attention(q, k, v, return_lse=True, causal=True)
    outs, lses = _partials(q, k, v, [0, 20, 53])
    merged = attnlib.merge_attention(outs, lses)
    streamed = attnlib.attention_stream(q, _chunks(k, v, CUTS, np.asarray), total_keys=SK, causal=True)
    pq, pk, pv = _packed_qkv(24)
    packed = attnlib.attention_varlen(pq, pk, pv, CU_Q, CU_K, causal=True)
    packed_ref = attnlib.reference_attention_varlen(pq, pk, pv, CU_Q, CU_K, causal=True)
    ref_abs = reference_with_abs(q, k, v, causal=True)[1]
    full_abs = reference_with_abs(q, k, v)[1]
    packed_abs = _varlen_ref_abs(pq, pk, pv, {"causal": True})

    monkeypatch.setattr(problem, "parse", _refuse)  # the host's reading of q, k, v
    # The tiled paths run the shared kernel's steps (`attnlib.core.backend`), on tensors, and
    # so does the dense reference.
    seen = []
    shipped = hooks.get("absorb")
    dense = reference._dense

    def on_tensors(q5, *args, **kwargs):
        seen.append(isinstance(q5, torch.Tensor))
        return dense(q5, *args, **kwargs)

    monkeypatch.setattr(reference, "_dense", on_tensors)

    def absorb(state, *args, **kwargs):
        seen.append(isinstance(state.acc, torch.Tensor) and isinstance(args[0], torch.Tensor))
        return shipped(state, *args, **kwargs)

    monkeypatch.setattr(hooks, "_current", {**hooks._current, "absorb": absorb})
    got = attnlib.reference_attention(tq, tk, tv, causal=True)
    _assert_close(got, None, want, want_lse, ref_abs)
    got = attnlib.merge_attention([T(o) for o in outs], [T(x) for x in lses])
    _assert_close(got[0], got[1], *merged, full_abs)
    got = attnlib.attention_stream(tq, _chunks(k, v, CUTS), total_keys=SK, causal=True)
    _assert_close(got, None, streamed, None, ref_abs)
    tensors = [T(x) for x in (pq, pk, pv)]
    got = attnlib.attention_varlen(*tensors, CU_Q, CU_K, causal=True)
    _assert_close(got, None, packed, None, packed_abs)
    got = attnlib.reference_attention_varlen(*tensors, CU_Q, CU_K, causal=True)
    _assert_close(got, None, packed_ref, None, packed_abs)
    assert seen and all(seen)
    with pytest.raises(AssertionError, match="numpy implementation"):  # the host path is the patched one
        attnlib.reference_attention(q, k, v)


@pytest.mark.slow
def test_numpy_calls_never_import_torch():
    code = """
import sys, numpy as np, attnlib
q, k, v = attnlib.random_qkv(20, 30, 8, seed=0)
o, l = attnlib.reference_attention(q, k, v, return_lse=True, causal=True)
attnlib.reference_attention(q, k, v, compute_dtype="float32")
attnlib.merge_attention([o, o], [l, l])
attnlib.attention_stream(q, [(k[:10], v[:10]), (k[10:], v[10:])], total_keys=30, causal=True)
cu = np.array([0, 20]); cu_k = np.array([0, 30])
attnlib.attention_varlen(q[:, None], k[:, None], v[:, None], cu, cu_k, causal=True)
attnlib.reference_attention_varlen(q[:, None], k[:, None], v[:, None], cu, cu_k)
print("torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
