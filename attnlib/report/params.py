"""The notebooks' parameters: the check of each (`positive`, `sizes`, ...), the runner's
record of each notebook (`Notebook`, `NOTEBOOKS`) and `check_params`, which a notebook's
second cell calls on the values of its ``parameters`` cell.

The checks live here, the defaults in the notebooks, so a bad value fails with the same
message in the notebook and in the runner (which checks before it starts anything).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..core import problem, validate
from ..core.oracle import ORACLE_PRECISION
from ..judge.sizing import dense_fits
from .costs import (
    _check_rule_costs, _equivalence_costs, _flex_gallery_costs, _gradients_costs, _memory_costs,
    _numerics_costs, _performance_costs, _rescales_costs, _scaleout_costs, check_costs)


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


def _list(name, x, what, check, increasing=False):
    """A non-empty list of ``what``, each item as ``check("name[i]", item)`` returns it;
    strictly increasing where ``increasing``."""
    if not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"parameter {name} must be a non-empty list of {what}, got {x!r}")
    values = [check(f"{name}[{i}]", v) for i, v in enumerate(x)]
    if increasing and values != sorted(set(values)):
        raise ValueError(f"parameter {name} must be strictly increasing, got {x!r}")
    return values


def sizes(name, x):
    return _list(name, x, "integers", positive, increasing=True)


def thresholds(name, x):
    """A strictly increasing list of lazy-rescale thresholds, each as `attention` accepts it."""
    def threshold(_, v):
        try:
            return validate.threshold(v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"parameter {name}: {e}") from None

    return _list(name, x, "numbers", threshold, increasing=True)


def precisions(name, x):
    """A non-empty list of distinct kernel precisions, as `check_kernel` takes them."""
    values = _list(name, x, "precisions", text)
    for v in values:
        try:
            problem.precision(v)
        except ValueError:
            raise ValueError(f"parameter {name}: {v!r} is not one of float64, float32, float16, "
                             "bfloat16") from None
    if len(set(values)) != len(values):
        raise ValueError(f"parameter {name} must not repeat a precision, got {x!r}")
    return values


def _shape_list(name, x, fields, what="shapes", causal=True):
    """A non-empty list of ``[*fields]``: positive integers, then (``causal``) a causal flag last."""
    def shape(name, s):
        if not isinstance(s, (list, tuple)) or len(s) != len(fields):
            raise ValueError(f"parameter {name} must be [{', '.join(fields)}], got {s!r}")
        dims = [positive(f"{name}[{j}]", v) for j, v in enumerate(s[:-1] if causal else s)]
        return dims + [flag(f"{name}[{len(fields) - 1}]", s[-1])] if causal else dims  # lists: papermill passes JSON

    return _list(name, x, what, shape)


def model_cases(name, x):
    """A non-empty list of ``[heads, n, block]`` (positive integers): runs of the scale-out
    cost model."""
    return _shape_list(name, x, ("heads", "n", "block"), "[heads, n, block]", causal=False)


def case_count(name, x):
    """A non-negative count of cases, clipped by its notebook to the cases there are."""
    return non_negative(name, x)


def bench_cases(name, x):
    """A non-empty list of ``[batch, heads, seqlen, headdim, causal]``: timing cases."""
    return _shape_list(name, x, ("batch", "heads", "seqlen", "headdim", "causal"))


def check_shapes(name, x):
    """A non-empty list of ``[batch, heads, seqlen_q, seqlen_k, headdim, causal]``."""
    return _shape_list(name, x, ("batch", "heads", "seqlen_q", "seqlen_k", "headdim", "causal"))


def backward_defect(name, x):
    """Empty, or the name of one of `attnlib.evidence.defects.BACKWARD_DEFECTS`."""
    from ..evidence.defects import BACKWARD_DEFECTS

    x = text(name, x)
    if x and x not in BACKWARD_DEFECTS:
        raise ValueError(f"parameter {name} must be empty or one of {sorted(BACKWARD_DEFECTS)}, got {x!r}")
    return x


def magnitudes(name, x):
    """A strictly increasing, non-empty list of positive finite numbers."""
    def magnitude(name, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
            raise ValueError(f"parameter {name} must be a positive finite number, got {v!r}")
        return float(v)

    return _list(name, x, "numbers", magnitude, increasing=True)


def power_shapes(name, x):
    """A non-empty list of ``[batch, heads, kv_heads, seqlen_q, seqlen_k, headdim, causal]``."""
    shapes = _shape_list(name, x, ("batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "headdim", "causal"))
    for i, shape in enumerate(shapes):
        if shape[1] % shape[2]:
            raise ValueError(f"parameter {name}[{i}]: heads ({shape[1]}) must be a multiple of kv_heads ({shape[2]})")
    return shapes

def check_resources(notebook: str, params: dict) -> None:
    """Refuse ``params`` (checked values) whose run cannot fit this machine: see `Cost`."""
    costs_of = NOTEBOOKS[notebook].costs
    if costs_of is not None:
        check_costs(costs_of(params), params)


@dataclass(frozen=True)
class Notebook:
    """What the runner knows of one evidence notebook (its defaults live in the notebook).

    ``parameters`` maps each parameter to its check; ``quick`` holds tiny values for
    ``--quick`` runs and the test suite; ``dense_runs`` lists ``(parameter, heads)`` pairs
    whose value is an ``n`` the dense path runs at, with that many ``(n, n)`` heads;
    ``costs`` maps the checked parameters to the notebook's stages (`Cost`), which bound
    every size-like parameter by the memory, disk and work it asks for; ``full`` holds the
    values of ``make report-full`` (``--full``: the measurements expensive by nature, into
    ``reports/full/``), empty where the defaults already are the full run.  ``alone``: the
    notebook times something (wall-clock figures), so the runner never runs another notebook
    beside it.
    """

    title: str
    parameters: dict
    quick: dict
    dense_runs: tuple = ()
    costs: object = None
    full: dict = None
    alone: bool = False

    @property
    def has_full(self) -> bool:
        return bool(self.full)


#: The performance issue's shapes, ``(B, H, S, D)`` (`attnlib.bench.SHAPES`).
_ISSUE_SHAPES = ((1, 1, 4096, 64), (1, 8, 4096, 64), (1, 4, 8192, 128), (2, 16, 2048, 128))

NOTEBOOKS = {
    "equivalence": Notebook(
        "Equivalence: tiled attention equals the dense float64 reference",
        {"n_cases": positive, "seed": non_negative, "max_len": positive, "d": positive,
         "broad_cases": positive, "broad_max_len": positive, "feature_cases": positive,
         "feature_max_len": positive, "sink_cases": positive, "sink_n": positive,
         "document_cases": positive, "document_max_len": positive, "layout_cases": positive,
         "layout_max_len": positive, "paged_pages": sizes,
         "adversarial_n": positive, "adversarial_d": positive,
         "block_q": positive, "block_k": positive, "oracle_max_n": non_negative, "results_json": text},
        {"n_cases": 6, "max_len": 300, "broad_cases": 6, "broad_max_len": 300, "feature_cases": 9,
         "feature_max_len": 256, "sink_cases": 3, "sink_n": 256, "document_cases": 2,
         "document_max_len": 512, "layout_cases": 6,
         "layout_max_len": 128, "paged_pages": [256, 2560], "adversarial_n": 256, "oracle_max_n": 256},
        # The reference holds [v, |v|] outputs and the gate a (Sq, Sk) size matrix besides.
        # The sink sweep: 4 heads of scores, and the gate's reference and sizes for them.
        (("max_len", 8), ("broad_max_len", 8), ("feature_max_len", 16), ("sink_n", 16),
         ("document_max_len", 8), ("adversarial_n", 2)),
        costs=_equivalence_costs,
        # make report-full: the values the committed full run was made at
        full={'n_cases': 50, 'seed': 0, 'max_len': 4096, 'd': 64, 'broad_cases': 50, 'broad_max_len': 4096, 'feature_cases': 50, 'feature_max_len': 2048, 'sink_cases': 12, 'sink_n': 1024, 'document_cases': 12, 'document_max_len': 4096, 'layout_cases': 12, 'layout_max_len': 1024, 'paged_pages': [256, 2560, 25600], 'adversarial_n': 4096, 'adversarial_d': 64, 'block_q': 64, 'block_k': 64, 'oracle_max_n': 4096}),
    "rescales": Notebook(
        "Rescales: where the online softmax's running max grows",
        {"n": positive, "d": positive, "block_q": positive, "block_k": positive,
         "causal": flag, "seed": non_negative, "dense_check_max_n": non_negative,
         "results_json": text},
        {"n": 256, "block_q": 32, "block_k": 32},
        (("dense_check_max_n", 1),), costs=_rescales_costs),
    "memory": Notebook(
        "Memory: the tiled kernel streams in near-constant working memory",
        {"n": positive, "d": positive, "causal": flag, "sweep": sizes,
         "dense_max_n": positive, "interval_s": seconds, "decode_keys": positive,
         "decode_queries": sizes, "results_json": text},
        {"n": 2048, "sweep": [512, 1024, 2048], "dense_max_n": 2048,
         "decode_keys": 262144, "decode_queries": [1]},
        (("n", 1), ("dense_max_n", 1)), costs=_memory_costs,
        # make report-full: the values the committed full run was made at
        full={'n': 4096, 'd': 64, 'causal': True, 'sweep': [1024, 2048, 4096, 8192, 16384, 32768, 65536], 'dense_max_n': 8192, 'interval_s': 0.002, 'decode_keys': 1048576, 'decode_queries': [1, 8, 128]}),
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
         "torch_max_n": positive, "cases": bench_cases, "dense_cases": case_count,
         "backward_cases": bench_cases, "mask_n": positive, "flex": flag, "mask_memory": flag,
         "mask_memory_cases": non_negative, "sweep_sizes": sizes, "device": text,
         "device_cases": bench_cases, "device_memory_ns": sizes, "results_json": text},
        {"repeats": 1, "n_values": [256, 512, 1024], "dense_max_n": 512, "torch_max_n": 512,
         "cases": [[1, 1, 1024, 64, True], [1, 2, 1024, 64, True], [1, 1, 1024, 64, False]],
         "dense_cases": 3, "backward_cases": [[1, 1, 1024, 64, True]], "mask_n": 512, "flex": True,
         "mask_memory_cases": 1, "sweep_sizes": [64, 128],
         "device_cases": [[1, 1, 256, 16, True], [1, 2, 256, 16, True], [1, 1, 256, 16, False],
                          [1, 2, 256, 16, False]], "device_memory_ns": [1024]},
        (("dense_max_n", 1),), costs=_performance_costs, alone=True,
        # make report-full: the values the committed full run was made at
        # (full_cases=True then: the issue's 8 cases, its 4 backward cases, SHAPES on the device)
        full={'workers': [1], 'repeats': 5, 'n_values': [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536], 'dense_max_n': 8192, 'torch_max_n': 16384,
              'cases': [[b, h, n, d, c] for c in (True, False) for b, h, n, d in _ISSUE_SHAPES], 'dense_cases': 8,
              'backward_cases': [[b, h, n, d, True] for b, h, n, d in _ISSUE_SHAPES], 'mask_n': 16384, 'flex': True,
              'mask_memory': True, 'mask_memory_cases': 4, 'sweep_sizes': [128, 256, 512], 'device': 'cuda',
              'device_cases': [[b, h, n, d, c] for c in (True, False) for b, h, n, d in _ISSUE_SHAPES],
              'device_memory_ns': [2048, 8192, 32768]}),
    "numerics": Notebook(
        "Numerics: float64 and low precisions against an extended-precision oracle; lazy rescaling",
        {"ns": sizes, "ds": sizes, "logit_stds": sizes, "precision_n": positive, "blocks": sizes,
         "precision_ns": sizes, "taus": thresholds, "lazy_n": positive, "seed": non_negative,
         "results_json": text},
        {"ns": [128, 256], "ds": [32], "logit_stds": [1, 10], "precision_n": 256,
         "precision_ns": [64, 128], "blocks": [32, 64], "taus": [0, 8], "lazy_n": 256},
        # its dense runs are bounded by the oracle's sizes (check_params)
        costs=_numerics_costs,
        # make report-full: the values the committed full run was made at
        full={'ns': [256, 512, 1024, 2048], 'ds': [32, 64, 128], 'logit_stds': [1, 10, 100], 'precision_n': 1024, 'precision_ns': [256, 1024, 4096], 'blocks': [32, 64, 128, 256], 'taus': [0, 1, 2, 4, 8, 16], 'lazy_n': 1024, 'seed': 0}),
    "scaleout": Notebook(
        "Scale-out: the float64 oracle on a Dask cluster",
        {"n": positive, "heads": positive, "d": positive, "block": positive, "workers": sizes,
         "repeats": positive, "sweep": sizes, "model_fit": model_cases, "model_heldout": model_cases,
         "model_repeats": positive, "long_n": positive, "long_block": positive, "long_repeats": positive,
         "long_samples": positive, "scheduler_batches": positive, "scheduler_tasks": positive, "project_n": positive, "project_heads": positive, "project_d": positive,
         "project_machines": sizes, "project_cores": positive, "project_block": positive,
         "results_json": text},
        {"n": 1024, "heads": 2, "d": 64, "block": 256, "repeats": 1, "sweep": [1024, 4096],
         "model_fit": [[1, 1024, 128], [1, 2048, 256], [1, 2048, 128], [1, 1024, 256]],
         "model_heldout": [[2, 1024, 256]],
         # long_n: a worker's RSS steps up ~8 MiB once between n = 8192 and 16384 at block 2048, then
         # stays flat (+2 MiB to 65536; measured, 2 workers): at 16384 that step met the 6 MiB bound;
         # 32768 bounds it by 14.7 MiB, in a quarter of 65536's 87 s.
         "model_repeats": 1, "long_n": 32768, "long_block": 2048, "long_repeats": 1, "long_samples": 2,
         "scheduler_batches": 3, "scheduler_tasks": 200, "project_n": 262144},
        costs=_scaleout_costs, alone=True,
        # make report-full: the values the committed full run was made at
        full={'n': 16384, 'heads': 4, 'd': 64, 'block': 4096, 'workers': [1, 2], 'repeats': 7, 'sweep': [8192, 16384, 32768, 65536], 'model_fit': [[1, 8192, 1024], [1, 8192, 2048], [1, 8192, 4096], [2, 8192, 2048], [1, 16384, 1024], [1, 16384, 2048], [1, 16384, 4096]], 'model_heldout': [[1, 32768, 4096], [2, 16384, 2048], [4, 16384, 4096]], 'model_repeats': 4, 'long_n': 262144, 'long_block': 4096, 'long_repeats': 1, 'long_samples': 3, 'scheduler_batches': 5, 'scheduler_tasks': 500, 'project_n': 1048576, 'project_heads': 32, 'project_d': 128, 'project_machines': [1, 8, 64, 512], 'project_cores': 32, 'project_block': 8192}),
    "flex_gallery": Notebook(
        "Programmable attention: a gallery of FlexAttention masks and scores against the float64 reference",
        {"n": positive, "heads": positive, "d": positive, "block": positive, "repeats": positive,
         "memory_entries": non_negative, "long_ns": sizes, "results_json": text},
        {"n": 256, "heads": 2, "d": 16, "block": 64, "repeats": 1, "memory_entries": 1,
         "long_ns": [1024, 4096]},
        # The dense reference, P @ |V| and the gate's sizes for every head, and the dense
        # mask count; FlexAttention eager holds n x n scores per head as well.
        (("n", 16),), costs=_flex_gallery_costs, alone=True,  # times attnlib against FlexAttention eager
        # make report-full: the values the committed full run was made at
        full={'n': 2048, 'heads': 4, 'd': 64, 'block': 128, 'repeats': 3, 'memory_entries': 10, 'long_ns': [8192, 32768]}),
    "check_rule": Notebook(
        "Check rule: correct kernels pass, buggy kernels fail",
        {"n_seeds": positive, "precisions": precisions, "shapes": check_shapes,
         "power_magnitudes": magnitudes, "power_shapes": power_shapes, "power_seeds": positive,
         "long_gradient_n": positive, "mixup_magnitudes": magnitudes, "mixup_seeds": positive,
         "space_problems": positive, "space_seed": non_negative, "space_jsonl": text, "dropout_runs": positive,
         "results_json": text},
        {"n_seeds": 1, "precisions": ["float64", "float32"],
         "shapes": [[1, 2, 64, 64, 32, True], [2, 2, 1, 300, 32, False]],
         "power_magnitudes": [1e-4, 1.0], "power_shapes": [[1, 4, 2, 64, 64, 32, True]], "power_seeds": 1,
         "long_gradient_n": 512, "mixup_magnitudes": [1.0], "mixup_seeds": 1, "space_problems": 8, "dropout_runs": 100},
        costs=_check_rule_costs,
        # make report-full: the values the committed full run was made at
        full={'n_seeds': 5, 'precisions': ['float64', 'float32', 'bfloat16', 'float16'], 'shapes': [[1, 1, 128, 128, 64, True], [2, 4, 512, 512, 64, True], [1, 4, 512, 512, 128, False], [4, 8, 1, 4096, 128, False], [8, 16, 1, 1024, 128, True]], 'power_magnitudes': [1e-06, 0.0001, 0.01, 1.0, 100.0, 10000.0], 'power_shapes': [[1, 4, 2, 384, 384, 64, True], [2, 4, 4, 1, 1024, 64, False]], 'power_seeds': 1, 'long_gradient_n': 8192, 'mixup_magnitudes': [0.01, 1.0, 100.0], 'mixup_seeds': 2,
              'space_problems': 2700, 'space_jsonl': 'reports-local/check_rule_space.jsonl', 'dropout_runs': 10000}),
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

