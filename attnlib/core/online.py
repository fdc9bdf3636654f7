"""The online softmax: per-row running state ``(m, l, acc)`` that absorbs score tiles.

For one query row with scores ``s_1 .. s_n`` over its keys and values ``v_1 .. v_n``::

    m   = max_j s_j                    running max
    l   = sum_j exp(s_j - m)           running sum, relative to the max
    acc = sum_j exp(s_j - m) v_j       unnormalised output, relative to the max

so that ``out = acc / l`` and ``lse = m + log(l)``.  When a new tile raises the max from
``m`` to ``m_new``, everything accumulated so far is relative to the old max and is
rescaled by ``alpha = exp(m - m_new) <= 1``.  This is exact algebra (Milakov &
Gimelshein, 2018, "Online normalizer calculation for softmax"; Dao et al., 2022,
"FlashAttention"), and because every exponent is ``<= 0`` nothing overflows.

A row that has seen no visible key yet has ``m = -inf`` and ``l = acc = 0``.  To avoid
forming ``-inf - (-inf)``, exponents are taken relative to ``shift``: ``m_new`` where it is
finite and ``0`` otherwise, so such a row gets ``alpha = p = exp(-inf) = 0`` and stays as
it was.
"""

from __future__ import annotations

import copy

import numpy as np

from . import hooks
from .backend import NUMPY
from .validate import MAX_THRESHOLD  # noqa: F401  (the lazy rescale's bound, read from here too)
from .arrays import _is_ml_float, as_numpy
from .device import on_device, resolve as device_of
from .lse_conventions import LseConvention


def _shift(m, xp=NUMPY):
    """``m`` where finite, else 0: the reference point for the exponents of a row."""
    return xp.finite_or_zero(m)


