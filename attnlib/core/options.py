"""One call's arguments, checked and bound once: the object the kernels read.

Every entry point (the forward, stream, paged, varlen, backward, the references, the
distributed oracle, the check and the gate) keeps its keyword arguments (FlashAttention's
and PyTorch's spirit) and binds them on entry: the masking and score options into one
`Options` (`Options.of` picks them out of the entry's arguments), handed on to `mask_specs`
through `Options.specs`, to the per-head terms through `Options.score_terms`, to the
programmable masks through `Options.mods`, and to another entry point through
`Options.given`; the forward's whole call, the options with the precision, the outputs and
how it runs, into one `Call` (`Call.bind`).  Adding an option is one field here, its check
in `Options.parse`, and the kernels that read it.

What can be checked without the problem's shapes is checked in `parse` (types, ranges,
callables, a FlexAttention block mask converted); what needs them (lengths against the
batch, slopes and sinks against the heads) when the options meet a `problem.Problem`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Callable

import numpy as np

from . import flex, lse_conventions, problem, validate
from .masks import mask_specs
from .tilesizes import TileSizes

#: The fields by what they shape: the mask, the scores, FlexAttention's mods, a paged cache.
MASKING = ("causal", "causal_align", "window", "q_lengths", "kv_lengths", "q_segment_ids",
           "kv_segment_ids", "key_leftpad", "attention_chunk", "sink_token_length")
SCORES = ("softcap", "alibi_slopes", "sinks", "scale")
MODS = ("mask_mod", "score_mod", "block_mask")
SPARSE = ("gather_kv_indices",)
PAGING = ("block_table", "cache_seqlens")


@dataclass(frozen=True, eq=False)
class Options:
    """The masking and score options of `docs/semantics.md`, checked.

    The fields are `attnlib.attention`'s keyword arguments of the same names; ``window``
    is held as ``(left, right)`` (None: that side unbounded), ``softcap`` as a positive
    float or None, ``block_mask`` as an attnlib `flex.BlockMask` (FlexAttention's
    converted).  Arrays (lengths, segment ids, slopes, sinks, page tables) are held as
    given, never copied or written.
    """

    causal: bool = False
    causal_align: str = "bottom_right"
    window: tuple = (None, None)
    q_lengths: Any = None
    kv_lengths: Any = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    key_leftpad: Any = None
    attention_chunk: int | None = None
    sink_token_length: int = 0
    softcap: float | None = None
    alibi_slopes: Any = None
    sinks: Any = None
    scale: float | None = None
    mask_mod: Callable | None = None
    score_mod: Callable | None = None
    block_mask: Any = None
    block_table: Any = None
    cache_seqlens: Any = None
    gather_kv_indices: Any = None

    @classmethod
    def parse(cls, options: "Options | None" = None, /, **given) -> "Options":
        """The checked options of ``given`` (keyword arguments named as the fields), on top
        of ``options`` when given.  A name that is not a field is a ``TypeError`` naming it;
        a value of the wrong kind a ``TypeError``, of the right kind but out of range a
        ``ValueError``, each naming the argument."""
        names = _names()
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; accepted: {', '.join(names)}")
        if options is not None:
            if not isinstance(options, Options):
                raise TypeError(f"options must be an attnlib Options, got {type(options).__name__}")
            if not given:  # already checked: the same object, not parsed again
                return options
            given = {**options.given(), **given}
        scale = given.get("scale")
        if scale is not None:
            if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
                raise TypeError(f"scale must be a real number or None, got {scale!r}")
            if not math.isfinite(scale):
                raise ValueError(f"scale must be finite, got {scale!r}")
            scale = float(scale)
        if given.get("gather_kv_indices") is not None:
            mods = sorted(n for n in ("mask_mod", "block_mask") if given.get(n) is not None)
            if mods:
                raise ValueError(f"gather_kv_indices cannot be combined with {' or '.join(mods)}: "
                                 "AND the mask into the index lists (-1 drops an entry)")
        paging = [given.get(n) is not None for n in PAGING]
        if any(paging) and not all(paging):
            raise ValueError("a paged KV cache needs both block_table and cache_seqlens")
        return cls(
            causal=validate.flag(given.get("causal", False), "causal"),
            causal_align=validate.causal_align(given.get("causal_align", "bottom_right")),
            window=validate.window(given.get("window")),
            q_lengths=given.get("q_lengths"), kv_lengths=given.get("kv_lengths"),
            q_segment_ids=given.get("q_segment_ids"), kv_segment_ids=given.get("kv_segment_ids"),
            key_leftpad=given.get("key_leftpad"),
            attention_chunk=validate.chunk(given.get("attention_chunk")),
            sink_token_length=validate.count(given.get("sink_token_length", 0), "sink_token_length"),
            softcap=validate.softcap(given.get("softcap")),
            alibi_slopes=given.get("alibi_slopes"), sinks=given.get("sinks"), scale=scale,
            mask_mod=_callable(given.get("mask_mod"), "mask_mod"),
            score_mod=_callable(given.get("score_mod"), "score_mod"),
            block_mask=flex.as_block_mask(given.get("block_mask")),
            block_table=given.get("block_table"), cache_seqlens=given.get("cache_seqlens"),
            gather_kv_indices=given.get("gather_kv_indices"),
        )

    @classmethod
    def of(cls, arguments: dict, /, **given) -> "Options":
        """The checked options among an entry point's ``arguments`` (its parameters by name, as
        ``locals()`` holds them on entry), with ``given`` on top; other names are left out."""
        return cls.parse(**{**{n: arguments[n] for n in _names() if n in arguments}, **given})

    @classmethod
    def split(cls, options: "Options | None" = None, /, *, entry: str | None = None, accept=None,
              **given) -> tuple:
        """``(Options.parse(options, **the fields among given), the rest of given)``: for an
        entry point whose keyword arguments mix the options with its own.  With ``accept``
        (the names it takes besides the options), any other name is a ``TypeError`` naming
        it and ``entry``, the function the caller called."""
        names = set(_names())
        rest = {n: v for n, v in given.items() if n not in names}
        unknown = sorted(set(rest) - set(accept)) if accept is not None else []
        if unknown:
            raise TypeError(f"{entry or 'this function'}() got unexpected keyword argument(s) {unknown}; "
                            f"it takes the options {', '.join(_names())} and {', '.join(accept)}")
        opts = cls.parse(options, **{n: v for n, v in given.items() if n in names})
        return opts, rest

    def given(self, *groups) -> dict:
        """The options that differ from the defaults, as keyword arguments (of the fields of
        ``groups``, e.g. ``MASKING``, when named): what another entry point is called with."""
        names = [n for g in groups for n in g] if groups else _names()
        return {n: getattr(self, n) for n in names if not _is_default(n, getattr(self, n))}

    def replace(self, **changes) -> "Options":
        """These options with ``changes`` (checked like `parse`)."""
        return Options.parse(self, **changes)

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def has_mods(self) -> bool:
        """Whether the tiles carry a programmable mask: FlexAttention's, or top-k lists."""
        return any(getattr(self, n) is not None for n in MODS + SPARSE)

    def selection(self, pb: "problem.Problem"):
        """The top-k lists (`sparse.Selection`) of ``gather_kv_indices`` for ``pb``, or None;
        parsed once per problem shape."""
        if self.gather_kv_indices is None:
            return None
        from .sparse import Selection
        key = (pb.batch, pb.hq, pb.hk, pb.sq, pb.sk)
        cache = self.__dict__.setdefault("_selections", {})  # frozen: a cache, not a field
        if key not in cache:
            cache.clear()
            cache[key] = Selection.parse(self.gather_kv_indices, pb)
        return cache[key]

    def specs(self, pb: "problem.Problem") -> dict:
        """``{batch index: MaskSpec}`` for the problem (`masks.mask_specs`)."""
        return mask_specs(pb.batch, pb.sq, pb.sk, **self.given(MASKING))

    def score_terms(self, pb: "problem.Problem", prec: "problem.Precision | None" = None,
                    kernel: str = "float64"):
        """``(cap, slopes, sink)`` for the problem in the type the scores are kept in:
        the softcap, and the ALiBi slopes and sinks grouped like q's heads ``(..., hk, g)``
        (None where not given)."""
        dtype = np.float64 if prec is None else prec.accumulate
        cap = problem.softcap_in(self.softcap, dtype, kernel if prec is None else prec.name)
        return (cap, problem.alibi_slopes(self.alibi_slopes, pb, dtype),
                problem.sinks(self.sinks, pb, dtype))

    def tiles_for(self, base, block_q=None, block_k=None):
        """The tile sizes: ``block_q``/``block_k`` when given, else the block mask's, else
        ``base`` (a `tilesizes.TileSizes`)."""
        if self.block_mask is not None:  # its tiles, unless asked otherwise
            base = TileSizes(self.block_mask.block_q, self.block_mask.block_k)
        return TileSizes(base.block_q if block_q is None else validate.positive_int(block_q, "block_q"),
                         base.block_k if block_k is None else validate.positive_int(block_k, "block_k"))

    def mods(self, pb: "problem.Problem", tiles):
        """`flex.mods_for` of the programmable options: None without any.  Top-k lists
        become a block mask over ``tiles`` whose ``mask_mod`` is their `sparse.Selection`."""
        sel = self.selection(pb)
        block_mask = self.block_mask if sel is None else sel.block_mask(pb, tiles)
        return flex.mods_for(self.mask_mod, self.score_mod, block_mask, pb, pb.sq, pb.sk, tiles)


