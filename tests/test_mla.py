"""MLA's second query (``qv``): forward, LSE and gradients against an independent float64
restatement of FlashAttention's ``attention_ref`` with ``qv`` (torch autograd through it), with
GQA, causal and lengths, on the numpy kernel, the dense reference and the torch kernel; the
shared latent as a view; the check naming qv ignored or the scale without Dv."""

import math

import numpy as np
import pytest

import attnlib
from attnlib import attention, attention_backward, attention_vjp, check, reference_attention

torch = pytest.importorskip("torch")
BOUND = 1e-12  # two float64 computations of the same sums in other orders (the 1e-12)
B, HQ, HK, SQ, SK, D, DV = 2, 6, 2, 33, 47, 16, 24


def _problem(seed=0, with_q=True):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, HQ, SQ, D)) if with_q else None
    k = rng.standard_normal((B, HK, SK, D))
    v = rng.standard_normal((B, HK, SK, DV))
    qv = rng.standard_normal((B, HQ, SQ, DV))
    dout = rng.standard_normal((B, HQ, SQ, DV))
    return q, k, v, qv, dout


def fa_reference(q, k, v, qv, dout, causal=False, kv_lengths=None, scale=None):
    """FlashAttention's attention_ref with qv, in float64 with torch autograd: k and v
    repeated to the query heads, ``scores = q k^T * scale + qv v^T * scale`` with ``scale =
    1/sqrt(d + dv)``, a key padding mask, the bottom-right causal mask; rows without keys 0.
    Returns ``(out, lse, (dq, dk, dv, dqv))``."""
    tq = None if q is None else torch.tensor(q, requires_grad=True)
    tk, tv, tqv = (torch.tensor(x, requires_grad=True) for x in (k, v, qv))
    g = HQ // HK
    kk, vv = tk.repeat_interleave(g, 1), tv.repeat_interleave(g, 1)
    d = 0 if q is None else q.shape[-1]
    scale = 1 / math.sqrt(d + v.shape[-1]) if scale is None else scale
    s = torch.einsum("bhtd,bhsd->bhts", tqv * scale, vv)
    if tq is not None:
        s = s + torch.einsum("bhtd,bhsd->bhts", tq * scale, kk)
    lengths = torch.full((B,), SK) if kv_lengths is None else torch.tensor(kv_lengths)
    j = torch.arange(SK)[None, None, None, :]
    i = torch.arange(SQ)[None, None, :, None]
    hide = j >= lengths[:, None, None, None]
    if causal:
        hide = hide | (j > i + lengths[:, None, None, None] - SQ)
    s = s.masked_fill(hide, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None]).masked_fill(hide, 0)
    out = p @ vv
    out.backward(torch.tensor(dout))
    grads = tuple(None if x is None or x.grad is None else x.grad.numpy() for x in (tq, tk, tv, tqv))
    return out.detach().numpy(), lse.detach().numpy(), grads


