"""`check_kernel`: the verdict on a kernel from the tensors it read and wrote."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from ..core import arrays
from ..core import problem
from ..core import descale, flex, mla, sparse
from ..judge.sizing import dense_fits
from ..core.arrays import as_numpy
from ..core.backward import dense_backward
from ..core.lse_conventions import LseConvention
from ..core.options import Options
from ..core.device import resolve as device_of
from ..core.tiled import forward_on
from .dropout import Dropped
from .diagnosis import (DROPPED, diagnose, diagnose_gradient, diagnose_lse,
                        diagnose_max_scores, guard_grad, guard_mods, row_ratios, trend, variant_alternatives)
from ..judge.packing import unpack_paged, unpack_varlen
from .gradrule import judge_grads
from .rule import (Expected, TensorVerdict, expect, expect_max_scores, judge_lse,
                   judge_max_scores, judge_out, OnDevice)
from .shapes import LAYOUTS, TENSORS, UnusableInput, check_shapes, to_bhsd

#: Entries kept for the histograms (a random sample beyond it).
SAMPLE = 200_000
#: The gradients a kernel may give (``dqv``: MLA's, with ``qv``).
GRADIENTS = ("dq", "dk", "dv", "dqv")


@dataclass
class KernelCheck:
    """Everything `check_kernel` found; `~attnlib.check.format_text` prints it."""

    shape: dict
    options: dict
    dtype: str
    eps: float
    baseline: str  # how the allowance was made
    out: TensorVerdict
    lse: TensorVerdict | None
    grads: dict
    row_err: np.ndarray  # (Sq,) max |kernel - ref| per query position (finite entries)
    row_ratio: np.ndarray  # (Sq,) max |kernel - ref| / allowance per query position
    row_naive_ratio: np.ndarray | None  # (Sq,) the naive baseline's (below float64)
    head_row_ratio: np.ndarray  # (Hq, Sq) max ratio per head and query position (inf: NaN/inf)
    ratios: np.ndarray  # a sample of the kernel's |out - ref| / allowance (for histograms)
    naive_ratios: np.ndarray | None  # the naive baseline's, same entries
    trend: str
    diagnosis: list
    max_scores: TensorVerdict | None = None

    @property
    def judged(self) -> list:
        """The tensors' verdicts: out, then lse and max_scores when given, then the gradients."""
        return [self.out] + [v for v in (self.lse, self.max_scores) if v] + list(self.grads.values())

    @property
    def passed(self) -> bool:
        judged = self.judged
        return all(v.passed is not False for v in judged)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1


def _as_float(x, name, integers=False):
    """``(array, stored dtype)`` for a float array (numpy, ml_dtypes, or a torch tensor or
    any other array `as_numpy` takes), and with ``integers`` an int8 one (quantised values,
    exact in float32), else UnusableInput."""
    x = as_numpy(x, name)
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return x, x.dtype
    if integers and isinstance(x, np.ndarray) and x.dtype == np.int8:
        return x.astype(np.float32), x.dtype
    if isinstance(x, np.ndarray) and arrays._is_ml_float(x.dtype):
        return x.astype(np.float32), x.dtype  # bfloat16, float8: exact in float32
    raise UnusableInput(f"{name}: expected a floating-point array, got {x.dtype}")


