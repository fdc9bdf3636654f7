"""Streaming attention: keys and values arrive in chunks (a generator, a memmapped KV cache).

Memory is bounded by one chunk's float64 tile plus the online state of the queries,
whatever the total number of keys: the decode case of a few queries against a KV cache
far larger than memory.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import problem, validate, hooks
from .options import MODS, SPARSE, Call
from .masks import SKIP, MaskSpec, sink_tokens
from .tilesizes import DEFAULT_TILES, TileSizes
from .backend import NUMPY, backend_for
from . import tiles  # noqa: F401  (declares the steps absorb looks up)
from .parallel import run_tiles
from .device import on_device, resolve as device_of


def attention_stream(q, kv_chunks, *, causal=False, causal_align="bottom_right", window=None,
                     attention_chunk=None, sink_token_length=0, softcap=None, alibi_slopes=None, sinks=None,
                     scale=None, total_keys=None,
                     block_q=None, block_k=None, workers=None, return_lse=False, check_finite=True,
                     device=None):
    """Attention of ``q`` over keys that arrive in chunks, in order.

    Parameters
    ----------
    q : array_like, shape ``(..., Hq, Sq, D)`` or ``(Sq, D)``
    kv_chunks : iterable of ``(k_chunk, v_chunk)``
        Each ``k_chunk: (..., Hk, c, D)`` and ``v_chunk: (..., Hk, c, Dv)`` (``c`` may vary
        from chunk to chunk, and may be 0), e.g. from a generator or slices of an
        ``np.memmap``.  Chunk ``t`` holds the keys that follow those of chunk ``t - 1``.
    causal, causal_align, window, attention_chunk, sink_token_length, softcap, alibi_slopes, sinks, scale
        As in `attention` (the sinks are every query row's initial state).
    total_keys : int, optional
        The number of keys all chunks hold together, ``Sk``.  Needed for the
        ``bottom_right`` alignment (``o = Sk - Sq``) when a causal mask, a window or ALiBi
        uses it; checked against the chunks when given.  ``top_left`` and unmasked
        attention need nothing but the chunks.
    block_q, block_k : int, optional
        Tile sizes inside a chunk (default `DEFAULT_TILES`).
    workers : int, optional
        Threads that take the query tiles of each chunk in parallel; default (None, or
        -1): one per available CPU, with BLAS held to one thread.  Bit-identical for every
        thread count.
    return_lse : bool
        Also return ``lse: (..., Hq, Sq)``.
    check_finite : bool
        Refuse NaN or inf in q and in every chunk.
    device : str or torch.device, optional
        As in `attention`: a torch ``q`` (or ``device=``) has the stream computed with torch
        on that device (the torch backend, `attnlib.core.torch_backend`), each chunk moved there as it comes
        (numpy or torch, any floating type), torch tensors out (numpy out for a numpy ``q``
        with ``device=``).  ``q`` decides: a numpy ``q`` without ``device=`` reads torch
        chunks on the host, as before.

    Returns
    -------
    out : ndarray, shape ``(..., Hq, Sq, Dv)``
    lse : ndarray, shape ``(..., Hq, Sq)``, if ``return_lse``

    Notes
    -----
    Equal to `attention` on the concatenated chunks up to rounding (the key tiles start at
    chunk boundaries, so the rescale pattern, not the result, can differ).  Working memory
    is one ``(..., block_q, block_k)`` score tile and a ``(..., block_k, D)`` float64 copy
    of the chunk's keys at a time, plus the state ``(..., Hq, Sq, Dv)``.

    Examples
    --------
    >>> import numpy as np, attnlib
    >>> q, k, v = attnlib.random_qkv(4, 1000, 16, seed=0)
    >>> chunks = ((k[i:i + 300], v[i:i + 300]) for i in range(0, 1000, 300))
    >>> out = attnlib.attention_stream(q, chunks, causal=True, total_keys=1000)
    >>> bool(np.allclose(out, attnlib.reference_attention(q, k, v, causal=True), atol=1e-14))
    True
    """
    if total_keys is not None:
        total_keys = validate.count(total_keys, "total_keys")
    return stream_forward(q, kv_chunks, Call.bind(locals()), total_keys=total_keys)


def stream_forward(q, kv_chunks, call: Call, total_keys=None):
    """`attention_stream` of the bound ``call`` (``total_keys`` checked)."""
    opts, workers, check_finite = call.options, call.workers, call.check_finite
    refused = sorted(opts.given(("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids", "key_leftpad")
                                + MODS + SPARSE))
    if refused:
        raise ValueError(f"{', '.join(refused)} cannot be combined with streamed keys")
    dev = device_of(call.device, q)
    xp = NUMPY if dev is None else backend_for(dev, workers)
    base = DEFAULT_TILES
    if xp is not NUMPY:
        from .tilesizes import device_tiles
        base = device_tiles(dev, int(np.prod(np.shape(q)[:-2])) if len(np.shape(q)) >= 2 else 1)
    tiles = TileSizes(call.block_q or base.block_q, call.block_k or base.block_k)
    workers = validate.workers(workers) if xp is NUMPY else xp.workers
    needs_offset = (opts.causal or opts.window != (None, None) or opts.alibi_slopes is not None
                    or opts.attention_chunk is not None)
    if needs_offset and opts.causal_align == "bottom_right" and total_keys is None:
        raise ValueError(
            "total_keys is needed: the bottom_right alignment puts query i at key position "
            "i + total_keys - Sq (or pass causal_align='top_left')")
    with xp.threads(workers):
        out, lse = _stream(q, kv_chunks, opts, xp, tiles, total_keys, workers, check_finite)
    result = (out, lse) if call.return_lse else out
    return on_device(result, (q,)) if dev is not None else result


def _stream(q, kv_chunks, opts, xp, tiles, total_keys, workers, check_finite):
    """`stream_forward`'s loop over the chunks: ``(out, lse)`` in the caller's layout."""
    causal, causal_align, cap, win = opts.causal, opts.causal_align, opts.softcap, opts.window
    alibi_slopes, sinks, scale, window = opts.alibi_slopes, opts.sinks, opts.scale, opts.window
    q_arr = xp.read(q, "q")
    if check_finite and q_arr.ndim >= 2:
        q_max = xp.checked_max(q_arr, "q")  # max |q| on the way, as for each chunk below
    if total_keys is not None and q_arr.ndim >= 2:  # sides past Sq + Sk bound nothing
        win = validate.window(window, limit=q_arr.shape[-2] + total_keys)
    try:
        kv_chunks = iter(kv_chunks)
    except TypeError:
        raise TypeError("kv_chunks must be an iterable of (k_chunk, v_chunk) pairs, got "
                        f"{type(kv_chunks).__name__}") from None
    state = None
    position = 0  # absolute position of the next key
    v_max, v_exp = 0.0, 0  # values near the range are summed / 2**v_exp (`problem.value_exponent`)
    for t, chunk in enumerate(kv_chunks):
        if not (isinstance(chunk, (tuple, list)) and len(chunk) == 2):
            raise ValueError(f"kv_chunks[{t}] must be a (k_chunk, v_chunk) pair")
        q5, k5, v5, pb, _ = xp.parse(q_arr, chunk[0], chunk[1], scale, False)
        if check_finite:
            maxima = (q_max, xp.checked_max(k5, f"k of kv_chunks[{t}]"),
                      xp.checked_max(v5, f"v of kv_chunks[{t}]"))
            pb = replace(pb, maxima=maxima)  # one pass over each chunk: its check gave its maxima
        if state is None:
            slopes = xp.from_host(problem.alibi_slopes(alibi_slopes, pb))  # (..., hk, g)
            sink = problem.sinks(sinks, pb)  # (..., hk, g): each row starts from its head's sink
            sink = None if sink is None else xp.from_host(sink[..., None])
            state_class = hooks.get("state")  # the step "state" (`attnlib.core.hooks`): OnlineSoftmax
            state = [state_class.empty(tuple(q5.shape[:-2]) + (rows,), pb.dv, keys_first=xp.keys_first_for(rows),
                                       sink=sink, **({} if xp is NUMPY else {"xp": xp}))
                     for rows in (min(pb.sq, q0 + tiles.block_q) - q0 for q0 in range(0, pb.sq, tiles.block_q))]
            first = pb
        elif (pb.batch, pb.hk, pb.dv) != (first.batch, first.hk, first.dv):
            raise ValueError(
                f"kv_chunks[{t}] has shape k {tuple(np.shape(chunk[0]))}, v {tuple(np.shape(chunk[1]))}, "
                "unlike the first chunk")
        end = position + pb.sk
        if total_keys is not None and end > total_keys:
            raise ValueError(f"the chunks hold more than total_keys={total_keys} keys")
        spec = MaskSpec(pb.sq, total_keys if total_keys is not None else end, causal,
                        causal_align, win, chunk=opts.attention_chunk,
                        sink_tokens=sink_tokens(opts.sink_token_length, win))
        check = problem.scores_may_overflow(q5, k5, pb.scale, q_max=pb.max_of("q", q5),
                                            k_max=pb.max_of("k", k5)) if pb.sq and pb.sk else False
        v_max = max(v_max, pb.max_of("v", v5))
        grown = problem.value_exponent(v_max, end) - v_exp
        if grown:  # what the states hold so far, divided by the new power of two (exact)
            for st in state:
                st.acc *= 2.0 ** -grown
            v_exp += grown
        k0s = np.arange(position, end, tiles.block_k)
        k1s = np.minimum(k0s + tiles.block_k, end)

        def query_tile(a, spec=spec, k0s=k0s, k1s=k1s, k5=k5, v5=v5, position=position, check=check,
                       v_scale=2.0 ** -v_exp):
            xp.worker_start()
            q0 = a * tiles.block_q
            q1 = min(pb.sq, q0 + tiles.block_q)
            kinds = spec.tile_kind(q0, q1, k0s, k1s)  # (n_k_tiles of the chunk,)
            todo = np.flatnonzero(kinds != SKIP)
            if todo.size:
                with xp.ignore_overflow(check):
                    q_i = xp.operand(q5[..., q0:q1, :]) * pb.scale  # (..., bq, d)
                hooks.get("absorb")(state[a], q_i, k5, v5, spec, q0, k0s[todo], k1s[todo], kinds[todo],
                                    cap, slopes, key_offset=position, check=check, v_scale=v_scale)

        # Each query tile's state is its own: threads take them in any order, bit-identically.
        run_tiles(query_tile, range(len(state) - 1, -1, -1), workers)
        xp.finish()  # a device's errors in this chunk, raised once
        position = end
    if state is None:
        raise ValueError("kv_chunks is empty: give at least one (k_chunk, v_chunk), "
                         "possibly with 0 keys")
    if total_keys is not None and position != total_keys:
        raise ValueError(f"the chunks hold {position} keys, but total_keys={total_keys}")
    finals = [(problem.unscale_values(o, v_exp, v_max), lse) for o, lse in (s.finalize() for s in state)]
    out = xp.concat([f[0] for f in finals], -2) if finals else xp.zeros(tuple(q5.shape[:-2]) + (0, first.dv))
    lse = xp.concat([f[1] for f in finals], -1) if finals else xp.zeros(tuple(q5.shape[:-2]) + (0,))
    out = first.merge_heads(out, 2)
    return out, first.merge_heads(lse, 1)
