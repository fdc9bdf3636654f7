"""attnlib.distributed at the edges: nothing to compute, and values past a length.

Issue 24, items 5 and 13: a call with no piece (an empty axis, every length 0) gives what
`attnlib.attention` gives without touching a cluster; keys past ``kv_lengths`` and query
rows past ``q_lengths`` are never read, whatever ``block_q`` and ``kv_block``.
"""

import numpy as np
import pytest

import attnlib
from attnlib.judge.metrics import rel_error

import attnlib.distributed as ad
import distributed  # the [distributed] extra; make test installs it
from attnlib.distributed import engine
from attnlib.distributed.plan import count_tasks, make_plan
from attnlib.core.masks import mask_specs


@pytest.fixture
def client(dask_client):
    """The pytest run's one LocalCluster (conftest.py's `dask_client`)."""
    return dask_client


@pytest.fixture
def no_cluster(monkeypatch):
    """Any use of a cluster fails the test (a client given, the current one, or a new one)."""
    def refuse(client):
        raise AssertionError("a call with nothing to compute used a cluster")

    monkeypatch.setattr(engine, "_client", refuse)


def _qkv(batch, sq, sk, hq=4, hk=2, d=3, dv=2, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=batch + (hq, sq, d)), rng.normal(size=batch + (hk, sk, d)),
            rng.normal(size=batch + (hk, sk, dv)))


#: (batch, Sq, Sk, lengths): every way for a call to have no piece at all.
EMPTY = {
    "Sq=0": ((2,), 0, 7, {}),
    "Sk=0": ((2,), 7, 0, {}),
    "Sq=Sk=0": ((2,), 0, 0, {}),
    "batch 0": ((0,), 7, 7, {}),
    "batch (3, 0)": ((3, 0), 7, 7, {}),
    "q_lengths 0": ((2,), 7, 7, dict(q_lengths=[0, 0])),
    "kv_lengths 0": ((2,), 7, 7, dict(kv_lengths=[0, 0])),
    "both lengths 0": ((2,), 7, 7, dict(q_lengths=[0, 0], kv_lengths=[0, 0])),
}
OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(2, 1)),
    "causal window top_left": dict(causal=True, window=(3, None), causal_align="top_left"),
    "scores": dict(softcap=3.0, alibi_slopes=[0.5, 0.25, 0.125, 1.0], scale=0.7),
    "sinks": dict(sinks=[0.5, -1.0, 2.0, 0.0]),
    "causal sinks": dict(causal=True, sinks=[0.5, -1.0, 2.0, 0.0]),
}


