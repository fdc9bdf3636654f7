"""Several KV sources in one softmax (`docs/semantics.md`, "Several KV sources"): a sliding
window of the cache, a compressed cache, top-k selected keys, each with its own keys, values and
mask, under one softmax with the sinks (DeepSeek-V4-style kernels).

Each source is a `Source`: its ``k``, ``v`` and the mask options `attention` takes for ``(q, k,
v)`` alone.  The forward is each source's tiled attention (the sinks with the first), merged
(`merge_attention`: one softmax over the union of their keys); the backward each source's with
the merged ``out`` and ``lse``, whose weights are the shared softmax's.  `join_sources` gives the
same problem as one: the keys concatenated and one ``mask_mod`` that reads each source's mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import problem
from .arrays import as_numpy
from .flex import mask_values
from .options import MASKING, SPARSE, Options

#: The options a source is seen under: its mask (the rest, scale, softcap and sinks, are shared).
SOURCE_OPTIONS = MASKING + SPARSE + ("mask_mod",)


@dataclass(frozen=True)
class Source:
    """One KV source: ``k (..., Hk, Sk_s, D)``, ``v (..., Hk, Sk_s, Dv)`` (the layout of
    `attention`) and the mask options it is seen under (`SOURCE_OPTIONS`: ``causal``,
    ``window``, ``kv_lengths``, ``gather_kv_indices``, ``mask_mod``, ... as `attention` takes them
    for ``(q, k, v)`` alone, its positions its own); ``name`` says which it is in messages."""

    k: object = field(repr=False)
    v: object = field(repr=False)
    name: str = ""
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.options) - set(SOURCE_OPTIONS))
        if unknown:
            raise TypeError(f"source {self.label}: {', '.join(unknown)} is no source option (a source takes "
                            f"its mask: {', '.join(SOURCE_OPTIONS)}; scale, softcap and sinks are the call's)")

    @property
    def label(self) -> str:
        return repr(self.name) if self.name else "(unnamed)"


def source(k, v, name: str = "", **mask_options) -> Source:
    """``Source(k, v, name, mask_options)``."""
    return Source(k, v, name, dict(mask_options))


def _sources(sources) -> list:
    found = list(sources)
    if not found:
        raise ValueError("sources must hold at least one Source")
    for n, s in enumerate(found):
        if not isinstance(s, Source):
            raise TypeError(f"sources[{n}] must be an attnlib Source (attnlib.source(k, v, **mask)), got "
                            f"{type(s).__name__}")
    return found


def attention_sources(q, sources, *, scale=None, softcap=None, sinks=None, return_lse=False, block_q=None,
                      block_k=None, workers=None, check_finite=True, device=None):
    """Attention of ``q`` over several KV sources in one softmax: ``out`` (and ``lse``).

    Each source's attention (`attention` with its mask options, the sinks with the first source),
    merged by `merge_attention`: ``lse = log sum_s exp(lse_s)``, ``out = sum_s exp(lse_s - lse)
    out_s``, equal to attention over the sources' keys concatenated with each key under its
    source's mask (`join_sources`).  ``scale`` defaults to ``1 / sqrt(D)``, shared."""
    from .online import merge_attention
    from .tiled import attention

    parts = [attention(q, s.k, s.v, scale=scale, softcap=softcap, sinks=sinks if n == 0 else None, return_lse=True,
                       block_q=block_q, block_k=block_k, workers=workers, check_finite=check_finite, device=device,
                       **s.options) for n, s in enumerate(_sources(sources))]
    out, lse = merge_attention([p[0] for p in parts], [p[1] for p in parts], device=device)
    return (out, lse) if return_lse else out


def attention_sources_backward(q, sources, out, lse, dout, *, dlse=None, scale=None, softcap=None, sinks=None,
                               block_q=None, block_k=None, workers=None, check_finite=True, device=None):
    """Gradients of `attention_sources`: ``(dq, dks, dvs)`` (``dks``, ``dvs`` lists, one per
    source) and ``dsinks`` last with sinks.  ``out`` and ``lse`` are the merged ones (their
    weights ``exp(s - lse)`` are the shared softmax's); ``dlse`` as in `attention_backward`."""
    from .backward import attention_backward

    grads = [attention_backward(q, s.k, s.v, out, lse, dout, dlse=dlse, scale=scale, softcap=softcap,
                                sinks=sinks if n == 0 else None, block_q=block_q, block_k=block_k, workers=workers,
                                check_finite=check_finite, device=device, **s.options)
             for n, s in enumerate(_sources(sources))]
    dq = grads[0][0]
    for g in grads[1:]:
        dq = dq + g[0]
    result = (dq, [g[1] for g in grads], [g[2] for g in grads])
    return result + ((grads[0][3],) if sinks is not None else ())