def check_kernel(q, k, v, out, *, lse=None, dout=None, dq=None, dk=None, dv=None, dlse=None,
                 layout="bshd", dtype=None, causal=False, causal_align="bottom_right",
                 window=None, softcap=None, scale=None, kv_lengths=None, q_lengths=None, sinks=None,
                 dsinks=None, mask_mod=None, score_mod=None, block_mask=None, score_mod_grad=None,
                 key_leftpad=None, attention_chunk=None, sink_token_length=0,
                 cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, block_table=None,
                 cache_seqlens=None, workers=None, names=None, lse_dtype=None, lse_base=None,
                 lse_sink=None, lse_empty=None, q_descale=None, k_descale=None, v_descale=None,
                 qv=None, dqv=None, gather_kv_indices=None, max_scores=None, scheduler=None,
                 device=None, dropout_p=None, dropout_mask=None, sum_exp=None, k_mean=None,
                 intermediate_dtype=None) -> KernelCheck:
    """Judge a kernel's ``out`` (and ``lse``, gradients) against attnlib's reference.

    The rule (`attnlib.check.rule`): below float64, FlashAttention's test rule in ulps of
    each entry's own size, ``|kernel - ref| <= (2 r + 2) unit`` with ``r`` the largest
    ``|naive - ref| / unit`` over the tensor (per head for gradients), ``naive`` plain
    attention in the kernel's precision; for float64 kernels, the verdict gate's float64 rounding bound
    per row (any tiling).  ``ref`` is attnlib's float64 tiled kernel: any length, bounded
    memory.

    Parameters
    ----------
    q, k, v : array
        The kernel's inputs, as it read them: ``(batch, seqlen, nheads, headdim)`` for
        ``layout="bshd"`` (FlashAttention's), ``(batch, nheads, seqlen, headdim)`` for
        ``"bhsd"`` (PyTorch SDPA's); 3-D without the batch axis, 2-D ``(seqlen, headdim)``.
        numpy floating arrays, ml_dtypes ones (bfloat16, float8), torch tensors on any
        device in any float type, or anything with ``__array__``/``__dlpack__`` (every
        tensor argument: converted exactly, see `attnlib.core.arrays`).
    out : ndarray
        The kernel's output, in the layout of ``q`` with ``headdim`` of ``v``.  NaN or inf
        in it is a failure, reported with its positions.
    lse : ndarray, optional
        ``(batch, nheads, seqlen_q)`` in both layouts (as FlashAttention and PyTorch return
        it); rows without a visible key may hold ``-inf`` or ``+inf``.
    dout, dq, dk, dv : ndarray, optional
        The upstream gradient and the kernel's gradients (layouts of out, q, k, v).
    dlse : ndarray, optional
        The loss's gradient with respect to ``lse``, ``(batch, nheads, seqlen_q)`` like it
        (FlashAttention 4's ``dlse``; ring attention): the gradients judged are those of a loss
        of ``out`` and ``lse`` (`attention_backward`'s ``dlse``; base 2 with ``lse_base=2``).
    layout : {"bshd", "bhsd", "thd"}
        ``thd``: FlashAttention's varlen layout, ``(total, nheads, headdim)`` with
        ``cu_seqlens_q`` and ``cu_seqlens_k`` (and ``lse (nheads, total_q)``).
    dtype : {None, "float64", "float32", "float16", "bfloat16"}
        The kernel's compute precision; default: the type ``q`` is held in.
    causal, causal_align, window, softcap, scale, kv_lengths, q_lengths, sinks
        The attention the kernel computes, as in `attention` (``sinks``: ``(nheads,)`` or
        ``(batch, nheads)``, the logits of attention sinks; ``q_lengths``: padded query
        rows, whose output must be 0).
    key_leftpad, attention_chunk, sink_token_length : optional
        Left-padded keys ``(batch,)``, chunked attention and sink tokens inside a window,
        as in `attention` (FlashAttention's ``cache_leftpad``, ``attention_chunk``,
        ``sink_token_length``).
    intermediate_dtype : {None, "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
        The type the kernel rounds the weights ``p`` to before ``p @ v`` (FlashAttention's
        ``intermediate_dtype``), no wider than ``dtype``: the naive baselines round them alike
        (``docs/semantics.md``); gradients are not judged with it.
    k_mean : ndarray, optional
        SageAttention's K smoothing: the mean key ``(batch, 1, nheads_k, headdim)`` (bshd; ``(batch,
        nheads_k, 1, headdim)`` in bhsd) subtracted before ``k`` was quantised; added back to the
        keys judged (the softmax is unchanged by it, the LSE is not: an LSE of the smoothed keys
        fails, named).
    sum_exp : ndarray, optional
        With ``max_scores``, the row statistics a kernel returns instead of the LSE (cuDNN's
        ``score_max``/``score_sum_exp``, tokamax's residuals): ``sum_exp = sum_j exp(s_ij -
        max_i)`` over the keys (the sink not among them; base 2 with ``lse_base=2``), judged as the
        LSE ``max + log(sum_exp)`` of the keys (`judge_lse`), ``max_scores`` as given.
    dropout_p, dropout_mask : optional
        Dropout with the kernel's keep mask (FlashAttention's ``attention_ref``'s): ``out = (P *
        keep) v / (1 - dropout_p)``; ``dropout_mask`` a boolean array ``(batch, nheads, seqlen_q,
        seqlen_k)`` (True: kept) or a function ``keep(b, h, q_idx, kv_idx)``.  ``out`` is judged as
        the kept keys' attention (`attnlib.check.dropout`), ``lse`` as the undropped row's.
    max_scores : ndarray, optional
        FlexAttention's aux ``max_scores``, ``(batch, nheads, seqlen_q)`` as ``lse``: each row's
        largest visible score (natural units, or base 2 with ``lse_base=2``; ``-inf`` on rows
        without a key), judged entry by entry with the score's own allowance.
    gather_kv_indices : array of int, optional
        Top-k sparse keys, as in `attention`: ``(batch, seqlen_q, topk)`` shared by the heads,
        or per kv head ``(batch, seqlen_q, nheads_k, topk)`` in ``"bshd"`` (FlashMLA's order)
        and ``(batch, nheads_k, seqlen_q, topk)`` in ``"bhsd"``; not with varlen or a paged cache.
    mask_mod, score_mod, block_mask, score_mod_grad : optional
        FlexAttention-style programmable attention, as in `attention` (``score_mod_grad``,
        its derivative, for judging gradients).
    dsinks : array, optional
        The kernel's gradient of the sinks (shape of ``sinks``), judged with the other
        gradients (needs ``dout``).
    workers : int, optional
        Threads for the float64 reference; default: every available CPU.
    names : dict, optional
        How messages name each tensor (e.g. ``{"q": "--q q.npy"}``).
    lse_dtype : dtype, optional
        The type the kernel stored ``lse`` in, when ``lse`` was converted on the way (a
        bfloat16 file read as float32); default ``lse.dtype``.  Its rounding is allowed.
    qv : array, optional
        MLA's second query (FlashAttention 3/4's ``qv``), in ``q``'s layout with ``v``'s head
        dim: the attention judged has scores ``scale (q k^T + qv v^T)``, default scale
        ``1/sqrt(D + Dv)`` (`attnlib.core.mla`).  An output that matches qv ignored, or the
        scale 1/sqrt(D), is diagnosed by name.  ``dqv``: the kernel's gradient of ``qv``,
        judged with the others (``dv`` then sums its value and key parts, `judge_grads`).
    q_descale, k_descale, v_descale : array, optional
        An fp8 kernel's descales ``(batch, nheads_k)`` (FlashAttention 3's): ``q``, ``k``, ``v``
        are the fp8 tensors as stored, the attention judged that of their dequantised values
        (`attnlib.core.descale`); ``dtype`` defaults to float8_e4m3fn for float8_e4m3fn ``q``
        (an fp8 kernel's arithmetic: bfloat16 with ``p`` rounded to fp8).  An output
        that matches the descales ignored, applied twice or per tensor is diagnosed by name.
    lse_base, lse_sink, lse_empty : optional
        The kernel's LSE convention (`attnlib.core.lse_conventions`): ``lse_base`` "e"
        (default) or 2 (FlashInfer, JAX Pallas); ``lse_sink`` "included" (default,
        FlashAttention 4) or "excluded" (FlashMLA: the keys' log-sum-exp only); ``lse_empty``
        "-inf" or "+inf", what rows with no visible key must hold (default: either).  A
        failing LSE that matches another convention is diagnosed by name.
    cu_seqlens_q, cu_seqlens_k, seqused_k : array of int, optional
        A varlen kernel's offsets ``(batch + 1,)`` and used keys ``(batch,)`` (layout
        ``thd``): judged as its sequences padded into a batch (`attnlib.judge.packing`), so
        positions in the verdict are (sequence, position in it).
    block_table, cache_seqlens : array of int, optional
        A paged KV cache: ``k`` and ``v`` are the pages ``(num_blocks, page_size, nheads,
        headdim)``, entry ``b``'s keys its first ``cache_seqlens[b]`` positions through
        ``block_table (batch, max_blocks)``; judged against the contiguous keys.
    scheduler : distributed.Client or str, optional
        Compute the float64 reference (``out``, ``lse`` and ``P @ |V|``) on this Dask
        cluster (a client or a scheduler address) with `attnlib.distributed.attention`,
        for lengths one machine is too slow for; the rest of the check (the naive
        baselines below float64, the float64 bound, the diagnosis) runs here.

    device : str or torch.device, optional
        Where the reference is computed with torch (`attnlib.core.tiled` on the torch backend): the float64
        reference, ``P @ |V|``, the score sizes of the allowance and the tiled naive
        baselines.  Default: the device of ``q``, ``k``, ``v`` and ``out`` when they are torch
        tensors (CUDA tensors are judged on their GPU), else the numpy kernel on the host.
    Returns
    -------
    KernelCheck

    Raises
    ------
    UnusableInput
        Inconsistent shapes (with a hint when the layout looks swapped), non-float data,
        NaN or inf in the inputs; `UnreadableInput` (a TypeError too) for a tensor holding
        no values to read (`attnlib.core.arrays`).  A failing kernel gets a verdict, never
        an exception from its diagnosis (`attnlib.check.diagnosis`).
    """
    names = {n: n for n in TENSORS + ("qv", "dqv", "max_scores", "dlse")} | (names or {})
    try:
        dev = device_of(device, q, k, v, out)  # before any tensor is read to the host
    except (ValueError, TypeError) as e:
        raise UnusableInput(str(e)) from None
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None or layout == "thd"
    if layout not in LAYOUTS + ("thd",):
        raise UnusableInput(f"layout must be one of {LAYOUTS + ('thd',)}, got {layout!r}")
    if varlen and (layout != "thd" or cu_seqlens_q is None or cu_seqlens_k is None):
        raise UnusableInput("the varlen layout takes layout='thd' (--layout thd) with both cu_seqlens_q "
                            "and cu_seqlens_k")
    paged = block_table is not None or cache_seqlens is not None
    if paged and (block_table is None or cache_seqlens is None):
        raise UnusableInput("a paged KV cache needs both block_table and cache_seqlens")
    if varlen and paged:
        raise UnusableInput("varlen offsets and a paged cache together are not judged; give one of them")
    if (seqused_k is not None or paged) and kv_lengths is not None:
        raise UnusableInput("kv_lengths comes from seqused_k or cache_seqlens here: leave it out")
    if varlen and q_lengths is not None:
        raise UnusableInput("q_lengths comes from cu_seqlens_q in the varlen layout: leave it out")
    if dsinks is not None and sinks is None:
        raise UnusableInput("dsinks was given without sinks")
    if dlse is not None and (varlen or paged):
        raise UnusableInput(f"{names.get('dlse', 'dlse')} is judged in the bshd and bhsd layouts: not with varlen "
                            "offsets or a paged cache")
    if sum_exp is not None:  # (max, sum_exp): the keys' LSE, max + log(sum_exp), judged as one
        lse, lse_sink, lse_dtype = _lse_of_stats(max_scores, sum_exp, lse, lse_base, lse_sink, sinks, names)
    if max_scores is not None and varlen:
        raise UnusableInput("max_scores is judged in the bshd and bhsd layouts (batch, nheads, seqlen_q); "
                            "not in the varlen layout thd: pad the sequences into a batch")
    if gather_kv_indices is not None and (varlen or paged):
        raise UnusableInput("gather_kv_indices is judged on a batch of contiguous keys: not with varlen "
                            "offsets or a paged cache")
    try:
        convention = LseConvention.parse(lse_base, lse_sink, lse_empty)
    except ValueError as e:
        raise UnusableInput(str(e)) from None
    given, stored = {}, {}
    if dqv is not None and qv is None:
        raise UnusableInput("dqv was given without qv")
    if q is None:
        raise UnusableInput("q is None: the check judges scores q k^T (+ qv v^T); for MLA's qv-only "
                            "scores give q and k of head dim 0 (np.zeros((..., 0)))")
    scaled = dict(q=q_descale, k=k_descale, v=v_descale)  # int8 values with their scales (SageAttention's)
    for n, x in dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, dq=dq, dk=dk, dv=dv, qv=qv, dqv=dqv,
                     max_scores=max_scores, dlse=dlse).items():
        if x is not None:
            given[n], stored[n] = _as_float(x, names[n], integers=scaled.get(n) is not None)
    try:  # the lists in attnlib's order, against q as read
        gather_kv_indices = sparse.in_bhsd(as_numpy(gather_kv_indices, names.get("gather_kv_indices",
                                                                                 "gather_kv_indices")), layout,
                                           given["q"].shape)
    except ValueError as e:
        raise UnusableInput(str(e)) from None
    if sinks is not None:
        sinks = _as_float(sinks, names.get("sinks", "sinks"))[0].astype(np.float64)
    layout_note = ""
    if varlen:
        given, q_lengths, kv_lengths = unpack_varlen(given, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks, names,
                                                     convention)
        layout = "bshd"
        layout_note = "varlen (thd): judged as its sequences padded into a batch, (sequence, position) below"
    elif paged:
        given, kv_lengths = unpack_paged(given, layout, block_table, cache_seqlens, names)
        layout_note = "a paged KV cache: judged against its keys gathered in order"
    shape = check_shapes(given, layout, names)
    empty_dims = [n for n in ("batch", "sq") if shape[n] == 0]
    if empty_dims:
        raise UnusableInput(f"{names['q']}: the problem is empty ({', '.join(empty_dims)} = 0): there "
                            "is no output to judge")
    for n in ("q", "k", "v", "dout", "qv", "dlse"):
        if n in given and not np.isfinite(given[n]).all():
            bad = np.argwhere(~np.isfinite(given[n]))[:3].tolist()
            raise UnusableInput(f"{names[n]}: holds NaN or inf (first at {bad}); the inputs must be finite")
    if (any(n in given for n in GRADIENTS) or dsinks is not None) and "dout" not in given:
        raise UnusableInput("gradients were given without dout (the upstream gradient they answer)")
    if "dlse" in given:
        if "dout" not in given:
            raise UnusableInput(f"{names['dlse']} was given without dout: the gradients answer "
                                "both (pass zeros for a loss of the lse alone)")
        if convention.sink == "excluded" and sinks is not None:
            raise UnusableInput(f"{names['dlse']} with lse_sink='excluded': the gradient of the "
                                "sink-free LSE is not judged (pass the LSE's with the sink included)")
    if dsinks is not None:
        dsinks = _as_float(dsinks, names.get("dsinks", "dsinks"))[0]
    try:
        prec = problem.precision(dtype if dtype is not None else stored["q"].name)
    except ValueError:
        given_as = f"{dtype!r}" if dtype is not None else f"q's storage type {stored['q'].name}"
        raise UnusableInput(f"dtype: the kernel's compute precision must be one of float64, float32, "
                            f"float16, bfloat16, float8_e4m3fn; got {given_as} (pass dtype=/--dtype)") from None
    if intermediate_dtype is not None:
        try:
            prec = problem.precision(prec, intermediate_dtype)
        except ValueError as e:
            raise UnusableInput(str(e)) from None
        if any(n in given for n in GRADIENTS) or dsinks is not None:
            raise UnusableInput("gradients are not judged with intermediate_dtype (no backward rounds p to "
                                "another type here): leave intermediate_dtype or the gradients out")
    kv_lengths, q_lengths, key_leftpad = (as_numpy(x, names.get(n, n)) for x, n in (
        (kv_lengths, "kv_lengths"), (q_lengths, "q_lengths"), (key_leftpad, "key_leftpad")))
    if block_mask is not None:
        # The rule runs the reference at other tilings too (the naive baselines): the mask,
        # not one tiling's map of it (a mask_mod and another function's block mask: both).
        try:
            mask_mod = flex.visible_mod(mask_mod, block_mask)
        except TypeError as e:
            raise UnusableInput(str(e)) from None
    qh, kh, vh = (to_bhsd(given[n], layout).astype(np.float64) for n in ("q", "k", "v"))
    qvh = None if "qv" not in given else to_bhsd(given["qv"], layout).astype(np.float64)
    factors, scales = {}, {}  # the fp8 descales, laid out on (..., H, S, D), and as given (bhsd)
    if descale.given(q_descale, k_descale, v_descale):
        if any(n in given for n in GRADIENTS) or dsinks is not None:
            raise UnusableInput("gradients are not judged with fp8 descales (FlashAttention 3's fp8 "
                                "path is forward only): leave the descales or the gradients out")
        try:
            scales = {n: _descale_in(x, names.get(n, n), layout, qh.ndim)
                      for x, n in zip((q_descale, k_descale, v_descale), descale.NAMES) if x is not None}
            factors = descale.factors(qh, kh, **scales, v=vh)
        except (ValueError, TypeError) as e:
            raise UnusableInput(str(e)) from None
    raw = (qh, kh, vh, qvh)  # as the kernel read them, bhsd
    qh, kh, vh = _inputs(raw, factors)
    smoothed = None  # the keys as the kernel quantised them, before the mean key is added back
    if k_mean is not None:
        mean = to_bhsd(np.asarray(_as_float(k_mean, names.get("k_mean", "k_mean"))[0], dtype=np.float64), layout)
        try:
            smoothed, kh = kh, kh + np.broadcast_to(mean, kh.shape[:-2] + (1, kh.shape[-1]))
        except ValueError:
            raise UnusableInput(f"k_mean must be the mean key per batch entry and kv head, {kh.shape[:-2] + (1,)} "
                                f"+ (headdim,) in bhsd, got {mean.shape}") from None
    dense = dense_fits(shape["sq"], heads=shape["batch"] * shape["hq"], sk=shape["sk"])
    kernel = to_bhsd(given["out"], layout).astype(np.float64)
    # The kernel's lse in natural units (its worst rows join the baselines' sample too).
    kernel_lse = None if lse is None else convention.to_natural(np.asarray(given["lse"], dtype=np.float64))
    try:
        # One parse of the options, handed to every reference, baseline and diagnosis below.
        opts = Options.parse(causal=causal, causal_align=causal_align, window=window, softcap=softcap,
                             scale=scale, kv_lengths=kv_lengths, q_lengths=q_lengths, sinks=sinks,
                             mask_mod=mask_mod, score_mod=score_mod, key_leftpad=key_leftpad,
                             attention_chunk=attention_chunk, sink_token_length=sink_token_length,
                             gather_kv_indices=gather_kv_indices)
        sinkless = lse is not None and convention.sink == "excluded" and opts.sinks is not None
        dropped = None
        if dropout_p is not None or dropout_mask is not None:
            if max_scores is not None:
                raise UnusableInput("with dropout the check judges out, lse and the gradients (max_scores: "
                                    "not yet): leave max_scores out")
            # out / w judged as the kept keys' attention (`attnlib.check.dropout`)
            dropped = Dropped.of(qh, kh, vh, opts, dropout_p, dropout_mask, workers, dev)
        judged = kernel if dropped is None else dropped.to_kept(kernel)
        expected = expect(qh, kh, vh, opts if dropped is None else dropped.opts, prec, workers, scheduler, dev,
                          kernel=judged, kernel_lse=None if sinkless or dropped is not None else kernel_lse)
        if dropped is not None:  # and the whole row's normaliser, which the kept problem's lacks
            expected = dropped.widened(expected, qh, kh, vh, prec, workers, dev)
    except (ValueError, TypeError) as e:  # e.g. kv_lengths of the wrong shape, or a mod's own error
        raise UnusableInput(str(e)) from e  # chained: a mask_mod's own exception is never replaced
    verdict, err, ratio = judge_out(judged, expected)
    if dropped is not None:
        verdict.notes.insert(0, f"dropout (p = {dropped.rate:g}): judged as the kept keys' attention, out / w with "
                                "w = exp(lse_keep - lse) / (1 - p) each row's kept share (errors and "
                                "values below in those units)")
    row_ratio = row_ratios(err, ratio, expected.allowance)
    head_row_ratio = ratio.max(axis=-1, initial=0.0)
    head_row_ratio = head_row_ratio.reshape((-1,) + head_row_ratio.shape[-2:]).max(axis=0) \
        if head_row_ratio.ndim >= 2 else head_row_ratio[None]  # (Hq, Sq)
    naive_ratio = _naive_ratio(expected)
    diagnosis = []
    if verdict.passed is False and dropped is not None:
        diagnosis = dropped.diagnose(kernel, expected.ref, expected.allowance, qh, kh, vh, workers, dev)
    if verdict.passed is False and not diagnosis:
        diagnosis = diagnose(judged, qh, kh, vh, opts if dropped is None else dropped.opts, expected, ratio, shape,
                             layout, given, prec, workers, dev, _mixups(raw, factors, opts, scales))
    lse_verdict = None
    if lse is not None:
        # An lse without the sink is that of the problem without sinks, with its own allowance.
        lse_opts = replace(opts, sinks=None) if convention.sink == "excluded" else opts
        lse_expected = expected if dropped is None and (lse_opts is opts or opts.sinks is None) else \
            expect(qh, kh, vh, lse_opts, prec, workers, scheduler, dev, kernel=kernel, kernel_lse=kernel_lse)
        lse_verdict = judge_lse(given["lse"], lse_expected, lse_dtype or stored["lse"], convention)
        if sum_exp is not None:
            lse_verdict.notes.insert(0, "the lse judged is max_scores + log(sum_exp), the keys' (the kernel's "
                                        "row statistics in place of an LSE)")
        if not convention.is_default:  # its worst entries are shown in base e, the reference's
            lse_verdict.notes.insert(0, f"judged in the convention told: {convention.words()}"
                                     + (" (shown times ln 2)" if convention.base == 2.0 else ""))
        if lse_verdict.passed is False:
            _diagnose_lse(lse_verdict, given["lse"], lse_expected, qh, kh, vh, opts, lse_opts, convention,
                          workers, dev, smoothed)
    max_verdict = None
    if max_scores is not None:
        ms_ref, ms_allow, ms_naive = expect_max_scores(qh, kh, vh, opts, prec, expected, workers, dense,
                                                       None if dev is None else OnDevice(dev, qh, kh, vh))
        max_verdict = judge_max_scores(given["max_scores"], ms_ref, ms_allow, ms_naive, stored["max_scores"],
                                       convention)
        if max_verdict.passed is False:
            scale = opts.scale if opts.scale is not None else 1.0 / math.sqrt(qh.shape[-1])  # [q, qv]'s
            max_verdict.notes += diagnose_max_scores(given["max_scores"], ms_ref, ms_allow, opts, convention, scale)
    grads = {}
    if "dout" in given and (any(n in given for n in GRADIENTS) or dsinks is not None):
        kernel_grads = {n: given.get(n) for n in GRADIENTS} | {"dsinks": dsinks}
        context = {}
        douth = to_bhsd(given["dout"], layout).astype(np.float64)
        # dL/dlse in natural units: a base-2 LSE's gradient over ln 2
        dlse_e = None if "dlse" not in given else convention.gradient_to_natural(given["dlse"])
        try:
            # with dropout: the kept problem's gradients and the whole one's, added (`Dropped.expect_grads`)
            expected_grads = None if dropped is None else dropped.expect_grads(
                qh, kh, vh, douth, dlse_e, expected, prec, layout, shape, workers, dev, score_mod_grad)
            grads = judge_grads(kernel_grads, qh, kh, vh, expected.ref,
                                expected.ref_lse, douth, prec, opts, layout, shape, workers, context,
                                mod_grad=score_mod_grad, device=dev, qv_dim=None if qvh is None else shape["d"],
                                scores=expected.scores, dlse=dlse_e, expected=expected_grads)
        except (ValueError, TypeError) as e:  # e.g. a score_mod without its derivative
            raise UnusableInput(str(e)) from e
        if qvh is None:  # the neighbouring problems' gradients are q, k and v's own
            _diagnose_grads(grads, context, qh, kh, vh, douth, opts, score_mod_grad, prec.name, dlse_e,
                            None if dropped is None else functools.partial(
                                dropped.gradient_alternatives, qh, kh, vh, douth, dlse_e, score_mod_grad, workers, dev))
    finite = np.where(np.isfinite(ratio), ratio, 0.0)
    sample = slice(None)
    if err.size > SAMPLE:
        sample = np.random.default_rng(0).choice(err.size, size=SAMPLE, replace=False)
    row_err = err.max(axis=-1, initial=0.0)
    row_err = row_err.reshape((-1, row_err.shape[-1])).max(axis=0) if row_err.ndim > 1 else row_err
    shown = options_dict(opts, window=window, softcap=softcap, scale=scale)  # as the caller gave them
    if gather_kv_indices is not None:  # (batch, [Hk,] Sq, topk), attnlib's order
        shown["gather_kv_indices"] = gather_kv_indices
    if dropped is not None:
        shown["dropout_p"] = dropped.rate
    if qvh is not None:
        shown["qv"] = tuple(given["qv"].shape)  # in the layout given
    for n, x in zip(descale.NAMES, (q_descale, k_descale, v_descale)):
        if x is not None:
            shown[n] = (tuple(np.asarray(as_numpy(f, names.get(n, n))) for f in x) if isinstance(x, (tuple, list))
                        else np.asarray(as_numpy(x, names.get(n, n))))
    if lse is not None and not convention.is_default:
        shown["lse_convention"] = convention.words()
    if layout_note:
        shown["layout_note"] = layout_note
    return KernelCheck(
        shape=shape, options=shown, dtype=prec.label, eps=prec.eps, baseline=expected.baseline,
        out=verdict, lse=lse_verdict, grads=grads, row_err=row_err, row_ratio=row_ratio,
        row_naive_ratio=None if naive_ratio is None else row_ratios(naive_ratio[0], naive_ratio[1], expected.allowance),
        head_row_ratio=head_row_ratio, ratios=finite.ravel()[sample],
        naive_ratios=None if naive_ratio is None else naive_ratio[1].ravel()[sample],
        trend=trend(row_ratio), diagnosis=diagnosis, max_scores=max_verdict)