class OnlineSoftmax:
    """Running softmax-weighted sum over key tiles, for a block of query rows.

    Parameters
    ----------
    m : ndarray, shape ``(..., rows)``
        Running max of the scores seen so far (``-inf`` before any visible key).
    l : ndarray, shape ``(..., rows)``
        Running ``sum exp(s - m)``.
    acc : ndarray, shape ``(..., rows, dv)``
        Running ``sum exp(s - m) v``.

    Use `empty` to start, `update` once per key tile in ascending key order, `merge` to
    combine states built over disjoint key ranges, and `finalize` for ``(out, lse)``.
    """

    __slots__ = ("m", "l", "acc", "xp")

    def __init__(self, m: np.ndarray, l: np.ndarray, acc: np.ndarray, xp=NUMPY):
        self.m, self.l, self.acc = m, l, acc
        self.xp = xp  # the arrays' backend (`attnlib.core.backend`)

    @classmethod
    def empty(cls, rows_shape: tuple, dv: int, dtype=np.float64,
              keys_first: bool = False, sink=None, xp=NUMPY) -> "OnlineSoftmax":
        """The state of rows that have seen no key: ``m = -inf``, ``l = 0``, ``acc = 0``.

        With ``sink`` (finite logits broadcastable to ``rows_shape``: attention sinks, one
        per head) the rows start from the sink instead, a logit with no value:
        ``m = sink``, ``l = exp(sink - m) = 1``, ``acc = 0``.  Every later step is the
        ordinary update, so the sink joins the denominator exactly once, a row that sees no
        key finalizes to ``out = 0``, ``lse = sink``, and a tile whose max exceeds the sink
        counts as a rescale (the max was finite).

        ``keys_first`` stores ``acc`` column by column, ``(..., dv, rows)`` in memory
        (``acc`` is still the ``(..., rows, dv)`` view): then ``update(keys_first=True)``
        forms ``p @ v`` as ``v^T p``, whose BLAS call is the faster one for a
        ``(bk, rows)`` tile (about 15% at 256 x 256 x 64, measured).
        """
        rows_shape = tuple(rows_shape)
        if keys_first:
            acc = xp.swapaxes(xp.zeros(rows_shape[:-1] + (dv,) + rows_shape[-1:], dtype=dtype), -1, -2)
        else:
            acc = xp.zeros(rows_shape + (dv,), dtype=dtype)
        if sink is not None:
            m = xp.empty(rows_shape, dtype=dtype)
            m[...] = sink  # rounded once to the state's type
            return cls(m, xp.full(rows_shape, 1.0, dtype=dtype), acc, xp)
        return cls(xp.full(rows_shape, -np.inf, dtype=dtype), xp.zeros(rows_shape, dtype=dtype), acc, xp)

    def update(self, s: np.ndarray, v: np.ndarray, *, threshold: float = 0.0,
               overwrite_s: bool = False, pv: np.ndarray | None = None,
               round_p=None, keys_first: bool = False, visible: np.ndarray | None = None,
               count: bool = True) -> np.ndarray | None:
        """Absorb one tile of scores ``s: (..., rows, bk)`` with values ``v: (..., bk, dv)``.

        Masked pairs carry ``s = -inf``.  ``threshold`` (natural-log units) makes the
        rescale lazy, as FlashAttention-4 does: a row keeps its stale max ``m`` until the
        tile's max exceeds it by more than ``threshold``, so its weights ``exp(s - m)`` may
        reach ``exp(threshold)`` (bounded: see `MAX_THRESHOLD`); the result is the same
        up to rounding, since ``m`` is only a reference point.  0 is the eager rule.
        With ``overwrite_s`` the tile's weights ``p`` are computed in the memory of ``s``
        (as SciPy's ``overwrite_a``: faster, and ``s`` is garbage afterwards); ``pv``, if
        given, is a ``(..., rows, dv)`` buffer for ``p @ v``; ``round_p``, if given, rounds
        ``p`` before ``p @ v`` (a low compute precision: ``l`` sums the unrounded ``p``, as
        FlashAttention's kernels do).  ``keys_first``: ``s`` is the transposed tile
        ``(..., bk, rows)``, as the kernels form it (``k_j @ q_i^T``): its per-row max,
        shift and sum then run along the outer axis, which numpy vectorises over the
        contiguous rows (about 1.5x faster than along a row of 256 keys, measured), the
        sum is one BLAS product ``1^T p``, and ``pv`` (if given) is a ``(..., dv, rows)``
        buffer for ``v^T p``.  ``visible``, a boolean array laid out as ``s`` (False
        where ``s`` is ``-inf``), has ``exp`` evaluated only where it is True: numpy's
        ``exp(-inf)`` takes a slow path, 6.8 ns per element against 1.1 ns for a finite
        exponent (measured), and half of a diagonal tile is masked.
        Returns a boolean ``(..., rows)`` array marking the rescale events of this tile:
        rows whose max was finite and was moved up (so that ``acc`` and ``l`` were
        multiplied by ``alpha < 1``); None without ``count`` (not worked out: three array
        operations a tile, which on a device's small tiles are launches).
        """
        xp = self.xp
        if not overwrite_s:  # a copy in the state's type (lists too)
            s = xp.copy(xp.from_host(s, self.acc.dtype))
        key_axis = -2 if keys_first else -1
        m_tile = xp.amax(s, key_axis)  # (..., rows)
        if threshold:
            # -inf + threshold is -inf, so a row's first finite max is always taken.
            m_new = xp.where(m_tile > self.m + threshold, m_tile, self.m)
        else:
            m_new = xp.maximum(self.m, m_tile)
        rescaled = xp.isfinite(self.m) & (m_new > self.m) if count else None
        shift = _shift(m_new, xp)
        # A difference below -max (scores of +-1e308) is -inf, whose exp is the exact 0.
        with xp.overflow_ok():
            alpha = xp.exp(self.m - shift)  # (..., rows); 0 for rows with m = -inf
            s -= shift[..., None, :] if keys_first else shift[..., None]  # exponents <= 0; -inf stays
        if visible is None:
            p = xp.exp(s, out=s)  # (..., rows, bk), or (..., bk, rows) keys first
        else:  # the invisible entries are -inf: exactly 0 (`backend.Numpy.exp_visible_`)
            p = xp.exp_visible_(s, visible)
        self.l *= alpha
        self.l += xp.key_sum(p, keys_first)  # sum over the keys: (..., rows)
        self.acc *= alpha[..., None]
        if round_p is not None:
            p = round_p(p)
        if keys_first:  # (..., dv, bk) @ (..., bk, rows): acc's own layout in memory
            self.acc += xp.swapaxes(xp.matmul(xp.swapaxes(v, -1, -2), p, out=pv), -1, -2)
        else:
            self.acc += xp.matmul(p, v, out=pv)
        self.m = m_new
        return rescaled

    def rows(self, r0: int, r1: int) -> "OnlineSoftmax":
        """The state of rows ``[r0, r1)``: views on ``m``, ``l`` and ``acc``, in a shallow copy
        of this object (so a subclass's own slots come along); `put_rows` writes it back."""
        part = copy.copy(self)
        part.m, part.l, part.acc = self.m[..., r0:r1], self.l[..., r0:r1], self.acc[..., r0:r1, :]
        return part

    def put_rows(self, r0: int, r1: int, part: "OnlineSoftmax") -> None:
        """Write back the rows ``[r0, r1)`` of `rows` after its updates (``update`` rebinds
        ``m``; a replaced step may rebind more), and its other attributes (the state's own,
        not per row)."""
        self.m[..., r0:r1], self.l[..., r0:r1], self.acc[..., r0:r1, :] = part.m, part.l, part.acc
        for cls in type(self).__mro__:
            slots = getattr(cls, "__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("m", "l", "acc", "__dict__", "__weakref__") and hasattr(part, name):
                    setattr(self, name, getattr(part, name))
        if hasattr(part, "__dict__"):  # a subclass without __slots__: its attributes too
            self.__dict__.update(part.__dict__)

    def merge(self, other: "OnlineSoftmax") -> "OnlineSoftmax":
        """The state over the union of two disjoint key ranges (log-sum-exp combination).

        Associative and commutative up to rounding; an empty side (``m = -inf``) is a
        neutral element.
        """
        xp = self.xp
        m = xp.maximum(self.m, other.m)
        shift = _shift(m, xp)
        with xp.overflow_ok():  # a difference below -max is -inf: weight exactly 0
            a_self = xp.exp(self.m - shift)
            a_other = xp.exp(other.m - shift)
        return OnlineSoftmax(m, a_self * self.l + a_other * other.l,
                             a_self[..., None] * self.acc + a_other[..., None] * other.acc, xp)

    def finalize(self) -> tuple[np.ndarray, np.ndarray]:
        """``(out, lse)``; rows with no visible key give ``out = 0`` and ``lse = -inf``.

        ``l >= 1`` for every row that saw a key (its max contributes ``exp(0)``), so the
        single division here never divides by zero.  A row without a key has ``m = -inf`` and
        ``log l = -inf``: their sum is its ``-inf``, no ``inf - inf`` (the bits of `lse_of` of
        `finalize_parts`, in fewer steps: a device's launches).
        """
        xp = self.xp
        seen = self.l > 0
        out = xp.divide_where(self.acc, self.l[..., None], seen[..., None])
        return out, self.m + xp.log_where(self.l, seen, xp.full(tuple(self.m.shape), -np.inf, dtype=self.m.dtype))

    def finalize_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """``(out, parts)`` with ``parts (..., rows, 2) = (m, log l)``, the lse in two parts:
        for partials to be merged (split-KV, the distributed pieces), whose ``m + log l``
        rounded to one float would lose ``log l`` below the spacing of floats at ``m``
        (``m = 1e16``: 2), and with it the weight of each partial."""
        xp = self.xp
        seen = self.l > 0
        out = xp.divide_where(self.acc, self.l[..., None], seen[..., None])
        parts = xp.full(tuple(self.m.shape) + (2,), -np.inf, dtype=self.m.dtype)
        xp.log_where(self.l, seen, parts[..., 1])
        xp.copy_where(parts[..., 0], self.m, seen)
        return out, parts


class SizedSoftmax(OnlineSoftmax):
    """The online softmax with its weights squared beside it, for values laid out as
    ``[v, v**2, v, 1]`` (`attnlib.check.sizes.reference_sizes`: the check's entry sizes): ``acc`` sums ``p v`` over the first ``Dv``
    columns as `OnlineSoftmax` does (the same arithmetic: the reference's bits), ``acc2`` sums
    ``p**2 [v**2, v, 1]`` over the rest, rescaled by ``alpha**2``, and `finalize` divides it
    by ``l**2``: ``sum_j p_j**2 x_j`` of the normalised weights, one pass for both (one key
    range: no partials to merge)."""

    __slots__ = ("acc2",)

    @classmethod
    def empty(cls, rows_shape, dv, dtype=np.float64, keys_first=False, sink=None, xp=None, **backend):
        split = (dv - 1) // 3  # [v, v**2, v, 1]: Dv value columns, then 2 Dv + 1
        xp = {} if xp is None else {"xp": xp}
        state = super().empty(rows_shape, split, dtype, keys_first, sink, **xp)
        # acc's layout (keys first: column by column); a sink's weight, 1 at m = sink, squared is 1.
        state.acc2 = super().empty(rows_shape, dv - split, dtype, keys_first, None, **xp).acc
        if sink is not None:
            state.acc2[..., -1] = 1.0
        return state

    def update(self, s, v, *, keys_first=False, overwrite_s=False, **given):
        xp, split, m_old = self.xp, self.acc.shape[-1], self.m
        if not overwrite_s:  # p is formed in s's memory below: a copy, as `OnlineSoftmax.update`
            s = xp.copy(xp.from_host(s, self.acc.dtype))
        rescaled = super().update(s, v[..., :split], keys_first=keys_first, overwrite_s=True, **given)
        with xp.overflow_ok():  # as update's alpha: 0 for rows with m = -inf
            alpha = xp.exp(m_old - _shift(self.m, xp))
        p2 = s * s  # s holds p now
        self.acc2 *= (alpha * alpha)[..., None]
        if keys_first:  # (..., W, bk) @ (..., bk, rows), as update forms p @ v
            self.acc2 += xp.swapaxes(xp.matmul(xp.swapaxes(v[..., split:], -1, -2), p2), -1, -2)
        else:
            self.acc2 += xp.matmul(p2, v[..., split:])
        return rescaled

    def rows(self, r0, r1):
        part = super().rows(r0, r1)
        part.acc2 = self.acc2[..., r0:r1, :]
        return part

    def put_rows(self, r0, r1, part):
        whole = self.acc2
        super().put_rows(r0, r1, part)  # takes part's acc2 (a view of these rows): the whole back
        whole[..., r0:r1, :] = part.acc2
        self.acc2 = whole

    def finalize(self):
        out, lse = super().finalize()
        seen = (self.l > 0)[..., None]
        squares = self.xp.divide_where(self.acc2, (self.l * self.l)[..., None], seen)
        return self.xp.concat([out, squares], -1), lse


def _real_float(x, name: str) -> np.ndarray:
    """``x`` as float64; refused (TypeError) unless it holds real floating numbers.

    Nested lists of Python floats are fine; strings, objects, integers, bools and complex
    numbers (whose imaginary part a cast would drop) are not.  ml_dtypes floats (bfloat16)
    are converted.
    """
    if type(x) is not np.ndarray and (isinstance(x, np.ndarray) or hasattr(x, "__dlpack__")
                                      or hasattr(x, "__array__")):  # tensors, masked arrays: read exactly or refused
        x = as_numpy(x, name)
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError):  # ragged nested lists and the like
        arr = None
    if arr is None or not (np.issubdtype(arr.dtype, np.floating) or _is_ml_float(arr.dtype)):
        kind = ("nothing usable" if arr is None else "complex" if np.iscomplexobj(arr)
                else "strings" if arr.dtype.kind in "US" else str(arr.dtype))
        raise TypeError(f"{name} must be an array of real floating numbers, got {kind}")
    return arr.astype(np.float64, copy=False)


