"""The three ways kernels write a row's log-sum-exp, parsed once (`docs/semantics.md`,
"LSE conventions"): its base, whether the attention sink is in it, what empty rows hold.

attnlib's own is base e, the sink included, ``-inf`` on rows with no visible key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from . import problem

#: ``lse_2 = lse / ln 2``: FlashInfer's and JAX Pallas's base-2 LSE times this is attnlib's.
LN2 = math.log(2.0)
SINK = ("included", "excluded")
_EMPTY = {"-inf": -math.inf, "+inf": math.inf, "inf": math.inf}


@dataclass(frozen=True)
class LseConvention:
    """``base``: ``math.e`` or ``2.0``; ``sink``: "included" or "excluded"; ``empty``:
    ``-inf``, ``+inf``, or None (either infinity)."""

    base: float = math.e
    sink: str = "included"
    empty: float | None = None

    @classmethod
    def parse(cls, lse_base=None, lse_sink=None, lse_empty=None) -> "LseConvention":
        """The convention from the user's spelling; ValueError naming the argument."""
        if lse_base is None or (isinstance(lse_base, str) and lse_base == "e") or (
                _is_number(lse_base) and lse_base == math.e):
            base = math.e
        elif (isinstance(lse_base, str) and lse_base == "2") or (_is_number(lse_base) and lse_base == 2):
            base = 2.0
        else:
            raise ValueError(f"lse_base must be 'e' (natural log, the default) or 2, got {lse_base!r}")
        sink = "included" if lse_sink is None else lse_sink
        if not isinstance(sink, str) or sink not in SINK:
            raise ValueError(f"lse_sink must be 'included' (the default) or 'excluded', got {lse_sink!r}")
        if lse_empty is None:
            empty = None
        elif isinstance(lse_empty, str) and lse_empty in _EMPTY:
            empty = _EMPTY[lse_empty]
        elif _is_number(lse_empty) and math.isinf(lse_empty):
            empty = float(lse_empty)
        else:
            raise ValueError(f"lse_empty must be '-inf', '+inf' or None (either), got {lse_empty!r}")
        return cls(base, sink, empty)

    @property
    def factor(self) -> float:
        """What a stored LSE is multiplied by to be natural: 1 or ln 2."""
        return 1.0 if self.base == math.e else LN2

    @property
    def is_default(self) -> bool:
        return self.base == math.e and self.sink == "included" and self.empty is None

    def to_natural(self, lse) -> np.ndarray:
        """A stored LSE in base e (``+-inf`` kept: a product by ln 2 keeps them)."""
        lse = np.asarray(lse, dtype=np.float64)
        return lse if self.factor == 1.0 else lse * self.factor

    def gradient_to_natural(self, dlse) -> np.ndarray:
        """A loss's gradient with respect to a stored LSE as that with respect to the natural
        one: ``lse_2 = lse_e / ln 2``, so ``dL/dlse_e = dL/dlse_2 / ln 2`` (float64)."""
        dlse = np.asarray(dlse, dtype=np.float64)
        return dlse if self.factor == 1.0 else dlse / self.factor

    def from_natural(self, lse):
        """attnlib's LSE (numpy or torch) in this convention's base and empty-row value (the
        sink's place is the caller's: `without_sink`)."""
        if self.factor != 1.0:
            lse = lse / self.factor  # -inf stays -inf
        if self.empty is not None and self.empty > 0:
            lse = _where(lse == -math.inf, math.inf, lse)
        return lse

    def words(self) -> str:
        """How `attnlib.check.format_text` names it."""
        parts = ["base 2" if self.base == 2.0 else "base e"]
        parts.append(f"sink {self.sink}")
        if self.empty is not None:
            parts.append(f"empty rows {'+inf' if self.empty > 0 else '-inf'}")
        return ", ".join(parts)


def parse_for_output(lse_base, lse_sink, lse_empty, return_lse, return_max_scores=False):
    """The convention an entry point returns its lse (and ``max_scores``, in the same base) in,
    or None for attnlib's own; a ValueError naming the argument for one given without
    ``return_lse`` (``lse_base`` alone: or ``return_max_scores``)."""
    conv = LseConvention.parse(lse_base, lse_sink, lse_empty)
    if conv.is_default or (conv.base == math.e and conv.sink == "included" and conv.empty is not None
                           and conv.empty < 0):
        return None
    given = [n for n, x in (("lse_base", lse_base), ("lse_sink", lse_sink), ("lse_empty", lse_empty))
             if x is not None and (not return_max_scores or n != "lse_base")]
    if not return_lse and given:
        raise ValueError(f"{', '.join(given)}: only the returned lse takes a convention; pass return_lse=True")
    return conv