#: The keys `KernelCheck.options` always has; ``q_lengths``, the 2026 variants, ``mask_mod``
#: and ``score_mod`` follow when given (and ``layout_note`` for a varlen or paged problem,
#: ``gather_kv_indices``, ``qv``'s shape and the fp8 descales when judged with them).
RESULT_OPTIONS = ("causal", "causal_align", "window", "softcap", "scale", "kv_lengths", "sinks")


def options_dict(opts: Options, **as_given) -> dict:
    """``opts`` as `KernelCheck.options` holds them, for `format_text` and the user: every key of
    `RESULT_OPTIONS`, then ``q_lengths``, ``mask_mod`` and ``score_mod`` where not None.
    ``as_given``: options as the caller spelled them, in place of the parsed values, which
    `Options.parse` normalises (``window`` None and ``(None, None)`` are one there, a
    ``softcap`` of 30 is 30.0); without them ``window`` is None for no window."""
    result = {name: getattr(opts, name) for name in RESULT_OPTIONS}
    result["window"] = None if opts.window == (None, None) else opts.window
    result |= {name: getattr(opts, name) for name in ("q_lengths", "key_leftpad", "attention_chunk",
                                                      "mask_mod", "score_mod")
               if getattr(opts, name) is not None}
    if opts.sink_token_length:
        result["sink_token_length"] = opts.sink_token_length
    return result | as_given


