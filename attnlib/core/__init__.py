"""attnlib's numerical core: exact tiled attention in float64, and nothing that judges it.

The modules, bottom up (each imports only those above it):

- `arrays` (foreign arrays to numpy, exactly), `validate` (argument checks), `online`
  (the online softmax state and exact merges), `problem` (the checked shapes, the
  precision, per-head options), `masks` (the contract's masks and tile classes),
  `flex` (FlexAttention's mods and block masks), `options` (every masking and score option,
  parsed once), `hooks` (the declared seams the evidence may replace);
- `tilesizes`, `parallel` (work units, threads), `tiles` (one query tile against its key
  tiles), `tiled` (`attention`), `stream`, `paged`, `varlen`, `backward`;
- `reference` (the dense float64 reference), `oracle` (the decimal oracle), `tensorio`
  (tensor files, never unpickled).

Nothing here imports `attnlib.evidence`, `attnlib.check`, `attnlib.report`,
`attnlib.bench` or `attnlib.distributed`.
"""

import importlib as _importlib
import pkgutil as _pkgutil

_SUBMODULES = {m.name for m in _pkgutil.iter_modules(__path__)}


def __getattr__(name: str):
    """A submodule on first use (``attnlib.core.flex`` after a bare ``import attnlib``)."""
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
