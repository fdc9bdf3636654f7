"""Gradients of attention: the tiled FlashAttention-2 backward (the dense reference is
`attnlib.core.backward_dense`'s, re-exported here).

With ``P = softmax(S)`` row by row and ``out = P V``, for an upstream gradient ``dout``::

    dV = P^T dout
    dP = dout V^T
    dS = P * (dP - D),   D_i = sum_j P_ij dP_ij = dout_i . out_i     (softmax Jacobian)
    dT = dS * (1 - tanh(T / c)**2)        with softcap S = c tanh(T / c), else dT = dS
    dQ = scale * dT K,   dK = scale * dT^T Q

where ``T = scale * Q K^T`` are the raw scores.  Masked pairs have ``P = 0`` and so no
gradient; ALiBi is a constant bias and has none of its own.  With GQA, ``dK`` and ``dV``
sum over the query heads that share a kv head.

With attention sinks the softmax runs over ``[S_i, sink_h]`` with a value of 0 for the
sink, so ``dP_sink = 0``, ``D_i`` is unchanged, ``P`` above is already normalised with the
sink in its denominator (through ``lse``), and the sink's own gradient is::

    dsink_h = sum_{b, i} P_sink_i (0 - D_i) = -sum_{b, i} exp(sink_h - lse_i) D_i
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

from . import mla, problem, validate, flex, hooks
from .masks import PARTIAL, SKIP
from .options import Options
from .tilesizes import DEFAULT_TILES
from .backend import NUMPY, backend_for
from .parallel import Turns, _unit_of, run_tiles
from .tiled import attention, prepare
from .gradparts import _grad_exponent, _grad_inputs, _head_dim, _options, _split_grads, _unscale_grads
# Re-exported: the dense backward's and the shared pieces' long-standing import path.
from .gradparts import _score_mod_grad, grad_exponent  # noqa: F401
from .backward_dense import FORMULATIONS, SEQUENTIAL_STEPS, dense_backward, reference_attention_backward  # noqa: F401
from . import device as dev_mod


def attention_backward(q, k, v, out, lse, dout, *, dlse=None, scale=None, block_q=None, block_k=None,
                       workers=None, check_finite=True, qv=None, device=None, **options):
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
    dlse : array_like, shape ``(..., Hq, Sq)``, optional
        Gradient of the loss with respect to ``lse`` (natural log, the sinks included), for a
        loss of both results (ring attention's merge, context parallelism; FlashAttention 4's
        ``dlse``): ``D_i`` becomes ``D_i - dlse_i``.  None: 0.
    scale, causal, causal_align, window, kv_lengths, q_lengths, q_segment_ids,
    kv_segment_ids, softcap, alibi_slopes, sinks
        As in `attention`, and equal to the forward's (``lse`` then includes the sinks).
    block_q, block_k : int, optional
        Tile sizes (default `DEFAULT_TILES`).
    workers : int, optional
        Threads that take key tiles in parallel; default (None, or -1): one per available
        CPU, with BLAS held to one thread.  The result is bit-identical for every thread
        count: each key tile owns its ``dk``/``dv`` rows, and the additions to each ``dq``
        tile are made in ascending key-tile order.
    qv : array_like, shape ``(..., Hq, Sq, Dv)``, optional
        MLA's second query, as in the forward (``q`` may be None): the gradients are those of
        the joined problem split back (`attnlib.core.mla`), ``dv`` both its parts.
    device : str or torch.device, optional
        Compute with torch on this device (`attnlib.core.torch_backend`); torch tensors among
        the inputs choose it when None.  Tensors in give float64 tensors on the device out;
        numpy inputs with ``device=`` give numpy.  Numpy inputs without it take the numpy
        kernel (torch is not imported).  ``mask_mod``, ``score_mod`` (with
        ``score_mod_grad``) and ``block_mask`` are called there as in the forward.

    Returns
    -------
    dq : ndarray, shape of ``q``;  dk : shape of ``k``;  dv : shape of ``v`` (float64)
    dqv : ndarray, shape of ``qv``, only when ``qv`` is given (``dq`` and ``dk`` are then
        None without ``q``)
    dsinks : ndarray, shape of ``sinks``, only when sinks are given:
        ``-sum exp(sink_h - lse_i) D_i`` over the rows (and batch entries) of each sink

    Notes
    -----
    ``D_i = rowsum(dout_i * out_i)`` per query row, once.  Key tiles are the outer loop
    (each owns ``dk_j``, ``dv_j``); for each visible query tile the probabilities are
    recomputed from the saved ``lse`` as ``p = exp(s - lse)`` (no second softmax pass),
    then ``dv_j += p^T dout_i``, ``dp = dout_i v_j^T``, ``ds = p * (dp - D_i)`` (times
    ``1 - tanh^2`` under softcap), ``dk_j += scale * ds^T q_i`` and
    ``dq_i += scale * ds k_j``.  SKIP tiles are never touched and FULL tiles do no mask
    work, as in the forward.  Rows with ``lse = -inf`` (no visible key) have ``p = 0`` and
    contribute exactly zero.  Working memory is a few tile-sized arrays per head and
    thread, the per-row ``D`` and the tile map (one byte per tile); the gradients
    themselves are the size of the inputs.

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
    if qv is not None:  # MLA: the joined problem's gradients, split back
        joined_q, joined_k, _ = mla.inputs(q, k, v, qv)
        return mla.split(attention_backward(joined_q, joined_k, v, out, lse, dout, dlse=dlse, scale=scale, block_q=block_q,
                                            block_k=block_k, workers=workers, check_finite=check_finite,
                                            device=device, **options), _head_dim(q), q is not None)
    dev = dev_mod.resolve(device, q, k, v, out, lse, dout, dlse)
    opts, mod_grad = _options(scale, options, "attention_backward")
    grads = tiled_backward(q, k, v, out, lse, dout, opts, mod_grad, block_q=block_q, block_k=block_k,
                           workers=workers, check_finite=check_finite, dev=dev, dlse=dlse)
    return grads if dev is None else dev_mod.on_device(grads, (q, k, v, out, lse, dout))


def tiled_backward(q, k, v, out, lse, dout, opts: Options, mod_grad=None, *, block_q=None, block_k=None,
                   workers=None, check_finite=True, dev=None, sizes=None, dlse=None):
    """`attention_backward` with its options parsed into ``opts`` (and ``mod_grad`` the
    ``score_mod_grad``); ``dev``: a torch device to compute on (`attnlib.core.torch_backend`),
    or None for numpy.  The gradients as ``xp``'s arrays.

    ``sizes``: `GradSizes`, for ``(grads, rss)``: the gradients bit for bit and, beside them, the
    root-sum-squares `dense_backward` gives with ``return_rss`` (the check's entry sizes, in
    memory bounded in the sequence length): a first pass over the tiles for each row's
    ``d1_i``, then the backward with the squares summed beside the gradients."""
    workers = validate.workers(workers) if dev is None or workers is not None else None
    xp = NUMPY if dev is None else backend_for(dev, workers)
    q5, k5, v5, pb, extremes = xp.parse(q, k, v, opts.scale, check_finite)
    out5, lse5, dout5 = _grad_inputs(pb, check_finite, xp, out=out, lse=lse, dout=dout)
    dlse5 = None if dlse is None else _grad_inputs(pb, check_finite, xp, dlse=dlse)[0]  # (*batch, hk, g, sq)
    # The host's backward keeps 256 x 256 tiles at every head dim (the forward's 512 x 512 for D >= 128).
    setup = prepare(q5, k5, v5, pb, opts, block_q=block_q, block_k=block_k, xp=xp, extremes=extremes,
                    base=DEFAULT_TILES if xp is NUMPY else None)
    workers = workers if xp is NUMPY else xp.workers
    sink = setup.sink  # (..., hk, g) or None
    if sink is not None and check_finite and any(xp.host_bools([(lse5 == -math.inf).any()])):
        raise ValueError("lse has -inf rows, but with sinks every row's lse is at least its sink: "
                         "pass the lse of attention(..., sinks=sinks, return_lse=True)")
    # Values near float64's range: dout / 2**e while summing, the gradients times 2**e after.
    e = _grad_exponent(pb, dout5, (v5, out5), q5, k5, xp, dlse5=dlse5)
    dout5 = xp.ldexp(dout5, -e) if e else dout5
    if dlse5 is not None:  # float64 (and divided by the same 2**e)
        dlse5 = xp.ldexp(dlse5, -e)
    dq = xp.zeros(tuple(q5.shape))
    dk = xp.zeros(pb.batch + (pb.hk, pb.sk, pb.d))
    dv = xp.zeros(pb.batch + (pb.hk, pb.sk, pb.dv))
    # dsink_h = -sum_i exp(sink_h - lse_i) D_i, per grouped head (*batch, hk, g).
    dsink = None if sink is None else xp.zeros(pb.batch + (pb.hk, pb.group))
    if pb.sq == 0 or pb.sk == 0 or not math.prod(pb.batch):
        # No query: no loss reaches k and v.  No key: out = 0 whatever q is.  Zeros either way
        # (and D = dout . out = 0 for dsinks).
        grads = _split_grads(pb, dq, dk, dv, dsink, opts.sinks)
        return grads if sizes is None else (grads, tuple(xp.zeros(tuple(g.shape)) for g in grads))
    hook = hooks.get("backward")  # the stage edits (`attnlib.core.hooks`)
    hook = None if hook is hooks.keep else hook  # the identity: not called at all
    lse5 = xp.operand(lse5)
    delta = _rows_delta(out5, dout5, setup.tiles.block_q, xp)  # D = rowsum(dout * out), (..., sq)
    if dlse5 is not None:  # a loss of lse too: d lse_i / d s_ij = p_ij, so ds = p (dp - (D - dlse))
        delta -= dlse5
    if hook is not None:
        delta = hook("delta", delta)
    sized = None if sizes is None else sizes.bind(pb, out5, dout5, setup.cap, xp, dlse5, e)
    # The shift of p = exp(s - lse): rows without a visible key have lse = -inf and only -inf
    # scores; shifting them by 0 gives exp(-inf) = 0, not -inf - (-inf).
    shift = xp.finite_or_zero(lse5)
    per_thread = threading.local()  # each thread's tile buffers and band masks
    mods = setup.mods

    def sweep(sized_pass):  # every mask's tiles, key tiles outer
        items = []
        for idx, spec in setup.specs.items():  # idx = (): all batch entries share one mask
            items += _backward_plan(q5[idx], k5[idx], v5[idx], dout5[idx], delta[idx], shift[idx], pb.scale, spec,
                                    setup, problem.for_entry(setup.slopes, idx), dq[idx], dk[idx], dv[idx], workers,
                                    per_thread, None if mods is None else flex.Mods(*mods, *flex.index_grids(pb, idx)),
                                    mod_grad, hook, None if sized_pass is None else sized_pass.at(idx))
        # A wrong lse makes exp(s - lse) overflow: let it, and name it below (not a FloatingPointError).
        with xp.threads(workers), xp.ignore_overflow(check_finite):
            run_tiles(lambda item: item(), items, workers)
            xp.finish()  # the errors a device gathered, raised once

    if sized is not None:  # the sizes' first pass: each row's d1_i over all its keys
        sweep(sized.rows_pass())
    sweep(sized)
    p_sinks = None if sink is None or sized is None else xp.zeros(tuple(delta.shape))
    with xp.threads(workers), xp.ignore_overflow(check_finite):
        if sink is not None:  # lse_i >= sink_h, so every exponent is <= 0
            for idx in setup.specs:
                with xp.overflow_ok():  # sink - lse below -max: weight exactly 0
                    p_sink = xp.exp(xp.broadcast_to(problem.for_entry(sink, idx), tuple(delta[idx].shape[:-1]))[..., None]
                                    - lse5[idx])  # (*lead, sq)
                dsink[idx] -= (p_sink * delta[idx]).sum(-1)  # 0 - x: +0 where no row counts
                if p_sinks is not None:
                    p_sinks[idx] = p_sink
    dq *= pb.scale  # dq = scale * sum_j ds_ij k_j
    grads = _split_grads(pb, dq, dk, dv, dsink, opts.sinks)
    if check_finite:
        for ok, name in zip(xp.host_bools([xp.isfinite(g).all() for g in grads]), ("dq", "dk", "dv", "dsinks")):
            if not ok:  # with finite inputs only a wrong lse makes exp(s - lse) > 1
                raise ValueError(f"{name} is not finite: lse does not match q and k (exp(s - lse) "
                                 "exceeds 1): pass the lse of attention(..., return_lse=True) with the "
                                 "same options")
    grads = grads if hook is None else hook("grads", grads, xp=xp)
    if sized is not None:
        rss = sized.finish(pb, p_sinks, opts.sinks)
        result = (_unscale_grads(grads, e, xp=xp), _unscale_grads(rss, e, xp=xp)) if e else (grads, rss)
        if sized.naive is not None:
            shift, d_naive = sized.naive_rows(pb, p_sinks, xp)
            result += ((shift, xp.ldexp(d_naive, e) if e else d_naive),)
        if sized.flush:
            flushed = sized.flushed(pb, p_sinks, delta, opts.sinks)
            result += (_unscale_grads(flushed, e, xp=xp) if e else flushed,)
        return result
    return _unscale_grads(grads, e, xp=xp) if e else grads


def _rows_delta(out, dout, bq, xp):
    """``D = rowsum(dout * out)`` in float64, a query tile at a time (within the memory bound)."""
    delta = xp.empty(tuple(out.shape[:-1]))  # (*lead, sq)
    for q0 in range(0, out.shape[-2], bq):
        q1 = min(q0 + bq, out.shape[-2])
        delta[..., q0:q1] = (xp.operand(dout[..., q0:q1, :]) * xp.operand(out[..., q0:q1, :])).sum(-1)
    return delta


def _backward_plan(q, k, v, dout, delta, shift, scale, spec, setup, slopes, dq, dk, dv, workers, per_thread,
          mods=None, mod_grad=None, hook=None, sized=None):
    """The tiles of one mask, key tiles outer, as in FlashAttention-2's Algorithm 2: one
    callable per (head block, key tile) unit, in ascending key tiles.

    ``q, dout: (*lead, sq, .)``, ``delta, shift: (*lead, sq)`` with ``lead = (..., hk, g)``;
    ``k, v: (..., hk, 1, sk, .)``.  Each unit's key tile owns its ``dk_j`` and ``dv_j``
    (written to ``dk, dv: (..., hk, sk, .)``, a GQA group's query heads summed); its
    contributions ``ds @ k_j`` are added to ``dq`` (unscaled) in ascending key-tile order
    whatever the number of ``workers``, so the result is bit-identical to the serial run
    (FlashAttention-2's deterministic backward orders its dq additions the same way).
    ``hook``: the step ``"backward"`` of `attnlib.core.hooks` (its stages are listed there),
    or None for its default, the identity (no call per tile); the scores and masks are the
    steps ``"tile_scores"`` and ``"tile_visible"``, as in the forward.  ``sized``: a
    `_SizedPass` at this mask's entries: its first pass (``rows``) sums each row's ``d1_i``
    (in the ``dq`` order) and nothing else, its second the squares beside the gradients.
    """
    xp, tiles = setup.xp, setup.tiles
    bq, bk = tiles.block_q, tiles.block_k
    lead, sq = tuple(q.shape[:-2]), q.shape[-2]
    k_starts, k_ends, kv_ranges = spec.key_tiles(bk)  # (n_k_tiles,) each
    q_starts = np.arange(0, sq, bq)
    q_ends = np.minimum(q_starts + bq, sq)
    # The tile map, one byte a tile, on the host: (n_q_tiles, n_k_tiles).
    kinds = np.stack([spec.tile_kind(q0, q1, k_starts, k_ends, kv_ranges) for q0, q1 in zip(q_starts, q_ends)])
    units = xp.units(lead[:-1], lead[-1] * min(bq, sq), min(bk, k.shape[-2]), k_starts.size)
    # Each unit's tile map: the built-in classes AND its heads' block mask, (n_units, nq, nk).
    unit_mods = [None if mods is None else mods.unit(unit) for unit in units]
    unit_kinds = np.stack([kinds if m is None else np.stack([m.tile_kinds(a, kinds[a]) for a in range(len(kinds))])
                           for m in unit_mods])
    visible = unit_kinds != SKIP
    # rank[u, a, b]: visible key tiles before b in query tile a, i.e. b's turn to add to dq_a.
    turns = Turns(np.cumsum(visible, axis=2) - visible, threaded=workers > 1)
    last = np.where(visible.any(axis=2), visible.shape[2] - 1 - np.argmax(visible[..., ::-1], axis=2), -1)
    slopes = None if slopes is None else xp.broadcast_to(slopes, lead)
    # The declared steps (`attnlib.core.hooks`), as the forward's: the same masks and scores.
    tile_visible, scores_of = hooks.get("tile_visible"), hooks.get("tile_scores")
    on_device = {} if xp is NUMPY else {"xp": xp}  # the steps' replacements of old take no xp on the host

    def key_tile(u, b):
        xp.worker_start()
        unit, mods_u = units[u], unit_mods[u]
        q_u, dout_u, delta_u, shift_u = q[unit], dout[unit], delta[unit], shift[unit]
        dq_u, slopes_u = dq[unit], None if slopes is None else slopes[unit]
        k0, k1 = int(k_starts[b]), int(k_ends[b])
        cols = np.arange(k0, k1)
        k_j = xp.operand(_unit_of(k, unit)[..., k0:k1, :])  # (..., hk, 1, bk, d)
        v_j = xp.operand(_unit_of(v, unit)[..., k0:k1, :])  # (..., hk, 1, bk, dv)
        dk_j = xp.zeros(tuple(q_u.shape[:-2]) + tuple(k_j.shape[-2:]))  # (..., hk, g, bk, d)
        dv_j = xp.zeros(tuple(q_u.shape[:-2]) + tuple(v_j.shape[-2:]))  # (..., hk, g, bk, dv)
        dk_part, dv_part = xp.empty(tuple(dk_j.shape)), xp.empty(tuple(dv_j.shape))
        if sized is not None:  # the sizes' operands: |v_j|, k_j**2 and this unit's rows
            v_abs, k_sq, d1_u = abs(v_j), sized.operand(k_j), sized.d1[unit]
            w2_u = None if sized.w2 is None else sized.w2[unit]
            if not sized.rows:
                dq2_u, dk2_j, dv2_j = sized.dq2[unit], xp.zeros(tuple(dk_j.shape)), xp.zeros(tuple(dv_j.shape))
                if sized.flush:  # the flushed terms' sizes (`_SizedPass.flushed`)
                    fq_u, fk_j, fv_j = sized.fq[unit], xp.zeros(tuple(dk_j.shape)), xp.zeros(tuple(dv_j.shape))
        buffers = per_thread.__dict__.setdefault("buffers", {})  # s/p, ds and dq_ij per tile shape
        band_masks = per_thread.__dict__.setdefault("band masks", {})  # for tile_visible
        try:
            for a in np.flatnonzero(visible[u, :, b]):
                q0, q1, kind = int(q_starts[a]), int(q_ends[a]), unit_kinds[u, a, b]
                rows = np.arange(q0, q1)
                shape = tuple(q_u.shape[:-2]) + (q1 - q0, k1 - k0, q_u.shape[-1])
                if shape not in buffers:
                    buffers[shape] = (xp.empty(shape[:-1]), xp.empty(shape[:-1]), xp.empty(shape[:-2] + shape[-1:]))
                s_buf, ds, dq_ij = buffers[shape]
                with xp.ignore_overflow(setup.check):
                    q_i = xp.operand(q_u[..., q0:q1, :]) * scale  # (..., g, bq, d), scaled; inf: caught below
                dout_i = xp.operand(dout_u[..., q0:q1, :])
                vis = (xp.mask(tile_visible(spec, rows, k0, k1, contiguous=True, cache=band_masks))
                       if kind == PARTIAL else None)  # (bq, bk)
                if mods_u is not None and kind == PARTIAL:  # AND mask_mod, per head
                    vis = mods_u.visible(vis, rows, cols, False, xp)
                grad = None if mod_grad is None else [mod_grad]
                s, th = scores_of(q_i, k_j, spec, rows, cols, kind, setup.cap, slopes_u, keep_tanh=True,
                                  out=s_buf, check=setup.check, vis=vis, mods=mods_u, mod_grad=grad, **on_device)
                naive = sized is not None and sized.rows and sized.naive is not None
                if naive:  # the scores as a naive kernel in that type stores them (from float32, as it does)
                    acc_type = sized.naive.accumulate
                    s_naive = xp.rounded(xp.astype(s, acc_type), sized.naive)
                with xp.overflow_ok():  # below -max: -inf, whose exp is the exact 0
                    s -= shift_u[..., q0:q1, None]
                # (..., g, bq, bk): the forward's probabilities, exactly 0 where hidden.
                p = xp.exp(s, out=s) if vis is None else xp.exp_visible_(s, vis)
                if sized is not None:
                    # |dp_ij| and, weighted, the componentwise |dout_i| . |v_j| that dp_ij and D_i sum
                    # (componentwise sizes: that alone).
                    dp = xp.matmul(dout_i, xp.swapaxes(v_j, -1, -2), out=ds)
                    # (the weight on the small operand: a power of 2, exact either side of the product)
                    dout_abs = abs(dout_i) * sized.accumulate if sized.power == 2 else abs(dout_i)
                    dp_abs = xp.matmul(dout_abs, xp.swapaxes(v_abs, -1, -2))
                    if sized.power == 2:
                        dp_abs += abs(dp)
                    dp_size = dp_abs
                    if sized.rows:  # d1_i = sum_j p_ij (|dp_ij| + a |dout_i| . |v_j|), in the dq order
                        dp_size *= p
                        d1_add = dp_size.sum(-1)
                        if naive:  # L_i and A_i (`GradSizes`'s naive): that kernel's weights, unnormalised
                            with xp.overflow_ok():
                                s_naive -= shift_u[..., q0:q1, None]
                            e = xp.exp(s_naive, out=s_naive) if vis is None else xp.exp_visible_(s_naive, vis)
                            l_add = e.sum(-1)
                            e = xp.rounded(e, sized.naive)
                            e *= xp.rounded(xp.astype(dp, acc_type), sized.naive)
                            a_add = e.sum(-1)
                        with turns.turn((u,), a, b):
                            d1_u[..., q0:q1] += d1_add
                            if naive:
                                sized.naive_l[unit][..., q0:q1] += l_add
                                sized.naive_a[unit][..., q0:q1] += a_add
                        continue
                dv_part = xp.matmul(xp.swapaxes(p, -1, -2), dout_i, out=dv_part)
                dv_j += dv_part if hook is None else hook("dv_tile", dv_part, a=a, b=b)
                if sized is None:  # (the sizes' pass holds dp in ds already)
                    ds = xp.matmul(dout_i, xp.swapaxes(v_j, -1, -2), out=ds)  # dp, (..., g, bq, bk)
                ds -= delta_u[..., q0:q1, None]
                ds *= p  # ds = p * (dp - D)
                if th is not None:  # softcap: d/dt c tanh(t / c) = 1 - tanh(t / c)**2
                    th *= th
                    th *= -1.0
                    th += 1.0
                    ds *= th
                if grad is not None:  # score_mod: its derivative at the (capped) score; p = 0: ds = 0 whatever it is
                    ds = xp.copy_where(ds, ds * grad[1], p > 0)
                if sized is not None:
                    # ds_ij's size p_ij (|dp_ij| + d1_i) |factor|, squared (1 + w_i**2) with the scores'.
                    a2 = dp_size
                    a2 += d1_u[..., q0:q1, None]
                    a2 *= p
                    if th is not None:
                        a2 *= th + sized.cap
                    if grad is not None:
                        a2 *= xp.where(p > 0, abs(grad[1]), 0.0)
                    p2, dout_sq, q_sq = p, sized.operand(dout_i), sized.operand(q_i)  # q_i carries the scale
                    w2_i = None
                    if sized.power == 2:
                        a2 *= a2
                        p2 = p * p
                        if w2_u is not None:  # a row's weight, on the small operands (and dq's rows)
                            w2_i = w2_u[..., q0:q1, None]
                            dout_sq, q_sq = dout_sq * w2_i, q_sq * w2_i
                    dv2_j += xp.matmul(xp.swapaxes(p2, -1, -2), dout_sq)
                    dk2_j += xp.matmul(xp.swapaxes(a2, -1, -2), q_sq)
                    dq2_add = xp.matmul(a2, k_sq)
                    if w2_i is not None:
                        dq2_add *= w2_i
                    fq_add = None
                    if sized.flush:  # weights in (0, flush), which a flush-to-zero kernel drops: what they add
                        low = p < sized.flush  # (and > 0: hidden pairs are 0; a full tile has none)
                        if bool(low.any()) and bool((low := low & (p > 0)).any()):
                            ds_low = xp.where(low, abs(ds), 0.0)
                            fv_j += xp.matmul(xp.swapaxes(xp.where(low, p, 0.0), -1, -2), abs(dout_i))
                            fk_j += xp.matmul(xp.swapaxes(ds_low, -1, -2), abs(q_i))
                            fq_add = xp.matmul(ds_low, abs(k_j))
                if hook is not None:
                    ds = hook("ds", ds, a=a, b=b)
                dk_part = xp.matmul(xp.swapaxes(ds, -1, -2), q_i, out=dk_part)  # q_i carries the scale
                dk_j += dk_part if hook is None else hook("dk_tile", dk_part, a=a, b=b)
                add = xp.matmul(ds, k_j, out=dq_ij)  # (..., g, bq, d)
                if hook is not None:
                    add = hook("dq_tile", add, a=a, b=b, last=b == last[u, a])
                with turns.turn((u,), a, b):  # taken even by a dropped tile: the order stays fixed
                    if add is not None:
                        dq_u[..., q0:q1, :] += add
                    if sized is not None:
                        dq2_u[..., q0:q1, :] += dq2_add
                        if fq_add is not None:
                            fq_u[..., q0:q1, :] += fq_add
        except BaseException:
            turns.abort()  # no other worker may wait for this tile's turns any more
            raise
        if sized is not None and sized.rows:
            return
        # GQA: the query heads of a group share k_j and v_j, so their gradients add up.
        dk[unit][..., k0:k1, :] = dk_j.sum(-3)
        dv[unit][..., k0:k1, :] = dv_j.sum(-3)
        if sized is not None:  # and so do their squares
            sized.dk2[unit][..., k0:k1, :] = dk2_j.sum(-3)
            sized.dv2[unit][..., k0:k1, :] = dv2_j.sum(-3)
            if sized.flush:
                sized.fk[unit][..., k0:k1, :] = fk_j.sum(-3)
                sized.fv[unit][..., k0:k1, :] = fv_j.sum(-3)

    # Key tiles are handed out in ascending order, so the lowest unfinished one never
    # waits: no deadlock.  Under causal masks the first key tiles are also the longest.
    return [functools.partial(key_tile, u, b) for b in range(k_starts.size) for u in range(len(units))
            if visible[u, :, b].any()]


def attention_vjp(q, k, v, dout, *, dlse=None, qv=None, device=None, **options):
    """Forward and backward in one call: ``(out, (dq, dk, dv))`` (``dqv`` next with ``qv``,
    ``dsinks`` last with sinks); ``dlse``: the loss's gradient with respect to the forward's
    ``lse`` too (`attention_backward`'s).

    ``options`` are those of `attention_backward` (masks, score options, tiles,
    ``check_finite``), passed to both passes.  With torch tensors (or ``device=``) both
    passes run with torch on the device, ``out`` and ``lse`` staying there between them;
    numpy inputs with ``device=`` get numpy back.
    """
    if qv is not None:  # MLA: the joined problem's, its gradients split back
        joined_q, joined_k, _ = mla.inputs(q, k, v, qv)
        out, grads = attention_vjp(joined_q, joined_k, v, dout, dlse=dlse, device=device, **options)
        return out, mla.split(grads, _head_dim(q), q is not None)
    forward = {name: value for name, value in options.items() if name != "score_mod_grad"}
    dev = dev_mod.resolve(device, q, k, v, dout, dlse)
    if dev is None:
        out, lse = attention(q, k, v, return_lse=True, **forward)
        return out, attention_backward(q, k, v, out, lse, dout, dlse=dlse, **options)
    given = (q, k, v, dout)
    q, k, v, dout = (dev_mod.as_tensor(x, name, dev) for x, name in zip(given, ("q", "k", "v", "dout")))
    dlse = None if dlse is None else dev_mod.as_tensor(dlse, "dlse", dev)
    out, lse = attention(q, k, v, return_lse=True, device=dev, **forward)
    grads = attention_backward(q, k, v, out, lse, dout, dlse=dlse, device=dev, **options)
    return dev_mod.on_device(out, given), dev_mod.on_device(grads, given)


__all__ = ["attention_backward", "reference_attention_backward", "attention_vjp"]