def lse_of(parts, xp=NUMPY):
    """``m + log l`` of lse parts ``(..., 2)``; ``-inf`` where the row saw no key."""
    seen = xp.isfinite(parts[..., 1])
    return xp.where(seen, parts[..., 0] + xp.where(seen, parts[..., 1], 0.0), -np.inf)


def merge_parts(outs, parts, xp=NUMPY) -> tuple[np.ndarray, np.ndarray]:
    """`merge_attention` of partials whose lse comes in two parts ``(m, log l)`` (see
    `OnlineSoftmax.finalize_parts`); returns ``(out, parts)``.  The weight of partial ``r``
    is ``exp(m_r - M + log l_r - log L)``: ``m_r - M`` is exact where the maxima are close,
    so no weight loses what a one-float lse of size ``M`` cannot hold."""
    shape = tuple(parts[0].shape[:-1])
    big_m = xp.full(shape, -np.inf)
    for p in parts:
        big_m = xp.maximum(big_m, p[..., 0])
    shift = _shift(big_m, xp)
    with xp.overflow_ok():  # a difference below -max is -inf: weight exactly 0
        logs = [(p[..., 0] - shift) + p[..., 1] for p in parts]  # log(l_r exp(m_r - M)); -inf: none
        top = xp.full(shape, -np.inf)
        for c in logs:
            top = xp.maximum(top, c)
        ref = _shift(top, xp)  # the largest term: its weight exp(0) keeps L >= 1
        big_l = xp.zeros(shape)
        for c in logs:
            big_l += xp.exp(c - ref)
        seen = big_l > 0
        log_l = xp.log_where(big_l, seen, xp.full(shape, -np.inf))
        log_l = xp.where(seen, log_l + ref, log_l)  # log L, relative to M
        out = xp.zeros(tuple(outs[0].shape))
        for o_r, c in zip(outs, logs):
            w = xp.exp(c - xp.where(seen, log_l, 0.0))  # sums to 1 over the partials; 0 where none
            out += w[..., None] * xp.where(xp.isfinite(c)[..., None], o_r, 0.0)
    bound = max(xp.abs_max(o_r) for o_r in outs)
    merged = xp.full(shape + (2,), -np.inf)
    xp.copy_where(merged[..., 0], big_m, seen)
    xp.copy_where(merged[..., 1], log_l, seen)
    return xp.clip(out, bound), merged


