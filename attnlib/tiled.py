"""The tiled attention kernel: FlashAttention's forward pass in numpy, in float64.

The Python loop runs over ``(query tile, key tile)`` pairs; every batch and head is
processed at once inside a tile by broadcasting matmul.  Working memory is a few
``(..., block_q, block_k)`` and ``(..., block_q, Dv)`` arrays, independent of ``Sq`` and
``Sk``.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from threadpoolctl import ThreadpoolController

from . import _args, flex
from .masks import PARTIAL, SKIP, mask_specs
from .online import OnlineSoftmax, lse_of, merge_attention, merge_parts


@dataclass(frozen=True)
class TileSizes:
    """Tile shape of the kernel: ``block_q`` query rows by ``block_k`` keys."""

    block_q: int = 256
    block_k: int = 256

    def __post_init__(self):
        _args.positive_int(self.block_q, "block_q")
        _args.positive_int(self.block_k, "block_k")


DEFAULT_TILES = TileSizes()
#: The forward's tiles for heads of ``D >= 128``: a ``(512, 128) @ (128, 512)`` score product
#: runs closer to BLAS's peak, and four times fewer tiles mean less per-tile Python work.
#: Measured on a 2-core Xeon, default workers, interleaved medians of 3 (256x256 -> 512x512):
#: (1, 4, 8192, 128) causal 1.43 -> 1.24 s, full 2.64 -> 2.06 s; (2, 16, 2048, 128) causal
#: 0.89 -> 0.89 s, full 1.46 -> 1.32 s.  At D = 64 the larger tiles lost: (1, 8, 4096, 64)
#: causal 0.43 -> 0.55 s (the causal diagonal's wasted half grows with the tile).
LARGE_HEAD_TILES = TileSizes(512, 512)


def default_tiles(d: int) -> TileSizes:
    """The forward's default tiles for head dimension ``d``: `DEFAULT_TILES`, or
    `LARGE_HEAD_TILES` from ``d = 128`` on."""
    return LARGE_HEAD_TILES if d >= 128 else DEFAULT_TILES


@dataclass(frozen=True)
class AttentionStats:
    """What the kernel did, tile by tile (the contract's "Stats").

    Attributes
    ----------
    block_q, block_k : int
        Tile sizes used; tile ``(a, b)`` starts at ``(q0, k0) = (a*block_q, b*block_k)``.
    tile_kind : ndarray of int8, shape ``(..., n_q_tiles, n_k_tiles)``
        ``0 = SKIP, 1 = PARTIAL, 2 = FULL``; leading axes are the batch axes (the same map
        for every entry unless padding or segments differ between them).
    rescales : ndarray of int64, shape ``(..., Hq, n_q_tiles, n_k_tiles)``
        Rescale events per tile and head: query rows whose running max was finite and
        strictly grew in that tile.  For 2-D inputs ``(n_q_tiles, n_k_tiles)``, as ``out``
        has no head axis then.
    rescale_counts : dict
        ``{(q0, k0): events}`` summed over batch and heads, for every processed tile.
    processed_tiles, skipped_tiles, total_rescales : int
        Totals over all (batch, head, tile) triples.
    """

    block_q: int
    block_k: int
    tile_kind: np.ndarray = field(repr=False)
    rescales: np.ndarray = field(repr=False)
    rescale_counts: dict = field(repr=False)
    processed_tiles: int
    skipped_tiles: int
    total_rescales: int


def attention(q, k, v, *, causal=False, causal_align="bottom_right", window=None,
              kv_lengths=None, q_lengths=None, q_segment_ids=None, kv_segment_ids=None,
              softcap=None, alibi_slopes=None, sinks=None, scale=None, block_q=None, block_k=None,
              kv_splits=1, workers=None, rescale_threshold=0.0, compute_dtype=None,
              return_lse=False, return_stats=False, check_finite=True, block_table=None,
              cache_seqlens=None, mask_mod=None, score_mod=None, block_mask=None):
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
        `_safe_threshold`): ``log(max_acc / (Sk * max(1, max|v|))) - log 2`` for the state
        ``(l, acc)`` in the accumulate type (float32 unless float64: about
        ``88.7 - log(Sk)``), and ``log(max_compute) - log 2 ~ 10.4`` for float16, whose
        rounded ``p`` must stay finite.  In float64 with ordinary ``v`` nothing is clamped.
    compute_dtype : {None, "float64", "float32", "float16", "bfloat16"}
        The precision a kernel under test runs in: q, k, v and the weights ``p`` are
        rounded to it, the scores and ``(m, l, acc)`` kept in float32 (for the 16-bit types,
        as GPU kernels do; bfloat16 needs ``ml_dtypes``).  ``out`` is returned in it and
        ``lse`` in float32.  Default: float64 throughout.
    workers : int, optional
        Threads that take (head block, query tile) units in parallel; default (None, or
        -1): one per available CPU.  numpy releases the GIL in matmul and ``exp``.  The
        result is bit-identical for every thread count (the units and their arithmetic do
        not depend on it), and the working memory grows by one tile's buffers per thread.
        BLAS is held to one thread meanwhile, so the machine is never oversubscribed.
    return_lse : bool
        Also return ``lse: (..., Hq, Sq)``.
    return_stats : bool
        Also return an `AttentionStats` (costs ``O(Hq * n_q_tiles * n_k_tiles)`` memory).
    check_finite : bool
        Refuse inputs holding NaN or inf (checked in chunks, within the memory bound).
    mask_mod, score_mod : callable, optional
        FlexAttention's programmable mask ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and score
        ``score_mod(score, b, h, q_idx, kv_idx) -> score``, called on numpy index arrays of
        one tile at a time (see `attnlib.flex`): the mask combines with the built-in ones by
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
        a time, with key tiles on page boundaries (`attnlib.paged.paged_attention`, whose
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
    if block_table is not None or cache_seqlens is not None:
        if block_table is None or cache_seqlens is None:
            raise ValueError("a paged KV cache needs both block_table and cache_seqlens")
        unsupported = {"kv_lengths": kv_lengths, "q_lengths": q_lengths, "q_segment_ids": q_segment_ids,
                       "kv_segment_ids": kv_segment_ids, "return_stats": return_stats or None,
                       "kv_splits": None if kv_splits == 1 else kv_splits,
                       "rescale_threshold": rescale_threshold or None,
                       "compute_dtype": None if compute_dtype in (None, "float64") else compute_dtype,
                       "mask_mod": mask_mod, "score_mod": score_mod, "block_mask": block_mask}
        given = sorted(name for name, value in unsupported.items() if value is not None)
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with a paged KV cache "
                             "(cache_seqlens gives the key lengths)")
        from .paged import paged_attention

        if block_k is not None:  # paged_attention calls it chunk_keys
            _args.positive_int(block_k, "block_k")
        return paged_attention(q, k, v, block_table, cache_seqlens, causal=causal, causal_align=causal_align,
                               window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                               scale=scale, block_q=block_q, chunk_keys=block_k, workers=workers,
                               return_lse=return_lse, check_finite=check_finite)
    if block_q is not None:
        _args.positive_int(block_q, "block_q")
    if block_k is not None:
        _args.positive_int(block_k, "block_k")
    kv_splits = _args.positive_int(kv_splits, "kv_splits")
    workers = _args.workers(workers)
    tau = _args.threshold(rescale_threshold)
    prec = _args.precision(compute_dtype)
    return_lse = _args.flag(return_lse, "return_lse")
    return_stats = _args.flag(return_stats, "return_stats")
    q5, k5, v5, pb = _args.parse(q, k, v, scale=scale, check_finite_inputs=check_finite)
    base = default_tiles(pb.d)
    block_mask = flex.as_block_mask(block_mask)  # FlexAttention's too
    if block_mask is not None:  # its tiles, unless asked otherwise
        base = TileSizes(block_mask.block_q, block_mask.block_k)
    tiles = TileSizes(base.block_q if block_q is None else block_q,
                      base.block_k if block_k is None else block_k)
    specs = mask_specs(pb.batch, pb.sq, pb.sk, causal=causal, causal_align=causal_align,
                       window=window, q_lengths=q_lengths, kv_lengths=kv_lengths,
                       q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    cap = _args.softcap_in(_args.softcap(softcap), prec.accumulate, prec.name)
    slopes = _args.alibi_slopes(alibi_slopes, pb, prec.accumulate)  # (..., hk, g)
    sink = _args.sinks(sinks, pb, prec.accumulate)  # (..., hk, g)
    mods = flex.mods_for(mask_mod, score_mod, block_mask, pb, pb.sq, pb.sk, tiles)

    _args.check_representable(prec, q=q5, k=k5, v=v5)
    check = _args.scores_may_overflow(q5, k5, pb.scale, prec.accumulate)
    v_max = _args.abs_max(v5)  # once, for every key range below
    if tau:
        tau = _safe_threshold(tau, prec, pb.sk, v_max)
    n_k_tiles = -(-pb.sk // tiles.block_k)
    # More ranges than key tiles would only add empty ones (each a pass over the queries).
    splits = np.array_split(np.arange(n_k_tiles), max(1, min(kv_splits, n_k_tiles)))
    # The sink joins the first key range's state only: once per row, whatever the split.
    # float64 partials keep their lse in two parts (m, log l), which merge without the loss
    # of a one-float lse at large scores; a low precision merges its lse, as its kernel does.
    parts = len(splits) > 1 and prec.is_float64
    partials = [_run(q5, k5, v5, pb, specs, tiles, cap, slopes, return_stats,
                     (int(part[0]), int(part[-1]) + 1) if part.size else (0, 0), workers, tau, prec,
                     check, sink=sink if r == 0 else None, mods=mods, lse_parts=parts, v_max=v_max)
                for r, part in enumerate(splits)]
    if len(partials) == 1:
        out, lse = partials[0][:2]
    elif parts:
        out, merged = merge_parts([p[0] for p in partials], [p[1] for p in partials])
        lse = lse_of(merged)
    else:
        out, lse = merge_attention([p[0] for p in partials], [p[1] for p in partials])
    if not prec.is_float64:  # what a kernel in that precision would write out
        out, lse = out.astype(prec.compute), lse.astype(prec.accumulate)

    result = [pb.merge_heads(out, 2)]
    if return_lse:
        result.append(pb.merge_heads(lse, 1))
    if return_stats:
        rescales = sum(p[2] for p in partials)
        result.append(_stats(rescales, partials[0][3], pb, tiles))
    return result[0] if len(result) == 1 else tuple(result)


def _safe_threshold(tau, prec, n_keys, v_max):
    """The largest lazy-rescale threshold ``<= tau`` whose weights cannot overflow ``prec``.

    With a stale max every weight is ``p = exp(s - m) <= exp(tau)``, and until the max
    moves the state sums them: ``l <= n_keys * exp(tau)`` and
    ``|acc| <= n_keys * exp(tau) * v_max``, in the accumulate type (float32 for the low
    precisions: ``exp(100)`` alone overflows it).  With a 16-bit ``p`` (rounded to the
    compute type before ``p @ v``) also ``exp(tau) <= max_compute`` (float16: 65504, so
    ``tau <= 11.09``).  Both get a factor-2 margin for rounding::

        tau <= log(max_acc) - log(n_keys) - log(max(1, v_max)) - log 2
        tau <= log(max_compute) - log 2            (low precision only)

    The result is clamped to ``[0, tau]``: 0 (eager) needs no bound, as its weights are
    ``<= 1``.  ``prec`` is a `_args.Precision` or a ``compute_dtype`` value.  Clamping
    changes only the reference point of the weights, not the result (up to rounding);
    ``stats`` count the rescales done with the clamped threshold.
    """
    if not tau:
        return tau
    if not isinstance(prec, _args.Precision):
        prec = _args.precision(prec)
    margin = math.log(2.0)
    bound = (math.log(float(_args.finfo(prec.accumulate).max)) - math.log(max(n_keys, 1))
             - math.log(max(v_max, 1.0)) - margin)
    if not prec.is_float64:
        bound = min(bound, math.log(float(_args.finfo(prec.compute).max)) - margin)
    return min(float(tau), max(0.0, bound))


def _run(q, k, v, pb, specs, tiles, cap, slopes, count_rescales, key_tiles, workers, tau=0.0,
         prec=None, check=False, sink=None, mods=None, lse_parts=False, v_max=None):
    """Attend to the key tiles ``[b_lo, b_hi)``: ``(out, lse, rescales, kinds)``, grouped heads.
    ``lse_parts``: ``lse`` as ``(..., sq, 2)`` parts ``(m, log l)``, for partials to merge
    (`online.merge_parts`).  ``v_max``: ``max |v|``, if the caller has it.

    ``q: (*batch, hk, g, sq, d)``; one plan per entry of ``specs`` (all batch entries at
    once when the mask does not depend on them), and the work items of every plan on one
    pool of ``workers`` threads, so that batch entries with masks of their own (padding,
    documents) run in parallel too.  ``sink``: the grouped sinks ``(..., hk, g)``, the
    rows' initial state, or None.
    """
    lead = q.shape[:-2]
    # Values near the type's range are summed divided by 2**e (see `_args.value_exponent`).
    v_max = _args.abs_max(v) if v_max is None else v_max
    v_exp = _args.value_exponent(v_max, pb.sk, np.float64 if prec is None else prec.accumulate)
    out = np.empty(lead + (pb.sq, pb.dv))
    lse = np.empty(lead + (pb.sq,) + ((2,) if lse_parts else ()))
    kinds = rescales = None
    if count_rescales:
        # The tile map and per-tile counts grow as (Sq / block_q) * (Sk / block_k): kept
        # only when stats are asked for.
        shape = (-(-pb.sq // tiles.block_q), -(-pb.sk // tiles.block_k))
        _args.check_allocation(9 * math.prod(lead + shape), f"return_stats's per-tile counts of "
                               f"{shape[0]} x {shape[1]} tiles per head (block_q={tiles.block_q}, "
                               f"block_k={tiles.block_k})")
        kinds = np.empty(pb.batch + shape, dtype=np.int8)
        rescales = np.zeros(lead + shape, dtype=np.int64)
    if not math.prod(lead):  # a zero-size batch axis: nothing to compute, no tile to map
        return out, lse, rescales, kinds
    plans = []  # (items, fn) per entry
    per_thread = threading.local()  # each thread's tile buffers, shared by every entry's plan
    for idx, spec in specs.items():
        # idx = () selects everything: all batch entries share one mask.
        plans.append(_forward(q[idx], k[idx], v[idx], pb.scale, spec, tiles, cap,
                              _args.for_entry(slopes, idx),
                              out[idx], lse[idx],
                              None if rescales is None else rescales[idx],
                              None if kinds is None else kinds[idx], key_tiles, tau, prec, check,
                              per_thread, _args.for_entry(sink, idx),
                              None if mods is None else flex.Mods(*mods, *flex.index_grids(pb, idx)),
                              (v_exp, v_max), lse_parts))
    starts = np.cumsum([0] + [n for n, _ in plans])  # item i belongs to the plan whose range holds it

    def item(i):
        p = int(np.searchsorted(starts, i, side="right")) - 1
        plans[p][1](i - int(starts[p]))

    run_tiles(item, range(int(starts[-1])), workers)
    return out, lse, rescales, kinds


#: Bytes of one score tile ``(..., block_k, block_q)`` that a work unit aims at: heads are
#: grouped into a unit up to this size, so that the tile and its exponentials stay in a
#: core's L2 cache (1-2 MiB on the machines measured) while a unit still batches enough
#: heads for its matmuls to dwarf the per-tile Python work.  (1, 8, 4096, 64) causal on
#: one thread: 0.5 MiB units (one head) took 654 ms, 4 MiB (all eight heads) 672 ms;
#: decode (Sq = 1) puts hundreds of heads in one unit instead of one per unit.
_UNIT_BYTES = 1 << 20
#: Fewest work units worth making when heads can be split further (decode: one query
#: tile), so that threads have something to share; fixed, not taken from ``workers``,
#: so that the grouping, and with it every rounding, is the same for any thread count.
_MIN_UNITS = 8


def work_units(lead: tuple, n_rows: int, n_keys: int, n_q_tiles: int, itemsize: int = 8) -> list:
    """Split the head axes ``lead`` into work units: a list of index tuples into ``lead``.

    Each unit is an index that selects a block of whole heads (ints on the leading axes,
    then one slice), as many as keep a ``(heads, n_keys, n_rows)`` score tile within
    `_UNIT_BYTES`, but no more than leave `_MIN_UNITS` units over all ``n_q_tiles``, unless
    that would make a unit's tile smaller than an eighth of `_UNIT_BYTES` (decode: one
    query row per head, so hundreds of heads make one worthwhile step).
    Together the units cover every head exactly once, in C order.
    """
    n = math.prod(lead)
    head_tile = max(1, n_rows) * max(1, n_keys)  # scores per head in one tile
    per_unit = max(1, _UNIT_BYTES // (itemsize * head_tile))
    # Split further for more units, but not into tiles too small to be worth a step.
    smallest = -(-_UNIT_BYTES // (8 * itemsize * head_tile))
    per_unit = min(per_unit, max(smallest, n // -(-_MIN_UNITS // max(1, n_q_tiles))))
    per_unit = max(1, per_unit)
    # The unit spans axes j.. whole (their product fits), and a chunk of axis j - 1.
    j = len(lead)
    while j > 0 and math.prod(lead[j - 1:]) <= per_unit:
        j -= 1
    if j == 0:
        return [()]
    inner = math.prod(lead[j:])
    chunk = max(1, per_unit // inner)
    return [u + (slice(c, min(c + chunk, lead[j - 1])),)
            for u in np.ndindex(*lead[:j - 1]) for c in range(0, lead[j - 1], chunk)]


def _unit_of(arr, unit: tuple):
    """``arr[unit]`` for an array whose head axes broadcast against the unit's: a size-1
    axis gives its one entry (index 0, or whole where the unit takes a slice)."""
    return arr[tuple(i if n != 1 else slice(None) if isinstance(i, slice) else 0
                     for n, i in zip(arr.shape, unit))]


def _forward(q, k, v, scale, spec, tiles, cap, slopes, out, lse, rescales, kinds, key_tiles,
             tau, prec, check, per_thread, sink=None, mods=None, values=(0, 0.0), lse_parts=False):
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
    ``values``: ``(e, max|v|)``, the values summed divided by ``2**e`` (`_args.value_exponent`).
    """
    v_exp, v_max = values
    bq, bk = tiles.block_q, tiles.block_k
    lead, sq, dv = q.shape[:-2], q.shape[-2], v.shape[-1]
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
    units = work_units(lead[:-1] if packed else lead, groups * min(bq, sq), min(bk, k.shape[-2]),
                       n_q_tiles)
    if slopes is not None:
        slopes = np.broadcast_to(slopes, lead)  # (*lead,): one slope per head
    if sink is not None:
        sink = np.broadcast_to(sink, lead)  # (*lead,): one sink per head

    def unit_tile(item):
        # The longest (last, under causal) query tiles go first so the threads finish together.
        a, unit = n_q_tiles - 1 - item // len(units), units[item % len(units)]
        q0, q1 = a * bq, min(sq, (a + 1) * bq)
        tile_kinds = spec.tile_kind(q0, q1, k_starts, k_ends, kv_ranges)  # (n_k_tiles,), closed form
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
            with np.errstate(over="ignore") if check else contextlib.nullcontext():
                q_i = q_u[..., q0:q1, :].astype(np.float64) * scale  # (..., bq, d); inf: caught below
            dtype = np.float64
        else:  # rounded q; the scale goes on the float32 scores, as in low-precision kernels
            q_i = prec.round(q_u[..., q0:q1, :])
            dtype = prec.accumulate
        rows = None
        if packed:  # (..., g, r, d) -> (..., g * r, d); the rows' positions repeat per head
            q_i = q_i.reshape(q_i.shape[:-3] + (g * (q1 - q0), q_i.shape[-1]))
            rows = np.tile(np.arange(q0, q1), g)
        sink_rows = None
        if sink is not None:  # each row starts from its head's sink
            sink_rows = (np.repeat(sink[unit], q1 - q0, axis=-1) if packed  # (..., g * rows)
                         else sink[unit][..., None])  # (..., 1) against (..., rows)
        state = OnlineSoftmax.empty(q_i.shape[:-1], dv, dtype, keys_first=keys_first_for(q_i.shape[-2]),
                                    sink=sink_rows)
        todo = np.flatnonzero((tile_kinds != SKIP) & in_range)
        events = absorb(state, q_i, k_u, v_u, spec, q0, k_starts[todo], k_ends[todo],
                        tile_kinds[todo], cap, slopes if slopes is None else slopes[unit],
                        count=rescales is not None, threshold=tau, prec=prec, scale=scale,
                        buffers=per_thread.__dict__.setdefault("buffers", {}), check=check,
                        rows=rows, row_groups=groups, mods=mods_u, v_scale=math.ldexp(1.0, -v_exp))
        if rescales is not None:
            rescales[unit][..., a, todo] = events
        o_i, lse_i = state.finalize_parts() if lse_parts else state.finalize()
        o_i = _args.unscale_values(o_i, v_exp, v_max)
        tail = lse_i.shape[-1:] if lse_parts else ()  # (m, log l) of each row
        if packed:
            o_i = o_i.reshape(o_i.shape[:-2] + (g, q1 - q0, dv))
            lse_i = lse_i.reshape(lse_i.shape[:-1 - len(tail)] + (g, q1 - q0) + tail)
        out[unit][..., q0:q1, :] = o_i
        lse[unit][(..., slice(q0, q1)) + ((slice(None),) if lse_parts else ())] = lse_i

    return n_q_tiles * len(units), unit_tile


