"""Running the notebooks: the plan (every parameter checked before anything starts),
papermill and its kernel, the progress pump, one notebook's run (`execute`, `run_one`) and
a whole run (`run`) under a lock on its output folder.

A report is replaced only when its notebook ran to the end; a notebook that fails keeps its
previous report, and ``<out>/<name>.status.json`` and ``<out>/failed/<name>.ipynb`` record
why (see the package's docstring).
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import json
import logging
import numbers
import os
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

from ..core import validate

from .costs import _importable
from .notebook import PROGRESS_ENV, ROOT, Verdict, _now
from .params import NOTEBOOKS, check_params
from .render import FULL, _banner, _load, _write_json, render_html, write_index

REPORTS = ROOT / "reports"  # the committed runs at the notebooks' defaults (`make report`)
FULL_REPORTS = REPORTS / FULL  # the committed --full runs (`make report-full`)
LOCAL_REPORTS = ROOT / "reports-local"  # git-ignored: --quick and -p runs


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
    return [name for name in REPORT_MODULES if not _importable(name)]


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


def plan(names=None, overrides=(), quick=False, nb_dir=None, full=False) -> list[tuple[str, Path, dict]]:
    """Check everything before running: ``[(name, notebook path, parameters), ...]``.

    ``overrides`` are ``"key=value"`` (every selected notebook that declares ``key``) or
    ``"notebook.key=value"`` strings; a key no selected notebook declares is refused.
    ``full``: the notebooks' ``full`` values (`Notebook.full`), only those that have them
    unless ``names`` asks for others.
    """
    return [(name, path, params) for name, path, params, _ in _plan(names, overrides, quick, nb_dir, full)]


def _plan(names, overrides, quick, nb_dir, full=False) -> list[tuple[str, Path, dict, dict]]:
    """`plan`, with each notebook's reference values (its declared defaults, with its ``full``
    values over them in a full run) as a fourth item."""
    missing = missing_report_modules()
    if missing:  # nothing can run: one line naming the extra, not a traceback
        raise _needs_report_extra(missing)
    if quick and full:
        raise ReportError("--quick and --full exclude each other")
    nb_dir = Path(nb_dir) if nb_dir else ROOT / "notebooks"
    names = ([n for n, nb in NOTEBOOKS.items() if nb.has_full or not full] if not names else list(names))
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
        if full:  # the full run's values are its reference: not marked non-default
            defaults = {**defaults, **(NOTEBOOKS[name].full or {})}
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
                    kernel_name="python3", progress_bar=False, cwd=str(path.parent), **_kernel_options())
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
        render_html(executed, target, banner, data)
    return data

def _overrides(params: dict, defaults: dict | None, marks: dict | None) -> dict:
    return {**overridden(params, defaults or {}), **(marks or {})}


def _record_error(out_dir: Path, name: str, params: dict, overrides: dict, e: NotebookError) -> str:
    """``<name>.status.json`` for a notebook that did not run to the end (the index shows it as
    ERROR over the previous report); returns the runner's ERROR line."""
    _write_json(out_dir / f"{name}.status.json", {
        "notebook": e.notebook, "status": "ERROR", "cell": e.cell, "error": e.error,
        "kernel_died": e.dead, "executed": str(e.executed) if e.executed else None,
        "date (UTC)": _now(), "params": {**params, "results_json": ""},
        "default_params": not overrides, "overrides": overrides})
    kept_line = f"; the executed notebook is kept in {e.executed}" if e.executed else ""
    return f"ERROR: {e}{kept_line}"