def _same(got, want):
    """Bit for bit: shapes, zeros, -inf and sinks."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = np.asarray(g[...])
        assert g.shape == w.shape and g.dtype == np.float64
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("case", list(EMPTY))
def test_nothing_to_compute_equals_attention_without_a_cluster(no_cluster, case, option, return_lse):
    batch, sq, sk, lengths = EMPTY[case]
    q, k, v = _qkv(batch, sq, sk)
    options = {**lengths, **OPTIONS[option]}
    if "sinks" in options and batch:  # per entry and head, where the batch allows
        options["sinks"] = np.broadcast_to(options["sinks"], batch + (4,)).copy()
    copies = [x.copy() for x in (q, k, v)]
    want = attnlib.attention(q, k, v, return_lse=return_lse, **options)
    got = ad.attention(q, k, v, client="tcp://127.0.0.1:1", block_q=3, kv_block=2,
                       return_lse=return_lse, **options)
    _same(got, want)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)


@pytest.mark.parametrize("kind", ["npy", "memmap", "zarr", "dask", "bshd"])
@pytest.mark.parametrize("case", ["Sq=0", "Sk=0", "batch 0", "kv_lengths 0"])
def test_nothing_to_compute_with_every_kind_of_input(no_cluster, tmp_path, case, kind):
    import dask.array as da
    import zarr

    batch, sq, sk, lengths = EMPTY[case]
    q, k, v = _qkv(batch, sq, sk, seed=1)
    sinks = np.random.default_rng(1).normal(size=batch + (4,))
    want = attnlib.attention(q, k, v, return_lse=True, causal=True, sinks=sinks, **lengths)
    layout = "bhsd"
    given = []
    for name, x in zip("qkv", (q, k, v)):
        if kind == "bshd":
            layout = "bshd"
            given.append(np.ascontiguousarray(np.swapaxes(x, -2, -3)))
        elif kind in ("npy", "memmap"):
            np.save(tmp_path / f"{name}.npy", x)
            given.append(str(tmp_path / f"{name}.npy") if kind == "npy"
                         else np.load(tmp_path / f"{name}.npy", mmap_mode="r"))
        elif kind == "zarr":
            z = zarr.open_array(str(tmp_path / f"{name}.zarr"), mode="w", shape=x.shape,
                                dtype=x.dtype, chunks=tuple(max(n, 1) for n in x.shape))
            z[...] = x
            given.append(z)
        else:
            given.append(da.from_array(x, chunks=tuple(max(n, 1) for n in x.shape)))
    out, lse = ad.attention(*given, return_lse=True, causal=True, sinks=sinks, layout=layout, **lengths)
    _same((np.swapaxes(out, -2, -3) if kind == "bshd" else out, lse), want)


@pytest.mark.parametrize("ext", ["npy", "zarr"])
@pytest.mark.parametrize("case", ["Sq=0", "Sk=0", "batch 0", "q_lengths 0", "kv_lengths 0"])
def test_nothing_to_compute_into_output_files(no_cluster, tmp_path, case, ext):
    batch, sq, sk, lengths = EMPTY[case]
    q, k, v = _qkv(batch, sq, sk, seed=2)
    sinks = np.random.default_rng(2).normal(size=(4,))
    want = attnlib.attention(q, k, v, return_lse=True, sinks=sinks, **lengths)
    got = ad.attention(q, k, v, return_lse=True, sinks=sinks, out=tmp_path / f"o.{ext}",
                       lse_out=tmp_path / f"l.{ext}", **lengths)
    _same(got, want)
    out_only = ad.attention(q, k, v, sinks=sinks, out=tmp_path / f"o2.{ext}", **lengths)
    _same(out_only, want[0])


def test_two_d_inputs_and_many_heads_per_task(no_cluster):
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(5, 3)), rng.normal(size=(0, 3)), rng.normal(size=(0, 2))
    _same(ad.attention(q, k, v, return_lse=True, sinks=[0.7], heads_per_task=9),
          attnlib.attention(q, k, v, return_lse=True, sinks=[0.7]))
    k, v = rng.normal(size=(6, 3)), rng.normal(size=(6, 2))
    for lengths in (dict(q_lengths=0), dict(kv_lengths=0)):
        _same(ad.attention(q, k, v, return_lse=True, **lengths),
              attnlib.attention(q, k, v, return_lse=True, **lengths))
    _same(ad.attention(q[:0], k, v, return_lse=True, causal=True),
          attnlib.attention(q[:0], k, v, return_lse=True, causal=True))


def test_empty_batch_with_every_per_entry_argument(no_cluster):
    q, k, v = _qkv((0,), 5, 6, seed=4)
    ids = np.zeros((0, 5), int), np.zeros((0, 6), int)
    for options in (dict(q_lengths=np.zeros(0, int), kv_lengths=np.zeros(0, int)),
                    dict(q_segment_ids=ids[0], kv_segment_ids=ids[1], causal=True),
                    dict(sinks=np.zeros((0, 4))), dict(alibi_slopes=np.zeros((0, 4)))):
        _same(ad.attention(q, k, v, return_lse=True, **options),
              attnlib.attention(q, k, v, return_lse=True, **options))


@pytest.mark.parametrize("shape", [dict(hq=0, hk=0), dict(d=0), dict(dv=0)])
def test_shapes_attention_refuses_are_refused_alike(no_cluster, shape):
    q, k, v = _qkv((2,), 5, 0, **shape)
    with pytest.raises(ValueError) as want:
        attnlib.attention(q, k, v)
    with pytest.raises(ValueError) as got:
        ad.attention(q, k, v)
    assert str(got.value) == str(want.value)


def test_a_plan_with_nothing_visible_has_no_piece():
    for batch, sq, sk, lengths in EMPTY.values():
        specs = mask_specs(batch, sq, sk, causal=True, **lengths)
        counts = count_tasks(make_plan(batch, 2, sq, sk, specs, 3, 2, 1))
        assert counts["pieces"] == counts["merges"] == 0
        assert counts["blocks"] == counts["empty_blocks"]


def test_some_entries_empty_others_not(client):
    """An entry with nothing to compute beside entries with pieces: out 0, lse -inf or the sink."""
    q, k, v = _qkv((4,), 9, 11, seed=5)
    sinks = np.random.default_rng(5).normal(size=(4, 4))
    lengths = dict(q_lengths=[0, 9, 3, 9], kv_lengths=[11, 0, 5, 11])
    for options in ({}, dict(causal=True), dict(window=(2, 3)), dict(sinks=sinks, causal=True)):
        for return_lse in (False, True):
            want = attnlib.attention(q, k, v, return_lse=True, **lengths, **options)
            got = ad.attention(q, k, v, client=client, block_q=4, kv_block=4, return_lse=return_lse,
                               **lengths, **options)
            out, lse = got if return_lse else (got, None)
            ref_abs = attnlib.attention(q, k, np.abs(v), **lengths, **options)
            assert out.shape == want[0].shape and rel_error(out, want[0], ref_abs) < 1e-13
            np.testing.assert_array_equal(out[:2], 0.0)  # entry 0: no row, entry 1: no key
            if return_lse:
                np.testing.assert_array_equal(lse[:2], want[1][:2])  # -inf, or the sinks
                np.testing.assert_allclose(lse[2:], want[1][2:], rtol=1e-13, atol=0)


# --- Item 13: values past a length are never read ---------------------------------------

B, H, SQ, SK, D = 3, 2, 37, 41, 4
Q_LEN, KV_LEN = [37, 20, 5], [41, 13, 0]


def _padded(seed=6):
    """Finite q, k, v; the same with NaN and inf past the lengths; the masks of those entries."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, H, SQ, D))
    k, v = rng.normal(size=(B, H, SK, D)), rng.normal(size=(B, H, SK, D))
    qn, kn, vn = q.copy(), k.copy(), v.copy()
    for b in range(B):
        qn[b, :, Q_LEN[b]:] = np.nan
        kn[b, :, KV_LEN[b]:] = np.nan
        vn[b, :, KV_LEN[b]:] = -np.inf
    return (q, k, v), (qn, kn, vn)


