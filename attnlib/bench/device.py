"""The oracle on a torch device, measured: ``python -m attnlib bench --device cuda|cpu``.

On the device the tensors live on, in one process, interleaved, medians:

- the device's float64 GEMM rate, measured at the kernel's own tile shape (all heads of a
  query tile against one key tile) and at a large square product;
- attnlib's torch kernel against torch SDPA in float64 (on CUDA SDPA's float64 path is its
  math backend, which materialises the ``n x n`` scores: run where they fit) and, on the
  CPU, against attnlib's numpy kernel on the same values, with the largest difference;
- the masks (a causal sliding window, documents) against SDPA with the explicit mask;
- the device memory a call adds, against ``n``: torch's allocator statistics on CUDA
  (peak allocated above what the inputs hold), RSS in a fresh process on the CPU;
- on CUDA the long case: exact float64 causal attention at ``n = 131072``, 8 heads,
  ``D = 128``, its TFLOP/s and its extra memory.

A machine without CUDA asked for it says so and runs the CPU part.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..core.tiled import attention
from ..core.validate import cpu_name
from ..evidence.inputs import random_qkv
from .masks import mask_cases
from .timing import SHAPES, BenchCase

#: The long case of the device issue: one GPU, exact float64 causal attention.
LONG = BenchCase(1, 8, 131072, 128, True)
#: Sequence lengths of the memory rows (one head, D = 64, causal).
MEMORY_NS = (2048, 8192, 32768)


def _torch():
    import torch

    return torch


def describe(dev) -> str:
    """The device in words: the GPU's name, or the CPU model and its threads."""
    torch = _torch()
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    return f"{cpu_name()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def _sync(dev):
    if dev.type == "cuda":
        _torch().cuda.synchronize(dev)


def _interleaved(fns: dict, dev, repeats: int) -> tuple[dict, dict]:
    """Every repeat's seconds of each callable, one warm-up each, then in turn ``repeats`` times;
    and their medians."""
    for fn in fns.values():
        fn()
    _sync(dev)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(dev)
            start = time.perf_counter()
            fn()
            _sync(dev)
            times[name].append(time.perf_counter() - start)
    return times, {name: statistics.median(t) for name, t in times.items()}


def gemm_rates(dev, d: int = 128, repeats: int = 5) -> dict:
    """float64 GEMM TFLOP/s on ``dev``: at the kernel's tile (`tilesizes.device_tiles` for 8
    heads: ``(8, block_q, d) @ (8, d, block_k)``) and at a large square product."""
    from ..core.tilesizes import device_tiles

    torch = _torch()
    tiles = device_tiles(dev, 8)
    a = torch.randn(8, tiles.block_q, d, dtype=torch.float64, device=dev)
    b = torch.randn(8, d, tiles.block_k, dtype=torch.float64, device=dev)
    side = 8192 if dev.type == "cuda" else 1024
    x = torch.randn(side, side, dtype=torch.float64, device=dev)
    times, t = _interleaved({"tile": lambda: a @ b, "square": lambda: x @ x}, dev, repeats)
    flop = {"tile": 2 * a.numel() * tiles.block_k, "square": 2 * side ** 3}
    return {"tile_tflops": flop["tile"] / t["tile"] / 1e12,
            "square_tflops": flop["square"] / t["square"] / 1e12,
            # every repeat's TFLOP/s, lowest to highest
            "tflops_repeats": {name: sorted(flop[name] / x / 1e12 for x in s) for name, s in times.items()},
            "tile": f"(8, {tiles.block_q}, {d}) @ (8, {d}, {tiles.block_k})", "square": side}


def _sdpa_fits(dev, heads: int, n: int) -> bool:
    """Whether SDPA's float64 math path, a few ``(heads, n, n)`` float64 arrays, fits."""
    need = 4 * heads * n * n * 8
    if dev.type == "cuda":
        return need < _torch().cuda.mem_get_info(dev)[0] / 2  # half the free memory
    from ..judge.sizing import dense_fits

    return dense_fits(n, heads=heads)


