"""The tensors a kernel read and wrote: their layouts, shapes, and how messages name places."""

from __future__ import annotations

import numpy as np

from ..core.arrays import UnusableInput  # raised here and by the core's conversions

LAYOUTS = ("bshd", "bhsd")
TENSORS = ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv")
AXES = {"bshd": "(batch, seqlen, nheads, headdim)", "bhsd": "(batch, nheads, seqlen, headdim)"}


def to_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    """A view of ``x`` in attnlib's ``(..., H, S, D)`` layout."""
    return np.swapaxes(x, -2, -3) if layout == "bshd" and x.ndim >= 3 else x


def other_layout(layout: str) -> str:
    return LAYOUTS[1 - LAYOUTS.index(layout)]


def _dims(x, layout):
    """``(batch, s, h, d)`` of a 2-D, 3-D or 4-D tensor in ``layout`` (batch ``()`` below 4-D, h 1 at 2-D)."""
    if x.ndim == 2:
        return (), x.shape[0], 1, x.shape[1]
    *b, first, second, d = x.shape
    return tuple(b), *((first, second) if layout == "bshd" else (second, first)), d


def shape_problem(given, layout):
    """The first inconsistency as ``(tensor, message)``, or ``(None, dims)`` when consistent."""
    q, k, v = given["q"], given["k"], given["v"]
    if not (q.ndim == k.ndim == v.ndim) or q.ndim not in (2, 3, 4):
        return "q", (f"q, k and v must all be 4-D {AXES[layout]}, 3-D without batch or 2-D "
                     f"(seqlen, headdim); got q {q.shape}, k {k.shape}, v {v.shape}")
    (bq, sq, hq, d), (bk, sk, hk, dk), (bv, sv, hv, dv) = (_dims(x, layout) for x in (q, k, v))
    if bq != bk or bq != bv:
        return "k", f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}"
    if dk != d:
        return "k", f"k has head dim {dk}, q has {d} ({layout} shapes q {q.shape}, k {k.shape})"
    if (sv, hv) != (sk, hk):
        return "v", f"v {v.shape} must have the seqlen and heads of k {k.shape} ({layout})"
    if hq == 0 or hk == 0:
        return "q", f"q and k need at least one head, got {hq} and {hk} ({layout} shapes q {q.shape}, k {k.shape})"
    if hq % hk:
        return "q", f"q has {hq} heads, not a multiple of k's {hk} ({layout} shapes q {q.shape}, k {k.shape})"
    dims = dict(batch=int(np.prod(bq, dtype=np.int64)), sq=sq, sk=sk, hq=hq, hk=hk, d=d, dv=dv,
                squeeze=q.ndim == 2)
    like_q = q.shape[:-1] + (dv,)
    expected = {"out": like_q, "dq": q.shape, "dk": k.shape, "dv": v.shape, "dout": like_q,
                "lse": bq + ((hq,) if q.ndim > 2 else ()) + (sq,), "qv": like_q, "dqv": like_q}
    expected["max_scores"] = expected["dlse"] = expected["lse"]
    for n, shape in expected.items():
        if n in given and given[n].shape != tuple(shape):
            like = "q" if n not in ("lse", "max_scores", "dlse") else "(batch, nheads, seqlen_q)"
            return n, f"{n} must have shape {tuple(shape)} (like {like} in {layout}), got {given[n].shape}"
    return None, dims


def check_shapes(given, layout, names):
    """The problem's dimensions, or UnusableInput naming the tensor (with a layout hint)."""
    bad, found = shape_problem(given, layout)
    if bad is None:
        return found
    other = other_layout(layout)
    hint = ""
    if shape_problem(given, other)[0] is None:
        hint = f"; these shapes fit --layout {other} {AXES[other]}"
    elif bad in ("out", "dout", "dq") and given[bad].ndim >= 3:
        if shape_problem(given | {bad: np.swapaxes(given[bad], -2, -3)}, layout)[0] is None:
            hint = (f"; {bad} looks like {other} {AXES[other]} while the inputs are {layout}: "
                    "the kernel wrote it in the other layout")
    raise UnusableInput(f"{names[bad]}: {found}{hint}")


def positions(pos="query"):
    """Maps an index into the ``(..., H, S, X)`` arrays to the user's words."""
    def describe(idx):
        *lead, s, x = (int(i) for i in idx)
        return {"batch": lead[0] if len(lead) > 1 else 0, pos: s, "head": lead[-1] if lead else 0, "dim": x}
    return describe


def where(p) -> str:
    """``"batch 0, query 5, head 2, dim 7"`` for a position from `positions`."""
    return ", ".join(f"{k} {p[k]}" for k in ("batch", "query", "key", "head", "dim") if k in p)
