"""`python -m attnlib check`: synthetic kernels built from attnlib pass or fail with the right
diagnosis, and every unusable input gets one clear message (exit 2)."""

import math
import pickle

import ml_dtypes  # the test extra installs it
import numpy as np
import pytest

import attnlib
from attnlib import check
from attnlib.core.tensorio import save_safetensors

B, S, H, D = 2, 128, 4, 32


def bhsd(x):
    return np.swapaxes(x, 1, 2)


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(3))  # bshd


def kernel(q, k, v, **kw):
    """attnlib's tiled kernel as a float32 kernel under test (32 x 32 tiles, so that it
    rounds differently from the dense baseline), in and out in bshd."""
    return bhsd(attnlib.attention(bhsd(q), bhsd(k), bhsd(v), compute_dtype=kw.pop("compute_dtype", "float32"),
                                  block_q=32, block_k=32, **kw))


def no_rescale_kernel(q, k, v, block=32):
    """A causal float32 kernel that forgets to rescale l and acc when the row max grows."""
    qh, kh, vh = (bhsd(x) for x in (q, k, v))
    scale = np.float32(1 / math.sqrt(qh.shape[-1]))
    m = np.full(qh.shape[:-1], -np.inf, np.float32)
    l = np.zeros(qh.shape[:-1], np.float32)
    acc = np.zeros(qh.shape, np.float32)
    rows = np.arange(qh.shape[-2])[:, None]
    for j0 in range(0, kh.shape[-2], block):
        s = qh @ np.swapaxes(kh[..., j0:j0 + block, :], -1, -2) * scale
        s = np.where(np.arange(j0, j0 + block)[None] <= rows, s, -np.inf)
        m_new = np.maximum(m, s.max(-1))
        p = np.exp(s - np.where(np.isfinite(m_new), m_new, 0)[..., None])
        l, acc, m = l + p.sum(-1), acc + p @ vh[..., j0:j0 + block, :], m_new  # no alpha
    return bhsd(acc / l[..., None])


def run(tmp_path, capsys, tensors, *args):
    """Save the tensors as .npy files and run the CLI; returns (exit code, stdout + stderr)."""
    argv = []
    for name, x in tensors.items():
        path = tmp_path / f"{name}.npy"
        np.save(path, x)
        argv += [f"--{name}", str(path)]
    code = check.main(argv + list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.slow
def test_float32_kernel_passes(tmp_path, capsys, qkv):
    q, k, v = qkv
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=kernel(q, k, v, causal=True)), "--causal")
    assert code == 0, text
    assert "out: PASS" in text and "naive baseline: float32: eager: q k^T, then scaled, each stored, BLAS order; BLAS order, q and k scaled by sqrt(scale) first; softmax first, q and k scaled first; key by key" in text and "verdict: PASS (exit 0)" in text
    assert "within the allowance at every position" in text


@pytest.mark.slow
def test_bfloat16_kernel_passes_in_every_file_form(tmp_path, capsys, qkv):
    qb, kb, vb = (x.astype(ml_dtypes.bfloat16) for x in qkv)
    out = kernel(*(x.astype(np.float32) for x in (qb, kb, vb)), causal=True, compute_dtype="bfloat16")
    # ml_dtypes arrays via np.save (raw |V2 on disk) need --dtype ...
    code, text = run(tmp_path, capsys, dict(q=qb, k=kb, v=vb, out=out), "--causal", "--dtype", "bfloat16")
    assert code == 0 and "kernel precision bfloat16" in text, text
    code, text = run(tmp_path, capsys, dict(q=qb, k=kb, v=vb, out=out), "--causal")
    assert code == 2 and "pass --dtype bfloat16" in text
    # ... as do their bits saved as uint16; safetensors BF16 says it itself.
    bits = {n: x.view(np.uint16) for n, x in dict(q=qb, k=kb, v=vb, out=out).items()}
    code, text = run(tmp_path, capsys, bits, "--causal", "--dtype", "bfloat16")
    assert code == 0, text
    st = tmp_path / "run.safetensors"
    save_safetensors(st, {n: ("bfloat16", b) for n, b in bits.items()})
    code = check.main([arg for n in bits for arg in (f"--{n}", f"{st}:{n}")] + ["--causal"])
    text = capsys.readouterr().out
    assert code == 0 and "kernel precision bfloat16" in text, text


