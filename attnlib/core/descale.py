"""fp8 descales (FlashAttention 3's ``q_descale, k_descale, v_descale``): attention of the
dequantised values, ``q[b, h] q_descale[b, h // group]``, ``k[b, hk] k_descale[b, hk]``,
``v[b, hk] v_descale[b, hk]`` (`docs/semantics.md`, "fp8 descales"); and block scales (MXFP8,
MXFP4, NVFP4, SageAttention's int8 blocks, per-channel fp8 ``v``): a descale of the data's own
rank whose every axis divides the data's, one factor per block, and a tuple of such factors
multiplied (NVFP4's block and per-tensor scales; `docs/semantics.md`, "Block-scaled inputs").

An fp8 value (4 significant bits) times a float32 descale (24) has 28 bits: exact in float64,
so the dequantised inputs are the ones the kernel's arithmetic means, without a rounding.
"""

from __future__ import annotations

import functools

import numpy as np

from . import device as dev_mod
from .arrays import _is_ml_float, as_float_array, as_numpy

NAMES = ("q_descale", "k_descale", "v_descale")


def given(q_descale=None, k_descale=None, v_descale=None) -> bool:
    return any(x is not None for x in (q_descale, k_descale, v_descale))


def factors(q, k, q_descale=None, k_descale=None, v_descale=None, v=None) -> dict:
    """``{name: float64 array}`` of the descales given, each checked (finite, positive, of a
    shape that broadcasts to ``(*batch, Hk)``) and laid out to multiply ``(..., H, S, D)``:
    ``q_descale`` repeated over each kv head's group of query heads, ``(*batch, Hq, 1, 1)``; a
    block scale (the data's rank) expanded to the data's shape (`_blocks`; ``v``: v, or its
    shape's stand-in, for ``v_descale``'s, default k); a tuple of factors, their product."""
    qs, ks = (tuple(x.shape) if hasattr(x, "shape") else np.shape(x) for x in (q, k))
    lead = qs[:-3]
    hq = qs[-3] if len(qs) >= 3 else 1
    hk = ks[-3] if len(ks) >= 3 else 1
    target = lead + ((hk,) if len(qs) >= 3 else ())
    out = {}
    shapes = {"q_descale": qs, "k_descale": ks, "v_descale": ks if v is None else tuple(np.shape(v))}
    for name, x in zip(NAMES, (q_descale, k_descale, v_descale)):
        if x is None:
            continue
        if isinstance(x, (tuple, list)):  # NVFP4: block scales times a per-tensor scale, multiplied
            if not x:
                raise ValueError(f"{name}: a tuple of factors needs at least one")
            parts = [factors(q, k, v=v, **{name: f})[name] for f in x]
            out[name] = functools.reduce(np.multiply, parts)
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
        if a.ndim == len(shapes[name]) and a.ndim >= 3:  # block scales: one factor per block of the data
            out[name] = _blocks(a, shapes[name], name)
            continue
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


