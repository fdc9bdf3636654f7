"""The numerical study: float64 and low-precision paths measured against the long-double oracle.

Each function runs one sweep and returns rows (dicts) for a table or a figure; the
numerics notebook calls them.  Errors are ``max |x - oracle|`` over all outputs, in float64
epsilons where that is the natural unit.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..judge.gate import Gate
from .inputs import adversarial_qkv, random_qkv
from ..core.oracle import oracle_attention
from ..core.problem import precision
from ..core.reference import reference_attention
from ..core.tiled import attention

EPS64 = float(np.finfo(np.float64).eps)
#: The unit roundoff FlashAttention's rule adds per compute type: ``tiled <= 2 naive + eps``.
LOW_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def _max_err(x, oracle) -> float:
    return float(np.abs(np.asarray(x, dtype=np.float64) - oracle).max())


def _rounded(dt, *xs):
    """The inputs a ``dt`` kernel holds: each rounded once to ``dt``, as float64 values
    (FlashAttention's ``attention_ref`` upcasts the kernel's own low-precision inputs)."""
    return tuple(precision(dt).round(x).astype(np.float64) for x in xs)


def _scaled_qkv(n, d, logit_scale, seed, heads=1):
    """Random q, k, v whose scaled logits have standard deviation ``logit_scale``."""
    q, k, v = random_qkv(n, n, d, batch=(1,), heads=heads, seed=seed)
    root = np.sqrt(logit_scale)
    return q * root, k * root, v


def float64_vs_oracle(ns, ds, logit_scales, *, causal=True, seed=0) -> list[dict]:
    """Errors of dense and tiled float64 against the oracle, in float64 epsilons, and each
    one's ratio to one implementation's share of the verdict gate (`~attnlib.judge.gate.Gate`
    with ``oracle=True``: out and lse; <= 1 is within what float64 rounding allows)."""
    rows = []
    for n, d, scale in itertools.product(ns, ds, logit_scales):
        q, k, v = _scaled_qkv(n, d, scale, seed)
        gate = Gate(q, k, v, causal=causal, oracle=True)
        row = {"n": n, "d": d, "logit_std": scale}
        for name, (out, lse) in (
                ("dense", reference_attention(q, k, v, causal=causal, return_lse=True)),
                ("tiled", attention(q, k, v, causal=causal, return_lse=True))):
            judged = gate.judge(out, lse)
            row[f"{name}_eps"] = _max_err(out, gate.ref) / EPS64
            row[f"{name}_gate_ratio"] = max(judged["out_ratio"], judged["lse_ratio"])
        rows.append(row)
    return rows


def precision_vs_oracle(ns, blocks, logit_scales, dtypes, *, d=64, causal=True, seed=0) -> list[dict]:
    """FlashAttention's test rule: tiled vs naive same-precision error, both against the oracle of
    the inputs rounded to that precision (as `attention_ref` upcasts the kernel's own inputs)."""
    rows = []
    for n, scale in itertools.product(ns, logit_scales):
        qkv = _scaled_qkv(n, d, scale, seed, heads=2)
        for dt in dtypes:
            # The oracle of the rounded inputs: both kernels are judged on their arithmetic only.
            q, k, v = _rounded(dt, *qkv)
            oracle = oracle_attention(q, k, v, causal=causal)
            naive = _max_err(reference_attention(q, k, v, causal=causal, compute_dtype=dt), oracle)
            for block in blocks:
                tiled = _max_err(attention(q, k, v, causal=causal, compute_dtype=dt,
                                           block_q=block, block_k=block), oracle)
                rows.append({"dtype": dt, "n": n, "block": block, "logit_std": scale,
                             "tiled_err": tiled, "naive_err": naive,
                             "ratio": tiled / naive if naive else float("nan")})
    return rows


def lazy_rescaling(taus, dtypes, *, n=1024, d=64, block=64, families=(), seed=0) -> list[dict]:
    """Applied rescales and error against the oracle as the lazy threshold ``tau`` varies.

    Each row is judged as an eager kernel of its precision would be: float64 by the verdict
    gate against the oracle (`~attnlib.judge.gate.Gate` with ``oracle=True``: ``out_ratio`` on
    ``out``, ``lse_ratio`` on ``lse``, whose error against the oracle is ``lse_error``, and
    ``gate_ratio``, the larger of the two, <= 1 passes), a lower precision by FlashAttention's
    rule against a naive computation in that precision, on ``out`` and on ``lse``
    (``naive_error``, ``naive_lse_error``; ``out_ratio = error / (2 naive_error + eps)``,
    ``lse_ratio`` likewise, ``rule_ratio`` the larger, <= 1 passes).  The oracle is the reference for both: of the inputs for float64, of the inputs
    rounded to the lower precision for it (so the rounding of the inputs, common to both
    kernels, is not counted as either one's error).
    """
    inputs = {"random": random_qkv(n, d=d, seed=seed)}
    inputs.update({f: adversarial_qkv(f, n, d=d, block_k=block, seed=seed) for f in families})
    rows = []
    for name, qkv in inputs.items():
        gate = Gate(*qkv, causal=True, block_k=block, oracle=True)
        for dt in dtypes:
            # A lower precision against the oracle of its rounded inputs, as in `precision_vs_oracle`.
            q, k, v = qkv if dt == "float64" else _rounded(dt, *qkv)
            if dt == "float64":
                oracle, naive, naive_lse = gate.ref, None, None
            else:
                oracle, oracle_lse = oracle_attention(q, k, v, causal=True, return_lse=True)
                naive_out, naive_lse_out = reference_attention(q, k, v, causal=True, compute_dtype=dt,
                                                               return_lse=True)
                naive, naive_lse = _max_err(naive_out, oracle), _max_err(naive_lse_out, oracle_lse)
            for tau in taus:
                out, lse, stats = attention(q, k, v, causal=True, block_q=block, block_k=block,
                                            rescale_threshold=tau, compute_dtype=dt, return_lse=True,
                                            return_stats=True)
                error = _max_err(out, oracle)
                if dt == "float64":  # the gate's figures
                    judged = gate.judge(out, lse)
                    lse_error, out_ratio, lse_ratio = judged["lse_error"], judged["out_ratio"], judged["lse_ratio"]
                else:  # FlashAttention's rule
                    lse_error = _max_err(lse, oracle_lse)
                    out_ratio, lse_ratio = error / (2 * naive + LOW_EPS[dt]), lse_error / (2 * naive_lse + LOW_EPS[dt])
                ratio = max(out_ratio, lse_ratio)
                rows.append({"inputs": name, "dtype": dt, "tau": tau, "rescales": stats.total_rescales, "error": error,
                             "lse_error": lse_error, "out_ratio": out_ratio, "lse_ratio": lse_ratio,
                             "gate_ratio": ratio if dt == "float64" else None, "naive_error": naive,
                             "naive_lse_error": naive_lse,
                             "rule_ratio": None if dt == "float64" else ratio})  # None: the other precision's rule
    return rows


def elementary_ulps(n=1_000_000, *, seed=0) -> list[dict]:
    """numpy's float64 ``exp`` and ``log`` against long double, in ulps, on this machine.

    ``exp`` on ``x`` uniform in ``[-700, 0]`` (the kernel's exponents are ``<= 0``), ``log``
    on ``[1, 1e6]`` (``log l`` with ``1 <= l <= n``).  The gate allows 4 ulp for each.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for name, fn, x in (("exp", np.exp, rng.uniform(-700.0, 0.0, n)),
                        ("log", np.log, rng.uniform(1.0, 1e6, n))):
        y = fn(x)
        exact = fn(x.astype(np.longdouble))
        ulps = np.abs(y - exact) / np.spacing(y)
        rows.append({"function": name, "samples": n, "max ulp": float(ulps.max()),
                     "mean ulp": float(ulps.mean())})
    return rows
