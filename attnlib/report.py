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
"""

from __future__ import annotations

import ast
import datetime as _dt
import html
import json
import math
import numbers
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import __version__, _args
from .memory import dense_fits
from .oracle import ORACLE_PRECISION
from .plots import Table

ROOT = Path(__file__).resolve().parent.parent


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


@dataclass(frozen=True)
class Notebook:
    """What the runner knows of one evidence notebook (its defaults live in the notebook).

    ``parameters`` maps each parameter to its check; ``quick`` holds tiny values for
    ``--quick`` runs and the test suite; ``dense_runs`` lists ``(parameter, heads)`` pairs
    whose value is an ``n`` the dense path runs at, with that many ``(n, n)`` heads.
    """

    title: str
    parameters: dict
    quick: dict
    dense_runs: tuple = ()


NOTEBOOKS = {
    "equivalence": Notebook(
        "Equivalence: tiled attention equals the dense float64 reference",
        {"n_cases": positive, "seed": non_negative, "max_len": positive,
         "adversarial_n": positive, "adversarial_d": positive,
         "block_q": positive, "block_k": positive, "results_json": text},
        {"n_cases": 6, "max_len": 300, "adversarial_n": 256},
        (("max_len", 4), ("adversarial_n", 1))),
    "rescales": Notebook(
        "Rescales: where the online softmax's running max grows",
        {"n": positive, "d": positive, "block_q": positive, "block_k": positive,
         "causal": flag, "seed": non_negative, "dense_check_max_n": non_negative,
         "results_json": text},
        {"n": 256, "block_q": 32, "block_k": 32},
        (("dense_check_max_n", 1),)),
    "memory": Notebook(
        "Memory: the tiled kernel streams in constant working memory",
        {"n": positive, "d": positive, "causal": flag, "sweep": sizes,
         "dense_max_n": positive, "interval_s": seconds, "decode_keys": positive,
         "decode_queries": sizes, "results_json": text},
        {"n": 2048, "sweep": [512, 1024, 2048], "dense_max_n": 2048,
         "decode_keys": 65536, "decode_queries": [1, 16]},
        (("dense_max_n", 1),)),
    "gradients": Notebook(
        "Gradients: the tiled backward pass equals the dense float64 gradient",
        {"n_cases": positive, "seed": non_negative, "max_len": positive,
         "adversarial_n": positive, "adversarial_d": positive, "block_q": positive,
         "block_k": positive, "sweep": sizes, "dense_max_n": positive, "results_json": text},
        {"n_cases": 5, "max_len": 256, "adversarial_n": 256, "sweep": [1024, 2048],
         "dense_max_n": 2048},
        # The dense gradient holds about twice the forward's (Sq, Sk) arrays.
        (("max_len", 8), ("adversarial_n", 2), ("dense_max_n", 2))),
    "performance": Notebook(
        "Performance: the tiled kernel against dense numpy and PyTorch SDPA",
        {"workers": sizes, "repeats": positive, "n_values": sizes, "dense_max_n": positive,
         "torch_max_n": positive, "full_cases": flag, "sweep_sizes": sizes, "results_json": text},
        {"repeats": 1, "n_values": [256, 512, 1024], "dense_max_n": 512,
         "torch_max_n": 512, "full_cases": False, "sweep_sizes": [64, 128]},
        (("dense_max_n", 1),)),
    "numerics": Notebook(
        "Numerics: float64 and low precisions against an extended-precision oracle; lazy rescaling",
        {"ns": sizes, "ds": sizes, "logit_stds": sizes, "precision_n": positive, "blocks": sizes,
         "precision_ns": sizes, "taus": thresholds, "lazy_n": positive, "seed": non_negative,
         "results_json": text},
        {"ns": [128, 256], "ds": [32], "logit_stds": [1, 10], "precision_n": 256,
         "precision_ns": [64, 128], "blocks": [32, 64], "taus": [0, 8], "lazy_n": 256}),
        # its dense runs are bounded by the oracle's sizes (check_params)
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
    if notebook == "numerics":
        if max(params["ns"] + params["precision_ns"] + [params["precision_n"], params["lazy_n"]]) > 4096:
            raise ValueError("the long-double oracle has no BLAS: keep ns, precision_ns, precision_n "
                             "and lazy_n <= 4096")
        if ORACLE_PRECISION["method"] != "longdouble":
            raise ValueError("the numerics report needs a long double of >= 64 mantissa bits, which "
                             "this platform's numpy lacks (the decimal oracle takes small shapes only)")
    if notebook in ("memory", "gradients") and params["dense_max_n"] > params["sweep"][-1]:
        raise ValueError("parameter dense_max_n must not exceed the largest sweep size")
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
        "date (UTC)": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
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

    @property
    def label(self) -> str:
        return {True: "PASS", False: "FAIL", None: "INFO"}[self.passed]

    def _repr_markdown_(self):
        return f"**{self.label}**: {self.line}"


def save_results(results_json: str, notebook: str, params: dict, passed, line: str,
                 figures: dict) -> Verdict:
    """Write a notebook's figures and verdict as JSON (when ``results_json`` is set)."""
    verdict = Verdict(None if passed is None else bool(passed), line)
    if results_json:
        data = {"notebook": notebook, "passed": verdict.passed, "verdict": line,
                "params": params, "environment": environment(), "figures": figures}
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