def _floating(x) -> bool:
    """A real floating torch tensor (``is_floating_point``, not complex)."""
    return bool(x.is_floating_point()) and not bool(x.is_complex())


def merge_attention(outs, lses, *, lse_base=None, device=None):
    """Combine attention results computed over disjoint key ranges (split-KV).

    Parameters
    ----------
    outs : sequence of arrays, each ``(..., Sq, Dv)``
        Normalised partial outputs, one per key range.
    lses : sequence of arrays, each ``(..., Sq)``
        Their log-sum-exps; ``-inf`` marks a row that saw no key in that range (its output
        must then be 0), and such partials are ignored cleanly.
    lse_base : {"e", 2}, optional
        The base the ``lses`` are in, and the returned one: ``2`` for FlashInfer's and JAX
        Pallas's partials (flashinfer 2113: a base-2 LSE merged as a natural one weights the
        partials wrongly); default natural.
    device : str or torch.device, optional
        As in `attention`: given torch tensors (or ``device=``) the merge is computed with
        torch on their device (the same steps, `attnlib.core.torch_backend`), float64 tensors out (numpy out
        for numpy inputs with ``device=``).

    Returns
    -------
    out, lse : the result over the union of the key ranges (float64), ``lse`` in ``lse_base``.

    Raises
    ------
    TypeError
        If an entry of ``outs`` or ``lses`` is not an array of real floating numbers
        (strings, integers, complex: no silent conversion).

    Notes
    -----
    A partial ``(out, lse)`` is the online state ``m = lse, l = 1, acc = out`` (or the
    empty state where ``lse = -inf``), so merging is `OnlineSoftmax.merge`:
    ``lse = log(sum_r exp(lse_r))`` and ``out = sum_r exp(lse_r - lse) out_r``.
    """
    outs, lses = list(outs), list(lses)
    base = LseConvention.parse(lse_base)
    if base.factor != 1.0:  # natural for the merge; what is no float is refused by name, here or below
        lses = [(x * base.factor if _floating(x) else x) if hasattr(x, "is_floating_point")  # torch: its device
                else _real_float(x, f"lses[{r}]") * base.factor for r, x in enumerate(lses)]
        out, lse = merge_attention(outs, lses, device=device)
        return out, base.from_natural(lse)
    dev = device_of(device, *outs, *lses)
    if dev is None:
        return _merged(_read_partials(outs, lses, NUMPY), NUMPY)
    from .torch_backend import Torch
    xp = Torch(dev)
    with xp.threads(None):
        return on_device(_merged(_read_partials(outs, lses, xp), xp), (*outs, *lses))


