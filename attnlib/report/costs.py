"""The resource bounds of the notebooks' parameters: one cost model per notebook.

Every size-like parameter is bounded by what its notebook does with it, before anything
runs.  Each notebook's ``costs`` function (read off its cells and the functions they call)
yields a `Cost` per stage: the parameters that size the stage, and upper estimates of the
bytes it holds in memory at once, the bytes it writes to the temporary folder and the
arithmetic it does, from the shapes it builds (inputs, outputs and gradients, the dense
reference's (Sq, Sk) arrays, tile maps, one pass per injected defect, worker processes and
threads).  `check_params` refuses a stage whose memory exceeds `memory_limit` or whose
files exceed the temporary folder's free space, and a notebook whose work summed over its
stages exceeds `WORK_LIMIT`, naming the stage's parameters, their values and the limit.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass

from ..evidence.memory import CAP_BYTES
from ..judge.sizing import dense_bytes, physical_memory

#: Arithmetic one notebook may do: 1e16 floating-point operations, about 12 days at
#: 10 GFLOP/s (one core's float64 rate), ~90x the largest default run's estimate
#: (equivalence, 1.1e14); past it a run would not finish in any useful time.
WORK_LIMIT = 10**16
#: Work of one (query, key) pair besides its ``4 d`` multiply-adds (q k^T, then p v): its
#: exponential, the running max and sum, and masking (~32 operations' time).
PAIR_WORK = 32
#: Work of one tile beyond its arithmetic: the kernel's Python steps (~50 us measured), in
#: operations at 10 GFLOP/s.
TILE_WORK = 5 * 10**5
#: One long-double operation of the oracle against a float64 one: numpy has no BLAS for long
#: double (0.25 GFLOP/s measured against ~20 for the tiled float64 kernel).
LONG_DOUBLE = 100
#: One backward pass against a forward: five (Sq, Sk) matmuls to the forward's two, and
#: the recomputed scores.
BACKWARD = 3
#: One Dask task outside its arithmetic: the scheduler's and the worker's ~1 ms per task, in
#: operations at 10 GFLOP/s.
TASK_WORK = 10**7
#: One piece of a distributed plan (`attnlib.distributed.make_plan`): a small Python object
#: (bytes) and the steps that make it (operations).
PIECE_BYTES, PIECE_WORK = 512, 10**4
#: One Dask task in flight: its future and task records on the client, the scheduler and a
#: worker (measured: 7.8 KiB a no-op task, all three in one process, traced peak of 2,000).
TASK_BYTES = 16 * 2**10
#: One Dask worker process: the interpreter with numpy, dask and distributed imported.
PROCESS_BYTES = 256 * 2**20
#: One kernel thread: its own tile buffers (the forward's working memory, capped at
#: `memory.CAP_BYTES`) and its stack (8 MiB by default on Linux).
THREAD_BYTES = CAP_BYTES + 8 * 2**20
#: Where the physical memory cannot be read (no ``os.sysconf``): assume a 16 GiB machine.
FALLBACK_MEMORY = 16 * 2**30
#: Entries of `attnlib.bench.gallery.gallery` (the flex_gallery notebook runs each).
GALLERY_ENTRIES = 10


def memory_limit() -> int:
    """Bytes one stage of a notebook may hold at once: half this machine's physical memory
    (as `attnlib.judge.sizing.dense_fits` allows the dense path), or of `FALLBACK_MEMORY` where unknown."""
    return (physical_memory() or FALLBACK_MEMORY) // 2


def disk_limit() -> int | None:
    """Free bytes in the temporary folder (where the notebooks write their KV caches and
    ``.npy`` inputs), or None where that cannot be read (then not checked)."""
    try:
        return shutil.disk_usage(tempfile.gettempdir()).free
    except OSError:
        return None


@dataclass(frozen=True)
class Cost:
    """One stage of a notebook: ``names`` (the parameters that size it), ``what`` it is,
    and its estimated ``memory`` (bytes held at once), ``disk`` (bytes written to the
    temporary folder) and ``work`` (floating-point operations, or their time's worth)."""

    names: tuple
    what: str
    memory: int = 0
    work: int = 0
    disk: int = 0


def _ceil(a, b):
    return -(-a // b)


def _arrays(heads, sq, sk, d, dv=None) -> int:
    """Bytes of q, k, v, out and lse of ``heads`` float64 heads."""
    dv = d if dv is None else dv
    return 8 * heads * (sq * d + sk * (d + dv) + sq * (dv + 1))


def _pass(heads, sq, sk, d, block_q=256, block_k=256) -> int:
    """Work of one attention pass over every pair (an upper bound under any mask), with
    `TILE_WORK` for each tile of ``block_q x block_k`` (tiles never exceed the lengths)."""
    tiles = _ceil(sq, min(block_q, max(sq, 1))) * _ceil(sk, min(block_k, max(sk, 1)))
    return heads * sq * sk * (4 * d + PAIR_WORK) + TILE_WORK * tiles


def _importable(name: str) -> bool:
    """Whether module ``name`` is found here (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a blocked import, or a module without a spec
        return False


def _equivalence_costs(p):
    from ..evidence.defects import DEFECTS
    from ..evidence.inputs import BLOCK_SIZES, DIFFERENTIAL_BLOCKS, FAMILIES, HEAD_DIMS

    runs = len(DEFECTS) + 3  # the kernel clean and with each defect, the reference and |v|'s
    b, dmax = min(BLOCK_SIZES), max(HEAD_DIMS)
    n, d = p["max_len"], p["d"]
    yield Cost(("n_cases", "max_len", "d"), "the differential run (up to 4 heads of max_len x max_len)",
               _arrays(4, n, n, d) + dense_bytes(n, n, 8),
               p["n_cases"] * runs * _pass(4, n, n, d, min(DIFFERENTIAL_BLOCKS), min(DIFFERENTIAL_BLOCKS)))
    n = p["broad_max_len"]
    yield Cost(("broad_cases", "broad_max_len"), "the broad run (up to 4 heads, head dim up to 256)",
               _arrays(4, n, n, dmax) + dense_bytes(n, n, 8), p["broad_cases"] * 3 * _pass(4, n, n, dmax, b, b))
    n = p["feature_max_len"]
    for name in ("feature_cases", "sink_cases"):  # up to 2 x 4 heads, head dim up to 256
        yield Cost((name, "feature_max_len"), f"the {name.split('_')[0]} run (up to 8 heads of "
                   "feature_max_len x feature_max_len)", _arrays(8, n, n, dmax) + dense_bytes(n, n, 16),
                   p[name] * runs * _pass(8, n, n, dmax, b, b))
    n = p["document_max_len"]  # up to 2 x 2 heads, head dim up to 128; the visible pairs are few
    yield Cost(("document_cases", "document_max_len"), "the packed-documents run (up to 4 heads of "
               "document_max_len x document_max_len)", _arrays(4, n, n, 128) + dense_bytes(n, n, 8),
               p["document_cases"] * runs * _pass(4, n, n, 128, 256, 256))
    n = p["sink_n"]  # 4 heads; their scores kept for the recount, the gate's reference per sink
    yield Cost(("sink_n",), "the sink sweep (13 sinks on 4 heads of sink_n x sink_n)",
               _arrays(4, n, n, 64) + 8 * 4 * n * n + dense_bytes(n, n, 16), 13 * 4 * _pass(4, n, n, 64, 128, 128))
    n = p["layout_max_len"]  # varlen: up to 6 sequences x 4 heads padded into a batch
    yield Cost(("layout_cases", "layout_max_len"), "the varlen run (up to 24 padded heads of "
               "layout_max_len x layout_max_len)", 2 * _arrays(24, n, n, 64) + dense_bytes(n, n, 48),
               p["layout_cases"] * 4 * _pass(24, n, n, 64))
    yield Cost(("layout_cases", "layout_max_len"), "the paged run (up to 32 heads of 64 queries over "
               "layout_max_len keys, on pages of one key)", 2 * _arrays(32, 64, n, 64) + dense_bytes(64, n, 64),
               p["layout_cases"] * 4 * _pass(32, 64, n, 64, 64, 1))
    pages = max(p["paged_pages"])  # a cache of 16-key pages of k and v, head dim 64, made in memory
    yield Cost(("paged_pages",), "the paged memory run's cache", 2 * 8 * 16 * 64 * pages + 8 * pages,
               PAIR_WORK * 2 * 16 * 64 * sum(p["paged_pages"]))
    n, d = p["adversarial_n"], p["adversarial_d"]
    yield Cost(("adversarial_n", "adversarial_d", "block_q", "block_k"), "the adversarial families",
               _arrays(1, n, n, d) + dense_bytes(n, n, 2),
               len(FAMILIES) * runs * _pass(1, n, n, d, p["block_q"], p["block_k"]))
    if n <= p["oracle_max_n"]:  # the accuracy families against the long-double oracle
        accuracy = sum(f.purpose == "accuracy" for f in FAMILIES.values())
        yield Cost(("adversarial_n", "adversarial_d", "oracle_max_n"), "the long-double oracle runs",
                   _arrays(1, n, n, d) + 3 * 16 * n * n, accuracy * LONG_DOUBLE * _pass(1, n, n, d))


def _rescales_costs(p):
    from ..evidence.inputs import FAMILIES

    n, d, bq, bk = p["n"], p["d"], p["block_q"], p["block_k"]
    runs = 1 + len(FAMILIES)  # random inputs, then each family; the stats of every one are kept
    yield Cost(("n", "d"), "the tiled runs' inputs and outputs", 2 * _arrays(1, n, n, d))
    yield Cost(("n", "block_q", "block_k"), "the tile maps and per-tile rescale counts",
               _ceil(n, bq) * _ceil(n, bk) * (9 * runs + 16))
    yield Cost(("n", "d", "block_q", "block_k"), "the tiled runs", work=runs * _pass(1, n, n, d, bq, bk))
    if n <= p["dense_check_max_n"]:
        yield Cost(("n", "dense_check_max_n"), "the dense recount", dense_bytes(n, n, 1) + _arrays(1, n, n, d),
                   2 * _pass(1, n, n, d, bq, bk))


def _memory_costs(p):
    n, d, sweep = p["n"], p["d"], p["sweep"]
    yield Cost(("n", "d"), "memory over time at n (tiled and dense, tracemalloc and RSS)",
               _arrays(1, n, n, d) + dense_bytes(n, n, 1), 4 * _pass(1, n, n, d))
    yield Cost(("sweep", "d", "dense_max_n"), "the peak vs n runs (tiled, then dense up to dense_max_n)",
               _arrays(1, sweep[-1], sweep[-1], d),
               sum(_pass(1, m, m, d) * (2 if m <= p["dense_max_n"] else 1) for m in sweep))
    keys, queries = p["decode_keys"], p["decode_queries"]
    step = min(keys, 1 << 16)  # written and read 65536 keys at a time
    yield Cost(("decode_keys", "decode_queries", "d"), "the decode runs over a memmapped KV cache "
               "(k and v written to the temporary folder per run)",
               _arrays(1, queries[-1], 2 * step, d), 2 * sum(_pass(1, m, keys, d, 256, 512) for m in queries)
               + 2 * len(queries) * PAIR_WORK * 2 * keys * d, disk=2 * 8 * keys * d)


def _gradients_costs(p):
    from ..evidence.defects import BACKWARD_DEFECTS
    from ..evidence.inputs import BLOCK_SIZES, FAMILIES, HEAD_DIMS

    # the forward, the tiled backward clean and with each defect, the dense forward and backward
    runs = 2 + BACKWARD * (2 + len(BACKWARD_DEFECTS))
    b, dmax, n = min(BLOCK_SIZES), max(HEAD_DIMS), p["max_len"]
    for name, what, heads in (("n_cases", "the random shapes", 4), ("sink_cases", "the sink problems", 8)):
        yield Cost((name, "max_len"), f"{what} (up to {heads} heads, head dim up to 256)",
                   2 * _arrays(heads, n, n, dmax) + dense_bytes(n, n, 2 * heads),
                   p[name] * runs * _pass(heads, n, n, dmax, b, b))
    m = max(8, n // 2)  # up to 6 sequences x 4 heads, padded into a batch for the dense gradient
    yield Cost(("varlen_cases", "max_len"), "the varlen problems (up to 24 padded heads of max_len / 2)",
               2 * _arrays(24, m, m, 64) + dense_bytes(m, m, 48), p["varlen_cases"] * 10 * _pass(24, m, m, 64))
    n, d = p["adversarial_n"], p["adversarial_d"]
    yield Cost(("adversarial_n", "adversarial_d", "block_q", "block_k"), "the adversarial families",
               2 * _arrays(1, n, n, d) + dense_bytes(n, n, 2),
               len(FAMILIES) * runs * _pass(1, n, n, d, p["block_q"], p["block_k"]))
    sweep = p["sweep"]
    yield Cost(("sweep", "dense_max_n"), "the backward memory runs (head dim 64)",
               2 * _arrays(1, sweep[-1], sweep[-1], 64),
               sum((1 + BACKWARD) * _pass(1, m, m, 64) * (2 if m <= p["dense_max_n"] else 1) for m in sweep))


def _performance_costs(p):
    torch = _importable("torch")
    workers, reps, cases = p["workers"], p["repeats"], p["cases"]

    def one(case, *tiles):  # a pass over a [batch, heads, seqlen, headdim, causal] case
        return _pass(case[0] * case[1], case[2], case[2], case[3], *tiles)

    yield Cost(("workers",), "the kernel's threads (each with its own tile buffers and stack)",
               workers[-1] * THREAD_BYTES)
    impls = 2 + len(workers) + torch  # the default, each thread count, dense numpy, torch SDPA
    forward, backward = sum(map(one, cases)), sum(map(one, p["backward_cases"]))
    yield Cost(("repeats", "workers", "cases", "dense_cases", "backward_cases"), "the forward and backward "
               "cases, phases and the run under load",
               work=(reps + 1) * (impls * forward + BACKWARD * impls * backward + 4 * one(cases[0])))
    n = p["mask_n"]
    # Per (query, key) pair: the boolean masks given to torch (SDPA's, FlexAttention's) and,
    # with torch, FlexAttention eager's three float64 (Sq, Sk) arrays (6.4 GB measured at
    # 16384); the GQA decode case's 64 kv heads of n keys, which FlexAttention expands 4x.
    measured = 4 * p["mask_memory"] * min(4, p.get("mask_memory_cases", 4))  # of the 4 cases
    yield Cost(("mask_n", "repeats", "flex", "mask_memory", "mask_memory_cases"),
               "the mask cases (dense masks of mask_n x mask_n)",
               max(n * n * (2 + 24 * torch), _arrays(64, 1, n, 64) * (1 + 4 * torch)),
               (4 * (2 + reps) + measured) * (1 + 3 * torch) * _pass(1, n, n, 64))
    ns = p["n_values"]
    yield Cost(("n_values", "repeats", "dense_max_n", "torch_max_n"), "time vs n",
               _arrays(1, ns[-1], ns[-1], 64),
               sum((reps + 1) * _pass(1, m, m, 64)  # every n at `repeats`: each point has its spread
                   * (1 + (m <= p["dense_max_n"]) + (torch and m <= p["torch_max_n"])) for m in ns))
    if torch:  # the device section (its CPU part here): torch, numpy and SDPA on each shape, masks, memory
        shapes = [tuple(c[:4]) for c in p["device_cases"]]
        dm = p["device_memory_ns"]
        yield Cost(("repeats", "device_cases", "mask_n", "device_memory_ns"), "the device section",
                   # SDPA's float64 scores and weights of a case (where they fit), the mask case's
                   # explicit mask and scores, the memory rows' inputs (in their own processes)
                   max(max(16 * b * h * m * m for b, h, m, d in shapes), n * n * (1 + 16),
                       _arrays(1, dm[-1], dm[-1], 64)),
                   (reps + 1) * 3 * sum(_pass(b * h, n, n, d) for b, h, n, d in shapes)
                   + 2 * (reps + 1) * _pass(1, n, n, 64) + sum(_pass(1, m, m, 64) for m in dm))
    case = cases[1] if len(cases) > 1 else cases[0]
    sizes = p["sweep_sizes"]
    yield Cost(("sweep_sizes", "repeats", "cases"), "the tile-size sweep",
               work=reps * sum(one(case, bq, bk) for bq in sizes for bk in sizes))


def _numerics_costs(p):
    ns, ds, stds = p["ns"], p["ds"], p["logit_stds"]
    yield Cost(("ns", "ds", "logit_stds"), "float64 against the oracle (dense, tiled, long double)",
               _arrays(1, ns[-1], ns[-1], ds[-1]) + 3 * 16 * ns[-1] ** 2 + 2 * dense_bytes(ns[-1], ns[-1], 1),
               len(stds) * sum((LONG_DOUBLE + 4) * _pass(1, n, n, d) for n in ns for d in ds))
    blocks = p["blocks"]
    for names, lengths, tiles in ((("precision_n", "blocks", "logit_stds"), [p["precision_n"]], blocks),
                                  (("precision_ns", "blocks", "logit_stds"), p["precision_ns"], blocks[-1:])):
        # 2 heads, head dim 64: the oracle, 3 naive runs, and 3 precisions per tile size
        yield Cost(names, "the low-precision study",
                   _arrays(2, lengths[-1], lengths[-1], 64) + 3 * 16 * 2 * lengths[-1] ** 2,
                   len(stds) * sum((LONG_DOUBLE + 3) * _pass(2, n, n, 64) + 3 * sum(
                       _pass(2, n, n, 64, b, b) for b in tiles) for n in lengths))
    n = p["lazy_n"]  # random inputs and two families; two precisions per threshold
    yield Cost(("lazy_n", "taus"), "the lazy-rescaling study", _arrays(1, n, n, 64) + 3 * 16 * n * n,
               3 * (LONG_DOUBLE * _pass(1, n, n, 64) + 2 * len(p["taus"]) * _pass(1, n, n, 64, 64, 64)))


def _plan_pieces(heads, n, block) -> int:
    """Pieces of a causal distributed plan: per head, the (query block, key range) pairs
    on or below the diagonal."""
    nb = _ceil(n, block)
    return heads * nb * (nb + 1) // 2


def _scaleout_costs(p):
    n, heads, d, block, workers, reps, sweep = (p[k] for k in ("n", "heads", "d", "block", "workers",
                                                               "repeats", "sweep"))
    b = min(block, max(n, sweep[-1]))
    yield Cost(("workers", "block", "d"), "the Dask worker processes (every cluster size started at once "
               "for the timing), each holding a piece", sum(workers) * (PROCESS_BYTES + _arrays(1, b, b, d)))
    tasks = 2 * _plan_pieces(heads, n, block)  # pieces and (at most as many) merges
    one = _pass(heads, n, n, d) + TASK_WORK * tasks
    yield Cost(("n", "heads", "d", "block", "workers", "repeats"), "the equality and timing case (q, k, v "
               "written to the temporary folder; q, k, v, both outputs and |v|'s in memory)",
               8 * 8 * heads * n * d + PIECE_BYTES * tasks, (3 + (reps + 1) * (len(workers) + 1)) * one,
               disk=3 * 8 * heads * n * d)
    yield Cost(("sweep", "d", "block"), "the sweep (q, k, v of each n written to the temporary folder)",
               3 * 8 * sweep[-1] * d + PIECE_BYTES * 2 * _plan_pieces(1, sweep[-1], block),
               sum(4 * (_pass(1, m, m, d) + TASK_WORK * 2 * _plan_pieces(1, m, block)) for m in sweep),
               disk=3 * 8 * sweep[-1] * d)
    cases = p["model_fit"] + p["model_heldout"]
    biggest = max(h * m for h, m, _ in cases)
    yield Cost(("model_fit", "model_heldout", "d", "model_repeats"), "the cost model's runs (q, k, v of each "
               "written to the temporary folder, run on every cluster size)",
               3 * 8 * biggest * d + PIECE_BYTES * 2 * max(_plan_pieces(h, m, bl) for h, m, bl in cases),
               sum(p["model_repeats"] * len(workers) * (_pass(h, m, m, d) + TASK_WORK * 2 * _plan_pieces(h, m, bl))
                   for h, m, bl in cases), disk=3 * 8 * biggest * d)
    ln = p["long_n"]
    lb = min(p["long_block"], ln)
    # The cluster's run, then each sampled query block against its keys in this process
    # (its k, v slices, |v| and the two outputs; the tiled kernel's tiles).
    yield Cost(("long_n", "long_block", "long_repeats", "long_samples", "d"), "the long run (q, k, v and the output "
               "as .npy files in the temporary folder)",
               6 * 8 * ln * d + 8 * 4 * lb * d + PIECE_BYTES * 2 * _plan_pieces(1, ln, lb),
               p["long_repeats"] * (_pass(1, ln, ln, d) + TASK_WORK * 2 * _plan_pieces(1, ln, lb))
               + 2 * p["long_samples"] * _pass(1, lb, ln, d), disk=4 * 8 * ln * d)
    yield Cost(("scheduler_batches", "scheduler_tasks"), "the scheduler's no-op tasks (a future each)",
               TASK_BYTES * p["scheduler_tasks"], TASK_WORK * p["scheduler_batches"] * p["scheduler_tasks"])
    pieces = _plan_pieces(p["project_heads"], p["project_n"], p["project_block"])  # planned, never run
    yield Cost(("project_n", "project_heads", "project_block", "project_machines"), "the projection's plan (its pieces made "
               "as Python objects)", PIECE_BYTES * pieces, len(p["project_machines"]) * PIECE_WORK * pieces)
    flops = 4 * p["project_d"] * p["project_heads"] * p["project_n"] * (p["project_n"] + 1) // 2
    if flops > 2**1000 or p["project_machines"][-1] * p["project_cores"] > 2**53:
        names = ("project_n", "project_heads", "project_d", "project_machines", "project_cores")
        raise ValueError(f"{_named(names, p)}: the projection computes in float64; its operation "
                         "count must stay below 2^1000 and its worker count (machines x cores) below 2^53")


def _flex_gallery_costs(p):
    n, heads, d, block, reps = p["n"], p["heads"], p["d"], p["block"], p["repeats"]
    torch = _importable("torch")
    padded = _ceil(n, block) * block
    # inputs, the gate's reference, P @ |V| and sizes for every head, the dense mask and its
    # index arrays; FlexAttention eager's scores and probabilities per head
    yield Cost(("n", "heads", "d"), "the gallery runs at n (every head's dense reference and mask)",
               2 * _arrays(heads, n, n, d) + dense_bytes(n, n, 4 * heads) + (9 + 16 * torch) * heads * n * n)
    yield Cost(("n", "heads", "d", "block", "repeats", "memory_entries"), "the gallery runs at n",
               # per entry: the gate, the built-in, the gradients and the timing; then the memory runs
               work=(GALLERY_ENTRIES * (6 + (reps + 1) * (1 + torch))
                     + 2 * min(p["memory_entries"], GALLERY_ENTRIES) * (1 + torch))
               * _pass(heads, n, n, d, block, block))
    yield Cost(("n", "heads", "block"), "the dense tile count's mask padded to whole tiles",
               heads * padded * padded)
    long_ns = p["long_ns"]
    yield Cost(("long_ns", "d", "block"), "the long-context runs (one head)",
               _arrays(1, long_ns[-1], long_ns[-1], d),
               2 * 2 * sum(_pass(1, m, m, d, block, block) for m in long_ns))


def _check_rule_costs(p):
    precisions, seeds = p["precisions"], p["n_seeds"]
    for i, (b, h, sq, sk, d, _) in enumerate(p["shapes"]):
        # per seed and precision: up to 6 correct and 3 defective kernels, each defect's exact
        # version, the exact answer and the dense baseline
        yield Cost(("shapes", "n_seeds", "precisions"), f"the calibration runs of shapes[{i}]",
                   4 * _arrays(b * h, sq, sk, d), seeds * len(precisions) * 14 * _pass(b * h, sq, sk, d))
    for i, (b, h, _, sq, sk, d, _) in enumerate(p["power_shapes"]):
        # per precision (3), magnitude and seed: 13 wrong and 5 correct kernels' gradients, judged
        yield Cost(("power_shapes", "power_seeds", "power_magnitudes"),
                   f"the power runs of power_shapes[{i}]", 8 * _arrays(b * h, sq, sk, d),
                   3 * len(p["power_magnitudes"]) * p["power_seeds"] * 20 * BACKWARD
                   * _pass(b * h, sq, sk, d))
    # the random problems: about 3 kernels each, at most space.MAX_WORK (one in LONG_EVERY LONG_WORK)
    yield Cost(("space_problems",), "the random problems over the input space (attnlib.check.space)",
               8 * _arrays(1, 2048, 2048, 64), 3 * p["space_problems"] * 4 * _pass(1, 64, 64, 1024))
    n = p["long_gradient_n"]
    yield Cost(("long_gradient_n",), "the long float32 gradients (one causal head, head dim 64)",
               8 * _arrays(1, n, n, 64), 6 * BACKWARD * _pass(1, n, n, 64))
    # a mask of 128 x 1024 draws and its three tests per run (1.1 a tenth more: the errors and structures)
    yield Cost(("dropout_runs",), "the dropout statistics' calibration (128 x 1024 masks)", 16 * 128 * 1024,
               int(1.1 * p["dropout_runs"] * 50 * 128 * 1024))
    # per precision (3), magnitude and seed: 15 mix-ups, each judged with up to 10 neighbours
    yield Cost(("mixup_magnitudes", "mixup_seeds"), "the mix-up runs (attnlib.check.mixups.SHAPE)",
               8 * _arrays(4, 96, 96, 32), 3 * len(p["mixup_magnitudes"]) * p["mixup_seeds"] * 15 * 10
               * _pass(4, 96, 96, 32))


def _shown(x) -> str:
    """``repr(x)``, with an integer of more than 30 digits as ``~1e+N``."""
    if isinstance(x, list):
        return "[" + ", ".join(map(_shown, x)) + "]"
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) >= 10**30:
        return f"~{_sci(x)}"
    return repr(x)


def _named(names, params) -> str:
    shown = ", ".join(f"{name}={_shown(params[name])}" for name in names)
    return f"parameter{'s' if len(names) > 1 else ''} {shown}"


def _sci(x) -> str:
    """``x`` (an int or float, however large) as ``1.2e+34``."""
    try:
        return f"{float(x):.2g}"
    except OverflowError:  # past float64's range: the exponent from the bit length
        return f"1e+{int(int(x).bit_length() * math.log10(2))}"


def _gib(x) -> str:
    return f"{x / 2**30:,.1f} GiB" if x < 2**70 else f"{_sci(x // 2**30)} GiB"


def check_costs(costs, params: dict) -> None:
    """Refuse ``params`` (checked values) whose stages, ``costs`` (`Cost` objects made from
    them), cannot fit this machine: memory, temporary folder and work, as above."""
    costs = list(costs)
    memory, disk = memory_limit(), disk_limit()
    for cost in costs:
        if cost.memory > memory:
            raise ValueError(
                f"{_named(cost.names, params)}: {cost.what} would hold about {_gib(cost.memory)} in "
                f"memory; this machine allows {_gib(memory)} (half its physical memory); choose "
                "smaller values")
        if disk is not None and cost.disk > disk:
            raise ValueError(
                f"{_named(cost.names, params)}: {cost.what} would write about {_gib(cost.disk)} to "
                f"{tempfile.gettempdir()}, which has {_gib(disk)} free; choose smaller values")
    total = sum(cost.work for cost in costs)
    if total > WORK_LIMIT:
        worst = max(costs, key=lambda cost: cost.work)
        raise ValueError(
            f"{_named(worst.names, params)}: {worst.what} would take about {_sci(worst.work)} "
            f"floating-point operations (the whole notebook {_sci(total)}); the limit is "
            f"{_sci(WORK_LIMIT)} per notebook (about 12 days at 10 GFLOP/s); choose smaller values")
