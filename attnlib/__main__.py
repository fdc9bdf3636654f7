"""``python -m attnlib {report,bench,check} ...``: the command-line entry points."""

import sys

COMMANDS = {"report": "attnlib.report", "bench": "attnlib.bench", "check": "attnlib.check"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m attnlib {{{','.join(COMMANDS)}}} [options]  (--help per command)")
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