def apply(call, run, *, check_sinks=None):
    """``run(call)``'s result ``(out, [lse], [max_scores], [stats])`` in ``call.convention``
    (an `options.Call`; None: as it is): with the sink excluded, ``run`` attends without the
    sinks and ``out`` is weighted by them after (`without_sink`); ``lse`` and ``max_scores``
    in its base, ``lse``'s empty rows as it says.

    ``check_sinks(sinks)``: the checks the kernel makes of the sinks it is given
    (`check_sinks_for`), returning them as given; called before ``run`` when the sinks are
    taken out of it, so that they are checked, with the same errors, whatever the
    convention."""
    conv, opts = call.convention, call.options
    if conv is None:
        return run(call)
    excluded = call.return_lse and conv.sink == "excluded" and opts.sinks is not None
    if excluded:
        if check_sinks is None:
            raise TypeError("lse_conventions.apply needs check_sinks to take the sinks out of the run")
        sinks = check_sinks(opts.sinks)
    out, *rest = run(replace(call, options=replace(opts, sinks=None)) if excluded else call)
    if call.return_lse:
        if excluded:  # the keys' own lse; out weighted by the sinks after
            out = without_sink(out, rest[0], sinks)
        rest[0] = conv.from_natural(rest[0])
    if call.return_max_scores and conv.factor != 1.0:
        at = 1 if call.return_lse else 0
        rest[at] = rest[at] / conv.factor  # -inf stays -inf
    return (out, *rest)


def without_sink(out, lse, sinks):
    """``out`` with the sinks, from the attention ``(out, lse)`` computed without them: the
    merge of that partial with the sink's (a logit with no value), ``out e^{lse - lse'}``,
    ``lse' = log(e^lse + e^sink)``; rows without a key stay 0.  ``sinks``: ``(Hq,)`` or
    ``(..., Hq)``, as `attention` takes them.  The LSE returned is the keys' own."""
    sink = np.asarray(sinks, dtype=np.float64)
    if np.ndim(lse) == 1:  # 2-D inputs, one head: lse (Sq,), the sinks (1,)
        sink = sink.reshape(())
    sink = sink[..., None]  # (..., Hq, 1) against lse (..., Hq, Sq)
    if isinstance(lse, np.ndarray):
        weight = np.exp(lse - np.logaddexp(lse, sink))  # lse = -inf: exp(-inf) = 0, exactly
        return (out * weight[..., None]).astype(out.dtype, copy=False)  # a low precision's type kept
    torch = _torch_of(lse)
    sink = torch.as_tensor(sink, device=lse.device)
    weight = torch.exp(lse - torch.logaddexp(lse, sink))
    return (out * weight[..., None]).to(out.dtype)


def check_sinks_for(q, k, v, *, paged: bool = False, compute_dtype=None):
    """`apply`'s ``check_sinks`` for an entry point on ``q, k, v`` (as the kernel takes them:
    dequantised, ``qv`` joined): the kernel's own checks of ``sinks``
    (`problem.checked_sinks`; a paged cache's `problem.per_entry` first), against the
    problem of their shapes, in the type ``compute_dtype`` keeps the scores in.  Returns
    the sinks as given (a float numpy array)."""
    def check(sinks):
        dtype = problem.precision(compute_dtype).accumulate
        if not paged:
            return problem.checked_sinks(sinks, problem.of_shapes(q, k, v), dtype)
        shape = tuple(q.shape) if hasattr(q, "shape") else np.shape(q)
        if len(shape) != 4:  # refused by the paged kernel, with its own message
            return np.asarray(problem.as_float_array(sinks, "sinks"))
        batch, hq = int(shape[0]), int(shape[1])
        problem.per_entry(sinks, "sinks", batch, hq)  # the paged kernel's shapes and message
        return problem.checked_sinks(sinks, problem.Problem((batch,), hq, 1, 0, 0, 1, 1, 1.0, False), dtype)
    return check


def _torch_of(x):
    import torch  # only for results already on a torch device
    return torch


def _where(cond, a, b):
    if isinstance(b, np.ndarray):
        return np.where(cond, a, b)
    return _torch_of(b).where(cond, a, b)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


#: attnlib's own: base e, the sink included, either infinity accepted on empty rows.
NATURAL = LseConvention()