def _inputs(stored, factors):
    """``(q, k, v)`` the reference takes: the stored ``(q, k, v, qv)`` (bhsd, float64) times the
    fp8 descales in ``factors``, then with MLA's ``qv`` joined (`attnlib.core.mla`)."""
    q, k, v, qv = descale.scaled(*stored, factors)
    if qv is not None:
        q, k = mla.join(q, k, v, qv)
    return q, k, v


def _mixups(stored, factors, opts: Options, scales=None):
    """``(words, (q, k, v), options)``: the inputs a kernel may have mishandled (block scales read
    one block off, as another format or per tensor; the fp8 descales; MLA's qv ignored, or its Dv
    left out of the default scale), made one at a time as the diagnosis asks (each is a float64
    copy of the inputs)."""
    for words, f in descale.block_variants(scales or {}, *stored[:3]):
        yield words, _inputs(stored, {**factors, **f}), opts
    for words, f in (descale.descale_variants(factors) if factors else ()):
        yield words, _inputs(stored, f), opts
    q, k, v, qv = stored
    if qv is not None:
        d, dv = q.shape[-1], v.shape[-1]
        joined = opts.scale if opts.scale is not None else 1.0 / math.sqrt(d + dv)
        yield "qv ignored (the scores q k^T alone)", _inputs((q, k, v, None), factors), opts.replace(scale=joined)
        if opts.scale is None:
            yield (f"qv ignored (the scores q k^T alone, scaled by 1/sqrt(D) = {1 / math.sqrt(d):.4g})",
                   _inputs((q, k, v, None), factors), opts)
            yield (f"the default scale 1/sqrt(D) = {1 / math.sqrt(d):.4g}, not 1/sqrt(D + Dv) = "
                   f"{joined:.4g} (qv's Dv left out of it)", _inputs(stored, factors),
                   opts.replace(scale=1.0 / math.sqrt(d)))


