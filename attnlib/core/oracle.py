"""The extended-precision oracle: the reference computation in more than float64's precision.

Two arithmetics compute the same function as `reference_attention` (same arguments, masks
and score options, the scale and softcap taken exactly as the float64 numbers the float64
paths use):

* ``"longdouble"``: the dense reference in ``np.longdouble``, 64 mantissa bits on x86-64
  Linux; fast, any shape that fits in memory.
* ``"decimal"``: Python's `decimal` module at `DECIMAL_DIGITS` significant digits
  (~166 bits): every product of two float64 numbers is exact at that precision, and
  ``exp``/``ln`` are correctly rounded.  Pure Python, one pair at a time: small shapes only
  (at most `DECIMAL_MAX_WORK` multiply-adds).  Results are rounded once, correctly, to
  float64.

The default is ``"longdouble"`` where it has at least 64 mantissa bits (80-bit x87 on
x86-64 Linux and macOS, a 113-bit software quad on Linux aarch64), else ``"decimal"`` (where
long double is plain float64: Windows, macOS on Apple silicon); `ORACLE_PRECISION` says
which, here.
"""

from __future__ import annotations

import decimal
from decimal import Decimal

import numpy as np

from . import problem
from .options import MODS
from .reference import _dense, dense_options, pair_terms

#: Significant decimal digits of the ``"decimal"`` oracle (about 166 bits).
DECIMAL_DIGITS = 50
#: The largest ``batch * Hq * Sq * Sk * D`` the ``"decimal"`` oracle takes (seconds of work).
DECIMAL_MAX_WORK = 1 << 22

_LONGDOUBLE_BITS = int(np.finfo(np.longdouble).nmant) + 1


def _describe(method: str) -> dict:
    if method == "longdouble":
        return {"method": "longdouble", "dtype": "longdouble", "mantissa_bits": _LONGDOUBLE_BITS,
                "result_dtype": "longdouble"}
    return {"method": "decimal", "dtype": f"decimal ({DECIMAL_DIGITS} digits)",
            "mantissa_bits": int(DECIMAL_DIGITS * np.log2(10)), "result_dtype": "float64"}


#: The default oracle arithmetic on this machine: method, mantissa bits, result dtype.
ORACLE_PRECISION = _describe("longdouble" if _LONGDOUBLE_BITS >= 64 else "decimal")


def oracle_attention(q, k, v, *, method=None, return_lse=False, check_finite=True, **options):
    """Attention in extended precision, an oracle for the float64 paths.

    Parameters
    ----------
    q, k, v, return_lse, check_finite, causal, causal_align, window, kv_lengths, q_lengths,
    q_segment_ids, kv_segment_ids, softcap, alibi_slopes, sinks, scale
        As in `reference_attention`.
    method : {None, "longdouble", "decimal"}
        The arithmetic (see the module docstring); None: `ORACLE_PRECISION`'s.

    Returns
    -------
    out : ndarray, shape ``(..., Hq, Sq, Dv)``: long double for ``"longdouble"`` (so that
        float64 results can be compared with it in units of float64 epsilon), float64
        correctly rounded for ``"decimal"``
    lse : ndarray, shape ``(..., Hq, Sq)``, if ``return_lse``

    Examples
    --------
    >>> import numpy as np, attnlib
    >>> q, k, v = attnlib.random_qkv(50, 60, 16, seed=0)
    >>> oracle = attnlib.oracle_attention(q, k, v, causal=True)
    >>> err = np.abs(attnlib.attention(q, k, v, causal=True) - oracle).max()
    >>> bool(err < 10 * np.finfo(np.float64).eps)
    True
    """
    if method is None:
        method = ORACLE_PRECISION["method"]
    if method not in ("longdouble", "decimal"):
        raise ValueError(f"method must be 'longdouble' or 'decimal', got {method!r}")
    if method == "longdouble" and _LONGDOUBLE_BITS < 64:
        raise ValueError(f"np.longdouble has {_LONGDOUBLE_BITS} mantissa bits here, fewer than "
                         "the oracle needs (64); use method='decimal'")
    opts = dense_options(**options)
    q5, k5, v5, pb = problem.parse(q, k, v, scale=opts.scale, check_finite_inputs=check_finite)
    if method == "longdouble":
        (out,), (lse,), _ = _dense(q5, k5, v5, pb, np.longdouble, opts)
    else:
        work = int(np.prod(pb.batch, dtype=np.int64)) * pb.hq * pb.sq * pb.sk * pb.d
        if work > DECIMAL_MAX_WORK:
            raise ValueError(
                f"the decimal oracle computes pair by pair in Python; batch * Hq * Sq * Sk * D = "
                f"{work:,} exceeds its limit of {DECIMAL_MAX_WORK:,} (use smaller shapes)")
        out, lse = _decimal_dense(q5, k5, v5, pb, opts)
    return (out, lse) if return_lse else out