@pytest.mark.slow
def test_off_by_one_causal_mask_fails_with_diagnosis(tmp_path, capsys, qkv):
    q, k, v = qkv
    wrong = kernel(q, k, v, window=(None, 1))  # sees one future key
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=wrong), "--causal")
    assert code == 1 and "out: FAIL" in text
    assert "one future key (off by one)" in text
    assert "shrinks with the query position" in text


@pytest.mark.slow
def test_forgotten_rescale_fails_with_diagnosis(tmp_path, capsys, qkv):
    q, k, v = qkv
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=no_rescale_kernel(q, k, v)), "--causal")
    assert code == 1 and "out: FAIL" in text
    assert "every row that sees at most 32 keys is within the allowance, and the failing rows see more" in text
    assert "rows whose keys fit in one tile of 32 are right" in text
    assert "missing rescale" in text
    assert "grows with the query position" in text


@pytest.mark.slow
def test_wrong_scale_fails_with_diagnosis(tmp_path, capsys, qkv):
    q, k, v = qkv
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=kernel(q, k, v, causal=True, scale=1 / D)),
                     "--causal")
    assert code == 1 and "scale 1/D" in text
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=kernel(q, k, v, scale=1.0)))
    assert code == 1 and "scale 1 (the softmax scale is never applied)" in text


@pytest.mark.slow
def test_window_and_alignment(tmp_path, capsys, qkv):
    q, k, v = qkv
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=kernel(q, k, v, window=(16, 0))),
                     "--window", "16", "0")
    assert code == 0, text
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=kernel(q, k, v, window=(None, 3))),
                     "--window", "-1", "3")
    assert code == 0, text
    # Fewer queries than keys: the two causal alignments differ, and the check tells which one.
    q2 = q[:, :48]
    top_left = kernel(q2, k, v, causal=True, causal_align="top_left")
    code, text = run(tmp_path, capsys, dict(q=q2, k=k, v=v, out=top_left), "--causal", "--align", "top_left")
    assert code == 0, text
    code, text = run(tmp_path, capsys, dict(q=q2, k=k, v=v, out=top_left), "--causal")
    assert code == 1 and "causal alignment top_left instead of bottom_right" in text


@pytest.mark.slow
def test_swapped_layout(tmp_path, capsys, qkv):
    q, k, v = qkv
    out = kernel(q, k, v, causal=True)
    # Shapes give it away: a hint, exit 2.
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=bhsd(out).copy()), "--causal")
    assert code == 2 and "out looks like bhsd" in text and "the kernel wrote it in the other layout" in text
    # The inputs themselves in the other layout: the hint names the layout that fits.
    code, text = run(tmp_path, capsys, dict(q=bhsd(q).copy(), k=bhsd(k)[:, :2, :96].copy(),
                                            v=bhsd(v)[:, :2, :96].copy(), out=bhsd(out).copy()))
    assert code == 2 and "these shapes fit --layout bhsd" in text
    # PyTorch-layout files whose shapes fit both layouts: the values tell.
    code, text = run(tmp_path, capsys, dict(q=bhsd(q).copy(), k=bhsd(k).copy(), v=bhsd(v).copy(),
                                            out=bhsd(out).copy()), "--causal")
    assert code == 1 and "read as --layout bhsd" in text and "the files are in bhsd, not bshd" in text
    # seqlen == nheads: the shapes agree, the values tell.
    q2, k2, v2 = (x[:, :H] for x in qkv)  # (B, 4, 4, D)
    swapped = bhsd(kernel(q2, k2, v2)).copy()
    code, text = run(tmp_path, capsys, dict(q=q2, k=k2, v=v2, out=swapped))
    assert code == 1 and "seqlen and heads axes swapped" in text


