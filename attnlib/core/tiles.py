"""One query tile against its key tiles: the scores in the contract's order and the online
softmax's update, shared by the forward, the stream, the paged cache and the backward.
"""

from __future__ import annotations

import math

import numpy as np

from . import problem, hooks
from .backend import KEYS_FIRST_MIN_ROWS, NUMPY  # noqa: F401  (KEYS_FIRST_MIN_ROWS: read from here too)
from .masks import PARTIAL, SKIP
from .online import OnlineSoftmax  # the state absorb updates (its import declares the "state" step)


def keys_first_for(rows: int) -> bool:
    """Whether the host's tile of ``rows`` query rows is laid out keys first
    (`backend.Numpy.keys_first_for`)."""
    return NUMPY.keys_first_for(rows)


def absorb(state: OnlineSoftmax, q_i, k, v, spec, q0, k0s, k1s, kinds, cap=None, slopes=None, *,
           key_offset=0, count=False, threshold=0.0, prec=None, scale=None, buffers=None,
           check=False, rows=None, row_groups=1, mods=None, v_scale=1.0, maxes=None):
    """Feed the key tiles ``[k0s[t], k1s[t])`` (ascending, none SKIP) into one query tile.

    ``q_i: (..., bq, d)`` is the scaled query tile starting at row ``q0``; ``k, v`` hold
    the keys from absolute position ``key_offset`` on (0, or a streamed chunk's start);
    ``kinds`` says which tiles are PARTIAL.  Scores follow the contract's order: softcap,
    mask (``-inf``), ALiBi.  ``threshold`` is the lazy-rescale threshold of
    `OnlineSoftmax.update`.  With a low precision ``prec`` (`problem.Precision`), ``q_i``
    is rounded but unscaled, k and v are rounded per tile, ``scale`` multiplies the
    float32 scores and ``p`` is rounded before ``p @ v``.  ``buffers``, a dict the caller
    keeps (one per thread), lets the score and ``p @ v`` buffers be reused from one query
    tile to the next.  ``check`` has each tile's scores checked for overflow (see
    `tile_scores`).  ``rows``: the absolute positions of the tile's rows (default
    ``q0, q0 + 1, ...``); a GQA-packed tile repeats them once per head, and
    ``row_groups`` (its head count) splits the rescale events per head.  Returns the
    rescale events per tile ``(..., n_tiles)`` (``(..., row_groups, n_tiles)`` when
    packed) when ``count``, else None.  ``mods``: the `attnlib.core.flex.Mods` of the tile's
    heads (``mask_mod`` joins the PARTIAL tiles' visibility, ``score_mod`` every tile's scores).
    ``v_scale``: a power of two the values are multiplied by (`problem.value_exponent`).
    ``maxes``, laid out as ``state.m``: raised in place to each row's largest visible score
    (``max_scores``; the running max is no substitute, being lazy and sink-initialised).
    The masks and scores are the steps ``"tile_visible"`` and ``"tile_scores"`` of
    `attnlib.core.hooks`, and so is the split of a packed-documents tile into document
    blocks, ``"document_blocks"``; callers reach this function as its step ``"absorb"``.
    The arrays are ``state.xp``'s (`attnlib.core.backend`): numpy's, or torch tensors on a
    device; the positions and masks are worked out on the host.
    """
    xp = state.xp
    contiguous = rows is None  # a packed tile's rows repeat per head
    rows = np.arange(q0, q0 + q_i.shape[-2]) if rows is None else rows
    keys_first = xp.keys_first_for(q_i.shape[-2])
    groups = (row_groups,) if row_groups > 1 else ()
    events = xp.zeros(tuple(state.m.shape[:-1]) + groups + (len(k0s),), dtype=np.int64) if count else None
    low = prec is not None and not prec.is_float64
    round_p = (lambda p: xp.rounded_p(p, prec)) if low else None
    on_device = {} if xp is NUMPY else {"xp": xp}  # the steps' replacements of old take no xp on the host
    # The declared steps (`attnlib.core.hooks`), looked up once per query tile.
    tile_visible, scores_of = hooks.get("tile_visible"), hooks.get("tile_scores")
    split_documents = hooks.get("document_blocks")
    # One score and one p @ v buffer per tile shape, reused tile after tile, and the band
    # masks of the PARTIAL tiles (`MaskSpec.tile_visible`).
    buffers = {} if buffers is None else buffers
    band_masks = buffers.setdefault("band masks", {})
    for t, (k0, k1) in enumerate(zip(k0s, k1s)):
        a, b = k0 - key_offset, k1 - key_offset  # positions in the arrays
        if low:
            k_j, v_j = xp.rounded(k[..., a:b, :], prec), xp.rounded(v[..., a:b, :], prec)
        else:
            k_j, v_j = xp.operand(k[..., a:b, :]), xp.operand(v[..., a:b, :])  # (..., bk, d), (..., bk, dv)
        if v_scale != 1.0:  # exact: a power of two
            v_j = v_j * v_scale
        acc_shape = tuple(state.acc.shape)
        shape = (acc_shape, b - a, state.acc.dtype)
        if shape not in buffers:
            lead = np.broadcast_shapes(tuple(q_i.shape[:-2]), tuple(k_j.shape[:-2]))
            tile = (b - a, q_i.shape[-2]) if keys_first else (q_i.shape[-2], b - a)
            pv = acc_shape[:-2] + (acc_shape[:-3:-1] if keys_first else acc_shape[-2:])
            buffers[shape] = (xp.empty(lead + tile, dtype=state.acc.dtype),
                              xp.empty(pv, dtype=state.acc.dtype))  # (..., dv, bq) keys first
        s_buf, pv_buf = buffers[shape]
        # A PARTIAL tile of packed documents may be computed one document block at a time
        # (`document_blocks`): each block's rows of the state absorb its keys under the other
        # rules, and pairs of two documents are never formed; else the tile is its one block.
        split = (split_documents(spec, q0, q_i.shape[-2], k0, k1)
                 if kinds[t] == PARTIAL and contiguous and mods is None else None)
        whole = split is None
        if whole:
            parts = [(spec, kinds[t], 0, q_i.shape[-2], 0, b - a)]
        else:
            sub = spec.without_documents
            parts = [(sub, kind, r0, r1, c0, c1) for r0, r1, c0, c1 in split
                     if (kind := sub.tile_kind(q0 + r0, q0 + r1, k0 + c0, k0 + c1)) != SKIP]
            rescaled = xp.zeros(tuple(state.m.shape), dtype=bool) if count else None
        for part_spec, kind, r0, r1, c0, c1 in parts:
            # A block keeps the tile's layout (keys_first), in which the state's acc is laid out.
            st = state if whole else state.rows(r0, r1)
            rows_b, j0, j1 = (rows, k0, k1) if whole else (rows[r0:r1], k0 + c0, k0 + c1)
            vis = (tile_visible(part_spec, rows_b, j0, j1, keys_first, contiguous=contiguous, cache=band_masks)
                   if kind == PARTIAL else None)  # laid out as s, worked out on the host
            vis = None if vis is None else xp.mask(vis)
            if mods is not None and kind == PARTIAL:  # AND mask_mod: (..., tile), per head
                vis = mods.visible(vis, rows_b, np.arange(j0, j1), keys_first, xp)
            # The block's views on the start of the tile's buffers (a whole tile's: the buffers).
            tile = (c1 - c0, r1 - r0) if keys_first else (r1 - r0, c1 - c0)
            s_b = _prefix(s_buf, s_buf.shape[:-2] + tile)
            pv_b = _prefix(pv_buf, pv_buf.shape[:-2] + ((pv_buf.shape[-2], r1 - r0) if keys_first
                                                        else (r1 - r0, pv_buf.shape[-1])))
            # Keys first: s = k_j q_i^T, (..., bk, bq) (see keys_first_for).
            # A whole tile's operands as they are (a tensor's slicing costs microseconds of Python).
            q_b, k_b, v_b = (q_i, k_j, v_j) if whole else (q_i[..., r0:r1, :], k_j[..., c0:c1, :],
                                                            v_j[..., c0:c1, :])
            s, _ = scores_of(q_b, k_b, part_spec, rows_b, np.arange(j0, j1), kind, cap, slopes, out=s_b,
                             post_scale=scale if low else None, check=check, keys_first=keys_first,
                             vis=vis, mods=mods, **on_device)
            if maxes is not None:  # before update, which overwrites s; masked pairs are -inf
                mx = maxes if whole else maxes[..., r0:r1]
                xp.maximum(mx, xp.amax(s, -2 if keys_first else -1), out=mx)
            moved = st.update(s, v_b, threshold=threshold, overwrite_s=True,
                              pv=pv_b, round_p=round_p, keys_first=keys_first, visible=vis, count=count)  # s now holds p
            if whole:
                rescaled = moved
            else:
                state.put_rows(r0, r1, st)
                if count:
                    rescaled[..., r0:r1] = moved
        if count:  # per head: a packed tile's rows are row_groups heads' rows
            events[..., t] = rescaled.reshape(tuple(rescaled.shape[:-1]) + groups + (-1,)).sum(-1)
    return events


