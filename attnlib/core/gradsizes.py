"""The check's gradient entry sizes, summed by the tiled backward beside the gradients.

`attnlib.core.backward.tiled_backward` with ``sizes=GradSizes(...)`` gives the root-sum-squares
`attnlib.core.backward.dense_backward` gives with ``return_rss`` (the terms each gradient entry
sums, squared and summed: `attnlib.check.rule`'s sizes), in memory bounded in the sequence length:
a first pass over the tiles sums each row's ``d1_i = sum_j p_ij (|dp_ij| + a |dout_i| . |v_j|)``
(in the order ``dq`` is summed), the second the squares beside the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .gradparts import _split_grads

@dataclass(frozen=True)
class GradSizes:
    """The entry sizes `tiled_backward` sums beside the gradients: `dense_backward`'s ``return_rss``
    with ``rss_accumulate = accumulate`` and, per row, ``w_i = rss_scores (sigma_i + |lse_i|)``
    given as ``scores`` ``(..., Hq, Sq)`` (None: ``rss_scores = 0``); ``componentwise``: its
    ``return_abs`` instead, the gradients' formulas on ``|dout|, |q|, |k|, |v|`` with ``|dp| + |D|``
    (the float64 rule's sizes; ``accumulate`` and ``scores`` unused).

    ``naive``: a low precision whose naive backward (PyTorch's, scores and ``dp`` stored in the
    type) the check runs on a sample of the keys, where each row's normaliser and ``D_i`` cannot be
    its own (they sum every key): the first pass sums them as that backward has them, ``L_i =
    sum_j exp(rnd(s_ij) - lse_i)`` (with the sink's weight) and ``A_i = sum_j rnd(exp(rnd(s_ij) -
    lse_i)) rnd(dp_ij)``, given back as ``(log L_i, A_i / L_i)``: the shift of its LSE and its
    ``D_i`` (`attnlib.check.naive`)."""

    accumulate: float = 1.0
    scores: object = None
    componentwise: bool = False
    naive: object = None  # a `problem.Precision`: also each row's statistics as its naive backward has them
    flush: float = 0.0  # > 0: also what the terms whose weight lies in (0, flush) add to each entry (`_SizedPass.flushed`)
    #: ``(..., Hq, Sq, Dv)``: the terms ``dout_ic out_ic`` of another problem's ``D_i`` that this
    #: one's ``dlse`` carries (dropout's whole problem, `attnlib.check.dropout`): their roundings join
    #: ``D_i``'s size, as a kernel that computes that ``D_i`` rounds them
    d_terms: object = None

    def bind(self, pb, out5, dout5, cap, xp, dlse5=None, e=0) -> "_SizedPass":
        """The arrays the passes sum into, grouped as the kernel's ``(*batch, hk, g, ...)``;
        ``dlse5``: the backward's ``dlse`` or None; ``e``: the exponent ``dout`` was scaled by."""
        lead = pb.batch + (pb.hk, pb.group)
        # D_i - dlse_i: dlse is one more of D_i's terms
        d1 = xp.zeros(lead + (pb.sq,)) if dlse5 is None else abs(dlse5)
        if self.d_terms is not None:
            t = xp.from_host(np.ldexp(np.asarray(self.d_terms, dtype=np.float64), -e).reshape(lead + (pb.sq, -1)))
            d1 = d1 + (abs(t).sum(-1) if self.componentwise else (t * t).sum(-1) ** 0.5)
        w2 = None
        if self.scores is not None and not self.componentwise:
            # D_i = dout_i . out_i from the output as stored: its entries' roundings, root-sum-square.
            d1 += ((dout5 * xp.operand(out5)) ** 2).sum(-1) ** 0.5
            w = xp.from_host(np.asarray(self.scores, dtype=np.float64).reshape(lead + (pb.sq,)))
            w2 = 1.0 + w * w  # the scores' rounding, relative to p: (1 + w_i**2) on the squares
        rows = None if self.naive is None else (xp.zeros(lead + (pb.sq,)), xp.zeros(lead + (pb.sq,)))
        flushed = (() if not self.flush else
                   (xp.zeros(lead + (pb.sq, pb.d)), xp.zeros(pb.batch + (pb.hk, pb.sk, pb.d)),
                    xp.zeros(pb.batch + (pb.hk, pb.sk, pb.dv))))
        return _SizedPass(1.0 if self.componentwise else float(self.accumulate),
                          0.0 if cap is None or self.componentwise else 4 * 2.0 ** -53, d1, w2,
                          xp.zeros(lead + (pb.sq, pb.d)), xp.zeros(pb.batch + (pb.hk, pb.sk, pb.d)),
                          xp.zeros(pb.batch + (pb.hk, pb.sk, pb.dv)), False, 1 if self.componentwise else 2,
                          self.naive, *(rows or (None, None)), float(self.flush), *(flushed or (None,) * 3))


