"""A kernel run over a sweep of its own knobs: every setting judged, repeated runs compared.

FlashAttention issues 1647 and 2244: results that change with ``num_splits``, a
"deterministic" backward that is not.  `sweep_kernel` calls the user's kernel once per
setting of the knobs' cartesian product (split counts, GQA packing, tile or page sizes, ...)
and ``repeats`` times more, judges the first result of each setting with `check_kernel`
(the same rule, reference and diagnosis), and records whether the repeated runs are bitwise
equal, tensor by tensor, and how far each setting lies from the first.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ..core.arrays import as_numpy
from .shapes import UnusableInput
from .text import format_text
from .verdict import check_kernel

#: What a kernel may return, by name: ``out`` and optionally these (``dqv``: MLA's, with the
#: check option ``qv``; ``dsinks``: with ``sinks``).
RESULTS = ("out", "lse", "max_scores", "dq", "dk", "dv", "dqv", "dsinks")


@dataclass
class Setting:
    """One setting's outcome: ``knobs`` as passed, the check's verdict and text, whether
    ``repeats`` further runs gave the same bits (``nondeterministic``: the tensors that did
    not), and ``max |t - t_first|`` per tensor against the first setting's."""

    knobs: dict
    passed: bool
    ratio: float
    nondeterministic: list
    spread: dict
    text: str = field(repr=False)


@dataclass
class Sweep:
    settings: list
    repeats: int

    @property
    def failing(self) -> list:
        return [s for s in self.settings if not s.passed]

    @property
    def nondeterministic(self) -> list:
        return [s for s in self.settings if s.nondeterministic]

    def passed(self, deterministic: bool = False) -> bool:
        return not self.failing and not (deterministic and self.nondeterministic)

    def summary(self) -> str:
        """One line per setting: PASS/FAIL, the worst ratio, bitwise repeatability."""
        lines = [f"{len(self.settings)} settings, each run {1 + self.repeats} times"]
        for s in self.settings:
            same = ("repeats bitwise equal" if not s.nondeterministic
                    else f"repeats differ in {', '.join(s.nondeterministic)}")
            spread = ", ".join(f"{n} {x:.2e}" for n, x in s.spread.items())
            lines.append(f"  {_words(s.knobs)}: {'PASS' if s.passed else 'FAIL'} (worst err / allowance "
                         f"{s.ratio:.3g}); {same}" + (f"; max diff from the first setting: {spread}" if spread else ""))
        return "\n".join(lines)


def _words(knobs) -> str:
    return ", ".join(f"{n}={v!r}" for n, v in knobs.items()) or "(defaults)"


def _tensors(result, name="kernel") -> dict:
    """The kernel's return as ``{name: ndarray}``: ``out``, ``(out, lse)``, or a dict of `RESULTS`."""
    if isinstance(result, dict):
        unknown = sorted(set(result) - set(RESULTS))
        if unknown or "out" not in result:
            raise UnusableInput(f"{name} returned a dict with keys {sorted(result)}: it must have 'out' "
                                f"and may have {', '.join(RESULTS[1:])}")
        got = result
    elif isinstance(result, tuple):
        if len(result) != 2:
            raise UnusableInput(f"{name} returned a tuple of {len(result)}: return out, (out, lse), or a dict")
        got = dict(out=result[0], lse=result[1])
    else:
        got = dict(out=result)
    # Copies: a kernel that writes into one buffer call after call must not compare it with itself.
    return {n: np.array(as_numpy(x, n), copy=True) for n, x in got.items() if x is not None}


def _call(kernel, q, k, v, setting, extra):
    try:
        return kernel(q, k, v, **setting, **extra)
    except Exception as e:  # which setting raised, with the kernel's own error chained
        raise RuntimeError(f"the kernel raised at {_words(setting)}: {type(e).__name__}: {e}") from e


def sweep_kernel(kernel, q, k, v, *, knobs: dict, repeats: int = 1, dout=None, **check_options) -> Sweep:
    """Run ``kernel(q, k, v, **setting)`` (and ``dout=`` when given) over every setting of
    ``knobs`` and judge each.

    Parameters
    ----------
    kernel : callable
        Returns ``out``, ``(out, lse)`` or a dict with ``out`` and any of ``lse, dq, dk, dv,
        dqv, dsinks`` (numpy arrays, torch tensors on any device, ...).  Only ``q, k, v``, the
        knobs and ``dout`` are passed to it: a kernel of more inputs (MLA's ``qv``, sinks)
        takes them from its closure, and the check from ``check_options``.
    q, k, v : array
        The inputs, passed to the kernel as they are and judged as `check_kernel` takes them.
    knobs : dict
        ``{name: [values]}``: the kernel's own keyword arguments to sweep, e.g.
        ``{"num_splits": [1, 3], "pack_gqa": [False, True]}`` (every combination).
    repeats : int
        Further runs of each setting, compared bit for bit with its first.
    dout : array, optional
        Passed to the kernel (``dout=``) when given, and to the check for the gradients.
    **check_options
        `check_kernel`'s options: the attention the kernel computes (``causal``,
        ``layout``, ``dtype``, ``window``, ...).
    """
    if not isinstance(knobs, dict) or not all(isinstance(n, str) for n in knobs):
        raise UnusableInput(f"knobs must be a dict of the kernel's argument names to lists of values, got {knobs!r}")
    bad = [n for n, vs in knobs.items() if isinstance(vs, (str, bytes)) or not hasattr(vs, "__iter__")]
    if bad:
        raise UnusableInput(f"knobs {bad}: each must map to a list of values, e.g. {{'num_splits': [1, 3]}}")
    values = {n: list(vs) for n, vs in knobs.items()}
    empty = [n for n, vs in values.items() if not vs]
    if empty:
        raise UnusableInput(f"knobs {empty} have no values to sweep")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise UnusableInput(f"repeats must be an int >= 0, got {repeats!r}")
    extra = {} if dout is None else {"dout": dout}
    settings, first = [], None
    for combo in itertools.product(*values.values()):
        setting = dict(zip(values, combo))
        runs = [_tensors(_call(kernel, q, k, v, setting, extra), f"kernel({_words(setting)})")
                for _ in range(1 + repeats)]
        got = runs[0]
        grads = {n: got.get(n) for n in ("dq", "dk", "dv", "dqv", "dsinks")}
        result = check_kernel(q, k, v, got["out"], lse=got.get("lse"), max_scores=got.get("max_scores"),
                              dout=dout if any(g is not None for g in grads.values()) else None, **grads,
                              **check_options)
        differ = sorted({n for r in runs[1:] for n in got
                         if n not in r or r[n].shape != got[n].shape or r[n].tobytes() != got[n].tobytes()})
        first = got if first is None else first
        spread = {}
        for n, x in got.items():
            if n in first and first[n].shape == x.shape and x is not first[n]:
                with np.errstate(invalid="ignore", over="ignore"):
                    d = np.abs(x.astype(np.float64) - first[n].astype(np.float64))
                spread[n] = float(d.max()) if d.size else 0.0  # NaN where either holds one
        ratio = max((float(t.ratio) for t in result.judged if t.ratio is not None), default=0.0)
        settings.append(Setting(setting, result.passed, ratio, differ, spread, format_text(result)))
    return Sweep(settings, repeats)


__all__ = ["sweep_kernel", "Sweep", "Setting"]
