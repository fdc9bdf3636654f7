"""attnlib: exact, memory-tiled attention in numpy, beside a dense float64 reference.

The contract every entry point follows is ``docs/semantics.md`` in the repository (layout
``(..., H, S, D)``, causal alignment, fully masked rows, LSE, stats, the error metric and
the verdict gate).

>>> import attnlib
>>> q, k, v = attnlib.random_qkv(1000, d=64, heads=4, kv_heads=2, seed=0)
>>> out, lse, stats = attnlib.attention(q, k, v, causal=True, return_lse=True, return_stats=True)
>>> out.shape, lse.shape
((4, 1000, 64), (4, 1000))
"""

from . import check  # attnlib.check.check_kernel: the verdict on your kernel
from .backward import attention_backward, attention_vjp, reference_attention_backward
from .inputs import FAMILIES, Case, adversarial_qkv, differential_cases, feature_cases, random_cases, random_qkv
from .masks import FULL, PARTIAL, SKIP, MaskSpec, mask_specs
from .metrics import (
    BOUND,
    Errors,
    attention_errors,
    expected_rescales,
    gradient_errors,
    max_rescales,
    log10_histogram,
    max_abs_error,
    naive_rel_error,
    normwise_error,
    reference_with_abs,
    rel_error,
    run_case_gradients,
    run_family_gradients,
)
from .differential import power_table, run_case, run_family
from .gate import Gate, GradientGate
from .online import OnlineSoftmax, merge_attention
from .oracle import ORACLE_PRECISION, oracle_attention
from .reference import reference_attention, reference_rescales, reference_scores
from .stream import attention_stream
from .tiled import DEFAULT_TILES, LARGE_HEAD_TILES, AttentionStats, TileSizes, attention, default_tiles
from .varlen import attention_varlen, attention_varlen_backward, reference_attention_varlen
from .flex import BlockMask, create_block_mask

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_stream", "attention_varlen", "attention_varlen_backward",
    "reference_attention_varlen", "create_block_mask", "BlockMask", "reference_attention", "oracle_attention", "ORACLE_PRECISION", "attention_backward",
    "reference_attention_backward", "attention_vjp", "gradient_errors", "reference_scores", "reference_rescales",
    "AttentionStats", "TileSizes", "DEFAULT_TILES", "LARGE_HEAD_TILES", "default_tiles", "OnlineSoftmax", "merge_attention",
    "MaskSpec", "mask_specs",
    "SKIP", "PARTIAL", "FULL", "random_qkv", "adversarial_qkv", "FAMILIES", "Case", "random_cases", "differential_cases", "feature_cases", "run_case", "run_family", "power_table", "Gate", "GradientGate", "run_case_gradients",
    "run_family_gradients",
    "expected_rescales", "max_rescales",
    "BOUND", "Errors", "attention_errors", "rel_error", "naive_rel_error",
    "max_abs_error", "normwise_error", "reference_with_abs", "log10_histogram",
]
