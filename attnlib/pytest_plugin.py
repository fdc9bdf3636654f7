"""attnlib's pytest plugin: the kernel verdicts of a test run gathered into one report.

Registered as a ``pytest11`` entry point, so on wherever attnlib is installed, and silent
until one of its options is given:

- ``--attnlib-report DIR``: every verdict `attnlib.testing.assert_attention_close` makes
  during the run, passing or failing (and any `attnlib.testing.record`), one row each under
  its test's id, into ``DIR/pytest_report.json``, rendered at the end into
  ``DIR/pytest_report.html`` by the packaged notebook ``attnlib/pytest_report.ipynb``
  (papermill and nbconvert: ``pip install 'attnlib[report]'``; without them a warning, and
  the JSON still).  Under pytest-xdist each worker writes its rows into ``DIR`` and the
  controller merges and renders them.
- ``--attnlib-device DEVICE``: the torch device the float64 reference runs on when an
  assert gives no ``device=`` (``cpu``, ``cuda``, ``cuda:1``).
- the fixture ``attnlib_case``: each test that takes it runs once per shape of `CASES`
  (decode and prefill, GQA, head dims 64 and 128); ``attnlib_case.qkv()`` gives its
  seeded inputs.  Other shapes: ``@pytest.mark.parametrize("attnlib_case", [Case(...) or a
  name], indirect=True)``.

A report that cannot be rendered is a warning: it never changes the run's outcome.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

#: The packaged notebook that renders the report (package data).
NOTEBOOK = Path(__file__).with_name("pytest_report.ipynb")
#: ``DIR/<REPORT>.json`` holds the rows, ``DIR/<REPORT>.html`` the report.
REPORT = NOTEBOOK.stem
#: What rendering imports (the report extra's, less memory_profiler).
RENDER_MODULES = ("papermill", "nbformat", "nbconvert", "ipykernel", "matplotlib")
#: A failure's error maps keep at most this many query-position columns (the max of each
#: group, as `attnlib.evidence.plots.kernel_error_heatmap` bins them).
MAP_COLUMNS = 512


@dataclass(frozen=True)
class Case:
    """One attention shape for a kernel's tests; `qkv` makes its seeded inputs."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty string, got {self.name!r}")
        for field in ("batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim", "seed"):
            x = getattr(self, field)
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"{field} must be an int, got {x!r}")
            if x < (0 if field == "seed" else 1):
                raise ValueError(f"{field} must be {'>= 0' if field == 'seed' else '>= 1'}, got {x}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    def qkv(self, dtype="float32", layout="bshd", device=None):
        """Standard normal ``q, k, v`` (`attnlib.random_qkv` at ``seed``) rounded to ``dtype``:
        numpy arrays, or torch tensors on ``device`` when given.  ``layout="bshd"``:
        ``(batch, seqlen, heads, head_dim)``, FlashAttention's and `assert_attention_close`'s
        default; ``"bhsd"``: PyTorch SDPA's."""
        import numpy as np

        from .evidence.inputs import random_qkv

        if layout not in ("bshd", "bhsd"):
            raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
        qkv = random_qkv(self.seqlen_q, self.seqlen_k, self.head_dim, batch=(self.batch,), heads=self.heads,
                         kv_heads=self.kv_heads, seed=self.seed)  # float64, (batch, heads, seqlen, dim)
        if layout == "bshd":
            qkv = tuple(np.ascontiguousarray(x.swapaxes(1, 2)) for x in qkv)
        if device is None:
            return tuple(x.astype(_numpy_dtype(dtype)) for x in qkv)
        from .core.device import parse_name, _torch

        torch, dev = _torch(), parse_name(device)
        tdtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        if not isinstance(tdtype, torch.dtype) or not tdtype.is_floating_point:
            raise ValueError(f"dtype must name a torch floating type (float32, bfloat16, ...), got {dtype!r}")
        return tuple(torch.from_numpy(x).to(device=dev, dtype=tdtype) for x in qkv)


def _numpy_dtype(dtype):
    import numpy as np

    try:
        dt = np.dtype(dtype)
    except TypeError:
        try:
            import ml_dtypes  # bfloat16, float8 (the lowp extra)
            dt = np.dtype(getattr(ml_dtypes, dtype))
        except (ImportError, AttributeError, TypeError):
            raise ValueError(f"dtype must name a floating type (float32, float16, bfloat16 with "
                             f"ml_dtypes), got {dtype!r}") from None
    if dt.kind not in "fV":  # ml_dtypes' types are kind "V"
        raise ValueError(f"dtype must be a floating type, got {dtype!r}")
    return dt


#: The shapes ``attnlib_case`` runs a test at: prefill and decode (one query against a long
#: cache), with and without GQA, head dims 64 and 128.
CASES = (
    Case("prefill-d64", batch=2, heads=8, kv_heads=8, seqlen_q=512, seqlen_k=512, head_dim=64),
    Case("prefill-gqa-d128", batch=1, heads=8, kv_heads=2, seqlen_q=512, seqlen_k=512, head_dim=128),
    Case("decode-d64", batch=4, heads=8, kv_heads=8, seqlen_q=1, seqlen_k=2048, head_dim=64),
    Case("decode-gqa-d128", batch=4, heads=8, kv_heads=2, seqlen_q=1, seqlen_k=2048, head_dim=128),
)


@pytest.fixture(params=CASES, ids=lambda case: case.name)
def attnlib_case(request) -> Case:
    """A common attention shape (`attnlib.pytest_plugin.CASES`: decode and prefill, GQA, head
    dims 64 and 128); ``attnlib_case.qkv(dtype, layout, device)`` makes its seeded inputs.
    Parametrize it indirectly with a `Case` or a name of `CASES` for others."""
    case = request.param
    if isinstance(case, str):
        named = {c.name: c for c in CASES}
        if case not in named:
            raise ValueError(f"attnlib_case: unknown case {case!r}; known: {', '.join(named)}")
        return named[case]
    if not isinstance(case, Case):
        raise TypeError(f"attnlib_case takes a Case or a name of CASES, got {case!r}")
    return case


def pytest_make_parametrize_id(config, val, argname):
    """A `Case` is named by its name in test ids."""
    return val.name if isinstance(val, Case) else None


def pytest_addoption(parser):
    group = parser.getgroup("attnlib", "attnlib: attention kernel verdicts")
    group.addoption("--attnlib-report", metavar="DIR", default=None,
                    help=f"gather every kernel verdict of the run (attnlib.testing) into DIR/{REPORT}.html, "
                         f"one row per verdict, the rows also in DIR/{REPORT}.json")
    group.addoption("--attnlib-device", metavar="DEVICE", default=None,
                    help="compute the float64 reference with torch on DEVICE (cpu, cuda, cuda:1) when an "
                         "assert gives no device=")


def pytest_configure(config):
    device, folder = config.getoption("attnlib_device"), config.getoption("attnlib_report")
    if device is not None:
        from . import testing
        from .core.device import parse_name

        try:
            parse_name(device, "a torch device such as 'cpu', 'cuda' or 'cuda:1'")
        except ValueError as e:
            raise pytest.UsageError(f"--attnlib-device {device}: {e}") from None
        config._attnlib_device = testing._default_device
        testing._default_device = device
    if folder is not None:
        config.pluginmanager.register(Recorder(config, folder), "attnlib-recorder")


def pytest_unconfigure(config):
    if hasattr(config, "_attnlib_device"):
        from . import testing

        testing._default_device = config._attnlib_device
        del config._attnlib_device


class Recorder:
    """``--attnlib-report``: listens to `attnlib.testing` for the whole session, each verdict
    a row under the test running (its node id; "" outside any test)."""

    def __init__(self, config, folder: str):
        self.config, self.rows, self.test = config, [], ""
        self.worker = getattr(config, "workerinput", {}).get("workerid")  # None: controller or no xdist
        self.dir = Path(config.invocation_params.dir, folder).resolve()
        self.json = self.dir / f"{REPORT}.json"
        self.html = self.dir / f"{REPORT}.html"
        self.summary = ""
        if self.worker is None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise pytest.UsageError(f"--attnlib-report {folder}: cannot make the folder: {e}") from None
            if not os.access(self.dir, os.W_OK):
                raise pytest.UsageError(f"--attnlib-report {folder}: the folder {self.dir} cannot be written")
            for stale in [self.html, *self._worker_files()]:  # an earlier run's: not this one's report
                stale.unlink(missing_ok=True)
        from . import testing

        testing._listeners.append(self.listen)
        self._testing = testing

    def _worker_files(self):
        return sorted(self.dir.glob(f".{REPORT}-*.json"))

    def listen(self, result):
        try:
            self.rows.append(row(result, self.test, self._testing._entry.get()))
        except Exception as e:  # a row that cannot be made must not fail the test
            warnings.warn(pytest.PytestWarning(f"attnlib: a verdict of {self.test or 'no test'} was not "
                                               f"recorded: {type(e).__name__}: {e}"))

    def pytest_runtest_logstart(self, nodeid):
        self.test = nodeid

    def pytest_runtest_logfinish(self, nodeid):
        self.test = ""

    def pytest_unconfigure(self, config):
        if self.listen in self._testing._listeners:
            self._testing._listeners.remove(self.listen)

    def pytest_sessionfinish(self, session):
        try:
            self._finish(session)
        except OSError as e:  # a full disk, a folder removed: the tests' outcome stands
            warnings.warn(pytest.PytestWarning(f"attnlib: the kernel verdicts could not be written into "
                                               f"{self.dir}: {type(e).__name__}: {e}"))

    def _finish(self, session):
        if self.worker is not None:  # the controller merges it
            _write_json(self.dir / f".{REPORT}-{self.worker}.json", self.rows)
            return
        rows, parts = list(self.rows), self._worker_files()
        for part in parts:
            try:
                rows += json.loads(part.read_text())
            except (OSError, ValueError) as e:
                warnings.warn(pytest.PytestWarning(f"attnlib: {part} could not be read, its rows are "
                                                   f"missing from the report: {e}"))
        if parts:  # workers ran the tests in no fixed order
            rows.sort(key=lambda r: r["test"])
        from ._version import __version__

        failed = sum(r["verdict"] == "FAIL" for r in rows)
        _write_json(self.json, {"attnlib": __version__, "verdicts": len(rows), "failed": failed, "rows": rows,
                                "run": _run_context(session, self.config.getoption("attnlib_device"))})
        for part in parts:
            part.unlink(missing_ok=True)
        tally = f"{len(rows)} kernel verdicts, {failed} failed"
        rendered = self._render()
        self.summary = (f"attnlib: {tally}: {self.html}" if rendered
                        else f"attnlib: {tally}; rows in {self.json} (no HTML report, see the warning)")

    def _render(self) -> bool:
        """Render the report; False (and a warning) when it cannot be, the test results as they are."""
        from .report.costs import _importable

        missing = [m for m in RENDER_MODULES if not _importable(m)]
        if missing:
            warnings.warn(pytest.PytestWarning(
                f"attnlib: --attnlib-report renders HTML with the report extra ({', '.join(missing)} not "
                f"importable): pip install 'attnlib[report]'; the rows are in {self.json}"))
            return False
        try:
            from .report.runner import execute

            execute(NOTEBOOK, {"rows_json": str(self.json)}, self.html)
        except Exception as e:  # the tests' outcome stands; the rows are written
            warnings.warn(pytest.PytestWarning(f"attnlib: the HTML report could not be rendered "
                                               f"({type(e).__name__}: {e}); the rows are in {self.json}"))
            return False
        return True

    def pytest_terminal_summary(self, terminalreporter):
        if self.summary:
            terminalreporter.write_line(self.summary)


def row(result, test: str = "", entry: str = "assert_attention_close") -> dict:
    """One verdict as a report row: the test, shape, options, precision, worst ratio, PASS or
    FAIL, the diagnosis and, for a failure, its error maps (binned to `MAP_COLUMNS`)."""
    import numpy as np

    shape = result.shape
    ratios = [float(t.ratio) for t in result.judged if t.ratio is not None]
    data = {
        "test": test,
        "shape": {"batch": shape.get("batch"), "heads_q": shape.get("hq"), "heads_k": shape.get("hk"),
                  "seqlen_q": shape.get("sq"), "seqlen_k": shape.get("sk"), "head_dim": shape.get("d"),
                  "head_dim_v": shape.get("dv")},
        "options": {name: _plain(x) for name, x in result.options.items()},
        "precision": result.dtype,
        "worst_ratio": max(ratios, default=0.0),  # max |err| / allowance over the judged tensors
        "ratios": {t.name: None if t.ratio is None else float(t.ratio) for t in result.judged},
        "verdict": "PASS" if result.passed else "FAIL",
        "diagnosis": [str(line) for line in result.diagnosis],
        "entry": entry,  # the assert that judged it: assert_attention_close or a compat twin
    }
    if not result.passed:
        from .check import format_text
        data["text"] = format_text(result)  # the check's verdict in full: errors, allowances, worst entries
        head_row = np.asarray(result.head_row_ratio, dtype=np.float64)
        groups = np.array_split(np.arange(head_row.shape[-1]), min(head_row.shape[-1], MAP_COLUMNS))
        data["maps"] = {"seqlen_q": int(head_row.shape[-1]),
                        "head_row_ratio": [[float(f"{x:.4g}") for x in r]
                                           for r in np.stack([head_row[:, g].max(axis=1) for g in groups], axis=1)],
                        "row_ratio": [float(f"{np.max(result.row_ratio[g]):.4g}") for g in groups]}
    return data


def _run_context(session, device) -> dict:
    """How to reproduce the run: its command line, when, the torch and numpy versions, and
    where the reference ran (``--attnlib-device``, else each tensor's own device)."""
    import datetime
    import sys

    import numpy as np

    torch = sys.modules.get("torch")
    return {"command": "pytest " + " ".join(session.config.invocation_params.args),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "numpy": np.__version__, "torch": getattr(torch, "__version__", None),
            "device": device or "each input's own (numpy: the host)",
            "outcome": _outcome(session)}


def _outcome(session) -> dict:
    """The tests' own outcome (passed, failed, ...), as pytest's summary counts them."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = getattr(reporter, "stats", {}) or {}
    return {k: len(v) for k, v in stats.items() if k in ("passed", "failed", "error", "skipped") and v}


def _plain(x):
    """An option's value as JSON holds it: arrays of up to 16 entries as lists, larger ones and
    functions by a description."""
    import numpy as np

    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (tuple, list)):
        return [_plain(y) for y in x]
    if hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "tolist"):  # numpy, torch
        return _plain(x.tolist()) if math.prod(x.shape) <= 16 else f"array {tuple(x.shape)} {x.dtype}"
    if callable(x):
        return getattr(x, "__name__", type(x).__name__)
    return str(x)


def _write_json(target: Path, data) -> None:
    from .report.render import _write_json as write  # atomic: tmp file + rename

    write(target, data)
