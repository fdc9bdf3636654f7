"""What the kernel's steps need of an array library beyond the code they share.

Every numerical step (`tiles.absorb`, `tiles.tile_scores`, `online.OnlineSoftmax`, the merge,
`tiled.forward`'s tile loop) is written once and calls its arrays' backend for the few things
numpy and torch spell differently or that numpy needs for speed: buffers written in place
(``out=``, ``where=``), the layout of a score tile, rounding to a low precision, how an error
found in a tile is raised (numpy at once; torch gathered on the device and raised once, so a
GPU never waits on the host inside the loop), where arrays live and the threads.  A backend
holds no numerical step of its own: a test (`tests/test_one_kernel.py`) fails if one grows.

A protocol of our own rather than the array API through ``array-api-compat``: the steps need
the in-place ``out=``/``where=`` forms the standard leaves out (numpy's kernel is 1.5-2x
slower without them), and the core depends on numpy alone.  `Numpy` is the host's backend;
`attnlib.core.torch_backend.Torch` a tensor's device's (CPU or CUDA).
"""

from __future__ import annotations

import contextlib

import numpy as np

_NOTHING = contextlib.nullcontext()  # reusable: entered per tile where nothing is to be quieted
#: Fewest rows in a tile for the keys-first layout (see `Numpy.keys_first_for`).
KEYS_FIRST_MIN_ROWS = 64