def run_one(name: str, path: Path, params: dict, out_dir: Path, defaults: dict | None = None,
            progress=None, marks: dict | None = None, tidy: bool = True) -> tuple[bool, str]:
    """Execute one notebook and render it; the previous report stays unless this succeeds.

    Returns ``(ran, message)``.  On success the results JSON records ``default_params`` and
    ``overrides`` against ``defaults`` (the notebook's declared values; None: not known, taken
    as default) and any error marker of an earlier run is cleared.  On failure
    ``<name>.status.json`` records the error and ``failed/<name>.ipynb`` keeps the executed
    notebook.  ``marks`` are further ``{name: {"default": ..., "actual": ...}}`` entries that
    make the run non-default (e.g. a notebook from another folder).  ``tidy``: remove an
    empty ``failed/`` after a success (not while another notebook may be writing there).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    overrides = _overrides(params, defaults, marks)
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
        return False, _record_error(out_dir, name, params, overrides, e)
    elapsed = time.perf_counter() - started
    data["seconds"] = round(elapsed, 1)
    data["params"] = {**data["params"], "results_json": ""}
    data["default_params"], data["overrides"] = not overrides, overrides
    _write_json(out_dir / f"{name}.json", data)
    status_file.unlink(missing_ok=True)
    kept.unlink(missing_ok=True)
    if tidy:
        with contextlib.suppress(OSError):  # only when empty
            kept.parent.rmdir()
    label = Verdict(data["passed"], data["verdict"]).label
    marker = f" [NON-DEFAULT PARAMETERS: {', '.join(overrides)}]" if overrides else ""
    return True, f"{label}: {data['verdict']} ({elapsed:.1f} s){marker}"

#: At most this many notebooks run side by side by default (`default_jobs`): the runner lets
#: one notebook hold up to half the machine's memory (`~attnlib.report.costs.check_costs`).
MAX_JOBS = 2

#: The thread counts a side-by-side notebook's kernel (and its BLAS, OpenMP and torch) starts with.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def default_jobs() -> int:
    """Notebooks side by side by default: one per CPU this process may use, at most `MAX_JOBS`."""
    return min(MAX_JOBS, validate.available_cpus())


class _Run(NamedTuple):
    """One planned notebook run: its log prefix and `run_one`'s arguments."""
    prefix: str
    name: str
    path: Path
    params: dict
    defaults: dict
    marks: dict | None

    @property
    def overrides(self) -> dict:
        return _overrides(self.params, self.defaults, self.marks)


def _run_here(r: _Run, out_dir: Path, log) -> tuple[bool, str]:
    log(f"{r.prefix} running {r.path.name} ...")
    return run_one(r.name, r.path, r.params, out_dir, r.defaults, marks=r.marks,
                   progress=lambda line: log(f"{r.prefix}   {line}"))


def _cpu_shares(jobs: int) -> list[list[int]]:
    """This process's CPUs dealt into ``jobs`` disjoint shares (empty where the OS does not
    say which CPUs a process may use, or there are fewer CPUs than jobs)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return [[] for _ in range(jobs)]
    return [cpus[s::jobs] if len(cpus) >= jobs else [] for s in range(jobs)]


def _child(channel, cpus: list[int], r: _Run, out_dir: Path) -> None:
    """A side-by-side notebook's process: pinned to ``cpus`` (which its kernel inherits, so the
    kernels' default thread count is the share's), with as many BLAS and OpenMP threads; sends
    ``("log", line)`` messages, then one ``("done", ran, message)``, on ``channel``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    for variable in THREAD_VARIABLES:
        os.environ[variable] = str(max(1, len(cpus)))
    where = f"on CPU {','.join(map(str, cpus))}" if cpus else "unpinned, one BLAS thread"
    channel.send(("log", f"{r.prefix} running {r.path.name} {where} ..."))
    try:
        ok, message = run_one(r.name, r.path, r.params, out_dir, r.defaults, marks=r.marks, tidy=False,
                              progress=lambda line: channel.send(("log", f"{r.prefix}   {line}")))
    except BaseException as e:  # recorded as the notebook's error, never lost with the process
        error = NotebookError(r.path.name, "", f"{type(e).__name__}: {e}".rstrip(": "))
        ok, message = False, _record_error(out_dir, r.name, r.params, r.overrides, error)
    channel.send(("done", ok, message))
    channel.close()


def _last_seconds(out_dir: Path, name: str) -> float:
    """How long ``name`` took when it last wrote into ``out_dir`` (infinity: never)."""
    try:
        return float(_load(out_dir, name)[0]["seconds"])
    except (OSError, ValueError, KeyError, TypeError):  # TypeError: no report there
        return float("inf")


