"""What a verdict is made of, shared by the check (the product) and the evidence (the lab).

- `gate` (the verdict gate: the per-row float64 rounding bound, `Gate`, `GradientGate`),
  `metrics` (error metrics, the gradient rows, the rescale theory), `packing` (varlen and
  paged layouts as a padded batch, for judging), `sizing` (whether a dense reference fits
  this machine).  Built on `attnlib.core` only: nothing here imports `attnlib.evidence`,
  `attnlib.check` or `attnlib.report`.
"""

from ..core import lazy_submodules as _lazy

__getattr__ = _lazy(__name__, __path__)
