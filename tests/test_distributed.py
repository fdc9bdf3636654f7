"""attnlib.distributed on a real LocalCluster (two worker processes, started once)."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import attnlib
from attnlib.core.masks import mask_specs
from attnlib.judge.metrics import rel_error

import attnlib.distributed as ad
import distributed  # the [distributed] extra; make test installs it
import zarr


@pytest.fixture
def client(dask_client):
    """The pytest run's one LocalCluster (conftest.py's `dask_client`)."""
    return dask_client


def _ids(n, docs, seed):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n), docs - 1, replace=False))
    return np.repeat(np.arange(docs), np.diff(np.concatenate([[0], cuts, [n]])))


def _case(name):
    """(q, k, v, options) of a named case: (B, H, S, D) small enough for the suite."""
    if name == "causal":
        q, k, v = attnlib.random_qkv(1500, 1500, 16, batch=(2,), heads=2, seed=1)
        return q, k, v, dict(causal=True)
    if name == "window":
        q, k, v = attnlib.random_qkv(1800, 1800, 16, batch=(1,), heads=2, seed=2)
        return q, k, v, dict(causal=True, window=(300, None))
    if name == "gqa":
        q, _, _ = attnlib.random_qkv(700, 0, 16, batch=(2,), heads=4, seed=3)
        _, k, v = attnlib.random_qkv(0, 1300, 16, batch=(2,), heads=2, seed=4)
        return q, k, v, dict(causal=True)  # bottom-right: Sq < Sk
    if name == "padded":
        q, k, v = attnlib.random_qkv(1200, 1200, 16, batch=(3,), heads=2, seed=5)
        return q, k, v, dict(causal=True, q_lengths=[1200, 700, 0], kv_lengths=[1200, 900, 300])
    if name == "segments":
        q, k, v = attnlib.random_qkv(1600, 1600, 16, batch=(2,), heads=1, seed=6)
        ids = np.stack([_ids(1600, 7, 0), _ids(1600, 3, 1)])
        return q, k, v, dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    if name == "scores":  # softcap, ALiBi, a scale, top-left alignment, rows that see nothing
        q, k, v = attnlib.random_qkv(1000, 600, 16, batch=(1,), heads=2, seed=7)
        return q, k, v, dict(causal=True, causal_align="bottom_right", softcap=5.0,
                             alibi_slopes=[0.5, 0.125], scale=0.3)
    if name == "sinks":  # per entry and head; blocks without a piece (no keys) give lse = sink
        q, k, v = attnlib.random_qkv(1100, 1100, 16, batch=(3,), heads=4, kv_heads=2, seed=11)
        sinks = np.random.default_rng(11).normal(size=(3, 4)) * 3
        return q, k, v, dict(causal=True, q_lengths=[1100, 600, 0], kv_lengths=[1100, 0, 300],
                             sinks=sinks)
    if name == "variants":  # left padding, chunks, sink tokens in a window (pieces keep their origin)
        q, k, v = attnlib.random_qkv(1000, 1300, 16, batch=(2,), heads=2, seed=12)
        return q, k, v, dict(causal=True, key_leftpad=[100, 417], kv_lengths=[1300, 1250], window=(300, None),
                             sink_token_length=5, attention_chunk=448)
    if name == "two_d":
        q, k, v = attnlib.random_qkv(900, 1100, 16, seed=8)
        return q, k, v, dict(window=(200, 100))
    raise KeyError(name)


CASES = ["causal", "window", "gqa", "padded", "segments", "scores", "sinks", "variants", "two_d"]


def _as(kind, x, tmp_path, name):
    if kind == "memory":
        return x
    if kind in ("npy", "memmap"):
        path = tmp_path / f"{name}.npy"
        np.save(path, x)
        return str(path) if kind == "npy" else np.load(path, mmap_mode="r")
    if kind == "zarr":
        z = zarr.open_array(str(tmp_path / f"{name}.zarr"), mode="w", shape=x.shape, dtype=x.dtype,
                            chunks=tuple(min(n, 256) for n in x.shape))
        z[...] = x
        return z
    if kind == "dask":
        import dask.array as da

        return da.from_array(x, chunks=tuple(min(n, 512) for n in x.shape))
    raise KeyError(kind)


def _check_equal(out, lse, q, k, v, options):
    """The contract's rel_error against attnlib.attention < 1e-13, LSE within 1e-13."""
    # One pass gives P @ V and P @ |V| (the sizes rel_error divides by): v and |v| side by side.
    both, ref_lse = attnlib.attention(q, k, np.concatenate([v, np.abs(v)], axis=-1), return_lse=True, **options)
    ref, ref_abs = np.split(both, 2, axis=-1)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert rel_error(out, ref, ref_abs) < 1e-13
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    seen = np.isfinite(ref_lse)
    assert np.all(np.abs(lse[seen] - ref_lse[seen]) <= 1e-13 * np.maximum(1.0, np.abs(ref_lse[seen])))
    assert np.all(out[~seen] == 0)