class Aborted(Exception):
    """Raised in a worker that stops waiting because another worker failed."""


def run_tiles(fn, items, workers: int) -> None:
    """``fn(item)`` for each item: in order when ``workers == 1``, else on a thread pool.

    numpy releases the GIL in matmul and ufuncs, so threads run tiles in parallel.  Two
    things do not cross into the threads by themselves and are carried over here: the
    caller's floating-point error state (numpy keeps it per thread, so strict mode would
    silently not apply) and a BLAS limited to one thread; the GIL switch interval is
    shortened meanwhile (both process-wide: see `_parallel_settings`).  BLAS is held to
    one thread with one worker too: tile-sized matmuls gain nothing from BLAS threads and
    lose badly to a busy machine.

    Each thread takes the next item in order from a shared counter, so an item starts only
    after every earlier one has started, and the bookkeeping is a few objects per thread,
    not one per item (a future per tile grew with the number of tiles).  After a failure no
    new item starts; the first exception in item order that is not `Aborted` is re-raised.
    """
    items = list(items)
    if workers == 1 or len(items) < 2:
        with _parallel_settings():
            for item in items:
                fn(item)
        return
    errors = np.geterr()
    lock = threading.Lock()
    cursor = iter(range(len(items)))
    failures = []  # (item index, exception)

    def worker():
        with np.errstate(**errors):
            while True:
                with lock:
                    i = None if failures else next(cursor, None)
                if i is None:
                    return
                try:
                    fn(items[i])
                except BaseException as e:  # reported by the caller's thread below
                    with lock:
                        failures.append((i, e))
                    return

    with _parallel_settings(), ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in range(min(workers, len(items))):
            pool.submit(worker)
    # Leaving the pool waited for every thread, so each failure is known.
    if failures:
        failures.sort(key=lambda f: f[0])
        raise next((e for _, e in failures if not isinstance(e, Aborted)), failures[0][1])


