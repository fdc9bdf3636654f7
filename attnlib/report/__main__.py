"""``python -m attnlib.report ...``: the same as ``python -m attnlib report ...``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