@pytest.mark.parametrize("kind", ["npy", "memmap", "zarr"])
@pytest.mark.parametrize("name", CASES)
def test_equals_attention_from_files(client, tmp_path, name, kind):
    q, k, v, options = _case(name)
    qq, kk, vv = (_as(kind, x, tmp_path, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    out, lse = ad.attention(qq, kk, vv, client=client, block_q=256, kv_block=384, return_lse=True,
                            **options)
    _check_equal(out, lse, q, k, v, options)


@pytest.mark.parametrize("kind", ["memory", "dask"])
def test_equals_attention_in_memory_and_dask(client, tmp_path, kind):
    q, k, v, options = _case("gqa")
    out, lse = ad.attention(*(_as(kind, x, tmp_path, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))),
                            client=client, block_q=200, kv_block=300, return_lse=True, **options)
    _check_equal(out, lse, q, k, v, options)


def test_long_context(client, tmp_path):
    """GQA (2 query heads on 1 key head): causal at n = 16384 from .npy memmaps, causal with a
    sliding window at n = 32768 from zarr (the scale-out report's quick run checks one causal
    head at n = 32768 on a cluster, on sampled blocks)."""
    q, _, _ = attnlib.random_qkv(32768, 0, 8, batch=(1,), heads=2, seed=9)
    _, k, v = attnlib.random_qkv(0, 32768, 8, batch=(1,), heads=1, seed=10)
    for kind, length, options in (("memmap", 16384, dict(causal=True)),
                                  ("zarr", 32768, dict(causal=True, window=(2048, None)))):
        qs, ks, vs = (x[..., :length, :] for x in (q, k, v))
        qq, kk, vv = (_as(kind, x, tmp_path, n) for x, n in ((qs, "q"), (ks, "k"), (vs, "v")))
        out, lse = ad.attention(qq, kk, vv, client=client, block_q=8192, kv_block=8192,
                                return_lse=True, **options)
        _check_equal(out, lse, qs, ks, vs, options)


def _visible_pairs(q_shape, k_shape, block_q, kv_block, options):
    """Independently of the plan: per entry and kv head, the (q block, key range) pairs
    with a visible pair, from the contract's dense visibility."""
    batch, hk, sq, sk = q_shape[:-3], k_shape[-3], q_shape[-2], k_shape[-2]
    specs = mask_specs(batch, sq, sk, **{k: v for k, v in options.items()
                                         if k not in ("softcap", "alibi_slopes", "sinks", "scale")})
    total = 0
    for entry in np.ndindex(*batch):
        vis = (specs[()] if () in specs else specs[entry]).visible(np.arange(sq), np.arange(sk))
        for q0 in range(0, sq, block_q):
            for k0 in range(0, sk, kv_block):
                total += hk * bool(vis[q0:q0 + block_q, k0:k0 + kv_block].any())
    return total


@pytest.mark.parametrize("name", CASES)
def test_task_count_is_the_visible_pair_count(client, name):
    q, k, v, options = _case(name)
    want = _visible_pairs(q.shape if q.ndim > 2 else (1,) + q.shape,
                          k.shape if k.ndim > 2 else (1,) + k.shape, 256, 384, options)
    with distributed.get_task_stream(client=client) as stream:
        ad.attention(q, k, v, client=client, block_q=256, kv_block=384, **options)
    ran = [t["key"] for t in stream.data if str(t["key"]).startswith("attnlib-piece")]
    assert len(ran) == len(set(ran)) == want


def test_bitwise_identical_across_runs_and_worker_counts(client):
    q, k, v, options = _case("segments")
    runs = [ad.attention(q, k, v, client=client, block_q=256, kv_block=128, **options) for _ in range(2)]
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as one, distributed.Client(one) as c1:
        runs.append(ad.attention(q, k, v, client=c1, block_q=256, kv_block=128, **options))
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])