#: The GIL switch interval while workers run (Python's default is 5 ms).  Between the
#: large numpy calls that release the GIL, a tile does a dozen small ones (per-row max,
#: alpha, rescale) that hold it; a thread that then asks for the GIL waits up to the switch
#: interval for the other to let go.  Measured on (1, 1, 4096, 64) causal with 2 workers,
#: median of 15 interleaved runs, two runs: 75-79 ms at 5 ms, 77-78 ms at 0.1 ms, 54-58 ms
#: at 10 us, 50-57 ms at 1 us (1 worker: 81-102 ms); with 8 heads 502 ms at 0.1 ms and
#: 473 ms at 1 us.
_SWITCH_INTERVAL = 1e-6

# The state of `_parallel_settings`, shared by every thread of the process.
_settings_lock = threading.Lock()
_settings_users = 0  # calls inside the guard now
_settings_saved = None  # (switch interval, BLAS limiter or None) seen by the first entrant


@lru_cache(maxsize=1)
def _blas_controller() -> ThreadpoolController:
    return ThreadpoolController()  # finds the BLAS libraries loaded (once: about 1 ms)


@contextlib.contextmanager
def _parallel_settings():
    """Process-wide settings for our worker threads, reference-counted across threads.

    Two settings belong to the whole process, not to a call: the GIL switch interval is
    shortened to `_SWITCH_INTERVAL` (see there), and BLAS is limited to one thread
    (threadpoolctl; about 5 us).  Our threads already keep the cores busy, and a tile's
    matmuls are too small for BLAS threads to pay: a multithreaded BLAS inside each worker
    oversubscribes the machine (2 workers were 1.5x slower than 1 with a 2-thread
    OpenBLAS, and 1.6x faster with a 1-thread one), and even one worker with a 2-thread
    OpenBLAS took 1393 ms instead of 55 ms for (1, 1, 4096, 64) causal while another
    process kept a core busy: BLAS threads spin waiting for each other.

    Calls may overlap (threads each running ``attention(..., workers=2)``), so each cannot
    simply restore what it saw on entry: the second would see the first one's settings
    and put them back after the first had restored the originals, leaving them for the
    rest of the process.  Instead, under one lock, the first entrant saves the originals
    and applies the settings, later ones only count themselves in, and the last one out
    restores the originals, exactly once.  Nesting in one thread works the same way.
    """
    global _settings_users, _settings_saved
    with _settings_lock:
        if _settings_users == 0:
            old = sys.getswitchinterval()
            limiter = _blas_controller().limit(limits=1, user_api="blas")
            sys.setswitchinterval(min(old, _SWITCH_INTERVAL))
            _settings_saved = (old, limiter)
        _settings_users += 1
    try:
        yield
    finally:
        with _settings_lock:
            _settings_users -= 1
            if _settings_users == 0:
                old, limiter = _settings_saved
                _settings_saved = None
                sys.setswitchinterval(old)
                limiter.restore_original_limits()


