"""A cluster as a user starts one: ``dask scheduler`` and ``dask worker`` as separate
processes on loopback (no nanny: a killed worker stays dead), inputs in files every process
reads.  The oracle, ``python -m attnlib reference --scheduler`` and ``attnlib check
--scheduler`` run against it; a worker killed mid-call and another added give the same bits."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import attnlib
from attnlib import distributed as ad

distributed = pytest.importorskip("distributed")
DASK = [sys.executable, "-m", "dask"]
START_TIMEOUT = 90  # seconds for a process of the cluster to come up (a 2-core CI machine)


def _worker(scheduler_file, name, log):
    return subprocess.Popen(DASK + ["worker", "--scheduler-file", str(scheduler_file), "--nthreads", "1",
                                    "--nworkers", "1", "--no-nanny", "--no-dashboard", "--name", name,
                                    "--host", "127.0.0.1"],
                            stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``(client, scheduler address, scheduler file, worker processes, log)``."""
    d = tmp_path_factory.mktemp("cli_cluster")
    sched_file = d / "scheduler.json"
    log = open(d / "cluster.log", "wb")
    scheduler = subprocess.Popen(DASK + ["scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                         "--scheduler-file", str(sched_file)], stdout=log, stderr=subprocess.STDOUT)
    workers = []  # the tests replace the workers they kill: these are stopped at the end
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not sched_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sched_file.exists(), (d / "cluster.log").read_text()
        workers += [_worker(sched_file, f"w{i}", log) for i in range(2)]
        with distributed.Client(scheduler_file=str(sched_file), timeout=START_TIMEOUT) as client:
            client.wait_for_workers(2, timeout=START_TIMEOUT)
            yield client, client.scheduler.address, sched_file, workers, log
    finally:  # the workers first (each closes with the scheduler still there), then the scheduler
        for group in (workers, [scheduler]):
            for p in group:
                if p.poll() is None:
                    p.terminate()
            for p in group:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        log.close()


def _files(tmp_path, **arrays):
    paths = {}
    for name, x in arrays.items():
        paths[name] = str(tmp_path / f"{name}.npy")
        np.save(paths[name], x)
    return paths


def test_oracle_and_both_commands_against_a_cli_cluster(cluster, tmp_path):
    client, address, _, _, _ = cluster
    q, k, v = attnlib.random_qkv(700, 900, 16, batch=(1,), heads=4, kv_heads=2, seed=3)
    paths = _files(tmp_path, q=q, k=k, v=v)
    options = dict(causal=True, kv_lengths=np.array([850]))
    out, lse = ad.attention(paths["q"], paths["k"], paths["v"], client=address, block_q=256, kv_block=256,
                            return_lse=True, **options)
    ref, ref_lse = attnlib.reference_attention(q, k, v, return_lse=True, **options)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-13)
    env = dict(os.environ)
    # python -m attnlib reference, bhsd files: the same bits as the call above.
    cmd = [sys.executable, "-m", "attnlib", "reference", *(f"--{n}={paths[n]}" for n in "qkv"),
           f"--out-file={tmp_path / 'out.npy'}", "--layout=bhsd", "--causal", "--kv-lengths", "850",
           "--block-q=256", "--kv-block=256", f"--scheduler={address}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), out)
    # --piece-device: the pieces with torch's kernel on the workers (its CPU here), to rounding.
    done = subprocess.run(cmd[:-1] + [f"--out-file={tmp_path / 'out_torch.npy'}", "--piece-device=cpu", cmd[-1]],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out_torch.npy"), ref, rtol=0, atol=1e-13)
    # attnlib check --scheduler: a correct float32 kernel passes, one off by 1e-3 fails.
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    good = attnlib.attention(q32, k32, v32, compute_dtype="float32", **options)
    kernel = _files(tmp_path, q32=q32, k32=k32, v32=v32, good=good, bad=good * np.float32(1.001))
    for name, code in (("good", 0), ("bad", 1)):
        cmd = [sys.executable, "-m", "attnlib", "check", f"--q={kernel['q32']}", f"--k={kernel['k32']}",
               f"--v={kernel['v32']}", f"--out={kernel[name]}", "--layout=bhsd", "--causal",
               "--kv-lengths", "850", f"--scheduler={address}"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == code, done.stdout + done.stderr


def test_a_worker_killed_and_another_added_mid_call_give_the_same_bits(cluster, tmp_path):
    client, address, sched_file, workers, log = cluster
    q, k, v = attnlib.random_qkv(6144, 6144, 32, batch=(1,), heads=2, seed=11)
    paths = _files(tmp_path, q=q, k=k, v=v)
    options = dict(causal=True, block_q=512, kv_block=512)
    want = ad.attention(paths["q"], paths["k"], paths["v"], client=client, **options)
    result, errors = {}, []

    def run():
        try:
            result["out"] = ad.attention(paths["q"], paths["k"], paths["v"], client=client, **options)
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # some pieces done: the victim holds or runs work
        done = client.run_on_scheduler(lambda dask_scheduler: sum(
            1 for ts in dask_scheduler.tasks.values()
            if str(ts.key).startswith("attnlib-piece") and ts.state == "memory"))
        if done >= 4:
            break
        time.sleep(0.05)
    assert thread.is_alive(), "the run ended before a worker could be killed: make it longer"
    workers[0].send_signal(signal.SIGKILL)  # no nanny: it stays dead
    workers[0].wait(timeout=30)
    workers[0] = _worker(sched_file, "w-added", log)  # a new worker joins during the call
    thread.join(600)
    assert not errors, errors
    np.testing.assert_array_equal(result["out"], want)
    np.testing.assert_allclose(result["out"], attnlib.attention(q, k, v, causal=True), rtol=0, atol=1e-13)
    names = {w["name"] for w in client.scheduler_info()["workers"].values()}
    assert "w0" not in names and "w-added" in names