@pytest.mark.slow
def test_one_bad_head_is_named(tmp_path, capsys, qkv):
    q, k, v = qkv
    out = kernel(q, k, v, causal=True)
    out[:, :, 2] = kernel(q, k, v, causal=True, scale=0.5)[:, :, 2]
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=out), "--causal")
    assert code == 1 and "only heads [2] fail" in text


@pytest.mark.slow
def test_nonfinite_output_is_a_failure_with_positions(tmp_path, capsys, qkv):
    q, k, v = qkv
    out = kernel(q, k, v, kv_lengths=[S, 0])  # batch 1 sees no key: out = 0 there
    nan_out = out.copy()
    nan_out[1] = np.nan  # a kernel that divides 0 by 0 on empty rows
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=nan_out), "--kv-lengths", str(S), "0")
    assert code == 1 and f"{S * H * D} NaN and 0 inf values, first at batch 1, query 0, head 0, dim 0" in text
    assert f"{S * H * D} NaN and 0 inf values in {S * H} rows: all in rows with no visible key" in text
    assert "every finite row is within the allowance" in text
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=out), "--kv-lengths", str(S), "0")
    assert code == 0, text


def test_lse_verdict(tmp_path, capsys, qkv):
    q, k, v = qkv
    out, lse = attnlib.attention(*(bhsd(x) for x in qkv), kv_lengths=[S, 0], return_lse=True,
                                 compute_dtype="float32")
    fa_lse = np.where(np.isneginf(lse), np.inf, lse)  # FlashAttention writes +inf on empty rows
    tensors = dict(q=q, k=k, v=v, out=bhsd(out))
    code, text = run(tmp_path, capsys, tensors | dict(lse=fa_lse), "--kv-lengths", str(S), "0")
    assert code == 0 and "lse: PASS" in text, text
    code, text = run(tmp_path, capsys, tensors | dict(lse=fa_lse * np.float32(1.001)), "--kv-lengths", str(S), "0")
    assert code == 1 and "lse: FAIL" in text
    code, text = run(tmp_path, capsys, tensors | dict(lse=np.swapaxes(fa_lse, 1, 2).copy()),
                     "--kv-lengths", str(S), "0")
    assert code == 2 and "lse must have shape (2, 4, 128)" in text


@pytest.mark.slow
def test_gradient_verdicts(tmp_path, capsys, qkv):
    q, k, v = qkv
    qh, kh, vh = (bhsd(x).astype(np.float64) for x in qkv)
    out, lse = attnlib.attention(qh, kh, vh, causal=True, return_lse=True)
    dout = np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
    grads = attnlib.attention_backward(qh, kh, vh, out, lse, dout.astype(np.float64), causal=True)
    dq, dk, dv = (bhsd(g).astype(np.float32) for g in grads)  # a float32 kernel's gradients
    tensors = dict(q=q, k=k, v=v, out=bhsd(out).astype(np.float32), dout=bhsd(dout).copy())
    code, text = run(tmp_path, capsys, tensors | dict(dq=dq, dk=dk, dv=dv), "--causal")
    assert code == 0 and "dq: PASS" in text and "dk: PASS" in text and "dv: PASS" in text, text
    code, text = run(tmp_path, capsys, tensors | dict(dq=dq * np.float32(2), dk=dk, dv=dv), "--causal")
    assert code == 1 and "dq: FAIL" in text and "dk: PASS" in text
    bad_dv = dv.copy()
    bad_dv[1, 77, 3, 5] += 1.0
    code, text = run(tmp_path, capsys, tensors | dict(dq=dq, dk=dk, dv=bad_dv), "--causal")
    assert code == 1 and "dv: FAIL" in text and "worst: batch 1, key 77, head 3, dim 5" in text
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=bhsd(out).astype(np.float32), dq=dq), "--causal")
    assert code == 2 and "without dout" in text