def _decimal_dense(q5, k5, v5, pb, opts):
    """``(out, lse)`` in the caller's layout, each pair's score and weight in `decimal`."""
    given = sorted(opts.given(MODS))
    if given:
        raise ValueError(f"the decimal oracle does not take {', '.join(given)} (its arithmetic is per pair "
                         "in Decimal); use method='longdouble'")
    sink = problem.sinks(opts.sinks, pb)  # (..., hk, g) or None
    visible, distance, cap, slopes = pair_terms(pb, opts)
    lead = np.broadcast_shapes(q5.shape[:-2], k5.shape[:-2])  # (*batch, hk, g)
    if sink is not None:
        sink = np.broadcast_to(sink, lead)
    q5, k5, v5 = (np.broadcast_to(x, lead + x.shape[-2:]) for x in (q5, k5, v5))
    visible = np.broadcast_to(visible, lead + (pb.sq, pb.sk))
    if distance is not None:
        distance = np.broadcast_to(distance, lead + (pb.sq, pb.sk))
        slopes = np.broadcast_to(slopes, lead)
    out = np.zeros(lead + (pb.sq, pb.dv))
    lse = np.full(lead + (pb.sq,), -np.inf)
    # float -> Decimal is exact, so the inputs, the scale and the cap enter unrounded.
    with decimal.localcontext() as ctx:
        ctx.prec = DECIMAL_DIGITS
        ctx.Emin, ctx.Emax = decimal.MIN_EMIN, decimal.MAX_EMAX  # exp(-1e5) must not underflow
        scale = Decimal(pb.scale)
        c = None if cap is None else Decimal(cap)
        for idx in np.ndindex(lead):
            slope = None if distance is None else Decimal(float(slopes[idx]))
            qs, ks, vs = ([[Decimal(x) for x in row] for row in a[idx].tolist()] for a in (q5, k5, v5))
            for i, q_i in enumerate(qs):
                keys = np.flatnonzero(visible[idx][i]).tolist()
                if not keys and sink is None:
                    continue  # no visible key: out = 0, lse = -inf
                s = []
                for j in keys:
                    t = scale * sum(a * b for a, b in zip(q_i, ks[j]))
                    if c is not None:  # c * tanh(t / c), tanh(x) = 1 - 2 / (exp(2x) + 1)
                        x = t / c
                        # |x| > 64: 2 / (exp(2x) + 1) < 1e-55, below the context's 50 digits
                        t = c * (Decimal(1).copy_sign(x) if abs(x) > 64 else 1 - 2 / ((2 * x).exp() + 1))
                    if distance is not None:
                        t -= slope * Decimal(float(distance[idx][i, j]))
                    s.append(t)
                # Rounded to the context like the scores: a tie with a score stays a tie.
                sink_logit = None if sink is None else +Decimal(float(sink[idx]))
                m = max(s + ([] if sink_logit is None else [sink_logit]))
                p = [(t - m).exp() for t in s]
                l = sum(p) + (0 if sink_logit is None else (sink_logit - m).exp())  # no value
                for e in range(pb.dv):
                    out[idx][i, e] = float(sum(w * vs[j][e] for w, j in zip(p, keys)) / l)
                lse[idx][i] = float(m + l.ln())
    return pb.merge_heads(out, 2), pb.merge_heads(lse, 1)


__all__ = ["oracle_attention", "ORACLE_PRECISION", "DECIMAL_DIGITS"]
