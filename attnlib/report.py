"""The report runner: notebook parameters, provenance, papermill runs and HTML rendering.

``python -m attnlib report`` runs every notebook in ``notebooks/`` with papermill, renders
each executed notebook to self-contained HTML in ``reports/`` (plots embedded, no script
or style from a CDN) and writes ``reports/index.html`` with one verdict line per report.
A report is replaced only when its notebook ran to the end: it is written to a temporary
file and renamed.

Each notebook's defaults live in its cell tagged ``parameters``; the checks for those
values live here (`NOTEBOOKS`), and the notebook's next cell calls `check_params`, so a
bad value fails with the same message in the notebook and in the runner (which checks
before it starts anything).

Runs never pass for what they are not:

* ``reports/`` holds the committed full runs at the notebooks' defaults.  A run with
  ``--quick``, any ``-p`` or other notebooks (``--notebooks``) writes to the git-ignored
  ``reports-local/`` unless ``--out`` says otherwise; ``--out reports`` is refused for
  such a run unless ``--allow-nondefault-reports`` is given too.  Every report whose
  parameters differ from the defaults carries a NON-DEFAULT PARAMETERS banner under its
  title and in the index, and its results JSON records ``default_params`` and
  ``overrides`` (``{name: {"default": ..., "actual": ...}}``).
* A notebook that fails (an exception in a cell, or a dead kernel, e.g. killed for
  memory) keeps its previous report; ``<out>/<name>.status.json`` records the error, the
  index shows it as ERROR with the notebook and cell, and the executed notebook with the
  traceback is kept as ``<out>/failed/<name>.ipynb``.  A later successful run clears both.
* The notebooks call `strict` in their setup cell: every numpy operation of the notebook
  process then runs under `STRICT` (``np.errstate(divide='raise', over='raise',
  invalid='raise')``); `save_results` records whether it did, and only then does the
  verdict say so.
* `stage` in a notebook prints a progress line on the runner's terminal (through a file
  named by ``$ATTNLIB_REPORT_PROGRESS``: the kernel's own stdout and stderr end up in the
  report).  Progress goes to stdout; errors, FAIL and ERROR lines to stderr.
"""

from __future__ import annotations

import ast
import contextlib
import datetime as _dt
import html
import json
import math
import numbers
import os
import platform
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import __version__, _args
from .memory import CAP_BYTES, dense_bytes, dense_fits, physical_memory
from .oracle import ORACLE_PRECISION
from .plots import Table

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "reports"  # the committed full runs, at the notebooks' defaults
LOCAL_REPORTS = ROOT / "reports-local"  # git-ignored: --quick and -p runs
PROGRESS_ENV = "ATTNLIB_REPORT_PROGRESS"  # the file `stage` appends its lines to


# -- strict floating point and progress, called from the notebooks ---------------------------

STRICT = _args.STRICT  # the contract's strict floating-point mode
STRICT_TEXT = "np.errstate(" + ", ".join(f"{k}={v!r}" for k, v in STRICT.items()) + ")"


def strict() -> None:
    """Put this process under `STRICT` (``np.seterr``): every later kernel call runs in it.

    attnlib's worker threads carry the caller's errstate, so threaded calls do too.  Code
    that legitimately makes an inf or a NaN (``log10(0)`` for a histogram) says so locally
    with ``np.errstate(...="ignore")``.
    """
    np.seterr(**STRICT)


def is_strict() -> bool:
    """Whether numpy's current error handling is at least `STRICT`."""
    current = np.geterr()
    return all(current[key] == value for key, value in STRICT.items())


def stage(text: str) -> None:
    """Announce a long stage of a notebook on the terminal of ``python -m attnlib report``.

    The kernel's stdout and stderr are captured into the report (and its fd 2 is echoed
    there too), so the runner names a file in ``$ATTNLIB_REPORT_PROGRESS`` and prints the
    lines appended to it as they come.  Outside the runner this does nothing.
    """
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(" ".join(str(text).split()) + "\n")
    except OSError:  # progress is a courtesy; it never fails a report
        pass


# -- parameter checks ----------------------------------------------------------------------

def _int(name, x, lo):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"parameter {name} must be an integer, got {x!r}")
    if x < lo:
        raise ValueError(f"parameter {name} must be >= {lo}, got {x!r}")
    return int(x)


def positive(name, x):
    return _int(name, x, 1)


def non_negative(name, x):
    return _int(name, x, 0)


def flag(name, x):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"parameter {name} must be True or False, got {x!r}")
    return bool(x)


def text(name, x):
    if not isinstance(x, str):
        raise TypeError(f"parameter {name} must be a string, got {x!r}")
    return x


def seconds(name, x):
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not (0 < x < 10 and math.isfinite(x)):
        raise ValueError(f"parameter {name} must be a number of seconds in (0, 10), got {x!r}")
    return float(x)


def sizes(name, x):
    if not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"parameter {name} must be a non-empty list of integers, got {x!r}")
    values = [positive(f"{name}[{i}]", v) for i, v in enumerate(x)]
    if values != sorted(set(values)):
        raise ValueError(f"parameter {name} must be strictly increasing, got {x!r}")
    return values


def thresholds(name, x):
    """A strictly increasing list of lazy-rescale thresholds, each as `attention` accepts it."""
    if not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"parameter {name} must be a non-empty list of numbers, got {x!r}")
    try:
        values = [_args.threshold(v) for v in x]
    except (TypeError, ValueError) as e:
        raise ValueError(f"parameter {name}: {e}") from None
    if values != sorted(set(values)):
        raise ValueError(f"parameter {name} must be strictly increasing, got {x!r}")
    return values


def precisions(name, x):
    """A non-empty list of distinct kernel precisions, as `check_kernel` takes them."""
    if not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"parameter {name} must be a non-empty list of precisions, got {x!r}")
    values = [text(f"{name}[{i}]", v) for i, v in enumerate(x)]
    for v in values:
        try:
            _args.precision(v)
        except ValueError:
            raise ValueError(f"parameter {name}: {v!r} is not one of float64, float32, float16, "
                             "bfloat16") from None
    if len(set(values)) != len(values):
        raise ValueError(f"parameter {name} must not repeat a precision, got {x!r}")
    return values


def _shape_list(name, x, fields):
    """A non-empty list of ``[*fields]``: positive integers, then a causal flag last."""
    if not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"parameter {name} must be a non-empty list of shapes, got {x!r}")
    shapes = []
    for i, shape in enumerate(x):
        if not isinstance(shape, (list, tuple)) or len(shape) != len(fields):
            raise ValueError(f"parameter {name}[{i}] must be [{', '.join(fields)}], got {shape!r}")
        dims = [positive(f"{name}[{i}][{j}]", v) for j, v in enumerate(shape[:-1])]
        shapes.append(dims + [flag(f"{name}[{i}][{len(fields) - 1}]", shape[-1])])  # lists: papermill passes JSON
    return shapes


def check_shapes(name, x):
    """A non-empty list of ``[batch, heads, seqlen_q, seqlen_k, headdim, causal]``."""
    return _shape_list(name, x, ("batch", "heads", "seqlen_q", "seqlen_k", "headdim", "causal"))


