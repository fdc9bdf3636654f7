"""The dense float64 reference: the contract written out with the whole score matrix.

Short and obviously right is its job; it materialises ``(..., Hq, Sq, Sk)`` scores, so
its memory grows as ``Sq * Sk``.  The tiled kernel is tested against it, and it is tested
against hand-built cases.
"""

from __future__ import annotations

import numpy as np

from . import _args
from .masks import MaskSpec


def reference_scores(q, k, *, causal=False, causal_align="bottom_right", scale=None,
                     check_finite=True):
    """The masked score matrix ``s`` of the contract, shape ``(..., Hq, Sq, Sk)``.

    ``s[i, j] = scale * (q[i] . k[j])`` for visible pairs and ``-inf`` otherwise.
    """
    q5, k5, _, pb = _args.parse(q, k, k, scale=scale, check_finite_inputs=check_finite)
    s = _scores(q5, k5, pb, causal, causal_align)
    return pb.merge_heads(s, 2)


def _scores(q5, k5, pb, causal, causal_align):
    mask = MaskSpec(pb.sq, pb.sk, _args.flag(causal, "causal"), causal_align)
    q64 = q5.astype(np.float64)
    k64 = k5.astype(np.float64)
    s = pb.scale * np.matmul(q64, np.swapaxes(k64, -1, -2))  # (..., hk, g, sq, sk)
    visible = mask.visible(np.arange(pb.sq), np.arange(pb.sk))  # (sq, sk)
    return np.where(visible, s, -np.inf)


def reference_attention(q, k, v, *, causal=False, causal_align="bottom_right", scale=None,
                        return_lse=False, check_finite=True):
    """Dense float64 attention, ``softmax(scale * q k^T + mask) v``.

    Parameters
    ----------
    q : array_like, shape ``(..., Hq, Sq, D)`` or ``(Sq, D)``
    k : array_like, shape ``(..., Hk, Sk, D)`` or ``(Sk, D)``
    v : array_like, shape ``(..., Hk, Sk, Dv)`` or ``(Sk, Dv)``
        Real floating arrays; ``Hq % Hk == 0`` (GQA/MQA).  Computed in float64.
    causal : bool
        Query ``i`` sees key ``j`` only if ``j <= i + o``.
    causal_align : {"bottom_right", "top_left"}
        ``o = Sk - Sq`` (FlashAttention >= 2.1) or ``o = 0`` (torch SDPA ``is_causal``).
    scale : float, optional
        Score scale, ``1/sqrt(D)`` by default.
    return_lse : bool
        Also return ``lse: (..., Hq, Sq)``, the natural log of the softmax denominator.
    check_finite : bool
        Refuse inputs holding NaN or inf.

    Returns
    -------
    out : ndarray, shape ``(..., Hq, Sq, Dv)``, float64
    lse : ndarray, shape ``(..., Hq, Sq)``, float64, if ``return_lse``

    Notes
    -----
    A row with no visible key gets ``out = 0`` and ``lse = -inf``.  The max is subtracted
    before ``exp`` (where it is finite) so that nothing overflows and logits of ``-1e4``
    do not all underflow to 0.
    """
    q5, k5, v5, pb = _args.parse(q, k, v, scale=scale, check_finite_inputs=check_finite)
    s = _scores(q5, k5, pb, causal, causal_align)  # (..., hk, g, sq, sk)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # -inf for rows with no key
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))  # masked pairs: exp(-inf) = 0
    l = p.sum(axis=-1, keepdims=True)  # >= 1 where the row sees a key, else 0
    seen = l > 0
    out = np.matmul(p, v5.astype(np.float64))
    out = np.divide(out, l, out=np.zeros_like(out), where=seen)
    out = pb.merge_heads(out, 2)
    if not return_lse:
        return out
    lse = np.full_like(m, -np.inf)
    np.log(l, out=lse, where=seen)
    lse = pb.merge_heads((lse + m)[..., 0], 1)
    return out, lse


def reference_rescales(scores: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """Rescale events per tile, counted independently from a dense score matrix.

    ``scores: (..., Sq, Sk)`` with ``-inf`` on masked pairs (see `reference_scores`).
    For each row the tile maxima are taken in ascending key order; an event is a tile
    whose max strictly exceeds the running max of the tiles before it, when that running
    max is already finite.  Returns int64 ``(..., n_q_tiles, n_k_tiles)``, summed over the
    rows of each query tile, to compare with the kernel's ``stats.rescales``.
    """
    sq, sk = scores.shape[-2:]
    nq, nk = -(-sq // block_q), -(-sk // block_k)
    pad = [(0, 0)] * (scores.ndim - 2) + [(0, nq * block_q - sq), (0, nk * block_k - sk)]
    s = np.pad(scores, pad, constant_values=-np.inf)
    tile_max = s.reshape(s.shape[:-1] + (nk, block_k)).max(axis=-1)  # (..., rows, nk)
    before = np.maximum.accumulate(tile_max, axis=-1)
    before = np.concatenate([np.full_like(before[..., :1], -np.inf), before[..., :-1]], axis=-1)
    events = np.isfinite(before) & (tile_max > before)  # (..., rows, nk)
    events = events.reshape(events.shape[:-2] + (nq, block_q, nk))
    return events.sum(axis=-2, dtype=np.int64)
