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


def lazy_submodules(package: str, path):
    """The module ``__getattr__`` of a package whose submodules load on first use
    (``attnlib.core.flex`` after a bare ``import attnlib``): core, judge and evidence share it."""
    names = {m.name for m in _pkgutil.iter_modules(path)}

    def __getattr__(name: str):
        if name in names:
            return _importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__


__getattr__ = lazy_submodules(__name__, __path__)