def _docs():
    ids = np.stack([np.repeat([0, 1, 2], [10, 20, 11]), np.repeat([0, 1], [20, 21]), np.zeros(SK, int)])
    return dict(causal=True, q_segment_ids=ids[:, :SQ], kv_segment_ids=ids)


PAST = {
    "plain": {},
    "causal sinks": dict(causal=True, sinks=[[0.3, -2.0]] * B),
    "window": dict(window=(5, 2)),
    "documents": _docs(),
}


def _check_never_read(got, finite_run, finite, options):
    """Bit for bit the distributed result on finite data; attnlib.attention's within 1e-13."""
    q, k, v = finite
    for g, f in zip(got, finite_run):
        np.testing.assert_array_equal(np.asarray(g[...]), f)
    want, want_lse = attnlib.attention(q, k, v, q_lengths=Q_LEN, kv_lengths=KV_LEN, return_lse=True,
                                       check_finite=False, **options)
    ref_abs = attnlib.attention(q, k, np.abs(v), q_lengths=Q_LEN, kv_lengths=KV_LEN, **options)
    assert rel_error(np.asarray(got[0][...]), want, ref_abs) < 1e-13
    lse = np.asarray(got[1][...])
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-13, atol=0)
    np.testing.assert_array_equal(lse[~seen], want_lse[~seen])


@pytest.mark.parametrize("blocks", [(16, 16), (4, 4), (5, 7), (64, 64)])
@pytest.mark.parametrize("option", list(PAST))
def test_values_past_a_length_are_never_read(client, option, blocks):
    """NaN in q past q_lengths, NaN in k and -inf in v past kv_lengths: never read, never
    reported (the issue's case is kv_block=16, where keys past a length share a range)."""
    finite, padded = _padded()
    copies = [x.copy() for x in padded]
    options = PAST[option]
    block_q, kv_block = blocks
    run = dict(client=client, q_lengths=Q_LEN, kv_lengths=KV_LEN, return_lse=True,
               block_q=block_q, kv_block=kv_block, **options)
    got = ad.attention(*padded, **run)
    _check_never_read(got, ad.attention(*finite, **run), finite, options)
    for x, c in zip(padded, copies):
        np.testing.assert_array_equal(x, c)  # inputs never written