def backward_defect(name, x):
    """Empty, or the name of one of `attnlib.defects.BACKWARD_DEFECTS`."""
    from .defects import BACKWARD_DEFECTS

    x = text(name, x)
    if x and x not in BACKWARD_DEFECTS:
        raise ValueError(f"parameter {name} must be empty or one of {sorted(BACKWARD_DEFECTS)}, got {x!r}")
    return x


def magnitudes(name, x):
    """A strictly increasing, non-empty list of positive finite numbers."""
    if not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"parameter {name} must be a non-empty list of numbers, got {x!r}")
    values = []
    for i, v in enumerate(x):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
            raise ValueError(f"parameter {name}[{i}] must be a positive finite number, got {v!r}")
        values.append(float(v))
    if values != sorted(set(values)):
        raise ValueError(f"parameter {name} must be strictly increasing, got {x!r}")
    return values


def power_shapes(name, x):
    """A non-empty list of ``[batch, heads, kv_heads, seqlen_q, seqlen_k, headdim, causal]``."""
    shapes = _shape_list(name, x, ("batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "headdim", "causal"))
    for i, shape in enumerate(shapes):
        if shape[1] % shape[2]:
            raise ValueError(f"parameter {name}[{i}]: heads ({shape[1]}) must be a multiple of kv_heads ({shape[2]})")
    return shapes


# -- resource bounds -------------------------------------------------------------------------
#
# Every size-like parameter is bounded by what its notebook does with it, before anything
# runs.  Each notebook's ``costs`` function (read off its cells and the functions they call)
# yields a `Cost` per stage: the parameters that size the stage, and upper estimates of the
# bytes it holds in memory at once, the bytes it writes to the temporary folder and the
# arithmetic it does, from the shapes it builds (inputs, outputs and gradients, the dense
# reference's (Sq, Sk) arrays, tile maps, one pass per injected defect, worker processes and
# threads).  `check_params` refuses a stage whose memory exceeds `memory_limit` or whose
# files exceed the temporary folder's free space, and a notebook whose work summed over its
# stages exceeds `WORK_LIMIT`, naming the stage's parameters, their values and the limit.

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
    (as `memory.dense_fits` allows the dense path), or of `FALLBACK_MEMORY` where unknown."""
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


def _dense(heads, sq, sk) -> int:
    """The dense reference's ``(heads, Sq, Sk)`` float64 arrays (`memory.dense_bytes`)."""
    return dense_bytes(sq, sk, heads)


def _pass(heads, sq, sk, d, block_q=256, block_k=256) -> int:
    """Work of one attention pass over every pair (an upper bound under any mask), with
    `TILE_WORK` for each tile of ``block_q x block_k`` (tiles never exceed the lengths)."""
    tiles = _ceil(sq, min(block_q, max(sq, 1))) * _ceil(sk, min(block_k, max(sk, 1)))
    return heads * sq * sk * (4 * d + PAIR_WORK) + TILE_WORK * tiles


def _torch_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def _equivalence_costs(p):
    from .defects import DEFECTS
    from .inputs import BLOCK_SIZES, DIFFERENTIAL_BLOCKS, FAMILIES, HEAD_DIMS

    runs = len(DEFECTS) + 3  # the kernel clean and with each defect, the reference and |v|'s
    b, dmax = min(BLOCK_SIZES), max(HEAD_DIMS)
    n, d = p["max_len"], p["d"]
    yield Cost(("n_cases", "max_len", "d"), "the differential run (up to 4 heads of max_len x max_len)",
               _arrays(4, n, n, d) + _dense(8, n, n),
               p["n_cases"] * runs * _pass(4, n, n, d, min(DIFFERENTIAL_BLOCKS), min(DIFFERENTIAL_BLOCKS)))
    n = p["broad_max_len"]
    yield Cost(("broad_cases", "broad_max_len"), "the broad run (up to 4 heads, head dim up to 256)",
               _arrays(4, n, n, dmax) + _dense(8, n, n), p["broad_cases"] * 3 * _pass(4, n, n, dmax, b, b))
    n = p["feature_max_len"]
    for name in ("feature_cases", "sink_cases"):  # up to 2 x 4 heads, head dim up to 256
        yield Cost((name, "feature_max_len"), f"the {name.split('_')[0]} run (up to 8 heads of "
                   "feature_max_len x feature_max_len)", _arrays(8, n, n, dmax) + _dense(16, n, n),
                   p[name] * runs * _pass(8, n, n, dmax, b, b))
    n = p["sink_n"]  # 4 heads; their scores kept for the recount, the gate's reference per sink
    yield Cost(("sink_n",), "the sink sweep (13 sinks on 4 heads of sink_n x sink_n)",
               _arrays(4, n, n, 64) + 8 * 4 * n * n + _dense(16, n, n), 13 * 4 * _pass(4, n, n, 64, 128, 128))
    n = p["layout_max_len"]  # varlen: up to 6 sequences x 4 heads padded into a batch
    yield Cost(("layout_cases", "layout_max_len"), "the varlen run (up to 24 padded heads of "
               "layout_max_len x layout_max_len)", 2 * _arrays(24, n, n, 64) + _dense(48, n, n),
               p["layout_cases"] * 4 * _pass(24, n, n, 64))
    yield Cost(("layout_cases", "layout_max_len"), "the paged run (up to 32 heads of 64 queries over "
               "layout_max_len keys, on pages of one key)", 2 * _arrays(32, 64, n, 64) + _dense(64, 64, n),
               p["layout_cases"] * 4 * _pass(32, 64, n, 64, 64, 1))
    pages = max(p["paged_pages"])  # a cache of 16-key pages of k and v, head dim 64, made in memory
    yield Cost(("paged_pages",), "the paged memory run's cache", 2 * 8 * 16 * 64 * pages + 8 * pages,
               PAIR_WORK * 2 * 16 * 64 * sum(p["paged_pages"]))
    n, d = p["adversarial_n"], p["adversarial_d"]
    yield Cost(("adversarial_n", "adversarial_d", "block_q", "block_k"), "the adversarial families",
               _arrays(1, n, n, d) + _dense(2, n, n),
               len(FAMILIES) * runs * _pass(1, n, n, d, p["block_q"], p["block_k"]))
    if n <= p["oracle_max_n"]:  # the accuracy families against the long-double oracle
        accuracy = sum(f.purpose == "accuracy" for f in FAMILIES.values())
        yield Cost(("adversarial_n", "adversarial_d", "oracle_max_n"), "the long-double oracle runs",
                   _arrays(1, n, n, d) + 3 * 16 * n * n, accuracy * LONG_DOUBLE * _pass(1, n, n, d))


def _rescales_costs(p):
    from .inputs import FAMILIES

    n, d, bq, bk = p["n"], p["d"], p["block_q"], p["block_k"]
    runs = 1 + len(FAMILIES)  # random inputs, then each family; the stats of every one are kept
    yield Cost(("n", "d"), "the tiled runs' inputs and outputs", 2 * _arrays(1, n, n, d))
    yield Cost(("n", "block_q", "block_k"), "the tile maps and per-tile rescale counts",
               _ceil(n, bq) * _ceil(n, bk) * (9 * runs + 16))
    yield Cost(("n", "d", "block_q", "block_k"), "the tiled runs", work=runs * _pass(1, n, n, d, bq, bk))
    if n <= p["dense_check_max_n"]:
        yield Cost(("n", "dense_check_max_n"), "the dense recount", _dense(1, n, n) + _arrays(1, n, n, d),
                   2 * _pass(1, n, n, d, bq, bk))


def _memory_costs(p):
    n, d, sweep = p["n"], p["d"], p["sweep"]
    yield Cost(("n", "d"), "memory over time at n (tiled and dense, tracemalloc and RSS)",
               _arrays(1, n, n, d) + _dense(1, n, n), 4 * _pass(1, n, n, d))
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
    from .defects import BACKWARD_DEFECTS
    from .inputs import BLOCK_SIZES, FAMILIES, HEAD_DIMS

    # the forward, the tiled backward clean and with each defect, the dense forward and backward
    runs = 2 + BACKWARD * (2 + len(BACKWARD_DEFECTS))
    b, dmax, n = min(BLOCK_SIZES), max(HEAD_DIMS), p["max_len"]
    yield Cost(("n_cases", "max_len"), "the random shapes (up to 4 heads, head dim up to 256)",
               2 * _arrays(4, n, n, dmax) + _dense(8, n, n), p["n_cases"] * runs * _pass(4, n, n, dmax, b, b))
    yield Cost(("sink_cases", "max_len"), "the sink problems (up to 8 heads, head dim up to 256)",
               2 * _arrays(8, n, n, dmax) + _dense(16, n, n),
               p["sink_cases"] * runs * _pass(8, n, n, dmax, b, b))
    m = max(8, n // 2)  # up to 6 sequences x 4 heads, padded into a batch for the dense gradient
    yield Cost(("varlen_cases", "max_len"), "the varlen problems (up to 24 padded heads of max_len / 2)",
               2 * _arrays(24, m, m, 64) + _dense(48, m, m), p["varlen_cases"] * 10 * _pass(24, m, m, 64))
    n, d = p["adversarial_n"], p["adversarial_d"]
    yield Cost(("adversarial_n", "adversarial_d", "block_q", "block_k"), "the adversarial families",
               2 * _arrays(1, n, n, d) + _dense(2, n, n),
               len(FAMILIES) * runs * _pass(1, n, n, d, p["block_q"], p["block_k"]))
    sweep = p["sweep"]
    yield Cost(("sweep", "dense_max_n"), "the backward memory runs (head dim 64)",
               2 * _arrays(1, sweep[-1], sweep[-1], 64),
               sum((1 + BACKWARD) * _pass(1, m, m, 64) * (2 if m <= p["dense_max_n"] else 1) for m in sweep))


def _performance_costs(p):
    from .bench import BACKWARD_CASES, CASES, QUICK_BACKWARD_CASES, QUICK_CASES, BenchCase

    torch = _torch_installed()
    workers, reps = p["workers"], p["repeats"]
    yield Cost(("workers",), "the kernel's threads (each with its own tile buffers and stack)",
               workers[-1] * THREAD_BYTES)
    cases = CASES if p["full_cases"] else QUICK_CASES
    impls = 2 + len(workers) + torch  # the default, each thread count, dense numpy, torch SDPA
    forward = sum(_pass(c.b * c.h, c.n, c.n, c.d) for c in cases)
    backward = sum(_pass(c.b * c.h, c.n, c.n, c.d)
                   for c in (BACKWARD_CASES if p["full_cases"] else QUICK_BACKWARD_CASES))
    first = _pass(cases[0].b * cases[0].h, cases[0].n, cases[0].n, cases[0].d)
    yield Cost(("repeats", "workers", "full_cases"), "the forward and backward cases, phases and the run "
               "under load", work=(reps + 1) * (impls * forward + BACKWARD * impls * backward + 4 * first))
    n = p["mask_n"]
    # Per (query, key) pair: the boolean masks given to torch (SDPA's, FlexAttention's) and,
    # with torch, FlexAttention eager's three float64 (Sq, Sk) arrays (6.4 GB measured at
    # 16384); the GQA decode case's 64 kv heads of n keys, which FlexAttention expands 4x.
    yield Cost(("mask_n", "repeats", "mask_memory"), "the mask cases (dense masks of mask_n x mask_n)",
               max(n * n * (2 + 24 * torch), _arrays(64, 1, n, 64) * (1 + 4 * torch)),
               (2 + max(1, reps // 2) + 4 * p["mask_memory"]) * (1 + 2 * torch) * 4 * _pass(1, n, n, 64))
    ns = p["n_values"]
    yield Cost(("n_values", "repeats", "dense_max_n", "torch_max_n"), "time vs n",
               _arrays(1, ns[-1], ns[-1], 64),
               sum(((reps if m <= 16384 else 1) + 1) * _pass(1, m, m, 64)
                   * (1 + (m <= p["dense_max_n"]) + (torch and m <= p["torch_max_n"])) for m in ns))
    case = cases[1] if p["full_cases"] else BenchCase(1, 1, 1024)
    sizes = p["sweep_sizes"]
    yield Cost(("sweep_sizes", "repeats", "full_cases"), "the tile-size sweep",
               work=reps * sum(_pass(case.b * case.h, case.n, case.n, case.d, bq, bk)
                               for bq in sizes for bk in sizes))


def _numerics_costs(p):
    ns, ds, stds = p["ns"], p["ds"], p["logit_stds"]
    yield Cost(("ns", "ds", "logit_stds"), "float64 against the oracle (dense, tiled, long double)",
               _arrays(1, ns[-1], ns[-1], ds[-1]) + 3 * 16 * ns[-1] ** 2 + 2 * _dense(1, ns[-1], ns[-1]),
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
    pieces = _plan_pieces(p["project_heads"], p["project_n"], 8192)  # planned, never run
    yield Cost(("project_n", "project_heads", "project_machines"), "the projection's plan (its pieces made "
               "as Python objects)", PIECE_BYTES * pieces, len(p["project_machines"]) * PIECE_WORK * pieces)
    flops = 4 * p["project_d"] * p["project_heads"] * p["project_n"] * (p["project_n"] + 1) // 2
    if flops > 2**1000 or p["project_machines"][-1] * p["project_cores"] > 2**53:
        names = ("project_n", "project_heads", "project_d", "project_machines", "project_cores")
        raise ValueError(f"{_named(names, p)}: the projection computes in float64; its operation "
                         "count must stay below 2^1000 and its worker count (machines x cores) below 2^53")


def _flex_gallery_costs(p):
    n, heads, d, block, reps = p["n"], p["heads"], p["d"], p["block"], p["repeats"]
    torch = _torch_installed()
    padded = _ceil(n, block) * block
    # inputs, the gate's reference, P @ |V| and sizes for every head, the dense mask and its
    # index arrays; FlexAttention eager's scores and probabilities per head
    yield Cost(("n", "heads", "d"), "the gallery runs at n (every head's dense reference and mask)",
               2 * _arrays(heads, n, n, d) + _dense(4 * heads, n, n) + (9 + 16 * torch) * heads * n * n)
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
    n = p["long_gradient_n"]
    yield Cost(("long_gradient_n",), "the long float32 gradients (one causal head, head dim 64)",
               8 * _arrays(1, n, n, 64), 6 * BACKWARD * _pass(1, n, n, 64))


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


def check_resources(notebook: str, params: dict) -> None:
    """Refuse ``params`` (checked values) whose run cannot fit this machine: see `Cost`."""
    costs_of = NOTEBOOKS[notebook].costs
    if costs_of is None:
        return
    costs = list(costs_of(params))
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


@dataclass(frozen=True)
class Notebook:
    """What the runner knows of one evidence notebook (its defaults live in the notebook).

    ``parameters`` maps each parameter to its check; ``quick`` holds tiny values for
    ``--quick`` runs and the test suite; ``dense_runs`` lists ``(parameter, heads)`` pairs
    whose value is an ``n`` the dense path runs at, with that many ``(n, n)`` heads;
    ``costs`` maps the checked parameters to the notebook's stages (`Cost`), which bound
    every size-like parameter by the memory, disk and work it asks for.
    """

    title: str
    parameters: dict
    quick: dict
    dense_runs: tuple = ()
    costs: object = None


NOTEBOOKS = {
    "equivalence": Notebook(
        "Equivalence: tiled attention equals the dense float64 reference",
        {"n_cases": positive, "seed": non_negative, "max_len": positive, "d": positive,
         "broad_cases": positive, "broad_max_len": positive, "feature_cases": positive,
         "feature_max_len": positive, "sink_cases": positive, "sink_n": positive,
         "layout_cases": positive, "layout_max_len": positive, "paged_pages": sizes,
         "adversarial_n": positive, "adversarial_d": positive,
         "block_q": positive, "block_k": positive, "oracle_max_n": non_negative, "results_json": text},
        {"n_cases": 6, "max_len": 300, "broad_cases": 6, "broad_max_len": 300, "feature_cases": 9,
         "feature_max_len": 256, "sink_cases": 3, "sink_n": 256, "layout_cases": 6,
         "layout_max_len": 128, "paged_pages": [256, 2560], "adversarial_n": 256, "oracle_max_n": 256},
        # The reference holds [v, |v|] outputs and the gate a (Sq, Sk) size matrix besides.
        # The sink sweep: 4 heads of scores, and the gate's reference and sizes for them.
        (("max_len", 8), ("broad_max_len", 8), ("feature_max_len", 16), ("sink_n", 16), ("adversarial_n", 2)),
        costs=_equivalence_costs),
    "rescales": Notebook(
        "Rescales: where the online softmax's running max grows",
        {"n": positive, "d": positive, "block_q": positive, "block_k": positive,
         "causal": flag, "seed": non_negative, "dense_check_max_n": non_negative,
         "results_json": text},
        {"n": 256, "block_q": 32, "block_k": 32},
        (("dense_check_max_n", 1),), costs=_rescales_costs),
    "memory": Notebook(
        "Memory: the tiled kernel streams in constant working memory",
        {"n": positive, "d": positive, "causal": flag, "sweep": sizes,
         "dense_max_n": positive, "interval_s": seconds, "decode_keys": positive,
         "decode_queries": sizes, "results_json": text},
        {"n": 2048, "sweep": [512, 1024, 2048], "dense_max_n": 2048,
         "decode_keys": 262144, "decode_queries": [1, 16]},
        (("n", 1), ("dense_max_n", 1)), costs=_memory_costs),
    "gradients": Notebook(
        "Gradients: the tiled backward pass equals the dense float64 gradient",
        {"n_cases": positive, "seed": non_negative, "max_len": positive, "sink_cases": positive,
         "varlen_cases": positive,
         "adversarial_n": positive, "adversarial_d": positive, "block_q": positive,
         "block_k": positive, "sweep": sizes, "dense_max_n": positive, "inject": backward_defect,
         "results_json": text},
        {"n_cases": 5, "max_len": 256, "sink_cases": 3, "varlen_cases": 3, "adversarial_n": 256,
         "sweep": [1024, 2048],
         "dense_max_n": 2048},
        # The dense gradient holds about twice the forward's (Sq, Sk) arrays.
        (("max_len", 8), ("adversarial_n", 2), ("dense_max_n", 2)), costs=_gradients_costs),
    "performance": Notebook(
        "Performance: attnlib against dense numpy and PyTorch SDPA",
        {"workers": sizes, "repeats": positive, "n_values": sizes, "dense_max_n": positive,
         "torch_max_n": positive, "full_cases": flag, "mask_n": positive, "mask_memory": flag,
         "sweep_sizes": sizes, "results_json": text},
        {"repeats": 1, "n_values": [256, 512, 1024], "dense_max_n": 512,
         "torch_max_n": 512, "full_cases": False, "mask_n": 512, "sweep_sizes": [64, 128]},
        (("dense_max_n", 1),), costs=_performance_costs),
    "numerics": Notebook(
        "Numerics: float64 and low precisions against an extended-precision oracle; lazy rescaling",
        {"ns": sizes, "ds": sizes, "logit_stds": sizes, "precision_n": positive, "blocks": sizes,
         "precision_ns": sizes, "taus": thresholds, "lazy_n": positive, "seed": non_negative,
         "results_json": text},
        {"ns": [128, 256], "ds": [32], "logit_stds": [1, 10], "precision_n": 256,
         "precision_ns": [64, 128], "blocks": [32, 64], "taus": [0, 8], "lazy_n": 256},
        # its dense runs are bounded by the oracle's sizes (check_params)
        costs=_numerics_costs),
    "scaleout": Notebook(
        "Scale-out: the exact float64 oracle on a Dask cluster",
        {"n": positive, "heads": positive, "d": positive, "block": positive, "workers": sizes,
         "repeats": positive, "sweep": sizes, "project_n": positive, "project_heads": positive,
         "project_d": positive, "project_machines": sizes, "project_cores": positive,
         "results_json": text},
        {"n": 1024, "heads": 2, "d": 64, "block": 256, "repeats": 1, "sweep": [1024, 4096]},
        costs=_scaleout_costs),
    "flex_gallery": Notebook(
        "Programmable attention: a gallery of FlexAttention masks and scores, exact",
        {"n": positive, "heads": positive, "d": positive, "block": positive, "repeats": positive,
         "memory_entries": non_negative, "long_ns": sizes, "results_json": text},
        {"n": 256, "heads": 2, "d": 16, "block": 64, "repeats": 1, "memory_entries": 1,
         "long_ns": [1024, 4096]},
        # The dense reference, P @ |V| and the gate's sizes for every head, and the dense
        # mask count; FlexAttention eager holds n x n scores per head as well.
        (("n", 16),), costs=_flex_gallery_costs),
    "check_rule": Notebook(
        "Check rule: correct kernels pass, buggy kernels fail",
        {"n_seeds": positive, "precisions": precisions, "shapes": check_shapes,
         "power_magnitudes": magnitudes, "power_shapes": power_shapes, "power_seeds": positive,
         "long_gradient_n": positive, "results_json": text},
        {"n_seeds": 1, "precisions": ["float64", "float32"],
         "shapes": [[1, 2, 64, 64, 32, True], [2, 2, 1, 300, 32, False]],
         "power_magnitudes": [1e-4, 1.0], "power_shapes": [[1, 4, 2, 64, 64, 32, True]], "power_seeds": 1,
         "long_gradient_n": 512},
        costs=_check_rule_costs),
}


def check_params(notebook: str, **values) -> dict:
    """Check one notebook's parameters; returns them, converted, or raises a clear error."""
    if notebook not in NOTEBOOKS:
        raise ValueError(f"unknown notebook {notebook!r}; known: {sorted(NOTEBOOKS)}")
    schema = NOTEBOOKS[notebook].parameters
    unknown = sorted(set(values) - set(schema))
    if unknown:
        raise ValueError(f"unknown parameter(s) for {notebook}: {unknown}; known: {sorted(schema)}")
    missing = sorted(set(schema) - set(values))
    if missing:
        raise ValueError(f"missing parameter(s) for {notebook}: {missing}")
    params = {name: schema[name](name, values[name]) for name in schema}
    # The dense path only ever runs where it fits in memory, with room to spare.
    for name, heads in NOTEBOOKS[notebook].dense_runs:
        if not dense_fits(params[name], heads=heads):
            raise ValueError(
                f"parameter {name}={params[name]} would run the dense reference out of memory "
                "on this machine; choose a smaller value")
    if notebook == "check_rule":
        for shape in params["power_shapes"]:
            b, h, _, sq, sk = shape[:5]
            if not dense_fits(sq, heads=4 * b * h, sk=sk):  # the dense gradient and its baselines
                raise ValueError(f"parameter power_shapes: {list(shape)} would run the dense gradient out "
                                 "of memory on this machine; choose a smaller shape")
        if not dense_fits(params["long_gradient_n"], heads=4):
            raise ValueError(f"parameter long_gradient_n={params['long_gradient_n']} would run the dense "
                             "gradient out of memory on this machine; choose a smaller value")
        for shape in params["shapes"]:
            b, h, sq, sk = shape[:4]
            if not dense_fits(sq, heads=2 * b * h, sk=sk):  # the naive baseline and the exact answer
                raise ValueError(f"parameter shapes: {list(shape)} would run the dense baseline out of "
                                 "memory on this machine; choose a smaller shape")
    if notebook == "numerics":
        if max(params["ns"] + params["precision_ns"] + [params["precision_n"], params["lazy_n"]]) > 4096:
            raise ValueError("the long-double oracle has no BLAS: keep ns, precision_ns, precision_n "
                             "and lazy_n <= 4096")
        if ORACLE_PRECISION["method"] != "longdouble":
            raise ValueError("the numerics report needs a long double of >= 64 mantissa bits, which "
                             "this platform's numpy lacks (the decimal oracle takes small shapes only)")
    if notebook == "equivalence" and params["max_len"] < 64:
        raise ValueError("parameter max_len must be >= 64: the differential run's lengths are "
                         "drawn from 64..max_len, so that rows cross two key tiles")
    if notebook in ("memory", "gradients") and params["dense_max_n"] > params["sweep"][-1]:
        raise ValueError("parameter dense_max_n must not exceed the largest sweep size")
    check_resources(notebook, params)
    return params


# -- provenance and results ------------------------------------------------------------------

def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)
        if head.returncode:
            return "unknown (not a git checkout)"
        # The reports being written by this very run do not make the code dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)reports"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"


def _blas() -> str:
    try:
        config = np.show_config(mode="dicts")
        blas = config["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # older numpy: no dict mode
        return "unknown"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Where and with what a report was made."""
    return {
        "attnlib": __version__,
        "git commit": _git_commit(),
        "date (UTC)": _now(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "BLAS": _blas(),
        "CPU": f"{_cpu()} ({os.cpu_count()} logical cores)",
    }


def provenance(params: dict):
    """A table of the run's parameters and `environment`, for the top of a report."""
    shown = {k: v for k, v in params.items() if k != "results_json"}  # the runner's plumbing
    rows = [{"": "parameter", "name": k, "value": repr(v)} for k, v in shown.items()]
    rows += [{"": "environment", "name": k, "value": v} for k, v in environment().items()]
    return Table(rows, ["", "name", "value"], title="Parameters and environment of this run")


@dataclass(frozen=True)
class Verdict:
    """A report's one-line verdict, shown in the notebook and in the index.

    ``passed`` is True or False for a report that checks claims, and None (shown as INFO)
    for one that only measures, such as timings on a shared machine.
    """

    passed: bool | None
    line: str
    strict: bool = False  # the notebook ran under `STRICT`

    @property
    def label(self) -> str:
        return {True: "PASS", False: "FAIL", None: "INFO"}[self.passed]

    @property
    def mode(self) -> str:
        """What the verdict may claim of the floating-point mode ("" when not strict)."""
        return f"all kernel calls under {STRICT_TEXT}" if self.strict else ""

    def _repr_markdown_(self):
        mode = f" — {self.mode.replace(STRICT_TEXT, f'`{STRICT_TEXT}`')}" if self.strict else ""
        return f"**{self.label}**: {self.line}{mode}"


def save_results(results_json: str, notebook: str, params: dict, passed, line: str,
                 figures: dict) -> Verdict:
    """Write a notebook's figures and verdict as JSON (when ``results_json`` is set).

    ``strict`` records whether numpy's error handling is `STRICT` now, as `strict` sets it.
    """
    verdict = Verdict(None if passed is None else bool(passed), line, is_strict())
    if results_json:
        data = {"notebook": notebook, "passed": verdict.passed, "verdict": line,
                "strict": verdict.strict, "params": params, "environment": environment(),
                "figures": figures}
        Path(results_json).write_text(json.dumps(data, indent=1, default=_jsonable))
    return verdict


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")


# -- running and rendering -------------------------------------------------------------------

class ReportError(Exception):
    """A report run that cannot start (bad arguments or parameters)."""


class NotebookError(ReportError):
    """A notebook that started and did not run to the end, or wrote no results.

    ``cell`` is ``"cell N ('first line')"`` (N counted in the stored notebook) or "" when
    unknown; ``error`` is ``"ExcName: message"``; ``executed`` is where the executed
    notebook, traceback included, was kept (None: not kept).
    """

    def __init__(self, notebook: str, cell: str, error: str, dead: bool = False):
        self.notebook, self.cell, self.error, self.dead = notebook, cell, error, dead
        self.executed = None
        where = f" in {cell}" if cell else ""
        what = "lost its kernel" if dead else "failed"
        super().__init__(f"{notebook} {what}{where}: {error}")


def _parse_value(raw: str):
    lowered = {"true": True, "false": False}.get(raw.strip().lower())
    if lowered is not None:
        return lowered
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


#: What the runner and the notebooks import from the report extra (``pip install
#: 'attnlib[report]'``): papermill runs the notebooks, nbformat and nbconvert read and render
#: them, ipykernel is their kernel, matplotlib draws and memory_profiler measures.
REPORT_MODULES = ("papermill", "nbformat", "nbconvert", "ipykernel", "matplotlib", "memory_profiler")
INSTALL_REPORT = "pip install 'attnlib[report]'"


def missing_report_modules() -> list[str]:
    """The `REPORT_MODULES` that cannot be imported here (found without importing them)."""
    import importlib.util

    missing = []
    for name in REPORT_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a blocked import, or a module without a spec
            found = False
        if not found:
            missing.append(name)
    return missing


def _needs_report_extra(missing) -> ReportError:
    return ReportError(f"the report runner needs the report extra ({', '.join(missing)} not "
                       f"importable): {INSTALL_REPORT}")


def _notebook_defaults(path: Path) -> dict:
    try:
        import papermill
    except ImportError as e:  # found, but broken: the same one line as when missing
        raise _needs_report_extra([e.name or "papermill"]) from None

    declared = papermill.inspect_notebook(str(path))
    return {name: ast.literal_eval(p["default"]) for name, p in declared.items()}


def plan(names=None, overrides=(), quick=False, nb_dir=None) -> list[tuple[str, Path, dict]]:
    """Check everything before running: ``[(name, notebook path, parameters), ...]``.

    ``overrides`` are ``"key=value"`` (every selected notebook that declares ``key``) or
    ``"notebook.key=value"`` strings; a key no selected notebook declares is refused.
    """
    return [(name, path, params) for name, path, params, _ in _plan(names, overrides, quick, nb_dir)]


def _plan(names, overrides, quick, nb_dir) -> list[tuple[str, Path, dict, dict]]:
    """`plan`, with each notebook's declared defaults as a fourth item."""
    missing = missing_report_modules()
    if missing:  # nothing can run: one line naming the extra, not a traceback
        raise _needs_report_extra(missing)
    nb_dir = Path(nb_dir) if nb_dir else ROOT / "notebooks"
    names = list(NOTEBOOKS) if not names else list(names)
    for name in names:
        if name not in NOTEBOOKS:
            raise ReportError(f"unknown notebook {name!r}; known: {', '.join(NOTEBOOKS)}")
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ReportError(f"parameters are given as key=value, got {item!r}")
        target, _, key = key.rpartition(".")
        if key == "results_json":
            raise ReportError("results_json is where the runner collects a notebook's figures, "
                              "not a parameter to set")
        if target and target not in names:
            raise ReportError(f"parameter {item!r} names notebook {target!r}, which is not selected")
        if not any(key in NOTEBOOKS[n].parameters for n in ([target] if target else names)):
            where = target or ", ".join(names)
            raise ReportError(f"unknown parameter {key!r} for {where}")
        parsed.append((target, key, _parse_value(raw)))
    runs = []
    for name in names:
        path = nb_dir / f"{name}.ipynb"
        if not path.exists():
            raise ReportError(f"notebook {path} not found")
        defaults = _notebook_defaults(path)
        if set(defaults) != set(NOTEBOOKS[name].parameters):
            raise ReportError(
                f"{path.name}: its parameters cell declares {sorted(defaults)}, "
                f"but attnlib checks {sorted(NOTEBOOKS[name].parameters)}")
        values = {**defaults, **(NOTEBOOKS[name].quick if quick else {})}
        values.update({k: v for t, k, v in parsed if t in ("", name) and k in NOTEBOOKS[name].parameters})
        try:
            params = check_params(name, **values)
        except (TypeError, ValueError) as e:
            raise ReportError(f"{name}: {e}") from None
        runs.append((name, path, params, defaults))
    return runs


def overridden(params: dict, defaults: dict) -> dict:
    """``{name: {"default": ..., "actual": ...}}`` for each parameter not at its default."""
    return {name: {"default": defaults[name], "actual": value} for name, value in params.items()
            if name != "results_json" and name in defaults and value != defaults[name]}


def _describe(overrides: dict) -> str:
    return ", ".join(f"{name}={o['actual']!r} (default {o['default']!r})" for name, o in overrides.items())


def _failed_cell(executed: Path) -> str:
    """``cell N ('first line')`` of the failing cell, N counted in the stored notebook.

    The cell with an error output, else (a dead kernel leaves none) the last cell papermill
    started; "" when the executed notebook is missing or no cell started.
    """
    import nbformat

    added = {"injected-parameters", "papermill-error-cell-tag"}  # cells papermill inserts
    try:
        nb = nbformat.read(str(executed), as_version=4)
    except Exception:  # never written (the kernel did not start) or cut short
        return ""
    cells = [c for c in nb.cells if not added & set(c.metadata.get("tags", []))]
    failed = [i for i, c in enumerate(cells)
              if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    started = [i for i, c in enumerate(cells) if c.metadata.get("papermill", {}).get("start_time")]
    if not failed and not started:
        return ""
    index = (failed or started)[0 if failed else -1]
    source = cells[index].source.strip()
    return f"cell {index} ({source.splitlines()[0] if source else ''!r})"


def _banner(overrides: dict) -> str:
    """The NON-DEFAULT PARAMETERS banner put under a report's title."""
    return ('<div style="border: 3px solid #c0392b; background: #fdecea; padding: .6em 1em; '
            'margin: .5em 0; font-size: 1.1em"><b>NON-DEFAULT PARAMETERS</b>: '
            f"{html.escape(_describe(overrides))}. This is not the report of the notebook's "
            "defaults, which <code>reports/</code> holds.</div>")


def render_html(executed: Path, target: Path, banner: str = "") -> None:
    """Executed notebook -> self-contained HTML, written atomically (tmp file + rename).

    ``banner`` (HTML) is shown under the notebook's first cell, its title.
    """
    import nbformat
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="offline",
                            extra_template_basedirs=[str(Path(__file__).parent / "templates")])
    nb = nbformat.read(str(executed), as_version=4)
    if banner:
        nb.cells.insert(1, nbformat.v4.new_markdown_cell(banner, metadata={"tags": ["attnlib-banner"]}))
    body, _ = exporter.from_notebook_node(nb)
    _write_atomic(target, body)


def _kernel_options() -> dict:
    """papermill keyword arguments for a quiet kernel with a private connection.

    Where jupyter_client can provision CurveZMQ keys (and pyzmq has CURVE), the kernel's
    sockets are encrypted: ipykernel then has no reason to warn that it runs over plain TCP.
    """
    # The kernel's own log (e.g. "KeyboardInterrupt caught in kernel" when the runner stops it
    # at the end) goes to the user's terminal: only critical lines.  A notebook's errors reach
    # the runner through the cells' outputs, not this log.
    options = {"extra_arguments": ["--IPKernelApp.log_level=CRITICAL"]}
    try:
        import zmq
        from jupyter_client.manager import KernelManager
        from traitlets.config import Config
    except ImportError:
        return options
    if "transport_encryption" not in KernelManager.class_trait_names() or not zmq.has("curve"):
        return options
    return {**options, "config": Config({"KernelManager": {"transport_encryption": "auto"}})}


class _Reported(logging.Filter):
    """Drops papermill's log records of errors the runner reports itself, more precisely."""

    def filter(self, record):
        return "Kernel died while waiting for execute reply" not in record.getMessage()


@contextlib.contextmanager
def _kernel_environment(progress_file: Path | None):
    """The kernel's environment and the runner's filters while papermill runs a notebook.

    * ``PYDEVD_DISABLE_FILE_VALIDATION=1``: no debugpy warning about frozen modules at
      kernel start (papermill's own CLI sets it too);
    * ``$ATTNLIB_REPORT_PROGRESS``: the file `stage` writes to (or unset);
    * RuntimeWarnings raised in the kernel transport (zmq, jupyter_client, nbclient), e.g.
      about event loops at shutdown, are ignored; warnings from anywhere else still show.
    """
    saved = {key: os.environ.get(key) for key in ("PYDEVD_DISABLE_FILE_VALIDATION", PROGRESS_ENV)}
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    if progress_file is None:
        os.environ.pop(PROGRESS_ENV, None)
    else:
        os.environ[PROGRESS_ENV] = str(progress_file)
    reported = _Reported()
    papermill_log = logging.getLogger("papermill")
    papermill_log.addFilter(reported)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=RuntimeWarning,
                                    module=r"(zmq|jupyter_client|nbclient)(\.|$)")
            yield
    finally:
        papermill_log.removeFilter(reported)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _progress_pump(progress_file: Path | None, progress):
    """Calls ``progress(line)`` for each line `stage` appends to ``progress_file``."""
    if progress_file is None or progress is None:
        yield
        return
    progress_file.write_bytes(b"")
    stop = threading.Event()

    def pump():
        offset = 0
        while True:
            done = stop.wait(0.2)
            try:
                with open(progress_file, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                chunk = b""
            complete = chunk[:chunk.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.decode("utf-8", "replace").splitlines():
                progress(line)
            if done:
                return

    thread = threading.Thread(target=pump, name="attnlib-report-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def execute(path: Path, params: dict, target: Path, *, banner: str = "", progress=None,
            keep_failed: Path | None = None) -> dict:
    """Run one notebook with papermill and render it to ``target``; returns its results JSON.

    ``results_json`` is added to ``params`` (a temporary file the notebook writes).  Raises
    `NotebookError` (a `ReportError`) naming the failed cell, when the kernel dies or does
    not start, or when the notebook wrote no results; ``target`` is then left as it was,
    and the executed notebook, traceback included, is copied to ``keep_failed`` if given.
    ``progress(line)`` receives the notebook's `stage` lines as they come; ``banner``
    (HTML) goes under the report's title.
    """
    import papermill

    with tempfile.TemporaryDirectory(prefix=f"attnlib-{path.stem}-") as tmp:
        executed = Path(tmp) / path.name
        results = Path(tmp) / f"{path.stem}.json"
        progress_file = Path(tmp) / "progress.txt" if progress is not None else None
        failure = None
        try:
            with _kernel_environment(progress_file), _progress_pump(progress_file, progress):
                papermill.execute_notebook(
                    str(path), str(executed), parameters={**params, "results_json": str(results)},
                    kernel_name="python3", progress_bar=False, cwd=str(path.parent),
                    **_kernel_options(),
                )
        except papermill.PapermillExecutionError as e:
            failure = NotebookError(path.name, _failed_cell(executed), f"{e.ename}: {e.evalue}")
        except Exception as e:  # the kernel died (killed, e.g. out of memory) or never started
            dead = type(e).__name__ == "DeadKernelError"
            error = f"{type(e).__name__}: {e}".rstrip(": ")
            if dead:
                error += " (the notebook's process was killed, e.g. for lack of memory)"
            failure = NotebookError(path.name, _failed_cell(executed), error, dead=dead)
        else:
            if not results.exists():
                failure = NotebookError(path.name, "", "it ran but wrote no results JSON")
        if failure is not None:
            if keep_failed is not None and executed.exists():
                keep_failed.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(executed, keep_failed)
                failure.executed = keep_failed
            raise failure
        data = json.loads(results.read_text())
        render_html(executed, target, banner)
    return data


def _write_atomic(target: Path, text: str) -> None:
    """Write ``text`` to a uniquely named file beside ``target``, then rename it over ``target``:
    a reader sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_json(target: Path, data: dict) -> None:
    _write_atomic(target, json.dumps(data, indent=1, default=_jsonable))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def run_one(name: str, path: Path, params: dict, out_dir: Path, defaults: dict | None = None,
            progress=None, marks: dict | None = None) -> tuple[bool, str]:
    """Execute one notebook and render it; the previous report stays unless this succeeds.

    Returns ``(ran, message)``.  On success the results JSON records ``default_params`` and
    ``overrides`` against ``defaults`` (the notebook's declared values; None: not known, taken
    as default) and any error marker of an earlier run is cleared.  On failure
    ``<name>.status.json`` records the error and ``failed/<name>.ipynb`` keeps the executed
    notebook.  ``marks`` are further ``{name: {"default": ..., "actual": ...}}`` entries that
    make the run non-default (e.g. a notebook from another folder).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    overrides = {**overridden(params, defaults or {}), **(marks or {})}
    status_file, kept = out_dir / f"{name}.status.json", out_dir.resolve() / "failed" / f"{name}.ipynb"
    started = time.perf_counter()

    def stage(line):
        progress(f"{line} ({time.perf_counter() - started:.0f} s in)")

    try:
        try:
            data = execute(path, params, out_dir / f"{name}.html", banner=_banner(overrides) if overrides else "",
                           progress=stage if progress else None, keep_failed=kept)
        except OSError as e:  # the notebook ran, but its report could not be rendered or written
            raise NotebookError(path.name, "", f"writing its report failed: {type(e).__name__}: {e}") from e
    except NotebookError as e:
        _write_json(status_file, {
            "notebook": e.notebook, "status": "ERROR", "cell": e.cell, "error": e.error,
            "kernel_died": e.dead, "executed": str(e.executed) if e.executed else None,
            "date (UTC)": _now(), "params": {**params, "results_json": ""},
            "default_params": not overrides, "overrides": overrides})
        kept_line = f"; the executed notebook is kept in {e.executed}" if e.executed else ""
        return False, f"ERROR: {e}{kept_line}"
    elapsed = time.perf_counter() - started
    data["seconds"] = round(elapsed, 1)
    data["params"] = {**data["params"], "results_json": ""}
    data["default_params"], data["overrides"] = not overrides, overrides
    _write_json(out_dir / f"{name}.json", data)
    status_file.unlink(missing_ok=True)
    kept.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # only when empty
        kept.parent.rmdir()
    label = Verdict(data["passed"], data["verdict"]).label
    marker = f" [NON-DEFAULT PARAMETERS: {', '.join(overrides)}]" if overrides else ""
    return True, f"{label}: {data['verdict']} ({elapsed:.1f} s){marker}"


def _index_item(name: str, title: str, out_dir: Path) -> str:
    results, page = out_dir / f"{name}.json", out_dir / f"{name}.html"
    status_file = out_dir / f"{name}.status.json"
    data = json.loads(results.read_text()) if results.exists() and page.exists() else None
    status = json.loads(status_file.read_text()) if status_file.exists() else None
    lines = []
    if status is not None:
        where = f"{status['notebook']}, {status['cell']}" if status.get("cell") else status["notebook"]
        previous = (f"the report below is from the previous run that completed, of "
                    f"{data.get('environment', {}).get('date (UTC)', '?')} UTC, and is not this run's"
                    if data is not None else "there is no earlier report")
        kept = (f" (the executed notebook is kept locally as failed/{html.escape(name)}.ipynb)"
                if status.get("executed") else "")
        lines.append(f'<span class="error">ERROR</span> in {html.escape(where)}: '
                     f'{html.escape(status["error"])} ({html.escape(status.get("date (UTC)", "?"))} UTC) — '
                     f"{previous}{kept}")
    if data is None:
        if status is None:
            return f"<li><b>{html.escape(title)}</b>: not run yet</li>"
        return f"<li><b>{html.escape(title)}</b><br>{lines[0]}</li>"
    env = data.get("environment", {})
    verdict = Verdict(data["passed"], data["verdict"], bool(data.get("strict")))
    badge = verdict.label.lower()
    mode = f" — {html.escape(verdict.mode)}" if verdict.strict else ""
    lines.append(f'<span class="{badge}">{badge.upper()}</span> '
                 f'<a href="{name}.html">{html.escape(title)}</a>')
    if data.get("overrides"):
        lines.append(f'<span class="nondefault">NON-DEFAULT PARAMETERS</span> '
                     f'{html.escape(_describe(data["overrides"]))}')
    lines.append(f'{html.escape(data["verdict"])}{mode}')
    lines.append(f'<small>{data.get("seconds", "?")} s, {html.escape(env.get("date (UTC)", "?"))} UTC, '
                 f'commit {html.escape(env.get("git commit", "?"))}, attnlib {html.escape(env.get("attnlib", "?"))}, '
                 f'numpy {html.escape(env.get("numpy", "?"))}</small>')
    return "<li>" + "<br>".join(lines) + "</li>"


def write_index(out_dir: Path) -> Path:
    """``index.html`` linking every report in ``out_dir`` with its verdict line.

    A notebook whose last run failed shows ERROR with the notebook, the cell and the error,
    above its previous report (if any); reports made at non-default parameters are marked.
    """
    items = [_index_item(name, nb.title, out_dir) for name, nb in NOTEBOOKS.items()]
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>attnlib reports</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 52em; margin: 2em auto; line-height: 1.5; }}
li {{ margin-bottom: 1em; }}
.pass, .fail, .info, .error, .nondefault {{ font-weight: bold; padding: 0 .4em; border-radius: 3px; color: white; }}
.pass {{ background: #2a9d8f; }} .fail, .error {{ background: #c0392b; }} .info {{ background: #6c757d; }}
.nondefault {{ background: #d35400; }} small {{ color: #555; }}
</style></head><body>
<h1>attnlib: the evidence</h1>
<p>Exact, memory-tiled attention in numpy, checked against a dense float64 reference.
Each report below was produced by running its notebook with papermill
(<code>make report</code>); its parameters and environment are stated at its top.</p>
<ul>
{chr(10).join(items)}
</ul></body></html>
"""
    index = out_dir / "index.html"
    _write_atomic(index, page)
    return index


def run(names=None, overrides=(), quick=False, out_dir=None, nb_dir=None, log=print, error=None,
        allow_nondefault_reports=False) -> int:
    """Run the selected notebooks and write their reports; returns an exit status.

    0: every notebook ran and passed its checks (or, measuring only, reported INFO);
    1: a notebook failed (its previous report is kept) or its verdict is FAIL; 2: bad
    arguments, nothing was run.

    ``log`` receives progress lines, ``error`` (default: ``log``) the errors and the FAIL
    and ERROR lines.  ``out_dir`` defaults to `REPORTS` for a run of the default notebooks
    at their defaults and to `LOCAL_REPORTS` for any other (``quick``, ``overrides`` or
    ``nb_dir``); such a run into `REPORTS` needs ``allow_nondefault_reports``.
    """
    error = error or log
    try:
        runs = _plan(names, overrides, quick, nb_dir)
    except ReportError as e:
        error(f"error: {e}")
        return 2
    other_notebooks = nb_dir is not None and Path(nb_dir).resolve() != (ROOT / "notebooks").resolve()
    nondefault = bool(quick or overrides or other_notebooks)
    if out_dir is None:
        out_dir = LOCAL_REPORTS if nondefault else REPORTS
    out_dir = Path(out_dir)
    inside_reports = out_dir.resolve() == REPORTS.resolve() or REPORTS.resolve() in out_dir.resolve().parents
    if nondefault and inside_reports and not allow_nondefault_reports:
        error(f"error: {REPORTS} holds the full runs at the notebooks' defaults; a --quick, -p or "
              f"--notebooks run writes to {LOCAL_REPORTS.name}/ (or give --out elsewhere, or add "
              "--allow-nondefault-reports to write there anyway, marked NON-DEFAULT)")
        return 2
    if nondefault:
        log(f"non-default run: reports go to {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir) as locked:
        if not locked:
            error(f"error: another report run is writing to {out_dir}; wait for it or use --out")
            return 2
        status = 0
        for i, (name, path, params, defaults) in enumerate(runs, 1):
            prefix = f"[{i}/{len(runs)}] {name}:"
            log(f"{prefix} running {path.name} ...")
            marks = ({"notebook": {"default": f"notebooks/{name}.ipynb", "actual": str(path)}}
                     if other_notebooks else None)
            ok, message = run_one(name, path, params, out_dir, defaults, marks=marks,
                                  progress=lambda line, prefix=prefix: log(f"{prefix}   {line}"))
            if not ok or message.startswith("FAIL"):
                status = 1
                error(f"{prefix} {message}")
            else:
                log(f"{prefix} {message}")
        index = write_index(out_dir)
    log(f"index: {index}")
    return status


@contextlib.contextmanager
def _locked(out_dir: Path):
    """An exclusive lock on ``out_dir/.lock`` while a run writes there; yields False when
    another run holds it (POSIX ``flock``; where that does not exist, no lock)."""
    try:
        import fcntl
    except ImportError:
        yield True
        return
    with open(out_dir / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_EPILOG = """\
output: a run of the notebooks at their defaults writes to reports/ (the committed
reports); --quick, -p or --notebooks write to reports-local/ (git-ignored) unless --out
says otherwise, and into reports/ only with --allow-nondefault-reports.  Reports made at
non-default parameters are marked NON-DEFAULT PARAMETERS in their header and the index.
A failed notebook keeps its previous report; the index shows ERROR with the notebook and
cell, and the executed notebook is kept in <out>/failed/.

Progress goes to stdout; errors and the FAIL and ERROR lines to stderr.
exit status: 0 all passed (or INFO), 1 a notebook failed or its verdict is FAIL,
2 bad arguments, a value too large for this machine (its memory, the temporary folder's
free space, or 1e16 floating-point operations per notebook), or the report extra missing
(pip install 'attnlib[report]'): nothing was run.
"""


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m attnlib report", description=__doc__.split("\n\n")[0],
                                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=list(NOTEBOOKS), metavar="NAME",
                        help=f"run only this notebook (repeatable): {', '.join(NOTEBOOKS)}")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override a parameter (KEY or NOTEBOOK.KEY); values are Python literals")
    parser.add_argument("--quick", action="store_true", help="tiny parameters, for a smoke run")
    parser.add_argument("--out", default=None,
                        help="output folder (default: reports/ at the defaults, reports-local/ otherwise)")
    parser.add_argument("--allow-nondefault-reports", action="store_true",
                        help="let a --quick, -p or --notebooks run write into reports/ (marked NON-DEFAULT)")
    parser.add_argument("--notebooks", default=None, help="notebook folder (default: notebooks/)")
    args = parser.parse_args(argv)
    return run(args.only, args.param, args.quick, args.out, args.notebooks,
               log=lambda m: print(m, flush=True),
               error=lambda m: print(m, file=sys.stderr, flush=True),
               allow_nondefault_reports=args.allow_nondefault_reports)


if __name__ == "__main__":
    sys.exit(main())
