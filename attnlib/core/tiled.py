"""The tiled attention kernel: FlashAttention's forward pass in numpy, in float64.

The Python loop runs over ``(query tile, key tile)`` pairs; every batch and head is
processed at once inside a tile by broadcasting matmul.  Working memory is a few
``(..., block_q, block_k)`` and ``(..., block_q, Dv)`` arrays, independent of ``Sq`` and
``Sk``.
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, replace

import numpy as np

from . import lse_conventions, mla, problem, sparse, validate, flex, hooks
from .backend import NUMPY, backend_for
from .masks import SKIP
from .options import Call, Options
from .paged import paged_forward
from .parallel import _unit_of, run_tiles
from .tilesizes import DEFAULT_TILES, LARGE_HEAD_TILES, TileSizes, default_tiles
from .online import _merged, lse_of, merge_parts
from .stats import AttentionStats, results
from .device import on_device, resolve as device_of


def attention(q, k, v, *, causal=False, causal_align="bottom_right", window=None,
              kv_lengths=None, q_lengths=None, q_segment_ids=None, kv_segment_ids=None,
              key_leftpad=None, attention_chunk=None, sink_token_length=0, softcap=None, alibi_slopes=None,
              sinks=None, scale=None, block_q=None, block_k=None,
              kv_splits=1, workers=None, rescale_threshold=0.0, compute_dtype=None, intermediate_dtype=None,
              return_lse=False, return_stats=False, check_finite=True, block_table=None,
              cache_seqlens=None, mask_mod=None, score_mod=None, block_mask=None, qv=None, q_descale=None,
              k_descale=None, v_descale=None, lse_base=None, lse_sink=None, lse_empty=None,
              gather_kv_indices=None, return_max_scores=False, device=None):
    """Exact attention computed tile by tile with the online softmax.

    Equal to `reference_attention` up to float64 rounding, in working memory independent of
    the sequence lengths: a few ``(..., block_q, block_k)`` and ``(..., block_q, Dv)``
    arrays, plus a few integers per key tile for the tile classes of one query tile.

    Parameters
    ----------
    q : array_like, shape ``(..., Hq, Sq, D)`` or ``(Sq, D)``
    k : array_like, shape ``(..., Hk, Sk, D)`` or ``(Sk, D)``
    v : array_like, shape ``(..., Hk, Sk, Dv)`` or ``(Sk, Dv)``
        Real floating arrays (computed in float64; ml_dtypes' bfloat16 and float8 too,
        converted exactly); equal leading (batch) axes;
        ``Hq % Hk == 0``: query head ``h`` reads kv head ``h // (Hq // Hk)`` (GQA, and
        MQA when ``Hk == 1``).  ``Dv`` may differ from ``D``; ``Sq`` or ``Sk`` may be 0.
    causal : bool
        Query ``i`` sees key ``j`` only if ``j <= i + o``.
    causal_align : {"bottom_right", "top_left"}
        ``o = Sk - Sq`` (default; FlashAttention >= 2.1) or ``o = 0`` (torch SDPA
        ``is_causal``), with the actual lengths of a padded row.  For ``Sq = 2, Sk = 5``::

            bottom_right      top_left
            1 1 1 1 0         1 0 0 0 0
            1 1 1 1 1         1 1 0 0 0

    window : (left, right), optional
        Sliding window: ``i + o - left <= j <= i + o + right``; ``None`` leaves a side
        unbounded; ``causal=True`` forces ``right = 0``.
    kv_lengths, q_lengths : array_like of int, shape ``(...)`` (the batch axes), optional
        Padding: keys ``j >= kv_lengths[b]`` are invisible, rows ``i >= q_lengths[b]``
        give 0 (and ``lse = -inf``).
    q_segment_ids, kv_segment_ids : array_like of int, ``(..., Sq)`` and ``(..., Sk)``
        Document masking (packed samples): a pair is visible only within one id.
    key_leftpad : array_like of int, shape ``(...)``, optional
        Left-padded keys (FlashAttention's ``cache_leftpad``): entry ``b``'s valid keys are
        ``[key_leftpad[b], kv_lengths[b])``, positions counted from the first of them.
    attention_chunk : int, optional
        Chunked attention (Llama 4): a query sees only the keys of its own chunk of this
        many key positions (``floor(j' / C) == floor((i + o') / C)``); 0 or None: off; ``2**62``
        and more: one chunk wider than any sequence (taken as ``2**62``).
    sink_token_length : int, optional
        The first this many valid keys are exempt from the window's left bound
        (StreamingLLM's sink tokens inside a sliding window).
    softcap : float, optional
        ``s = softcap * tanh(s / softcap)`` before masking; 0 or None: off.
    alibi_slopes : array_like, shape ``(Hq,)`` or ``(..., Hq)``, optional
        Adds ``-slope[h] * |i + o - j|`` to the scores after masking (not scaled).
    sinks : array_like, shape ``(Hq,)`` or ``(..., Hq)``, optional
        Attention sinks (gpt-oss ``s_aux``, FlashAttention ``learnable_sink``): a finite
        logit per head that joins every row's softmax denominator with no value,
        ``out_i = sum_j e^{s_ij} v_j / (e^{sink_h} + sum_j e^{s_ij})`` and
        ``lse_i = log(e^{sink_h} + sum_j e^{s_ij})``.  Taken as given: no scale, softcap
        or ALiBi applies to it.  A row with no visible key gives ``out = 0`` and
        ``lse = sink_h``.  In the online softmax it is the rows' initial state
        ``(m, l, acc) = (sink, 1, 0)``, so a tile whose max exceeds it counts as a rescale.
    scale : float, optional
        Score scale, ``1/sqrt(D)`` by default.
    block_q, block_k : int, optional
        Tile sizes; the last tiles may be ragged.  Default: `default_tiles` of ``D``
        (256 x 256, and 512 x 512 for ``D >= 128``; ``stats`` says which were used).
    kv_splits : int
        Split the key tiles into this many contiguous ranges, attend to each separately and
        combine the partial results with `merge_attention` (split-KV / FlashDecoding); more
        splits than key tiles count as one per tile (the others would be empty).
    rescale_threshold : float
        Lazy rescaling (FlashAttention-4): a row keeps its stale running max until a tile's
        max exceeds it by more than this many natural-log units (``0 <= tau <= 100``);
        0 is the eager rule.  Same result up to rounding; ``stats`` then counts the
        rescales actually applied.  A stale max lets the weights reach ``exp(tau)``, so the
        threshold used is clamped to the largest one the precision can hold (see
        `problem.safe_threshold`): ``log(max_acc / (Sk * max(1, max|v|))) - log 2`` for the state
        ``(l, acc)`` in the accumulate type (float32 unless float64: about
        ``88.7 - log(Sk)``), and ``log(max_compute) - log 2 ~ 10.4`` for float16, whose
        rounded ``p`` must stay finite.  In float64 with ordinary ``v`` nothing is clamped.
    compute_dtype : {None, "float64", "float32", "float16", "bfloat16", "float8_e4m3fn"}
        The precision a kernel under test runs in: q, k, v and the weights ``p`` are
        rounded to it, the scores and ``(m, l, acc)`` kept in float32 (for the 16-bit types,
        as GPU kernels do; bfloat16 needs ``ml_dtypes``).  ``out`` is returned in it and
        ``lse`` in float32.  float8_e4m3fn: an fp8 kernel's arithmetic (FlashAttention 3's),
        bfloat16 but for ``p``, rounded to float8_e4m3fn before ``p @ v`` (``out`` in
        bfloat16).  Default: float64 throughout.
    intermediate_dtype : {None, "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
        The type the weights are rounded to before ``p @ v`` (FlashAttention's test reference's
        name), with a ``compute_dtype`` below float64 no narrower than it: ``p = exp(s - m) <= 1``
        rounded from the state's type (normalised after).  See ``docs/semantics.md``.
    qv : array_like, shape ``(..., Hq, Sq, Dv)``, optional
        MLA's second query (FlashAttention 3/4's ``qv``): scores ``scale (q k^T + qv v^T)``,
        default ``scale = 1/sqrt(D + Dv)``; ``q`` may then be None (``qv v^T`` alone).
        Computed as the attention of ``[q, qv]`` and ``[k, v]`` joined along the head dim
        (one float64 copy of each, `attnlib.core.mla`), with the values ``v``.
    lse_base, lse_sink, lse_empty : optional
        The returned ``lse``'s convention (`attnlib.core.lse_conventions`; with
        ``return_lse``): base ``"e"`` (default) or ``2`` (FlashInfer, JAX Pallas); with sinks,
        ``"included"`` (default, FlashAttention 4) or ``"excluded"`` (FlashMLA: the keys' own
        log-sum-exp, computed without the sinks and ``out`` weighted by them after); rows
        without a key ``"-inf"`` (default) or ``"+inf"`` (FlashAttention's ``softmax_lse``).
    q_descale, k_descale, v_descale : array_like, shape ``(..., Hk)``, optional
        FlashAttention 3's fp8 descales: the attention of ``q * q_descale`` (each kv head's
        factor on its query heads), ``k * k_descale`` and ``v * v_descale``, formed once in
        float64 (exact for fp8 values and float32 factors).  Positive, finite, and of a shape
        that broadcasts to ``(..., Hk)`` (a per-tensor scale too); not with a paged cache.
    gather_kv_indices : array_like of int, ``(..., Sq, topk)`` or ``(..., Hk, Sq, topk)``, optional
        Top-k sparse keys (DeepSeek sparse attention, FlashMLA's ``indices``, FlashAttention 4's):
        query ``i`` sees only the keys its list names, shared by the heads or per kv head; a set
        (repeats count once), ``-1`` or out-of-range entries select nothing, ANDed with the
        other masks (`attnlib.core.sparse`).  Where few keys are listed the forward gathers
        them, at a cost that follows ``Sq * topk``; not with ``mask_mod`` or ``block_mask``.
    workers : int, optional
        Threads that take (head block, query tile) units in parallel; default (None, or
        -1): one per available CPU.  numpy releases the GIL in matmul and ``exp``.  The
        result is bit-identical for every thread count (the units and their arithmetic do
        not depend on it), and the working memory grows by one tile's buffers per thread.
        BLAS is held to one thread meanwhile, so the machine is never oversubscribed.
    return_lse : bool
        Also return ``lse: (..., Hq, Sq)``.
    return_max_scores : bool
        Also return ``max_scores: (..., Hq, Sq)`` after ``lse`` (FlexAttention's aux): each row's
        largest visible score after every modification, ``-inf`` where none (no sink), in the
        base of ``lse_base``.
    return_stats : bool
        Also return an `AttentionStats` (costs ``O(Hq * n_q_tiles * n_k_tiles)`` memory).
    check_finite : bool
        Refuse inputs holding NaN or inf (checked in chunks, within the memory bound).
    mask_mod, score_mod : callable, optional
        FlexAttention's programmable mask ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and score
        ``score_mod(score, b, h, q_idx, kv_idx) -> score``, called on numpy index arrays of
        one tile at a time (see `attnlib.core.flex`): the mask combines with the built-in ones by
        AND; ``score`` is ``scale * q.k`` after the softcap, and the mask and ALiBi come after.
    block_mask : BlockMask, optional
        `create_block_mask` of ``mask_mod``: its tiles become the kernel's, its SKIP tiles are
        never touched; made here (one ``mask_mod`` evaluation per pair) when only
        ``mask_mod`` is given.
    block_table, cache_seqlens : array_like of int, shapes ``(batch, max_blocks)`` and ``(batch,)``
        A paged KV cache (FlashAttention's ``flash_attn_with_kvcache``, vLLM): ``k`` and
        ``v`` are then the pages ``(num_blocks, page_size, Hk, D)``, ``q`` is
        ``(batch, Hq, Sq, D)``, and entry ``b``'s key ``j < cache_seqlens[b]`` is
        ``k[block_table[b, j // page_size], j % page_size]``.  Read in place, a few pages at
        a time, with key tiles on page boundaries (`attnlib.core.paged.paged_attention`, whose
        further options apply); the masks and score options as above, except the padding
        and document ones, split-KV, lazy rescaling, low precision and stats.

    Raises
    ------
    ValueError
        Also if finite q and k give a score ``scale * q . k`` that overflows (float64, or
        float32 for a lower ``compute_dtype``) for a visible pair: the softmax of such a
        row is undefined in that precision.  Checked tile by tile only when an ``O(n)``
        bound, ``D * max|q| * max|k| * |scale|``, says an overflow is possible.

    Returns
    -------
    out : ndarray, shape ``(..., Hq, Sq, Dv)``, float64
    lse : ndarray, shape ``(..., Hq, Sq)``, if ``return_lse``
    stats : AttentionStats, if ``return_stats``

    Notes
    -----
    Scores are formed in the contract's order: ``scale * q.k``, softcap, mask (``-inf``),
    ALiBi.  Each query tile carries an `OnlineSoftmax` state ``(m_i, l_i, acc)`` over its
    key tiles in ascending order.  Tiles are classified in closed form from the window
    bounds, the lengths and the segment id ranges: SKIP tiles are never touched, FULL tiles
    do no mask work, PARTIAL tiles set their invisible scores to ``-inf``.  When padding or
    segments make the mask depend on the batch entry, the entries are processed one at a
    time (heads still together), so that each skips its own tiles.  Rows with no visible
    key give ``out = 0`` and ``lse = -inf``; no step divides by zero, overflows or forms
    ``inf - inf``, so the call runs clean under
    ``np.errstate(divide="raise", over="raise", invalid="raise")``.

    References
    ----------
    T. Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
    IO-Awareness", NeurIPS 2022; T. Dao, "FlashAttention-2", 2023.

    Examples
    --------
    >>> import numpy as np, attnlib
    >>> q, k, v = attnlib.random_qkv(300, 500, 64, seed=0)
    >>> out, lse = attnlib.attention(q, k, v, causal=True, window=(64, None), return_lse=True)
    >>> attnlib.attention_errors(out, q, k, v, causal=True, window=(64, None)).rel_error < 1e-12
    True
    """
    call = Call.bind(locals())  # every argument checked once, read by the kernel as bound
    q, k, v = mla.inputs(q, k, v, qv, call.options.paged, q_descale, k_descale, v_descale, check_finite)
    return lse_conventions.apply(call, lambda c: run_call(q, k, v, c),
                                 check_sinks=lse_conventions.check_sinks_for(q, k, v, paged=call.options.paged,
                                                                             compute_dtype=compute_dtype))


def forward_on(q, k, v, opts: Options, **run):
    """`run_call` of ``opts`` and the run's keywords (`Call.bind`'s: ``return_lse``,
    ``workers``, ``device``, ...; not an LSE convention, which `attention` applies)."""
    conventions = sorted(n for n in ("lse_base", "lse_sink", "lse_empty") if run.get(n) is not None)
    if conventions:
        raise TypeError(f"forward_on returns attnlib's own lse: {', '.join(conventions)} is applied by attention")
    return run_call(q, k, v, Call.bind(options=opts, **run))


def run_call(q, k, v, call: Call):
    """`forward`, with numpy, or with torch on the device that ``call.device`` or torch inputs
    name (`attnlib.core.device.resolve`): results as the inputs came (numpy for numpy inputs)."""
    dev = device_of(call.device, q, k, v)
    if dev is None:
        return forward(q, k, v, call)
    return on_device(forward(q, k, v, call, dev=dev), (q, k, v))


def forward(q, k, v, call: Call, dev=None):
    """`attention`'s forward of the bound ``call``; ``dev``: a torch device to compute on
    (`attnlib.core.torch_backend`), or None for numpy."""
    opts, prec = call.options, call.precision
    if opts.paged:
        given = sorted([*opts.given(("kv_lengths", "q_lengths", "q_segment_ids", "kv_segment_ids", "key_leftpad",
                                     "attention_chunk", "sink_token_length", "mask_mod", "score_mod", "block_mask",
                                     "gather_kv_indices")),
                        *(name for name, on in (("return_stats", call.return_stats), ("kv_splits", call.kv_splits > 1),
                                                ("rescale_threshold", call.rescale_threshold),
                                                ("return_max_scores", call.return_max_scores),
                                                ("compute_dtype", not prec.is_float64)) if on)])
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with a paged KV cache "
                             "(cache_seqlens gives the key lengths)")
        return paged_forward(q, k, v, call, dev=dev)  # block_k: the keys gathered at a time
    workers = validate.workers(None) if dev is None and call.workers is None else call.workers
    xp = NUMPY if dev is None else backend_for(dev, workers)
    q5, k5, v5, pb, extremes = xp.parse(q, k, v, opts.scale, call.check_finite)
    setup = prepare(q5, k5, v5, pb, opts, block_q=call.block_q, block_k=call.block_k, prec=prec,
                    tau=call.rescale_threshold, xp=xp, extremes=extremes)
    tiles = setup.tiles
    if xp is not NUMPY:  # every head's score tile together bounds a unit's
        xp.fit_workers(8 * math.prod(pb.batch) * pb.hq * min(tiles.block_q, pb.sq) * min(tiles.block_k, pb.sk))
        workers = xp.workers
    n_k_tiles = -(-pb.sk // tiles.block_k)
    # More ranges than key tiles would only add empty ones (each a pass over the queries).
    splits = np.array_split(np.arange(n_k_tiles), max(1, min(call.kv_splits, n_k_tiles)))
    # The sink joins the first key range's state only: once per row, whatever the split.
    # float64 partials keep their lse in two parts (m, log l), which merge without the loss
    # of a one-float lse at large scores; a low precision merges its lse, as its kernel does.
    parts = len(splits) > 1 and prec.is_float64
    sel, stats, maxes = setup.selection, call.return_stats, call.return_max_scores
    if (sel is not None and len(splits) == 1 and xp is NUMPY and call.state is None
            and sel.prefer_gather(tiles.block_q, tiles.block_k)):
        # Top-k lists: the listed keys gathered, at a cost that follows them (`sparse.gathered`).
        partials = [sparse.gathered(q5, k5, v5, pb, setup, sel, workers=workers,
                                    count_rescales=stats, max_scores=maxes)]
        return _results(pb, tiles, call, *partials[0][:2], partials)
    with xp.threads(workers):
        partials = [run_keys(q5, k5, v5, pb, setup if r == 0 else replace(setup, sink=None),
                             (int(part[0]), int(part[-1]) + 1) if part.size else (0, 0), workers=workers,
                             count_rescales=stats, lse_parts=parts, max_scores=maxes, state_class=call.state)
                    for r, part in enumerate(splits)]
        xp.finish()  # the errors a device gathered, raised once
        if len(partials) == 1:
            out, lse = partials[0][:2]
        elif parts:
            out, merged = merge_parts([p[0] for p in partials], [p[1] for p in partials], xp)
            lse = lse_of(merged, xp)
        else:
            out, lse = _merged([p[:2] for p in partials], xp)
        return _results(pb, tiles, call, out, lse, partials, xp)


def _results(pb, tiles, call, out, lse, partials, xp=NUMPY):
    """`stats.results` of the merged ``out, lse`` of the key ranges' ``partials`` (and their
    ``max_scores``, the largest of theirs, when they carry one)."""
    maxes, prec = None, call.precision
    if partials[0][4] is not None:
        maxes = functools.reduce(xp.maximum, [p[4] for p in partials])
    if not prec.is_float64:  # what a kernel in that precision would write out
        out, lse = xp.astype(out, prec.compute), xp.astype(lse, prec.accumulate)
        maxes = None if maxes is None else xp.astype(maxes, prec.accumulate)
    return results(pb, tiles, out, lse, sum(p[2] for p in partials) if call.return_stats else None,
                   partials[0][3], return_lse=call.return_lse, return_stats=call.return_stats, max_scores=maxes)


@dataclass(frozen=True, eq=False)
class Setup:
    """What the forward needs of one call's options, resolved against its `problem.Problem`:
    the mask specs, the tiles, the score terms in the type the scores are kept in, the mods,
    the precision, whether scores may overflow, ``max |v|`` and the lazy-rescale threshold."""

    specs: dict  # {batch index: MaskSpec}, {(): spec} when the mask is the same for all
    tiles: TileSizes
    cap: float | None
    slopes: np.ndarray | None  # (..., hk, g)
    sink: np.ndarray | None  # (..., hk, g): the rows' initial state
    mods: tuple | None  # flex.mods_for
    prec: problem.Precision
    check: bool  # problem.scores_may_overflow: each tile checks its scores
    v_max: float
    tau: float = 0.0
    selection: object = None  # sparse.Selection: the top-k lists, or None
    xp: object = NUMPY  # the arrays' backend (`attnlib.core.backend`)


def prepare(q5, k5, v5, pb, opts: Options, *, block_q=None, block_k=None, prec=None, tau=0.0, xp=NUMPY,
            extremes=None, spec=None, base=None) -> Setup:
    """The `Setup` of a call on the grouped ``q5, k5, v5`` (`problem.parse`) with ``opts``;
    on a device, ``extremes`` are the inputs' ``(max, min)`` (`device.parse`).  ``spec``: one
    mask for the whole problem instead of ``opts``'s (a piece of a larger one); ``base``: the
    tile sizes unless given (default: the backend's for the forward)."""
    prec = problem.precision(prec)
    if base is None and xp is NUMPY:
        base = default_tiles(pb.d)
    elif base is None:
        from .tilesizes import device_tiles
        base = device_tiles(xp.dev, math.prod(pb.batch) * pb.hq, opts, spec=spec)
    tiles = opts.tiles_for(base, block_q, block_k)
    specs = opts.specs(pb) if spec is None else {(): spec}
    cap, slopes, sink = opts.score_terms(pb, prec)
    if xp is NUMPY:
        mods = opts.mods(pb, tiles)
        problem.check_representable(prec, q=q5, k=k5, v=v5)
    else:
        from .torch_flex import device_mods
        mods = device_mods(opts, pb, tiles, xp.dev)  # a mask_mod's block mask made on the device
        # Values beyond the compute type's range round to inf there (the host path's message).
        problem.check_representable(prec, **{n: np.array(extremes.get(n, (0.0, 0.0))) for n in "qkv"})
    check = problem.scores_may_overflow(q5, k5, pb.scale, prec.accumulate, q_max=pb.max_of("q", q5),
                                        k_max=pb.max_of("k", k5))
    v_max = pb.max_of("v", v5)  # once, for every key range
    if tau:
        tau = problem.safe_threshold(tau, prec, pb.sk, v_max)
    return Setup(specs, tiles, cap, xp.from_host(slopes), xp.from_host(sink), mods, prec, check, v_max, tau,
                 opts.selection(pb), xp)


def run_keys(q, k, v, pb, setup: Setup, key_tiles, *, workers=1, count_rescales=False, lse_parts=False,
             max_scores=False, state_class=None):
    """Attend to the key tiles ``[b_lo, b_hi)``: ``(out, lse, rescales, kinds, maxes)``, grouped
    heads.  ``lse_parts``: ``lse`` as ``(..., sq, 2)`` parts ``(m, log l)``, for partials to merge
    (`online.merge_parts`); ``max_scores``: ``maxes (..., sq)``, each row's largest visible
    score over these keys (else None); ``state_class``: the online-softmax state (None: the
    declared step "state").

    ``q: (*batch, hk, g, sq, d)``; one plan per entry of ``setup.specs`` (all batch entries
    at once when the mask does not depend on them), and the work items of every plan on
    one pool of ``workers`` threads, so that batch entries with masks of their own
    (padding, documents) run in parallel too.  ``setup.sink``: the grouped sinks
    ``(..., hk, g)`` that start the rows, or None (a later key range of a split).
    """
    specs, tiles, cap, slopes, sink, mods = (setup.specs, setup.tiles, setup.cap, setup.slopes,
                                             setup.sink, setup.mods)
    prec, check, v_max, tau, xp = setup.prec, setup.check, setup.v_max, setup.tau, setup.xp
    lead = tuple(q.shape[:-2])
    # Values near the type's range are summed divided by 2**e (see `problem.value_exponent`).
    v_exp = problem.value_exponent(v_max, pb.sk, prec.accumulate)
    out = xp.empty(lead + (pb.sq, pb.dv))
    lse = xp.empty(lead + (pb.sq,) + ((2,) if lse_parts else ()))
    maxes = xp.full(lead + (pb.sq,), -np.inf) if max_scores else None
    kinds = rescales = None
    if count_rescales:
        # The tile map and per-tile counts grow as (Sq / block_q) * (Sk / block_k): kept
        # only when stats are asked for.
        shape = (-(-pb.sq // tiles.block_q), -(-pb.sk // tiles.block_k))
        validate.check_allocation(9 * math.prod(lead + shape), f"return_stats's per-tile counts of "
                               f"{shape[0]} x {shape[1]} tiles per head (block_q={tiles.block_q}, "
                               f"block_k={tiles.block_k})")
        kinds = np.empty(pb.batch + shape, dtype=np.int8)
        rescales = np.zeros(lead + shape, dtype=np.int64)
    if not math.prod(lead):  # a zero-size batch axis: nothing to compute, no tile to map
        return out, lse, rescales, kinds, maxes
    plans = []  # (items, fn) per entry
    per_thread = threading.local()  # each thread's tile buffers, shared by every entry's plan
    for idx, spec in specs.items():
        # idx = () selects everything: all batch entries share one mask.
        plans.append(_forward(q[idx], k[idx], v[idx], pb.scale, spec, tiles, cap,
                              problem.for_entry(slopes, idx),
                              out[idx], lse[idx],
                              None if rescales is None else rescales[idx],
                              None if kinds is None else kinds[idx], key_tiles, tau, prec, check,
                              per_thread, problem.for_entry(sink, idx),
                              None if mods is None else flex.Mods(*mods, *flex.index_grids(pb, idx)),
                              (v_exp, v_max), lse_parts, None if maxes is None else maxes[idx], xp, state_class))
    starts = np.cumsum([0] + [n for n, _ in plans])  # item i belongs to the plan whose range holds it

    def item(i):
        xp.worker_start()
        p = int(np.searchsorted(starts, i, side="right")) - 1
        plans[p][1](i - int(starts[p]))

    run_tiles(item, range(int(starts[-1])), workers)
    return out, lse, rescales, kinds, maxes


def _forward(q, k, v, scale, spec, tiles, cap, slopes, out, lse, rescales, kinds, key_tiles,
             tau, prec, check, per_thread, sink=None, mods=None, values=(0, 0.0), lse_parts=False, maxes=None,
             xp=NUMPY, state_class=None):
    """The kernel for one mask, as a plan: ``(n_items, fn)``; ``fn(i)`` runs item ``i``.

    ``q: (*lead, sq, d)``, ``k, v: (*lead', sk, .)``.  The items write ``out (*lead, sq,
    dv)``, ``lse (*lead, sq)`` and, when given, the tile map ``kinds (..., nq, nk)`` and
    per-tile ``rescales (*lead, nq, nk)`` in place.  The work is split into (head block,
    query tile) units (see `work_units`); they are independent, so threads may take them
    in any order: each writes only its own rows, with the same arithmetic, so the result
    is bit-identical.  ``check`` has every tile's scores checked for overflow (see
    `tile_scores`).  ``per_thread``, a ``threading.local`` shared by the plans of one call,
    holds each thread's tile buffers (keyed by shape), so that the working memory is one
    set of buffers per thread however many batch entries have masks of their own.
    ``sink`` (broadcastable to ``lead``) starts every row from its head's sink.
    ``values``: ``(e, max|v|)``, the values summed divided by ``2**e`` (`problem.value_exponent`).
    ``maxes (*lead, sq)``, if given, receives each row's largest visible score.  ``xp``: the
    arrays' backend (`attnlib.core.backend`); ``state_class``: the online-softmax state (None:
    the declared step "state", looked up per query tile).
    """
    v_exp, v_max = values
    bq, bk = tiles.block_q, tiles.block_k
    lead, sq, dv = tuple(q.shape[:-2]), q.shape[-2], v.shape[-1]
    k_starts, k_ends, kv_ranges = spec.key_tiles(bk)  # (n_k_tiles,) each
    in_range = np.zeros(k_starts.size, dtype=bool)
    in_range[key_tiles[0]:key_tiles[1]] = True
    n_q_tiles = -(-sq // bq)
    # GQA packing (decode): when a group's query rows fit one tile together, the g query
    # heads that share a kv head become one tile of g * rows rows, k_j q_i^T one matmul per
    # kv head instead of g matrix-vector products.  ALiBi's slopes differ per head: not then.
    g = lead[-1] if lead else 1
    packed = g > 1 and slopes is None and mods is None and g * min(bq, sq) <= bq
    groups = g if packed else 1  # query heads per tile row block
    units = xp.units(lead[:-1] if packed else lead, groups * min(bq, sq), min(bk, k.shape[-2]), n_q_tiles)
    if slopes is not None:
        slopes = xp.broadcast_to(slopes, lead)  # (*lead,): one slope per head
    if sink is not None:
        sink = xp.broadcast_to(sink, lead)  # (*lead,): one sink per head

    latest = [(None, None)]  # (a, its tile classes): the units of one query tile come in a row

    def unit_tile(item):
        # The longest (last, under causal) query tiles go first so the threads finish together.
        a, unit = n_q_tiles - 1 - item // len(units), units[item % len(units)]
        q0, q1 = a * bq, min(sq, (a + 1) * bq)
        seen_a, tile_kinds = latest[0]
        if seen_a != a:  # once per query tile (a tuple swapped whole: safe across threads)
            tile_kinds = spec.tile_kind(q0, q1, k_starts, k_ends, kv_ranges)  # (n_k_tiles,), closed form
            latest[0] = (a, tile_kinds)
        if kinds is not None:  # the same values from every unit of this query tile
            if mods is None:
                kinds[..., a, :] = tile_kinds
            else:  # per batch entry, over all its heads
                for e in np.ndindex(kinds.shape[:-2]):
                    kinds[e + (a,)] = mods.unit(e).tile_kinds(a, tile_kinds)
        mods_u = None
        if mods is not None:  # this unit's heads: the block mask's classes AND the built-in ones
            mods_u = mods.unit(unit)
            tile_kinds = mods_u.tile_kinds(a, tile_kinds)
        q_u, k_u, v_u = q[unit], _unit_of(k, unit), _unit_of(v, unit)
        if packed:  # (..., 1, sk, .) -> (..., sk, .): the group's shared kv head
            k_u, v_u = k_u[..., 0, :, :], v_u[..., 0, :, :]
        if prec is None or prec.is_float64:
            # The scale is applied once per query tile: a (..., bq, d) copy, never all of q.
            with xp.ignore_overflow(check):
                q_i = xp.operand(q_u[..., q0:q1, :]) * scale  # (..., bq, d); inf: caught below
            dtype = xp.float64
        else:  # rounded q; the scale goes on the float32 scores, as in low-precision kernels
            q_i = xp.rounded(q_u[..., q0:q1, :], prec)
            dtype = xp.dtype(prec.accumulate)
        rows = None
        if packed:  # (..., g, r, d) -> (..., g * r, d); the rows' positions repeat per head
            q_i = q_i.reshape(tuple(q_i.shape[:-3]) + (g * (q1 - q0), q_i.shape[-1]))
            rows = np.tile(np.arange(q0, q1), g)
        sink_rows = None
        if sink is not None:  # each row starts from its head's sink
            sink_rows = (xp.repeat(sink[unit], q1 - q0, -1) if packed  # (..., g * rows)
                         else sink[unit][..., None])  # (..., 1) against (..., rows)
        # The steps "state" and "absorb" (`attnlib.core.hooks`): OnlineSoftmax, tiles.absorb.
        state = (hooks.get("state") if state_class is None else state_class).empty(
            tuple(q_i.shape[:-1]), dv, dtype, keys_first=xp.keys_first_for(q_i.shape[-2]), sink=sink_rows,
            **({} if xp is NUMPY else {"xp": xp}))
        todo = np.flatnonzero((tile_kinds != SKIP) & in_range)
        mx_i = None if maxes is None else xp.full(tuple(state.m.shape), -np.inf, dtype=dtype)  # as state.m
        events = hooks.get("absorb")(state, q_i, k_u, v_u, spec, q0, k_starts[todo], k_ends[todo],
                                     tile_kinds[todo], cap, slopes if slopes is None else slopes[unit],
                                     count=rescales is not None, threshold=tau, prec=prec, scale=scale,
                                     buffers=per_thread.__dict__.setdefault("buffers", {}), check=check,
                                     rows=rows, row_groups=groups, mods=mods_u, v_scale=math.ldexp(1.0, -v_exp),
                                     maxes=mx_i)
        if rescales is not None:
            rescales[unit][..., a, todo] = xp.to_host(events)
        o_i, lse_i = state.finalize_parts() if lse_parts else state.finalize()
        o_i = problem.unscale_values(o_i, v_exp, v_max)
        tail = tuple(lse_i.shape[-1:]) if lse_parts else ()  # (m, log l) of each row
        if packed:
            o_i = o_i.reshape(tuple(o_i.shape[:-2]) + (g, q1 - q0, dv))
            lse_i = lse_i.reshape(tuple(lse_i.shape[:-1 - len(tail)]) + (g, q1 - q0) + tail)
            mx_i = None if mx_i is None else mx_i.reshape(tuple(mx_i.shape[:-1]) + (g, q1 - q0))
        if mx_i is not None:
            maxes[unit][..., q0:q1] = mx_i
        out[unit][..., q0:q1, :] = o_i
        lse[unit][(..., slice(q0, q1)) + ((slice(None),) if lse_parts else ())] = lse_i

    return n_q_tiles * len(units), unit_tile


__all__ = ["attention", "AttentionStats", "TileSizes", "DEFAULT_TILES", "LARGE_HEAD_TILES", "default_tiles"]


def max_sum_exp(q, k, v, *, lse_base=None, device=None, **options):
    """``(max_scores, sum_exp)``: the row statistics kernels return in place of the LSE (cuDNN's
    ``score_max``, ``score_sum_exp``; tokamax's residuals), ``sum_exp_i = sum_j exp(s_ij -
    max_i)`` over the visible keys (the sink is no key's score: not in it), 0 and ``-inf`` on
    rows with no visible key, so that ``max + log(sum_exp)`` is the keys' LSE.  ``max_scores`` in
    base 2 with ``lse_base=2`` (``sum_exp`` is the same in either base).  ``options``: `attention`'s.
    From one call: the keys' LSE (the sink excluded) and the max, ``sum_exp = exp(lse - max)``
    (relative error about ``u |lse|``)."""
    sink = "excluded" if options.get("sinks") is not None else None
    _, lse, top = attention(q, k, v, return_lse=True, return_max_scores=True, lse_sink=sink, device=device,
                            **options)
    dev = device_of(device, q, k, v)
    xp = NUMPY if dev is None else backend_for(dev, None)
    total = xp.exp(lse - xp.finite_or_zero(top))  # rows without a key: exp(-inf - 0) = 0
    base2 = lse_conventions.LseConvention.parse(lse_base).base == 2.0
    return (top / lse_conventions.LN2 if base2 else top), total
