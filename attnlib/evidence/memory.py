"""Memory measurement: numpy-allocated bytes of one attention call, in a fresh process.

numpy reports its allocations to `tracemalloc`, so the traced peak of a call is exact
(bytes, not pages).  Each measurement runs in a new Python process after a warm-up call
at a small size, so that BLAS buffers, imports and earlier runs do not pollute it.  The
inputs are created before tracing starts; the peak therefore counts the call's working
memory plus its output, and ``working_bytes`` subtracts the output.

The RSS tool reports what the operating system sees: the total RSS growth from
``memory_profiler`` and, on Linux, its split (from ``/proc/self/status``) into anonymous
memory (what the process itself allocates) and file-backed pages (the pages of memmapped
files that the kernel maps in as they are read: page cache, reclaimable and shared with the
OS).  Where ``/proc`` has no such split, the split is reported as not measured (``None``).

Every measurement process runs numpy in strict mode: division by zero, overflow and
invalid operations raise (``np.seterr``) in the warm-up and the measured call.

The kernels run with ``workers=1`` here: each worker thread holds its own tile buffers
(the default, every CPU, multiplies the working memory by the thread count, still
independent of the sequence length), and whether two threads' buffers are alive at the
same moment depends on timing, which would make a peak a matter of chance.
"""

from __future__ import annotations

import os

from .fresh import FreshProcessError, run_fresh

PATHS = ("tiled", "dense")
#: ``peak_memory`` also measures "stream" (`attention_stream` over a memmapped KV cache),
#: "paged" (`attention` over a paged KV cache in memory) and the backward passes
#: "tiled_backward" and "dense_backward".
ALL_PATHS = PATHS + ("stream", "paged", "tiled_backward", "dense_backward")

#: The fixed cap on the tiled forward's working memory (over inputs and output).
CAP_BYTES = 32 * 2**20


def _in_subprocess(case: dict, timeout: float) -> dict:
    if case["path"] not in ALL_PATHS:
        raise ValueError(f"path must be one of {ALL_PATHS}, got {case['path']!r}")
    try:
        return run_fresh(_measure, case, timeout=timeout)
    except FreshProcessError as e:
        raise RuntimeError(f"memory measurement {case} failed ({e.how}):\n{e.stderr}") from None


def peak_memory(path: str, sq: int, sk: int | None = None, d: int = 64, *,
                causal: bool = True, block_q: int | None = None, block_k: int | None = None,
                chunk: int = 65536, seed: int = 0, cache_pages: int = 0, page_size: int = 16,
                timeout: float = 600.0) -> dict:
    """Traced peak of one ``path`` call on random inputs, in a fresh process.

    ``path`` is "tiled" (`attention`), "dense" (`reference_attention`), "stream":
    `attention_stream` over ``chunk``-key slices of a KV cache of ``sk`` keys memmapped
    from files on disk (written before tracing starts, then read during the call), or
    "paged": `attention` over a paged cache of ``cache_pages`` pages of ``page_size`` keys
    in memory (made before tracing), the sequence's ``sk`` keys on randomly chosen pages.

    Returns a dict with ``peak_bytes`` (traced peak during the call), ``output_bytes``
    (``out`` and ``lse``), ``working_bytes`` (peak minus output), ``input_bytes`` (arrays
    in memory) and, for "stream", ``cache_bytes`` (k and v on disk) and ``seconds``.
    """
    case = dict(tool="peak", path=path, sq=sq, sk=sq if sk is None else sk, d=d,
                causal=causal, block_q=block_q, block_k=block_k, chunk=chunk, seed=seed,
                cache_pages=cache_pages, page_size=page_size)
    return _in_subprocess(case, timeout)


