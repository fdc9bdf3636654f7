"""MLA's second query (FlashAttention 3/4's ``qv``, DeepSeek's absorbed form): scores
``scale (q k^T + qv v^T)``, default ``scale = 1/sqrt(D + Dv)`` (`docs/semantics.md`, "MLA").

The scores are those of one attention with the head dims joined, ``[q, qv] . [k, v]``, so
every entry point computes it as that attention of ``q' = [q, qv]`` and ``k' = [k, v]`` with
the values ``v``: its default scale is ``1/sqrt(D + Dv)`` by itself, and its gradients split
back, ``dq' = [dq, dqv]``, ``dk' = [dk, dv_s]``, with ``dv = dv_p + dv_s`` (``v`` is both a
value and a key).
"""

from __future__ import annotations

import numpy as np

from . import descale
from . import device as dev_mod
from .arrays import as_float_array, check_finite as check_finite_array


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def check(q, k, v, qv):
    """ValueError naming ``qv`` for a shape that does not go with q and v."""
    qs, vs, ws = _shape(qv), _shape(v), (None if q is None else _shape(q))
    if len(qs) < 2 or len(qs) != len(vs):
        raise ValueError(f"qv must have the dimensions of v, (..., Hq, Sq, Dv); got qv {qs} and v {vs}")
    if qs[-1] != vs[-1]:
        raise ValueError(f"qv's last dimension must be v's head dim Dv = {vs[-1]}, got qv {qs}")
    if ws is not None and qs[:-1] != ws[:-1]:
        raise ValueError(f"qv must have q's shape but for its last dimension, got qv {qs} and q {ws}")
    ks = None if q is None or k is None else _shape(k)  # qv-only scores take no k
    if ks is not None and (len(ks) != len(vs) or ks[:-1] != vs[:-1]):
        raise ValueError(f"k and v must have the same heads and keys (joined for qv), got k {ks} and v {vs}")


def join(q, k, v, qv, dev=None, check_finite=True):
    """``(q', k')``: ``[q, qv]`` and ``[k, v]`` along the head dim (``qv`` and ``v`` alone when
    ``q`` is None), in float64: numpy arrays, or torch tensors on ``dev``.  ``check_finite``:
    each part refused by its own name (and index) for NaN or inf, before the join hides it."""
    check(q, k, v, qv)
    names = ("q", "k", "v", "qv")
    if dev is None:
        read = lambda x, n: as_float_array(x, n).astype(np.float64, copy=False)
        cat, finite = np.concatenate, check_finite_array
    else:
        torch = dev_mod._torch()
        read = lambda x, n: dev_mod.as_tensor(x, n, dev).to(torch.float64)
        cat, finite = torch.cat, dev_mod._first_bad  # raises, naming the first NaN or inf
    q, k, v, qv = (None if x is None else read(x, n) for x, n in zip((q, k, v, qv), names))
    if check_finite:
        for x, name in zip((q, k, v, qv), names):
            if x is not None:
                finite(x, name)
    if q is None:
        return qv, v
    return cat((q, qv), -1), cat((k, v), -1)


def split(grads, d: int, has_q: bool):
    """``(dq, dk, dv, dqv, *rest)`` from the joined problem's ``(dq', dk', dv_p, *rest)``:
    ``dq = dq'[..., :D]`` (None without q), ``dqv = dq'[..., D:]``, ``dk = dk'[..., :D]``,
    ``dv = dv_p + dk'[..., D:]``."""
    dq_, dk_, dv, *rest = grads
    if not has_q:
        return (None, None, dv + dk_, dq_, *rest)
    return (dq_[..., :d], dk_[..., :d], dv + dk_[..., d:], dq_[..., d:], *rest)


def inputs(q, k, v, qv=None, paged=False, q_descale=None, k_descale=None, v_descale=None, check_finite=True):
    """``(q, k, v)`` as the kernels take them: dequantised by the fp8 descales
    (`attnlib.core.descale`), then with MLA's ``qv`` joined (`join`); computed where
    torch tensors live (else numpy), so that the results come back in the inputs' kind."""
    if q is None and qv is None:
        raise ValueError("q is None: give q, or qv for MLA's qv-only scores")
    dev = dev_mod.resolve(None, q, k, v, qv)
    if descale.given(q_descale, k_descale, v_descale):
        if paged:  # a page may serve several batch entries, each with its own factors
            raise ValueError("q_descale, k_descale and v_descale cannot be combined with a paged KV "
                             "cache; dequantise the pages, or judge the kernel with attnlib.check")
        q, k, v, qv = descale.dequantize(q, k, v, q_descale, k_descale, v_descale, dev, qv=qv)
    if qv is not None:
        q, k = join(q, k, v, qv, dev, check_finite)
    return q, k, v
