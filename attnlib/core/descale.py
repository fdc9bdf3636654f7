"""fp8 descales (FlashAttention 3's ``q_descale, k_descale, v_descale``): attention of the
dequantised values, ``q[b, h] q_descale[b, h // group]``, ``k[b, hk] k_descale[b, hk]``,
``v[b, hk] v_descale[b, hk]`` (`docs/semantics.md`, "fp8 descales").

An fp8 value (4 significant bits) times a float32 descale (24) has 28 bits: exact in float64,
so the dequantised inputs are the ones the kernel's arithmetic means, without a rounding.
"""

from __future__ import annotations

import numpy as np

from . import device as dev_mod
from .arrays import _is_ml_float, as_float_array, as_numpy

NAMES = ("q_descale", "k_descale", "v_descale")


def given(q_descale=None, k_descale=None, v_descale=None) -> bool:
    return any(x is not None for x in (q_descale, k_descale, v_descale))


def factors(q, k, q_descale=None, k_descale=None, v_descale=None) -> dict:
    """``{name: float64 array}`` of the descales given, each checked (finite, positive, of a
    shape that broadcasts to ``(*batch, Hk)``) and laid out to multiply ``(..., H, S, D)``:
    ``q_descale`` repeated over each kv head's group of query heads, ``(*batch, Hq, 1, 1)``."""
    qs, ks = (tuple(x.shape) if hasattr(x, "shape") else np.shape(x) for x in (q, k))
    lead = qs[:-3]
    hq = qs[-3] if len(qs) >= 3 else 1
    hk = ks[-3] if len(ks) >= 3 else 1
    target = lead + ((hk,) if len(qs) >= 3 else ())
    out = {}
    for name, x in zip(NAMES, (q_descale, k_descale, v_descale)):
        if x is None:
            continue
        a = as_numpy(x, name)
        if isinstance(a, np.ndarray) and _is_ml_float(a.dtype):  # bfloat16, float8: exact in float64
            a = a.astype(np.float64)
        if not isinstance(a, np.ndarray) or not (np.issubdtype(a.dtype, np.floating)
                                                  or np.issubdtype(a.dtype, np.integer)):
            raise TypeError(f"{name} must hold real numbers (batch, kv heads), got {getattr(a, 'dtype', type(a))}")
        a = np.asarray(a, dtype=np.float64)
        if not (np.isfinite(a).all() and (a > 0).all()):
            raise ValueError(f"{name} must be finite and positive (the factor that dequantises the "
                             f"stored values), got {a.ravel()[~(np.isfinite(a.ravel()) & (a.ravel() > 0))][:3]}")
        try:
            a = np.broadcast_to(a, target)
        except ValueError:
            raise ValueError(f"{name} must have the shape (batch, kv heads) = {target} (or one that "
                             f"broadcasts to it: a per-tensor scale), got {a.shape}") from None
        if len(qs) >= 3:
            if name == "q_descale":  # each kv head's factor on its group of query heads
                if not hk or hq % hk:
                    continue  # the heads do not group: `problem.parse` says so
                a = np.repeat(a, hq // hk, axis=-1)
            a = a[..., None, None]
        out[name] = a
    return out


def dequantize(q, k, v, q_descale=None, k_descale=None, v_descale=None, dev=None, qv=None):
    """``(q, k, v, qv)`` times their descales (``qv``, MLA's second query, takes ``q``'s), in
    float64: numpy arrays, or torch tensors on ``dev`` (the inputs are never written).  Inputs
    without a descale (or None) are returned as given."""
    # qv-only scores (q None) may come without k: the kv heads are v's, which k's must equal.
    return scaled(q, k, v, qv, factors(qv if q is None else q, v if k is None else k, q_descale, k_descale,
                                       v_descale), dev)


def scaled(q, k, v, qv, f: dict, dev=None):
    """``(q, k, v, qv)`` times the laid-out factors ``f`` (`factors`; ``qv`` takes ``q``'s), in
    float64, as `dequantize`."""
    xs = {"q": q, "k": k, "v": v, "qv": qv}
    for name, x in xs.items():
        a = f.get(f"{name[0]}_descale")
        if a is None or x is None:
            continue
        if dev is None:
            xs[name] = as_float_array(x, name).astype(np.float64, copy=False) * a
        else:
            torch = dev_mod._torch()
            t = dev_mod.as_tensor(x, name, dev).to(torch.float64)
            xs[name] = t * torch.tensor(a, device=dev)  # a copy: `a` may be a read-only broadcast
    return xs["q"], xs["k"], xs["v"], xs["qv"]