#: A PARTIAL tile of packed documents is computed block by block when that forms more than
#: this many fewer score pairs per block than the whole tile (else whole, masked): a block
#: costs about 230 us of numpy calls beside its pairs' (measured at 256 x 256, D = 64, 2 workers:
#: causal documents of 32 keys 0.033 s whole, 0.062 s by blocks; 16 random documents at
#: n = 16384 0.166 s whole, 0.144 s by blocks).
DOCUMENT_BLOCK_PAIRS = 16384


def document_blocks(spec, q0, rows, k0, k1):
    """The document blocks (`MaskSpec.document_blocks`) of queries ``[q0, q0 + rows)`` against
    keys ``[k0, k1)`` worth computing apart, or None: the tile is then computed whole."""
    if spec.q_segments is None:
        return None
    blocks = spec.document_blocks(np.arange(q0, q0 + rows), np.arange(k0, k1))
    if blocks is None:
        return None
    saved = rows * (k1 - k0) - sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in blocks)
    return blocks if saved > DOCUMENT_BLOCK_PAIRS * len(blocks) else None


def _prefix(buf, shape):
    """A C-contiguous ``shape`` view on the start of the contiguous buffer ``buf``."""
    if tuple(buf.shape) == tuple(shape):  # a whole tile: the buffer itself
        return buf
    return buf.reshape(-1)[:math.prod(shape)].reshape(shape)


