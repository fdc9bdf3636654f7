"""Gradients of attention: the dense reference and the tiled FlashAttention-2 backward.

With ``P = softmax(S)`` row by row and ``out = P V``, for an upstream gradient ``dout``::

    dV = P^T dout
    dP = dout V^T
    dS = P * (dP - D),   D_i = sum_j P_ij dP_ij = dout_i . out_i     (softmax Jacobian)
    dT = dS * (1 - tanh(T / c)**2)        with softcap S = c tanh(T / c), else dT = dS
    dQ = scale * dT K,   dK = scale * dT^T Q

where ``T = scale * Q K^T`` are the raw scores.  Masked pairs have ``P = 0`` and so no
gradient; ALiBi is a constant bias and has none of its own.  With GQA, ``dK`` and ``dV``
sum over the query heads that share a kv head.
"""

from __future__ import annotations

import numpy as np

from . import _args
from .masks import SKIP, mask_specs
from .reference import _scores
from .tiled import DEFAULT_TILES, TileSizes, attention, tile_scores

_MASKS = ("causal", "causal_align", "window", "kv_lengths", "q_lengths", "q_segment_ids",
          "kv_segment_ids")
_OPTIONS = _MASKS + ("softcap", "alibi_slopes")


def _check_options(options: dict) -> None:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; accepted: scale, {', '.join(_OPTIONS)}")


def _grad_inputs(pb, check_finite, **arrays):
    """``out``/``dout`` ``(..., Hq, Sq, Dv)`` and ``lse`` ``(..., Hq, Sq)``, checked, as
    grouped views ``(*batch, hk, g, sq[, dv])``."""
    heads = pb.batch + (pb.hq, pb.sq)
    grouped = pb.batch + (pb.hk, pb.group, pb.sq)
    result = []
    for name, x in arrays.items():
        tail = () if name == "lse" else (pb.dv,)
        x = _args.as_float_array(x, name)
        shape = (heads + tail)[1:] if pb.squeeze else heads + tail  # 2-D inputs: no head axis
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
        if check_finite and name == "lse":
            if np.isnan(x).any() or np.isposinf(x).any():
                raise ValueError("lse must be finite or -inf (rows without a visible key)")
        elif check_finite:
            _args.check_finite(x, name)
        result.append(x.reshape(grouped + tail))
    return result


def _split_grads(pb, dq5, dk4, dv4):
    """Grouped ``(dq, dk, dv)`` back to the layout of q, k and v."""
    dq = pb.merge_heads(dq5, 2)
    if pb.squeeze:
        return dq, dk4[0], dv4[0]
    return dq, dk4, dv4


def reference_attention_backward(q, k, v, dout, *, scale=None, return_abs=False,
                                 check_finite=True, **options):
    """Dense float64 gradients ``(dq, dk, dv)`` of `reference_attention` for ``dout``.

    Parameters
    ----------
    q, k, v : array_like
        As in `reference_attention`.
    dout : array_like, shape ``(..., Hq, Sq, Dv)``
        Gradient of the loss with respect to the output.
    scale, causal, causal_align, window, kv_lengths, q_lengths, q_segment_ids,
    kv_segment_ids, softcap, alibi_slopes
        As in `attention`.
    return_abs : bool
        Also return the sizes of what each gradient entry sums, for the error metric
        (`attnlib.gradient_errors`): the same formulas with ``|dout|, |q|, |k|, |v|`` and
        ``|dp| + |D|`` in place of ``dp - D``.

    Returns
    -------
    grads : ``(dq, dk, dv)``, shaped like ``q``, ``k`` and ``v`` (float64)
    sizes : ``(dq_abs, dk_abs, dv_abs)``, if ``return_abs``

    Notes
    -----
    Materialises ``P`` and ``dS`` of shape ``(..., Hq, Sq, Sk)``: the softmax Jacobian
    written out (see the module docstring).  Rows with no visible key have ``P = 0`` and
    contribute nothing.
    """
    _check_options(options)
    q5, k5, v5, pb = _args.parse(q, k, v, scale=scale, check_finite_inputs=check_finite)
    (dout5,) = _grad_inputs(pb, check_finite, dout=dout)
    s = _scores(q5, k5, pb, **options)  # (..., hk, g, sq, sk), -inf where invisible
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    p = np.divide(p, l, out=np.zeros_like(p), where=l > 0)  # P, 0 on rows with no key
    q64, k64, v64 = (x.astype(np.float64) for x in (q5, k5, v5))
    cap = _args.softcap(options.get("softcap"))
    factor = 1.0  # d/dt of c * tanh(t / c) = 1 - tanh(t / c)**2 under softcap
    if cap is not None:
        factor = 1.0 - np.tanh(pb.scale * (q64 @ np.swapaxes(k64, -1, -2)) / cap) ** 2

    def grads(dout5, q64, k64, v64, jacobian):
        dv = np.swapaxes(p, -1, -2) @ dout5  # (..., hk, g, sk, dv)
        dp = dout5 @ np.swapaxes(v64, -1, -2)  # (..., hk, g, sq, sk)
        ds = jacobian(dp, np.sum(p * dp, axis=-1, keepdims=True)) * factor
        dq = pb.scale * (ds @ k64)
        dk = pb.scale * (np.swapaxes(ds, -1, -2) @ q64)
        # GQA: the query heads of a group share k and v, so their gradients add up.
        return _split_grads(pb, dq, dk.sum(axis=-3), dv.sum(axis=-3))

    result = grads(dout5, q64, k64, v64, lambda dp, d: p * (dp - d))  # the softmax Jacobian
    if not return_abs:
        return result
    sizes = grads(np.abs(dout5), np.abs(q64), np.abs(k64), np.abs(v64), lambda dp, d: p * (dp + d))
    return result, sizes