def test_a_killed_worker_changes_nothing(client, tmp_path):
    """One worker process is killed mid-run; Dask reruns its tasks; the result is identical."""
    q, k, v = attnlib.random_qkv(6144, 6144, 32, batch=(1,), heads=2, seed=11)
    paths = [_as("npy", x, tmp_path, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    options = dict(causal=True, block_q=512, kv_block=512)
    want = ad.attention(*paths, client=client, **options)
    result, errors = {}, []

    def run():
        try:
            result["out"] = ad.attention(*paths, client=client, **options)
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    # Wait until some pieces are done, then kill a worker that holds or runs work.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = client.run_on_scheduler(lambda dask_scheduler: sum(
            1 for ts in dask_scheduler.tasks.values()
            if str(ts.key).startswith("attnlib-piece") and ts.state == "memory"))
        if done >= 4:
            break
        time.sleep(0.05)
    assert thread.is_alive(), "the run ended before a worker could be killed: make it longer"
    victim = sorted(client.run(os.getpid).items())[0][1]
    os.kill(victim, signal.SIGKILL)
    thread.join(300)
    assert not errors, errors
    np.testing.assert_array_equal(result["out"], want)
    client.wait_for_workers(2, timeout=60)  # the nanny restarts it for later tests


def test_a_failing_piece_names_its_block(client, tmp_path):
    q, k, v = attnlib.random_qkv(1024, 1024, 16, batch=(1,), heads=1, seed=12)
    q[0, 0, 600, 3] = np.nan
    with pytest.raises(ad.BlockError, match=r"query rows \[512, 768\).*non-finite|query rows \[512, 768\).*NaN"):
        ad.attention(_as("npy", q, tmp_path, "q"), k, v, client=client, block_q=256, kv_block=256)


def test_output_files_block_by_block(client, tmp_path):
    q, k, v, options = _case("padded")
    want, want_lse = ad.attention(q, k, v, client=client, block_q=256, kv_block=384, return_lse=True,
                                  **options)
    for out, lse_out in (("o.npy", "l.npy"), ("o.zarr", "l.zarr")):
        o, lse = ad.attention(q, k, v, client=client, block_q=256, kv_block=384, return_lse=True,
                              out=tmp_path / out, lse_out=tmp_path / lse_out, **options)
        np.testing.assert_array_equal(np.asarray(o[...]), want)
        np.testing.assert_array_equal(np.asarray(lse[...]), want_lse)


def test_bad_arguments(client, tmp_path):
    q, k, v = attnlib.random_qkv(64, 64, 8, seed=13)
    with pytest.raises(TypeError, match="q must be"):
        ad.attention(object(), k, v, client=client)
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"not a numpy file at all")
    with pytest.raises(ValueError, match="k: .*not an .npy file"):
        ad.attention(q, str(bad), v, client=client)
    ints = tmp_path / "ints.npy"
    np.save(ints, np.zeros((64, 8), dtype=np.int64))
    with pytest.raises(TypeError, match="v: .*int64"):
        ad.attention(q, k, str(ints), client=client)
    short = tmp_path / "short.npy"
    np.save(short, k)
    with open(short, "r+b") as f:
        f.truncate(os.path.getsize(short) - 8)
    with pytest.raises(ValueError, match="header declares shape .* but the file holds"):
        ad.attention(q, str(short), v, client=client)
    with pytest.raises(ValueError, match="kv_block"):
        ad.attention(q, k, v, client=client, kv_block=0)
    with pytest.raises(ValueError, match="lse_out"):
        ad.attention(q, k, v, client=client, out=tmp_path / "o.npy", return_lse=True)
    with pytest.raises(ValueError, match="same head dim"):
        ad.attention(q, k[:, :4], v, client=client)