def _problem_alternatives(opts: Options) -> list:
    """``(words, options)``: the neighbouring problems a wrong kernel may have computed; one
    whose options are refused (a change that does not combine with the others) is left out,
    as the diagnosis leaves out every alternative it cannot compute (`DROPPED`)."""
    alts = []
    if opts.causal:
        alts.append(("no causal mask", replace(opts, causal=False)))
    else:
        alts.append(("a causal mask (bottom_right) that was not asked for", replace(opts, causal=True)))
    if opts.kv_lengths is not None:
        alts.append(("kv_lengths ignored (padding keys attended)", replace(opts, kv_lengths=None)))
    if opts.sinks is not None:
        alts.append(("no sinks", replace(opts, sinks=None)))
    for change, words in variant_alternatives(opts):
        try:
            alts.append((words, opts.replace(**change)))
        except DROPPED:
            continue
    return alts


def _descale_in(x, name, layout, ndim):
    """A descale as read: FlashAttention 3's ``(batch, nheads_k)`` as it is, a block scale (the
    data's rank) from the kernel's layout to attnlib's, a tuple (NVFP4's) each of its factors."""
    if isinstance(x, (tuple, list)):
        return tuple(_descale_in(f, f"{name}[{i}]", layout, ndim) for i, f in enumerate(x))
    a = as_numpy(x, name)
    return to_bhsd(a, layout) if a is not None and np.ndim(a) == ndim and ndim >= 3 else a