def _rel(a, b):
    a = np.asarray(a.numpy() if isinstance(a, torch.Tensor) else a, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


CASES = [dict(), dict(causal=True), dict(causal=True, kv_lengths=[SK, 20]), dict(kv_lengths=[0, 30])]


@pytest.mark.parametrize("opts", CASES, ids=["plain", "causal", "causal+lengths", "empty entry"])
@pytest.mark.parametrize("with_q", [True, False], ids=["q+qv", "qv only"])
def test_qv_forward_lse_and_gradients_equal_flash_attentions_reference(opts, with_q):
    q, k, v, qv, dout = _problem(with_q=with_q)
    want_out, want_lse, want_grads = fa_reference(q, k, v, qv, dout, **opts)
    finite = np.isfinite(want_lse)
    for name, run in (("numpy", lambda: attention(q, k, v, qv=qv, return_lse=True, **opts)),
                      ("dense", lambda: reference_attention(q, k, v, qv=qv, return_lse=True, **opts))):
        out, lse = run()
        assert _rel(out, want_out) < BOUND, name
        assert np.array_equal(np.isfinite(lse), finite) and _rel(np.where(finite, lse, 0), np.where(finite, want_lse, 0)) < BOUND
    out, lse = attention(q, k, v, qv=qv, return_lse=True, **opts)
    grads = attention_backward(q, k, v, out, lse, dout, qv=qv, **opts)
    assert len(grads) == 4
    for got, want in zip(grads, want_grads):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.shape == want.shape and _rel(got, want) < BOUND
    dense = attnlib.reference_attention_backward(q, k, v, dout, qv=qv, **opts)
    for got, want in zip(dense, want_grads):
        if want is not None:
            assert _rel(got, want) < BOUND
    t = [None if x is None else torch.tensor(x) for x in (q, k, v, qv, dout)]
    t_out, t_grads = attention_vjp(t[0], t[1], t[2], t[4], qv=t[3], **opts)
    assert isinstance(t_out, torch.Tensor) and _rel(t_out, want_out) < BOUND
    for got, want in zip(t_grads, want_grads):
        if want is not None:
            assert isinstance(got, torch.Tensor) and _rel(got, want) < BOUND


def test_the_default_scale_counts_dv_and_an_explicit_one_is_kept():
    q, k, v, qv, dout = _problem(1)
    joined = attention(np.concatenate([q, qv], -1), np.concatenate([k, v], -1), v)
    assert _rel(attention(q, k, v, qv=qv), joined) < BOUND
    want = fa_reference(q, k, v, qv, dout, scale=0.3)[0]
    assert _rel(attention(q, k, v, qv=qv, scale=0.3), want) < BOUND
    assert _rel(attention(q, k, v, qv=qv), attention(q, k, v)) > 1e-3  # qv does change the scores


def test_qv_with_sinks_and_a_window_on_the_tiled_kernel():
    q, k, v, qv, dout = _problem(2)
    sinks = np.linspace(-1, 1, HQ)
    opts = dict(causal=True, window=(10, 0), sinks=sinks)
    out, lse = attention(q, k, v, qv=qv, return_lse=True, block_q=8, block_k=8, **opts)
    ref_out, ref_lse = reference_attention(q, k, v, qv=qv, return_lse=True, **opts)
    assert _rel(out, ref_out) < BOUND and _rel(lse, ref_lse) < BOUND
    dq, dk, dv, dqv, dsinks = attention_backward(q, k, v, out, lse, dout, qv=qv, **opts)
    ref = attnlib.reference_attention_backward(q, k, v, dout, qv=qv, **opts)
    for got, want in zip((dq, dk, dv, dqv, dsinks), ref):
        assert _rel(got, want) < BOUND


def test_the_shared_latent_is_a_view():
    """FlashMLA's shared latent: v is k's first Dv dimensions, read in place."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 1, 40, 72))
    q = rng.standard_normal((1, 4, 9, 72))
    v = k[..., :64]
    assert np.shares_memory(v, k)
    assert _rel(attention(q, k, v, causal=True), attention(q, k, np.ascontiguousarray(v), causal=True)) == 0


@pytest.mark.parametrize("bad, word", [(dict(qv=np.zeros((B, HQ, SQ, DV + 1))), "head dim"),
                                       (dict(qv=np.zeros((B, HQ, SQ + 1, DV))), "q's shape"),
                                       (dict(qv=np.zeros((HQ, SQ, DV))), "dimensions of v")])
def test_a_bad_qv_is_named(bad, word):
    q, k, v, _, _ = _problem()
    with pytest.raises(ValueError, match=word):
        attention(q, k, v, **bad)
    with pytest.raises(ValueError, match="q is None"):
        attention(None, k, v)


def _bshd(x):
    return np.swapaxes(x, 1, 2)


@pytest.mark.parametrize("wrong, words", [("ignored", "qv ignored"), ("scale", "1/sqrt(D) = ")])
def test_the_check_judges_qv_and_names_its_mixups(wrong, words, tmp_path, capsys):
    q, k, v, qv, _ = (None if x is None else x.astype(np.float32) for x in _problem(4))
    right, lse = attention(q, k, v, qv=qv, causal=True, compute_dtype="float32", return_lse=True)
    args = [_bshd(x) for x in (q, k, v)]
    ok = check.check_kernel(*args, _bshd(right), lse=lse, qv=_bshd(qv), causal=True)
    assert ok.passed is True and ok.lse.passed is True
    without = attention(q, k, v, causal=True, return_lse=True)[1]  # the lse of q k^T alone
    assert check.check_kernel(*args, _bshd(right), lse=without, qv=_bshd(qv), causal=True).lse.passed is False
    bad = attention(q, k, v, causal=True, compute_dtype="float32") if wrong == "ignored" else \
        attention(q, k, v, qv=qv, scale=1 / math.sqrt(D), causal=True, compute_dtype="float32")
    r = check.check_kernel(*args, _bshd(bad), qv=_bshd(qv), causal=True)
    assert r.passed is False and any(words in d for d in r.diagnosis), r.diagnosis
    with pytest.raises(check.UnusableInput, match="dqv was given without qv"):
        check.check_kernel(*args, _bshd(right), dout=_bshd(right), dqv=_bshd(qv))


@pytest.mark.parametrize("prec", ["float64", "float32"])
def test_the_check_judges_mla_gradients(prec):
    """dq, dk, dqv by the joined problem's parts; dv by its value and key parts added."""
    q, k, v, qv, dout = _problem(6)
    if prec == "float32":
        q, k, v, qv, dout = (x.astype(np.float32).astype(np.float64) for x in (q, k, v, qv, dout))
    rnd = (lambda x: x.astype(np.float32).astype(np.float64)) if prec == "float32" else (lambda x: x)
    out, grads = attention_vjp(q, k, v, dout, qv=qv, causal=True)
    given = dict(zip(("dq", "dk", "dv", "dqv"), (rnd(g) for g in grads)))
    kw = dict(layout="bhsd", dtype=prec, causal=True, qv=qv, dout=dout)
    r = check.check_kernel(q, k, v, rnd(out), **kw, **given)
    assert r.passed is True and set(r.grads) == {"dq", "dk", "dv", "dqv"}
    joined = attention_vjp(np.concatenate([q, qv], -1), np.concatenate([k, v], -1), v, dout, causal=True)[1]
    wrong = {"dv": rnd(joined[2]),  # the value part alone: v's part as a key left out
             "dqv": rnd(grads[3] * (1 + 1e-3)), "dk": rnd(joined[1])[..., :D] * (1 + 1e-3)}
    for name, bad in wrong.items():
        r = check.check_kernel(q, k, v, rnd(out), **kw, **dict(given, **{name: bad}))
        assert {n: t.passed for n, t in r.grads.items()} == {n: n != name for n in given}, name


def test_the_cli_takes_qv_and_the_shared_latent(tmp_path, capsys):
    rng = np.random.default_rng(5)
    latent = rng.standard_normal((1, 64, 1, 40)).astype(np.float32)  # bshd keys; values its first 32
    q = rng.standard_normal((1, 64, 4, 40)).astype(np.float32)
    qv = rng.standard_normal((1, 64, 4, 32)).astype(np.float32)
    out = _bshd(attention(_bshd(q), _bshd(latent), _bshd(latent)[..., :32], qv=_bshd(qv), causal=True,
                          compute_dtype="float32"))
    for n, x in (("q", q), ("k", latent), ("qv", qv), ("out", out)):
        np.save(tmp_path / f"{n}.npy", x.astype(np.float32))
    argv = ["--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"), "--out", str(tmp_path / "out.npy"),
            "--causal", "--v-from-k", "32"]
    assert check.main(argv + ["--qv", str(tmp_path / "qv.npy")]) == 0
    assert check.main(argv) == 1  # qv not told
    assert "qv" not in capsys.readouterr().err
    assert check.main(argv[:-2]) == 2  # neither --v nor --v-from-k
    assert "--v-from-k" in capsys.readouterr().err
    assert check.main(argv[:-1] + ["41"]) == 2


