"""``attnlib {report,bench,check,reference} ...`` (the console command ``pip install``
makes) or ``python -m attnlib ...``: the command-line entry points."""

import sys

COMMANDS = {"report": "attnlib.report", "bench": "attnlib.bench", "check": "attnlib.check",
            "reference": "attnlib.distributed.cli"}

USAGE = f"""usage: attnlib {{{','.join(COMMANDS)}}} [options]   (or: python -m attnlib ...)

  report  run the evidence notebooks and render their HTML reports
  bench   time the tiled kernel against dense numpy (and torch, when installed)
  check   judge an attention kernel's saved tensors against the float64 reference
  reference  write the float64 reference of saved q, k, v to a file, computed on a Dask cluster

attnlib COMMAND --help shows a command's options."""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            print(f"attnlib: unknown command {argv[0]!r}", file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