@pytest.mark.slow
def test_unusable_inputs(tmp_path, capsys, qkv):
    q, k, v = qkv
    out = kernel(q, k, v)
    ok = dict(q=q, k=k, v=v, out=out)
    assert run(tmp_path, capsys, ok)[0] == 0
    code = check.main(["--q", str(tmp_path / "missing.npy"), "--k", str(tmp_path / "k.npy"),
                       "--v", str(tmp_path / "v.npy"), "--out", str(tmp_path / "out.npy")])
    assert code == 2 and f"--q {tmp_path / 'missing.npy'}: no such file" in capsys.readouterr().err
    code, text = run(tmp_path, capsys, ok | dict(k=k[..., :16]))
    assert code == 2 and "k has head dim 16, q has 32" in text
    code, text = run(tmp_path, capsys, ok | dict(v=(v * 100).astype(np.int32)))
    assert code == 2 and "dtype int32 is not a floating-point type" in text
    code, text = run(tmp_path, capsys, ok | dict(k=k.view(np.uint16)[..., ::2].copy()))
    assert code == 2 and "if these are bfloat16 bits, pass --dtype bfloat16" in text
    bad = q.copy()
    bad[0, 3, 1, 2] = np.inf
    code, text = run(tmp_path, capsys, ok | dict(q=bad))
    assert code == 2 and "--q" in text and "holds NaN or inf (first at [[0, 3, 1, 2]])" in text
    code, text = run(tmp_path, capsys, ok | dict(q=q[0]))
    assert code == 2 and "must all be 4-D" in text


def test_missing_file_and_pickles_are_refused(tmp_path, capsys, qkv):
    q, k, v = qkv
    for name, x in dict(q=q, k=k, v=v).items():
        np.save(tmp_path / f"{name}.npy", x)
    base = ["--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"), "--v", str(tmp_path / "v.npy")]
    assert check.main(base + ["--out", str(tmp_path / "nowhere.npy")]) == 2
    assert "--out " + str(tmp_path / "nowhere.npy") + ": no such file" in capsys.readouterr().err
    np.save(tmp_path / "evil.npy", np.array([{"payload": 1}], dtype=object), allow_pickle=True)
    assert check.main(base + ["--out", str(tmp_path / "evil.npy")]) == 2
    assert "holds pickled Python objects, refused" in capsys.readouterr().err
    (tmp_path / "raw.pkl").write_bytes(pickle.dumps(q))
    assert check.main(base + ["--out", str(tmp_path / "raw.pkl")]) == 2
    assert "unknown file type '.pkl'" in capsys.readouterr().err


def test_npz_and_named_tensors(tmp_path, capsys, qkv):
    q, k, v = qkv
    np.savez(tmp_path / "run.npz", q=q, k=k, v=v, out=kernel(q, k, v, causal=True))
    z = str(tmp_path / "run.npz")
    assert check.main(["--q", z + ":q", "--k", z + ":k", "--v", z + ":v", "--out", z + ":out", "--causal"]) == 0
    capsys.readouterr()
    assert check.main(["--q", z, "--k", z + ":k", "--v", z + ":v", "--out", z + ":out"]) == 2
    assert "holds 4 tensors" in capsys.readouterr().err
    assert check.main(["--q", z + ":x", "--k", z + ":k", "--v", z + ":v", "--out", z + ":out"]) == 2
    assert "no tensor named 'x'" in capsys.readouterr().err


@pytest.mark.slow
def test_html_report_renders(tmp_path, capsys, qkv):
    q, k, v = (x[:1, :64, :2] for x in qkv)
    out = kernel(q, k, v, window=(None, 1))  # a failing kernel: the report shows why
    report = tmp_path / "check.html"
    code, text = run(tmp_path, capsys, dict(q=q, k=k, v=v, out=out), "--causal", "--html", str(report))
    assert code == 1 and "one future key" in text and f"report: {report}" in text
    page = report.read_text()
    assert "Kernel check" in page and "one future key" in page and "<img" in page
    assert "src=\"http" not in page and "href=\"http" not in page  # self-contained
