"""The check's CLI flags of the 2026 variants: ``--intermediate-dtype``, ``--dropout-p`` with
``--dropout-mask`` (booleans or integers), ``--k-mean``, and the block-sparse lists
(``--kv-num-blocks``/``--kv-indices``/``--full-kv-*``, ``--bsr-indptr``/``--bsr-indices`` with
``--block-size``): each passes a right kernel's files and fails a wrong one's."""

import numpy as np

import attnlib


def _cli(tmp_path, files, *flags):
    """``python -m attnlib check`` on ``files`` saved as .npy, in this process (its `main`): the
    exit code and what it printed, as `subprocess.run` gives them."""
    import contextlib
    import io
    from types import SimpleNamespace

    from attnlib.check.cli import main
    for name, x in files.items():
        np.save(tmp_path / f"{name}.npy", x)
    args = ["--layout", "bhsd", *flags]
    args += sum(([f"--{n.replace('_', '-')}", str(tmp_path / f"{n}.npy")] for n in files), [])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_cli_takes_intermediate_dtype_and_a_dropout_mask(tmp_path):
    q, k, v = attnlib.random_qkv(48, 640, 64, seed=5, batch=(1,), heads=2)
    good = attnlib.attention(q, k, v, compute_dtype="float32", intermediate_dtype="float8_e4m3fn")
    files = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32), out=good)
    told = _cli(tmp_path, files, "--intermediate-dtype", "float8_e4m3fn")
    assert told.returncode == 0, told.stdout + told.stderr
    assert "float32 (p in float8_e4m3fn)" in told.stdout
    assert _cli(tmp_path, files).returncode == 1  # judged as a plain float32 kernel: fp8 p fails
    # dropout: the mask saved as booleans (a torch kernel's) or as uint8
    rate = 0.25
    keep = np.random.default_rng(1).random((1, 2, 48, 640)) >= rate
    out = attnlib.attention_dropout(q, k, v, dropout_p=rate, dropout_mask=keep).astype(np.float32)
    for mask in (keep, keep.astype(np.uint8)):
        files = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32), out=out,
                     dropout_mask=mask)
        assert _cli(tmp_path, files, "--dropout-p", str(rate)).returncode == 0
        assert _cli(tmp_path, files, "--dropout-p", "0.5").returncode == 1
    # SageAttention's K smoothing: the kernel read k - mean; its LSE is the true keys'
    mean = k.mean(axis=-2, keepdims=True)
    out, lse = attnlib.attention(q, k, v, return_lse=True)
    files = dict(q=q.astype(np.float32), k=(k - mean).astype(np.float32), v=v.astype(np.float32),
                 out=out.astype(np.float32), lse=lse.astype(np.float32), k_mean=mean.astype(np.float32))
    assert _cli(tmp_path, files).returncode == 0
    files.pop("k_mean")
    (tmp_path / "k_mean.npy").unlink()
    assert _cli(tmp_path, files).returncode == 1  # the LSE judged against the smoothed keys'


def test_cli_takes_block_sparse_lists(tmp_path):
    """FlexAttention's lists (the mask flags apply to the listed pairs) and FlashInfer's BSR, as files."""
    from attnlib import block_mask_from_kv_blocks
    q, k, v = attnlib.random_qkv(96, 128, 32, seed=6, batch=(1,), heads=2)
    listed = np.random.default_rng(0).random((3, 4)) < 0.5
    listed[:, 0] = True
    counts, order = listed.sum(-1)[None, None], np.argsort(~listed, axis=-1, kind="stable")[None, None]
    mask = block_mask_from_kv_blocks(counts, order, block_size=32, seq_lengths=(96, 128),
                                     mask_mod=lambda b, h, i, j: i + 32 >= j)
    out = attnlib.attention(q, k, v, block_mask=mask).astype(np.float32)
    files = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32), out=out,
                 kv_num_blocks=counts.astype(np.int32), kv_indices=order.astype(np.int32))
    flex = ("--block-size", "32", "32", "--causal")  # bottom-right causal: i + 32 >= j at 96 x 128
    assert _cli(tmp_path, files, *flex).returncode == 0
    assert _cli(tmp_path, files, "--block-size", "32", "32").returncode == 1  # partial blocks without causal
    t = np.ascontiguousarray(np.transpose(order, (0, 1, 2, 3)))
    files["kv_indices"] = np.where(np.arange(4) < counts[..., None], np.roll(t, 1, -1), t).astype(np.int32)
    assert _cli(tmp_path, files, *flex).returncode == 1  # the lists misread
    # FlashInfer's BSR: the same blocks, every pair in them (no mask flags)
    rows, cols = np.nonzero(listed)
    indptr = np.concatenate([[0], np.cumsum(listed.sum(-1))]).astype(np.int32)
    out = attnlib.attention(q, k, v, block_mask=attnlib.block_mask_from_bsr(indptr, cols, 32, 32, 96, 128))
    files = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32), out=out.astype(np.float32),
                 bsr_indptr=indptr, bsr_indices=cols.astype(np.int32))
    assert _cli(tmp_path, files, "--block-size", "32", "32").returncode == 0
    bad = _cli(tmp_path, files)
    assert bad.returncode == 2 and "--block-size" in bad.stderr