@pytest.mark.parametrize("kind", ["npy", "memmap", "zarr", "dask", "bshd npy"])
def test_values_past_a_length_are_never_read_from_any_source(client, tmp_path, kind):
    import dask.array as da
    import zarr

    finite, padded = _padded(seed=7)
    options = dict(causal=True)
    run = dict(client=client, q_lengths=Q_LEN, kv_lengths=KV_LEN, return_lse=True, block_q=16,
               kv_block=16, **options)
    given = []
    for name, x in zip("qkv", padded):
        if kind == "bshd npy":
            x = np.ascontiguousarray(np.swapaxes(x, 1, 2))
        if kind in ("npy", "memmap", "bshd npy"):
            np.save(tmp_path / f"{name}.npy", x)
            given.append(np.load(tmp_path / f"{name}.npy", mmap_mode="r") if kind == "memmap"
                         else str(tmp_path / f"{name}.npy"))
        elif kind == "zarr":
            z = zarr.open_array(str(tmp_path / f"{name}.zarr"), mode="w", shape=x.shape, dtype=x.dtype,
                                chunks=(1, 1, 8, D))
            z[...] = x
            given.append(z)
        else:
            given.append(da.from_array(x, chunks=(1, 1, 8, D)))
    if kind == "bshd npy":
        out, lse = ad.attention(*given, layout="bshd", **run)
        got = (np.swapaxes(out, 1, 2), lse)
    else:
        got = ad.attention(*given, **run)
    _check_never_read(got, ad.attention(*finite, **run), finite, options)


def test_values_past_a_length_into_output_files(client, tmp_path):
    finite, padded = _padded(seed=8)
    run = dict(client=client, q_lengths=Q_LEN, kv_lengths=KV_LEN, block_q=16, kv_block=16,
               causal=True, sinks=[0.5, -0.5])
    finite_run = ad.attention(*finite, return_lse=True, **run)
    for ext in ("npy", "zarr"):
        got = ad.attention(*padded, return_lse=True, out=tmp_path / f"o.{ext}",
                           lse_out=tmp_path / f"l.{ext}", **run)
        _check_never_read(got, finite_run, finite, dict(causal=True, sinks=[0.5, -0.5]))