def _read_partials(outs, lses, xp):
    """`merge_attention`'s partials as ``xp``'s float64 arrays, checked: ``[(out, lse)]``.  Each
    partial's types and shapes are checked in turn; their values' checks are gathered (one
    synchronisation on a device) and raised first, for the partials before a failing one."""
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_attention needs as many outs as lses, at least one; "
                         f"got {len(outs)} and {len(lses)}")
    parts, flags, failed = [], [], None
    for r, (out, lse) in enumerate(zip(outs, lses)):
        try:
            out = xp.real_float(out, f"outs[{r}]", _real_float)
            lse = xp.real_float(lse, f"lses[{r}]", _real_float)
            if out.ndim < 2:
                raise ValueError(f"outs[{r}] must have shape (..., Sq, Dv), got {tuple(out.shape)}")
            if out.shape[:-1] != lse.shape:
                raise ValueError(f"outs[{r}] {tuple(out.shape)} and lses[{r}] {tuple(lse.shape)} do not match "
                                 "((..., Sq, Dv) and (..., Sq))")
            if parts and out.shape != parts[0][0].shape:
                raise ValueError(f"outs[{r}] has shape {tuple(out.shape)}, outs[0] {tuple(parts[0][0].shape)}")
        except (TypeError, ValueError) as e:
            failed = e
            break
        flags += [(xp.isnan(lse) | xp.isposinf(lse)).any(), (~xp.isfinite(out)).any()]
        parts.append((out, lse))
    for i, bad in enumerate(xp.host_bools(flags)):
        if bad:
            r = i // 2
            raise ValueError(f"lses[{r}] must be finite or -inf" if i % 2 == 0 else f"outs[{r}] contains NaN or inf")
    if failed is not None:
        raise failed
    return parts


def _merged(parts, xp):
    """`merge_attention` of checked partials ``[(out, lse)]``: ``(out, lse)``."""
    # A partial's lse is the parts (m, log l) = (lse, 0).  First the lse over all ranges, then
    # the outputs with weights that sum to 1, so no partial sum exceeds max |out_r|.
    out, merged = merge_parts([o for o, _ in parts], [lse_parts(lse, xp) for _, lse in parts], xp)
    return out, lse_of(merged, xp)


def lse_parts(lse, xp=NUMPY):
    """A one-float ``lse (...)`` as parts ``(..., 2) = (lse, 0)`` (``(-inf, -inf)`` where none)."""
    parts = xp.full(tuple(lse.shape) + (2,), -np.inf, dtype=lse.dtype)
    parts[..., 0] = lse
    xp.copy_where(parts[..., 1], xp.zeros(tuple(lse.shape), dtype=lse.dtype), xp.isfinite(lse))
    return parts


hooks.declare("state", OnlineSoftmax)  # the forward paths' state, replaceable (`hooks`)