@dataclass(frozen=True)
class _SizedPass:
    """A `GradSizes` bound to a problem: ``d1 (*lead, sq)`` (summed by the first pass, ``rows``),
    ``w2 = 1 + w**2`` or None, and the sums ``dq2, dk2, dv2`` of the terms' sizes to the ``power``
    (2: squares, rooted in `finish`; 1: componentwise) the second pass sums."""

    accumulate: float
    cap: float  # under softcap, 1 - tanh**2 from a rounded tanh is off by up to 4u absolutely
    d1: object
    w2: object
    dq2: object
    dk2: object
    dv2: object
    rows: bool
    power: int = 2
    naive: object = None
    naive_l: object = None  # L_i, (*lead, sq)
    naive_a: object = None  # A_i
    flush: float = 0.0
    fq: object = None  # sum_j |ds_ij| |k_j| over the pairs whose weight is in (0, flush) (times |scale| in `flushed`)
    fk: object = None  # sum_i |ds_ij| |q_i| |scale| over those pairs
    fv: object = None  # sum_i p_ij |dout_i| over those pairs

    def operand(self, x):
        """``x**2`` or ``|x|``: what a term's size multiplies."""
        return x * x if self.power == 2 else abs(x)

    def rows_pass(self) -> "_SizedPass":
        return replace(self, rows=True)

    def at(self, idx) -> "_SizedPass":  # one mask's batch entries
        return replace(self, **{n: None if getattr(self, n) is None else getattr(self, n)[idx]
                                for n in ("d1", "w2", "dq2", "dk2", "dv2", "naive_l", "naive_a", "fq", "fk", "fv")})

    def naive_rows(self, pb, p_sink, xp):
        """``(shift, D)``, ``(..., Hq, Sq)``: the naive's LSE minus the reference's and its ``D_i``
        (0 on rows with no key)."""
        l = self.naive_l if p_sink is None else self.naive_l + p_sink
        seen = l > 0
        shift = xp.log_where(l, seen, xp.zeros(tuple(l.shape)))
        return pb.merge_heads(shift, 1), pb.merge_heads(xp.divide_where(self.naive_a, l, seen), 1)

    def flushed(self, pb, p_sink, delta, sinks):
        """``(dq, dk, dv[, dsinks])``: the size of the terms whose weight ``p`` lies in ``(0, flush)``, what
        a kernel that flushes such weights to zero (GPU exponentials with flush-to-zero) drops from each
        entry; ``dsinks``: ``sum_i p_sink_i |D_i|`` over the rows whose sink weight does."""
        dsink = None
        if p_sink is not None:
            low = (p_sink > 0) & (p_sink < self.flush)
            dsink = (p_sink * abs(delta) * low).sum(-1)
        return _split_grads(pb, self.fq * abs(pb.scale), self.fk, self.fv, dsink, sinks)

    def finish(self, pb, p_sink, sinks):
        """``(dq, dk, dv[, dsinks])``: the sizes in the layouts of the gradients."""
        dq2 = self.dq2
        dq2 *= self.operand(pb.scale)
        # dsinks: sum_i (P_sink_i d1_i)**2 (or P_sink_i d1_i) over the rows of each grouped head, with
        # the scores' rounding, (1 + w_i**2): P_sink = exp(sink - lse) from a rounded lse is off by
        # about u |lse| (with dlse >> D_i, float32 kernels' dsinks failed at 1.2-2.9 without it)
        dsink2 = None if p_sink is None else self.operand(p_sink * self.d1)
        if dsink2 is not None and self.w2 is not None and self.power == 2:
            dsink2 = dsink2 * self.w2
        dsink2 = None if dsink2 is None else dsink2.sum(-1)
        sizes = _split_grads(pb, dq2, self.dk2, self.dv2, dsink2, sinks)
        return tuple(g ** 0.5 for g in sizes) if self.power == 2 else sizes


__all__ = ["GradSizes"]
