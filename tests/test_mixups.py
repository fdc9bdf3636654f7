"""The mix-ups of the 2026 conventions and variants fail and are named (`attnlib.check.mixups`),
and a correct kernel of each problem passes (so the failures are the mix-ups')."""

import numpy as np

import attnlib
import pytest

from attnlib.check import check_kernel, mixups

pytest.importorskip("ml_dtypes")


@pytest.mark.slow
@pytest.mark.parametrize("prec", ["float32", "float8_e4m3fn"])
def test_every_mixup_fails_and_is_named(prec):
    rows = mixups.measure(precisions=(prec,), magnitudes=(1e-2, 1e2), seeds=(0,))
    assert rows and all(r["failed"] and r["named"] for r in rows), [r for r in rows if not r["named"]]
    assert all(t["hit_rate"] == 1.0 for t in mixups.hit_rates(rows))


@pytest.mark.slow
def test_the_right_answer_to_each_mixups_problem_passes():
    """The problems as told, answered right: no mix-up, no failure."""
    from attnlib import attention
    import ml_dtypes

    for prec in ("float32", "float8_e4m3fn"):
        seen = set()
        for name, words, q, k, v, told, tensors in mixups.cases(prec, 1.0, 0):
            key = tuple(sorted((n, str(x)) for n, x in told.items()))
            if key in seen:
                continue
            seen.add(key)
            conv = {n: told[n] for n in ("lse_sink", "lse_empty") if n in told}
            opts = {n: x for n, x in told.items() if n not in conv}
            if prec == "float8_e4m3fn":
                out = attention(q, k, v, compute_dtype=prec, **opts).astype(np.float64)
                stored = [x.astype(ml_dtypes.float8_e4m3fn) for x in (q, k, v)]
                r = check_kernel(*stored, out, layout="bhsd", **told)
            elif "dropout_p" in opts:  # the exact answer with the keep mask, rounded once
                drop = [opts.pop(n) for n in ("dropout_p", "dropout_mask")]
                out = attnlib.attention_dropout(q, k, v, *drop, **opts).astype(np.float32)
                lse = attention(q, k, v, return_lse=True, **opts)[1].astype(np.float32)
                r = check_kernel(q, k, v, out.astype(np.float64), lse=lse, layout="bhsd", dtype=prec, **told)
            else:
                out, lse = attention(q, k, v, return_lse=True, compute_dtype=prec, **opts)
                if conv.get("lse_sink") == "excluded":
                    lse = attention(q, k, v, return_lse=True, compute_dtype=prec,
                                    **{n: x for n, x in opts.items() if n != "sinks"})[1]
                r = check_kernel(q, k, v, out.astype(np.float64), lse=lse, layout="bhsd", dtype=prec, **told)
            assert r.passed is True, (name, r.diagnosis, r.lse.notes if r.lse else None)
