"""Row statistics in place of the LSE, ``(max, sum_exp)`` (cuDNN's score_max/score_sum_exp,
tokamax's residuals; docs/semantics.md, "Result"): the oracle and the check."""

import numpy as np
import pytest

import attnlib
from attnlib.check import UnusableInput, check_kernel

SQ = SK = 200
D = 32


def dense_stats(q, k, visible):
    s = np.where(visible, q @ np.swapaxes(k, -1, -2) / np.sqrt(D), -np.inf)
    top = s.max(-1)
    seen = np.isfinite(top)
    total = np.where(seen, np.exp(s - np.where(seen, top, 0.0)[..., None]).sum(-1), 0.0)
    return top, total


@pytest.mark.parametrize("sinks", [None, np.array([0.5, -1.0, 2.0, 0.0])])
def test_max_sum_exp_is_the_keys_statistics_and_judged_as_their_lse(sinks):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, SQ, D)) for _ in range(3))
    i, j = np.arange(SQ)[:, None], np.arange(SK)[None, :]
    options = dict(causal=True, kv_lengths=[150], sinks=sinks)
    visible = (j <= i - 50) & (j < 150)  # bottom-right causal on 150 keys: the first 50 rows see none
    top, total = attnlib.max_sum_exp(q, k, v, **options)
    want_top, want_total = dense_stats(q, k, visible)
    assert np.array_equal(np.isneginf(top), np.isneginf(want_top)) and np.all(total[np.isneginf(top)] == 0)
    seen = np.isfinite(want_top)
    assert np.abs(top[seen] - want_top[seen]).max() < 1e-14
    assert np.abs(total - want_total).max() < 1e-14 * want_total.max()
    top2, total2 = attnlib.max_sum_exp(q, k, v, lse_base=2, **options)
    assert np.array_equal(total2, total) and np.allclose(top2[seen] * np.log(2), top[seen], rtol=1e-15)

    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    out = attnlib.attention(q, k, v, **options).astype(np.float32)
    stats = dict(max_scores=want_top.astype(np.float32), sum_exp=want_total.astype(np.float32))
    verdict = check_kernel(q32, k32, v32, out, layout="bhsd", **stats, **options)
    assert verdict.passed and any(n.startswith("the lse judged is max_scores + log(sum_exp)") for n in verdict.lse.notes)
    base2 = dict(max_scores=(want_top / np.log(2)).astype(np.float32), sum_exp=stats["sum_exp"])
    assert check_kernel(q32, k32, v32, out, layout="bhsd", lse_base=2, **base2, **options).passed
    # a sum taken against a max one unit too low (a stale running max): e times too large
    stale = check_kernel(q32, k32, v32, out, layout="bhsd", max_scores=stats["max_scores"],
                         sum_exp=(want_total * np.e).astype(np.float32), **options)
    assert not stale.passed and stale.lse.passed is False


def test_sum_exp_needs_max_scores_and_no_lse():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 8, D)).astype(np.float32) for _ in range(3))
    top = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(UnusableInput, match="sum_exp is judged with max_scores"):
        check_kernel(q, k, v, q, layout="bhsd", sum_exp=top)
    with pytest.raises(UnusableInput, match="sum_exp must be finite and >= 0"):
        check_kernel(q, k, v, q, layout="bhsd", max_scores=top, sum_exp=top - 1)
    with pytest.raises(UnusableInput, match="sum_exp must have the shape"):
        check_kernel(q, k, v, q, layout="bhsd", max_scores=top, sum_exp=top[..., :4])