#: Fewest rows in a tile for the keys-first layout (see `keys_first_for`).
KEYS_FIRST_MIN_ROWS = 64


def keys_first_for(rows: int) -> bool:
    """Whether a tile of ``rows`` query rows is laid out keys first, ``(..., bk, rows)``.

    Keys first, the per-row max, shift and sum run along the outer axis over contiguous
    rows: at 256 x 256 the max took 0.38 ns per score against 0.65 rows first, and ``v^T p``
    is the faster product.  With few rows (decode: one query per head, or a GQA group of
    them) that axis is too short to vectorise: at 4 rows by 256 keys the max took 106 us
    keys first and 8 us rows first (8 heads, measured), so such tiles stay rows first.
    """
    return rows >= KEYS_FIRST_MIN_ROWS


def absorb(state, q_i, k, v, spec, q0, k0s, k1s, kinds, cap=None, slopes=None, *,
           key_offset=0, count=False, threshold=0.0, prec=None, scale=None, buffers=None,
           check=False, rows=None, row_groups=1, mods=None, v_scale=1.0):
    """Feed the key tiles ``[k0s[t], k1s[t])`` (ascending, none SKIP) into one query tile.

    ``q_i: (..., bq, d)`` is the scaled query tile starting at row ``q0``; ``k, v`` hold
    the keys from absolute position ``key_offset`` on (0, or a streamed chunk's start);
    ``kinds`` says which tiles are PARTIAL.  Scores follow the contract's order: softcap,
    mask (``-inf``), ALiBi.  ``threshold`` is the lazy-rescale threshold of
    `OnlineSoftmax.update`.  With a low precision ``prec`` (`_args.Precision`), ``q_i``
    is rounded but unscaled, k and v are rounded per tile, ``scale`` multiplies the
    float32 scores and ``p`` is rounded before ``p @ v``.  ``buffers``, a dict the caller
    keeps (one per thread), lets the score and ``p @ v`` buffers be reused from one query
    tile to the next.  ``check`` has each tile's scores checked for overflow (see
    `tile_scores`).  ``rows``: the absolute positions of the tile's rows (default
    ``q0, q0 + 1, ...``); a GQA-packed tile repeats them once per head, and
    ``row_groups`` (its head count) splits the rescale events per head.  Returns the
    rescale events per tile ``(..., n_tiles)`` (``(..., row_groups, n_tiles)`` when
    packed) when ``count``, else None.  ``mods``: the `attnlib.flex.Mods` of the tile's
    heads (``mask_mod`` joins the PARTIAL tiles' visibility, ``score_mod`` every tile's scores).
    ``v_scale``: a power of two the values are multiplied by (`_args.value_exponent`).
    """
    contiguous = rows is None  # a packed tile's rows repeat per head
    rows = np.arange(q0, q0 + q_i.shape[-2]) if rows is None else rows
    keys_first = keys_first_for(q_i.shape[-2])
    groups = (row_groups,) if row_groups > 1 else ()
    events = np.zeros(state.m.shape[:-1] + groups + (len(k0s),), dtype=np.int64) if count else None
    low = prec is not None and not prec.is_float64
    # One score and one p @ v buffer per tile shape, reused tile after tile, and the band
    # masks of the PARTIAL tiles (`MaskSpec.tile_visible`).
    buffers = {} if buffers is None else buffers
    band_masks = buffers.setdefault("band masks", {})
    for t, (k0, k1) in enumerate(zip(k0s, k1s)):
        a, b = k0 - key_offset, k1 - key_offset  # positions in the arrays
        if low:
            k_j, v_j = prec.round(k[..., a:b, :]), prec.round(v[..., a:b, :])
        else:
            # Aligned (a copy only if not): numpy multiplies misaligned arrays in its own loop,
            # not BLAS, with other roundings, so the bits would depend on where the input lies.
            k_j = np.require(k[..., a:b, :].astype(np.float64, copy=False), requirements="A")  # (..., bk, d)
            v_j = np.require(v[..., a:b, :].astype(np.float64, copy=False), requirements="A")  # (..., bk, dv)
        if v_scale != 1.0:  # exact: a power of two
            v_j = v_j * v_scale
        shape = (state.acc.shape, b - a, state.acc.dtype)
        if shape not in buffers:
            lead = np.broadcast_shapes(q_i.shape[:-2], k_j.shape[:-2])
            tile = (b - a, q_i.shape[-2]) if keys_first else (q_i.shape[-2], b - a)
            pv = state.acc.shape[:-2] + (state.acc.shape[:-3:-1] if keys_first else state.acc.shape[-2:])
            buffers[shape] = (np.empty(lead + tile, dtype=state.acc.dtype),
                              np.empty(pv, dtype=state.acc.dtype))  # (..., dv, bq) keys first
        s_buf, pv_buf = buffers[shape]
        # Keys first: s = k_j q_i^T, (..., bk, bq) (see keys_first_for).
        vis = (spec.tile_visible(rows, k0, k1, keys_first, contiguous=contiguous, cache=band_masks)
               if kinds[t] == PARTIAL else None)  # laid out as s
        if mods is not None and kinds[t] == PARTIAL:  # AND mask_mod: (..., tile), per head
            vis = mods.visible(vis, rows, np.arange(k0, k1), keys_first)
        s, _ = tile_scores(q_i, k_j, spec, rows, np.arange(k0, k1), kinds[t], cap, slopes, out=s_buf,
                           post_scale=scale if low else None, check=check, keys_first=keys_first,
                           vis=vis, mods=mods)
        rescaled = state.update(s, v_j, threshold=threshold, overwrite_s=True, pv=pv_buf,
                                round_p=prec.round if low else None,
                                keys_first=keys_first, visible=vis)  # s now holds p
        if count:  # per head: a packed tile's rows are row_groups heads' rows
            events[..., t] = rescaled.reshape(rescaled.shape[:-1] + groups + (-1,)).sum(axis=-1)
    return events