def _lse_of_stats(max_scores, sum_exp, lse, lse_base, lse_sink, sinks, names):
    """``(lse, lse_sink, lse_dtype)`` of a kernel's ``(max_scores, sum_exp)``: ``max + log(sum_exp)``
    in float64 (in the base told), the sink excluded, the type max was stored in."""
    if lse is not None or max_scores is None:
        raise UnusableInput("sum_exp is judged with max_scores, in place of an lse: give max_scores and "
                            "sum_exp, or lse")
    if sinks is not None and lse_sink == "included":
        raise UnusableInput("sum_exp sums the keys alone (the sink is no score): lse_sink='included' does not apply")
    top, kind = _as_float(max_scores, names["max_scores"])
    total = _as_float(sum_exp, names.get("sum_exp", "sum_exp"))[0]
    if total.shape != top.shape:
        raise UnusableInput(f"sum_exp must have the shape of max_scores {top.shape}, got {total.shape}")
    if not (np.isfinite(total).all() and (total >= 0).all()):
        raise UnusableInput("sum_exp must be finite and >= 0 (a sum of exp(s - max))")
    log = np.log2 if LseConvention.parse(lse_base).base == 2.0 else np.log
    with np.errstate(divide="ignore", invalid="ignore"):  # rows without a key: -inf + log 0 = -inf
        derived = np.where(total > 0, top + log(np.where(total > 0, total, 1.0)), -np.inf)
    return derived, "excluded" if sinks is not None else lse_sink, kind


