"""The tiled forward in torch, on the tensors' own device, in float64.

The same algorithm as `attnlib.core.tiled` (the online softmax of `attnlib.core.online`
over the tiles `attnlib.core.masks` classifies in closed form), written for a device: one
query tile of every batch entry and head at once (a GQA group's query heads as one tile of
``g * rows`` rows against their shared kv head), no host synchronisation inside the loop
(the tile classes are planned on the host from the mask geometry; overflow and score
errors are gathered in device flags and raised once at the end), tiles sized for the
device.  Working memory: a few ``(..., block_q, block_k)`` tiles and the state of one query
tile, independent of ``Sq`` and ``Sk``.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import numpy as np

from . import device as dev_mod
from . import flex, problem, validate
from .masks import PARTIAL, SKIP
from .options import Options
from .parallel import _unit_of, run_tiles, work_units
from .stats import results
from . import tiles as tile_steps
from . import torch_flex
from .torch_merge import lse_of, merge_parts  # noqa: F401  (torch_stream takes them from here too)
from .tilesizes import TileSizes

#: Score tiles of this many bytes on a GPU (all heads of a query tile at once): large enough
#: that the ~25 launches a tile takes are a small part of its time (8 heads: 2048 x 2048
#: tiles, 17 GFLOP of products each), a few of them well within 4 GiB.
GPU_TILE_BYTES = 1 << 28


#: The CPU's tiles: torch's (MKL's) products gain from larger tiles than numpy's at every
#: head size.  Measured on a 2-core Xeon, 2 threads, medians of 3 interleaved, torch time
#: over numpy's default kernel at 256 -> 512: (1, 1, 4096, 64) 1.13 -> 0.82x, causal 1.16 ->
#: 0.96x; (1, 8, 4096, 64) 0.90 -> 0.80x, causal 1.06 -> 0.90x.
CPU_TILES = TileSizes(512, 512)
#: The CPU's tiles under documents or a window narrower than `NARROW`: fewer wasted pairs.
#: (1, 1, 16384, 64) causal, medians of 3: a 256-key window 0.27 s at 512 x 512, 0.16 s at
#: 256 x 256 (numpy's kernel 0.15 s); 16 documents 0.59 and 0.38 s (numpy 0.33 s).
CPU_MASK_TILES = TileSizes(256, 256)
NARROW = 1024


def device_tiles(dev, heads: int, opts: Options | None = None, *, spec=None) -> TileSizes:
    """The default tiles on ``dev``: on the CPU `CPU_TILES` (`CPU_MASK_TILES` under
    documents or a narrow window, read from ``opts`` or a piece's mask ``spec``), on a GPU
    square tiles of up to 4096 whose ``heads * block_q * block_k`` float64 scores fit
    `GPU_TILE_BYTES` (a per-tile Python loop is launch-bound there)."""
    if dev.type == "cpu":
        if spec is not None:
            window, documents = tuple(spec.window), spec.q_segments is not None
        else:
            window = (None, None) if opts is None or opts.window is None else tuple(opts.window)
            documents = opts is not None and opts.q_segment_ids is not None
        narrow = any(w is not None and 0 <= w < NARROW for w in window)
        return CPU_MASK_TILES if narrow or documents else CPU_TILES
    side = 4096
    while side > 256 and heads * side * side * 8 > GPU_TILE_BYTES:
        side //= 2
    return TileSizes(side, side)


@dataclass
class _State:
    """``(m_i, l_i, acc)`` of one query tile, ``(..., hk, g, r)`` and ``(..., hk, g, r, dv)``."""

    m: object
    l: object
    acc: object
    mx: object = None  # (..., hk, g, r): the largest visible score so far (max_scores), if asked


#: Most band masks one call keeps on the device (each at most one tile): a causal run or a
#: sliding window has one or two diagonal offsets per tile shape.
BAND_CACHE = 64
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


def _hidden(spec, q0, q1, k0, k1, torch, dev, seg=None):
    """``~MaskSpec.visible`` on the device for queries ``[q0, q1)`` against keys ``[k0, k1)``
    (host integers: no synchronisation): ``(r, c)`` bool, True where the pair is invisible.
    ``seg``: the spec's segment ids on the device, or None."""
    o = spec.offset
    i = torch.arange(q0, q1, device=dev)[:, None]
    j = torch.arange(k0, k1, device=dev)[None, :]
    hide = None

    def either(rule):
        return rule if hide is None else hide | rule

    if q1 > spec.rows:
        hide = either(i >= spec.rows)
    if k1 > spec.keys:
        hide = either(j >= spec.keys)
    if k0 < spec.key_lo:  # left-padded keys
        hide = either(j < spec.key_lo)
    if spec.left is not None:
        rule = j < i + (o - spec.left)
        hide = either(rule & (j >= spec.sink_end) if spec.sinks_from(k0) else rule)
    if spec.right is not None:
        hide = either(j > i + (o + spec.right))
    if spec.chunk is not None:  # floor((j - s) / C) != floor((i + o - s) / C)
        s, c = spec.kv_start, spec.chunk
        hide = either(torch.div(j - s, c, rounding_mode="floor") != torch.div(i + (o - s), c, rounding_mode="floor"))
    if seg is not None:
        hide = either(seg[0][q0:q1][:, None] != seg[1][k0:k1][None, :])
    if hide is None:
        hide = torch.zeros((q1 - q0, k1 - k0), dtype=torch.bool, device=dev)
    return hide


def band_key(spec, q0, q1, k0, k1, seg=None):
    """The key a PARTIAL tile's mask is kept under, or None: a tile under the band rules only
    (no length or document crosses it) depends on ``k0 - q0 - o``, the band and its shape
    alone, so a causal run or a sliding window reuses one or two masks per tile shape (the
    specs of a call differ in their offsets with their lengths, hence ``o`` in the key);
    chunks, left padding and sink tokens inside the tile are not band rules: no key."""
    if seg is not None or q1 > spec.rows or k1 > spec.keys or k0 < spec.key_lo or spec.chunk is not None:
        return None
    if spec.sinks_from(k0):  # sink tokens in the tile: not a pure band
        return None
    return (k0 - q0 - spec.offset, spec.left, spec.right, q1 - q0, k1 - k0)


def forward(q, k, v, opts: Options, *, dev, block_q=None, block_k=None, kv_splits=1, workers=None,
            rescale_threshold=0.0, compute_dtype=None, return_lse=False, return_stats=False,
            check_finite=True, return_max_scores=False):
    """`attnlib.core.tiled.forward` computed with torch on ``dev``: torch tensors out (float64)."""
    torch = dev_mod._torch()

    kv_splits = validate.positive_int(kv_splits, "kv_splits")
    workers = None if workers is None else validate.workers(workers)
    tau = validate.threshold(rescale_threshold)
    return_lse = validate.flag(return_lse, "return_lse")
    return_stats = validate.flag(return_stats, "return_stats")
    extremes = {}
    q5, k5, v5, pb = dev_mod.parse(q, k, v, scale=opts.scale, check_finite_inputs=check_finite, dev=dev,
                                   extremes=extremes)
    tiles = opts.tiles_for(device_tiles(dev, math.prod(pb.batch) * pb.hq, opts), block_q, block_k)
    specs = opts.specs(pb)
    mods = torch_flex.device_mods(opts, pb, tiles, dev)  # (mask_mod, score_mod, block_mask) or None, checked
    prec = problem.precision(compute_dtype)
    cap, slopes, sink = opts.score_terms(pb, prec)
    v_max = pb.maxima[2]
    # Values beyond the compute type's range round to inf there (the host path's message).
    problem.check_representable(prec, **{n: np.array(extremes.get(n, (0.0, 0.0))) for n in "qkv"})
    check = _overflow_check(q5, k5, pb, prec)
    if tau:
        tau = problem.safe_threshold(tau, prec, pb.sk, v_max)
    n_k_tiles = -(-pb.sk // tiles.block_k)
    splits = np.array_split(np.arange(n_k_tiles), max(1, min(kv_splits, n_k_tiles)))
    # float64 partials merge their lse in two parts (m, log l); a low precision merges its
    # one-float lse, as its kernel does (`tiled.forward`).
    parts = len(splits) > 1 and prec.is_float64
    with dev_mod.threads(dev, workers), torch.no_grad():
        kernel = _Kernel(torch, dev, pb, tiles, cap, slopes, check, v_max, tau, return_stats, workers, prec,
                         mods, return_max_scores)
        partials = [kernel.run(q5, k5, v5, specs, sink if r == 0 else None,
                               (int(part[0]), int(part[-1]) + 1) if part.size else (0, 0), parts)
                    for r, part in enumerate(splits)]
        if len(partials) == 1:
            out, lse = partials[0][:2]
        else:
            lse_parts = [p[1] if parts else torch.stack([p[1], torch.where(torch.isfinite(p[1]), 0.0, -math.inf)], -1)
                         for p in partials]
            out, merged = merge_parts([p[0] for p in partials], lse_parts)
            lse = lse_of(merged)
        kernel.raise_flags()
        maxes = None
        if return_max_scores:  # the largest of the key ranges'
            maxes = functools.reduce(torch.maximum, [p[4] for p in partials])
        if not prec.is_float64:  # what a kernel in that precision would write out
            out, lse = out.to(kernel.compute), lse.to(kernel.acc)
            maxes = None if maxes is None else maxes.to(kernel.acc)
    return results(pb, tiles, out, lse, sum(np.asarray(p[2].cpu()) for p in partials) if return_stats else None,
                   partials[0][3], return_lse=return_lse, return_stats=return_stats, max_scores=maxes)


def piece(q, k, v, spec, opts: Options, *, dev, cap, slopes, sink):
    """One piece of a larger problem (`attnlib.distributed`): all of its keys under its own
    mask ``spec``, float64, on one thread (the cluster's workers are the parallelism):
    ``(out (..., hk, g, sq, dv), lse parts (..., hk, g, sq, 2))`` as ``(m, log l)``, the
    problem's `problem.Problem` beside them. ``opts`` carries the scale and the top-k lists;
    ``slopes`` and ``sink``: one per query head, or None."""
    torch = dev_mod._torch()
    q5, k5, v5, pb = dev_mod.parse(q, k, v, scale=opts.scale, check_finite_inputs=True, dev=dev)
    slopes, sink = (None if x is None else x.reshape(pb.hk, pb.group) for x in (slopes, sink))
    tiles = device_tiles(dev, math.prod(pb.batch) * pb.hq, opts, spec=spec)
    prec = problem.precision(None)
    with dev_mod.threads(dev, 1), torch.no_grad():
        kernel = _Kernel(torch, dev, pb, tiles, cap, slopes, _overflow_check(q5, k5, pb, prec),
                         pb.maxima[2], 0.0, False, 1, prec, torch_flex.device_mods(opts, pb, tiles, dev))
        out, parts, *_ = kernel.run(q5, k5, v5, {(): spec}, sink, (0, -(-pb.sk // tiles.block_k)), True)
        kernel.raise_flags()
    return out, parts, pb


def _overflow_check(q5, k5, pb, prec) -> bool:
    """Whether a score may overflow ``prec``'s accumulator (`problem.scores_may_overflow`),
    checked per tile when it may."""
    q_max, k_max, _ = pb.maxima
    return problem.scores_may_overflow(q5, k5, pb.scale, prec.accumulate, q_max=q_max, k_max=k_max) \
        if pb.sq and pb.sk else False


class _Kernel:
    """One call's tile loop on the device, with its flags (overflow) and constants."""

    def __init__(self, torch, dev, pb, tiles, cap, slopes, check, v_max, tau, count, workers, prec, mods=None,
                 maxes=False):
        self.torch, self.dev, self.pb, self.tiles = torch, dev, pb, tiles
        self.maxes = maxes  # run also returns each row's largest visible score (max_scores)
        # The programmable options (`flex.mods_for`), their functions called on device tensors.
        self.mods = mods
        if mods is not None:
            self.mask_fn = torch_flex.on_device(mods[0], "mask_mod", dev)
            self.score_fn = torch_flex.on_device(mods[1], "score_mod", dev)
        self.errors = Errors(torch, dev, pb.sk)  # found on the device, raised by `raise_flags`
        self.cap, self.check, self.tau, self.count, self.v_max = cap, check, tau, count, v_max
        # A low precision (`problem.Precision`): q, k, v and p rounded to `compute`, the scores
        # and the state (m, l, acc) kept in `acc` (float32), the scale on the scores.
        self.prec, self.low = prec, not prec.is_float64
        self.compute = getattr(torch, prec.compute.name)
        self.p_type = getattr(torch, (prec.p_type or prec.compute).name)  # what p @ v takes p in
        self.acc = getattr(torch, prec.accumulate.name)
        self.slopes = None if slopes is None else torch.as_tensor(slopes, device=dev)  # (..., hk, g)
        # Values near the type's range are summed divided by 2**e (`problem.value_exponent`).
        self.v_exp = problem.value_exponent(v_max, pb.sk, prec.accumulate)
        # The CPU runs (head block, query tile) units on threads, as the numpy kernel does (one
        # torch thread each: tile-sized ops lose to torch's own threads, 330 against 165 us for
        # a (256, 64) @ (64, 256) product on 2 threads, measured); a GPU takes every head at once.
        self.workers = (validate.workers(None) if workers is None else workers) if dev.type == "cpu" else 1
        self.bands = {}  # `_mask`'s band masks, shared by the threads (each entry written once)

    def raise_flags(self):
        if self.errors.pairs:  # one read, at the end
            self.errors.raise_for(self.errors.state().cpu(), self.prec.accumulate)

    def run(self, q5, k5, v5, specs, sink, key_tiles, lse_parts):
        """Attend to the key tiles ``[b_lo, b_hi)``: ``(out, lse, rescales, kinds, maxes)``
        (``maxes``, each row's largest visible score, None unless asked)."""
        torch, pb, tiles = self.torch, self.pb, self.tiles
        lead = q5.shape[:-2]  # (*batch, hk, g)
        f64 = dict(dtype=torch.float64, device=self.dev)
        out = torch.empty(lead + (pb.sq, pb.dv), **f64)
        lse = torch.empty(lead + (pb.sq,) + ((2,) if lse_parts else ()), **f64)
        maxes = torch.full(lead + (pb.sq,), -math.inf, **f64) if self.maxes else None
        shape = (-(-pb.sq // tiles.block_q), -(-pb.sk // tiles.block_k))
        kinds = rescales = None
        if self.count:
            validate.check_allocation(9 * math.prod(lead + shape), f"return_stats's per-tile counts of "
                                      f"{shape[0]} x {shape[1]} tiles per head")
            kinds = np.empty(pb.batch + shape, dtype=np.int8)
            rescales = torch.zeros(lead + shape, dtype=torch.int64, device=self.dev)
        if not math.prod(lead):
            return out, lse, rescales, kinds, maxes
        sink_t = None if sink is None else torch.as_tensor(sink, device=self.dev)
        items = []
        for idx, spec in specs.items():  # idx = (): every batch entry shares one mask
            seg = None
            if spec.q_segments is not None:
                seg = (dev_mod.index_tensor(spec.q_segments, self.dev),
                       dev_mod.index_tensor(spec.kv_segments, self.dev))
            items += self._plan(idx, q5[idx], k5[idx], v5[idx], spec, seg,
                                None if self.slopes is None else problem.for_entry(self.slopes, idx),
                                None if sink_t is None else problem.for_entry(sink_t, idx),
                                out[idx], lse[idx], None if rescales is None else rescales[idx],
                                None if kinds is None else kinds[idx], key_tiles, lse_parts,
                                None if maxes is None else maxes[idx])
        with dev_mod.threads(self.dev, 1 if self.workers > 1 else None):
            run_tiles(self._run_item, items, self.workers)
        return out, lse, rescales, kinds, maxes

    def _run_item(self, item):
        if self.workers > 1:  # a worker thread of `run_tiles`: one torch thread of its own first
            dev_mod.hold_one_thread()
        item()

    def _plan(self, idx, q, k, v, spec, seg, slopes, sink, out, lse, rescales, kinds, key_tiles, lse_parts,
              maxes=None):
        """One mask's work: a list of callables, one per (query tile, head block) unit, each
        writing its own rows of ``out``, ``lse`` and ``rescales``.  ``q: (..., hk, g, sq, d)``,
        ``k, v: (..., hk, 1, sk, .)``; the longest (last, under causal) query tiles first."""
        tiles = self.tiles
        bq, bk = tiles.block_q, tiles.block_k
        lead, sq = q.shape[:-2], q.shape[-2]
        k_starts, k_ends, kv_ranges = spec.key_tiles(bk)
        in_range = np.zeros(k_starts.size, dtype=bool)
        in_range[key_tiles[0]:key_tiles[1]] = True
        n_q_tiles = -(-sq // bq)
        units = (work_units(lead, min(bq, sq), min(bk, k.shape[-2]), n_q_tiles)
                 if self.dev.type == "cpu" else [()])
        slopes = None if slopes is None else slopes.expand(lead)
        sink = None if sink is None else sink.expand(lead)
        mods = heads = None
        if self.mods is not None:  # each head's (b, h): on the host for the classes, on the device for the functions
            (b_np, h_np), heads = torch_flex.grids(self.pb, idx, self.dev)
            mods = flex.Mods(*self.mods, b_np, h_np)
        items = []
        for a in reversed(range(n_q_tiles)):
            q0, q1 = a * bq, min(sq, (a + 1) * bq)
            tile_kinds = spec.tile_kind(q0, q1, k_starts, k_ends, kv_ranges)  # (n_k_tiles,), on the host
            if kinds is not None:
                if mods is None:
                    kinds[..., a, :] = tile_kinds
                else:  # per batch entry, over all its heads: the block mask's classes AND the built-in ones
                    for e in np.ndindex(kinds.shape[:-2]):
                        kinds[e + (a,)] = mods.unit(e).tile_kinds(a, tile_kinds)
            for unit in units:
                unit_kinds = tile_kinds if mods is None else mods.unit(unit).tile_kinds(a, tile_kinds)
                todo = np.flatnonzero((unit_kinds != SKIP) & in_range)
                items.append(functools.partial(
                    self._tile, q[unit], _unit_of(k, unit)[..., 0, :, :], _unit_of(v, unit)[..., 0, :, :],
                    spec, seg, None if slopes is None else slopes[unit][..., None, None],
                    None if sink is None else sink[unit], out[unit], lse[unit],
                    None if rescales is None else rescales[unit], a, q0, q1,
                    [(int(t), int(k_starts[t]), int(k_ends[t]), unit_kinds[t]) for t in todo], lse_parts,
                    None if heads is None else (heads[0][unit], heads[1][unit]),
                    None if maxes is None else maxes[unit]))
        return items

    def _tile(self, q, k, v, spec, seg, slopes, sink, out, lse, rescales, a, q0, q1, todo, lse_parts,
              heads=None, maxes=None):
        """One query tile of one head block against its key tiles ``todo``:
        ``q: (..., g, sq, d)``, ``k, v: (..., sk, .)`` (the group's kv head)."""
        torch, pb = self.torch, self.pb
        lead, dv, r = q.shape[:-2], v.shape[-1], q1 - q0
        g = lead[-1] if lead else 1
        f64 = dict(dtype=self.acc, device=self.dev)  # the state's type: float64, or float32
        # The scale is applied once per query tile, as the host kernel does (a low precision:
        # on the scores); a GQA group's query heads are one tile of g * r rows against their kv head.
        q_i = self._operand(q[..., q0:q1, :])
        if not self.low:
            q_i = q_i * pb.scale
        q_i = q_i.reshape(lead[:-1] + (g * r, pb.d))
        shape = lead + (r,)
        if sink is None:
            st = _State(torch.full(shape, -math.inf, **f64), torch.zeros(shape, **f64),
                        torch.zeros(shape + (dv,), **f64))
        else:  # each row starts from its head's sink: (m, l, acc) = (sink, 1, 0)
            # A copy of its own (a one-row tile's expand is the sink itself): blocks write m's rows.
            st = _State(sink[..., None].expand(shape).to(self.acc).clone(memory_format=torch.contiguous_format),
                        torch.ones(shape, **f64),
                        torch.zeros(shape + (dv,), **f64))
        if maxes is not None:
            st.mx = torch.full(shape, -math.inf, **f64)
        v_scale = math.ldexp(1.0, -self.v_exp)
        for t, k0, k1, kind in todo:
            k_j = self._operand(k[..., k0:k1, :])  # (..., c, d)
            v_j = self._operand(v[..., k0:k1, :])  # (..., c, dv)
            if v_scale != 1.0:  # exact: a power of two
                v_j = v_j * v_scale
            # Packed documents on the CPU: each document's block alone (`tiles.absorb`'s rule).
            blocks = (tile_steps.document_blocks(spec, q0, r, k0, k1)
                      if kind == PARTIAL and heads is None and self.dev.type == "cpu" else None)
            if blocks is None:
                s, mask = self._scores(q_i, k_j, spec, seg, q0, q1, k0, k1, kind, slopes, lead, heads)
                events = self._update(st, s, mask, v_j, lead, r)
            else:
                events = self._blocks(st, q_i, k_j, v_j, spec, blocks, q0, k0, slopes, lead, r)
            if rescales is not None:
                rescales[..., a, t] = events
        self._finalize(st, out, lse, q0, q1, lse_parts)
        if maxes is not None:
            maxes[..., q0:q1] = st.mx

    def _blocks(self, st, q_i, k_j, v_j, spec, blocks, q0, k0, slopes, lead, r):
        """A PARTIAL tile of packed documents, block by block (`MaskSpec.document_blocks`):
        each block's rows of ``st`` absorb its keys under the rules but the documents';
        returns the tile's rescale events per head (None unless counted)."""
        sub, events = spec.without_documents, None
        q_rows = q_i.view(lead + (r, q_i.shape[-1]))  # (..., hk, g, r, d)
        for r0, r1, c0, c1 in blocks:
            kind = sub.tile_kind(q0 + r0, q0 + r1, k0 + c0, k0 + c1)
            if kind == SKIP:
                continue
            q_b = q_rows[..., r0:r1, :].reshape(lead[:-1] + (lead[-1] * (r1 - r0), q_i.shape[-1]))
            s, mask = self._scores(q_b, k_j[..., c0:c1, :], sub, None, q0 + r0, q0 + r1, k0 + c0, k0 + c1,
                                   kind, slopes, lead)
            part = _State(st.m[..., r0:r1], st.l[..., r0:r1], st.acc[..., r0:r1, :],
                          None if st.mx is None else st.mx[..., r0:r1])
            moved = self._update(part, s, mask, v_j[..., c0:c1, :], lead, r1 - r0)
            st.m[..., r0:r1] = part.m  # _update rebinds m and mx; l and acc change in place
            if st.mx is not None:
                st.mx[..., r0:r1] = part.mx
            events = moved if events is None else events + moved
        if events is None and self.count:  # no block with a visible pair
            events = self.torch.zeros(lead, dtype=self.torch.int64, device=self.dev)
        return events

    def _operand(self, x):
        """A tile of q, k or v in the type the products take: float64, or rounded to the
        compute type and held in float32."""
        if self.low:
            return dev_mod.rounded(x, self.compute).to(self.acc)
        return x.to(self.torch.float64)

    def _mask(self, spec, seg, q0, q1, k0, k1):
        """A PARTIAL tile's mask as ``(hide, bias, keep)``, ``(r, c)`` each: the invisible pairs
        (bool), ``0 / -inf`` to add for the row max, ``1 / 0`` to multiply ``p`` by.  torch's
        ``exp(-inf)`` takes a slow path (317 against 52 us for a 256 x 256 tile, half masked;
        ``masked_fill`` 132 us, an add 29 us, measured), so the scores are never set to
        ``-inf``: ``p = exp(min(s - m, tau + 1)) * keep`` is exactly 0 where hidden (the
        clamp keeps a hidden score above the row's max finite) and unchanged where visible
        (``s - m <= tau`` there).  Band masks are kept in ``self.bands`` (`band_key`)."""
        key = band_key(spec, q0, q1, k0, k1, seg)
        if key is not None and key in self.bands:
            return self.bands[key]
        torch = self.torch
        hide = _hidden(spec, q0, q1, k0, k1, torch, self.dev, seg)
        terms = (hide, torch.zeros(hide.shape, dtype=self.acc, device=self.dev).masked_fill_(hide, -math.inf),
                 (~hide).to(self.acc))
        if key is not None and len(self.bands) < BAND_CACHE:
            self.bands[key] = terms
        return terms

    def _scores(self, q_i, k_j, spec, seg, q0, q1, k0, k1, kind, slopes, lead, heads=None):
        """One tile's scores ``(..., hk, g, r, c)`` in the contract's order, ``(scale q) k^T``,
        softcap, ALiBi, and the tile's `_mask` (None for a FULL tile), which `_update` applies:
        masking commutes with the elementwise terms on the visible pairs."""
        torch, r = self.torch, q1 - q0
        s = torch.matmul(q_i, k_j.transpose(-1, -2)).view(lead + (r, k1 - k0))  # (..., hk, g, r, c)
        if self.low:  # rounded q: the scale goes on the float32 scores, as in low-precision kernels
            s = s.mul_(self.pb.scale)
        mask = None
        if kind == PARTIAL:
            mask = self._mask(spec, seg, q0, q1, k0, k1)
            if heads is not None and self.mask_fn is not None:  # AND mask_mod, per head: (..., r, c)
                hide = mask[0] | ~torch_flex.mask_values(self.mask_fn, *heads, q0, q1, k0, k1, s.shape, self.dev)
                mask = (hide, torch.zeros(hide.shape, dtype=self.acc, device=self.dev).masked_fill_(hide, -math.inf),
                        (~hide).to(self.acc))
        if self.check:  # a non-finite product of a visible pair: the softmax is undefined
            bad = ~torch.isfinite(s)
            self.errors.overflowed((bad if mask is None else bad & ~mask[0]).any())
            s = s.masked_fill_(bad, 0.0)  # an invisible pair's: masked out in `_update`
        if self.cap is not None:  # softcap, before masking
            s = s.div_(self.cap).tanh_().mul_(self.cap)
        if heads is not None and self.score_fn is not None:  # score_mod: after the softcap, before masks
            s = self.errors.modified(self.score_fn, s, heads, q0, q1, k0, k1, None if mask is None else mask[0])
        if slopes is not None:  # ALiBi
            rows = torch.arange(q0, q1, device=self.dev)
            cols = torch.arange(k0, k1, device=self.dev)
            dist = (rows[:, None] + spec.offset - cols[None, :]).abs().to(torch.float64)  # (r, c)
            s = s.sub_(slopes * dist)
            if self.check:  # a visible score pushed beyond the range by its bias
                bad = ~torch.isfinite(s)
                self.errors.overflowed((bad if mask is None else bad & ~mask[0]).any())
                s = s.masked_fill_(bad, 0.0)
        return s, mask

    def _update(self, st, s, mask, v_j, lead, r):
        """The online softmax's step (`attnlib.core.online.OnlineSoftmax.update`) on ``s`` and
        its `_mask`; returns the rescale events per head ``(..., hk, g)`` (int64 on the device)."""
        torch = self.torch
        m_tile = (s if mask is None else s + mask[1]).amax(dim=-1)  # (..., hk, g, r): visible pairs only
        if st.mx is not None:  # max_scores: its own reduction (m is lazy and sink-initialised)
            st.mx = torch.maximum(st.mx, m_tile)
        if self.tau:  # lazy: keep a stale max until the tile's exceeds it by more than tau
            m_new = torch.where(m_tile > st.m + self.tau, m_tile, st.m)
        else:
            m_new = torch.maximum(st.m, m_tile)
        events = (torch.isfinite(st.m) & (m_new > st.m)).sum(dim=-1) if self.count else None
        shift = torch.nan_to_num(m_new, neginf=0.0)  # m_new where finite, else 0: no -inf - -inf
        alpha = (st.m - shift).exp_()  # (..., hk, g, r); 0 for rows with m = -inf
        s = s.sub_(shift[..., None])  # visible: <= tau (0 eager)
        if mask is None:
            p = s.exp_()
        else:  # hidden pairs: exactly 0, their exponents held finite first
            p = s.clamp_max_(self.tau + 1.0).exp_().mul_(mask[2])
        st.l.mul_(alpha).add_(p.sum(dim=-1))
        if self.low:  # l sums the unrounded p; p @ v takes p rounded, as FlashAttention's kernels do
            p = p.to(self.p_type).to(self.acc)
        pv = torch.matmul(p.view(lead[:-1] + (lead[-1] * r, p.shape[-1])), v_j)  # (..., hk, g*r, dv)
        st.acc.mul_(alpha[..., None]).add_(pv.view(lead + (r, v_j.shape[-1])))
        st.m = m_new
        return events

    def _finalize(self, st, out, lse, q0, q1, lse_parts):
        torch = self.torch
        seen = st.l > 0  # l >= 1 for every row that saw a key
        l_safe = torch.where(seen, st.l, 1.0)
        o_i = torch.where(seen[..., None], st.acc / l_safe[..., None], 0.0)
        if self.v_exp:  # the attention of the values divided by 2**e: held to +-max|v|, scaled back
            bound = math.ldexp(self.v_max, -self.v_exp)
            o_i = o_i.clamp(-bound, bound) * math.ldexp(1.0, self.v_exp)  # exact: a power of two, within the range
        out[..., q0:q1, :] = o_i
        log_l = torch.where(seen, torch.log(l_safe), -math.inf)
        if lse_parts:
            lse[..., q0:q1, 0] = torch.where(seen, st.m, -math.inf)
            lse[..., q0:q1, 1] = log_l
        else:
            lse[..., q0:q1] = torch.where(seen, st.m + log_l, -math.inf)


def row_stats(q, k, opts: Options, *, dev, block_q, block_k):
    """`attnlib.judge.gate.row_stats` on the device: ``(sigma, n_vis)``, each
    ``(..., Hq, Sq)`` on ``dev``, tile by tile as the kernel visits the tiles.

    ``sigma_i = max_j |scale| sum_c |q_ic| |k_jc|`` over the row's visible keys (0 for none)
    and ``n_vis_i`` their count; the built-in masks only (``opts``: no score terms, no mods).
    """
    torch = dev_mod._torch()
    given = sorted(opts.given(("alibi_slopes", "sinks", "mask_mod", "score_mod", "block_mask",
                               "block_table", "cache_seqlens")))
    if given:  # the softcap does not bound the size of q . k: not read, as on the host
        raise ValueError(f"row_stats on a torch device takes the built-in masks only, not {', '.join(given)}")
    q5, k5, _, pb = dev_mod.parse(q, k, k[..., :1], scale=opts.scale, check_finite_inputs=False, dev=dev)
    specs = opts.specs(pb)
    f64 = dict(dtype=torch.float64, device=dev)
    sigma = torch.zeros(q5.shape[:-1], **f64)  # (*batch, hk, g, sq)
    n_vis = torch.zeros(q5.shape[:-1], dtype=torch.int64, device=dev)
    bands = {}
    with torch.no_grad():
        for idx, spec in specs.items():  # idx = (): one mask for every batch entry
            seg = None if spec.q_segments is None else (dev_mod.index_tensor(spec.q_segments, dev),
                                                         dev_mod.index_tensor(spec.kv_segments, dev))
            qa = q5[idx]
            ka = k5[idx][..., 0, :, :]  # (..., hk, sk, d)
            lead = qa.shape[:-2]
            k_starts, k_ends, ranges = spec.key_tiles(block_k)
            for q0 in range(0, pb.sq, block_q):
                q1 = min(pb.sq, q0 + block_q)
                kinds = spec.tile_kind(q0, q1, k_starts, k_ends, ranges)  # (n_k_tiles,), on the host
                # Scaled |q|, as the kernel scales q: (..., hk, g * r, d).
                q_i = (qa[..., q0:q1, :].to(torch.float64).abs() * abs(pb.scale)).reshape(
                    lead[:-1] + (lead[-1] * (q1 - q0), pb.d))
                top = sigma[idx][..., q0:q1]
                count = n_vis[idx][..., q0:q1]
                for t in np.flatnonzero(kinds != SKIP):
                    a, b = int(k_starts[t]), int(k_ends[t])
                    s = torch.matmul(q_i, ka[..., a:b, :].to(torch.float64).abs().transpose(-1, -2))
                    s = s.view(lead + (q1 - q0, b - a))  # (..., hk, g, r, c)
                    if kinds[t] == PARTIAL:  # masked pairs neither raise the max nor count
                        key = band_key(spec, q0, q1, a, b, seg)
                        hide = bands.get(key) if key is not None else None
                        if hide is None:
                            hide = _hidden(spec, q0, q1, a, b, torch, dev, seg)
                            if key is not None and len(bands) < BAND_CACHE:
                                bands[key] = hide
                        s = s.masked_fill_(hide, -math.inf)
                    count += torch.isfinite(s).sum(dim=-1)  # an overflowing size counts as the host's does
                    torch.maximum(top, s.amax(dim=-1).clamp_min(0.0), out=top)
    return pb.merge_heads(sigma, 1), pb.merge_heads(n_vis, 1)