def _parse_value(raw: str):
    lowered = {"true": True, "false": False}.get(raw.strip().lower())
    if lowered is not None:
        return lowered
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def _notebook_defaults(path: Path) -> dict:
    import papermill

    declared = papermill.inspect_notebook(str(path))
    return {name: ast.literal_eval(p["default"]) for name, p in declared.items()}


def plan(names=None, overrides=(), quick=False, nb_dir=None) -> list[tuple[str, Path, dict]]:
    """Check everything before running: ``[(name, notebook path, parameters), ...]``.

    ``overrides`` are ``"key=value"`` (every selected notebook that declares ``key``) or
    ``"notebook.key=value"`` strings; a key no selected notebook declares is refused.
    """
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
        runs.append((name, path, params))
    return runs


def _failed_cell(executed: Path) -> str:
    """``cell N ('first line')`` of the failing cell, N counted in the stored notebook."""
    import nbformat

    added = {"injected-parameters", "papermill-error-cell-tag"}  # cells papermill inserts
    nb = nbformat.read(str(executed), as_version=4)
    cells = [c for c in nb.cells if not added & set(c.metadata.get("tags", []))]
    for index, cell in enumerate(cells):
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
            return f"cell {index} ({first!r})"
    return "an unknown cell"


def render_html(executed: Path, target: Path) -> None:
    """Executed notebook -> self-contained HTML, written atomically (tmp file + rename)."""
    import nbformat
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="offline",
                            extra_template_basedirs=[str(Path(__file__).parent / "templates")])
    body, _ = exporter.from_notebook_node(nbformat.read(str(executed), as_version=4))
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(body, encoding="utf-8")
    os.replace(tmp, target)


def execute(path: Path, params: dict, target: Path) -> dict:
    """Run one notebook with papermill and render it to ``target``; returns its results JSON.

    ``results_json`` is added to ``params`` (a temporary file the notebook writes).  Raises
    `ReportError` naming the failed cell, or when the notebook wrote no results; ``target``
    is then left as it was.
    """
    import papermill

    with tempfile.TemporaryDirectory(prefix=f"attnlib-{path.stem}-") as tmp:
        executed = Path(tmp) / path.name
        results = Path(tmp) / f"{path.stem}.json"
        try:
            papermill.execute_notebook(
                str(path), str(executed), parameters={**params, "results_json": str(results)},
                kernel_name="python3", progress_bar=False, cwd=str(path.parent),
            )
        except papermill.PapermillExecutionError as e:
            raise ReportError(f"{path.name} failed in {_failed_cell(executed)}: {e.ename}: {e.evalue}") from None
        if not results.exists():
            raise ReportError(f"{path.name} ran but wrote no results JSON")
        data = json.loads(results.read_text())
        render_html(executed, target)
    return data


