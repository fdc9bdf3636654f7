"""Attention dropout with a given keep mask (`docs/semantics.md`, "Dropout"): FlashAttention's
test reference (``attention_ref(..., dropout_p, dropout_mask)``), exact in float64 and tiled.

``out_i = sum_j p_ij keep_ij v_j / (1 - dropout_p)`` with ``p`` the softmax of the whole row
(``lse`` unchanged).  Computed from two tiled passes: the attention of the kept keys (``keep`` as
one more ``mask_mod``), ``(A, lse_keep)``, and the row's ``lse``; then ``out = w A`` with ``w_i =
exp(lse_keep_i - lse_i) / (1 - dropout_p)``, the kept keys' share of the row.  The backward is
the chain rule through that: the kept problem's backward at ``dout w`` with ``dlse = dout . out``,
plus the whole problem's at ``dlse = -dout . out`` (`attention_backward`'s ``dlse``).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .arrays import as_numpy
from .flex import and_mods, visible_mod


def keep_mod(keep, q_shape: tuple, sk: int):
    """``keep`` as a ``mask_mod(b, h, q_idx, kv_idx)``: a callable as it is, or a boolean array
    that broadcasts to ``(..., Hq, Sq, Sk)`` read at the indices (``b`` the batch entry in C order)."""
    if keep is None:
        raise TypeError("dropout needs its keep mask: dropout_mask (a boolean array or a function "
                        "keep(b, h, q_idx, kv_idx)); for a kernel's own random dropout see "
                        "attnlib.check.dropout_statistics")
    if callable(keep):
        return keep
    mask = np.asarray(as_numpy(keep, "dropout_mask"))
    if mask.dtype != bool:
        raise TypeError(f"dropout_mask must be boolean (True: kept), got {mask.dtype}")
    lead = tuple(q_shape[:-2])  # (*batch, Hq)
    if mask.ndim < 2:
        raise ValueError(f"dropout_mask must broadcast to (..., Hq, Sq, Sk), got shape {mask.shape}")
    batch = lead[:-1]
    flat = mask.reshape((-1,) + mask.shape[-3:]) if mask.ndim >= 3 and mask.ndim - 3 == len(batch) else None
    if flat is None:  # fewer axes: broadcast over the batch (and heads)
        full = (1,) * (len(lead) + 2 - mask.ndim) + mask.shape
        flat = mask.reshape(full).reshape((-1,) + full[-3:]) if len(full) >= 3 else mask
    if (flat.shape[0] not in (1, math.prod(batch)) or flat.shape[1] not in (1, lead[-1] if lead else 1)
            or flat.shape[2] not in (1, q_shape[-2]) or flat.shape[3] not in (1, sk)):
        raise ValueError(f"dropout_mask must broadcast to (..., Hq, Sq, Sk) = {lead + (q_shape[-2], sk)}, "
                         f"got {mask.shape}")

    def from_array(b, h, q_idx, kv_idx):  # a size-1 axis broadcasts: read at index 0
        b, h, i, j = (np.asarray(x) if n > 1 else 0 for x, n in zip((b, h, q_idx, kv_idx), flat.shape))
        return flat[b, h, i, j]

    return from_array


def _rate(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a probability in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def _kept_options(options: dict, keep) -> dict:
    """The options of the kept keys' problem: ``keep`` ANDed into the mask."""
    if options.get("gather_kv_indices") is not None:
        raise ValueError("dropout with gather_kv_indices is not taken: AND the keep mask into the lists")
    own = visible_mod(options.get("mask_mod"), options.get("block_mask"))
    mod = keep if own is None else and_mods(own, keep)
    return {**{n: x for n, x in options.items() if n != "block_mask"}, "mask_mod": mod}


def _share(lse_keep, lse, rate, xp):
    """``w_i = exp(lse_keep_i - lse_i) / (1 - dropout_p)``, ``(..., Sq, 1)``: 0 where no key is kept
    (``lse_keep = -inf``; a row with no key at all has both ``-inf``, its ``lse`` taken as 0)."""
    return (xp.exp(lse_keep - xp.finite_or_zero(lse)) / (1.0 - rate))[..., None]


def attention_dropout(q, k, v, dropout_p, dropout_mask, *, return_lse=False, device=None, **options):
    """Attention with dropout of the weights: ``out = (P * keep) v / (1 - dropout_p)``.

    ``dropout_mask``: the keep mask, True where a weight is kept: a boolean array that
    broadcasts to ``(..., Hq, Sq, Sk)`` (FlashAttention's ``dropout_mask``; ``n^2`` of memory) or
    a function ``keep(b, h, q_idx, kv_idx) -> bool`` like a ``mask_mod`` (any length, flat
    memory).  ``options``: `attention`'s (masks, scale, softcap, sinks, ...).  ``lse`` (with
    ``return_lse``) is the undropped row's, as kernels return it.  Float64 (numpy, or torch on
    ``device``)."""
    from .backend import NUMPY, backend_for
    from .device import resolve
    from .tiled import attention

    rate = _rate(dropout_p)
    keep = keep_mod(dropout_mask, tuple(np.shape(q)), np.shape(k)[-2])
    kept, lse_keep = attention(q, k, v, return_lse=True, device=device, **_kept_options(options, keep))
    _, lse = attention(q, k, v, return_lse=True, device=device, **options)
    dev = resolve(device, q, k, v)
    xp = NUMPY if dev is None else backend_for(dev, None)
    out = kept * _share(lse_keep, lse, rate, xp)
    return (out, lse) if return_lse else out


def attention_dropout_backward(q, k, v, out, lse, dout, dropout_p, dropout_mask, *, dlse=None, device=None,
                               **options):
    """Gradients ``(dq, dk, dv[, dsinks])`` of `attention_dropout` for ``dout`` (and ``dlse``):
    ``ds_ij = p_ij (keep_ij dp_ij / (1 - dropout_p) - D_i + dlse_i)``, ``dv_j = sum_i p_ij keep_ij
    dout_i / (1 - dropout_p)``, ``D_i = dout_i . out_i``; ``out``, ``lse`` the forward's."""
    from .backend import NUMPY, backend_for
    from .backward import attention_backward
    from .device import resolve
    from .tiled import attention

    rate = _rate(dropout_p)
    keep = keep_mod(dropout_mask, tuple(np.shape(q)), np.shape(k)[-2])
    kept_opts = _kept_options(options, keep)
    kept, lse_keep = attention(q, k, v, return_lse=True, device=device, **kept_opts)
    dev = resolve(device, q, k, v, out, lse, dout)
    xp = NUMPY if dev is None else backend_for(dev, None)
    w = _share(lse_keep, lse, rate, xp)
    d_out = (dout * out).sum(-1)  # dout . out: what the kept keys' share carries
    kept_grads = attention_backward(q, k, v, kept, lse_keep, dout * w, dlse=d_out, device=device, **kept_opts)
    whole = attention_backward(q, k, v, out * 0.0, lse, dout * 0.0, dlse=-d_out if dlse is None else dlse - d_out,
                               device=device, **options)
    return tuple(a + b for a, b in zip(kept_grads, whole))


__all__ = ["attention_dropout", "attention_dropout_backward", "keep_mod"]
