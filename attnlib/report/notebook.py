"""What the evidence notebooks call while they run: `strict` floating point, `stage`
progress lines, the `provenance` table and `save_results` with its `Verdict`.

Kept light (numpy and `attnlib.evidence.plots` only): every notebook imports it in its
setup cell.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._version import __version__
from ..core import problem
from ..evidence.plots import Table

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository (a checkout's root)
PROGRESS_ENV = "ATTNLIB_REPORT_PROGRESS"  # the file `stage` appends its lines to


# -- strict floating point and progress, called from the notebooks ---------------------------

STRICT = problem.STRICT  # the contract's strict floating-point mode
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


#: The most words a verdict line may have: it is read first, under the report's title.
HEADLINE_WORDS = 40


@dataclass(frozen=True)
class Claim:
    """One row of a report's claims table, shown under its verdict.

    ``measured`` and ``bound`` are what the reader compares (text, already formatted from
    the data); ``met`` is True or False for a gated claim and None for one only shown.
    """

    claim: str
    measured: str
    bound: str = ""
    met: bool | None = None

    def row(self) -> dict:
        met = {True: "yes", False: "NO", None: "shown, not gated"}[self.met]
        return {"claim": self.claim, "measured": self.measured, "bound": self.bound or "-", "met": met}


def words(text: str) -> int:
    """The words of ``text`` as `HEADLINE_WORDS` counts them (runs of non-blanks)."""
    return len(str(text).split())


def save_results(results_json: str, notebook: str, params: dict, passed, line: str,
                 figures: dict, claims=()) -> Verdict:
    """Write a notebook's figures, verdict and claims as JSON (when ``results_json`` is set).

    ``line`` is the verdict in at most `HEADLINE_WORDS` words (a longer PASS line is a
    ValueError; a longer FAIL or INFO line is cut there, saying so, so that it is reported);
    ``claims`` are `Claim` s, the table under it.  A gated claim that is not met cannot sit
    under a PASS (ValueError).  ``strict`` records whether numpy's error handling is
    `STRICT` now, as `strict` sets it.
    """
    if words(line) > HEADLINE_WORDS:
        if passed:  # a notebook's own bug: its PASS line must be written short
            raise ValueError(f"the verdict line has {words(line)} words, more than {HEADLINE_WORDS}: {line!r}")
        # A FAIL (or INFO) must still be reported: cut, and say where the rest is.
        line = " ".join(str(line).split()[:HEADLINE_WORDS - 7]) + " ... (the claims table has the rest)"
    claims = list(claims)
    if passed and any(c.met is False for c in claims):
        raise ValueError("a PASS verdict with a gated claim not met: "
                         + "; ".join(c.claim for c in claims if c.met is False))
    verdict = Verdict(None if passed is None else bool(passed), line, is_strict())
    if results_json:
        data = {"notebook": notebook, "passed": verdict.passed, "verdict": line,
                "strict": verdict.strict, "claims": [c.row() for c in claims], "params": params,
                "environment": environment(), "figures": figures}
        Path(results_json).write_text(json.dumps(data, indent=1, default=_jsonable))
    return verdict


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")