def test_a_nan_is_named_by_its_own_tensor_and_q_none_in_the_check():
    """Found by review: a NaN in qv was reported as q's, at an index of the joined array."""
    q, k, v, qv, _ = _problem(7)
    qv = qv.copy()
    qv[0, 1, 2, 3] = np.nan
    with pytest.raises(ValueError, match=r"qv contains NaN or inf \(first at index \(0, 1, 2, 3\)\)"):
        attention(q, k, v, qv=qv)
    with pytest.raises(ValueError, match="qv contains NaN"):
        attention(*(torch.tensor(x) for x in (q, k, v)), qv=torch.tensor(qv))
    with pytest.raises(check.UnusableInput, match="qv: holds NaN"):
        check.check_kernel(*(_bshd(x) for x in (q, k, v)), np.zeros((B, SQ, HQ, DV)), qv=_bshd(qv))
    with pytest.raises(check.UnusableInput, match="q is None"):
        check.check_kernel(None, _bshd(k), _bshd(v), np.zeros((B, SQ, HQ, DV)), qv=_bshd(qv))
    # qv-only scores in the check: q and k of head dim 0.
    _, _, v, qv, _ = (x.astype(np.float32) for x in _problem(8))
    out = attention(None, None, v, qv=qv, causal=True, compute_dtype="float32")
    zeros = np.zeros((B, SQ, HQ, 0), np.float32), np.zeros((B, SK, HK, 0), np.float32)
    assert check.check_kernel(*zeros, _bshd(v), _bshd(out), qv=_bshd(qv), causal=True).passed is True


def test_varlen_takes_qv_as_each_sequence_alone():
    """FlashMLA's varlen prefill: the packed qv joined once, each sequence as attention alone."""
    rng = np.random.default_rng(8)
    q, k = rng.standard_normal((10, 4, 8)), rng.standard_normal((12, 2, 8))
    v, qv = rng.standard_normal((12, 2, 6)), rng.standard_normal((10, 4, 6))
    cu_q, cu_k = np.array([0, 3, 3, 10]), np.array([0, 5, 7, 12])
    out = attnlib.attention_varlen(q, k, v, cu_q, cu_k, causal=True, qv=qv)
    dense = attnlib.reference_attention_varlen(q, k, v, cu_q, cu_k, causal=True, qv=qv)
    t = [torch.from_numpy(x) for x in (q, k, v, qv)]
    on_torch = attnlib.attention_varlen(*t[:3], cu_q, cu_k, causal=True, qv=t[3])
    for (q0, q1), (k0, k1) in zip(((0, 3), (3, 3), (3, 10)), ((0, 5), (5, 7), (7, 12))):
        alone = attention(*(x[a:b].swapaxes(0, 1) for x, (a, b) in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1)))),
                          qv=qv[q0:q1].swapaxes(0, 1), causal=True).swapaxes(0, 1)
        assert _rel(out[q0:q1], alone) < BOUND if q1 > q0 else out[q0:q1].size == 0
    assert _rel(dense, out) < BOUND and _rel(on_torch, out) < BOUND
