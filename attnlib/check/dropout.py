"""Judging dropout (`docs/semantics.md`, "Dropout"): a kernel's output for a given keep mask, and
the statistics of a kernel's own random keep mask.

**With the mask.**  ``out_i = w_i A_i`` with ``A`` the attention of the kept keys and ``w_i =
exp(lse_keep_i - lse_i) / (1 - p)`` the kept keys' share of the row (`attnlib.core.dropout`), so a
kernel's ``out_i / w_i`` is judged as ``A_i`` by the rule of that problem (its allowance, in the
units of each entry's own size, times ``w_i`` back in the output's units); the diagnosis tries the
usual mistakes (the ``1 / (1 - p)`` missing, ``1 / p`` in its place, the mask inverted, no dropout).

**A kernel's own dropout** (`dropout_statistics`): the keep mask a kernel drew (or rows of it,
read back through ``q = 0``, ``v`` the identity: `keep_rows_from_output`) against independent
Bernoulli(``1 - p``) draws: the keep rate by an exact two-sided binomial test, and the rows' and
columns' kept counts by chi-square tests of their spread against the binomial's (a row or column
structure: correlated draws, a seed reused per row).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..core.dropout import _kept_options, _rate, _share, keep_mod
from ..core import arrays
from ..core.backend import NUMPY
from ..core.options import Options
from ..core.tiled import forward_on
from .sizes import doubled_options, score_size


@dataclass(frozen=True)
class Dropped:
    """A dropout problem judged as its kept keys' attention: ``opts`` that problem's options
    (``base`` the problem's own), ``w (..., Hq, Sq, 1)`` each row's share (0 where no key is
    kept), ``rate`` and ``keep`` (a ``mask_mod``)."""

    opts: Options
    base: Options
    w: np.ndarray
    rate: float
    keep: object
    lse: np.ndarray = None  # (..., Hq, Sq): the whole row's
    kept_out: np.ndarray = None  # (..., Hq, Sq, Dv): the kept problem's attention (float64)
    whole_out: np.ndarray = None  # the whole problem's, without dropout

    @classmethod
    def of(cls, qh, kh, vh, opts: Options, dropout_p, dropout_mask, workers=None, device=None) -> "Dropped":
        rate = _rate(0.0 if dropout_p is None else dropout_p)
        keep = keep_mod(dropout_mask, qh.shape, kh.shape[-2])
        kept = _masked(opts, keep)
        kept_out, lse_keep, whole_out, lse = (np.asarray(x, dtype=np.float64) for o in (kept, opts) for x in
                                              forward_on(qh, kh, vh, o, return_lse=True, workers=workers, device=device))
        return cls(kept, opts, _share(lse_keep, lse, rate, NUMPY), rate, keep, lse, kept_out, whole_out)

    def inverted(self, b, h, i, j):
        """The keep mask inverted (the dropped weights kept), as a ``mask_mod``."""
        return ~np.asarray(self.keep(b, h, i, j), dtype=bool)

    def widened(self, expected, qh, kh, vh, prec, workers=None, device=None):
        """``expected`` (the kept problem's, in units of ``out / w``) with what its allowance leaves
        out: a kernel normalises by the whole row, whose dropped keys' scores it rounds too; each
        moves ``out / w`` by ``p_j ds_j`` times it, ``ds_j`` up to an ulp of the state's type at the
        row's score size ``S_i``: ``sqrt(sum_dropped p_j^2) S_i |ref|`` (root-sum-square, as the rule
        counts the scores' rounding) in the state's ulps, times the allowance's multiple of ulps.
        Without it float32 kernels failed at up to 9.7 (large logits, many keys dropped)."""
        if expected.unit is None:  # float64: the gate's bound
            return expected
        dropped = replace(_masked(self.base, self.inverted), sinks=None)
        lse2 = np.asarray(forward_on(qh, kh, vh, doubled_options(dropped, qh.shape[-1]), return_lse=True,
                                     workers=workers, device=device)[1], dtype=np.float64)  # log sum_dropped exp(2 s)
        seen = np.isfinite(lse2) & np.isfinite(self.lse)
        rss = np.exp(np.where(seen, lse2 / 2 - np.where(seen, self.lse, 0.0), -np.inf))  # sqrt(sum_dropped p^2)
        size = score_size(qh, kh, self.base, self.lse, device) * rss
        multiple = np.divide(expected.allowance, expected.unit, out=np.zeros_like(expected.allowance),
                             where=expected.unit > 0)
        extra = multiple * float(np.finfo(prec.accumulate).eps) * size[..., None] * np.abs(expected.ref)
        # and the type's absolute resolution, which the kernel has in out's units (its weights
        # p_j keep_j / (1 - p) and its output rounded at half the smallest subnormal each) and the kept
        # problem in its own: (tiny / 2) (1 + sum_j |v_j|) (1 / w - 1) more in these units where w < 1
        # (float16 kernels failed at up to 43 in rows whose kept share w << 1: every kept weight subnormal)
        tiny = float(arrays.finfo(prec.compute).smallest_subnormal)
        w = np.broadcast_to(self.w, expected.ref.shape)
        v_sum = np.abs(vh).sum(axis=-2)[..., None, :]  # (..., Hk, 1, Dv): every key's, whatever the mask
        v_sum = np.repeat(v_sum, expected.ref.shape[-3] // max(1, vh.shape[-3]), axis=-3)
        excess = np.maximum(np.divide(1.0, w, out=np.ones_like(extra), where=w > 0) - 1.0, 0.0)
        extra += multiple * (tiny / 2) * (1.0 + v_sum) * excess
        return replace(expected, allowance=expected.allowance + extra)

    def to_kept(self, out):
        """A kernel's ``out`` in the kept problem's units, ``out / w`` (as it is where ``w = 0``:
        there the kept problem's output is 0)."""
        w = np.broadcast_to(self.w, out.shape)
        return np.divide(out, w, out=np.array(out, dtype=np.float64), where=w > 0)

    def diagnose(self, kernel, ref, allowance, qh, kh, vh, workers=None, device=None) -> list:
        """The mistakes a failing ``kernel`` (bhsd, in the output's units) matches, within the
        rule's allowance for the kept problem (per head at its largest) over ``1 - p``: the
        ``1 / (1 - p)`` left out, ``1 / p`` in its place, the keep mask inverted, no dropout."""
        right = ref * np.broadcast_to(self.w, kernel.shape)
        allowance = np.broadcast_to(allowance, kernel.shape)
        head = allowance.reshape(allowance.shape[:-2] + (-1,)).max(axis=-1)[..., None, None]
        # (at the largest share, 1 / (1 - p): a mistake's rows need not be the right output's)
        loose = np.broadcast_to(head, kernel.shape) / (1 - self.rate)
        candidates = [("the dropout scaling 1 / (1 - p) left out", lambda: right * (1 - self.rate))]
        if self.rate:
            candidates.append((f"1 / p (= {1 / self.rate:.4g}) in place of 1 / (1 - p)",
                               lambda: right * (1 - self.rate) / self.rate))
        candidates += [
            ("the keep mask inverted (the dropped weights kept)",
             lambda: _output(qh, kh, vh, self.base, self.rate, self.inverted, workers, device)),
            ("no dropout (every weight kept, unscaled)",
             lambda: self.whole_out)]
        return [f"the output matches dropout with {words}" for words, alt in candidates
                if np.all(np.abs(kernel - alt()) <= loose)]


    def expect_grads(self, qh, kh, vh, douth, dlse, expected, prec, layout, shape, workers=None, device=None,
                     mod_grad=None):
        """The dropout problem's `~attnlib.check.gradrule.ExpectedGrads`: its scores' gradient is
        ``w_i A_ij (dout_i . v_j) - P_ij (D_i - dlse_i)`` (``D_i = dout_i . out_i``, the exact
        dropout output's), the kept problem's gradients for ``dout w`` with ``dlse = D`` (its own
        ``D`` cancelled) plus the whole problem's for ``dout = 0`` with ``dlse - D``, ``D``'s roundings
        in its sizes, as a kernel that computes ``D`` makes them (as
        `attnlib.core.dropout.attention_dropout_backward` computes them), each by its own rule,
        the allowances added; ``expected``: the kept problem's `~attnlib.check.rule.Expected`."""
        from .gradrule import expect_grads

        terms = douth * (expected.ref * self.w)  # D_i's terms, dout_ic out_ic
        d = np.sum(terms, axis=-1)
        kept = expect_grads({}, qh, kh, vh, expected.ref, expected.ref_lse, douth * self.w, prec, self.opts, layout,
                            shape, workers, mod_grad, device, scores=expected.scores, dlse=d)
        whole = expect_grads({}, qh, kh, vh, self.whole_out, self.lse, np.zeros_like(douth), prec, self.base, layout,
                             shape, workers, mod_grad, device, scores=score_size(qh, kh, self.base, self.lse, device),
                             dlse=(0.0 if dlse is None else dlse) - d, d_terms=terms)
        return kept + whole

    def gradient_alternatives(self, qh, kh, vh, douth, dlse, mod_grad=None, workers=None, device=None) -> list:
        """``(words, {name: gradient})``: the dropout gradients' likely mistakes (dense float64): no
        dropout in the backward, the keep mask inverted, the ``1 / (1 - p)`` left out."""
        from ..core.backward import dense_backward

        loss = 0.0 if dlse is None else dlse
        # D_i = dout_i . out_i of the right output: a FlashAttention-style backward reads it from the
        # stored output whatever its own mistake (``ds = p (dp - D + dlse)``: another D is another dlse)
        stored = np.sum(douth * self.kept_out * self.w, -1)

        def grads(keep, factor=1.0, d=None):  # the dropout loss's with ``keep``, dout times ``factor``
            alt = self if keep is self.keep else Dropped.of(qh, kh, vh, self.base, self.rate, keep, workers, device)
            dout = douth * factor
            own = np.sum(dout * alt.kept_out * alt.w, -1)
            d = own if d is None else d
            parts = (dense_backward(qh, kh, vh, dout * alt.w, alt.opts, mod_grad, dlse=own),
                     dense_backward(qh, kh, vh, 0 * dout, self.base, mod_grad, dlse=loss - d))
            return [a + b for a, b in zip(*parts)]

        plain = np.sum(douth * self.whole_out, -1)
        names = ("dq", "dk", "dv", "dsinks")
        found = [("no dropout in the backward (the gradients of attention without it)",
                  dense_backward(qh, kh, vh, douth, self.base, mod_grad, dlse=dlse)),
                 ("the keep mask inverted in the backward", grads(self.inverted)),
                 ("the dropout scaling 1 / (1 - p) left out", grads(self.keep, 1 - self.rate)),
                 ("no dropout in the backward, D = dout . out from the stored output",
                  dense_backward(qh, kh, vh, douth, self.base, mod_grad, dlse=loss + plain - stored)),
                 ("the keep mask inverted in the backward, D = dout . out from the stored output",
                  grads(self.inverted, d=stored)),
                 ("the dropout scaling 1 / (1 - p) left out, D = dout . out from the stored output",
                  grads(self.keep, 1 - self.rate, d=stored))]
        out = []
        for words, g in found:
            g = dict(zip(names, g))
            if "dsinks" in g:
                g["dsinks"] = np.asarray(g["dsinks"])[..., None, None]
            out.append((words, g))
        return out


def _masked(opts: Options, keep) -> Options:
    """``opts`` with ``keep`` (a ``mask_mod``) ANDed into its mask (`attnlib.core.dropout`'s kept problem)."""
    return replace(opts, mask_mod=_kept_options(dict(mask_mod=opts.mask_mod, gather_kv_indices=opts.gather_kv_indices),
                                                keep)["mask_mod"])


def _output(qh, kh, vh, opts, rate, keep, workers, device) -> np.ndarray:
    """The float64 dropout output of ``keep`` (`attnlib.core.dropout.attention_dropout`'s)."""
    dropped = Dropped.of(qh, kh, vh, opts, rate, keep, workers, device)
    return dropped.kept_out * dropped.w


def keep_rows_from_output(out, dropout_p) -> np.ndarray:
    """A kernel's own keep mask, read back from its output on the probe ``q = 0`` (every score 0,
    so each of the ``Sk`` visible keys weighs ``1 / Sk``) and ``v`` the identity (``Dv = Sk``,
    no mask): ``out_ij = keep_ij / (Sk (1 - p))``, so ``keep = out Sk (1 - p) > 1/2``.  ``out``:
    ``(..., Sq, Sk)``, float (the kernel's output, in its type: the nearest value to ``1 / (Sk (1 -
    p))`` is far from 0 in any floating type); returns a boolean array for `dropout_statistics`."""
    rate = _rate(dropout_p)
    x = np.asarray(out, dtype=np.float64)
    if x.ndim < 2 or not x.size or not np.isfinite(x).all():
        raise ValueError(f"out must be a finite array (..., Sq, Sk) from the probe q = 0, v = I, got {x.shape}")
    return x * x.shape[-1] * (1.0 - rate) > 0.5


def dropout_statistics(keep, dropout_p, *, alpha=1e-3) -> dict:
    """Whether a boolean keep mask ``(..., rows, cols)`` (True: kept) is independent
    Bernoulli(``1 - dropout_p``) draws: ``{rate, expected, p_rate, p_rows, p_cols, alpha, passed}``.

    ``p_rate``: the exact two-sided binomial test of the kept count (`scipy.stats.binomtest`);
    ``p_rows``, ``p_cols``: chi-square tests of the kept counts per row (per column), pooled over
    the leading axes, against the binomial spread ``n q (1 - q)`` (a kernel that reuses a seed per
    row, or keeps whole columns, spreads them far more; one that draws too evenly, far less: both
    tails), each where its counts expect at least 5 kept and 5 dropped (else 1: the rate test alone).
    ``passed``: every p-value above ``alpha / 3`` (Bonferroni over the three), so the false-alarm
    rate of a correct kernel is at most ``alpha``."""
    from scipy import stats

    rate = _rate(dropout_p)
    mask = np.asarray(keep)
    if mask.dtype != bool or mask.ndim < 2 or not mask.size:
        raise ValueError(f"keep must be a non-empty boolean array (..., rows, cols), got {mask.dtype} {mask.shape}")
    q = 1.0 - rate
    kept = int(np.count_nonzero(mask))
    p_rate = float(stats.binomtest(kept, mask.size, q).pvalue) if 0 < q < 1 else float(kept == mask.size)
    rows, cols = mask.shape[-2], mask.shape[-1]

    def spread(counts, n):  # chi-square of the counts of n draws each against their binomial spread
        # (only where each count expects 5 kept and 5 dropped: below that the chi-square approximation
        # fails, and numpy's own draws at p = 0.001 failed 22 of 60 times)
        if q in (0.0, 1.0) or counts.size < 2 or min(n * q, n * (1 - q)) < 5:
            return 1.0
        chi2 = float(np.sum((counts - n * q) ** 2) / (n * q * (1 - q)))
        df = counts.size
        low, high = stats.chi2.cdf(chi2, df), stats.chi2.sf(chi2, df)
        return float(min(1.0, 2 * min(low, high)))

    p_rows = spread(mask.sum(axis=-1).ravel(), cols)
    p_cols = spread(mask.sum(axis=-2).ravel(), rows)
    result = dict(rate=kept / mask.size, expected=q, p_rate=p_rate, p_rows=p_rows, p_cols=p_cols, alpha=alpha)
    result["passed"] = min(p_rate, p_rows, p_cols) > alpha / 3
    return result


def calibrate_statistics(rows=128, cols=1024, dropout_p=0.1, runs=1000, errors=(0.001, 0.002, 0.004, 0.008),
                         alpha=1e-3, seed=0) -> dict:
    """`dropout_statistics` measured: its false alarms over ``runs`` masks of independent
    Bernoulli(``1 - dropout_p``) draws (numpy's generator), and, per keep-rate error ``e`` in
    ``errors``, the share of ``runs // 10`` masks drawn at ``1 - dropout_p - e`` it flags; and of
    masks whose rows repeat one row (a seed reused per row) or whose columns repeat (per column).
    ``{rows, cols, dropout_p, alpha, runs, false_alarms, rate_bound, detected: {e: share},
    smallest_detected (the least e flagged in at least 90% of its runs, or None), row_repeat,
    column_repeat}``."""
    rng = np.random.default_rng(seed)
    keep = 1.0 - dropout_p
    false = sum(not dropout_statistics(rng.random((rows, cols)) < keep, dropout_p, alpha=alpha)["passed"]
                for _ in range(runs))
    few = max(1, runs // 10)
    detected = {e: sum(not dropout_statistics(rng.random((rows, cols)) < keep - e, dropout_p, alpha=alpha)["passed"]
                       for _ in range(few)) / few for e in errors}
    repeated = [np.broadcast_to(rng.random((1, cols)) < keep, (rows, cols)) for _ in range(few)]
    by_column = [np.broadcast_to(rng.random((rows, 1)) < keep, (rows, cols)) for _ in range(few)]
    return dict(rows=rows, cols=cols, dropout_p=dropout_p, alpha=alpha, runs=runs, false_alarms=false,
                rate_bound=_upper_bound(false, runs), detected=detected,
                smallest_detected=next((e for e in sorted(errors) if detected[e] >= 0.9), None),
                row_repeat=sum(not dropout_statistics(m, dropout_p, alpha=alpha)["passed"] for m in repeated) / few,
                column_repeat=sum(not dropout_statistics(m, dropout_p, alpha=alpha)["passed"] for m in by_column) / few)


def _upper_bound(failures: int, runs: int, confidence: float = 0.95) -> float:
    """The exact one-sided upper confidence bound on a rate seen ``failures`` times in ``runs``."""
    from scipy import stats
    return 1.0 if failures >= runs else float(stats.beta.ppf(confidence, failures + 1, runs - failures))


__all__ = ["Dropped", "dropout_statistics", "calibrate_statistics", "keep_rows_from_output"]
