"""The tiled float64 backward in torch, on the tensors' own device (FlashAttention-2's Algorithm 2).

The contract of `attnlib.core.backward.attention_backward` (its module docstring has the
formulas), computed where the tensors are: key tiles outer, each owning its ``dk_j`` and
``dv_j``; for every visible query tile the probabilities are recomputed from the saved
``lse`` as ``p = exp(s - lse)``, then ``dv_j += p^T dout_i``, ``ds = p * (dout_i v_j^T - D_i)``
(times ``1 - tanh^2`` under softcap), ``dk_j += ds^T (scale q_i)`` and ``dq_i += ds k_j``,
added to each ``dq`` tile in ascending key-tile order.  The tile classes are planned on the
host from the mask geometry (`MaskSpec.tile_kind`), the masks built on the device from host
integers (`MaskSpec.tile_visible`), and errors (an overflowing score, a score_mod's NaN or
+inf, non-finite or out-of-range gradients) gathered in device flags and read once at the
end: no host synchronisation per tile.  ``mask_mod``, ``score_mod`` (with its derivative
``score_mod_grad``) and block masks are the forward's (`attnlib.core.torch_flex`): each
unit's tile classes AND its heads' block mask, the functions called on device tensors.

A GQA group's query heads are one tile of ``g * rows`` rows against their kv head, so each
product over the group's rows sums the group's contributions to ``dk_j`` and ``dv_j`` at
once.  On a GPU every batch entry and head of a key tile is computed at once; on the CPU
(head block, key tile) units run on `run_tiles` threads with one torch thread each, and the
result is the same bits for every thread count.  Working memory: a few
``(..., g * block_q, block_k)`` tiles per thread and the per-row ``D`` and ``lse`` shift,
independent of ``Sk`` (``D`` and the shift are the size of ``lse``).
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

from . import device as dev_mod
from . import flex, problem, torch_flex, validate
from .masks import PARTIAL, SKIP
from .parallel import Turns, run_tiles, work_units
from .tilesizes import device_tiles
from .torch_backend import BAND_CACHE, Torch

#: The largest power of two one multiplication scales by: ``2**-1000`` and ``2**1000`` are
#: normal numbers, so a scaling by ``2**e`` is done in steps of at most this exponent.
_STEP = 1000


def grad_exponent(pb, dout_max: float, vo_max: float, qk_max: float, dtype=np.float64) -> int:
    """The power of two ``e >= 0`` that ``dout`` is divided by while the gradients are summed
    (`attnlib.core.backward._grad_exponent` explains the bound), from the maxima
    ``max|dout|``, ``max(|v|, |out|)`` and ``max(|q|, |k|)``: shared by both backwards."""
    if not (dout_max and vo_max and math.isfinite(dout_max) and math.isfinite(vo_max)):
        return 0
    # log2 of max(1, max(|q|, |k|) Sq g) max(1, |scale|): ds @ k and ds^T @ q are summed
    # before the scale multiplies them, so a tiny scale does not shrink their partial sums.
    spread = max(0.0, math.log2(abs(pb.scale))) if pb.scale else 0.0
    if qk_max and math.isfinite(qk_max):
        spread += max(0.0, math.log2(qk_max) + math.log2(pb.sq + 1) + math.log2(pb.group))
    return problem.range_exponent(math.log2(2 * (pb.dv + 1)) + math.log2(dout_max) + math.log2(vo_max)
                                  + spread, dtype)


def _pow2(x, e: int):
    """``x * 2**e`` (a new tensor for ``e != 0``; ``x`` is never modified), in steps of at most
    ``2**_STEP`` (each factor a normal number): exact, except an entry that becomes subnormal
    on the way down (rounded once per step) or overflows on the way up."""
    first = True
    while e:
        step = max(-_STEP, min(_STEP, e))
        x = x * math.ldexp(1.0, step) if first else x.mul_(math.ldexp(1.0, step))
        first, e = False, e - step
    return x


def backward(q, k, v, out, lse, dout, opts, *, dev, mod_grad=None, block_q=None, block_k=None,
             workers=None, check_finite=True):
    """`attnlib.core.backward.tiled_backward` computed with torch on ``dev``: float64 tensors
    ``(dq, dk, dv[, dsinks])`` there.  ``opts``: the parsed `Options`; ``mod_grad``: the
    ``score_mod_grad`` (checked by the caller: required with a ``score_mod``)."""
    torch = dev_mod._torch()
    workers = validate.workers(workers)
    names = ("q", "k", "v", "out", "lse", "dout")
    t = {n: dev_mod.as_tensor(x, n, dev) for n, x in zip(names, (q, k, v, out, lse, dout))}
    ext = {}  # name -> (max, min) on the host

    def maxima():  # one synchronisation for the six inputs' extremes
        found = np.asarray(torch.stack([dev_mod._extremes(t[n]) for n in names]).cpu())
        ext.update(zip(names, found))
        if check_finite:
            for n in "qkv":
                if not np.isfinite(ext[n]).all():
                    dev_mod._first_bad(t[n], n)
        return tuple(float(np.abs(ext[n]).max()) for n in "qkv")

    q5, k5, v5, pb = problem.group(t["q"], t["k"], t["v"], scale=opts.scale, maxima=maxima)
    grouped = {}
    for n in ("out", "lse", "dout"):
        grouped[n] = _grad_input(pb, t[n], n)
        if check_finite and n == "lse":
            hi = ext[n][0]
            if math.isnan(hi) or hi == math.inf:
                raise ValueError("lse must be finite or -inf (rows without a visible key)")
        elif check_finite and not np.isfinite(ext[n]).all():
            dev_mod._first_bad(t[n], n)
    out5, lse5, dout5 = grouped["out"], grouped["lse"], grouped["dout"]
    tiles = opts.tiles_for(device_tiles(dev, math.prod(pb.batch) * pb.hq, opts), block_q, block_k)
    specs = opts.specs(pb)
    cap, slopes, sink = opts.score_terms(pb)  # slopes and sinks (..., hk, g)
    mods = torch_flex.device_mods(opts, pb, tiles, dev)  # (mask_mod, score_mod, block_mask) or None, checked
    if sink is not None and check_finite and ext["lse"][1] == -math.inf:
        raise ValueError("lse has -inf rows, but with sinks every row's lse is at least its sink: "
                         "pass the lse of attention(..., sinks=sinks, return_lse=True)")
    absmax = {n: float(np.abs(ext[n]).max()) for n in names}
    e = grad_exponent(pb, absmax["dout"], max(absmax["v"], absmax["out"]), max(absmax["q"], absmax["k"]))
    f64 = dict(dtype=torch.float64, device=dev)
    dq = torch.zeros(q5.shape, **f64)
    dk = torch.zeros(pb.batch + (pb.hk, pb.sk, pb.d), **f64)
    dv = torch.zeros(pb.batch + (pb.hk, pb.sk, pb.dv), **f64)
    dsink = None if sink is None else torch.zeros(pb.batch + (pb.hk, pb.group), **f64)
    if pb.sq == 0 or pb.sk == 0 or not math.prod(pb.batch):
        # No query: no loss reaches k and v.  No key: out = 0 whatever q is.  Zeros either way.
        return _split(pb, dq, dk, dv, dsink, opts.sinks)
    check = problem.scores_may_overflow(q5, k5, pb.scale, q_max=pb.maxima[0], k_max=pb.maxima[1])
    with dev_mod.threads(dev, 1), torch.no_grad():  # the CPU: one torch thread per unit
        kernel = _Kernel(torch, dev, pb, tiles, cap, check, e, workers, mods, mod_grad)
        delta, shift = kernel.rows(out5, lse5, dout5)
        if sink is not None:  # dsink_h = -sum_i exp(sink_h - lse_i) D_i; lse_i >= sink_h
            sink_t = torch.as_tensor(sink, device=dev)
            dsink = -(torch.exp(sink_t[..., None] - lse5.to(torch.float64)) * delta).sum(dim=-1)
            dsink = dsink.expand(pb.batch + (pb.hk, pb.group))
        slopes_t = None if slopes is None else torch.as_tensor(slopes, device=dev)
        items = []
        for idx, spec in specs.items():  # idx = (): every batch entry shares one mask
            seg = None
            if spec.q_segments is not None:
                seg = (dev_mod.index_tensor(spec.q_segments, dev), dev_mod.index_tensor(spec.kv_segments, dev))
            items += kernel.plan(q5[idx], k5[idx][..., 0, :, :], v5[idx][..., 0, :, :], dout5[idx],
                                 delta[idx], shift[idx], spec, seg,
                                 None if slopes_t is None else problem.for_entry(slopes_t, idx),
                                 dq[idx], dk[idx], dv[idx], idx)
        run_tiles(kernel.run_item, items, kernel.workers)
        dq.mul_(pb.scale)  # dq = scale * sum_j ds_ij k_j
        grads = _split(pb, dq, dk, dv, dsink, opts.sinks)
        return kernel.finish(grads, check_finite)


def _grad_input(pb, x, name):
    """``out``/``dout`` ``(..., Hq, Sq, Dv)`` or ``lse`` ``(..., Hq, Sq)``, shape-checked as
    the numpy backward does, as a grouped view ``(*batch, hk, g, sq[, dv])``."""
    heads = pb.batch + (pb.hq, pb.sq)
    tail = () if name == "lse" else (pb.dv,)
    shape = tuple((heads + tail)[1:] if pb.squeeze else heads + tail)  # 2-D inputs: no head axis
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    return x.reshape(pb.batch + (pb.hk, pb.group, pb.sq) + tail)


def _split(pb, dq5, dk4, dv4, dsink5=None, sinks=None):
    """Grouped gradients back to the layout of q, k and v; ``dsinks`` in the shape of the
    ``sinks`` given, summed over the batch axes they broadcast over."""
    dq = pb.merge_heads(dq5, 2)
    grads = (dq, dk4[0], dv4[0]) if pb.squeeze else (dq, dk4, dv4)
    if sinks is None:
        return grads
    dsink = dsink5.reshape(tuple(dsink5.shape[:-2]) + (pb.hq,))
    shape = tuple(np.shape(sinks))
    if dsink.ndim > len(shape):
        dsink = dsink.sum(dim=tuple(range(dsink.ndim - len(shape))))
    return grads + (dsink.reshape(shape),)


#: No tile: the first-error index of a thread that found none.
_NONE = 2**62


class Errors:
    """The errors a kernel finds on the device, kept per thread and updated in place (never
    one flag per tile), read once at the end: whether a visible pair's score overflowed, and
    the first tile (by position, ``q0 * (sk + 1) + k0``) where a visible pair's score_mod
    gave NaN or +inf, or `_NONE`.  Shared by the forward and the backward."""

    def __init__(self, torch, dev, sk: int):
        self.torch, self.dev, self.sk = torch, dev, sk
        self.local = threading.local()
        self.pairs = []  # every thread's (overflow, first), for `state`

    def _mine(self):
        mine = getattr(self.local, "pair", None)
        if mine is None:
            torch = self.torch
            mine = self.local.pair = (torch.zeros((), dtype=torch.bool, device=self.dev),
                                      torch.full((), _NONE, dtype=torch.int64, device=self.dev))
            self.pairs.append(mine)  # list.append: safe across threads
        return mine

    def overflowed(self, bad):
        """OR a device bool (a visible pair's score beyond the range) into this thread's flag."""
        self._mine()[0].logical_or_(bad)

    def modified(self, score_fn, s, ids, q0, q1, k0, k1, hidden):
        """``score_mod`` over a tile's scores ``s`` (`torch_flex.score_values`), its NaN and
        +inf noted where visible (``hidden``: True where invisible, or None) and set to 0
        (an invisible pair's is masked by the caller)."""
        torch = self.torch
        s = torch_flex.score_values(score_fn, s, *ids, q0, q1, k0, k1, self.dev)
        # A visible pair's modified score must be a number or -inf (FlexAttention's way to mask).
        bad = torch.isnan(s) | torch.isposinf(s)
        hit = (bad if hidden is None else bad & ~hidden).any()
        first = self._mine()[1]
        torch.minimum(first, torch.where(hit, q0 * (self.sk + 1) + k0, _NONE), out=first)
        return s.masked_fill_(bad, 0.0)

    def state(self):
        """``[overflowed, first]`` as a device int64 tensor (no synchronisation)."""
        torch = self.torch
        if not self.pairs:
            return torch.tensor([0, _NONE], dtype=torch.int64, device=self.dev)
        return torch.stack([torch.stack([o for o, _ in self.pairs]).any().to(torch.int64),
                            torch.stack([f for _, f in self.pairs]).min()])

    def raise_for(self, state, dtype):
        """The error ``state`` (`state` read back: two host ints) stands for, if any."""
        overflow, first = (int(x) for x in state)
        if overflow:
            raise ValueError(problem.overflow_message(dtype))
        if first != _NONE:
            q0, k0 = divmod(first, self.sk + 1)
            raise ValueError(f"score_mod returned NaN or +inf for a visible pair (queries from {q0}, "
                             f"keys from {k0}); it must return finite scores, or -inf to mask")


class _Kernel:
    """One backward call's tile loop on the device, with its flags and constants."""

    def __init__(self, torch, dev, pb, tiles, cap, check, e, workers, mods=None, mod_grad=None):
        self.torch, self.dev, self.pb, self.tiles = torch, dev, pb, tiles
        self.cap, self.check, self.e = cap, check, e
        self.workers = workers if dev.type == "cpu" else 1  # a GPU takes every head at once
        self.cache = {}  # band masks and ALiBi distances by tile geometry (each written once)
        self.xp = Torch(dev, 1)  # the masks moved to the device
        self.host_bands = threading.local()  # each thread's host band masks
        self.errors = Errors(torch, dev, pb.sk)  # found on the device, raised by `finish`
        self.mods = mods  # (mask_mod, score_mod, block_mask) or None; the functions on device tensors
        if mods is not None:
            self.mask_fn = torch_flex.on_device(mods[0], "mask_mod", dev)
            self.score_fn = torch_flex.on_device(mods[1], "score_mod", dev)
            self.grad_fn = torch_flex.on_device(mod_grad, "score_mod_grad", dev)

    def run_item(self, item):
        """``item()``; on the CPU with the calling thread's own torch threads held to one first
        (a worker thread's OpenMP and MKL settings are its own: the main thread's
        `device.threads` does not reach them)."""
        if self.dev.type == "cpu":
            dev_mod.hold_one_thread()
        item()

    def _dout(self, dout, q0, q1):
        """``dout[..., q0:q1, :] / 2**e`` in float64 (a new tile)."""
        return _pow2(dout[..., q0:q1, :].to(self.torch.float64), -self.e)

    def rows(self, out, lse, dout):
        """Per query row, once: ``D = rowsum(dout * out)`` (a query tile at a time) and the
        shift of ``p = exp(s - lse)`` (0 on rows with ``lse = -inf``: ``exp(-inf) = 0``)."""
        torch = self.torch
        delta = torch.empty(lse.shape, dtype=torch.float64, device=self.dev)
        bq = self.tiles.block_q
        for q0 in range(0, self.pb.sq, bq):
            q1 = min(q0 + bq, self.pb.sq)
            delta[..., q0:q1] = (self._dout(dout, q0, q1) * out[..., q0:q1, :].to(torch.float64)).sum(dim=-1)
        lse = lse.to(torch.float64)
        return delta, torch.where(torch.isfinite(lse), lse, 0.0)

    def plan(self, q, k, v, dout, delta, shift, spec, seg, slopes, dq, dk, dv, idx):
        """One mask's work: callables, one per (head block, key tile) unit in ascending key
        tiles.  ``q, dout: (..., hk, g, sq, .)``, ``k, v, dk, dv: (..., hk, sk, .)``,
        ``delta, shift: (..., hk, g, sq)``, ``slopes`` broadcastable to ``(..., hk, g)``;
        ``idx``: the batch selection of the mask (the heads' ``(b, h)`` for the mods)."""
        bq, bk = self.tiles.block_q, self.tiles.block_k
        lead, sq = q.shape[:-2], q.shape[-2]
        g = lead[-1]
        k_starts, k_ends, kv_ranges = spec.key_tiles(bk)
        q_starts = np.arange(0, sq, bq)
        q_ends = np.minimum(q_starts + bq, sq)
        kinds = np.zeros((q_starts.size, k_starts.size), dtype=np.int8)  # the tile map, on the host
        for a, (q0, q1) in enumerate(zip(q_starts, q_ends)):
            kinds[a] = spec.tile_kind(q0, q1, k_starts, k_ends, kv_ranges)
        units = (work_units(lead[:-1], g * min(bq, sq), min(bk, k.shape[-2]), k_starts.size)
                 if self.dev.type == "cpu" else [()])
        mods = heads = None
        if self.mods is not None:  # each head's (b, h): on the host for the classes, on the device for the functions
            (b_np, h_np), heads = torch_flex.grids(self.pb, idx, self.dev)
            mods = flex.Mods(*self.mods, b_np, h_np)
        # Each unit's tile map: the built-in classes AND its heads' block mask (n_units, nq, nk).
        unit_kinds = np.stack([kinds if mods is None else
                               np.stack([mods.unit(unit).tile_kinds(a, kinds[a]) for a in range(q_starts.size)])
                               for unit in units])
        visible = unit_kinds != SKIP
        turns = Turns(np.cumsum(visible, axis=2) - visible, self.workers > 1)
        if slopes is not None:
            slopes = slopes.expand(lead)
        items = []
        for b in range(k_starts.size):  # ascending: the lowest unfinished unit never waits
            for u, unit in enumerate(units):
                todo = [(int(a), int(q_starts[a]), int(q_ends[a]), unit_kinds[u, a, b])
                        for a in np.flatnonzero(visible[u, :, b])]
                if not todo:
                    continue
                items.append(functools.partial(
                    self._key_tile, q[unit], k[unit], v[unit], dout[unit], delta[unit], shift[unit],
                    spec, seg, None if slopes is None else slopes[unit][..., None, None],
                    dq[unit], dk[unit], dv[unit], int(k_starts[b]), int(k_ends[b]), b, todo,
                    functools.partial(turns.turn, (u,)), turns,
                    None if heads is None else (heads[0][unit], heads[1][unit])))
        return items

    def _key_tile(self, q, k, v, dout, delta, shift, spec, seg, slopes, dq, dk, dv, k0, k1, b, todo,
                  turn, turns, ids=None):
        """Key tile ``[k0, k1)`` of one head block against its visible query tiles ``todo``;
        ``ids``: the block's ``(b, h)`` index tensors ``(..., hk, g)`` under mods, else None."""
        torch, pb = self.torch, self.pb
        lead = q.shape[:-2]  # (..., hk, g)
        heads, g, c = lead[:-1], lead[-1], k1 - k0
        f64 = dict(dtype=torch.float64, device=self.dev)
        k_j = k[..., k0:k1, :].to(torch.float64)  # (..., hk, c, d)
        v_j = v[..., k0:k1, :].to(torch.float64)  # (..., hk, c, dv)
        dk_j = torch.zeros(heads + (c, pb.d), **f64)
        dv_j = torch.zeros(heads + (c, pb.dv), **f64)
        try:
            for a, q0, q1, kind in todo:
                r = q1 - q0
                # The group's query heads as one tile of g * r rows; q_i carries the scale.
                q_i = (q[..., q0:q1, :].to(torch.float64) * pb.scale).reshape(heads + (g * r, pb.d))
                dout_i = self._dout(dout, q0, q1).reshape(heads + (g * r, pb.dv))
                s = torch.matmul(q_i, k_j.transpose(-1, -2))  # (..., hk, g * r, c)
                s, th, grad = self._scores(s.view(lead + (r, c)), spec, seg, q0, q1, k0, k1, kind, slopes, ids)
                p = s.sub_(shift[..., q0:q1, None]).exp_()  # the forward's probabilities; 0 where hidden
                p_rows = p.view(heads + (g * r, c))
                dv_j.add_(torch.matmul(p_rows.transpose(-1, -2), dout_i))  # sums the group's heads
                ds = torch.matmul(dout_i, v_j.transpose(-1, -2)).view(lead + (r, c))  # dp
                ds.sub_(delta[..., q0:q1, None]).mul_(p)  # ds = p * (dp - D)
                if th is not None:  # softcap: d/dt c tanh(t / c) = 1 - tanh(t / c)**2
                    ds.mul_(th.mul_(th).neg_().add_(1.0))
                if grad is not None:  # score_mod: its derivative at the (capped) score; p = 0: ds = 0 whatever it is
                    ds.mul_(torch.where(p > 0, grad, 1.0))
                ds_rows = ds.view(heads + (g * r, c))
                dk_j.add_(torch.matmul(ds_rows.transpose(-1, -2), q_i))
                add = torch.matmul(ds_rows, k_j).view(lead + (r, pb.d))
                with turn(a, b):  # the additions to dq_a in ascending key-tile order
                    dq[..., q0:q1, :] += add
        except BaseException:
            turns.abort()  # no other worker may wait for this tile's turns any more
            raise
        dk[..., k0:k1, :] = dk_j
        dv[..., k0:k1, :] = dv_j

    def _scores(self, s, spec, seg, q0, q1, k0, k1, kind, slopes, heads=None):
        """One tile's scores ``(..., hk, g, r, c)`` in the contract's order (softcap,
        score_mod, mask ``-inf``, ALiBi), as the forward's, with ``tanh(t / cap)`` under
        softcap and ``score_mod_grad`` at the capped scores (each else None); the errors
        noted in `errors`."""
        torch = self.torch
        hide = self._hidden(spec, seg, q0, q1, k0, k1) if kind == PARTIAL else None
        if hide is not None and heads is not None and self.mask_fn is not None:  # AND mask_mod, per head
            hide = hide | ~torch_flex.mask_values(self.mask_fn, *heads, q0, q1, k0, k1, s.shape, self.dev)
        if self.check:  # a non-finite product of a visible pair: the gradient is undefined
            bad = ~torch.isfinite(s)
            self.errors.overflowed((bad if hide is None else bad & ~hide).any())
            s = s.masked_fill_(bad, 0.0)  # an invisible pair's: masked below; keeps tanh finite
        th = None
        if self.cap is not None:  # softcap, before masking
            s = s.div_(self.cap).tanh_()
            th = s.clone()
            s = s.mul_(self.cap)
        grad = None
        if heads is not None and self.score_fn is not None:  # score_mod: after the softcap, before masks
            if self.grad_fn is not None:
                grad = torch_flex.score_values(self.grad_fn, s, *heads, q0, q1, k0, k1, self.dev, "score_mod_grad")
            s = self.errors.modified(self.score_fn, s, heads, q0, q1, k0, k1, hide)  # NaN, +inf noted
        if hide is not None:
            s = s.masked_fill_(hide, -math.inf)
        if slopes is not None:  # ALiBi, after masking: -inf stays -inf
            finite = torch.isfinite(s) if self.check else None
            s = s.sub_(slopes * self._distance(spec, q0, q1, k0, k1))
            if self.check:
                self.errors.overflowed((finite & ~torch.isfinite(s)).any())
        return s, th, grad

    def _kept(self, key, build):
        """``build()``, kept in the call's cache under ``key`` (at most `BAND_CACHE` entries)."""
        found = self.cache.get(key)
        if found is None:
            found = build()
            if len(self.cache) < BAND_CACHE:
                self.cache[key] = found
        return found

    def _hidden(self, spec, seg, q0, q1, k0, k1):
        """The tile's invisible pairs, ``(r, c)`` bool on the device: the host's mask
        (`MaskSpec.tile_visible`, its bands kept per thread), a band's negation kept."""
        host = getattr(self.host_bands, "cache", None)
        if host is None:
            host = self.host_bands.cache = {}
        vis = spec.tile_visible(np.arange(q0, q1), k0, k1, contiguous=True, cache=host)
        if vis.flags.writeable:  # built for this tile alone
            return ~self.xp.mask(vis)
        return self._kept(("band", id(vis)), lambda: (vis, ~self.xp.mask(vis)))[1]

    def _distance(self, spec, q0, q1, k0, k1):
        """ALiBi's ``|i + o - j|`` over a tile ``(r, c)``, float64: kept by ``k0 - q0`` and shape."""
        torch, dev, o = self.torch, self.dev, spec.offset

        def build():
            i = torch.arange(q0, q1, device=dev)[:, None]
            j = torch.arange(k0, k1, device=dev)[None, :]
            return (i + o - j).abs().to(torch.float64)

        return self._kept(("alibi", k0 - q0 - o, q1 - q0, k1 - k0), build)

    def finish(self, grads, check_finite):
        """The gradients times ``2**e``, after one synchronisation for every error: an
        overflowing score, a non-finite gradient (a wrong ``lse``), one beyond the range."""
        torch, e = self.torch, self.e
        names = ("dq", "dk", "dv", "dsinks")
        finite = [torch.isfinite(g).all() for g in grads]
        scaled = [_pow2(g, e) for g in grads] if e else list(grads)
        kept = [torch.isfinite(g).all() for g in scaled] if e else []
        state = np.asarray(torch.cat([self.errors.state(),
                                      torch.stack(finite + kept).to(torch.int64)]).cpu())  # the one copy
        self.errors.raise_for(state[:2], np.float64)
        finite, kept = state[2:2 + len(grads)].astype(bool), state[2 + len(grads):].astype(bool)
        if check_finite:
            for ok, name in zip(finite, names):
                if not ok:  # with finite inputs only a wrong lse makes exp(s - lse) exceed 1
                    raise ValueError(f"{name} is not finite: lse does not match q and k (exp(s - lse) "
                                     "exceeds 1): pass the lse of attention(..., return_lse=True) with the "
                                     "same options")
        if not e:
            return grads
        result = []
        for g, s, ok, still, name in zip(grads, scaled, finite, kept, names):
            if ok and not still:
                raise ValueError(f"{name} exceeds float64's range (dout times v, out, q and k reaches "
                                 f"2**{e} times it): scale dout (or v) down")
            result.append(s if ok else g)  # already non-finite: as it is (the numpy backward's rule)
        return tuple(result)


__all__ = ["backward", "grad_exponent"]
