"""attnlib: exact, memory-tiled attention in numpy, beside a dense float64 reference.

The contract every entry point follows is ``docs/semantics.md`` in the repository (layout
``(..., H, S, D)``, causal alignment, fully masked rows, LSE, stats, the error metric and
the verdict gate).

>>> import attnlib
>>> q, k, v = attnlib.random_qkv(1000, d=64, heads=4, kv_heads=2, seed=0)
>>> out, lse, stats = attnlib.attention(q, k, v, causal=True, return_lse=True, return_stats=True)
>>> out.shape, lse.shape
((4, 1000, 64), (4, 1000))

The package root is lazy: ``import attnlib`` loads nothing else, and each name below is
imported on first use (PEP 562), so ``import attnlib.core.tiled`` never pulls in the
evidence, the check or the report.  The layout:

- `attnlib.core`: the numerical core (online softmax, masks and tile classes, the tiled
  forward, stream, paged, varlen, flex, backward, the dense reference, the oracle, array
  conversion, the options); it imports nothing outside itself.
- `attnlib.judge`: what a verdict is made of, shared by the check and the evidence (the
  verdict gate's rounding bounds, the error metrics, packed layouts as a batch, whether a
  dense reference fits); it imports only the core.
- `attnlib.evidence`: what proves attnlib right (differential runs, defects, memory runs,
  plots, numerics, inputs).
- `attnlib.check` (a verdict on someone else's kernel), `attnlib.testing` (its pytest
  helper), `attnlib.bench`, `attnlib.distributed`, `attnlib.report`.
"""

from __future__ import annotations

import importlib

from ._version import __version__

#: Each public name -> the module (under attnlib) that defines it.
_PUBLIC = {
    'attention_backward': 'core.backward',
    'attention_vjp': 'core.backward',
    'reference_attention_backward': 'core.backward',
    'FAMILIES': 'evidence.inputs',
    'Case': 'evidence.inputs',
    'adversarial_qkv': 'evidence.inputs',
    'differential_cases': 'evidence.inputs',
    'feature_cases': 'evidence.inputs',
    'random_cases': 'evidence.inputs',
    'random_qkv': 'evidence.inputs',
    'FULL': 'core.masks',
    'PARTIAL': 'core.masks',
    'SKIP': 'core.masks',
    'MaskSpec': 'core.masks',
    'mask_specs': 'core.masks',
    'BOUND': 'judge.metrics',
    'Errors': 'judge.metrics',
    'attention_errors': 'judge.metrics',
    'expected_rescales': 'judge.metrics',
    'gradient_errors': 'judge.metrics',
    'max_rescales': 'judge.metrics',
    'log10_histogram': 'judge.metrics',
    'max_abs_error': 'judge.metrics',
    'naive_rel_error': 'judge.metrics',
    'normwise_error': 'judge.metrics',
    'reference_with_abs': 'judge.metrics',
    'rel_error': 'judge.metrics',
    'run_case_gradients': 'evidence.differential',
    'run_family_gradients': 'evidence.differential',
    'power_table': 'evidence.differential',
    'run_case': 'evidence.differential',
    'run_family': 'evidence.differential',
    'Gate': 'judge.gate',
    'GradientGate': 'judge.gate',
    'OnlineSoftmax': 'core.online',
    'merge_attention': 'core.online',
    'ORACLE_PRECISION': 'core.oracle',
    'oracle_attention': 'core.oracle',
    'reference_attention': 'core.reference',
    'reference_rescales': 'core.reference',
    'reference_scores': 'core.reference',
    'attention_stream': 'core.stream',
    'DEFAULT_TILES': 'core.tilesizes',
    'LARGE_HEAD_TILES': 'core.tilesizes',
    'AttentionStats': 'core.stats',
    'TileSizes': 'core.tilesizes',
    'attention': 'core.tiled',
    'default_tiles': 'core.tilesizes',
    'attention_varlen': 'core.varlen',
    'attention_varlen_backward': 'core.varlen',
    'reference_attention_varlen': 'core.varlen',
    'BlockMask': 'core.flex',
    'create_block_mask': 'core.flex',
}

#: The subpackages, and the modules of the numerical core, the judge and the evidence by their short
#: names (``attnlib.flex`` is ``attnlib.core.flex``, ``attnlib.gate`` ``attnlib.judge.gate``), on first use.
_MODULES = {name: name for name in ("core", "judge", "evidence", "check", "testing", "bench", "distributed", "report")}
_MODULES.update({m: "core." + m for m in ("online", "masks", "flex", "stream", "paged", "varlen",
                                         "backward", "reference", "oracle", "tensorio", "tiled")})
_MODULES.update({m: "judge." + m for m in ("gate", "metrics", "packing", "sizing")})
_MODULES.update({m: "evidence." + m for m in ("differential", "defects", "memory", "plots", "numerics", "inputs")})

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC) | set(_MODULES))