def run_one(name: str, path: Path, params: dict, out_dir: Path) -> tuple[bool, str]:
    """Execute one notebook and render it; the previous report stays unless this succeeds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        data = execute(path, params, out_dir / f"{name}.html")
    except ReportError as e:
        return False, str(e)
    elapsed = time.perf_counter() - started
    data["seconds"] = round(elapsed, 1)
    data["params"] = {**data["params"], "results_json": ""}
    json_tmp = out_dir / f"{name}.json.tmp"
    json_tmp.write_text(json.dumps(data, indent=1))
    os.replace(json_tmp, out_dir / f"{name}.json")
    label = Verdict(data["passed"], data["verdict"]).label
    return True, f"{label}: {data['verdict']} ({elapsed:.1f} s)"


def write_index(out_dir: Path) -> Path:
    """``index.html`` linking every report in ``out_dir`` with its verdict line."""
    items = []
    for name, title in ((n, nb.title) for n, nb in NOTEBOOKS.items()):
        results = out_dir / f"{name}.json"
        if not (out_dir / f"{name}.html").exists() or not results.exists():
            items.append(f"<li><b>{html.escape(title)}</b>: not run yet</li>")
            continue
        data = json.loads(results.read_text())
        env = data.get("environment", {})
        badge = Verdict(data["passed"], data["verdict"]).label.lower()
        items.append(
            f'<li><span class="{badge}">{badge.upper()}</span> '
            f'<a href="{name}.html">{html.escape(title)}</a><br>'
            f'{html.escape(data["verdict"])}<br><small>{data.get("seconds", "?")} s, '
            f'{html.escape(env.get("date (UTC)", "?"))} UTC, commit {html.escape(env.get("git commit", "?"))}, '
            f'attnlib {html.escape(env.get("attnlib", "?"))}, numpy {html.escape(env.get("numpy", "?"))}</small></li>')
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>attnlib reports</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 52em; margin: 2em auto; line-height: 1.5; }}
li {{ margin-bottom: 1em; }} .pass, .fail, .info {{ font-weight: bold; padding: 0 .4em; border-radius: 3px; color: white; }}
.pass {{ background: #2a9d8f; }} .fail {{ background: #c0392b; }} .info {{ background: #6c757d; }} small {{ color: #555; }}
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
    tmp = out_dir / "index.html.tmp"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, index)
    return index


def run(names=None, overrides=(), quick=False, out_dir=None, nb_dir=None, log=print) -> int:
    """Run the selected notebooks and write their reports; returns an exit status.

    0: every notebook ran and passed its checks (or, measuring only, reported INFO);
    1: a notebook failed (its previous report is kept) or its verdict is FAIL; 2: bad
    arguments, nothing was run.
    """
    out_dir = Path(out_dir) if out_dir else ROOT / "reports"
    try:
        runs = plan(names, overrides, quick, nb_dir)
    except ReportError as e:
        log(f"error: {e}")
        return 2
    status = 0
    for i, (name, path, params) in enumerate(runs, 1):
        log(f"[{i}/{len(runs)}] {name}: running {path.name} ...")
        ok, message = run_one(name, path, params, out_dir)
        log(f"[{i}/{len(runs)}] {name}: {message}")
        if not ok or message.startswith("FAIL"):
            status = 1
    index = write_index(out_dir)
    log(f"index: {index}")
    return status


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m attnlib report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=list(NOTEBOOKS), metavar="NAME",
                        help=f"run only this notebook (repeatable): {', '.join(NOTEBOOKS)}")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override a parameter (KEY or NOTEBOOK.KEY); values are Python literals")
    parser.add_argument("--quick", action="store_true", help="tiny parameters, for a smoke run")
    parser.add_argument("--out", default=None, help="output folder (default: reports/)")
    parser.add_argument("--notebooks", default=None, help="notebook folder (default: notebooks/)")
    args = parser.parse_args(argv)
    return run(args.only, args.param, args.quick, args.out, args.notebooks,
               log=lambda m: print(m, flush=True))


if __name__ == "__main__":
    sys.exit(main())
