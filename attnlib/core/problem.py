"""The checked problem of one call: its shapes, its precision and the per-head options.

`parse` checks q, k, v against the contract's layout once and returns grouped views and a
`Problem`; `Precision` is the type a kernel under test computes in.  The per-head score
options (ALiBi slopes, sinks, the softcap) are resolved against the problem here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import numpy as np

from .arrays import abs_max, as_float_array, check_finite, finfo


#: The contract's strict floating-point mode: a division by zero, an overflow or an invalid
#: operation (inf - inf, 0 / 0, ...) raises instead of leaving an inf or a NaN behind.
STRICT = dict(divide="raise", over="raise", invalid="raise")


def scores_may_overflow(q: np.ndarray, k: np.ndarray, scale: float, dtype=np.float64, *,
                        q_max=None, k_max=None) -> bool:
    """Whether some score ``scale * q_i . k_j`` might overflow ``dtype``, from an O(n) bound.

    ``|scale * q_i . k_j| <= D * max|q| * max|k| * |scale|``; the bound used,
    ``D * max|q| * max(1, max|k|) * max(1, |scale|)``, also covers ``scale * q`` and the
    unscaled product (low precisions scale after the matmul), with a margin of 16 for the
    order of the additions.  False means no score can overflow, so the kernels skip their
    per-tile check; True only means they make it (see `overflow_message`).  Inputs holding
    NaN or inf (passed with ``check_finite=False``) are not checked: their scores are
    non-finite by the caller's choice.  ``q_max``, ``k_max``: the maxima, if known
    (`Problem.max_of`).
    """
    if math.prod(q.shape) == 0 or math.prod(k.shape) == 0:
        return False
    q_max = abs_max(q) if q_max is None else q_max
    k_max = abs_max(k) if k_max is None else k_max
    if not (math.isfinite(q_max) and math.isfinite(k_max)):
        return False  # non-finite inputs (check_finite=False): the caller gets what they asked for
    bound = q.shape[-1] * q_max * max(k_max, 1.0) * max(abs(float(scale)), 1.0)  # inf if huge
    return not bound < float(np.finfo(dtype).max) / 16


def check_representable(prec: "Precision", **arrays) -> None:
    """ValueError naming the first array whose values round to inf in ``prec.compute``
    (finite float64 inputs beyond float16's 65504, say): a kernel in that type cannot
    hold them, and the result would be NaN."""
    if prec.compute.itemsize >= 8:
        return
    for name, x in arrays.items():
        if x.size == 0:
            continue
        extremes = np.array([x.max(), x.min()], dtype=np.float64)
        with np.errstate(over="ignore"):
            rounded = extremes.astype(prec.compute)
        if np.isinf(rounded.astype(np.float64)).any():
            raise ValueError(
                f"{name} holds {float(extremes[np.argmax(np.abs(extremes))]):.4g}, beyond "
                f"{prec.name}'s range (largest finite {float(finfo(prec.compute).max):.5g}): "
                f"rounded to {prec.name} it is inf; scale {name} down or compute in a wider type")


def value_exponent(v_max: float, n_keys: int, dtype=np.float64) -> int:
    """The power of two ``e >= 0`` that the values are divided by while they are summed.

    A row's ``acc = sum_j p_j v_j`` (``p_j <= 1``) is bounded by ``n_keys * max|v|``, which
    overflows ``dtype`` for finite values near its range (``v = 1e308`` and two keys) while
    ``out = acc / l`` never exceeds ``max|v|``.  Summing ``v * 2**-e`` instead keeps
    ``n_keys * max|v| * 2**-e <= max / 4`` and is exact (a power of two), except that
    entries below ``2**(e - 1022)`` (next to others ~1e308) lose ``e`` bits as subnormals.
    0 (nothing scaled, every bit as before) whenever ``n_keys * max|v| <= max / 4``.
    """
    if not v_max or not math.isfinite(v_max):
        return 0
    return range_exponent(math.log2(max(n_keys, 1)) + math.log2(v_max), dtype)  # acc sums the keys only


def range_exponent(log2_bound: float, dtype=np.float64) -> int:
    """The least power of two ``e >= 0`` with ``2**(log2_bound - e) <= max / 4`` in ``dtype``:
    what a bound on every partial sum, given as its log2, must be divided by to stay a
    quarter of the range away from overflowing (the bound itself may exceed the range)."""
    log_top = float(np.log2(finfo(dtype).max))  # in its own type: long double's max is no float
    return max(0, math.ceil(log2_bound - log_top + 2))


def unscale_values(out: np.ndarray, e: int, v_max: float) -> np.ndarray:
    """``out * 2**e``, the attention of the values that `value_exponent` divided: ``out``
    is a convex combination of them (weights summing to at most 1), so it is first held
    to ``+-max|v| * 2**-e``, which a last rounding may cross, and never overflows."""
    if not e:
        return out
    bound = math.ldexp(v_max, -e)
    # numpy arrays and torch tensors alike; exact: a power of two, within the range
    return out.clip(-bound, bound) * math.ldexp(1.0, e)


def overflow_message(dtype) -> str:
    """The error for finite q and k whose scores overflow ``dtype``."""
    dtype = np.dtype(dtype)
    return (f"scores overflow {dtype}: |scale * q . k| exceeds {float(np.finfo(dtype).max):.3g} "
            "for a visible pair of q and k (their softmax is undefined in this precision); "
            "scale q or k down")


@dataclass(frozen=True)
class Precision:
    """A compute precision: inputs and ``p`` are rounded to ``compute``; the scores and the
    online state ``(m, l, acc)`` are kept in ``accumulate`` (float32 for the 16-bit types,
    as GPU kernels keep them).  ``p_type``: where ``p`` is rounded to another type before
    ``p @ v`` (float8_e4m3fn: an fp8 kernel's, FlashAttention 3's, whose inputs, scores and
    output are bfloat16's), else None."""

    name: str
    compute: np.dtype
    accumulate: np.dtype
    eps: float
    p_type: np.dtype | None = None

    @property
    def is_float64(self) -> bool:
        return self.name == "float64"

    @property
    def label(self) -> str:
        """The name, and an intermediate type of ``p`` (``intermediate_dtype``) where one is set."""
        own = self.p_type is None or self.name == "float8_e4m3fn"  # an fp8 kernel's own weights
        return self.name if own else f"{self.name} (p in {self.p_type.name})"

    def round(self, x) -> np.ndarray:
        """``x`` rounded to the compute type, held in the accumulate type."""
        return _rounded(np.asarray(x), self.compute, self.accumulate)

    def round_p(self, x) -> np.ndarray:
        """The weights ``p`` rounded as ``p @ v`` takes them (``p_type``, else ``compute``)."""
        return _rounded(np.asarray(x), self.p_type or self.compute, self.accumulate)


#: Entries `_rounded` takes at a time (256 KiB of float32: within a core's L2 cache).
_ROUND_SLICE = 1 << 16


def _rounded(x: np.ndarray, to: np.dtype, held: np.dtype) -> np.ndarray:
    """``x`` rounded to ``to`` (to nearest, ties to even), held in ``held`` (a new array).

    float32 to bfloat16 and float16, held in float32, by float32's bits, a cache-sized slice at a
    time: bit for bit the casts (every float32 checked), measured on (8, 160, 4096): bfloat16 0.73
    ns an entry against ml_dtypes' 2.18; float16 2.1-2.3 against numpy's 3.1, and 50 where most
    entries are float16 subnormals, as softmax weights are; the naive baselines round millions of
    entries a check."""
    by_bits = _ROUND_BITS.get(to.name)
    if by_bits is not None and x.dtype == np.float32 and held == np.float32 and x.ndim:
        out = np.empty(x.shape, np.float32)
        flat, into = np.ascontiguousarray(x).reshape(-1), out.reshape(-1)
        for c in range(0, flat.size, _ROUND_SLICE):
            by_bits(flat[c:c + _ROUND_SLICE], into[c:c + _ROUND_SLICE])
        return out
    return x.astype(to).astype(held, copy=False)


def _keep_bits(xs, ys, drop: int) -> None:
    """``ys``: float32 ``xs`` with its ``drop`` low mantissa bits rounded off (to nearest, ties to
    even: add half a unit less one, plus the lowest bit kept, then clear them); NaN kept (a
    payload below the kept bits would carry into inf)."""
    bits, r = xs.view(np.uint32), ys.view(np.uint32)
    np.right_shift(bits, drop, out=r)
    r &= 1
    r += (1 << (drop - 1)) - 1
    r += bits
    r &= (0xFFFFFFFF >> drop) << drop
    np.copyto(ys, xs, where=np.isnan(xs))


def _to_bfloat16(xs, ys) -> None:
    """bfloat16 is float32's top 16 bits, with float32's exponent range."""
    _keep_bits(xs, ys, 16)


def _to_float16(xs, ys) -> None:
    """float16: 10 mantissa bits kept; below its normal range (2**-14) a fixed step of 2**-24,
    float32's own rounding of ``|x| + 0.75`` (whose ulp it is) with x's sign bit (-0 too), blended
    in by bit masks (a where= copy took 3.8 ns an entry); from 65520 (half way past 65504, ties
    to even) infinite."""
    _keep_bits(xs, ys, 13)
    size = np.abs(xs)
    small = size < 2.0 ** -14
    if small.any():
        with np.errstate(invalid="ignore"):  # a signalling NaN (never small: its result stays NaN)
            size += np.float32(0.75)
            size -= np.float32(0.75)
        bits, r, t = xs.view(np.uint32), ys.view(np.uint32), size.view(np.uint32)
        t |= bits & 0x80000000
        keep = small.astype(np.uint32)
        np.negative(keep, out=keep)  # all ones where small
        t &= keep
        np.invert(keep, out=keep)
        r &= keep
        r |= t
        size = np.abs(xs, out=size)
    big = size >= 65520.0
    if big.any():
        np.copyto(ys, np.copysign(np.float32(np.inf), xs), where=big)


_ROUND_BITS = {"bfloat16": _to_bfloat16, "float16": _to_float16}


_PRECISIONS = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn")


def precision(x, intermediate=None) -> Precision:
    """``compute_dtype``: None/"float64", "float32", "float16", "bfloat16" or "float8_e4m3fn"
    (the last two need ml_dtypes; float8_e4m3fn is an fp8 kernel's arithmetic, FlashAttention
    3's: bfloat16 inputs and scores, the weights ``exp(s - m) <= 1`` rounded to float8_e4m3fn
    before ``p @ v``, the state in float32, ``out`` in bfloat16); ``intermediate``
    (``intermediate_dtype``): the type ``p`` is rounded to before ``p @ v`` (`INTERMEDIATES`, no
    wider than the compute type, below float64 only).

    A numpy dtype or type of those names is taken too, and a torch dtype; anything else is a ValueError
    naming the choices.
    """
    if intermediate is not None:
        prec, p_type = precision(x), _intermediate(intermediate)
        if prec.is_float64 or prec.p_type is not None or finfo(p_type).eps < prec.eps:
            raise ValueError(f"intermediate_dtype={p_type.name!r} needs a compute_dtype below float64, at least "
                             "as wide as it, and not float8_e4m3fn (whose p is fp8 already); got "
                             f"compute_dtype={prec.name!r}")
        return replace(prec, p_type=p_type)
    if isinstance(x, Precision):  # internal callers pass one, e.g. `extended_precision`
        return x
    if x is None:
        name = "float64"
    elif isinstance(x, str):
        name = x
    else:
        try:
            name = str(np.dtype(x))
        except (TypeError, ValueError):  # a torch dtype is taken by its name
            name = str(x).removeprefix("torch.") if type(x).__module__ == "torch" else None
    if name not in _PRECISIONS:
        raise ValueError("compute_dtype must be one of None, 'float64', 'float32', 'float16', "
                         f"'bfloat16', 'float8_e4m3fn', got {x!r}")
    if name in ("float64", "float32", "float16"):  # numpy's own: the state in float32 below float64
        dt = np.dtype(name)
        return Precision(name, dt, np.dtype(np.float64 if name == "float64" else np.float32), float(np.finfo(dt).eps))
    try:
        import ml_dtypes
    except ImportError:
        raise ValueError(f"compute_dtype={name!r} needs the ml_dtypes package "
                         "(pip install attnlib[lowp])") from None
    bf16 = np.dtype(ml_dtypes.bfloat16)  # bfloat16, or float8_e4m3fn: bfloat16 with fp8 weights
    p_type = np.dtype(ml_dtypes.float8_e4m3fn) if name == "float8_e4m3fn" else None
    return Precision(name, bf16, np.dtype(np.float32), float(finfo(bf16).eps), p_type)


#: The types ``p`` may be rounded to before ``p @ v`` (`precision`'s ``intermediate``).
INTERMEDIATES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _intermediate(x) -> np.dtype:
    """``intermediate_dtype`` as a numpy dtype (a name, numpy or torch dtype of `INTERMEDIATES`)."""
    name = x if isinstance(x, str) else str(x).removeprefix("torch.") if type(x).__module__ == "torch" else None
    if name is None:
        try:
            name = str(np.dtype(x))
        except (TypeError, ValueError):
            pass
    if name not in INTERMEDIATES:
        raise ValueError(f"intermediate_dtype must be one of {INTERMEDIATES}, got {x!r}")
    if name in ("float32", "float16"):
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise ValueError(f"intermediate_dtype={name!r} needs the ml_dtypes package "
                         "(pip install attnlib[lowp])") from None
    return np.dtype(getattr(ml_dtypes, name))


def extended_precision() -> Precision | None:
    """``np.longdouble`` as a `Precision`, where it has at least 64 mantissa bits (x86-64
    Linux and macOS, aarch64 Linux); None where it is plain float64.  Internal: the dense
    references take it as ``compute_dtype`` for a reference more precise than float64
    kernels (`attnlib.check`'s float64 gradients)."""
    info = np.finfo(np.longdouble)
    if info.nmant + 1 < 64:
        return None
    dt = np.dtype(np.longdouble)
    return Precision("longdouble", dt, dt, float(info.eps))


@dataclass(frozen=True)
class Problem:
    """The checked shape of one attention call.

    ``batch`` are the leading axes; ``hq``/``hk`` the query and key/value heads
    (``group = hq // hk`` query heads share one kv head); ``squeeze`` marks 2-D inputs.
    ``maxima``: ``max |q|, max |k|, max |v|`` when the finite check found them, else None.
    """

    batch: tuple
    hq: int
    hk: int
    sq: int
    sk: int
    d: int
    dv: int
    scale: float
    squeeze: bool
    maxima: tuple | None = None

    @property
    def group(self) -> int:
        return self.hq // self.hk

    def max_of(self, name: str, x: np.ndarray) -> float:
        """``max |x|`` of the grouped input ``name`` ("q", "k" or "v"): the finite check's
        figure when it ran, else two reductions of ``x``."""
        if self.maxima is None:
            return abs_max(x)
        return self.maxima["qkv".index(name)]

    def merge_heads(self, x: np.ndarray, tail: int) -> np.ndarray:
        """``(*batch, hk, group, *tail)`` back to the caller's ``(*batch, hq, *tail)`` layout."""
        shape = x.shape[x.ndim - tail :]
        x = x.reshape(self.batch + (self.hq,) + shape)
        return x[0] if self.squeeze else x


def parse(q, k, v, *, scale, check_finite_inputs: bool):
    """Check q, k, v against the contract's layout and return grouped views and the Problem.

    Returns ``(q5, k5, v5, problem)`` with ``q5: (*batch, hk, group, sq, d)``,
    ``k5: (*batch, hk, 1, sk, d)`` and ``v5: (*batch, hk, 1, sk, dv)``: GQA by splitting
    the head axis (a view), never by repeating k and v.
    """
    q, k, v = (as_float_array(x, name) for x, name in zip((q, k, v), "qkv"))
    finite = lambda: tuple(check_finite(x, name) for x, name in zip((q, k, v), "qkv"))
    return group(q, k, v, scale=scale, maxima=finite if check_finite_inputs else None)


def group(q, k, v, *, scale, maxima=None):
    """`parse`'s layout checks and grouping, for arrays already read (numpy arrays, or torch
    tensors: `attnlib.core.device`): only ``ndim``, ``shape``, ``reshape`` and indexing are
    used.  ``maxima``: a function returning ``(max|q|, max|k|, max|v|)`` (it raises for
    non-finite inputs), called after the shape checks of ``q``, or None."""
    if q.ndim < 2:
        raise ValueError(f"q must have at least 2 dimensions (..., Sq, D), got shape {tuple(q.shape)}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            "q, k and v must have the same number of dimensions, got shapes "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if maxima is not None:
        maxima = maxima()
    squeeze = q.ndim == 2
    if squeeze:  # one head: (S, D) -> (1, S, D)
        q, k, v = q[None], k[None], v[None]
    batch = tuple(int(n) for n in q.shape[:-3])  # a tuple for torch tensors too: messages print (2,)
    if tuple(k.shape[:-3]) != batch or tuple(v.shape[:-3]) != batch:
        raise ValueError(
            "q, k and v must have equal batch (leading) axes, got shapes "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    hq, sq, d = (int(n) for n in q.shape[-3:])
    hk, sk, dk = (int(n) for n in k.shape[-3:])
    hv, skv, dv = (int(n) for n in v.shape[-3:])
    if d == 0 or dk == 0 or dv == 0:
        raise ValueError(
            f"head dims must be non-empty, got D={d} (q), D={dk} (k), Dv={dv} (v)"
        )
    if dk != d:
        raise ValueError(f"q and k must have the same head dim D, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if (hv, skv) != (hk, sk):
        raise ValueError(
            f"k and v must have the same heads and keys, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if hq == 0 or hk == 0:
        raise ValueError(f"q and k must have at least one head, got Hq={hq}, Hk={hk}")
    if hq % hk:
        raise ValueError(
            f"the query heads must be a multiple of the kv heads (Hq % Hk == 0), got Hq={hq}, Hk={hk}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    q5 = q.reshape(batch + (hk, hq // hk, sq, d))  # splitting one axis: always a view
    k5, v5 = k[..., None, :, :], v[..., None, :, :]
    return q5, k5, v5, Problem(batch, hq, hk, sq, sk, d, dv, float(scale), squeeze, maxima)


def safe_threshold(tau, prec, n_keys, v_max):
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
    ``<= 1``.  ``prec`` is a `Precision` or a ``compute_dtype`` value.  Clamping
    changes only the reference point of the weights, not the result (up to rounding);
    ``stats`` count the rescales done with the clamped threshold.
    """
    if not tau:
        return tau
    prec = precision(prec)  # a Precision as it is
    margin = math.log(2.0)
    bound = (math.log(float(finfo(prec.accumulate).max)) - math.log(max(n_keys, 1))
             - math.log(max(v_max, 1.0)) - margin)
    if not prec.is_float64:
        bound = min(bound, math.log(float(finfo(prec.compute).max)) - margin)
    return min(float(tau), max(0.0, bound))


def softcap_in(cap, dtype, kernel: str):
    """``cap`` (from `softcap`) for a ``kernel`` (its name, for the message) that keeps its
    scores and cap in ``dtype`` (float32 below float64): a cap that rounds to 0 or inf there
    (``softcap=1e-300`` in float32) would make every score NaN, so it is a ValueError."""
    dtype = np.dtype(dtype)
    if cap is None or dtype.itemsize >= 8:
        return cap
    with np.errstate(over="ignore"):  # beyond the type: inf, refused below
        kept = float(np.asarray(cap, dtype=np.float64).astype(dtype))
    if kept == 0 or not math.isfinite(kept):
        raise ValueError(f"softcap={cap!r} rounds to {kept!r} in {dtype}, where a {kernel} "
                         "kernel keeps its scores: choose a cap within that type's range")
    return cap


def _per_head(x, name: str, pb: "Problem") -> np.ndarray:
    """A finite real per query head, shape ``(Hq,)`` or ``(*batch, Hq)``, as given (float)."""
    arr = as_float_array(x, name)
    if arr.shape not in ((pb.hq,), pb.batch + (pb.hq,)):
        raise ValueError(
            f"{name} must have shape ({pb.hq},) or {pb.batch + (pb.hq,)} (Hq or batch axes + Hq), "
            f"got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must be finite")
    return arr


def _grouped(arr: np.ndarray, pb: "Problem") -> np.ndarray:
    """``(..., Hq)`` float64 with the head axis split like q's, ``(..., hk, g)``."""
    return arr.astype(np.float64).reshape(arr.shape[:-1] + (pb.hk, pb.group))


def alibi_slopes(x, pb: "Problem", dtype=np.float64):
    """ALiBi slopes of shape ``(Hq,)`` or ``(*batch, Hq)``, finite reals.  ``dtype``: the
    type the scores are kept in (float32 for the low precisions), which bounds the biases.

    Returned as float64 with the head axis split like q's, ``(hk, g)`` or
    ``(*batch, hk, g)``, to broadcast over the grouped heads; None if ``x`` is None.
    """
    if x is None:
        return None
    arr = _per_head(x, "alibi_slopes", pb)
    # The bias slope * |i + o - j| has |i + o - j| <= Sq + Sk; it must be finite in the type
    # the scores are kept in (float32 for the low precisions), with room to add it.
    kept = "float32" if np.dtype(dtype).itemsize < 8 else "float64"
    limit = float(np.finfo(kept).max) / 4
    top = abs_max(arr) * (pb.sq + pb.sk)
    if top > limit:
        raise ValueError(
            f"alibi_slopes up to {abs_max(arr):.3g} times distances up to Sq + Sk = {pb.sq + pb.sk} "
            f"give biases of {top:.3g}, beyond {limit:.3g} (a quarter of {kept}'s range, where "
            "the scores are kept); such slopes put every weight on the nearest key: use smaller "
            "slopes")
    return _grouped(arr, pb)


#: The largest ``|sink|`` at the low precisions: the sink is a logit of the softmax, kept
#: (like the running max) in float32 there; beyond this a row's weights are all 0 or all the
#: sink's.  In float64 the bound is a quarter of its range.
SINK_LIMIT = 1e30


def sinks(x, pb: "Problem", dtype=np.float64):
    """Attention-sink logits of shape ``(Hq,)`` or ``(*batch, Hq)``, finite reals, within
    `SINK_LIMIT` when the state is kept in ``dtype`` float32 (the low precisions).

    Returned as float64 ``(hk, g)`` or ``(*batch, hk, g)`` like `alibi_slopes`; None if
    ``x`` is None.
    """
    if x is None:
        return None
    return _grouped(checked_sinks(x, pb, dtype), pb)


def checked_sinks(x, pb: "Problem", dtype=np.float64) -> np.ndarray:
    """`sinks`' checks (shape, finite, `SINK_LIMIT`), the sinks returned as given,
    ``(Hq,)`` or ``(*batch, Hq)`` (float): what `sinks` groups, and what an entry point that
    takes the sinks out of the kernel's run (``lse_sink="excluded"``) checks them with."""
    arr = _per_head(x, "sinks", pb)
    limit = SINK_LIMIT if np.dtype(dtype).itemsize < 8 else float(np.finfo(np.float64).max) / 4
    if abs_max(arr) > limit:
        raise ValueError(f"sinks must be within +-{limit:g} (a softmax logit"
                         f"{', kept in float32 by a low-precision kernel' if limit == SINK_LIMIT else ''}), "
                         f"got {abs_max(arr):.3g}")
    return arr


def of_shapes(q, k, v) -> "Problem":
    """The `Problem` of q, k and v's shapes alone, checked by `group` (its messages) without
    reading a value: each input stands in as a zero-stride array of its shape."""
    def stand_in(x):
        shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        return np.broadcast_to(np.zeros((), dtype=np.float64), tuple(int(n) for n in shape))
    return group(stand_in(q), stand_in(k), stand_in(v), scale=None)[3]


def per_entry(x, name: str, batch: int, hq: int):
    """A per-head option of a layout whose entries run one at a time (varlen, paged):
    ``(Hq,)`` for all or ``(batch, Hq)`` row by row; returns ``b -> values of entry b``
    (None throughout when ``x`` is None)."""
    if x is None:
        return lambda b: None
    arr = as_float_array(x, name)
    if arr.shape == (hq,):
        return lambda b: arr
    if arr.shape == (batch, hq):
        return lambda b: arr[b]
    raise ValueError(f"{name} must have shape ({hq},) or ({batch}, {hq}) (Hq, or batch and Hq), got {arr.shape}")


def for_entry(slopes, idx: tuple):
    """The slopes (or sinks) of batch entry ``idx`` (all of them for ``idx = ()`` or
    per-head values)."""
    if slopes is None or slopes.ndim == 2:
        return slopes
    return slopes[idx]