class Numpy:
    """numpy on the host's cores (the evidence's kernel); errors raised where found."""

    name = "numpy"
    dev = None
    float64 = np.dtype(np.float64)
    int64 = np.dtype(np.int64)

    # -- arrays ---------------------------------------------------------------------------
    def dtype(self, dt):
        """The backend's type of the numpy dtype ``dt``."""
        return np.dtype(dt)

    def empty(self, shape, dtype=np.float64):
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype=np.float64):
        return np.zeros(shape, dtype=dtype)

    def full(self, shape, value, dtype=np.float64):
        return np.full(shape, value, dtype=dtype)

    def from_host(self, x, dtype=None):
        """A host (numpy) array as this backend's, read-only use."""
        return x if dtype is None or x is None else np.asarray(x, dtype=dtype)

    def to_host(self, x):
        return x

    def operand(self, x):
        """A tile of q, k or v in float64, aligned (a copy only if not): numpy multiplies
        misaligned arrays in its own loop, not BLAS, so the bits would depend on where the
        input lies."""
        return np.require(x.astype(np.float64, copy=False), requirements="A")

    def rounded(self, x, prec):
        """``x`` rounded to ``prec``'s compute type, held in its accumulate type."""
        return prec.round(x)

    def rounded_p(self, p, prec):
        return prec.round_p(p)

    def copy(self, x):
        return x.copy()

    def read(self, x, name):
        """An input as this backend's float array, exactly (`arrays.as_float_array`)."""
        from .arrays import as_float_array
        return as_float_array(x, name)

    def parse(self, q, k, v, scale, check_finite):
        """``(q5, k5, v5, problem, extremes)``: the grouped inputs (`problem.parse`); ``extremes``
        (each input's ``(max, min)``, for `problem.check_representable`) None on the host."""
        from . import problem
        return (*problem.parse(q, k, v, scale=scale, check_finite_inputs=check_finite), None)

    def real_float(self, x, name, host_check):
        """An entry given to a merge as a float64 array: ``host_check`` (`online._real_float`)."""
        return host_check(x, name)

    def host_bools(self, flags):
        """Booleans found by the checks, as Python bools."""
        return [bool(b) for b in flags]

    def checked_max(self, x, name) -> float:
        """``max |x|``; ValueError naming ``name``'s first NaN or inf."""
        from .arrays import check_finite
        return check_finite(x, name)

    concat = staticmethod(np.concatenate)

    def astype(self, x, dt):
        """``x`` converted to the numpy dtype ``dt`` (ml_dtypes' too)."""
        return x.astype(dt)

    broadcast_to = staticmethod(np.broadcast_to)

    def repeat(self, x, n, axis):
        return np.repeat(x, n, axis=axis)

    # -- elementwise and reductions, in numpy's spelling ----------------------------------
    matmul = staticmethod(np.matmul)

    swapaxes = staticmethod(np.swapaxes)
    where = staticmethod(np.where)
    isfinite = staticmethod(np.isfinite)
    isnan = staticmethod(np.isnan)
    isposinf = staticmethod(np.isposinf)

    maximum = staticmethod(np.maximum)

    def amax(self, x, axis):
        return x.max(axis=axis)

    exp = staticmethod(np.exp)

    def scale_(self, x, factor):
        x *= factor
        return x

    def tanh_(self, x):
        return np.tanh(x, out=x)

    def fill_(self, x, where, value):
        """``x[where] = value`` in place."""
        np.copyto(x, value, where=where)
        return x

    def hide_(self, s, visible):
        """``s`` set to ``-inf`` where not ``visible`` (a tile's mask), in place."""
        np.copyto(s, -np.inf, where=~visible)
        return s

    def exp_visible_(self, s, visible):
        """``exp(s)`` in place, where ``s`` is ``-inf`` off ``visible``: numpy's ``exp(-inf)``
        takes a slow path (6.8 ns per element against 1.1 ns, measured), so only the visible
        entries are evaluated and the others set to 0."""
        p = np.exp(s, out=s, where=visible)
        np.maximum(p, 0.0, out=p)  # the invisible entries kept -inf: max(-inf, 0) = 0
        return p

    def key_sum(self, p, keys_first):
        """``p``'s sum over its keys: ``(..., rows)``."""
        if keys_first:  # (bk,) @ (..., bk, rows): one BLAS product
            return np.matmul(np.ones(p.shape[-2], dtype=p.dtype), p)
        return p.sum(axis=-1)

    def finite_or_zero(self, x):
        """``x`` where finite, else 0 (a new array)."""
        return np.where(np.isfinite(x), x, 0.0)

    def divide_where(self, a, b, where):
        """``a / b`` where ``where``, 0 elsewhere (never divides there)."""
        return np.divide(a, b, out=np.zeros_like(a), where=where)

    def log_where(self, x, where, out):
        """``out = log(x)`` where ``where`` (``out`` unchanged elsewhere)."""
        np.log(x, out=out, where=where)
        return out

    def copy_where(self, dst, src, where):
        """``dst[where] = src[where]`` in place."""
        np.copyto(dst, src, where=where)
        return dst

    def abs_max(self, x) -> float:
        from .arrays import abs_max
        return abs_max(x)

    def ldexp(self, x, e: int):
        """``x * 2**e`` in float64, a new array (an entry beyond the range becomes inf: the
        caller checks)."""
        with np.errstate(over="ignore"):
            return np.ldexp(x.astype(np.float64, copy=False), e)

    def clip(self, x, bound):
        return np.clip(x, -bound, bound)

    def keys_first_for(self, rows: int) -> bool:
        """Whether a tile of ``rows`` query rows is laid out keys first, ``(..., bk, rows)``:
        its per-row max, shift and sum then run along the outer axis over contiguous rows
        (at 256 x 256 the max took 0.38 ns per score against 0.65 rows first), and ``v^T p``
        is the faster product.  With few rows (decode) that axis is too short to vectorise:
        at 4 rows by 256 keys the max took 106 us keys first and 8 us rows first (8 heads,
        measured), so such tiles stay rows first."""
        return rows >= KEYS_FIRST_MIN_ROWS

    # -- errors ------------------------------------------------------------------------------
    def ignore_overflow(self, active=True):
        """The floating-point errors a checked tile reports itself (`refuse`), quiet."""
        return np.errstate(over="ignore", invalid="ignore") if active else _NOTHING

    def overflow_ok(self):
        """Overflow to an infinity is intended here (an exponent's difference below -max is
        -inf, whose exp is the exact 0): not an error, even in strict mode."""
        return np.errstate(over="ignore")

    def refuse(self, bad, message, q0=0, k0=0, *args):
        """ValueError ``message(bad, q0, k0, *args)`` if any of ``bad`` (a tile's booleans);
        ``bad`` is None where a backend gathered the error and has no tile to show."""
        if bad.any():
            raise ValueError(message(bad, q0, k0, *args))

    def finish(self):
        """Raise what `refuse` gathered (nothing on the host: raised at once)."""

    # -- masks -------------------------------------------------------------------------------
    def mask(self, vis):
        """A tile's visibility worked out on the host (`MaskSpec.tile_visible`) as this
        backend's array."""
        return vis

    def distance(self, spec, rows, cols, keys_first):
        """ALiBi's ``|i + o - j|`` over the tile, laid out as the tile, float64."""
        d = spec.distance(rows, cols)
        return d.T if keys_first else d

    # -- where and how it runs --------------------------------------------------------------------
    def threads(self, workers):
        return contextlib.nullcontext()

    def worker_start(self):
        """Run first in each worker thread."""

    def units(self, lead, rows, keys, n_q_tiles):
        from .parallel import work_units
        return work_units(lead, rows, keys, n_q_tiles)


NUMPY = Numpy()


def backend_for(dev, workers=None):
    """The torch backend on ``dev`` (`attnlib.core.torch_backend`) for one call."""
    from .torch_backend import Torch
    return Torch(dev, workers)