def _side_by_side(runs: list[_Run], out_dir: Path, jobs: int, log):
    """Runs ``runs`` up to ``jobs`` at a time, each in a process of its own on its share of the
    CPUs (`_cpu_shares`), the longest (by the previous report's time) first; yields
    ``(run, ran, message)`` as each ends, as `run_one` returns them.  Each process has a pipe
    of its own, and its end is seen at once (its sentinel): a process that ends without its
    "done" (killed) is its notebook's ERROR, recorded like any other."""
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    shares = _cpu_shares(jobs)
    pending = sorted(runs, key=lambda r: -_last_seconds(out_dir, r.name))
    running = {}  # slot -> (process, its pipe's reading end, run)
    try:
        while pending or running:
            for slot in range(jobs):
                if slot not in running and pending:
                    r = pending.pop(0)
                    receive, send = context.Pipe(duplex=False)
                    process = context.Process(target=_child, args=(send, shares[slot], r, out_dir),
                                              name=f"attnlib-report-{r.name}")
                    process.start()
                    send.close()  # the child holds the writing end: its exit closes the pipe
                    running[slot] = (process, receive, r)
            wait([c for _, c, _ in running.values()] + [p.sentinel for p, _, _ in running.values()])
            for slot, (process, receive, r) in list(running.items()):
                done, ended = None, False
                while receive.poll():
                    try:
                        kind, *rest = receive.recv()
                    except (EOFError, OSError):  # the process is gone (or died mid-message)
                        ended = True
                        break
                    if kind == "log":
                        log(rest[0])
                    else:
                        done = rest
                if done is None and not ended and process.is_alive():
                    continue
                del running[slot]
                receive.close()
                process.join(timeout=60)
                if process.is_alive():
                    process.terminate()
                    process.join()
                if done is None:
                    error = NotebookError(r.path.name, "", f"the process running it ended with exit code "
                                                           f"{process.exitcode} before the notebook did (killed?)",
                                          dead=True)
                    done = (False, _record_error(out_dir, r.name, r.params, r.overrides, error))
                yield (r, *done)
    finally:
        for process, receive, _ in running.values():
            process.terminate()
            process.join()
            receive.close()


def run(names=None, overrides=(), quick=False, out_dir=None, nb_dir=None, log=print, error=None,
        allow_nondefault_reports=False, full=False, jobs=1) -> int:
    """Run the selected notebooks and write their reports; returns an exit status.

    0: every notebook ran and passed its checks (or, measuring only, reported INFO);
    1: a notebook failed (its previous report is kept) or its verdict is FAIL; 2: bad
    arguments, nothing was run.

    ``log`` receives progress lines, ``error`` (default: ``log``) the errors and the FAIL
    and ERROR lines.  ``out_dir`` defaults to `REPORTS` for a run of the default notebooks
    at their defaults, to `FULL_REPORTS` for a ``full`` one, and to `LOCAL_REPORTS` for any
    other (``quick``, ``overrides`` or ``nb_dir``); such a run into `REPORTS` needs
    ``allow_nondefault_reports``.

    ``jobs`` > 1 runs the notebooks that time nothing up to ``jobs`` at a time (`_side_by_side`),
    then those that do (`Notebook.alone`) one by one; `default_jobs` is the command line's.
    """
    error = error or log
    if isinstance(jobs, bool) or not isinstance(jobs, numbers.Integral) or jobs < 1:
        error(f"error: jobs must be a positive integer, got {jobs!r}")
        return 2
    try:
        runs = _plan(names, overrides, quick, nb_dir, full)
    except ReportError as e:
        error(f"error: {e}")
        return 2
    other_notebooks = nb_dir is not None and Path(nb_dir).resolve() != (ROOT / "notebooks").resolve()
    nondefault = bool(quick or overrides or other_notebooks)
    if out_dir is None:
        out_dir = LOCAL_REPORTS if nondefault else REPORTS / FULL if full else REPORTS
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
        numbered = [_Run(f"[{i}/{len(runs)}] {name}:", name, path, params, defaults,
                         {"notebook": {"default": f"notebooks/{name}.ipynb", "actual": str(path)}}
                         if other_notebooks else None)
                    for i, (name, path, params, defaults) in enumerate(runs, 1)]
        beside = [r for r in numbered if not NOTEBOOKS[r.name].alone] if jobs > 1 else []
        if len(beside) < 2:
            beside = []
        if beside:
            alone = [r.name for r in numbered if r not in beside]
            shared = (f"each on its share of this process's {validate.available_cpus()} CPUs"
                      if all(_cpu_shares(jobs)) else "unpinned (fewer CPUs than jobs), one BLAS thread each")
            log(f"{len(beside)} notebooks run up to {min(jobs, len(beside))} at a time, {shared}" + (
                    f"; then, alone (they time things): {', '.join(alone)}" if alone else ""))
        outcomes = _side_by_side(beside, out_dir, jobs, log)
        with contextlib.closing(outcomes):  # its processes end with it, whatever stops the loop
            for r, ok, message in itertools.chain(outcomes, ((r, *_run_here(r, out_dir, log))
                                                              for r in numbered if r not in beside)):
                if not ok or message.startswith("FAIL"):
                    status = 1
                    error(f"{r.prefix} {message}")
                else:
                    log(f"{r.prefix} {message}")
        if beside:
            with contextlib.suppress(OSError):  # only when empty: what `run_one` leaves while others run
                (out_dir.resolve() / "failed").rmdir()
        index = write_index(out_dir)
        if out_dir.resolve() == (REPORTS / FULL).resolve():  # the main index links the full runs
            write_index(REPORTS)
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