def attention_backward(q, k, v, out, lse, dout, *, scale=None, block_q=None, block_k=None,
                       check_finite=True, **options):
    """Tiled float64 gradients ``(dq, dk, dv)``: the FlashAttention-2 backward pass.

    Parameters
    ----------
    q, k, v : array_like
        As in `attention`.
    out : array_like, shape ``(..., Hq, Sq, Dv)``
    lse : array_like, shape ``(..., Hq, Sq)``
        The forward's output and log-sum-exp (``attention(..., return_lse=True)``).
    dout : array_like, shape ``(..., Hq, Sq, Dv)``
        Gradient of the loss with respect to ``out``.
    scale, causal, causal_align, window, kv_lengths, q_lengths, q_segment_ids,
    kv_segment_ids, softcap, alibi_slopes
        As in `attention`, and equal to the forward's.
    block_q, block_k : int, optional
        Tile sizes (default `DEFAULT_TILES`).

    Returns
    -------
    dq : ndarray, shape of ``q``;  dk : shape of ``k``;  dv : shape of ``v`` (float64)

    Notes
    -----
    Per query tile, ``D_i = rowsum(dout_i * out_i)``; per visible tile the probabilities
    are recomputed from the saved ``lse`` as ``p = exp(s - lse)`` (no second softmax
    pass), then ``dv_j += p^T dout_i``, ``dp = dout_i v_j^T``, ``ds = p * (dp - D_i)``
    (times ``1 - tanh^2`` under softcap), ``dq_i += scale * ds k_j`` and
    ``dk_j += scale * ds^T q_i``.  SKIP tiles are never touched and FULL tiles do no mask
    work, as in the forward.  Rows with ``lse = -inf`` (no visible key) have ``p = 0``
    and contribute exactly zero.  Working memory is a few tile-sized arrays per head,
    independent of ``Sq`` and ``Sk`` (the gradients themselves are the size of the inputs).

    References
    ----------
    T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning", 2023, Algorithm 2.

    Examples
    --------
    >>> import attnlib
    >>> q, k, v = attnlib.random_qkv(200, 300, 32, seed=0)
    >>> out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True)
    >>> dout = attnlib.random_qkv(200, 1, 32, seed=1)[0]
    >>> dq, dk, dv = attnlib.attention_backward(q, k, v, out, lse, dout, causal=True)
    >>> errors = attnlib.gradient_errors((dq, dk, dv), q, k, v, dout, causal=True)
    >>> max(errors["dq"], errors["dk"], errors["dv"]) < 1e-12
    True
    """
    _check_options(options)
    tiles = TileSizes(DEFAULT_TILES.block_q if block_q is None else block_q,
                      DEFAULT_TILES.block_k if block_k is None else block_k)
    q5, k5, v5, pb = _args.parse(q, k, v, scale=scale, check_finite_inputs=check_finite)
    out5, lse5, dout5 = _grad_inputs(pb, check_finite, out=out, lse=lse, dout=dout)
    specs = mask_specs(pb.batch, pb.sq, pb.sk, **{n: options[n] for n in _MASKS if n in options})
    cap = _args.softcap(options.get("softcap"))
    slopes = _args.alibi_slopes(options.get("alibi_slopes"), pb)  # (..., hk, g)
    dq = np.zeros(q5.shape)
    dk = np.zeros(pb.batch + (pb.hk, pb.sk, pb.d))
    dv = np.zeros(pb.batch + (pb.hk, pb.sk, pb.dv))
    for idx, spec in specs.items():  # idx = (): all batch entries share one mask
        _backward(q5[idx], k5[idx], v5[idx], out5[idx], lse5[idx], dout5[idx], pb.scale, spec,
                  tiles, cap, _args.for_entry(slopes, idx),
                  dq[idx], dk[idx], dv[idx])
    return _split_grads(pb, dq, dk, dv)


