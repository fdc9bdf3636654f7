"""The evidence that attnlib's kernels are right: built on `attnlib.core`, never the reverse.

- `differential` (the kernel against the dense reference, with and without defects,
  judged by `attnlib.judge`'s gate), `defects` (injected bugs, attached through
  `attnlib.core.hooks`), `inputs` (the case families),
  `memory` (peak memory in a fresh process), `fresh` (running one call in a fresh
  process), `numerics` (the long-double study), `plots` (the reports' figures).
"""

from ..core import lazy_submodules as _lazy

__getattr__ = _lazy(__name__, __path__)