def test_no_client_starts_a_local_cluster_for_the_call():
    """client=None with no current client: an embedded LocalCluster, closed afterwards."""
    import subprocess
    import sys

    code = (
        "import numpy as np, attnlib, attnlib.distributed as ad, distributed\n"
        "q, k, v = attnlib.random_qkv(600, 600, 8, seed=14)\n"
        "out = ad.attention(q, k, v, causal=True, block_q=200, kv_block=200)\n"
        "assert np.abs(out - attnlib.attention(q, k, v, causal=True)).max() < 1e-14\n"
        "try:\n"
        "    distributed.get_client()\n"
        "    raise SystemExit('a client was left behind')\n"
        "except ValueError:\n"
        "    print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_the_current_client_is_used(client):
    q, k, v = attnlib.random_qkv(300, 300, 8, seed=15)
    with distributed.get_task_stream(client=client) as stream:
        out = ad.attention(q, k, v, block_q=100, kv_block=100)  # client=None: the current one
    assert any(str(t["key"]).startswith("attnlib-piece") for t in stream.data)
    np.testing.assert_allclose(out, attnlib.attention(q, k, v), rtol=0, atol=1e-14)


def test_bshd_layout_reads_and_writes_in_place(client, tmp_path):
    """FlashAttention's (B, S, H, D) files: read slice by slice, output written the same way."""
    q, k, v, options = _case("gqa")
    want, want_lse = ad.attention(q, k, v, client=client, block_q=200, kv_block=300, return_lse=True,
                                  **options)
    stored = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v)]  # (B, S, H, D)
    for kind in ("npy", "zarr", "memory"):
        qq, kk, vv = (_as(kind, x, tmp_path, f"{n}_{kind}") for x, n in zip(stored, "qkv"))
        got, lse = ad.attention(qq, kk, vv, client=client, block_q=200, kv_block=300, return_lse=True,
                                layout="bshd", **options)
        np.testing.assert_array_equal(got, np.swapaxes(want, 1, 2))
        np.testing.assert_array_equal(lse, want_lse)
    o = ad.attention(*(_as("npy", x, tmp_path, f"{n}_f") for x, n in zip(stored, "qkv")), client=client,
                     block_q=200, kv_block=300, layout="bshd", out=tmp_path / "o_bshd.npy", **options)
    np.testing.assert_array_equal(np.asarray(o), np.swapaxes(want, 1, 2))


def test_reference_command_writes_the_golden_files(client, tmp_path):
    """python -m attnlib reference, on the suite's cluster (--scheduler), bshd files."""
    from attnlib.__main__ import main

    q, k, v = attnlib.random_qkv(700, 900, 16, batch=(2,), heads=2, seed=16)
    files = {}
    for name, x in zip("qkv", (q, k, v)):
        files[name] = str(tmp_path / f"{name}.npy")
        np.save(files[name], np.ascontiguousarray(np.swapaxes(x, 1, 2)))
    address = client.scheduler.address
    code = main(["reference", "--q", files["q"], "--k", files["k"], "--v", files["v"], "--causal",
                 "--window", "300", "-1", "--kv-lengths", "900", "500", "--block-q", "256",
                 "--kv-block", "256", "--out-file", str(tmp_path / "ref.npy"),
                 "--lse-file", str(tmp_path / "ref_lse.npy"), "--scheduler", address])
    assert code == 0
    want, want_lse = attnlib.attention(q, k, v, causal=True, window=(300, None), kv_lengths=[900, 500],
                                       return_lse=True)
    ref = np.load(tmp_path / "ref.npy")
    assert ref.shape == (2, 700, 2, 16)
    assert rel_error(np.swapaxes(ref, 1, 2), want,
                     attnlib.attention(q, k, np.abs(v), causal=True, window=(300, None),
                                       kv_lengths=[900, 500])) < 1e-13
    lse = np.load(tmp_path / "ref_lse.npy")
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13, atol=0)
    # Unusable input: exit code 2 and a message naming it.
    assert main(["reference", "--q", files["q"], "--k", str(tmp_path / "nothing.npy"), "--v", files["v"],
                 "--out-file", str(tmp_path / "x.npy"), "--scheduler", address]) == 2


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16, 17, 21, 64, 70])
def test_merges_as_submitted_are_the_planned_groups(n):
    """_MergeChain (fed piece by piece) merges exactly the groups of plan.merge_groups."""
    from attnlib.distributed.engine import _MergeChain

    def merge(group):
        return ("m", tuple(group))

    chain = _MergeChain(merge)
    for i in range(n):
        chain.add(i)
    want = None
    for group in ad.merge_groups(n):
        want = ("m", tuple(group) if want is None else (want,) + tuple(group))
    assert chain.root() == (0 if n == 1 else want)  # the same nested groups, in key order
    groups = ad.merge_groups(n)
    assert [i for g in groups for i in g] == list(range(n if n > 1 else 0))
    assert all(len(g) <= ad.MERGE_FANIN - (k > 0) for k, g in enumerate(groups))