def join_sources(q, sources, seq_axis: int = -2):
    """The sources as one problem: ``(k, v, mask_mod)``, the keys and values concatenated along
    ``seq_axis`` (-2: `attention`'s layout; -3 for bshd) in order, and one ``mask_mod`` under
    which key ``j`` of source ``s`` (at ``j - offset_s``) is visible where its source's mask says.
    The ``mask_mod`` carries the neighbouring problems a wrong kernel computes (a source left
    out, or its mask ignored) for the check's diagnosis (``_attnlib_neighbours``)."""
    found = _sources(sources)
    qn = np.asarray(as_numpy(q, "q"))
    ks = [np.asarray(as_numpy(s.k, f"source {s.label}'s k")) for s in found]
    vs = [np.asarray(as_numpy(s.v, f"source {s.label}'s v")) for s in found]
    lengths = [np.shape(k)[seq_axis] for k in ks]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    to_bhsd = (lambda x: np.swapaxes(np.asarray(x), -2, -3)) if seq_axis == -3 else np.asarray
    mods = [_visible_mod(to_bhsd(qn), to_bhsd(k), to_bhsd(v), s.options)
            for k, v, s in zip(ks, vs, found)]

    def joined_with(which):  # the joined mask with source n's mask replaced by which[n] (None: its own)
        def mask_mod(b, h, q_idx, kv_idx):
            kv_idx = np.asarray(kv_idx)
            shape = np.broadcast_shapes(np.shape(b), np.shape(h), np.shape(q_idx), kv_idx.shape)
            vis = np.zeros(shape, dtype=bool)
            for n, mod in enumerate(mods):
                at = (kv_idx >= offsets[n]) & (kv_idx < offsets[n + 1])
                if not at.any():
                    continue
                local = np.clip(kv_idx - offsets[n], 0, max(int(lengths[n]) - 1, 0))
                own = which.get(n, mod)
                seen = np.ones(shape, dtype=bool) if own is True else np.zeros(shape, dtype=bool) if own is False \
                    else np.broadcast_to(own(b, h, q_idx, local), shape)
                vis |= at & seen
            return vis
        return mask_mod

    joined = joined_with({})
    joined._attnlib_neighbours = [
        neighbour for n, s in enumerate(found) for neighbour in (
            (joined_with({n: False}), f"source {s.label} ({n + 1} of {len(found)}) left out"),
            (joined_with({n: True}), f"source {s.label}'s mask ignored (every key of it visible)"))]
    k, v = np.concatenate(ks, axis=seq_axis), np.concatenate(vs, axis=seq_axis)
    return k, v, joined


def _visible_mod(q, k, v, options: dict):
    """``mask_mod(b, h, q_idx, kv_idx)`` of one source's mask options, on its own key positions."""
    opts = Options.parse(**options)
    _, _, _, pb = problem.parse(q, k, v, scale=None, check_finite_inputs=False)
    specs = opts.specs(pb)
    entries = [specs[()]] if () in specs else [specs[idx] for idx in np.ndindex(pb.batch)]
    selection = opts.selection(pb)

    def visible(b, h, q_idx, kv_idx):
        shape = np.broadcast_shapes(np.shape(b), np.shape(h), np.shape(q_idx), np.shape(kv_idx))
        if len(entries) == 1:
            vis = np.broadcast_to(entries[0].visible_at(np.asarray(q_idx), np.asarray(kv_idx)), shape)
        else:  # a mask per batch entry (lengths): b is the entry's index in C order
            vis = np.zeros(shape, dtype=bool)
            for n, spec in enumerate(entries):
                vis = vis | ((np.asarray(b) == n) & spec.visible_at(np.asarray(q_idx), np.asarray(kv_idx)))
        if selection is not None:
            vis = vis & selection(b, h, q_idx, kv_idx)
        if opts.mask_mod is not None:
            vis = vis & mask_values(opts.mask_mod, b, h, q_idx, kv_idx, shape)
        return vis

    return visible


__all__ = ["Source", "source", "attention_sources", "attention_sources_backward", "join_sources", "SOURCE_OPTIONS"]