def _diagnose_grads(grads, context, qh, kh, vh, douth, opts: Options, mod_grad, prec_name, dlse=None,
                    dropout=None):
    """Diagnosis notes on each failing gradient: its sign, the scale, a neighbouring problem's
    gradient, heads swapped, a constant factor; with ``dlse`` (natural units), the gradients with
    it ignored, its sign flipped, or off by the factor ln 2 between the LSE's bases.  ``dropout``: a
    callable giving the dropout gradients' mistakes (`Dropped.gradient_alternatives`), tried in place
    of the neighbouring problems (which have no dropout)."""
    failing = [n for n, v in grads.items() if v.passed is False and n in context]
    if not failing:
        return
    names = ("dq", "dk", "dv", "dsinks")
    alternatives = []
    mod_grad = guard_grad(mod_grad)
    ln2 = math.log(2.0)  # a base-2 LSE's gradient is the natural one's times ln 2
    mixed = [] if dlse is None else [
        ("dlse ignored (the gradients of out alone)", opts, None), ("dlse with its sign flipped", opts, -dlse),
        ("dlse times ln 2 (the gradient of a base-2 LSE taken as the natural one's)", opts, dlse * ln2),
        ("dlse over ln 2 (the gradient of a natural LSE taken as a base-2 one's)", opts, dlse / ln2)]
    if dropout is not None:
        alternatives, mixed = dropout(), []
    for words, alt, alt_dlse in ([] if dropout is not None else
                                 [(w, a, dlse) for w, a in _problem_alternatives(guard_mods(opts))] + mixed):
        try:
            g = dense_backward(qh, kh, vh, douth, alt, mod_grad, dlse=alt_dlse)
        except DROPPED:  # refused, or the user's mods failing on it: no such alternative
            continue
        g = dict(zip(names, g))
        if "dsinks" in g:
            g["dsinks"] = np.asarray(g["dsinks"])[..., None, None]
        alternatives.append((words, g))
    scale = opts.scale if opts.scale is not None else 1.0 / math.sqrt(qh.shape[-1])
    for n in failing:
        c = context[n]
        found = diagnose_gradient(n, c["kernel"], c["ref"], c["allowance"], scale,
                                  [(w, g.get(n)) for w, g in alternatives], prec_name)
        grads[n].notes += [f"diagnosis: {d}" for d in found] or ["diagnosis: no known cause matched"]


