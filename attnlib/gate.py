"""The verdict gate: what float64 rounding allows between two correct attention codes.

The contract's requirement is ``rel_error < 1e-9`` (`~attnlib.metrics.BOUND`).  Correct
float64 code does far better, so a gate at 1e-9 lets a real defect through: an ``exp``
off by ``1e-11 * x`` gives ~1e-11.  This module derives, per query row, how far two
correct float64 computations of the contract (the tiled kernel and the dense reference)
can differ, from a first-order rounding analysis of the operations they both perform, and
`Gate` judges an ``(out, lse)`` pair against it.

The bound
---------
Write ``u = 2**-53`` (float64 unit roundoff).  For query row ``i`` with visible keys
``J_i`` (``n_i`` of them) let

    sigma_i = max_{j in J_i} |scale| * sum_c |q_ic| |k_jc|      (the scores' componentwise size)
    S_i     = sigma_i, or min(sigma_i, cap) with a softcap     (a bound on |s_ij|)
    A_i     = max_{j in J_i} |slope_h| * |i + o - j|           (ALiBi; 0 without)
    N_i     = n_i + 2 T                                         (T = key tiles: one rescale
                                                                 multiply and add each)

One correct implementation makes these errors, each turned into an error of the output
relative to ``P @ |V|`` (the size of what the row sums, the contract's ``rel_error``):

1. *Exponents.*  The score ``scale * q . k`` is a dot product of ``d`` terms plus one
   scaling: ``|ds| <= g(d + 1) * sigma_i``.  The ALiBi addition rounds once
   (``u (S_i + A_i)``), the shift ``s - m`` once (``u |s - m| <= 2 u (S_i + A_i)``), a
   softcap's divide, ``tanh`` and multiply three times (``3 u cap``).  So every exponent
   is off by at most ``delta_i = g(d + 1) sigma_i + u (3 (S_i + A_i) + 3 cap)``.  An
   absolute error ``e_j`` in an exponent is a relative error in ``p_j``, and perturbing
   the weights of ``out = sum p_j v_j / sum p_j`` by relative ``e_j`` moves it by
   ``|sum p_j e_j (v_j - out)| / sum p_j <= 2 max|e_j| (P @ |V|)_i``.
2. *exp* rounds each weight (relative ``C_EXP u``): ``2 C_EXP u``, by the same argument.
   The rescale factors ``alpha`` multiply ``acc`` and ``l`` alike, so their ``exp`` error
   cancels in ``acc / l``; only the multiplies' own roundings remain (counted in ``N_i``).
3. *Sums.*  ``acc = sum p v`` and ``l = sum p`` are accumulated through a chain of at most
   ``N_i`` roundings each: ``g(N_i) (P @ |V|)`` and ``g(N_i) |out|`` (``|out| <= P @ |V|``).
4. The division ``acc / l``: ``u``.

    e_out_i = 2 delta_i + 2 C_EXP u + 2 g(N_i) + u                      (relative to P @ |V|)
    e_lse_i = delta_i + C_EXP u + g(N_i) + C_LOG u log(n_i) + u |lse_i|  (absolute)

(``lse = m + log l``: the exponents' errors, ``l``'s relative error, ``log``'s rounding
on ``log l <= log n_i`` and the final addition.)  Two implementations can differ by the
sum of their errors, so the gate is ``tol = 2 e`` for ``out`` and ``lse``.

``g(n)`` bounds the relative error of ``n`` accumulated roundings.  The worst case is
``n u``, reached only by adversarially correlated roundings; the probabilistic analysis of
Higham & Mary (2019, Thm. 2.4) shows that with rounding errors modelled as independent
and mean zero, ``|error| <= lambda sqrt(n) u`` (to first order) with probability at least
``1 - 2 n exp(-lambda**2 / 2)``.  With ``LAMBDA = 8`` that is ``1 - 2.6e-14 n`` per dot
product, so a whole report run stays within the bound with near certainty; this is the
one modelling assumption of the gate, and the report shows how far below the bound the
measured errors sit.  ``C_EXP = C_LOG = 8`` (4 ulp) is an allowance for numpy's ``exp``
and ``log``, which are within 4 ulp on the platforms numpy documents (the equivalence
report measures them on its machine).

Rows with no visible key have ``tol = 0``: their ``out`` must be exactly 0 and their
``lse`` exactly ``-inf``.

References
----------
N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM 2002,
ch. 3-4 (componentwise bounds of sums and dot products).
N. J. Higham and T. Mary, "A New Approach to Probabilistic Rounding Error Analysis",
SIAM J. Sci. Comput. 41(5), A2815-A2835, 2019.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _args
from .metrics import BOUND, reference_with_abs
from .oracle import oracle_attention
from .reference import reference_scores
from .tiled import DEFAULT_TILES

#: Unit roundoff of float64.
U = 2.0 ** -53
#: Confidence parameter of the probabilistic accumulation bound ``lambda sqrt(n) u``.
LAMBDA = 8.0
#: Allowances, in units of ``u``, for one ``exp`` and one ``log`` (4 ulp each).
C_EXP = 8.0
C_LOG = 8.0


def _g(n):
    """``lambda sqrt(n) u``: the probabilistic bound on ``n`` accumulated roundings."""
    return LAMBDA * np.sqrt(n) * U


@dataclass(frozen=True)
class Tolerance:
    """Per-row gate tolerances, shape ``(..., Hq, Sq)`` each.

    ``out``: on ``|out - ref| / (P @ |V|)``; ``lse``: on ``|lse - ref_lse|`` (absolute).
    ``sigma``, ``visible_keys``: the row's score size and key count they were built from.
    """

    out: np.ndarray
    lse: np.ndarray
    sigma: np.ndarray
    visible_keys: np.ndarray


def tolerance(q, k, v, ref_lse, *, block_k=None, **options) -> Tolerance:
    """The gate's per-row tolerances for ``attention(q, k, v, **options)`` (see module doc).

    ``ref_lse`` is the reference's ``lse`` (for the ``u |lse|`` term); ``block_k`` the
    tiled kernel's key tile (default `DEFAULT_TILES`), which sets the number of rescale
    steps; ``options`` the masking and score arguments.  Materialises ``(..., Sq, Sk)``
    arrays, as the dense reference does.
    """
    q = _args.as_float_array(q, "q")
    k = _args.as_float_array(k, "k")
    block_k = _args.positive_int(DEFAULT_TILES.block_k if block_k is None else block_k, "block_k")
    d, sk = q.shape[-1], k.shape[-2]
    scale = options.pop("scale", None)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cap = _args.softcap(options.get("softcap"))
    slopes = options.pop("alibi_slopes", None)
    plain = {key: val for key, val in options.items() if key != "softcap"}
    # |scale| |q| . |k| on visible pairs, -inf elsewhere: (..., Hq, Sq, Sk).
    size = reference_scores(np.abs(q), np.abs(k), scale=abs(scale), **plain)
    visible = np.isfinite(size)
    n_vis = visible.sum(axis=-1)
    sigma = np.max(size, axis=-1, initial=0.0)
    del size
    s_max = sigma if cap is None else np.minimum(sigma, cap)
    if slopes is not None:
        # -slope * |i + o - j| on visible pairs: the scores of q = 0 with ALiBi only.
        alibi = reference_scores(np.zeros_like(q), k, alibi_slopes=slopes, **plain)
        a_max = np.max(np.abs(alibi, where=visible, out=np.zeros_like(alibi)), axis=-1)
        del alibi
    else:
        a_max = 0.0
    delta = _g(d + 1) * sigma + U * (3 * (s_max + a_max) + (3 * cap if cap is not None else 0.0))
    g_sum = _g(n_vis + 2 * -(-sk // block_k))
    e_out = 2 * delta + (2 * C_EXP + 1) * U + 2 * g_sum
    lse_size = np.abs(np.where(n_vis > 0, ref_lse, 0.0))
    e_lse = (delta + C_EXP * U + g_sum + C_LOG * U * np.log(np.maximum(n_vis, 1))
             + U * lse_size)
    seen = n_vis > 0
    return Tolerance(out=np.where(seen, 2 * e_out, 0.0), lse=np.where(seen, 2 * e_lse, 0.0),
                     sigma=sigma, visible_keys=n_vis)


def _ratio(err, tol):
    """``max err / tol``; where ``tol = 0`` any error at all is infinitely over."""
    over = np.divide(err, tol, out=np.where(err > 0, np.inf, 0.0), where=tol > 0)
    return float(over.max()) if over.size else 0.0


class Gate:
    """The dense reference of one problem with its tolerances; judges ``(out, lse)`` pairs.

    Building it runs the reference once (``out``, ``P @ |V|`` and ``lse``) and the
    tolerances; with ``oracle=True`` the reference is `~attnlib.oracle.oracle_attention`
    (extended precision) and the tolerance one implementation's, half the default; `judge` is then cheap, so many candidate outputs (the real kernel and
    injected defects) can be judged against one reference.

    Examples
    --------
    >>> import attnlib
    >>> from attnlib.gate import Gate
    >>> q, k, v = attnlib.random_qkv(300, 400, 64, seed=0)
    >>> gate = Gate(q, k, v, block_k=64, causal=True)
    >>> out, lse = attnlib.attention(q, k, v, causal=True, block_k=64, return_lse=True)
    >>> gate.judge(out, lse)["passed"]
    True
    >>> gate.judge(out * (1 + 1e-11), lse)["passed"]
    False
    """

    def __init__(self, q, k, v, *, block_k=None, oracle=False, **options):
        self.ref, self.ref_abs, self.ref_lse = reference_with_abs(q, k, v, return_lse=True, **options)
        self.tol = tolerance(q, k, v, self.ref_lse, block_k=block_k, **options)
        self.oracle = bool(oracle)
        if self.oracle:
            # Against the extended-precision oracle only one implementation's error remains:
            # half the tolerance of two.  P @ |V| is a size and stays the float64 one.
            self.ref, self.ref_lse = oracle_attention(q, k, v, return_lse=True, **options)
            self.tol = Tolerance(self.tol.out / 2, self.tol.lse / 2, self.tol.sigma,
                                 self.tol.visible_keys)

    def judge(self, out, lse) -> dict:
        """``rel_error``, ``lse_error`` and their ratios to the gate; ``passed`` when all hold.

        ``out_ratio = max |out - ref| / (P @ |V|) / tol_out`` over entries (``|out - ref|``
        where ``P @ |V| = 0``), ``lse_ratio = max |lse - ref_lse| / tol_lse`` over rows
        (equal infinities, ``-inf`` on rows with no key, count as no error).  Passes when
        ``rel_error < BOUND`` (the contract's requirement) and both ratios are ``<= 1``.
        """
        out = np.asarray(out, dtype=np.float64)
        lse = np.asarray(lse, dtype=np.float64)
        if out.shape != self.ref.shape or lse.shape != self.ref_lse.shape:
            raise ValueError(f"out {out.shape} and lse {lse.shape} must have the reference's "
                             f"shapes {self.ref.shape} and {self.ref_lse.shape}")
        err = np.abs(out - self.ref).astype(np.float64)  # the oracle's long double, too
        err = np.divide(err, self.ref_abs, out=err, where=self.ref_abs > 0)  # (..., Sq, Dv)
        with np.errstate(invalid="ignore"):  # inf - inf: both -inf, no error
            lse_err = np.where(lse == self.ref_lse, 0.0, np.abs(lse - self.ref_lse)).astype(np.float64)
        lse_err = np.where(np.isnan(lse_err), np.inf, lse_err)
        rel = float(err.max()) if err.size else 0.0
        out_ratio = _ratio(err.max(axis=-1, initial=0.0), self.tol.out)
        lse_ratio = _ratio(lse_err, self.tol.lse)
        return {"rel_error": rel, "lse_error": float(lse_err.max()) if lse_err.size else 0.0,
                "out_ratio": out_ratio, "lse_ratio": lse_ratio,
                "passed": bool(rel < BOUND and out_ratio <= 1 and lse_ratio <= 1)}


__all__ = ["Gate", "Tolerance", "tolerance", "U", "LAMBDA", "C_EXP", "C_LOG"]
