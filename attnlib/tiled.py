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

from . import _args
from .masks import PARTIAL, SKIP, mask_specs
from .online import OnlineSoftmax, merge_attention


@dataclass(frozen=True)
class TileSizes:
    """Tile shape of the kernel: ``block_q`` query rows by ``block_k`` keys."""

    block_q: int = 256
    block_k: int = 256

    def __post_init__(self):
        _args.positive_int(self.block_q, "block_q")
        _args.positive_int(self.block_k, "block_k")


DEFAULT_TILES = TileSizes()


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
              softcap=None, alibi_slopes=None, scale=None, block_q=None, block_k=None,
              kv_splits=1, workers=1, rescale_threshold=0.0, compute_dtype=None,
              return_lse=False, return_stats=False, check_finite=True):
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
    scale : float, optional
        Score scale, ``1/sqrt(D)`` by default.
    block_q, block_k : int, optional
        Tile sizes (default `DEFAULT_TILES`); the last tiles may be ragged.
    kv_splits : int
        Split the key tiles into this many contiguous ranges, attend to each separately and
        combine the partial results with `merge_attention` (split-KV / FlashDecoding).
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
    workers : int
        Threads that take query tiles in parallel (-1: one per CPU).  numpy releases the
        GIL in matmul and ``exp``; the result is bit-identical to ``workers=1``, and the
        working memory grows by one tile's buffers per thread.
    return_lse : bool
        Also return ``lse: (..., Hq, Sq)``.
    return_stats : bool
        Also return an `AttentionStats` (costs ``O(Hq * n_q_tiles * n_k_tiles)`` memory).
    check_finite : bool
        Refuse inputs holding NaN or inf (checked in chunks, within the memory bound).

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
    tiles = TileSizes(
        DEFAULT_TILES.block_q if block_q is None else block_q,
        DEFAULT_TILES.block_k if block_k is None else block_k,
    )
    kv_splits = _args.positive_int(kv_splits, "kv_splits")
    workers = _args.workers(workers)
    tau = _args.threshold(rescale_threshold)
    prec = _args.precision(compute_dtype)
    return_lse = _args.flag(return_lse, "return_lse")
    return_stats = _args.flag(return_stats, "return_stats")
    q5, k5, v5, pb = _args.parse(q, k, v, scale=scale, check_finite_inputs=check_finite)
    specs = mask_specs(pb.batch, pb.sq, pb.sk, causal=causal, causal_align=causal_align,
                       window=window, q_lengths=q_lengths, kv_lengths=kv_lengths,
                       q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    cap = _args.softcap(softcap)
    slopes = _args.alibi_slopes(alibi_slopes, pb)  # (..., hk, g)

    _args.check_representable(prec, q=q5, k=k5, v=v5)
    check = _args.scores_may_overflow(q5, k5, pb.scale, prec.accumulate)
    if tau:
        tau = _safe_threshold(tau, prec, pb.sk, _args.abs_max(v5))
    n_k_tiles = -(-pb.sk // tiles.block_k)
    splits = np.array_split(np.arange(n_k_tiles), kv_splits)
    partials = [_run(q5, k5, v5, pb, specs, tiles, cap, slopes, return_stats,
                     (int(part[0]), int(part[-1]) + 1) if part.size else (0, 0), workers, tau, prec,
                     check)
                for part in splits]
    if len(partials) == 1:
        out, lse = partials[0][:2]
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
         prec=None, check=False):
    """Attend to the key tiles ``[b_lo, b_hi)``: ``(out, lse, rescales, kinds)``, grouped heads.

    ``q: (*batch, hk, g, sq, d)``; one pass per entry of ``specs`` (all batch entries at
    once when the mask does not depend on them).
    """
    lead = q.shape[:-2]
    out = np.empty(lead + (pb.sq, pb.dv))
    lse = np.empty(lead + (pb.sq,))
    kinds = rescales = None
    if count_rescales:
        # The tile map and per-tile counts grow as (Sq / block_q) * (Sk / block_k): kept
        # only when stats are asked for.
        shape = (-(-pb.sq // tiles.block_q), -(-pb.sk // tiles.block_k))
        kinds = np.empty(pb.batch + shape, dtype=np.int8)
        rescales = np.zeros(lead + shape, dtype=np.int64)
    for idx, spec in specs.items():
        # idx = () selects everything: all batch entries share one mask.
        _forward(q[idx], k[idx], v[idx], pb.scale, spec, tiles, cap,
                 _args.for_entry(slopes, idx),
                 out[idx], lse[idx],
                 None if rescales is None else rescales[idx],
                 None if kinds is None else kinds[idx], key_tiles, workers, tau, prec, check)
    return out, lse, rescales, kinds


def _forward(q, k, v, scale, spec, tiles, cap, slopes, out, lse, rescales, kinds, key_tiles,
             workers=1, tau=0.0, prec=None, check=False):
    """The kernel for one mask: ``q: (*lead, sq, d)``, ``k, v: (*lead', sk, .)``.

    Writes ``out (*lead, sq, dv)``, ``lse (*lead, sq)`` and, when given, the tile map
    ``kinds (..., nq, nk)`` and per-tile ``rescales (*lead, nq, nk)`` in place.  Query
    tiles are independent, so ``workers`` threads may take them in any order: each writes
    only its own rows, with the same arithmetic, so the result is bit-identical.
    ``check`` has every tile's scores checked for overflow (see `tile_scores`).
    """
    bq, bk = tiles.block_q, tiles.block_k
    lead, sq, dv = q.shape[:-2], q.shape[-2], v.shape[-1]
    k_starts, k_ends, kv_ranges = spec.key_tiles(bk)  # (n_k_tiles,) each
    in_range = np.zeros(k_starts.size, dtype=bool)
    in_range[key_tiles[0]:key_tiles[1]] = True
    per_thread = threading.local()  # each thread's tile buffers, kept across its query tiles

    def query_tile(a):
        q0, q1 = a * bq, min(sq, (a + 1) * bq)
        row_kinds = spec.tile_kind(q0, q1, k_starts, k_ends, kv_ranges)  # (n_k_tiles,), closed form
        if kinds is not None:
            kinds[..., a, :] = row_kinds
        if prec is None or prec.is_float64:
            # The scale is applied once per query tile: a (..., bq, d) copy, never all of q.
            with np.errstate(over="ignore") if check else contextlib.nullcontext():
                q_i = q[..., q0:q1, :].astype(np.float64) * scale  # (..., bq, d); inf: caught below
            state = OnlineSoftmax.empty(lead + (q1 - q0,), dv)
        else:  # rounded q; the scale goes on the float32 scores, as in low-precision kernels
            q_i = prec.round(q[..., q0:q1, :])
            state = OnlineSoftmax.empty(lead + (q1 - q0,), dv, prec.accumulate)
        todo = np.flatnonzero((row_kinds != SKIP) & in_range)
        events = absorb(state, q_i, k, v, spec, q0, k_starts[todo], k_ends[todo],
                        row_kinds[todo], cap, slopes, count=rescales is not None, threshold=tau,
                        prec=prec, scale=scale, buffers=per_thread.__dict__.setdefault("buffers", {}),
                        check=check)
        if rescales is not None:
            rescales[..., a, todo] = events
        out[..., q0:q1, :], lse[..., q0:q1] = state.finalize()

    # The longest (last, under causal) query tiles go first so the threads finish together.
    run_tiles(query_tile, range(-(-sq // bq) - 1, -1, -1), workers)


class Aborted(Exception):
    """Raised in a worker that stops waiting because another worker failed."""


def run_tiles(fn, items, workers: int) -> None:
    """``fn(item)`` for each item: in order when ``workers == 1``, else on a thread pool.

    numpy releases the GIL in matmul and ufuncs, so threads run tiles in parallel.  Two
    things do not cross into the threads by themselves and are carried over here: the
    caller's floating-point error state (numpy keeps it per thread, so strict mode would
    silently not apply) and a BLAS limited to one thread; the GIL switch interval is
    shortened meanwhile (both process-wide: see `_parallel_settings`).  The first
    exception in submission order that is not `Aborted` is re-raised.
    """
    items = list(items)
    if workers == 1 or len(items) < 2:
        for item in items:
            fn(item)
        return
    errors = np.geterr()

    def task(item):
        with np.errstate(**errors):
            fn(item)

    with _parallel_settings(), ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(task, item) for item in items]
    # Leaving the pool waited for every task, so each exception is known.
    failures = [f.exception() for f in futures if f.exception() is not None]
    if failures:
        raise next((e for e in failures if not isinstance(e, Aborted)), failures[0])


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
def _blas_controller():
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # optional: pip install attnlib[fast]
        return None
    return ThreadpoolController()


@contextlib.contextmanager
def _parallel_settings():
    """Process-wide settings for our worker threads, reference-counted across threads.

    Two settings belong to the whole process, not to a call: the GIL switch interval is
    shortened to `_SWITCH_INTERVAL` (see there), and BLAS is limited to one thread if
    threadpoolctl is installed (our threads already keep the cores busy; a multithreaded
    BLAS inside each of them oversubscribes the machine: 2 workers were 1.5x slower than 1
    with a 2-thread OpenBLAS, and 1.6x faster with a 1-thread one).

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
            controller = _blas_controller()
            limiter = controller.limit(limits=1, user_api="blas") if controller else None
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
                if limiter is not None:
                    limiter.restore_original_limits()


def absorb(state, q_i, k, v, spec, q0, k0s, k1s, kinds, cap=None, slopes=None, *,
           key_offset=0, count=False, threshold=0.0, prec=None, scale=None, buffers=None,
           check=False):
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
    `tile_scores`).  Returns the rescale events per tile ``(..., n_tiles)`` when ``count``,
    else None.
    """
    rows = np.arange(q0, q0 + q_i.shape[-2])
    events = np.zeros(state.m.shape[:-1] + (len(k0s),), dtype=np.int64) if count else None
    low = prec is not None and not prec.is_float64
    # One score and one p @ v buffer per tile shape, reused tile after tile.
    buffers = {} if buffers is None else buffers
    for t, (k0, k1) in enumerate(zip(k0s, k1s)):
        a, b = k0 - key_offset, k1 - key_offset  # positions in the arrays
        if low:
            k_j, v_j = prec.round(k[..., a:b, :]), prec.round(v[..., a:b, :])
        else:
            k_j = k[..., a:b, :].astype(np.float64, copy=False)  # (..., bk, d)
            v_j = v[..., a:b, :].astype(np.float64, copy=False)  # (..., bk, dv)
        shape = (state.acc.shape, b - a, state.acc.dtype)
        if shape not in buffers:
            lead = np.broadcast_shapes(q_i.shape[:-2], k_j.shape[:-2])
            buffers[shape] = (np.empty(lead + (q_i.shape[-2], b - a), dtype=state.acc.dtype),
                              np.empty(state.acc.shape, dtype=state.acc.dtype))
        s_buf, pv_buf = buffers[shape]
        s, _ = tile_scores(q_i, k_j, spec, rows, np.arange(k0, k1), kinds[t], cap, slopes, out=s_buf,
                           post_scale=scale if low else None, check=check)
        rescaled = state.update(s, v_j, threshold=threshold, overwrite_s=True, pv=pv_buf,
                                round_p=prec.round if low else None)  # s now holds p
        if count:
            events[..., t] = rescaled.sum(axis=-1)
    return events


def tile_scores(q_i, k_j, spec, rows, cols, kind, cap=None, slopes=None, keep_tanh=False, out=None,
                post_scale=None, check=False):
    """One tile's scores in the contract's order: ``(scale q) k^T``, softcap, mask, ALiBi.

    ``q_i: (..., bq, d)`` is already scaled; ``rows``/``cols`` are the tile's absolute
    query and key positions; ``out`` an optional ``(..., bq, bk)`` buffer; ``post_scale``
    multiplies the product instead (low precision: q is rounded unscaled).  Returns
    ``(s, th)``: ``s: (..., bq, bk)`` with ``-inf`` on invisible pairs, and
    ``th = tanh(t / cap)`` of the pre-cap scores ``t`` when ``keep_tanh`` (the backward
    pass needs ``1 - th**2``), else None.  ``check``: raise ValueError if a visible
    pair's scaled product ``scale * q . k`` is not finite (callers ask for it only when
    `_args.scores_may_overflow` says it may be, so the usual tile pays nothing).
    """
    # An overflow (only possible when `check` is asked for) is reported below.
    with np.errstate(over="ignore", invalid="ignore") if check else contextlib.nullcontext():
        s = np.matmul(q_i, np.swapaxes(k_j, -1, -2), out=out)  # (..., bq, bk)
        if post_scale is not None:
            s *= post_scale
    if check:
        bad = ~np.isfinite(s)
        if bad.any():
            # Only a visible pair's score is used; an invisible one is set to 0 (masked
            # below), which keeps softcap's tanh and its derivative finite.
            if kind != PARTIAL or (bad & spec.visible(rows, cols)).any():
                raise ValueError(_args.overflow_message(s.dtype))
            s[bad] = 0.0
    th = None
    if cap is not None:  # softcap, before masking
        s /= cap
        np.tanh(s, out=s)
        th = s.copy() if keep_tanh else None
        s *= cap
    if kind == PARTIAL:
        s[..., ~spec.visible(rows, cols)] = -np.inf  # (bq, bk) mask
    if slopes is not None:  # ALiBi, after masking: -inf stays -inf
        s -= slopes[..., None, None] * spec.distance(rows, cols)
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


__all__ = ["attention", "AttentionStats", "TileSizes", "DEFAULT_TILES"]