def test_the_reference_command_never_reads_past_a_length(client, tmp_path, monkeypatch):
    """python -m attnlib reference: .npy files (bshd) with NaN past --kv-lengths/--q-lengths."""
    from attnlib.__main__ import main

    finite, padded = _padded(seed=9)
    files = {}
    for name, x in zip("qkv", padded):
        files[name] = str(tmp_path / f"{name}.npy")
        np.save(files[name], np.ascontiguousarray(np.swapaxes(x, 1, 2)))
    args = ["reference", "--q", files["q"], "--k", files["k"], "--v", files["v"], "--causal",
            "--q-lengths", *map(str, Q_LEN), "--kv-lengths", *map(str, KV_LEN),
            "--block-q", "16", "--kv-block", "16", "--out-file", str(tmp_path / "ref.npy"),
            "--lse-file", str(tmp_path / "ref_lse.npy"), "--scheduler", client.scheduler.address]
    assert main(args) == 0
    got = (np.swapaxes(np.load(tmp_path / "ref.npy"), 1, 2), np.load(tmp_path / "ref_lse.npy"))
    finite_run = ad.attention(*finite, client=client, q_lengths=Q_LEN, kv_lengths=KV_LEN, causal=True,
                              return_lse=True, block_q=16, kv_block=16)
    _check_never_read(got, finite_run, finite, dict(causal=True))

    # No key at all: written without a cluster (no --scheduler, none started).
    monkeypatch.setattr(engine, "_client", lambda c: (_ for _ in ()).throw(AssertionError("cluster")))
    for name, x in zip("kv", padded[1:]):
        np.save(tmp_path / f"{name}0.npy", np.ascontiguousarray(np.swapaxes(x[:, :, :0], 1, 2)))
    assert main(["reference", "--q", files["q"], "--k", str(tmp_path / "k0.npy"), "--v",
                 str(tmp_path / "v0.npy"), "--q-lengths", *map(str, Q_LEN),
                 "--out-file", str(tmp_path / "e.npy"), "--lse-file", str(tmp_path / "e_lse.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "e.npy"), 0.0)
    np.testing.assert_array_equal(np.load(tmp_path / "e_lse.npy"), -np.inf)


def test_pieces_end_at_the_lengths():
    """The plan: no piece reaches past q_len or kv_len; the blocks tile every output row once."""
    rng = np.random.default_rng(10)
    for _ in range(50):
        sq, sk = (int(n) for n in rng.integers(0, 40, 2))
        q_len, kv_len = rng.integers(0, sq + 1, 3), rng.integers(0, sk + 1, 3)
        block_q, kv_block = (int(n) for n in rng.integers(1, 20, 2))
        causal = bool(rng.integers(2))
        specs = mask_specs((3,), sq, sk, causal=causal, q_lengths=q_len, kv_lengths=kv_len)
        blocks = make_plan((3,), 2, sq, sk, specs, block_q, kv_block, 1)
        for b in blocks:
            for p in b.pieces:
                assert (p.q0, p.q1) == (b.q0, b.q1)
                assert p.q1 <= q_len[p.entry] and p.k1 <= kv_len[p.entry] and p.k0 < p.k1
        for e in range(3):
            for h in range(2):
                rows = sorted((b.q0, b.q1) for b in blocks if b.entry == (e,) and b.h0 == h)
                edges = [0] + [r1 for _, r1 in rows]
                assert [r0 for r0, _ in rows] == edges[:-1] and edges[-1] == sq
                assert all(r0 < r1 for r0, r1 in rows)


def test_a_misaligned_block_gives_the_same_bits(client):
    """A block received from another worker may lie misaligned in its buffer: the task copies
    it aligned, so a piece is the same bits every run (numpy multiplies misaligned arrays
    with its own loop, not BLAS)."""
    from attnlib.distributed.engine import _piece
    from attnlib.distributed.sources import materialize

    def misaligned(x, offset):
        buf = np.zeros(x.nbytes + 16, np.uint8)
        y = np.frombuffer(buf[offset:offset + x.nbytes].data, dtype=x.dtype).reshape(x.shape)
        y[...] = x
        return y

    finite, _ = _padded(seed=11)
    q, k, v = finite
    spec = mask_specs((B,), SQ, SK)[()]
    args = (q[0, :1, 36:37], k[0, :1, 12:16], v[0, :1, 12:16])
    for x in args:
        m = materialize(misaligned(x, 3))
        assert m.flags.aligned and np.array_equal(m, x)
    rest = (spec.piece(36, 37, 12, 16), 0.5, None, None, "p")
    want = _piece(*(np.ascontiguousarray(x) for x in args), *rest)
    for offset in (1, 3, 8, 9):
        got = _piece(*(misaligned(x, offset) for x in args), *rest)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    runs = [ad.attention(q, k, v, client=client, q_lengths=Q_LEN, kv_lengths=KV_LEN, return_lse=True,
                         block_q=4, kv_block=4) for _ in range(3)]
    for r in runs[1:]:
        for a, b in zip(r, runs[0]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("size", [1e8, 1e16])
def test_tied_large_scores_merge_exactly_across_pieces(client, size):
    """The pieces' lse travels as (m, log l): tied scores of 1e16 split over pieces still
    weigh each key 1/3 (a one-float lse of 1e16 + log 2 is 1e16, and gave 3, not 2)."""
    q, k, v = np.array([[[size]]]), np.full((1, 3, 1), 1.0), np.array([[[1.0], [2.0], [3.0]]])
    out, lse = attnlib.distributed.attention(q, k, v, scale=1.0, kv_block=2, block_q=1, client=client,
                                             return_lse=True)
    assert out[0, 0, 0] == 2.0 and lse[0, 0] == size + np.log(3.0)