@dataclass(frozen=True, eq=False)
class Call:
    """One forward call of `attnlib.attention` (or a reference), bound: its `Options`, the
    precision it computes in, what it returns (in which LSE convention) and how it runs.
    Every field is checked by `bind`; the kernels read them as they are."""

    options: Options
    precision: problem.Precision
    return_lse: bool = False
    return_max_scores: bool = False
    return_stats: bool = False
    convention: "lse_conventions.LseConvention | None" = None  # None: attnlib's own
    block_q: int | None = None  # None: the backend's tiles (or the block mask's)
    block_k: int | None = None
    kv_splits: int = 1
    workers: int | None = None  # None: the backend's default
    rescale_threshold: float = 0.0
    check_finite: bool = True
    device: Any = None  # as given: resolved with the inputs (`device.resolve`)
    #: The online-softmax state class of the tiled forward, None: the declared step "state"
    #: (`attnlib.core.hooks`).  Not an argument: set by the check for its sizes
    #: (`attnlib.check.sizes.SizedSoftmax`), with ``dataclasses.replace``.
    state: Any = None

    @classmethod
    def bind(cls, arguments: dict | None = None, /, *, options: Options | None = None, **given) -> "Call":
        """The checked call of an entry point's ``arguments`` (``locals()`` on entry) with
        ``given`` on top: the options among them (on top of ``options``), ``compute_dtype`` (and
        ``intermediate_dtype``),
        ``return_lse``/``return_max_scores``/``return_stats``, ``lse_base``/``lse_sink``/
        ``lse_empty``, ``block_q``/``block_k``, ``kv_splits``, ``workers``,
        ``rescale_threshold``, ``check_finite`` and ``device``; other names are left out.
        Each bad value is a ``TypeError`` or ``ValueError`` naming its argument."""
        unknown = sorted(set(given) - set(_names()) - set(_CALL_ARGUMENTS))
        if unknown:  # a keyword given by name must be one the call reads (a misspelling is no default)
            raise TypeError(f"unexpected keyword argument(s) {unknown}; a call takes the options and "
                            f"{', '.join(_CALL_ARGUMENTS)}")
        a = {**(arguments or {}), **given}
        opts = Options.parse(options, **{n: a[n] for n in _names() if n in a})
        lse, most, stats = (validate.flag(a.get(n, False), n) for n in
                            ("return_lse", "return_max_scores", "return_stats"))
        tiles = {n: None if a.get(n) is None else validate.positive_int(a[n], n) for n in ("block_q", "block_k")}
        return cls(opts, problem.precision(a.get("compute_dtype"), a.get("intermediate_dtype")), lse, most, stats,
                   lse_conventions.parse_for_output(a.get("lse_base"), a.get("lse_sink"), a.get("lse_empty"),
                                                    lse, most),
                   **tiles, kv_splits=validate.positive_int(a.get("kv_splits", 1), "kv_splits"),
                   workers=None if a.get("workers") is None else validate.workers(a["workers"]),
                   rescale_threshold=validate.threshold(a.get("rescale_threshold", 0.0)),
                   check_finite=a.get("check_finite", True), device=a.get("device"))


#: What `Call.bind` reads besides the options.
_CALL_ARGUMENTS = ("compute_dtype", "intermediate_dtype", "return_lse", "return_max_scores", "return_stats", "lse_base", "lse_sink",
                   "lse_empty", "block_q", "block_k", "kv_splits", "workers", "rescale_threshold", "check_finite",
                   "device")


def _callable(fn, name):
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be callable as FlexAttention's, got {type(fn).__name__}")
    return fn


def _is_default(name, value) -> bool:
    default = _DEFAULTS[name]
    return value is None if default is None else value == default  # arrays: default None


def _names() -> tuple:
    return tuple(f.name for f in fields(Options))


_DEFAULTS = {f.name: f.default for f in fields(Options)}

__all__ = ["Call", "Options", "MASKING", "SCORES", "MODS", "PAGING", "SPARSE"]