def tile_scores(q_i, k_j, spec, rows, cols, kind, cap=None, slopes=None, keep_tanh=False, out=None,
                post_scale=None, check=False, keys_first=False, vis=None, mods=None, mod_grad=None):
    """One tile's scores in the contract's order: ``(scale q) k^T``, softcap, mask, ALiBi.

    ``q_i: (..., bq, d)`` is already scaled; ``rows``/``cols`` are the tile's absolute
    query and key positions; ``out`` an optional buffer for the result; ``post_scale``
    multiplies the product instead (low precision: q is rounded unscaled).  Returns
    ``(s, th)``: ``s: (..., bq, bk)`` with ``-inf`` on invisible pairs, and
    ``th = tanh(t / cap)`` of the pre-cap scores ``t`` when ``keep_tanh`` (the backward
    pass needs ``1 - th**2``), else None.  ``keys_first``: ``s`` is the transposed tile
    ``(..., bk, bq) = k_j q_i^T`` instead (what `OnlineSoftmax.update` takes with
    ``keys_first``; BLAS reads ``q_i`` transposed in place).  ``check``: raise ValueError
    if a visible pair's scaled product ``scale * q . k`` is not finite (callers ask for it
    only when `_args.scores_may_overflow` says it may be, so the usual tile pays nothing).
    ``vis``: a PARTIAL tile's visibility laid out as ``s``, if the caller has it
    (`MaskSpec.tile_visible`); else it is evaluated here.  ``mods`` (`attnlib.flex.Mods`):
    its ``score_mod`` modifies the scores after the softcap, before the mask (``vis`` then
    already holds its ``mask_mod``); ``mod_grad``, a list, receives
    ``score_mod_grad(score, b, h, q_idx, kv_idx)`` of the pre-modification scores for the
    backward pass (``mod_grad[0]`` is that function on entry).
    """
    # An overflow (only possible when `check` is asked for) is reported below.
    with np.errstate(over="ignore", invalid="ignore") if check else contextlib.nullcontext():
        if keys_first:
            s = np.matmul(k_j, np.swapaxes(q_i, -1, -2), out=out)  # (..., bk, bq)
        else:
            s = np.matmul(q_i, np.swapaxes(k_j, -1, -2), out=out)  # (..., bq, bk)
        if post_scale is not None:
            s *= post_scale

    def pairs(grid):  # a (bq, bk) grid over the pairs, laid out as s
        return grid.T if keys_first else grid

    if kind == PARTIAL and vis is None:
        vis = spec.visible(rows, cols, keys_first)
    if check:
        bad = ~np.isfinite(s)
        if bad.any():
            # Only a visible pair's score is used; an invisible one is set to 0 (masked
            # below), which keeps softcap's tanh and its derivative finite.
            if kind != PARTIAL or (bad & vis).any():
                raise ValueError(_args.overflow_message(s.dtype))
            s[bad] = 0.0
    th = None
    if cap is not None:  # softcap, before masking
        with np.errstate(over="ignore"):  # s / cap beyond the range: tanh(+-inf) = +-1, exact
            s /= cap
        np.tanh(s, out=s)
        th = s.copy() if keep_tanh else None
        s *= cap
    if mods is not None and mods.score_mod is not None:  # score_mod: after the softcap, before masks
        grids = mods.grids(rows, cols, keys_first)
        if mod_grad is not None:
            mod_grad.append(flex.score_values(mod_grad[0], s, *grids, name="score_mod_grad"))
        s[...] = flex.score_values(mods.score_mod, s, *grids)
    if kind == PARTIAL:
        np.copyto(s, -np.inf, where=~vis)
    if mods is not None and mods.score_mod is not None:
        # A visible pair's modified score must be a number or -inf (FlexAttention's way to
        # mask from a score_mod); NaN or +inf would make the softmax undefined.
        bad = np.isnan(s) | np.isposinf(s)
        if bad.any():
            raise ValueError(f"score_mod returned NaN or +inf for a visible pair (query "
                             f"{int(np.asarray(rows)[np.argwhere(bad)[0][-1 if keys_first else -2]])}); "
                             "it must return finite scores, or -inf to mask")
    if slopes is not None:  # ALiBi, after masking: -inf stays -inf
        # A bias on a score near -max may overflow it (only where `check` is asked for: else
        # |s| < max / 16 and the bias < max / 4): a visible score beyond the range, refused.
        finite = np.isfinite(s) if check else None
        with np.errstate(over="ignore") if check else contextlib.nullcontext():
            s -= slopes[..., None, None] * pairs(spec.distance(rows, cols))
        if check and (finite & ~np.isfinite(s)).any():
            raise ValueError(_args.overflow_message(s.dtype))
    return s, th


