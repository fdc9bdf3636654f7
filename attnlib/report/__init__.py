"""The report runner: notebook parameters, provenance, papermill runs and HTML rendering.

``python -m attnlib report`` runs every notebook in ``notebooks/`` with papermill, renders
each executed notebook to self-contained HTML in ``reports/`` (plots embedded, no script
or style from a CDN) and writes ``reports/index.html`` with one verdict line per report.
A report is replaced only when its notebook ran to the end: it is written to a temporary
file and renamed.

Each notebook's defaults live in its cell tagged ``parameters``; the checks for those
values live in `attnlib.report.params` (`NOTEBOOKS`), and the notebook's next cell calls
`check_params`, so a bad value fails with the same message in the notebook and in the
runner (which checks before it starts anything).

Runs never pass for what they are not:

* ``reports/`` holds the committed runs at the notebooks' defaults (``make report``, minutes)
  and ``reports/full/`` those at their ``full`` values (``make report-full``: the
  measurements expensive by nature; each `Notebook` names its own).  A run with
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
* Notebooks that time something (`Notebook.alone`: performance, scale-out, the Flex gallery)
  never run beside another: ``--jobs 2`` (the default on two or more CPUs) runs the others two at a time, each
  pinned to its share of the CPUs, which its report's CPU line states, then these alone.
* `stage` in a notebook prints a progress line on the runner's terminal (through a file
  named by ``$ATTNLIB_REPORT_PROGRESS``: the kernel's own stdout and stderr end up in the
  report).  Progress goes to stdout; errors, FAIL and ERROR lines to stderr.

Its modules, each importing only those above it:

* `attnlib.report.notebook`: what the notebooks call while they run (`strict`, `stage`,
  `provenance`, `save_results` with its `Claim` s, and the one rule for every measured
  spread: `against` a bound, `compare` for two times, `timing_claim`);
* `attnlib.report.costs`: the per-notebook cost model bounding every size-like parameter;
* `attnlib.report.params`: the parameter checks, `NOTEBOOKS` and `check_params`;
* `attnlib.report.render`: the HTML reports and their index;
* `attnlib.report.runner`: papermill, the plan, `execute`, `run_one` and `run`;
* `attnlib.report.cli`: ``python -m attnlib report`` (`main`).

Everything a notebook, a test or another module uses is importable from here.
"""

from .notebook import (
    CLAIMS_SHOWN, HEADLINE_WORDS, KEY_WORDS, PROGRESS_ENV, ROOT, STRICT, STRICT_TEXT, UNRESOLVED, Claim,
    Verdict, against, combined, compare, environment, is_strict, on_page, outcome, provenance, ratio_range,
    save_results, spread_text, decided_format, stage, strict, tally, timing_claim)
from .costs import (
    BACKWARD, FALLBACK_MEMORY, GALLERY_ENTRIES, LONG_DOUBLE, PAIR_WORK, PIECE_BYTES, PIECE_WORK, PROCESS_BYTES,
    TASK_WORK, THREAD_BYTES, TILE_WORK, WORK_LIMIT, Cost, check_costs, disk_limit, memory_limit)
from .params import (
    NOTEBOOKS, Notebook, backward_defect, check_params, check_resources, check_shapes, model_cases, flag,
    magnitudes, non_negative, positive, power_shapes, precisions, seconds, sizes, text, thresholds)
from .render import TEMPLATES, render_html, write_index
from .runner import (
    INSTALL_REPORT, FULL_REPORTS, LOCAL_REPORTS, REPORT_MODULES, REPORTS, NotebookError, ReportError, execute,
    missing_report_modules, overridden, plan, run, run_one)
from .cli import main

__all__ = [
    "BACKWARD", "CLAIMS_SHOWN", "Claim", "FALLBACK_MEMORY", "HEADLINE_WORDS", "KEY_WORDS", "UNRESOLVED",
    "against", "combined", "compare", "decided_format", "on_page", "outcome", "ratio_range", "spread_text", "tally", "timing_claim", "FULL_REPORTS", "GALLERY_ENTRIES", "INSTALL_REPORT", "LOCAL_REPORTS", "LONG_DOUBLE",
    "NOTEBOOKS", "PAIR_WORK", "PIECE_BYTES", "PIECE_WORK", "PROCESS_BYTES", "PROGRESS_ENV", "REPORTS",
    "REPORT_MODULES", "ROOT", "STRICT", "STRICT_TEXT", "TASK_WORK", "TEMPLATES", "THREAD_BYTES",
    "TILE_WORK", "WORK_LIMIT", "Cost", "Notebook", "NotebookError", "ReportError", "Verdict",
    "backward_defect", "check_costs", "check_params", "check_resources", "check_shapes", "model_cases", "disk_limit",
    "environment", "execute", "flag", "is_strict", "magnitudes", "main", "memory_limit",
    "missing_report_modules", "non_negative", "overridden", "plan", "positive", "power_shapes",
    "precisions", "provenance", "render_html", "run", "run_one", "save_results", "seconds", "sizes",
    "stage", "strict", "text", "thresholds", "write_index",
]
