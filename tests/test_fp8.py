"""fp8 with descales (FlashAttention 3's q/k/v_descale): the attention of the dequantised
values against an independent restatement of FlashAttention's `attention_ref`, the fp8 naive
baseline (`p` rounded to float8_e4m3fn), and the check naming descales ignored, applied twice
or per tensor."""

import math

import numpy as np
import pytest

import attnlib
from attnlib import attention, check, reference_attention
from attnlib.core import tensorio

ml_dtypes = pytest.importorskip("ml_dtypes")
F8 = ml_dtypes.float8_e4m3fn
B, HQ, HK, SQ, SK, D = 2, 6, 2, 40, 56, 32


def _problem(seed=0, magnitude=3.0):
    """fp8 q, k, v (bhsd) and float32 descales (batch, Hk)."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, HQ, SQ, D)) * magnitude).astype(F8)
    k = (rng.standard_normal((B, HK, SK, D)) * magnitude).astype(F8)
    v = (rng.standard_normal((B, HK, SK, D)) * magnitude).astype(F8)
    descales = {n: rng.uniform(0.02, 0.6, (B, HK)).astype(np.float32) for n in ("q", "k", "v")}
    return q, k, v, descales


def fa_attention(q, k, v, q_descale, k_descale, v_descale, causal=False, kv_lengths=None):
    """FlashAttention's attention_ref, restated in float64 on bhsd: q's descale repeated over
    each kv head's group, k and v expanded to the query heads, a bottom-right causal mask and a
    key padding mask; rows with no key give 0."""
    g = q.shape[1] // k.shape[1]
    qd = np.repeat(q_descale.astype(np.float64), g, axis=1)[..., None, None]
    q = q.astype(np.float64) * qd
    k = np.repeat(k.astype(np.float64) * k_descale.astype(np.float64)[..., None, None], g, axis=1)
    v = np.repeat(v.astype(np.float64) * v_descale.astype(np.float64)[..., None, None], g, axis=1)
    s = np.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])
    sq, sk = s.shape[-2:]
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    lengths = np.full(q.shape[0], sk) if kv_lengths is None else np.asarray(kv_lengths)
    hide = j[None] >= lengths[:, None, None]  # (b, 1, sk)
    if causal:
        hide = hide | (j > i + lengths[:, None, None] - sq)
    s = np.where(hide[:, None], -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(axis=-1, keepdims=True)
    return np.divide(p @ v, l, out=np.zeros(q.shape[:-1] + (v.shape[-1],)), where=l > 0)


def _rel(a, b):
    return float(np.abs(np.asarray(a, dtype=np.float64) - b).max() / np.abs(b).max())


@pytest.mark.slow
@pytest.mark.parametrize("causal, kv_lengths", [(False, None), (True, None), (True, [SK, 31])])
def test_the_dequantised_attention_equals_flash_attentions_reference(causal, kv_lengths):
    torch = pytest.importorskip("torch")
    q, k, v, ds = _problem()
    kw = dict(q_descale=ds["q"], k_descale=ds["k"], v_descale=ds["v"])
    want = fa_attention(q, k, v, **kw, causal=causal, kv_lengths=kv_lengths)
    opts = dict(causal=causal, kv_lengths=kv_lengths)
    assert _rel(attention(q, k, v, **opts, **kw), want) < 1e-12
    assert _rel(reference_attention(q, k, v, **opts, **kw), want) < 1e-12
    t = [torch.from_numpy(x.astype(np.float32)).to(torch.float8_e4m3fn) for x in (q, k, v)]
    tk = {n: torch.from_numpy(x) for n, x in kw.items()}
    got = attention(*t, **opts, **tk)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
    assert _rel(got.numpy(), want) < 1e-12
    assert _rel(reference_attention(*t, **opts, **tk).numpy(), want) < 1e-12
    # A per-tensor descale is a scalar, broadcast.
    assert _rel(attention(q, k, v, q_descale=0.5, k_descale=0.25, v_descale=2.0),
                fa_attention(q, k, v, *(np.full((B, HK), x, np.float32) for x in (0.5, 0.25, 2.0)))) < 1e-12


def test_the_inputs_are_never_modified():
    q, k, v = (np.random.default_rng(1).standard_normal((1, 2, 8, 4)) for _ in range(3))
    copies = [x.copy() for x in (q, k, v)]
    d = np.array([[0.5, 2.0]])
    attention(q, k, v, q_descale=d, k_descale=d, v_descale=d)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v), copies))


def _emulated_fp8(q, k, v, causal):
    """An fp8 kernel's arithmetic, dense: bfloat16 inputs and scores, the softmax's weights
    ``exp(s - m) <= 1`` in float32 rounded to fp8 before ``p @ v``, normalised after."""
    bf = ml_dtypes.bfloat16
    g = q.shape[1] // k.shape[1]
    q, k, v = (np.asarray(x, dtype=np.float64).astype(bf).astype(np.float32) for x in (q, k, v))
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = (q @ (k * np.float32(1 / math.sqrt(q.shape[-1]))).swapaxes(-1, -2)).astype(bf).astype(np.float32)
    if causal:
        s = np.where(np.arange(s.shape[-1])[None] > np.arange(s.shape[-2])[:, None] + s.shape[-1] - s.shape[-2],
                     -np.inf, s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    l = p.sum(axis=-1, keepdims=True)
    p = p.astype(F8).astype(np.float32)
    return ((p @ v) / l).astype(bf).astype(np.float64)


def test_the_fp8_baseline_rounds_p_to_fp8():
    torch = pytest.importorskip("torch")
    q, k, v, ds = _problem(2, magnitude=1.0)
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    exact = attention(q, k, v, causal=True)
    errs = {}
    for c in ("bfloat16", "float8_e4m3fn"):
        runs = [attention(q, k, v, causal=True, compute_dtype=c), reference_attention(q, k, v, causal=True, compute_dtype=c),
                attention(*(torch.from_numpy(x) for x in (q, k, v)), causal=True, compute_dtype=c).float().numpy(),
                reference_attention(*(torch.from_numpy(x) for x in (q, k, v)), causal=True,
                                    compute_dtype=c).float().numpy()]
        errs[c] = [np.abs(np.asarray(r, dtype=np.float64) - exact).max() for r in runs]
    assert attention(q, k, v, compute_dtype="float8_e4m3fn").dtype == ml_dtypes.bfloat16
    assert min(errs["float8_e4m3fn"]) > 2 * max(errs["bfloat16"])  # p's 3 mantissa bits show
    emulated = _emulated_fp8(q, k, v, causal=True)
    ref8 = reference_attention(q, k, v, causal=True, compute_dtype="float8_e4m3fn").astype(np.float64)
    assert np.abs(ref8 - emulated).max() < 0.25 * np.abs(emulated - exact).max()


@pytest.mark.slow
def test_the_fp8_check_fails_wrong_outputs_at_long_rows():
    """The weights are rounded as kernels hold them (<= 1), not normalised first: FlashAttention's
    test reference rounds p ~ 1/Sk among fp8's subnormals, an error near the output's own size
    that would let an all-zero output pass (found by review)."""
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((1, 8, 1, 128)) * 3).astype(F8)
    k, v = ((rng.standard_normal((1, 1, 1024, 128)) * 3).astype(F8) for _ in range(2))
    told = {n: np.full((1, 1), 0.3, np.float32) for n in ("q_descale", "k_descale", "v_descale")}
    right = attention(q, k, v, compute_dtype="float8_e4m3fn", **told)
    assert check.check_kernel(q, k, v, right, layout="bhsd", **told).passed is True
    for wrong in (np.zeros_like(right), right.astype(np.float32) * 0.5, -right.astype(np.float32),
                  np.roll(right.astype(np.float32), 1, axis=1)):
        assert check.check_kernel(q, k, v, wrong, layout="bhsd", **told).passed is False


def test_descales_are_refused_by_name():
    q, k, v, ds = _problem()
    for kw, word in ((dict(q_descale=-ds["q"]), "q_descale"), (dict(k_descale=np.ones((3, 2))), "k_descale"),
                     (dict(v_descale=np.array([[np.nan, 1.0]] * B)), "v_descale"),
                     (dict(k_descale=np.zeros((B, HK))), "k_descale")):
        with pytest.raises(ValueError, match=word):
            attention(q, k, v, **kw)
        with pytest.raises(ValueError, match=word):
            reference_attention(q, k, v, **kw)
    pages = np.zeros((4, 8, HK, D))
    with pytest.raises(ValueError, match="paged"):
        attention(np.zeros((1, HQ, 1, D)), pages, pages, block_table=np.zeros((1, 2), int),
                  cache_seqlens=np.array([3]), k_descale=np.ones((1, HK)))
    with pytest.raises(ValueError, match="no backward"):
        attnlib.reference_attention_backward(*(np.ones((1, 2, 4, 4)),) * 4, compute_dtype="float8_e4m3fn")


def _bshd(x):
    return np.swapaxes(x, 1, 2)


def _kernel(q, k, v, causal=True, **descales):
    """An fp8 kernel: FlashAttention's fp8 test reference in attnlib's tiled form (bshd out)."""
    return _bshd(attention(q, k, v, causal=causal, compute_dtype="float8_e4m3fn", **descales))


WRONG = {
    "ignored": (lambda d: {}, "the descales ignored"),
    "v ignored": (lambda d: dict(q_descale=d["q"], k_descale=d["k"]), "v_descale ignored"),
    "twice": (lambda d: {f"{n}_descale": x ** 2 for n, x in d.items()}, "applied twice"),
    "per tensor": (lambda d: {f"{n}_descale": np.full_like(x, x.max()) for n, x in d.items()},
                   "per-tensor descales (the largest"),
}


@pytest.mark.slow
@pytest.mark.parametrize("wrong", list(WRONG))
def test_the_check_passes_an_fp8_kernel_and_names_mishandled_descales(wrong):
    q, k, v, ds = _problem()
    told = dict(q_descale=ds["q"], k_descale=ds["k"], v_descale=ds["v"])
    args = [_bshd(x) for x in (q, k, v)]
    right = check.check_kernel(*args, _kernel(q, k, v, **told), causal=True, **told)
    assert right.passed is True and right.dtype == "float8_e4m3fn", right.diagnosis
    change, words = WRONG[wrong]
    r = check.check_kernel(*args, _kernel(q, k, v, **change(ds)), causal=True, **told)
    assert r.passed is False and any(words in d for d in r.diagnosis), r.diagnosis


@pytest.mark.slow
def test_a_small_bug_in_an_fp8_kernel_still_fails():
    q, k, v, ds = _problem()
    told = dict(q_descale=ds["q"], k_descale=ds["k"], v_descale=ds["v"])
    args = [_bshd(x) for x in (q, k, v)]
    off_by_one = _bshd(attention(q, k, v, window=(None, 1), compute_dtype="float8_e4m3fn", **told))
    r = check.check_kernel(*args, off_by_one, causal=True, **told)
    assert r.passed is False
    with pytest.raises(check.UnusableInput, match="descales"):
        check.check_kernel(*args, off_by_one, causal=True, dout=off_by_one, dq=args[0], **told)


@pytest.mark.slow
def test_the_cli_reads_fp8_safetensors_and_descales(tmp_path, capsys):
    q, k, v, ds = _problem()
    told = dict(q_descale=ds["q"], k_descale=ds["k"], v_descale=ds["v"])
    out = _kernel(q, k, v, **told).astype(np.float32)
    files = {n: ("float8_e4m3fn", _bshd(x).view(np.uint8)) for n, x in (("q", q), ("k", k), ("v", v))}
    tensorio.save_safetensors(str(tmp_path / "qkv.safetensors"), files)
    for n, x in (("out", out), ("qd", ds["q"]), ("kd", ds["k"]), ("vd", ds["v"])):
        np.save(tmp_path / f"{n}.npy", x)
    loaded, kind = tensorio.load_tensor(str(tmp_path / "qkv.safetensors") + ":k", "--k")
    assert kind == "float8_e4m3fn" and np.array_equal(loaded.astype(np.float32), _bshd(k).astype(np.float32))
    argv = [a for n in "qkv" for a in (f"--{n}", f"{tmp_path / 'qkv.safetensors'}:{n}")]
    argv += ["--out", str(tmp_path / "out.npy"), "--causal"]
    descales = ["--q-descale", str(tmp_path / "qd.npy"), "--k-descale", str(tmp_path / "kd.npy"),
                "--v-descale", str(tmp_path / "vd.npy")]
    assert check.main(argv + descales) == 0
    assert "kernel precision float8_e4m3fn" in capsys.readouterr().out
    assert check.main(argv + descales[:4]) == 1  # v_descale not told: the kernel applied it
    capsys.readouterr()
    np.save(tmp_path / "raw.npy", _bshd(q))  # ml_dtypes float8 via np.save: raw 1-byte values
    with pytest.raises(tensorio.TensorFileError, match="float8_e4m3fn"):
        tensorio.load_tensor(str(tmp_path / "raw.npy"), "--q")
    raw, kind = tensorio.load_tensor(str(tmp_path / "raw.npy"), "--q", "float8_e4m3fn")
    assert kind == "float8_e4m3fn" and np.array_equal(raw.astype(np.float32), _bshd(q).astype(np.float32))


def test_descales_in_bfloat16_are_read():
    torch = pytest.importorskip("torch")
    q, k, v, ds = _problem()
    d16 = {n: x.astype(ml_dtypes.bfloat16) for n, x in ds.items()}
    want = fa_attention(q, k, v, *(d16[n].astype(np.float32) for n in "qkv"))
    got = attention(q, k, v, q_descale=d16["q"], k_descale=torch.from_numpy(d16["k"].astype(np.float32)).bfloat16(),
                    v_descale=d16["v"])
    assert _rel(got, want) < 1e-12