def forward_rows(dev, shapes=SHAPES, repeats: int = 5, log=None, cases=None) -> list[dict]:
    """attnlib on ``dev`` against SDPA float64 there and, on the CPU, the numpy kernel: on
    ``cases`` (``(b, h, n, d, causal)`` each) or, without them, each of ``shapes`` causal
    and not."""
    torch = _torch()
    F = torch.nn.functional
    rows = []
    if cases is None:
        cases = [(b, h, n, d, causal) for causal in (True, False) for b, h, n, d in shapes]
    for b, h, n, d, causal in cases:
        case = BenchCase(b, h, n, d, causal)
        q, k, v = random_qkv(n, d=d, batch=(b,), heads=h, seed=0)
        tq, tk, tv = (torch.from_numpy(x).to(dev) for x in (q, k, v))
        fns = {"attnlib (torch)": lambda: attention(tq, tk, tv, causal=causal)}
        if dev.type == "cpu":
            fns["attnlib (numpy)"] = lambda: attention(q, k, v, causal=causal)
        if _sdpa_fits(dev, b * h, n):
            fns["torch SDPA float64"] = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        times, t = _interleaved(fns, dev, repeats)
        row = {"case": case.name, **t,
               "tflops": case.flops / t["attnlib (torch)"] / 1e12, "times": times}
        out = attention(tq, tk, tv, causal=causal)
        if "attnlib (numpy)" in t:
            row["torch / numpy"] = t["attnlib (torch)"] / t["attnlib (numpy)"]
            ref = attention(q, k, v, causal=causal)
            row["max |torch - numpy|"] = float(np.abs(out.cpu().numpy() - ref).max())
        if "torch SDPA float64" in t:
            row["attnlib / SDPA"] = t["attnlib (torch)"] / t["torch SDPA float64"]
        rows.append(row)
        if log:
            log(f"  {case.name}: " + ", ".join(f"{name} {s:.3f} s" for name, s in t.items())
                + (f", torch/numpy {row['torch / numpy']:.2f}x" if "torch / numpy" in row else "")
                + f", {row['tflops']:.3f} TFLOP/s")
    return rows


def mask_rows(dev, n: int = 16384, repeats: int = 3, log=None) -> list[dict]:
    """The sliding window and document cases: attnlib on ``dev`` against SDPA float64 there
    with the explicit boolean mask (where it fits)."""
    torch = _torch()
    F = torch.nn.functional
    rows = []
    for case in mask_cases(n)[:2]:
        q = random_qkv(case.sq, 0, case.d, batch=(case.b,), heads=case.hq, seed=0)[0]
        _, k, v = random_qkv(0, case.sk, case.d, batch=(case.b,), heads=case.hk, seed=1)
        tq, tk, tv = (torch.from_numpy(x).to(dev) for x in (q, k, v))
        fns = {"attnlib (torch)": lambda: attention(tq, tk, tv, **case.options)}
        if _sdpa_fits(dev, case.b * case.hq, n):
            mask = torch.from_numpy(case.visible()).to(dev)
            fns["torch SDPA float64 + mask"] = lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)
        times, t = _interleaved(fns, dev, repeats)
        row = {"case": case.name, "shape": case.shape, **t, "times": times}
        if len(t) == 2:
            row["SDPA / attnlib"] = t["torch SDPA float64 + mask"] / t["attnlib (torch)"]
        rows.append(row)
        if log:
            log(f"  {case.name} {case.shape}: " + ", ".join(f"{name} {s:.3f} s" for name, s in t.items())
                + (f", attnlib {row['SDPA / attnlib']:.1f}x ahead" if "SDPA / attnlib" in row else ""))
    return rows


def cuda_extra_bytes(n: int, heads: int = 1, d: int = 64, causal: bool = True, device: str = "cuda") -> dict:
    """Peak device memory one call adds above its inputs (torch's allocator statistics),
    after a warm-up call at a small size; and its seconds."""
    torch = _torch()
    dev = torch.device(device)
    small = [torch.randn(1, heads, 512, d, dtype=torch.float64, device=dev) for _ in range(3)]
    attention(*small, causal=causal)  # warm-up: kernels loaded, caches made
    del small
    q, k, v = (torch.randn(1, heads, n, d, dtype=torch.float64, device=dev) for _ in range(3))
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    start = time.perf_counter()
    out = attention(q, k, v, causal=causal)
    torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    extra = torch.cuda.max_memory_allocated(dev) - base - out.numel() * out.element_size()
    return {"n": n, "heads": heads, "d": d, "extra_bytes": int(extra), "seconds": seconds}