def test_check_computes_its_reference_on_the_cluster(client, tmp_path):
    """check_kernel(scheduler=...) and `attnlib check --scheduler`: the same verdicts."""
    from attnlib.__main__ import main
    from attnlib.check import check_kernel

    q, k, v = attnlib.random_qkv(600, 800, 16, batch=(2,), heads=2, seed=17)
    options = dict(causal=True, window=(200, None), kv_lengths=[800, 500])
    good = attnlib.attention(q, k, v, **options)
    bad = good.copy()
    bad[1, 0, 450] += 1e-9  # a float64 kernel's error far above its rounding
    bhsd = dict(layout="bhsd", **options)
    for out, passed in ((good, True), (bad, False)):
        here = check_kernel(q, k, v, out, **bhsd)
        there = check_kernel(q, k, v, out, scheduler=client, **bhsd)
        assert here.passed is there.passed is passed
        np.testing.assert_allclose(there.out.max_err, here.out.max_err, rtol=1e-6, atol=1e-15)
    files = {}
    for name, x in (("q", q), ("k", k), ("v", v), ("out", good)):
        files[name] = str(tmp_path / f"{name}.npy")
        np.save(files[name], x)
    args = ["check", "--layout", "bhsd", "--causal", "--window", "200", "-1", "--kv-lengths", "800", "500"]
    args += [a for n in ("q", "k", "v", "out") for a in (f"--{n}", files[n])]
    assert main(args + ["--scheduler", client.scheduler.address]) == 0
    assert main(args + ["--scheduler", client.scheduler.address, "--html", str(tmp_path / "r.html")]) == 2


def test_relative_paths_and_writable_memmaps(client, tmp_path, monkeypatch):
    """Paths are made absolute for the workers; a memmap with edits of its own is sent as data."""
    q, k, v = attnlib.random_qkv(300, 300, 8, seed=18)
    for name, x in zip("qkv", (q, k, v)):
        np.save(tmp_path / f"{name}.npy", x)
    monkeypatch.chdir(tmp_path)
    out = ad.attention("q.npy", "k.npy", "v.npy", client=client, block_q=100, kv_block=100, out="o.npy")
    np.testing.assert_allclose(np.asarray(out), attnlib.attention(q, k, v), rtol=0, atol=1e-14)
    assert os.path.isabs(out.filename)
    edited = np.load("k.npy", mmap_mode="c")
    edited[...] *= 2.0  # copy-on-write: the file keeps the old values
    got = ad.attention(q, edited, v, client=client, block_q=100, kv_block=100)
    np.testing.assert_allclose(got, attnlib.attention(q, 2 * k, v), rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="different paths"):
        ad.attention(q, k, v, client=client, out="x.npy", lse_out="x.npy", return_lse=True)


