"""The evidence that attnlib's kernels are right: built on `attnlib.core`, never the reverse.

- `differential` (the kernel against the dense reference, with and without defects,
  judged by `attnlib.judge`'s gate), `defects` (injected bugs, attached through
  `attnlib.core.hooks`), `inputs` (the case families),
  `memory` (peak memory in a fresh process), `fresh` (running one call in a fresh
  process), `numerics` (the long-double study), `plots` (the reports' figures).
"""

import importlib as _importlib
import pkgutil as _pkgutil

_SUBMODULES = {m.name for m in _pkgutil.iter_modules(__path__)}


def __getattr__(name: str):
    """A submodule on first use (``attnlib.core.flex`` after a bare ``import attnlib``)."""
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
