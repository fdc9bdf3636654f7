"""What a verdict is made of, shared by the check (the product) and the evidence (the lab).

- `gate` (the verdict gate: the per-row float64 rounding bound, `Gate`, `GradientGate`),
  `metrics` (error metrics, the gradient rows, the rescale theory), `packing` (varlen and
  paged layouts as a padded batch, for judging), `sizing` (whether a dense reference fits
  this machine).  Built on `attnlib.core` only: nothing here imports `attnlib.evidence`,
  `attnlib.check` or `attnlib.report`.
"""

import importlib as _importlib
import pkgutil as _pkgutil

_SUBMODULES = {m.name for m in _pkgutil.iter_modules(__path__)}


def __getattr__(name: str):
    """A submodule on first use (``attnlib.judge.gate`` after a bare ``import attnlib``)."""
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