def rss_growth(path: str, sq: int, sk: int | None = None, d: int = 64, *,
               causal: bool = True, block_q: int | None = None, block_k: int | None = None,
               chunk: int = 65536, interval: float = 0.002, seed: int = 0,
               timeout: float = 600.0) -> dict:
    """Process RSS growth during one ``path`` call, in a fresh process after a warm-up.

    The same case as `peak_memory` (same inputs, same warm-up), measured by the operating
    system instead of tracemalloc (which is not running, so its bookkeeping does not count).

    Returns a dict with ``rss_bytes`` (peak total RSS over the pre-call RSS, sampled by
    ``memory_profiler`` every ``interval`` seconds), ``anon_bytes`` and ``file_bytes``
    (peak growth of the anonymous and the file-backed RSS, sampled from
    ``/proc/self/status`` over the level just before the call, and once more after it;
    ``None`` where not measured), ``rss_split`` (where the split came from, or why it is
    not measured), ``output_bytes``, ``input_bytes``, ``seconds`` and, for "stream",
    ``cache_bytes``; and the samples: ``t``/``bytes`` (total) and ``split_t``/``anon``/
    ``file``.
    """
    case = dict(tool="rss", path=path, sq=sq, sk=sq if sk is None else sk, d=d, causal=causal,
                block_q=block_q, block_k=block_k, chunk=chunk, seed=seed, interval=interval)
    result = _in_subprocess(case, timeout)
    result["rss_bytes"] = result["peak_bytes"]
    return result


def memory_timeline(path: str, tool: str, n: int, d: int = 64, *, causal: bool = True,
                    interval: float = 0.005, seed: int = 0, timeout: float = 600.0) -> dict:
    """Memory over time during one ``path`` call on ``n x n`` random inputs.

    ``tool="tracemalloc"`` samples the numpy-allocated bytes of the call (traced since
    just before it, so the inputs are not counted) from a thread every ``interval``
    seconds, and adds the exact traced peak.  ``tool="rss"`` samples the process's
    resident set size with ``memory_profiler.memory_usage`` and reports it relative to
    the RSS just before the call (the inputs already resident), with its anonymous /
    file-backed split as in `rss_growth` (``anon_bytes``, ``file_bytes``, ...).

    Returns a dict with ``t`` (seconds since the call started), ``bytes`` (samples),
    ``peak_bytes`` and ``output_bytes``.
    """
    if tool not in ("tracemalloc", "rss"):
        raise ValueError(f"tool must be 'tracemalloc' or 'rss', got {tool!r}")
    case = dict(tool=tool, path=path, sq=n, sk=n, d=d, causal=causal, block_q=None,
                block_k=None, seed=seed, interval=interval)
    return _in_subprocess(case, timeout)


def _call(case, q, k, v, grad_inputs=None):
    from ..core.tiled import attention
    from ..core.backward import attention_backward, reference_attention_backward
    from ..core.stream import attention_stream
    from ..core.reference import reference_attention

    path, causal = case["path"], case["causal"]
    tiled = dict(causal=causal, block_q=case["block_q"], block_k=case["block_k"], workers=1)  # tiled kernels' options
    if path == "tiled_backward":  # grad_inputs: (out, lse, dout)
        return attention_backward(q, k, v, *grad_inputs, **tiled)
    if path == "dense_backward":
        return reference_attention_backward(q, k, v, grad_inputs[2], causal=causal)
    if path == "stream":
        sk, step = k.shape[-2], case.get("chunk", 65536)
        chunks = ((k[..., i:i + step, :], v[..., i:i + step, :]) for i in range(0, max(sk, 1), step))
        return attention_stream(q, chunks, total_keys=sk, return_lse=True, **tiled)
    if path == "paged":  # grad_inputs: (block_table, cache_seqlens)
        return attention(q, k, v, block_table=grad_inputs[0], cache_seqlens=grad_inputs[1], return_lse=True, **tiled)
    if path == "tiled":
        return attention(q, k, v, return_lse=True, **tiled)
    return reference_attention(q, k, v, causal=causal, return_lse=True)