def cpu_extra_bytes(n: int, heads: int = 1, d: int = 64, causal: bool = True) -> dict:
    """RSS one call of the torch kernel on the CPU adds above its inputs and output, in this
    (fresh) process after a warm-up call at a small size (memory_profiler's sampling)."""
    from memory_profiler import memory_usage

    torch = _torch()
    # The warm-up gives every worker thread its full 512 x 512 tiles (4 query tiles): with one
    # tile of 512 the first long call grew a second thread's buffers and the RSS with them.
    small = [torch.randn(1, heads, 2048, d, dtype=torch.float64) for _ in range(3)]
    attention(*small, causal=causal)
    q, k, v = (torch.randn(1, heads, n, d, dtype=torch.float64) for _ in range(3))
    base = memory_usage(-1, interval=0.01, timeout=0.01)[0]
    start = time.perf_counter()
    usage = memory_usage((attention, (q, k, v), {"causal": causal}), interval=0.005)
    seconds = time.perf_counter() - start
    extra = max(0.0, max(usage) - base) * 2**20 - heads * n * d * 8  # less the output itself
    return {"n": n, "heads": heads, "d": d, "extra_bytes": int(max(0.0, extra)), "seconds": seconds}


def memory_rows(dev, ns=MEMORY_NS, log=None) -> list[dict]:
    """Extra memory of one call against ``n``, each in a fresh process."""
    from ..evidence.fresh import run_fresh_or_error

    measure, options = (cuda_extra_bytes, {"device": str(dev)}) if dev.type == "cuda" else (cpu_extra_bytes, {})
    rows = []
    for n in ns:
        row = run_fresh_or_error(measure, n, **options)
        row.setdefault("n", n)
        rows.append(row)
        if log:
            log(f"  n = {n}: " + (f"{row['extra_bytes'] / 2**20:.1f} MiB extra" if "extra_bytes" in row
                                  else f"failed: {row.get('error')}"))
    return rows


def long_case(dev, log=None) -> dict:
    """`LONG` on a CUDA device: seconds, TFLOP/s and extra device memory (fresh process)."""
    from ..evidence.fresh import run_fresh_or_error

    row = run_fresh_or_error(cuda_extra_bytes, LONG.n, heads=LONG.h, d=LONG.d, device=str(dev), timeout=1800)
    if "seconds" in row:
        row["tflops"] = LONG.flops / row["seconds"] / 1e12
    if log:
        log(f"  {LONG.name}: " + (f"{row['seconds']:.2f} s, {row['tflops']:.1f} TFLOP/s, "
                                  f"{row['extra_bytes'] / 2**30:.2f} GiB extra" if "tflops" in row
                                  else f"failed: {row.get('error')}"))
    return row


def device_section(device: str = "cuda", *, repeats: int = 5, shapes=SHAPES, mask_n: int = 16384,
                   memory_ns=MEMORY_NS, log=None, cases=None, cpu_masks=True) -> dict:
    """Everything above on ``device``; a machine without CUDA asked for it runs the CPU part
    and says so in ``"note"``.  ``cases``: the forward's cases (`forward_rows`);
    ``cpu_masks=False`` leaves the mask rows out on the CPU (``"masks"`` is then empty), for a
    caller that times attnlib on torch tensors beside SDPA in its own mask section."""
    torch = _torch()
    note = None
    if device.startswith("cuda") and not torch.cuda.is_available():
        note = f"no CUDA device here (torch {torch.__version__}): the CPU part was run instead"
        device = "cpu"
    dev = torch.device(device)
    say = log or (lambda m: None)
    if note:
        say(note)
    result = {"device": str(dev), "describe": describe(dev), "note": note}
    say(f"device: {result['describe']}")
    result["gemm"] = gemm_rates(dev, repeats=repeats)
    say(f"float64 GEMM: {result['gemm']['tile_tflops']:.3f} TFLOP/s at the tile {result['gemm']['tile']}, "
        f"{result['gemm']['square_tflops']:.3f} at {result['gemm']['square']}^2")
    say("forward, default arguments:")
    result["forward"] = forward_rows(dev, shapes, repeats, say, cases=cases)
    for row in result["forward"]:  # the kernel's rate as a share of the device's float64 GEMM rate
        row["of GEMM"] = row["tflops"] / result["gemm"]["square_tflops"]
    result["masks"] = []
    if dev.type != "cpu" or cpu_masks:
        say(f"masks at n = {mask_n}:")
        result["masks"] = mask_rows(dev, mask_n, repeats, say)
    say("extra memory of one call (1 head, D = 64, causal):")
    result["memory"] = memory_rows(dev, memory_ns, say)
    if dev.type == "cuda":
        say("the long case:")
        result["long"] = long_case(dev, say)
        if "tflops" in result["long"]:
            result["long"]["of GEMM"] = result["long"]["tflops"] / result["gemm"]["square_tflops"]
    return result