def test_cli_refuses_half_a_dropout(tmp_path):
    q, k, v = attnlib.random_qkv(8, 16, 8, seed=1, batch=(1,), heads=1)
    keep = np.ones((1, 1, 8, 16), bool)
    files = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32),
                 out=attnlib.attention(q, k, v).astype(np.float32), dropout_mask=keep)
    alone = _cli(tmp_path, files)
    assert alone.returncode == 2 and "--dropout-p and --dropout-mask" in alone.stderr
    files.pop("dropout_mask")
    (tmp_path / "dropout_mask.npy").unlink()
    assert _cli(tmp_path, files, "--dropout-p", "0.1").returncode == 2


def test_cli_judges_native_sparse_attention(tmp_path):
    """``--nsa L S L_SEL TOP_N WINDOW`` with ``--gates`` (and the kernel's ``--selected``)."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 256, 32))
    k, v = (rng.standard_normal((1, 2, 256, 32)) for _ in range(2))
    gates = rng.random((1, 4, 256, 3))
    nsa = attnlib.NSA(block_size=16, stride=8, select_block_size=32, top_n=3, window=32)
    out, branches = attnlib.nsa_attention(q, k, v, gates, nsa, return_branches=True)
    files = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32), out=out.astype(np.float32),
                 gates=gates.astype(np.float32), selected=branches["blocks"].astype(np.int32))
    flags = ("--nsa", "16", "8", "32", "3", "32")
    right = _cli(tmp_path, files, *flags)
    assert right.returncode == 0 and "selection: PASS" in right.stdout, right.stdout + right.stderr
    files["gates"] = gates[..., ::-1].astype(np.float32)  # the gates in the other order
    assert _cli(tmp_path, files, *flags).returncode == 1
    files["gates"] = gates.astype(np.float32)
    files["selected"] = np.argsort(-branches["blocks"], -1).astype(np.int32)  # not a selection
    assert _cli(tmp_path, files, *flags).returncode == 1
    assert _cli(tmp_path, files, *flags, "--causal").returncode == 2  # NSA's masks are its own


def test_cli_refuses_lists_of_other_heads_and_nan_gates(tmp_path):
    q, k, v = attnlib.random_qkv(64, 64, 16, seed=3, batch=(1,), heads=3)
    out = attnlib.attention(q, k, v).astype(np.float32)
    files = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32), out=out,
                 kv_num_blocks=np.ones((1, 2, 2), np.int32), kv_indices=np.zeros((1, 2, 2, 2), np.int32))
    bad = _cli(tmp_path, files, "--block-size", "32", "32")
    assert bad.returncode == 2 and "--kv-num-blocks" in bad.stderr and "Traceback" not in bad.stderr
    gates = np.random.default_rng(0).random((1, 3, 64, 3)).astype(np.float32)
    gates[0, 0, 50, 1] = np.nan
    files = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32), out=out, gates=gates)
    bad = _cli(tmp_path, files, "--nsa", "16", "8", "32", "2", "16")
    assert bad.returncode == 2 and "gates hold NaN" in bad.stderr
