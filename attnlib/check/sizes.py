"""Each entry's size in the check's rule (`attnlib.check.rule`): what its rounding errors scale with.

``|ref|`` (errors relative to the whole), the root-sum-square of its terms (independent
roundings of the terms and of their sum) and of how far the scores' rounding moves them
(`reference_sizes`, `score_size`).  Computed by the float64 tiled kernel in the same pass as
the reference (`SizedSoftmax`: the weights squared beside the weights), or, where the kernel's
pieces run elsewhere (a Dask cluster), in a second pass at doubled scores, ``softmax(2 s) =
p**2 / sum p**2`` (`forward_sizes`); in memory bounded in the sequence length either way.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..core import arrays
from ..core.device import as_tensor
from ..core.online import SizedSoftmax
from ..core.options import MASKING, SPARSE, Call, Options
from ..core.tiled import run_call
from ..judge.gate import row_stats


def doubled_options(opts: Options, d) -> Options:
    """``opts`` with every score doubled: ``softmax(2 s) = p**2 / sum p**2``, which gives
    ``sum_j p_j**2 x_j`` as ``attention(q, k, x) * exp(lse(2 s) - 2 lse(s))``."""
    scale = opts.scale if opts.scale is not None else 1.0 / math.sqrt(d)
    doubled = dict(scale=float(2 * scale))
    for key in ("sinks", "alibi_slopes"):
        if getattr(opts, key) is not None:
            doubled[key] = 2 * np.asarray(getattr(opts, key), dtype=np.float64)
    if opts.softcap is not None:  # 2 c tanh(2 t / 2c) = 2 c tanh(t / c)
        doubled["softcap"] = 2 * opts.softcap
    mod = opts.score_mod
    if mod is not None:
        doubled["score_mod"] = lambda score, b, h, i, j: 2 * mod(score / 2, b, h, i, j)
    return replace(opts, **doubled)


def row_masks(opts: Options) -> Options:
    """What `row_stats` is given for a row's score size and visible keys here: the built-in
    masks (the lengths, documents, the 2026 variants), the top-k lists and the scale (not the
    mods).  ``q_lengths`` too: bottom-right causal and windows align on each entry's query
    length (without it, rows that see keys had ``sigma_i = 0`` and a correct float32 kernel's
    LSE failed at 27 times the allowance)."""
    return replace(Options(), **{n: getattr(opts, n) for n in MASKING + SPARSE + ("scale",)})


def reference_sizes(qh, kh, vh, opts: Options, workers=None, device=None):
    """``(ref, ref_lse, rss, dev)``: the float64 tiled reference of ``attention(qh, kh, vh)``
    and its entries' sizes (`sizes_of`), in one pass (`SizedSoftmax`); ``device``: a torch
    device to compute on (inputs moved there), else numpy."""
    dv = vh.shape[-1]
    values = np.empty(vh.shape[:-1] + (3 * dv + 1,))
    values[..., :dv] = vh
    np.multiply(vh, vh, out=values[..., dv:2 * dv])
    values[..., 2 * dv:3 * dv] = vh
    values[..., -1] = 1.0  # sum p**2
    call = replace(Call.bind(options=opts, return_lse=True, workers=workers, device=device), state=SizedSoftmax)
    if device is not None:
        qh, kh, values = (as_tensor(x, "input", device) for x in (qh, kh, values))
    both, ref_lse = (arrays.as_numpy(x, "the reference") for x in run_call(qh, kh, values, call))
    del values
    ref = both[..., :dv]
    rss, dev = sizes_of(ref, both[..., dv:2 * dv], both[..., 2 * dv:3 * dv], both[..., -1:])
    return ref, ref_lse, rss, dev


def sizes_of(ref, p2v2, p2v, w):
    """``(rss, dev)`` from ``sum_j p_j**2 v_j**2``, ``sum_j p_j**2 v_j`` and ``w = sum_j
    p_j**2`` (normalised weights, a sink's counted with ``v = 0``): ``rss = sqrt(sum_j p_j**2
    v_jc**2)`` and ``dev = sqrt(sum_j p_j**2 (v_jc - ref_c)**2)``, the root-sum-square of how far
    each value lies from the output, which every score's rounding error moves the output by
    (``d out = sum_j p_j ds_j (v_j - out)``); ``ref`` None: ``dev`` is None."""
    rss = np.sqrt(np.maximum(p2v2, 0.0))
    if ref is None:
        return rss, None
    dev = ref * w  # p2v2 - 2 ref p2v + ref**2 w, in place: arrays of n * Dv
    dev -= 2 * p2v
    dev *= ref
    dev += p2v2
    return rss, np.sqrt(np.maximum(dev, 0.0, out=dev), out=dev)


def forward_rss(run, qh, kh, vh, opts: Options, ref_lse) -> np.ndarray:
    """``sqrt(sum_j p_ij**2 v_jc**2)`` per entry (`forward_sizes`'s first part)."""
    return forward_sizes(run, qh, kh, vh, opts, None, ref_lse)[0]


def forward_sizes(run, qh, kh, vh, opts: Options, ref, ref_lse):
    """``(rss, dev)`` per output entry (`sizes_of`) from a second tiled pass, ``run``'s, at
    doubled scores over ``[v**2, v]``: for a reference computed by pieces elsewhere (a Dask
    cluster), whose kernel has no `SizedSoftmax`.  ``ref`` None: ``dev`` is None."""
    dv = vh.shape[-1]
    both = np.empty(vh.shape[:-1] + (2 * dv,))
    np.multiply(vh, vh, out=both[..., :dv])
    both[..., dv:] = vh
    out2, lse2 = run(qh, kh, both, doubled_options(opts, qh.shape[-1]))
    del both
    seen = np.isfinite(ref_lse)
    with np.errstate(under="ignore"):  # lse(2 s) <= 2 lse(s): a factor in (0, 1]
        w = np.exp(np.where(seen, lse2 - 2 * np.where(seen, ref_lse, 0.0), -np.inf))[..., None]
    out2 *= w  # [sum p**2 v**2, sum p**2 v]; w = sum p**2
    return sizes_of(ref, out2[..., :dv], out2[..., dv:], w)


def score_size(qh, kh, opts: Options, ref_lse, device=None) -> np.ndarray:
    """``(..., Hq, Sq)``: ``sigma_i + |lse_i|``, the size of a row's scores as a correct
    kernel rounds them: ``sigma_i = max_j |scale| sum_c |q_ic k_jc|`` (`row_stats`, the dot
    products' componentwise size) and ``|lse_i|``, which holds what is added to them
    (ALiBi, a softcap, a score_mod, the sink) and the shift ``s - m`` at the keys that
    weigh; 0 on rows with no visible key."""
    masks = row_masks(opts)
    sigma = row_stats(qh, kh, options=masks, device=None if masks.has_mods else device, dtype=np.float32)[0]
    sigma = np.asarray(arrays.as_numpy(sigma, "sigma"), dtype=np.float64).reshape(ref_lse.shape)
    seen = np.isfinite(ref_lse)
    return np.where(seen, sigma + np.abs(np.where(seen, ref_lse, 0.0)), 0.0)


__all__ = ["doubled_options", "forward_rss", "forward_sizes", "reference_sizes", "row_masks",
           "score_size", "sizes_of"]