def _diagnose_lse(verdict, lse, expected, qh, kh, vh, opts: Options, lse_opts: Options, convention,
                  workers, device=None, smoothed=None):
    """Diagnosis notes on a failing lse: another convention (base, the sink's place, the empty
    rows' infinity), its neighbour's row, a neighbouring problem's.  ``lse_opts``: the problem
    whose lse was judged (``opts`` without sinks when the sink is excluded)."""
    def lse_of(o):
        return forward_on(qh, kh, vh, o, return_lse=True, workers=workers, device=device)[1]

    alternatives = []
    if smoothed is not None:  # SageAttention's K smoothing: the mean key not added back to the LSE
        alternatives.append(("the mean key (k_mean) not added back (the LSE of the smoothed keys)",
                             forward_on(qh, smoothed, vh, lse_opts, return_lse=True, workers=workers, device=device)[1]))
    for words, alt in _problem_alternatives(guard_mods(lse_opts)):
        try:
            alternatives.append((words, lse_of(alt)))
        except DROPPED:  # refused, or the user's mods failing on it: no such alternative
            continue
    other_sink = None
    if opts.sinks is not None:
        try:
            other_sink = lse_of(guard_mods(opts if lse_opts is not opts else replace(opts, sinks=None)))
        except DROPPED:
            pass
    kernel = np.asarray(lse, dtype=np.float64).reshape(expected.ref_lse.shape)
    found = diagnose_lse(kernel, expected.ref_lse, np.asarray(expected.lse_allowance), expected.empty,
                         alternatives, convention, other_sink)
    verdict.notes += [f"diagnosis: {d}" for d in found] or ["diagnosis: no known cause matched"]


def _naive_ratio(expected: Expected):
    """``(err, ratio)`` of the naive baseline (below float64), else None."""
    if expected.naive_err is None:
        return None
    err = expected.naive_err
    allowance = np.broadcast_to(expected.allowance, err.shape)
    return err, np.divide(err, allowance, out=np.zeros_like(err), where=allowance > 0)


def check_sources(q, sources, out, *, layout="bshd", dk=None, dv=None, **check) -> KernelCheck:
    """`check_kernel` of a kernel over several KV sources in one softmax
    (`attnlib.core.sources`): ``sources`` each an `attnlib.Source` whose ``k``, ``v`` are in
    ``layout`` (its mask options in attnlib's terms), ``dk``, ``dv`` lists of the kernel's
    gradients per source; ``check`` the other keywords of `check_kernel` (``lse``, ``dout``,
    ``dq``, ``dlse``, ``sinks``, ``dsinks``, ``scale``, ``softcap``, ``dtype``, ...).  Judged as the
    joined problem (`attnlib.core.sources.join_sources`); a failing output that matches a source
    left out, or its mask ignored, is diagnosed by the source's name."""
    from ..core.sources import _sources, join_sources

    found = _sources(sources)
    taken = sorted(set(check) & {"mask_mod", "block_mask", "causal", "window", "kv_lengths", "gather_kv_indices"})
    if taken:
        raise UnusableInput(f"{', '.join(taken)}: each source's mask is its own (its options); "
                            "the call's are the scores' (scale, softcap, sinks)")
    if layout not in LAYOUTS:
        raise UnusableInput(f"layout must be one of {LAYOUTS} for sources, got {layout!r}")
    axis = -3 if layout == "bshd" else -2
    for name, grads in (("dk", dk), ("dv", dv)):
        if grads is not None and len(grads) != len(found):
            raise UnusableInput(f"{name} must be a list of one gradient per source ({len(found)}), got {len(grads)}")
    try:
        k, v, mask_mod = join_sources(q, found, seq_axis=axis)
    except (ValueError, TypeError) as e:
        raise UnusableInput(str(e)) from e
    joined = {n: None if g is None else np.concatenate([np.asarray(as_numpy(x, f"{n}[{i}]")) for i, x in enumerate(g)],
                                                      axis=axis) for n, g in (("dk", dk), ("dv", dv))}
    return check_kernel(q, k, v, out, layout=layout, mask_mod=mask_mod, **joined, **check)
