"""Error metrics, so that tests, notebooks and reports all compute the same figures.

The gate of this project is `rel_error`: each entry's error measured against the size of
what it sums, ``P @ |V|`` (the attention output with ``|v|`` in place of ``v``).  An
output entry is a weighted average of values of both signs and can cancel to nearly 0,
so the naive elementwise ``|out - ref| / |ref|`` is ill-conditioned: two correct float64
implementations differ by ~1e-8 "relative" on plain random inputs.  ``P @ |V|`` is the
componentwise condition bound of a sum (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., ch. 4); a correct float64 computation gives ~1e-15 on ordinary
inputs and about ``eps * |logit|`` (~1e-12) at logits of 1e4.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..core import arrays, validate
from ..core.backward import reference_attention_backward
from ..core.masks import MaskSpec
from ..core.options import Options
from ..core.reference import dense_attention, dense_options

#: The project's accuracy bound on `rel_error` against the float64 dense reference.
BOUND = 1e-9
#: The smallest positive normal float64 (2**-1022): `rel_error`'s floor on ``P @ |V|``.
TINY = float(np.finfo(np.float64).tiny)


def _error(out, ref, name="out") -> np.ndarray:
    """``|out - ref|`` in float64, for ``out`` of exactly ``ref``'s shape: a wrongly shaped
    output must not broadcast against the reference (one row standing for all)."""
    out = arrays.as_float_array(out, name)
    ref = np.asarray(ref)
    if out.shape != ref.shape:
        raise ValueError(f"{name} has shape {out.shape}, the reference {ref.shape}: they must be equal")
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf in out give NaN and inf errors
        return np.abs(out.astype(np.float64) - ref)


def rel_error(out, ref, ref_abs, name="out") -> float:
    """``max |out - ref| / max(P @ |V|, TINY)``; entries where ``P @ |V| = 0`` use ``|out - ref|``.

    ``ref_abs`` is ``P @ |V|``, e.g. from `reference_with_abs`.  The floor `TINY` (the
    smallest normal number): an entry whose size is subnormal cannot carry a relative
    precision in float64, only an absolute one of about ``2**-1074``.
    """
    err = _error(out, ref, name)
    if err.size == 0:
        return 0.0
    scaled = np.divide(err, np.maximum(ref_abs, TINY), out=err.copy(), where=ref_abs > 0)
    return float(scaled.max())


def naive_rel_error(out, ref, name="out") -> float:
    """``max |out - ref| / |ref|`` over entries with ``ref != 0`` (ill-conditioned; not the gate)."""
    err = _error(out, ref, name)
    nz = ref != 0
    return float((err[nz] / np.abs(ref[nz])).max(initial=0.0))


def max_abs_error(out, ref, name="out") -> float:
    """``max |out - ref|``."""
    err = _error(out, ref, name)
    return float(err.max()) if err.size else 0.0


def normwise_error(out, ref, name="out") -> float:
    """``max |out - ref| / max |ref|`` (the absolute error when ``ref`` is all zero)."""
    err = max_abs_error(out, ref, name)
    size = float(np.abs(ref).max()) if np.size(ref) else 0.0
    return err / size if size > 0 else err


def reference_with_abs(q, k, v, *, return_lse=False, options=None, **kwargs):
    """``(ref, P @ |V|)`` from one dense reference call on ``[v, |v|]`` stacked along Dv.

    Each output column depends only on its own value column, so stacking is exact.
    ``kwargs`` are those of `reference_attention` (masking and scale, or parsed into
    ``options``, an `~attnlib.core.options.Options`); with ``return_lse`` the reference's
    ``lse`` comes third.
    """
    opts, rest = Options.split(options, **kwargs)
    v = arrays.as_float_array(v, "v")
    if v.ndim < 2:
        raise ValueError(f"v must have at least 2 dimensions (..., Sk, Dv), got shape {v.shape}")
    both, lse = dense_attention(q, k, np.concatenate([v, np.abs(v)], axis=-1), dense_options(opts),
                                return_lse=True, **rest)
    dv = v.shape[-1]
    return (both[..., :dv], both[..., dv:]) + ((lse,) if return_lse else ())


@dataclass(frozen=True)
class Errors:
    """All error figures of one output against the dense reference."""

    rel_error: float
    naive_rel_error: float
    max_abs_error: float
    normwise_error: float

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, out, ref, ref_abs) -> "Errors":
        """The figures of ``out`` against ``ref``, with ``ref_abs = P @ |V|``."""
        return cls(rel_error=rel_error(out, ref, ref_abs), naive_rel_error=naive_rel_error(out, ref),
                   max_abs_error=max_abs_error(out, ref), normwise_error=normwise_error(out, ref))


def attention_errors(out, q, k, v, **kwargs) -> Errors:
    """Compare ``out`` with the dense float64 reference for ``(q, k, v, **kwargs)``.

    Examples
    --------
    >>> import attnlib
    >>> q, k, v = attnlib.random_qkv(100, 100, 32, seed=1)
    >>> out = attnlib.attention(q, k, v, causal=True, block_q=16, block_k=16)
    >>> attnlib.attention_errors(out, q, k, v, causal=True).rel_error < 1e-13
    True
    """
    return Errors.of(out, *reference_with_abs(q, k, v, **kwargs))


def gradient_errors(grads, q, k, v, dout, **kwargs) -> dict:
    """Errors of ``grads = (dq, dk, dv)`` (and ``dsinks`` with sinks) against the dense
    float64 gradient.

    ``"dq"``, ``"dk"``, ``"dv"``: the componentwise `rel_error` of each gradient against the
    size of what its entries sum (`reference_attention_backward` with ``return_abs``): a
    gradient entry sums ``p * (dp - D)`` terms of both signs, and when the softmax puts all
    its weight on one key, ``dp - D`` cancels to ~0 exactly, so a normwise ratio divides
    rounding noise by ~0.  ``"dq_normwise"`` etc.: ``max|g - ref| / max|ref|``, for
    comparison.  ``kwargs`` are the masking and score options.
    """
    return _gradient_figures(grads, *reference_attention_backward(q, k, v, dout, return_abs=True, **kwargs))


def _gradient_figures(grads, ref, sizes) -> dict:
    """`gradient_errors` of ``grads`` against a computed reference and its sizes."""
    if len(grads) != len(ref):
        raise ValueError(f"grads must be {len(ref)} arrays ((dq, dk, dv{', dsinks' if len(ref) == 4 else ''})), "
                         f"got {len(grads)}")
    errors = {}
    for name, g, r, a in zip(("dq", "dk", "dv", "dsinks"), grads, ref, sizes):
        errors[name] = rel_error(g, r, a, name)
        errors[f"{name}_normwise"] = normwise_error(g, r, name)
    return errors


def log10_histogram(errors, lo: float = -18.0, hi: float = -6.0, bins_per_decade: int = 4):
    """Counts of ``log10(errors)`` in equal bins over ``[lo, hi]``.

    Zeros and values below ``10**lo`` fall into the first bin, values above ``10**hi``
    into the last, so every error is counted.  Returns ``(edges, counts)`` with
    ``edges`` in log10 units.
    """
    e = np.asarray(errors, dtype=np.float64).ravel()
    edges = np.linspace(lo, hi, int(round((hi - lo) * bins_per_decade)) + 1)
    with np.errstate(divide="ignore"):  # log10(0) = -inf is clipped to the first bin
        x = np.clip(np.log10(e), lo, hi)
    counts, _ = np.histogram(x, bins=edges)
    return edges, counts


def _visible_keys_per_row(sq, sk, causal, causal_align):
    """How many keys each query row sees: a prefix ``0 .. L-1`` under a causal mask."""
    if not causal:
        return np.full(sq, sk)
    o = MaskSpec(sq, sk, True, causal_align).offset
    return np.clip(np.arange(sq) + o + 1, 0, sk)


def _tile_key_counts(sq, sk, block_q, block_k, causal, causal_align):
    """``(L, c, C)``: visible keys per row, per (row, key tile), and cumulative through the tile."""
    sq, sk = validate.count(sq, "sq"), validate.count(sk, "sk")
    block_q, block_k = validate.positive_int(block_q, "block_q"), validate.positive_int(block_k, "block_k")
    causal, causal_align = validate.flag(causal, "causal"), validate.causal_align(causal_align)
    validate.check_allocation(8 * 4 * sq * -(-sk // block_k), f"the per-row counts of {sq} rows by "
                           f"{-(-sk // block_k)} key tiles (block_k={block_k})")
    L = _visible_keys_per_row(sq, sk, causal, causal_align)[:, None]  # (sq, 1)
    k0 = np.arange(0, sk, block_k)[None, :]  # (1, nk)
    c = np.clip(L - k0, 0, block_k)  # visible keys of the row in the tile
    C = np.minimum(L, k0 + block_k)  # visible keys up to and including the tile
    return L, c, C


def _per_q_tile(per_row, block_q):
    sq = per_row.shape[0]
    nq = -(-sq // block_q)
    pad = np.zeros((nq * block_q - sq, per_row.shape[1]))
    return np.concatenate([per_row, pad]).reshape(nq, block_q, -1).sum(axis=1)


def expected_rescales(sq, sk, block_q, block_k, *, causal=False, causal_align="bottom_right"):
    """Expected rescale events per tile, ``(n_q_tiles, n_k_tiles)``, for i.i.d. scores.

    With a row's scores i.i.d. over its keys, the largest of the first ``C`` visible keys
    is equally likely to be any of them, so a tile holding ``c`` of them raises the running
    max with probability ``c / C``.  The row's first visible tile is never an event.  For
    ``t`` equal tiles a row expects ``H_t - 1`` events.  Uses ``O(Sq * n_k_tiles)`` memory.
    """
    _, c, C = _tile_key_counts(sq, sk, block_q, block_k, causal, causal_align)
    first = C == c  # the tile that holds the row's first visible key (or none visible)
    p = np.divide(c, C, out=np.zeros(c.shape), where=(c > 0) & ~first)
    return _per_q_tile(p, block_q)


def max_rescales(sq, sk, block_q, block_k, *, causal=False, causal_align="bottom_right"):
    """The most rescale events possible per tile: every visible tile after a row's first.

    Without sinks: a sink is the running max before any key, so a row's first visible tile
    can count too (at most one more event per row with a visible key)."""
    _, c, C = _tile_key_counts(sq, sk, block_q, block_k, causal, causal_align)
    return _per_q_tile(((c > 0) & (C > c)).astype(np.float64), block_q).astype(np.int64)