def _stats(rescales, kinds, pb, tiles) -> AttentionStats:
    """Stats from the per-tile counts ``(*batch, hk, g, nq, nk)`` and map ``(*batch, nq, nk)``."""
    # (*batch, hk, g, nq, nk) -> (*batch, hq, nq, nk), or (nq, nk) for 2-D inputs as for out.
    rescales = pb.merge_heads(rescales, 2)
    per_tile = rescales.sum(axis=tuple(range(rescales.ndim - 2)))  # (nq, nk)
    processed = kinds != SKIP  # (*batch, nq, nk)
    anywhere = processed.any(axis=tuple(range(processed.ndim - 2)))  # (nq, nk)
    n_processed = int(np.count_nonzero(processed))
    return AttentionStats(
        block_q=tiles.block_q,
        block_k=tiles.block_k,
        tile_kind=kinds,
        rescales=rescales,
        rescale_counts={
            (int(a) * tiles.block_q, int(b) * tiles.block_k): int(per_tile[a, b])
            for a, b in np.argwhere(anywhere)
        },
        processed_tiles=n_processed * pb.hq,
        skipped_tiles=(kinds.size - n_processed) * pb.hq,
        total_rescales=int(rescales.sum()),
    )


__all__ = ["attention", "AttentionStats", "TileSizes", "DEFAULT_TILES", "LARGE_HEAD_TILES", "default_tiles"]