def test_check_distributed_starts_a_local_cluster(tmp_path):
    """`attnlib check --distributed`: the reference on a LocalCluster made for the run."""
    import subprocess
    import sys

    q, k, v = attnlib.random_qkv(300, 300, 8, batch=(1,), heads=1, seed=19)
    files = []
    for name, x in (("q", q), ("k", k), ("v", v), ("out", attnlib.attention(q, k, v, causal=True))):
        np.save(tmp_path / f"{name}.npy", x)
        files += [f"--{name}", str(tmp_path / f"{name}.npy")]
    proc = subprocess.run([sys.executable, "-m", "attnlib", "check", "--layout", "bhsd", "--causal",
                           "--distributed", *files], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_worker_memory_gate_has_power(tmp_path):
    """The scale-out report's flatness verdict (growth between two n below one head's keys
    for the added positions) fails pieces that read whole key ranges (kv_block = n: memory of
    the sequence's size on a worker).  The planned pieces passing it at the same sizes (d 64,
    block 256, n 1024 -> 4096, 2 workers) is the quick scale-out report's gated verdict
    (test_notebooks_measured.py), not measured twice."""
    from attnlib.bench import scaleout

    d, block, sweep = 64, 256, (1024, 4096)
    from attnlib.report.runner import plan

    (_, _, quick), = plan(["scaleout"], quick=True)  # the quick run's values, defaults included
    assert (quick["d"], quick["block"], quick["sweep"], max(quick["workers"])) == (d, block, list(sweep), 2)
    working = []
    with scaleout.local_cluster(2) as client:
        for n in sweep:
            paths = scaleout.save_case(str(tmp_path), 1, 1, n, d, seed=1)
            out = str(tmp_path / f"out_{n}.npy")
            attnlib.distributed.attention(*paths, client=client, causal=True, block_q=block,
                                          kv_block=n, out=out)  # warm-up
            peaks = scaleout.worker_peaks(client, paths, block, out, kv_block=n)
            working.append(max(w for _, _, w in peaks))
    growth, bound = working[1] - working[0], scaleout.growth_bound(*sweep, d)
    assert bound <= growth, (growth, bound)


@pytest.mark.parametrize("per_head", [False, True])
def test_top_k_lists_piece_by_piece_and_no_task_for_pieces_without_a_listed_key(client, tmp_path, per_head):
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((2, 4, 300, 16)), rng.standard_normal((2, 2, 700, 16)), rng.standard_normal((2, 2, 700, 8))
    shape = (2, 2, 300, 12) if per_head else (2, 300, 12)
    lists = rng.integers(-1, 300, size=shape)  # keys >= 300 never listed: their pieces are no tasks
    options = dict(causal=True, kv_lengths=np.array([700, 280]), sinks=np.arange(4.0), gather_kv_indices=lists)
    with distributed.get_task_stream(client=client) as stream:
        out, lse = ad.attention(q, k, v, client=client, block_q=128, kv_block=256, return_lse=True, **options)
    starts = {int(str(t["key"]).rsplit("-", 1)[1]) for t in stream.data if str(t["key"]).startswith("attnlib-piece")}
    assert starts == {0, 256}  # the key range [512, 700) is visible, but lists none of its keys
    _check_equal(out, lse, q, k, v, options)
    # The CLI, in FlashAttention's layout: per-head lists as (batch, Sq, Hk, topk).
    from attnlib.distributed.cli import main
    bshd = {n: np.ascontiguousarray(np.swapaxes(x, 1, 2)) for n, x in (("q", q), ("k", k), ("v", v))}
    for n, x in {**bshd, "lists": np.swapaxes(lists, 1, 2) if per_head else lists}.items():
        np.save(tmp_path / f"{n}.npy", x)
    no_lengths = {n: x for n, x in options.items() if n not in ("kv_lengths", "sinks")}
    args = [f"--{n}={tmp_path / n}.npy" for n in ("q", "k", "v")] + [
        f"--out-file={tmp_path / 'out.npy'}", "--causal", f"--gather-kv-indices={tmp_path / 'lists.npy'}",
        f"--scheduler={client.scheduler.address}"]
    assert main(args) == 0
    ref = attnlib.reference_attention(q, k, v, **no_lengths)
    np.testing.assert_allclose(np.swapaxes(np.load(tmp_path / "out.npy"), 1, 2), ref, rtol=0, atol=1e-13)


def test_mla_qv_and_fp8_descales_piece_by_piece(client):
    """MLA's qv joined and the descales applied in each piece (bshd files read in place)."""
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((2, 4, 300, 16)), rng.standard_normal((2, 2, 500, 16)), rng.standard_normal((2, 2, 500, 24))
    qv = rng.standard_normal((2, 4, 300, 24))
    f = {f"{n}_descale": rng.uniform(0.1, 2.0, (2, 2)) for n in "qkv"}
    ref, ref_lse = attnlib.reference_attention(q, k, v, qv=qv, causal=True, return_lse=True, **f)
    out, lse = ad.attention(q, k, v, qv=qv, causal=True, client=client, block_q=128, kv_block=256,
                            return_lse=True, **f)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-13)
    bshd = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v, qv)]
    out = ad.attention(*bshd[:3], qv=bshd[3], layout="bshd", client=client, block_q=128, kv_block=256)
    np.testing.assert_allclose(np.swapaxes(out, 1, 2), attnlib.reference_attention(q, k, v, qv=qv), rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="qv"):
        ad.attention(q, k, v, qv=qv[..., :5], client=client)


