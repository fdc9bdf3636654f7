"""`attnlib.core.stream.attention_stream` in torch, on ``q``'s device, in float64.

Built from the torch forward's pieces: each chunk is one call of the tile loop of
`attnlib.core.torch_tiled` on that chunk's keys, under the piece of the mask it covers
(`MaskSpec.piece`: the rule in the chunk's own positions, with the alignment offset
shifted by the chunk's start), giving a normalised partial with its lse in two parts
``(m, log l)``; the running result is merged with it (`torch_tiled.merge_parts`, the
split-KV merge) and the chunk is dropped.  Memory: the running ``(..., Hq, Sq, Dv)`` result
and one chunk's tiles, whatever the number of keys.  Each chunk's values are summed
against its own ``max |v|`` (the partials are normalised, so the merge needs no common
power of two).  The sinks join the first chunk's rows once.

Equal to the numpy stream (and to `attention` on the concatenated chunks) to rounding.
The host synchronises a few times per chunk (its maxima and finite check, its overflow
flags, the merge's bound), never per tile.
"""

from __future__ import annotations

import math

import numpy as np

from . import device as dev_mod
from . import problem, torch_tiled, validate
from .masks import MaskSpec, sink_tokens


def stream_forward(q, kv_chunks, opts, *, dev, total_keys=None, block_q=None, block_k=None, workers=None,
                   return_lse=False, check_finite=True):
    """`stream.stream_forward` computed with torch on ``dev`` (the options and ``total_keys``
    already checked there): torch tensors out (float64)."""
    torch = dev_mod._torch()
    workers = None if workers is None else validate.workers(workers)
    q_t = dev_mod.as_tensor(q, "q", dev)
    if check_finite and q_t.ndim >= 2 and not bool(torch.isfinite(dev_mod._extremes(q_t)).all()):
        dev_mod._first_bad(q_t, "q")
    win = opts.window
    if total_keys is not None and q_t.ndim >= 2:  # sides past Sq + Sk bound nothing
        win = validate.window(opts.window, limit=q_t.shape[-2] + total_keys)
    try:
        kv_chunks = iter(kv_chunks)
    except TypeError:
        raise TypeError("kv_chunks must be an iterable of (k_chunk, v_chunk) pairs, got "
                        f"{type(kv_chunks).__name__}") from None
    first = running = None  # the first chunk's Problem; (out, lse parts) over the keys so far
    position = 0  # absolute position of the next key
    for t, chunk in enumerate(kv_chunks):
        if not (isinstance(chunk, (tuple, list)) and len(chunk) == 2):
            raise ValueError(f"kv_chunks[{t}] must be a (k_chunk, v_chunk) pair")
        q5, k5, v5, pb = dev_mod.parse(q_t, chunk[0], chunk[1], scale=opts.scale, check_finite_inputs=False,
                                       dev=dev)
        if check_finite:  # named in the grouped layout (..., hk, 1, c, d), as the host names it
            for x, name, top in ((k5, "k", pb.maxima[1]), (v5, "v", pb.maxima[2])):
                if not math.isfinite(top):
                    dev_mod._first_bad(x, f"{name} of kv_chunks[{t}]")
        if first is None:
            cap, slopes, sink = opts.score_terms(pb)  # slopes, sinks (..., hk, g): checked against q
            tiles = opts.tiles_for(torch_tiled.device_tiles(dev, math.prod(pb.batch) * pb.hq), block_q, block_k)
            first = pb
        elif (pb.batch, pb.hk, pb.dv) != (first.batch, first.hk, first.dv):
            raise ValueError(
                f"kv_chunks[{t}] has shape k {tuple(np.shape(chunk[0]))}, v {tuple(np.shape(chunk[1]))}, "
                "unlike the first chunk")
        end = position + pb.sk
        if total_keys is not None and end > total_keys:
            raise ValueError(f"the chunks hold more than total_keys={total_keys} keys")
        spec = MaskSpec(pb.sq, total_keys if total_keys is not None else end, opts.causal, opts.causal_align,
                        win, chunk=opts.attention_chunk,
                        sink_tokens=sink_tokens(opts.sink_token_length, win)).piece(0, pb.sq, position, end)
        check = problem.scores_may_overflow(q5, k5, pb.scale, np.float64, q_max=pb.maxima[0],
                                            k_max=pb.maxima[1]) if pb.sq and pb.sk else False
        with dev_mod.threads(dev, workers), torch.no_grad():
            kernel = torch_tiled._Kernel(torch, dev, pb, tiles, cap=cap, slopes=slopes, check=check,
                                         v_max=pb.maxima[2], tau=0.0, count=False, workers=workers,
                                         prec=problem.precision(None))
            part = kernel.run(q5, k5, v5, {(): spec}, sink if running is None else None,
                              (0, -(-pb.sk // tiles.block_k)), True)[:2]
            kernel.raise_flags()
            running = part if running is None else torch_tiled.merge_parts(
                [running[0], part[0]], [running[1], part[1]])
        position = end
    if running is None:
        raise ValueError("kv_chunks is empty: give at least one (k_chunk, v_chunk), "
                         "possibly with 0 keys")
    if total_keys is not None and position != total_keys:
        raise ValueError(f"the chunks hold {position} keys, but total_keys={total_keys}")
    out = first.merge_heads(running[0], 2)
    return (out, first.merge_heads(torch_tiled.lse_of(running[1]), 1)) if return_lse else out