def _traced(case, q, k, v, grad_inputs=None):
    """Exact traced peak, and samples of the traced size from a thread when asked."""
    import threading
    import time
    import tracemalloc

    samples, done = [], threading.Event()

    def sample(t0):
        while not done.is_set():
            samples.append((time.perf_counter() - t0, tracemalloc.get_traced_memory()[0]))
            done.wait(case["interval"])

    tracemalloc.start()
    t0 = time.perf_counter()
    sampler = None
    if case["tool"] == "tracemalloc":
        sampler = threading.Thread(target=sample, args=(t0,), daemon=True)
        sampler.start()
    result = _call(case, q, k, v, grad_inputs)
    elapsed = time.perf_counter() - t0
    done.set()
    if sampler is not None:
        sampler.join()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    samples.append((elapsed, current))
    return result, peak, samples, {}


#: Where the anonymous / file-backed split of the RSS is read (Linux >= 4.5).
PROC_STATUS = "/proc/self/status"


def rss_split() -> dict | None:
    """This process's resident memory by kind, in bytes, or None where /proc lacks it.

    ``anon``: ``RssAnon``, memory the process allocated (heap, mmap'd arrays, stacks);
    ``file``: ``RssFile`` plus ``RssShmem``, pages of mapped files (``RssShmem`` holds
    them when the file is on a tmpfs), i.e. page cache the kernel maps in as they are read.
    """
    try:
        with open(PROC_STATUS) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = {name: int(fields[name].split()[0]) * 1024
               for name in ("RssAnon", "RssFile", "RssShmem")}
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return {"anon": kib["RssAnon"], "file": kib["RssFile"] + kib["RssShmem"]}


def _rss(case, q, k, v, grad_inputs=None, max_samples=1 << 16):
    """RSS during the call: total from memory_profiler, anonymous and file-backed from /proc.

    All are bytes over the level just before the call.  The /proc split is sampled from a
    thread into buffers filled before its baseline is read, so that neither the thread's
    stack nor its samples count as growth (past ``max_samples`` only the peaks are kept).
    """
    import threading
    import time

    import numpy as np
    from memory_profiler import memory_usage

    buf = np.ones((3, max_samples))  # seconds, anon, file: resident before the baseline
    state = {"n": 0, "base": None, "peak": [0, 0]}
    done, started = threading.Event(), threading.Event()

    def record(t0):
        now, base = rss_split(), state["base"]
        anon, file = now["anon"] - base["anon"], now["file"] - base["file"]
        state["peak"] = [max(state["peak"][0], anon), max(state["peak"][1], file)]
        if state["n"] < max_samples:
            buf[:, state["n"]] = time.time() - t0, anon, file
            state["n"] += 1

    def sample(t0):
        state["base"] = rss_split()
        started.set()
        while state["base"] is not None and not done.is_set():
            record(t0)
            done.wait(case["interval"])

    def measured(t0):  # runs in this process while memory_profiler watches it
        sampler = threading.Thread(target=sample, args=(t0,), daemon=True)
        sampler.start()
        started.wait()
        try:
            return _call(case, q, k, v, grad_inputs)
        finally:
            done.set()
            sampler.join()
            if state["base"] is not None:
                record(t0)  # once more, with the result still alive

    base = memory_usage(-1, interval=0.01, timeout=0.01)[0]
    t0 = time.time()
    usage, result = memory_usage((measured, (t0,), {}),
                                 interval=case["interval"], timestamps=True, retval=True)
    samples = [(t - t0, (m - base) * 2**20) for m, t in usage]  # memory_profiler's MiB as bytes
    measured_split = state["base"] is not None
    n = state["n"]
    extra = {"rss_split": PROC_STATUS if measured_split else
             f"not measured: {PROC_STATUS} has no RssAnon/RssFile/RssShmem here",
             "anon_bytes": int(state["peak"][0]) if measured_split else None,
             "file_bytes": int(state["peak"][1]) if measured_split else None,
             "split_t": buf[0, :n].tolist(), "anon": buf[1, :n].astype(np.int64).tolist(),
             "file": buf[2, :n].astype(np.int64).tolist()}
    return result, max(b for _, b in samples), samples, extra