def tile_scores(q_i, k_j, spec, rows, cols, kind, cap=None, slopes=None, keep_tanh=False, out=None,
                post_scale=None, check=False, keys_first=False, vis=None, mods=None, mod_grad=None, xp=NUMPY):
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
    only when `problem.scores_may_overflow` says it may be, so the usual tile pays nothing).
    ``vis``: a PARTIAL tile's visibility laid out as ``s``, if the caller has it
    (`MaskSpec.tile_visible`); else it is evaluated here.  ``mods`` (`attnlib.core.flex.Mods`):
    its ``score_mod`` modifies the scores after the softcap, before the mask (``vis`` then
    already holds its ``mask_mod``); ``mod_grad``, a list, receives
    ``score_mod_grad(score, b, h, q_idx, kv_idx)`` of the pre-modification scores for the
    backward pass (``mod_grad[0]`` is that function on entry).  ``xp``: the arrays' backend
    (`attnlib.core.backend`); ``vis`` is then its array.
    """
    # An overflow (only possible when `check` is asked for) is reported below.
    with xp.ignore_overflow(check):
        if keys_first:
            s = xp.matmul(k_j, xp.swapaxes(q_i, -1, -2), out=out)  # (..., bk, bq)
        else:
            s = xp.matmul(q_i, xp.swapaxes(k_j, -1, -2), out=out)  # (..., bq, bk)
        if post_scale is not None:
            s = xp.scale_(s, post_scale)
    if kind == PARTIAL and vis is None:
        vis = xp.mask(spec.visible(rows, cols, keys_first))
    if check:
        # Only a visible pair's score is used; an invisible one is set to 0 (masked below),
        # which keeps softcap's tanh and its derivative finite.
        bad = ~xp.isfinite(s)
        xp.refuse(bad if kind != PARTIAL else bad & vis, _overflowed, *_corner(rows, cols), s.dtype)
        s = xp.fill_(s, bad, 0.0)
    th = None
    if cap is not None:  # softcap, before masking
        with xp.overflow_ok():  # s / cap beyond the range: tanh(+-inf) = +-1, exact
            s /= cap
        s = xp.tanh_(s)
        th = xp.copy(s) if keep_tanh else None
        s *= cap
    if mods is not None and mods.score_mod is not None:  # score_mod: after the softcap, before masks
        if mod_grad is not None:
            mod_grad.append(mods.scores(mod_grad[0], s, rows, cols, keys_first, xp, "score_mod_grad"))
        s[...] = mods.scores(mods.score_mod, s, rows, cols, keys_first, xp)
        # A visible pair's modified score must be a number or -inf (FlexAttention's way to
        # mask from a score_mod); NaN or +inf would make the softmax undefined.  A hidden
        # pair's is masked: set to 0 first, so that no NaN outlives the mask.
        bad = xp.isnan(s) | xp.isposinf(s)
        xp.refuse(bad if kind != PARTIAL else bad & vis, _score_mod_bad, *_corner(rows, cols), keys_first)
        s = xp.fill_(s, bad, 0.0)
    if kind == PARTIAL:
        s = xp.hide_(s, vis)  # -inf where not visible
    if slopes is not None:  # ALiBi, after masking: -inf stays -inf
        # A bias on a score near -max may overflow it (only where `check` is asked for: else
        # |s| < max / 16 and the bias < max / 4): a visible score beyond the range, refused.
        finite = xp.isfinite(s) if check else None
        with xp.ignore_overflow(check):
            s -= slopes[..., None, None] * xp.distance(spec, rows, cols, keys_first)
        if check:
            xp.refuse(finite & ~xp.isfinite(s), _overflowed, *_corner(rows, cols), s.dtype)
    return s, th


def _corner(rows, cols):
    """The tile's first query and key positions (0 for none), for its errors."""
    return tuple(int(np.ravel(x)[0]) if x is not None and np.size(x) else 0 for x in (rows, cols))


def _overflowed(bad, q0, k0, dtype):
    return problem.overflow_message(np.dtype(str(dtype).removeprefix("torch.")))


def _score_mod_bad(bad, q0, k0, keys_first):
    if bad is None:  # gathered on a device: the tile
        where = f"queries from {q0}, keys from {k0}"
    else:
        where = f"query {q0 + int(np.argwhere(bad)[0][-1 if keys_first else -2])}"
    return f"score_mod returned NaN or +inf for a visible pair ({where}); it must return finite scores, or -inf to mask"


# The steps this module defines, replaceable through `hooks` (see there).
hooks.declare("tile_scores", tile_scores)
hooks.declare("absorb", absorb)
hooks.declare("document_blocks", document_blocks)