def _kernel_labels(client):
    """The ``kernel on <device>`` labels the pieces booked in Dask's metrics, on any worker."""
    totals = client.run(lambda dask_worker: list(dask_worker.digests_total))
    return {key[-2] for keys in totals.values() for key in keys
            if isinstance(key, tuple) and key[0] == "execute" and str(key[-2]).startswith("kernel on")}


def test_pieces_on_a_torch_device_by_call_or_by_worker_setting(tmp_path):
    """``device=`` runs each piece with the device kernel (torch, float64) on its worker; a
    worker started with ``attnlib.device`` in its Dask configuration does so unasked; the
    result equals the numpy pieces' to rounding.  On this machine the device is torch's CPU:
    the same code runs a CUDA worker's pieces on its GPU."""
    pytest.importorskip("torch")
    import dask

    from attnlib.bench import scaleout

    paths = scaleout.save_case(str(tmp_path), 1, 4, 700, 32, seed=5)
    q, k, v = (np.load(p) for p in paths)
    ref = attnlib.attention(q, k, v, causal=True, sinks=np.linspace(-1, 1, 4))
    ref_abs = attnlib.attention(q, k, np.abs(v), causal=True, sinks=np.linspace(-1, 1, 4))
    options = dict(causal=True, sinks=np.linspace(-1, 1, 4), block_q=256, kv_block=256)
    # One worker each: every piece runs there (a worker process importing torch costs seconds).
    with scaleout.local_cluster(1) as client:
        numpy_out = attnlib.distributed.attention(*paths, client=client, **options)
        assert _kernel_labels(client) == set()
        auto = attnlib.distributed.attention(*paths, client=client, device="auto", **options)
        assert _kernel_labels(client) == set()  # no CUDA here: "auto" is the numpy kernel
        torch_out = attnlib.distributed.attention(*paths, client=client, device="cpu", **options)
        assert _kernel_labels(client) == {"kernel on cpu"}
        with pytest.raises(attnlib.distributed.BlockError, match="the piece .* failed.*CUDA"):
            attnlib.distributed.attention(*paths, client=client, device="cuda", **options)
    assert np.array_equal(auto, numpy_out)
    assert rel_error(torch_out, ref, ref_abs) < 1e-13 and rel_error(numpy_out, ref, ref_abs) < 1e-13
    with dask.config.set({"attnlib.device": "cpu"}), scaleout.local_cluster(1) as client:
        by_worker = attnlib.distributed.attention(*paths, client=client, **options)
        assert _kernel_labels(client) == {"kernel on cpu"}
        forced = attnlib.distributed.attention(*paths, client=client, device="numpy", **options)
    assert np.array_equal(by_worker, torch_out) and np.array_equal(forced, numpy_out)
    with pytest.raises(TypeError, match="device"):
        attnlib.distributed.attention(*paths, client="tcp://127.0.0.1:1", device=3, **options)


_PIECE_CASES = {
    "plain": {},
    "causal top-left, GQA": dict(causal=True, causal_align="top_left", gqa=True),
    "window, sink tokens": dict(causal=True, window=(40, 0), sink_token_length=3, k0=0),
    "documents": dict(segments=True),
    "softcap, ALiBi, sinks": dict(causal=True, softcap=20.0, alibi=True, sinks=True),
    "padding, left pad, chunk": dict(q_lengths=[90], kv_lengths=[150], key_leftpad=[7], attention_chunk=64),
    "top-k lists": dict(lists=True),
    "per-head top-k lists, GQA": dict(lists="per head", gqa=True),
    "fully masked rows": dict(causal=True, causal_align="bottom_right", small_k=True),
}


