"""The dense float64 reference: the contract written out with the whole score matrix.

Short and obviously right is its job; it materialises ``(..., Hq, Sq, Sk)`` scores, so
its memory grows as ``Sq * Sk``.  The tiled kernel is tested against it, and it is tested
against hand-built cases.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from . import arrays, lse_conventions, mla, problem, validate, flex
from .backend import NUMPY, backend_for
from .device import on_device, resolve as device_of
from .options import Call, Options


def reference_scores(q, k, *, check_finite=True, **options):
    """The score matrix of the contract, ``(..., Hq, Sq, Sk)``, after every modification.

    ``s[i, j] = scale * (q[i] . k[j])``, softcapped, ``-inf`` where invisible, plus ALiBi.
    ``options`` are the masking and score arguments of `attention`.
    """
    opts = dense_options(**options)
    if opts.sinks is not None:
        raise ValueError("sinks are not scores of a key: reference_scores gives the (Sq, Sk) scores; "
                         "the sink joins the softmax's denominator (reference_attention)")
    k = arrays.as_float_array(k, "k")
    q5, k5, _, pb = problem.parse(q, k, k[..., :1], scale=opts.scale, check_finite_inputs=check_finite)
    return pb.merge_heads(_scores(q5, k5, pb, opts), 2)


def dense_options(options=None, /, **given) -> Options:
    """`Options.parse` for the dense references, which take contiguous keys only."""
    opts = Options.parse(options, **given)
    if opts.paged:
        raise ValueError("block_table and cache_seqlens cannot be given to the dense reference, which "
                         "takes contiguous keys: gather the pages first (attnlib.core.paged.gather_pages)")
    return opts


def _scores(q5, k5, pb, opts: Options, dtype=np.float64, xp=NUMPY, rows=None, cols=None, eager=None):
    """The scores ``(..., hk, g, sq, sk)`` in ``dtype``, ``-inf`` where invisible; ``xp``'s
    arrays (`attnlib.core.backend`: numpy, or torch on a device).  ``rows``, ``cols``: the query
    and key positions ``q5`` and ``k5`` hold (default all ``pb.sq``, ``pb.sk``), for the scores of
    those pairs only.  ``eager``: a low precision whose eager kernel stores each step in it: ``q
    k^T``, then times the scale (Hugging Face's eager attention), and each step of a softcap, ``c
    tanh(s / c)`` (its Gemma 2); None: in ``dtype``."""
    visible, distance, cap, slopes = pair_terms(pb, opts, dtype, rows, cols)
    visible = xp.from_host(visible)
    mask_mod, score_mod = flex.visible_mod(opts.mask_mod, opts.block_mask), opts.score_mod  # a block mask's own too
    flex.check_elementwise(mask_mod, score_mod, pb.sq, pb.sk)
    # Each head's batch entry and query head, (*batch, hk, g), over the whole grid as one tile.
    mods = flex.Mods(mask_mod, score_mod, None, *flex.index_grids(pb, ()))
    i, j = (np.arange(pb.sq) if rows is None else rows), (np.arange(pb.sk) if cols is None else cols)
    if mask_mod is not None:  # AND the built-in masks
        visible = mods.visible(visible, i, j, False, xp)
    # The scale and cap are float64 numbers, taken exactly in a wider dtype too: the oracle
    # computes the same function more precisely, not a different one.
    may_overflow = problem.scores_may_overflow(q5, k5, pb.scale, dtype, q_max=pb.max_of("q", q5),
                                               k_max=pb.max_of("k", k5))
    # An overflow is reported below, and only where a visible pair has it.
    with xp.ignore_overflow(may_overflow):
        s = xp.matmul(xp.astype(q5, dtype), xp.swapaxes(xp.astype(k5, dtype), -1, -2))
        if eager is not None:  # q k^T stored in the type, then scaled and stored again
            s = xp.rounded(xp.scale_(xp.rounded(s, eager), float(dtype(pb.scale))), eager)
        else:
            s = xp.scale_(s, float(dtype(pb.scale)))
    if may_overflow and any(xp.host_bools([(~xp.isfinite(s) & visible).any()])):
        raise ValueError(problem.overflow_message(np.dtype(dtype)))
    if cap is not None and eager is not None:  # s, s / c, tanh and c tanh each stored in the type
        with xp.overflow_ok():
            s = xp.rounded(xp.tanh_(xp.rounded(s / float(dtype(cap)), eager)), eager)
            s = xp.rounded(s * float(dtype(cap)), eager)
    elif cap is not None:
        with xp.overflow_ok():  # s / cap beyond the range: tanh(+-inf) = +-1, exact
            s = xp.tanh_(s / float(dtype(cap))) * float(dtype(cap))
    if score_mod is not None:  # after the softcap, before the masks
        s = xp.astype(mods.scores(score_mod, s, i, j, False, xp), dtype)
    s = xp.where(visible, s, -math.inf)
    if score_mod is not None and any(xp.host_bools([(xp.isnan(s) | xp.isposinf(s)).any()])):
        raise ValueError("score_mod returned NaN or +inf for a visible pair; it must return finite "
                         "scores, or -inf to mask")
    if slopes is not None:  # after masking: -inf stays -inf
        with xp.ignore_overflow(may_overflow):
            biased = s - xp.from_host(slopes.astype(dtype))[..., None, None] * xp.from_host(distance)
        if may_overflow and any(xp.host_bools([(xp.isfinite(s) & ~xp.isfinite(biased)).any()])):
            raise ValueError(problem.overflow_message(np.dtype(dtype)))  # a score beyond the range
        s = biased
    return s


def pair_terms(pb, opts: Options, dtype=np.float64, rows=None, cols=None):
    """What the score options say about each pair: ``(visible, distance, cap, slopes)``.

    ``visible`` (bool) and ``distance`` (the ALiBi ``|i + o - j|``, or None without ALiBi)
    are ``(sq, sk)``, or ``(*batch, 1, 1, sq, sk)`` when the mask depends on the batch
    entry (``visible`` ``(*batch, hk or 1, 1, sq, sk)`` with top-k lists); ``cap`` is the softcap or None; ``slopes`` the ALiBi slopes ``(..., hk, g)`` or
    None.  ``rows``, ``cols``: the query and key positions of the pairs (default all).
    """
    specs = opts.specs(pb)
    cap = problem.softcap_in(opts.softcap, dtype, "low-precision")  # a low-precision baseline keeps it in float32
    slopes = problem.alibi_slopes(opts.alibi_slopes, pb, dtype)  # (..., hk, g)
    i = np.arange(pb.sq) if rows is None else np.asarray(rows)
    j = np.arange(pb.sk) if cols is None else np.asarray(cols)

    def per_pair(fn, dtype):  # fn(spec) -> (sq, sk); the batch axes too when specs differ
        if () in specs:
            return fn(specs[()])
        grid = np.array([fn(spec) for spec in specs.values()], dtype=dtype)  # none: a zero-size batch
        return grid.reshape(pb.batch + (1, 1, i.size, j.size))  # (*batch, hk=1, g=1, sq, sk)

    visible = per_pair(lambda spec: spec.visible(i, j), bool)
    sel = opts.selection(pb)
    if sel is not None:  # top-k lists: (*batch, hk or 1, 1, sq, sk), ANDed
        visible = visible & (sel.dense(pb.batch, pb.hk, rows) if cols is None else
                             sel.dense(pb.batch, pb.hk, rows)[..., j])
    distance = None if slopes is None else per_pair(lambda spec: spec.distance(i, j), np.float64)
    return visible, distance, cap, slopes


def reference_attention(q, k, v, *, return_lse=False, check_finite=True, compute_dtype=None,
                        intermediate_dtype=None,
                        qv=None, q_descale=None, k_descale=None, v_descale=None, lse_base=None, lse_sink=None,
                        lse_empty=None, return_max_scores=False, device=None, **options):
    """Dense float64 attention, ``softmax(scores) v`` with the whole score matrix.

    Parameters
    ----------
    q : array_like, shape ``(..., Hq, Sq, D)`` or ``(Sq, D)``
    k : array_like, shape ``(..., Hk, Sk, D)`` or ``(Sk, D)``
    v : array_like, shape ``(..., Hk, Sk, Dv)`` or ``(Sk, Dv)``
        Real floating arrays; ``Hq % Hk == 0`` (GQA/MQA).  Computed in float64.
    causal, causal_align, window, kv_lengths, q_lengths, q_segment_ids, kv_segment_ids,
    softcap, alibi_slopes, scale, mask_mod, score_mod, block_mask
        As in `attention`: the contract's masks and score modifications (``mask_mod`` and
        ``score_mod`` on the whole ``(..., Hq, Sq, Sk)`` index grid at once).
    sinks : array_like, shape ``(Hq,)`` or ``(..., Hq)``, optional
        Attention sinks, as in `attention`: one more logit per row in the denominator.
    return_lse : bool
        Also return ``lse: (..., Hq, Sq)``, the natural log of the softmax denominator.
    check_finite : bool
        Refuse inputs holding NaN or inf.
    compute_dtype : {None, "float64", "float32", "float16", "bfloat16", "float8_e4m3fn"}
        The naive baseline in a lower precision (FlashAttention's test rule compares a
        kernel against it): inputs rounded to it, ``q k^T`` accumulated in float32 and
        stored in it, the softmax in float32, ``p`` rounded, ``p @ v`` accumulated in
        float32, ``out`` returned in it (float8_e4m3fn: bfloat16, ``p = exp(s - m) <= 1``
        rounded to float8_e4m3fn before it is normalised, as fp8 kernels hold it; not the
        normalised ``p`` of FlashAttention's ``attention_ref(intermediate_dtype=fp8)``, see
        ``docs/semantics.md``, "fp8 descales").
    intermediate_dtype : {None, "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
        The type the weights are rounded to before ``p @ v`` (FlashAttention's test reference's
        name), with a ``compute_dtype`` below float64 no narrower than it: ``p = exp(s - m) <= 1``
        rounded from the state's type (the softmax-first order of the check's baselines: the
        normalised ``p`` rounded to ``compute_dtype``, then to it).  See ``docs/semantics.md``.
    qv : array_like, shape ``(..., Hq, Sq, Dv)``, optional
        MLA's second query, as in `attention` (``q`` may be None).
    q_descale, k_descale, v_descale : array_like, shape ``(..., Hk)``, optional
        fp8 descales, as in `attention`: the attention of the dequantised values.
    lse_base, lse_sink, lse_empty : optional
        The returned ``lse``'s convention, as in `attention`.
    device : str or torch.device, optional
        As in `attention`: given torch tensors (or ``device=``) the reference is computed
        with torch on their device (the same code on `attnlib.core.torch_backend`), torch
        tensors out (numpy out for numpy inputs with ``device=``); ``mask_mod``,
        ``score_mod`` and ``block_mask`` are called there on the device's index tensors.

    Returns
    -------
    out : ndarray, shape ``(..., Hq, Sq, Dv)``, float64 (or ``compute_dtype``)
    lse : ndarray, shape ``(..., Hq, Sq)``, float64, if ``return_lse``

    Notes
    -----
    A row with no visible key gets ``out = 0`` and ``lse = -inf`` (``lse = sink`` with
    sinks: its whole weight is the sink's).  The max is subtracted
    before ``exp`` (where it is finite) so that nothing overflows and logits of ``-1e4``
    do not all underflow to 0.
    """
    call = Call.bind(locals(), options=dense_options(**options))
    q, k, v = mla.inputs(q, k, v, qv, False, q_descale, k_descale, v_descale, check_finite)
    return lse_conventions.apply(call, lambda c: _dense_on(q, k, v, c),
                                 check_sinks=lse_conventions.check_sinks_for(q, k, v, compute_dtype=compute_dtype))


def _dense_on(q, k, v, call: Call):
    """`dense_attention` of the bound ``call`` with numpy, or with torch on the device
    `attention`'s rule picks."""
    dev = device_of(call.device, q, k, v)
    result = dense_attention(q, k, v, call.options, return_lse=call.return_lse, check_finite=call.check_finite,
                             compute_dtype=call.precision, return_max_scores=call.return_max_scores, dev=dev)
    return result if dev is None else on_device(result, (q, k, v))


def dense_attention(q, k, v, opts: Options, *, return_lse=False, check_finite=True, compute_dtype=None,
                    return_max_scores=False, orders=("blas",), rows=None, rounded=False, dev=None,
                    eager=False):
    """`reference_attention` with its options parsed into ``opts``; ``dev``: a torch device to
    compute on (`attnlib.core.torch_backend`), or None for numpy.  ``orders`` (`ORDERS`): how
    ``p @ v`` is summed, one ``out`` (and ``lse``) per order, from one computation of the
    scores and weights (a tuple of them when several are asked); ``rows``: the query
    positions computed (an index array; default all), the result holding those rows only;
    ``rounded``: ``q``, ``k``, ``v`` hold values of ``compute_dtype`` already (not rounded again:
    each rounding is a pass over the values); ``eager``: the scores'
    steps each stored in ``compute_dtype`` as an eager kernel stores them (`_scores`'s ``eager``)."""
    xp = NUMPY if dev is None else backend_for(dev, 1)  # one call of whole-matrix ops: torch's own threads
    q5, k5, v5, pb, extremes = xp.parse(q, k, v, opts.scale, check_finite)
    prec = problem.precision(compute_dtype)
    given = dict(q=q5, k=k5, v=v5) if extremes is None else {n: np.array(extremes.get(n, (0.0, 0.0))) for n in "qkv"}
    problem.check_representable(prec, **given)
    if rows is not None:  # those rows' queries; the masks still see the whole problem (pb)
        rows = np.asarray(rows, dtype=np.int64)
        q5 = q5[..., xp.from_host(rows) if xp is not NUMPY else rows, :]
    with xp.threads(1):
        if prec.is_float64:
            outs, lses, maxes = _dense(q5, k5, v5, pb, np.float64, opts, orders=orders, xp=xp, rows=rows)
        else:
            inputs = ((xp.astype(x, prec.accumulate) for x in (q5, k5, v5)) if rounded
                      else (xp.rounded(x, prec) for x in (q5, k5, v5)))
            outs, lses, maxes = _dense(*inputs, pb, prec.accumulate.type, opts, prec, orders, xp, rows, eager)
            outs = [xp.astype(out, prec.compute) for out in outs]
    out, lse = (outs[0], lses[0]) if len(orders) == 1 else (tuple(outs), tuple(lses))
    result = (out,) + ((lse,) if return_lse else ()) + ((maxes,) if return_max_scores else ())
    return result[0] if len(result) == 1 else result


#: How the dense computation sums ``p @ v`` (`dense_attention`'s ``orders``): ``"blas"``,
#: ``p @ v`` by one BLAS product, divided by ``l`` after; ``"softmax_first"``, ``p / l``
#: (rounded to a low precision) and then ``@ v``, as PyTorch's math path and FlashAttention's
#: test ``attention_ref`` do; ``"key_by_key"``, ``sum_j p_j v_j`` and ``l`` summed one key
#: after another in the accumulator's type, as a tiled kernel with one-key tiles accumulates
#: (its scores kept in that type, as tiled kernels keep them, so it is asked for alone; the
#: row's max known from the start: no rescaling); ``"rounded_twice"``, a mistake the check
#: names: ``p`` rounded as ``p @ v`` takes it, then normalised and rounded again (softmax-first;
#: its scores kept in the state's type as a kernel keeps them, so it too is asked for alone).
ORDERS = ("blas", "softmax_first", "key_by_key", "rounded_twice")


def _dense(q5, k5, v5, pb, dtype, opts: Options, prec=None, orders=("blas",), xp=NUMPY, rows=None,
           eager=False):
    """``(outs, lses, max_scores)`` in the caller's layout, computed densely in ``dtype``, one
    ``out`` and ``lse`` per summation order of ``orders`` (`ORDERS`); ``rows``: the query
    positions ``q5`` holds (default all).

    ``prec``: a low compute precision whose naive same-precision baseline this is (the scores
    and the weights rounded to it); None computes everything in ``dtype``.  The weights are
    rounded before they are normalised, ``p = exp(s - m) <= 1``, as kernels hold them.
    """
    unknown = sorted(set(orders) - set(ORDERS))
    alone = {"key_by_key", "rounded_twice"}
    if unknown or not orders or (alone & set(orders) and len(orders) > 1):
        raise ValueError(f"orders must name some of {ORDERS} (key_by_key, rounded_twice alone), got {orders!r}")
    low = prec is not None and not prec.is_float64
    sink = xp.from_host(problem.sinks(opts.sinks, pb, dtype), dtype)  # (..., hk, g) or None
    s = _scores(q5, k5, pb, opts, dtype, xp, rows, eager=prec if low and eager else None)  # (..., sq, sk)
    # A naive kernel stores its scores in the compute type (numpy float32 scores: already, no copy).
    same = low and prec.compute == prec.accumulate and prec.p_type is None and s.dtype == prec.compute
    if low and not same and orders not in (("key_by_key",), ("rounded_twice",)) and not eager:  # (eager: stored)
        s = xp.rounded(s, prec)
    # -inf for rows with no key
    m = xp.amax(s, -1)[..., None] if pb.sk else xp.full(tuple(s.shape[:-1]) + (1,), -math.inf, s.dtype)
    maxes = m[..., 0]  # the keys' largest score: max_scores (the sink is no key's)
    if sink is not None:  # one more logit per row, with no value: the max over both
        sink = sink[..., None, None]  # (..., hk, g, 1, 1)
        m = xp.maximum(m, sink)
    with xp.overflow_ok():  # s - m below -max (scores of +-1e308) is -inf: p = 0, exact
        p = xp.exp(s - xp.finite_or_zero(m))  # masked pairs: exp(-inf) = 0
    sink_p = None
    if sink is not None:
        with xp.overflow_ok():  # sink - m below -max: weight exactly 0
            sink_p = xp.exp(sink - m)  # the sink's weight joins the denominator only
    v_max = pb.max_of("v", v5)
    e = problem.value_exponent(v_max, pb.sk, dtype)  # values near the range: summed / 2**e
    v_scaled = xp.astype(v5, dtype)
    if e:  # exact: a power of two
        v_scaled = v_scaled * math.ldexp(1.0, -e)
    rounded = xp.rounded_p(p, prec) if low and not same and set(orders) - {"softmax_first"} else p
    outs, lses = [], []
    for order in orders:
        if order == "key_by_key":
            pv, l = _key_by_key(rounded, v_scaled, p, xp)
        else:
            l = p.sum(-1)[..., None]  # >= 1 where the row sees a key, else 0
        if sink_p is not None:
            l = l + sink_p
        seen = l > 0
        if order in ("softmax_first", "rounded_twice"):  # the weights normalised, then rounded, then summed
            w = xp.divide_where(rounded if order == "rounded_twice" else p, l, seen)
            if low and not same:  # the softmax in the compute type, then in p's (attention_ref's casts)
                w = xp.rounded_p(xp.rounded(w, prec) if prec.p_type is not None else w, prec)
            out = xp.matmul(w, v_scaled)
        else:
            out = xp.divide_where(pv if order == "key_by_key" else xp.matmul(rounded, v_scaled), l, seen)
        out = problem.unscale_values(out, e, v_max)
        lse = xp.log_where(l, seen, xp.full(tuple(m.shape), -math.inf, m.dtype))
        outs.append(pb.merge_heads(out, 2))
        lses.append(pb.merge_heads((lse + m)[..., 0], 1))
    return outs, lses, pb.merge_heads(maxes, 1)


def _key_by_key(p, v, weights, xp=NUMPY):
    """``(p @ v, sum_j weights_j)``, ``(..., sq, dv)`` and ``(..., sq, 1)``, summed one key
    after another in ``p``'s type: each product ``p_ij v_jc`` rounded, then added to the
    running sum (every row and column at once, a key at a time: ~7 us a key for 8 x 16 x 64
    sums, measured, against 36-60 us for a scan over blocks of keys).  ``weights``: the
    unrounded ``p`` the denominator sums."""
    lead = tuple(np.broadcast_shapes(tuple(p.shape[:-2]), tuple(v.shape[:-2])))
    acc = xp.zeros(lead + (p.shape[-2], v.shape[-1]), dtype=p.dtype)
    l = xp.zeros(tuple(p.shape[:-1]) + (1,), dtype=p.dtype)
    for j in range(p.shape[-1]):
        acc += p[..., j, None] * v[..., None, j, :]
        l += weights[..., j, None]
    return acc, l


def reference_rescales(scores: np.ndarray, block_q: int, block_k: int,
                       threshold: float = 0.0, sinks=None) -> np.ndarray:
    """Rescale events per tile, counted independently from a dense score matrix.

    ``scores: (..., Sq, Sk)`` with ``-inf`` on masked pairs (see `reference_scores`).
    For each row the tile maxima are taken in ascending key order; an event is a tile
    whose max exceeds the running max of the tiles before it by more than ``threshold``
    (strictly more than it for the eager ``threshold = 0``), when that running max is
    already finite; only then does the running max move.  ``sinks`` (per head,
    broadcastable to ``scores.shape[:-2]``) start every row's running max at its sink
    instead of ``-inf``, as the kernel's state does.  Returns int64
    ``(..., n_q_tiles, n_k_tiles)``, summed over the rows of each query tile, to compare
    with the kernel's ``stats.rescales``.
    """
    scores = arrays.as_float_array(scores, "scores")
    if scores.ndim < 2:
        raise ValueError(f"scores must have shape (..., Sq, Sk), got {scores.shape}")
    block_q, block_k = validate.positive_int(block_q, "block_q"), validate.positive_int(block_k, "block_k")
    if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, numbers.Real) \
            or not 0 <= threshold < np.inf:
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
    sq, sk = scores.shape[-2:]
    # A tile past the lengths holds the same rows and keys as one of their size.
    block_q, block_k = min(block_q, max(sq, 1)), min(block_k, max(sk, 1))
    nq, nk = -(-sq // block_q), -(-sk // block_k)
    pad = [(0, 0)] * (scores.ndim - 2) + [(0, nq * block_q - sq), (0, nk * block_k - sk)]
    s = np.pad(scores, pad, constant_values=-np.inf)
    tile_max = s.reshape(s.shape[:-1] + (nk, block_k)).max(axis=-1)  # (..., rows, nk)
    events = np.zeros(tile_max.shape, dtype=bool)
    running = np.full(tile_max.shape[:-1], -np.inf)  # (..., rows)
    if sinks is not None:
        running[...] = np.asarray(sinks, dtype=np.float64)[..., None]
    for b in range(nk):
        moves = tile_max[..., b] > running + threshold  # -inf + threshold = -inf
        events[..., b] = moves & np.isfinite(running)
        running = np.where(moves, tile_max[..., b], running)
    events = events.reshape(events.shape[:-2] + (nq, block_q, nk))
    return events.sum(axis=-2, dtype=np.int64)