def _backward(q, k, v, out, lse, dout, scale, spec, tiles, cap, slopes, dq, dk, dv):
    """Tiles of one mask; accumulates into ``dq (*lead, sq, d)``, ``dk, dv (*lead', sk, .)``."""
    bq, bk = tiles.block_q, tiles.block_k
    sq = q.shape[-2]
    k_starts, k_ends, kv_ranges = spec.key_tiles(bk)  # (n_k_tiles,) each
    for q0 in range(0, sq, bq):
        q1 = min(sq, q0 + bq)
        kinds = spec.tile_kind(q0, q1, k_starts, k_ends, kv_ranges)  # (n_k_tiles,)
        todo = np.flatnonzero(kinds != SKIP)
        if not todo.size:
            continue  # rows with no visible key: zero gradient
        rows = np.arange(q0, q1)
        q_i = q[..., q0:q1, :].astype(np.float64) * scale  # (..., bq, d), scaled once
        dout_i = dout[..., q0:q1, :].astype(np.float64)  # (..., bq, dv)
        d_i = np.sum(dout_i * out[..., q0:q1, :], axis=-1)  # D_i = rowsum(dout * out), (..., bq)
        lse_i = lse[..., q0:q1]
        # p = exp(s - lse); rows without a visible key have lse = -inf and only -inf
        # scores, so they are shifted by 0 instead: exp(-inf) = 0, no -inf - (-inf).
        shift = np.where(np.isfinite(lse_i), lse_i, 0.0)[..., None]  # (..., bq, 1)
        dq_i = np.zeros(q_i.shape)
        for b in todo:
            k0, k1 = k_starts[b], k_ends[b]
            k_j = k[..., k0:k1, :].astype(np.float64, copy=False)  # (..., bk, d)
            v_j = v[..., k0:k1, :].astype(np.float64, copy=False)  # (..., bk, dv)
            s, th = tile_scores(q_i, k_j, spec, rows, np.arange(k0, k1), kinds[b], cap, slopes,
                                keep_tanh=True)
            p = np.exp(s - shift)  # (..., bq, bk), the forward's probabilities
            pt = np.swapaxes(p, -1, -2)
            dv[..., k0:k1, :] += np.sum(pt @ dout_i, axis=-3)  # sum over the group's heads
            dp = dout_i @ np.swapaxes(v_j, -1, -2)  # (..., bq, bk)
            ds = p * (dp - d_i[..., None])
            if th is not None:
                ds *= 1.0 - th * th  # softcap: d/dt c tanh(t / c)
            dq_i += ds @ k_j
            dk[..., k0:k1, :] += np.sum(np.swapaxes(ds, -1, -2) @ q_i, axis=-3)  # q_i has the scale
        dq[..., q0:q1, :] = scale * dq_i


def attention_vjp(q, k, v, dout, **options):
    """Forward and backward in one call: ``(out, (dq, dk, dv))``.

    ``options`` are those of `attention_backward` (masks, score options, tiles,
    ``check_finite``), passed to both passes.
    """
    out, lse = attention(q, k, v, return_lse=True, **options)
    return out, attention_backward(q, k, v, out, lse, dout, **options)


__all__ = ["attention_backward", "reference_attention_backward", "attention_vjp"]