@pytest.mark.parametrize("case", list(_PIECE_CASES))
def test_a_torch_cpu_piece_equals_the_numpy_piece(case, monkeypatch):
    """`engine._piece` with the device kernel (torch CPU here) gives the numpy piece's
    ``(out, (m, log l))`` to rounding, option by option, on a piece cut from inside a larger
    problem (its own offset, lengths and document ids); no cluster needed."""
    pytest.importorskip("torch")
    from attnlib.core import masks, tilesizes
    from attnlib.distributed.engine import _piece

    o = _PIECE_CASES[case]
    rng = np.random.default_rng(3)
    hq, hk, sq, sk, d = 4, 2 if o.get("gqa") else 4, 96, 40 if o.get("small_k") else 160, 16
    q, k, v = (rng.standard_normal((1, h, s, d)) * 2 for h, s in ((hq, sq), (hk, sk), (hk, sk)))
    seg = None
    if o.get("segments"):
        seg = dict(q_segment_ids=np.repeat([[0, 1, 2]], [32, 32, 32], axis=1)[:, :sq],
                   kv_segment_ids=np.repeat([[0, 1, 2, 3]], [40, 50, 40, 30], axis=1)[:, :sk])
    keys = dict(causal=o.get("causal", False), causal_align=o.get("causal_align", "bottom_right"),
                window=o.get("window"), q_lengths=o.get("q_lengths"), kv_lengths=o.get("kv_lengths"),
                key_leftpad=o.get("key_leftpad"), attention_chunk=o.get("attention_chunk"),
                sink_token_length=o.get("sink_token_length", 0), **(seg or {}))
    k0 = o.get("k0", 64)  # a piece from inside; the sink tokens' from the first key
    spec = masks.mask_specs((1,), sq + 32, sk + k0, **{n: _padded_ids(x, k0) for n, x in keys.items()})
    spec = next(iter(spec.values())).piece(32, 32 + sq, k0, k0 + sk)
    slopes = np.linspace(0.05, 0.4, hq) if o.get("alibi") else None
    sink = np.linspace(-1.0, 2.0, hq) if o.get("sinks") else None
    lists = None
    if o.get("lists"):
        lists = np.sort(rng.choice(sk, (hk, sq, 12) if o["lists"] == "per head" else (sq, 12)), -1)
        lists[..., ::5, 6:] = -1  # short lists
    args = (q[0], k[0], v[0], spec, 0.3, o.get("softcap"), slopes, "p", sink, lists)
    want = _piece(*args)
    chosen = []  # the tiles the device piece takes
    device_tiles = tilesizes.device_tiles
    monkeypatch.setattr(tilesizes, "device_tiles", lambda *a, **kw: chosen.append(device_tiles(*a, **kw))
                        or chosen[-1])
    got = _piece(*args, device="cpu")
    scale = np.abs(want[0]).max()
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-13 * scale)
    finite = np.isfinite(want[1])
    assert np.array_equal(finite, np.isfinite(got[1])) and np.array_equal(want[1][~finite], got[1][~finite])
    np.testing.assert_allclose(got[1][finite], want[1][finite], rtol=1e-13, atol=1e-13)
    if o.get("small_k"):
        assert not np.isfinite(want[1][..., 0]).all()  # some rows see no key: m = -inf there
    # Documents and narrow windows take the CPU's smaller tiles.
    assert chosen == [tilesizes.CPU_MASK_TILES if seg or o.get("window") else tilesizes.CPU_TILES]
    if o.get("sink_token_length"):  # the sink tokens are in this piece: they change it
        plain = masks.mask_specs((1,), sq + 32, sk, **dict(keys, sink_token_length=0))[()].piece(32, 32 + sq, 0, sk)
        assert not np.allclose(_piece(q[0], k[0], v[0], plain, *args[4:])[0], want[0])


def _padded_ids(x, k0):
    """A per-piece mask argument widened to the whole problem: document ids padded with their
    edge values before the piece's rows (32) and keys (``k0``); the rest as given."""
    if isinstance(x, np.ndarray):  # document ids (1, s)
        pad = 32 if x.shape[1] == 96 else k0
        return np.pad(x, ((0, 0), (pad, 0)), mode="edge")
    return x


def test_a_device_name_no_torch_device_has_is_refused_before_any_task():
    """A typo in ``device=`` is refused on the client, naming the argument, before a task
    runs (the client address here reaches no cluster)."""
    pytest.importorskip("torch")
    q = np.zeros((1, 1, 8, 4))
    for bad in ("cdua", "meta", "cuda:x"):
        with pytest.raises(ValueError, match="device"):
            attnlib.distributed.attention(q, q, q, client="tcp://127.0.0.1:1", device=bad)