def _memmap_cache(folder, sk, d, seed, step=1 << 16):
    """A KV cache of ``sk`` standard normal keys and values, ``(sk, d)`` float64 memmaps."""
    import numpy as np

    rng = np.random.default_rng(seed)
    arrays = []
    for name in ("k", "v"):
        mm = np.lib.format.open_memmap(os.path.join(folder, f"{name}.npy"), mode="w+",
                                       dtype=np.float64, shape=(sk, d))
        for i in range(0, sk, step):  # written a slab at a time: never all in memory
            mm[i:i + step] = rng.standard_normal((min(step, sk - i), d))
        mm.flush()
        del mm
        arrays.append(np.load(os.path.join(folder, f"{name}.npy"), mmap_mode="r"))
    return arrays


def _measure(case: dict) -> dict:
    import tempfile
    import time

    import numpy as np

    from .inputs import random_qkv

    # Strict mode: a division by zero, overflow or invalid operation raises, in the
    # warm-up and in the measured call alike.
    from ..core.problem import STRICT

    np.seterr(**STRICT)

    def prepared(q, k, v, seed):
        """The call's ``(q, k, v, grad_inputs)``, made untraced.  For a backward: the forward's
        ``out`` and ``lse`` and an upstream gradient; for "paged": q as (1, 1, Sq, D), a cache of
        cache_pages pages holding k, v on random pages, the table and the length (every page of
        the cache that the sequence does not use is random too); else None."""
        if case["path"].endswith("_backward"):
            from ..core.tiled import attention

            out, lse = attention(q, k, v, causal=case["causal"], return_lse=True)
            return q, k, v, (out, lse, np.random.default_rng(seed).standard_normal(out.shape))
        if case["path"] != "paged":
            return q, k, v, None
        rng = np.random.default_rng(seed)
        size, sk = case["page_size"], k.shape[-2]
        need = -(-sk // size)
        total = max(need, case["cache_pages"])
        table = rng.permutation(total)[:max(need, 1)][None]
        kc, vc = (rng.standard_normal((total, size, 1, x.shape[-1])) for x in (k, v))
        pad = need * size - sk
        for cache, x in ((kc, k), (vc, v)):  # the sequence's keys (values) on its pages, zero-padded
            cache[table[0, :need]] = np.concatenate([x, np.zeros((pad, x.shape[-1]))]).reshape(need, size, 1, -1)
        return q[None, None], kc, vc, (table, np.array([sk]))

    _call(case, *prepared(*random_qkv(256, 256, case["d"], seed=1), 1))  # warm-up: imports, BLAS buffers, code paths
    with tempfile.TemporaryDirectory(prefix="attnlib-kv-") as folder:
        if case["path"] == "stream":  # only q in memory; k and v on disk
            q = random_qkv(case["sq"], 0, case["d"], seed=case["seed"])[0]
            k, v = _memmap_cache(folder, case["sk"], case["d"], case["seed"])
        else:
            q, k, v = random_qkv(case["sq"], case["sk"], case["d"], seed=case["seed"])
        q, k, v, grad_inputs = prepared(q, k, v, case["seed"] + 1)
        in_memory = q.nbytes if case["path"] == "stream" else q.nbytes + k.nbytes + v.nbytes
        if grad_inputs is not None:
            in_memory += sum(x.nbytes for x in grad_inputs)
        run = _rss if case["tool"] == "rss" else _traced
        started = time.perf_counter()
        result_arrays, peak, samples, extra = run(case, q, k, v, grad_inputs)
        seconds = time.perf_counter() - started
        cache = k.nbytes + v.nbytes
        del k, v
    output = sum(x.nbytes for x in result_arrays)  # (out, lse) or (dq, dk, dv)
    result = dict(case, peak_bytes=int(peak), output_bytes=output,
                  working_bytes=int(peak) - output, input_bytes=in_memory, seconds=seconds,
                  numpy_errors=np.geterr(), **extra)
    if case["path"] == "stream":
        result["cache_bytes"] = cache
    if case["tool"] != "peak":
        result["t"] = [t for t, _ in samples]
        result["bytes"] = [int(b) for _, b in samples]
    return result
