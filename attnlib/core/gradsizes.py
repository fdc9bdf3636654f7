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
    (the float64 rule's sizes; ``accumulate`` and ``scores`` unused)."""

    accumulate: float = 1.0
    scores: object = None
    componentwise: bool = False

    def bind(self, pb, out5, dout5, cap, xp) -> "_SizedPass":
        """The arrays the passes sum into, grouped as the kernel's ``(*batch, hk, g, ...)``."""
        lead = pb.batch + (pb.hk, pb.group)
        d1 = xp.zeros(lead + (pb.sq,))
        w2 = None
        if self.scores is not None and not self.componentwise:
            # D_i = dout_i . out_i from the output as stored: its entries' roundings, root-sum-square.
            d1 += ((dout5 * xp.operand(out5)) ** 2).sum(-1) ** 0.5
            w = xp.from_host(np.asarray(self.scores, dtype=np.float64).reshape(lead + (pb.sq,)))
            w2 = 1.0 + w * w  # the scores' rounding, relative to p: (1 + w_i**2) on the squares
        return _SizedPass(1.0 if self.componentwise else float(self.accumulate),
                          0.0 if cap is None or self.componentwise else 4 * 2.0 ** -53, d1, w2,
                          xp.zeros(lead + (pb.sq, pb.d)), xp.zeros(pb.batch + (pb.hk, pb.sk, pb.d)),
                          xp.zeros(pb.batch + (pb.hk, pb.sk, pb.dv)), False, 1 if self.componentwise else 2)


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

    def operand(self, x):
        """``x**2`` or ``|x|``: what a term's size multiplies."""
        return x * x if self.power == 2 else abs(x)

    def rows_pass(self) -> "_SizedPass":
        return replace(self, rows=True)

    def at(self, idx) -> "_SizedPass":  # one mask's batch entries
        return replace(self, **{n: None if getattr(self, n) is None else getattr(self, n)[idx]
                                for n in ("d1", "w2", "dq2", "dk2", "dv2")})

    def finish(self, pb, p_sink, sinks):
        """``(dq, dk, dv[, dsinks])``: the sizes in the layouts of the gradients."""
        dq2 = self.dq2
        dq2 *= self.operand(pb.scale)
        # dsinks: sum_i (P_sink_i d1_i)**2 (or P_sink_i d1_i) over the rows of each grouped head.
        dsink2 = None if p_sink is None else self.operand(p_sink * self.d1).sum(-1)
        sizes = _split_grads(pb, dq2, self.dk2, self.dv2, dsink2, sinks)
        return tuple(g ** 0.5 for g in sizes) if self.power == 2 else sizes


__all__ = ["GradSizes"]