def _blocks(a, shape, name) -> np.ndarray:
    """A block scale ``a`` of the data's rank expanded to the data's ``shape``: along each axis of
    ``n`` entries and ``m`` scales, blocks of ``ceil(n / m)`` (the last may be shorter), which must
    give exactly ``m`` blocks."""
    for axis, (n, m) in enumerate(zip(shape, a.shape)):
        block = -(-n // m) if m else 0
        if not m or -(-n // block) != m:
            raise ValueError(f"{name} of shape {a.shape} is no block scale of the data {tuple(shape)}: along axis "
                             f"{axis}, {m} scales cannot each cover a block of {n} entries")
        if block > 1:
            a = np.repeat(a, block, axis=axis)[(slice(None),) * axis + (slice(0, n),)]
    return a


def descale_variants(factors) -> list:
    """``(words, factors)``: the fp8 descales mishandled (ROCm/aiter 5661, vLLM 51363): ignored
    (all, or one: None), applied twice, or one per-tensor factor for every (batch, kv head)."""
    given = [n for n in NAMES if n in factors]
    varying = {n: f for n, f in factors.items() if np.ptp(f) > 0}
    out = []
    for how, detail, change in (("ignored", "the stored fp8 values attended as they are", lambda f: None),
                                ("applied twice", "to values already dequantised", lambda f: f ** 2)):
        out.append((f"the descales {how} ({detail})", {n: change(factors[n]) for n in given}))
        out += [(f"{n} {how}", {n: change(factors[n])}) for n in given if len(given) > 1]
    for which, pick in (("first", lambda f: f.flat[0]), ("largest", np.max)):
        if varying:
            out.append((f"per-tensor descales (the {which} factor for every batch entry and kv head) "
                        "instead of one per (batch, kv head)",
                        {n: np.full_like(f, pick(f)) for n, f in varying.items()}))
    return [(words, {**factors, **change}) for words, change in out]


def block_variants(scales: dict, q, k, v) -> list:
    """``(words, {name: laid-out factor})``: block scales a kernel reads wrongly: each block
    given its neighbour's scale (the blocks one off along an axis), read as blocks of twice or half
    their size (element ``c`` given scale ``c // size'``, the last past the end), an OCP E8M0 scale read as
    E4M3 (its byte taken for an fp8 number), one scale (the first block's) for the whole tensor.
    ``scales``: the descales as given (bhsd), of which only the block scales count."""
    import ml_dtypes

    shapes = {"q_descale": np.shape(q), "k_descale": np.shape(k), "v_descale": np.shape(v)}
    out = []
    for name, raw in scales.items():
        if isinstance(raw, (tuple, list)) and len(raw) > 1:  # NVFP4's two levels: one of them left out
            out += [(f"{name}'s factor {i} of {len(raw)} left out (NVFP4: its block scales, or its per-tensor "
                     "scale)", {name: factors(q, k, v=v, **{name: tuple(f for j, f in enumerate(raw) if j != i)})[name]})
                    for i in range(len(raw))]
            continue
        if raw is None or np.ndim(raw) != len(shapes[name]) or np.ndim(raw) < 3:
            continue
        a = np.asarray(raw)
        laid = {}
        for axis in range(a.ndim):
            n, m = shapes[name][axis], a.shape[axis]
            if m > 1 and n > m:  # blocks along this axis
                laid[f"{name}'s blocks read one block off along axis {axis - a.ndim} (each block given the next "
                     "block's scale)"] = np.roll(a, -1, axis=axis)
                size = -(-n // m)
                for other in (2 * size, size // 2):  # the scales read as blocks of another size, element by element
                    if other >= 1:
                        at = np.minimum(np.arange(n) // other, m - 1)
                        laid[f"{name}'s scales read as blocks of {other} along axis {axis - a.ndim}, not {size} "
                             "(the wrong block size)"] = np.take(np.asarray(a, dtype=np.float64), at, axis=axis)
        if a.dtype == ml_dtypes.float8_e8m0fnu:
            as_e4m3 = a.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            if np.isfinite(as_e4m3).all() and (as_e4m3 > 0).all():
                laid[f"{name}'s E8M0 scales read as E4M3 (the scale's byte taken for an fp8 number)"] = as_e4m3
        laid[f"{name} one scale for the tensor (its first block's) instead of one per block"] = \
            np.full(a.shape, np.asarray(a, dtype=np.float64).flat[0])
        out += [(words, {name: factors(q, k, v=v, **{name: f})[name]}) for words, f in laid.items()]
    return out


def dequantize(q, k, v, q_descale=None, k_descale=None, v_descale=None, dev=None, qv=None):
    """``(q, k, v, qv)`` times their descales (``qv``, MLA's second query, takes ``q``'s), in
    float64: numpy arrays, or torch tensors on ``dev`` (the inputs are never written).  Inputs
    without a descale (or None) are returned as given."""
    # qv-only scores (q None) may come without k: the kv heads are v's, which k's must equal.
    return scaled(q, k, v, qv, factors(qv if q is None else q, v if k is None else k, q_descale, k_descale,
                                       v_descale, v=v), dev)


def scaled(q, k, v, qv, f: dict, dev=None):
    """``(q, k, v, qv)`` times the laid-out factors ``f`` (`factors`; ``qv`` takes ``q``'s), in
    float64, as `dequantize`."""
    xs = {"q": q, "k": k, "v": v, "qv": qv}
    for name, x in xs.items():
        a = f.get(f"{name[0]}_descale")
        if a is None or x is None:
            continue
        if dev is None:  # (int8 values with their scale, SageAttention's: exact in float64)
            raw = as_numpy(x, name)
            raw = raw.astype(np.float64) if isinstance(raw, np.ndarray) and raw.dtype == np.int8 else raw
            xs[name] = as_float_array(raw, name).astype(np.float64, copy=False) * a
        else:
            torch = dev_mod._torch()
            t = dev_mod.as_tensor(x, name, dev).to(torch.float64)
            xs[name] = t * torch.tensor(a, device=dev)  # a copy: `a` may be a read-only broadcast
    return xs["q"], xs["k"], xs["v"], xs["qv"]
