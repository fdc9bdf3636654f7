"""``python -m attnlib report``: the command line of the report runner (`main`)."""

from __future__ import annotations

import sys

from .params import NOTEBOOKS
from .runner import MAX_JOBS, default_jobs, run

#: The first line of ``--help`` (the first paragraph of `attnlib.report`'s docstring).
DESCRIPTION = "The report runner: notebook parameters, provenance, papermill runs and HTML rendering."

_EPILOG = """\
output: a run of the notebooks at their defaults writes to reports/ (the committed
reports), a --full run (make report-full) to reports/full/; --quick, -p or --notebooks write to reports-local/ (git-ignored) unless --out
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

    parser = argparse.ArgumentParser(prog="python -m attnlib report", description=DESCRIPTION,
                                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=list(NOTEBOOKS), metavar="NAME",
                        help=f"run only this notebook (repeatable): {', '.join(NOTEBOOKS)}")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override a parameter (KEY or NOTEBOOK.KEY); values are Python literals")
    parser.add_argument("--quick", action="store_true", help="tiny parameters, for a smoke run")
    parser.add_argument("--full", action="store_true",
                        help="the full runs (make report-full): the notebooks' full values, into reports/full/")
    parser.add_argument("--out", default=None,
                        help="output folder (default: reports/ at the defaults, reports-local/ otherwise)")
    parser.add_argument("--allow-nondefault-reports", action="store_true",
                        help="let a --quick, -p or --notebooks run write into reports/ (marked NON-DEFAULT)")
    parser.add_argument("--notebooks", default=None, help="notebook folder (default: notebooks/)")
    parser.add_argument("--jobs", type=int, default=default_jobs(), metavar="N",
                        help="notebooks that time nothing run up to N at a time, each on its share of the "
                             f"CPUs; those that time things run alone after them (default: the CPUs, at most "
                             f"{MAX_JOBS}: {default_jobs()} here)")
    args = parser.parse_args(argv)
    return run(args.only, args.param, args.quick, args.out, args.notebooks,
               log=lambda m: print(m, flush=True),
               error=lambda m: print(m, file=sys.stderr, flush=True),
               allow_nondefault_reports=args.allow_nondefault_reports, full=args.full, jobs=args.jobs)

