"""What the evidence notebooks call while they run: `strict` floating point, `stage`
progress lines, the `provenance` table and `save_results` with its `Verdict`.

Kept light (numpy and `attnlib.evidence.plots` only): every notebook imports it in its
setup cell.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._version import __version__
from ..core import problem, validate
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


#: The key of the one time a report states, on its page and in its JSON: when the notebook
#: saved its results (`save_results`, its last step), so both carry the same timestamp.
FINISHED = "run finished (UTC)"


def environment() -> dict:
    """Where and with what a report was made (its time is `save_results`'s, `FINISHED`)."""
    return {
        "attnlib": __version__,
        "git commit": _git_commit(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": _version_of("torch"),  # the torch backend's and the peers' (not imported here)
        "BLAS": _blas(),
        "CPU": f"{validate.cpu_name()} ({_cores()})",
    }


def _cores() -> str:
    """The machine's logical cores, and those this run may use where fewer (a notebook the
    runner ran beside another, on its share of the CPUs)."""
    total, usable = os.cpu_count(), validate.available_cpus()
    return f"{total} logical cores" + (f"; this run on {usable} of them" if total and usable < total else "")


def _version_of(package: str) -> str:
    """An installed package's version from its metadata, or "not installed"."""
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def provenance(params: dict):
    """A table of the run's parameters and `environment`, for the top of a report.

    Longer than `~attnlib.evidence.plots.SHOWN` rows it is shown once, collapsed under a
    line that names its counts and the commit (no first rows shown twice).  It states no time:
    this cell runs first, and the one time a report states is when the run finished
    (`FINISHED`, written by `save_results` into the JSON and shown under the verdict)."""
    shown = {k: v for k, v in params.items() if k != "results_json"}  # the runner's plumbing
    env = environment()
    rows = [{"": "parameter", "name": k, "value": repr(v)} for k, v in shown.items()]
    rows += [{"": "environment", "name": k, "value": v} for k, v in env.items()]
    summary = (f"{len(shown)} parameters and {len(env)} entries of the environment (attnlib {env['attnlib']}, "
               f"commit {env['git commit']}; the time the run finished is under the verdict), every row in the "
               "section below")
    return Table(rows, ["", "name", "value"], title="Parameters and environment of this run", summary=summary)


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

#: The most words of a report's key figure, its line in the index (`save_results`'s ``key``).
KEY_WORDS = 10

#: The most claims the table under the verdict shows; the others (``Claim.detail``, or shown
#: only) are in a collapsed section under it.
CLAIMS_SHOWN = 15

#: ``Claim.met`` of a gated claim whose measured spread crosses its bound (`against`).
UNRESOLVED = "not resolved"

_MET = {True: "yes", False: "NO", None: "shown, not gated", UNRESOLVED: UNRESOLVED}


@dataclass(frozen=True)
class Claim:
    """One row of a report's claims table, shown under its verdict.

    ``measured`` and ``bound`` are what the reader compares (text, already formatted from
    the data); ``met`` is True or False for a gated claim, `UNRESOLVED` for a gated claim
    whose measured spread crosses its bound (`against`), and None for one only shown.
    ``detail`` marks a claim that a claim on the page sums up (one case of several): it goes
    to the collapsed section under the table, as do claims only shown once the table holds
    `CLAIMS_SHOWN`.
    """

    claim: str
    measured: str
    bound: str = ""
    met: bool | str | None = None
    detail: bool = False

    def __post_init__(self):
        if self.met not in _MET:
            raise ValueError(f"Claim.met must be True, False, None or {UNRESOLVED!r}, got {self.met!r}")

    def row(self, page: bool = True) -> dict:
        return {"claim": self.claim, "measured": self.measured, "bound": self.bound or "-",
                "met": _MET[self.met], "page": bool(page), "detail": self.detail}


def on_page(claims) -> list[bool]:
    """Which ``claims`` the table under the verdict shows: every one but the details, and of
    those, while more than `CLAIMS_SHOWN` remain, the claims only shown go (last first) to
    the collapsed section; gated claims and misses always stay."""
    page = [not c.detail for c in claims]
    for i in reversed(range(len(claims))):
        if sum(page) <= CLAIMS_SHOWN:
            break
        if page[i] and claims[i].met is None:
            page[i] = False
    return page


def combined(mets) -> bool | str | None:
    """The ``met`` of a claim that sums up gated claims: False when one is not met, else
    `UNRESOLVED` when one is not resolved, else True (None when none is gated)."""
    mets = [m for m in mets if m is not None]
    if not mets:
        return None
    if any(m is False for m in mets):
        return False
    return UNRESOLVED if any(isinstance(m, str) for m in mets) else True


# -- a measured spread against a bound, and two times compared: one rule for every timing -----

def against(spread: dict, bound: float, at_most: bool = True) -> bool | str:
    """A measured spread (``{"min", "median", "max"}``: repeats, or refits) against a bound:
    True when the whole spread meets it (``max <= bound`` for ``at_most``, else
    ``min >= bound``), False when the whole spread misses it, `UNRESOLVED` when it crosses
    the bound. The median alone never decides."""
    lo, hi = float(spread["min"]), float(spread["max"])
    if at_most:
        return True if hi <= bound else (False if lo > bound else UNRESOLVED)
    return True if lo >= bound else (False if hi < bound else UNRESOLVED)


def compare(ratio: dict) -> str:
    """The word for a ratio of times ``a / b`` with its spread (paired repeats, `against`'s
    dict): "slower" (a) only when the whole spread is above 1, "faster" only when it is all
    below 1, else "within noise"."""
    if float(ratio["min"]) > 1:
        return "slower"
    if float(ratio["max"]) < 1:
        return "faster"
    return "within noise"


def ratio_range(a: dict, b: dict) -> dict:
    """``a / b`` of two spreads that were not paired repeat by repeat: the median ratio and
    the widest range the two spreads allow (``a.min / b.max .. a.max / b.min``)."""
    return {"median": a["median"] / b["median"], "min": a["min"] / b["max"], "max": a["max"] / b["min"],
            "n": min(a.get("n", 0), b.get("n", 0))}


def _sided(fmt: str, values, bounds) -> str:
    """``fmt`` (``.Nf`` or ``.N%``) with decimals added until no value of ``values`` prints on
    the other side of a bound of ``bounds``, or on it (1.003 is not "1.00" against 1); other
    formats as given."""
    m = re.fullmatch(r"\.(\d+)([f%])", fmt)
    if m is None:
        return fmt
    decimals, kind = int(m.group(1)), m.group(2)
    scale = 100.0 if kind == "%" else 1.0
    while decimals < 15:
        fmt = f".{decimals}{kind}"
        shown = [float(format(v, fmt).rstrip("%")) / scale for v in values]
        if all((s > b) == (v > b) and (s < b) == (v < b) for b in bounds for s, v in zip(shown, values)):
            return fmt
        decimals += 1
    return f".15{kind}"


def decided_format(values, bound: float, percent: bool = False, digits: int = 3) -> str:
    """The format of values read against ``bound``: ``digits`` significant digits on the
    largest, and more where fewer would print one on the other side of the bound, or on it
    (0.7979 is not "0.80" against a target of 0.80)."""
    top = max(abs(v) * (100 if percent else 1) for v in values) or 1.0
    decimals = max(0, digits - 1 - math.floor(math.log10(top)))
    return _sided(f".{decimals}{'%' if percent else 'f'}", values, [bound])


def spread_text(spread: dict, fmt: str = ".2f", unit: str = "×", bound: float | None = None) -> str:
    """``median (min–max)``, as every timing is shown; the digits put each of the three on
    its side of ``bound`` and, for a ratio (``unit`` "×"), of 1, the line between faster and
    slower (`compare`)."""
    values = [float(spread[x]) for x in ("median", "min", "max")]
    fmt = _sided(fmt, values, [b for b in (bound, 1.0 if unit == "×" else None) if b is not None])
    return f"{spread['median']:{fmt}}{unit} ({spread['min']:{fmt}}–{spread['max']:{fmt}}{unit})"


def outcome(met) -> str:
    """A claim's ``met`` in the words of a verdict line: "met", "NOT met", "not resolved"."""
    return {True: "met", False: "NOT met", UNRESOLVED: "not resolved", None: "shown"}[met]


def tally(mets) -> str:
    """How a group of gated claims came out, in `outcome`'s words: ``"met 1/4, NOT met 2/4,
    not resolved 1/4"`` (outcomes with no claim left out; None, shown, not counted)."""
    mets = [m for m in mets if m is not None]
    parts = []
    for value in (True, False, UNRESOLVED):
        count = sum((m == value) if isinstance(value, str) else (m is value or (not isinstance(m, str) and m == value))
                    for m in mets)
        if count:
            parts.append(f"{outcome(value)} {count}/{len(mets)}")
    return ", ".join(parts)


def timing_claim(claim: str, spread: dict, bound: float | None = None, *, at_most: bool = True,
                 fmt: str = ".2f", unit: str = "×", gated: bool = True, note: str = "",
                 detail: bool = False) -> Claim:
    """The claim of one measured spread (a time, a ratio, an efficiency) against ``bound``,
    by `against`: measured ``median (min–max)`` (and ``note``), "the spread crosses the
    bound" where it does; ``met`` `against`'s answer when ``gated``, else None (the bound
    is a target shown beside it, the outcome in the measured column)."""
    measured = spread_text(spread, fmt, unit, bound) + (f", {note}" if note else "")
    if bound is None:
        return Claim(claim, measured, "", None, detail)
    met = against(spread, bound, at_most)
    bound_text = f"{'≤' if at_most else '≥'} " + (f"{bound:g}{unit}" if unit else f"{bound:{fmt}}")
    if met == UNRESOLVED:
        measured += "; the spread crosses the bound"
    if not gated:
        measured += f" (target {outcome(met)})"
        bound_text += " (target, not gated)"
    return Claim(claim, measured, bound_text, met if gated else None, detail)


def words(text: str) -> int:
    """The words of ``text`` as `HEADLINE_WORDS` counts them (runs of non-blanks)."""
    return len(str(text).split())


def save_results(results_json: str, notebook: str, params: dict, passed, line: str,
                 figures: dict, claims=(), key: str = "") -> Verdict:
    """Write a notebook's figures, verdict and claims as JSON (when ``results_json`` is set).

    ``line`` is the verdict in at most `HEADLINE_WORDS` words (a longer PASS line is a
    ValueError; a longer FAIL or INFO line is cut there, saying so, so that it is reported);
    ``claims`` are `Claim` s, the table under it (`on_page`: at most `CLAIMS_SHOWN` on the
    page, the rest collapsed; a PASS whose gated claims do not fit is a ValueError);
    ``key`` is the report's key figure, its line in the index, in at most `KEY_WORDS` words
    (longer: a ValueError; empty: the verdict line's first words).  A gated claim that is not
    met, or not resolved, cannot sit under a PASS (ValueError).  ``strict`` records whether
    numpy's error handling is `STRICT` now, as `strict` sets it.
    """
    if words(line) > HEADLINE_WORDS:
        if passed:  # a notebook's own bug: its PASS line must be written short
            raise ValueError(f"the verdict line has {words(line)} words, more than {HEADLINE_WORDS}: {line!r}")
        # A FAIL (or INFO) must still be reported: cut, and say where the rest is.
        line = " ".join(str(line).split()[:HEADLINE_WORDS - 7]) + " ... (the claims table has the rest)"
    if words(key) > KEY_WORDS:
        raise ValueError(f"the key figure has {words(key)} words, more than {KEY_WORDS}: {key!r}")
    claims = list(claims)
    missed = [c.claim for c in claims if c.met is False or isinstance(c.met, str)]
    if passed and missed:
        raise ValueError("a PASS verdict with a gated claim not met: " + "; ".join(missed))
    page = on_page(claims)
    if passed and sum(page) > CLAIMS_SHOWN:
        raise ValueError(f"{sum(page)} claims on the page, more than {CLAIMS_SHOWN}: sum some up "
                         "(Claim.detail for the claims a claim on the page covers)")
    verdict = Verdict(None if passed is None else bool(passed), line, is_strict())
    if results_json:
        data = {"notebook": notebook, "passed": verdict.passed, "verdict": line,
                "key": " ".join(str(key).split()), "strict": verdict.strict,
                "claims": [c.row(p) for c, p in zip(claims, page)], "params": params,
                "environment": {**environment(), FINISHED: _now()}, "figures": figures}
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

