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
_PUBLIC = {name: module for module, names in {
    'core.backward': ('attention_backward', 'attention_vjp', 'reference_attention_backward'),
    'evidence.inputs': ('FAMILIES', 'Case', 'adversarial_qkv', 'differential_cases', 'feature_cases',
                        'random_cases', 'random_qkv'),
    'core.masks': ('FULL', 'PARTIAL', 'SKIP', 'MaskSpec', 'mask_specs'),
    'judge.metrics': ('BOUND', 'Errors', 'attention_errors', 'expected_rescales', 'gradient_errors',
                      'max_rescales', 'log10_histogram', 'max_abs_error', 'naive_rel_error', 'normwise_error',
                      'reference_with_abs', 'rel_error'),
    'evidence.differential': ('run_case_gradients', 'run_family_gradients', 'power_table', 'run_case',
                              'run_family'),
    'judge.gate': ('Gate', 'GradientGate'),
    'core.online': ('OnlineSoftmax', 'merge_attention'),
    'core.oracle': ('ORACLE_PRECISION', 'oracle_attention'),
    'core.reference': ('reference_attention', 'reference_rescales', 'reference_scores'),
    'core.stream': ('attention_stream',),
    'core.tilesizes': ('DEFAULT_TILES', 'LARGE_HEAD_TILES', 'TileSizes', 'default_tiles'),
    'core.stats': ('AttentionStats',),
    'core.tiled': ('attention', 'max_sum_exp'),
    'core.varlen': ('attention_varlen', 'attention_varlen_backward', 'reference_attention_varlen'),
    'core.flex': ('BlockMask', 'create_block_mask', 'tensor_mods'),
    'core.block_sparse': ('block_mask_from_kv_blocks', 'block_mask_from_bsr'),
    'core.nsa': ('NSA', 'nsa_attention'),
    'core.dropout': ('attention_dropout', 'attention_dropout_backward'),
    'core.sources': ('Source', 'source', 'attention_sources', 'attention_sources_backward', 'join_sources'),
}.items() for name in names}

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
