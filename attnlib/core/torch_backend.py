"""The torch backend (`attnlib.core.backend`): the kernel's steps on a tensor's device.

Only what torch spells differently from numpy, or needs on a device: tensors in float64 (or a
low precision's types) on ``dev``, errors gathered in device flags and raised once
(`Torch.finish`), the tiles' masks moved to the device once per band, torch's threads held to
one per worker on the CPU, every head at once on a GPU (a per-tile Python loop is
launch-bound there).  No numerical step lives here.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings

import numpy as np

from . import device as dev_mod

_NOTHING = contextlib.nullcontext()  # torch raises no floating-point errors: nothing to quiet
#: Most band masks one call keeps on the device (each at most one tile).
BAND_CACHE = 64
#: No tile: the first-error position of a kind of error not found.
_NONE = 2**62
class Torch:
    """torch on ``dev``, for one call (its error flags are the call's)."""

    name = "torch"

    def __init__(self, dev, workers=None):
        from . import validate
        self.torch = torch = dev_mod._torch()
        self.dev = dev
        self.float64, self.int64 = torch.float64, torch.int64
        # The CPU runs (head block, query tile) units on threads, as the numpy kernel does (one
        # torch thread each; `fit_workers` may take one worker with torch's threads instead, where
        # those pay: an AMD EPYC took 330 against 165 us for a (256, 64) @ (64, 256) product on 2).
        self.workers = (validate.workers(None) if workers is None else workers) if dev.type == "cpu" else 1
        self.chosen = workers is not None  # the caller's thread count, never changed (`fit_workers`)
        self._local = threading.local()
        self._flags = []  # every thread's {message: first position}, read by `finish`
        self._bands = {}  # device copies of the band masks, shared by the threads
        self._mods = {}  # the user's functions as called on the device (`score_values`)
        self._terms_of = {}  # a band mask's 0 / -inf (`_bias`)
        self._distances = {}  # ALiBi's distances by diagonal offset and tile shape (`distance`)

    # -- arrays ---------------------------------------------------------------------------
    def dtype(self, dt):
        return getattr(self.torch, np.dtype(dt).name)

    def empty(self, shape, dtype=np.float64):
        return self.torch.empty(tuple(shape), dtype=self._t(dtype), device=self.dev)

    def zeros(self, shape, dtype=np.float64):
        return self.torch.zeros(tuple(shape), dtype=self._t(dtype), device=self.dev)

    def full(self, shape, value, dtype=np.float64):
        return self.torch.full(tuple(shape), value, dtype=self._t(dtype), device=self.dev)

    def _t(self, dtype):
        return dtype if isinstance(dtype, self.torch.dtype) else self.dtype(dtype)

    def from_host(self, x, dtype=None):
        if x is None:
            return None
        if isinstance(x, self.torch.Tensor):
            return x if dtype is None else x.to(self._t(dtype))
        x = np.asarray(x)
        if not (x.flags.writeable and x.flags.c_contiguous):  # a broadcast grid: a copy, not shared
            x = np.array(x)
        t = self.torch.as_tensor(x, device=self.dev)
        return t if dtype is None else t.to(self._t(dtype))

    def to_host(self, x):
        return x.cpu().numpy() if isinstance(x, self.torch.Tensor) else x

    def operand(self, x):
        return x if x.dtype is self.float64 else x.to(self.float64)

    def rounded(self, x, prec):
        return dev_mod.rounded(x, self.dtype(prec.compute)).to(self.dtype(prec.accumulate))

    def rounded_p(self, p, prec):
        return p.to(self.dtype(prec.p_type or prec.compute)).to(self.dtype(prec.accumulate))

    def copy(self, x):
        return x.clone()

    def read(self, x, name):
        return dev_mod.as_tensor(x, name, self.dev)

    def parse(self, q, k, v, scale, check_finite):
        """`backend.Numpy.parse` on the device (`device.parse`): the extremes found on the way."""
        extremes = {}
        q5, k5, v5, pb = dev_mod.parse(q, k, v, scale=scale, check_finite_inputs=check_finite, dev=self.dev,
                                       extremes=extremes)
        return q5, k5, v5, pb, extremes

    def real_float(self, x, name, host_check):
        """An entry given to a merge as a float64 tensor here: a tensor of a real floating type,
        or what ``host_check`` (`online._real_float`) reads on the host; else its TypeError."""
        from .arrays import _is_torch_tensor
        if _is_torch_tensor(x) and not x.is_floating_point():
            kind = "complex" if x.is_complex() else str(x.dtype).removeprefix("torch.")
            raise TypeError(f"{name} must be an array of real floating numbers, got {kind}")
        return dev_mod.as_tensor(x if _is_torch_tensor(x) else host_check(x, name), name, self.dev).to(self.float64)

    def host_bools(self, flags):
        """Device booleans read back at once."""
        return [bool(b) for b in self.torch.stack(flags).cpu()] if flags else []

    def checked_max(self, x, name) -> float:
        ext = dev_mod._extremes(x).cpu().numpy()
        if not np.isfinite(ext).all():
            dev_mod._first_bad(x, name)
        return float(np.abs(ext).max())

    def concat(self, xs, axis):
        return self.torch.cat(xs, dim=axis)

    def astype(self, x, dt):
        return x.to(self.dtype(dt))

    def broadcast_to(self, x, shape):
        return x.expand(tuple(shape))

    def repeat(self, x, n, axis):
        return x.repeat_interleave(n, dim=axis)

    # -- elementwise and reductions ---------------------------------------------------------
    def matmul(self, a, b, out=None):
        return self.torch.matmul(a, b) if out is None else self.torch.matmul(a, b, out=out)

    def swapaxes(self, x, a, b):
        return x.transpose(a, b)

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def isfinite(self, x):
        return self.torch.isfinite(x)

    def isnan(self, x):
        return self.torch.isnan(x)

    def isposinf(self, x):
        return self.torch.isposinf(x)

    def maximum(self, a, b, out=None):
        torch = self.torch
        a = a if isinstance(a, torch.Tensor) else torch.as_tensor(a, dtype=b.dtype, device=self.dev)
        b = b if isinstance(b, torch.Tensor) else torch.as_tensor(b, dtype=a.dtype, device=self.dev)
        return torch.maximum(a, b) if out is None else torch.maximum(a, b, out=out)

    def amax(self, x, axis):
        return x.amax(dim=axis)

    def exp(self, x, out=None):
        return self.torch.exp(x) if out is None else self.torch.exp(x, out=out)

    def scale_(self, x, factor):
        return x.mul_(factor)

    def tanh_(self, x):
        return x.tanh_()

    def fill_(self, x, where, value):
        return x.masked_fill_(where, value)

    def hide_(self, s, visible):
        """An add of ``0 / -inf`` (kept with the mask): ``masked_fill_`` took 12 against 1.5 ms
        for (8, 512, 512) scores (measured, one thread)."""
        return s.add_(self._bias(visible))

    def exp_visible_(self, s, visible):
        """``exp`` in place, exactly 0 where ``s`` is ``-inf`` (off ``visible``, a score_mod's
        mask, or a visible score whose shift fell below -max): torch's ``exp`` of ``-inf`` took
        12.8 ms and of finite scores 4.1 ((8, 512, 512), one thread, AMD EPYC, measured), so the
        ``-inf`` are set to 0 first and ``p`` multiplied by where they were above ``-inf`` (on
        (2, 256, 256) with half -inf, one thread, Intel Xeon: 423 us, ``isfinite`` 670, a plain
        ``exp_`` 322).  ``visible`` alone would not do: an overflowed shift is visible.  The
        comparison writes 1.0 / 0.0 into a float64 tensor: a bool factor cost a conversion
        (a (256, 256) tile, one thread, Intel Xeon: 70 against 130 us for the four steps)."""
        keep = self.torch.gt(s, -math.inf, out=self.torch.empty_like(s))
        return s.nan_to_num_(neginf=0.0).exp_().mul_(keep)

    def _bias(self, visible):
        """``0 / -inf`` of a mask, float64: kept with a cached band."""
        hit = self._terms_of.get(id(visible))
        if hit is not None and hit[0] is visible:
            return hit[1]
        bias = self.torch.zeros(visible.shape, dtype=self.torch.float64, device=self.dev).masked_fill_(
            ~visible, -math.inf)
        if len(self._terms_of) < BAND_CACHE and any(visible is band for _, band in list(self._bands.values())):
            self._terms_of[id(visible)] = (visible, bias)
        return bias

    def key_sum(self, p, keys_first):
        return p.sum(dim=-2 if keys_first else -1)

    def finite_or_zero(self, x):
        """One operation, not two (``isfinite`` and ``where``): the same values."""
        return x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    def divide_where(self, a, b, where):
        torch = self.torch
        return torch.where(where, a / torch.where(where, b, 1.0), 0.0)

    def log_where(self, x, where, out):
        torch = self.torch
        return torch.where(where, torch.log(torch.where(where, x, 1.0)), out, out=out)

    def copy_where(self, dst, src, where):
        return self.torch.where(where, src, dst, out=dst)

    def abs_max(self, x) -> float:
        return float(x.abs().max()) if x.numel() else 0.0

    def ldexp(self, x, e: int):
        """``x * 2**e`` in float64, a new tensor, in steps of at most ``2**1000`` (each factor a
        normal number; ``torch.ldexp`` forms ``2**e`` itself, inf past ``2**1023``)."""
        x = x.to(self.float64, copy=True)
        while e:
            step = max(-1000, min(1000, e))
            x.mul_(math.ldexp(1.0, step))
            e -= step
        return x

    def clip(self, x, bound):
        return x.clamp(-bound, bound)

    def keys_first_for(self, rows: int) -> bool:
        return False  # torch's reductions along a row are its fast ones

    # -- errors ------------------------------------------------------------------------------
    def ignore_overflow(self, active=True):
        return _NOTHING

    def overflow_ok(self):
        return _NOTHING

    def refuse(self, bad, message, q0=0, k0=0, *args):
        """Note the first tile (by position) where ``bad`` holds, per ``message``, on the device."""
        torch = self.torch
        flags = getattr(self._local, "flags", None)
        if flags is None:
            flags = self._local.flags = {}
            self._flags.append(flags)  # list.append: safe across threads
        message = (message, args)
        first = flags.get(message)
        if first is None:
            first = flags[message] = torch.full((), _NONE, dtype=torch.int64, device=self.dev)
        torch.minimum(first, torch.where(bad.any(), q0 * (1 << 31) + k0, _NONE), out=first)

    def finish(self):
        """Raise the first error `refuse` noted (one read of the device)."""
        found = {}
        for flags in self._flags:
            for message, first in flags.items():
                found.setdefault(message, []).append(first)
        if not found:
            return
        messages = list(found)
        firsts = self.torch.stack([self.torch.stack(found[m]).min() for m in messages]).cpu().tolist()
        for message, first in zip(messages, firsts):
            if first != _NONE:
                q0, k0 = divmod(int(first), 1 << 31)
                raise ValueError(message[0](None, q0, k0, *message[1]))

    # -- masks -------------------------------------------------------------------------------
    def score_values(self, fn, s, grids, name):
        """The function called as FlexAttention calls it, with tensors on the device
        (`torch_flex.on_device`: a numpy-written one on the host's arrays)."""
        from . import torch_flex
        b, h, q_idx, kv_idx = (self.from_host(np.asarray(g, dtype=np.int64)) for g in grids)
        return torch_flex.checked_scores(self._on_device(fn, name)(s.clone(), b, h, q_idx, kv_idx), s, name)

    def _on_device(self, fn, name):
        """A user's ``fn`` as called on the device (`torch_flex.on_device`), made once per call."""
        from . import torch_flex
        wrapped = self._mods.get((fn, name))
        if wrapped is None:
            wrapped = self._mods[(fn, name)] = torch_flex.on_device(fn, name, self.dev)
        return wrapped

    def mask_values(self, fn, grids, shape):
        """A ``mask_mod`` over a tile, called as FlexAttention calls it (`torch_flex.on_device`),
        as a bool tensor of ``shape``."""
        from . import torch_flex
        m = self._on_device(fn, "mask_mod")(*(self.from_host(np.asarray(g, dtype=np.int64)) for g in grids))
        return torch_flex.checked_mask(m, shape)

    def mask(self, vis):
        """The host's mask of a tile on the device; a cached band's (`MaskSpec.tile_visible`:
        read-only, the same array each time) moved there once."""
        if self.torch.is_tensor(vis):
            return vis
        if vis.flags.writeable:  # built for this tile alone
            return self._moved(vis)
        hit = self._bands.get(id(vis))
        if hit is not None and hit[0] is vis:
            return hit[1]
        t = self._moved(vis)
        if len(self._bands) < BAND_CACHE:
            self._bands[id(vis)] = (vis, t)
        return t

    def _moved(self, vis):
        if self.dev.type == "cpu" and vis.flags.c_contiguous:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only band: only read here
                return self.torch.from_numpy(vis)
        return self.from_host(vis)

    def distance(self, spec, rows, cols, keys_first):
        """ALiBi's distances of a tile on the device, kept by diagonal offset and shape for a
        tile of contiguous rows and keys (a GPU's tiles need not cross the host each time)."""
        rows, cols = np.asarray(rows), np.asarray(cols)
        key = None
        if rows.size and cols.size and rows[-1] - rows[0] == rows.size - 1 and cols[-1] - cols[0] == cols.size - 1:
            key = (int(rows[0]) + spec.offset - int(cols[0]), rows.size, cols.size, keys_first)
            hit = self._distances.get(key)
            if hit is not None:
                return hit
        d = spec.distance(rows, cols)
        t = self.from_host(d.T if keys_first else d)
        if key is not None and len(self._distances) < BAND_CACHE:
            self._distances[key] = t
        return t

    # -- where and how it runs ----------------------------------------------------------------
    def threads(self, workers):
        torch = self.torch
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(dev_mod.threads(self.dev, 1 if self.workers > 1 else None))
        return stack

    def fit_workers(self, unit_bytes: int) -> None:
        """One worker, with torch's own threads inside each op, for a forward whose every head's
        score tiles together, ``unit_bytes``, are at most half of `parallel._UNIT_BYTES` (one head
        of 256 x 256 tiles: a window or documents on one head), where the workers were left to
        the default and torch's threads pay on such a tile here (`device.threads_pay`).  Such a tile's ops
        take tens of microseconds, and two Python workers spend them waiting for each other's
        GIL (Intel Xeon, 2 cores, medians of 5: a 256-key window at n = 16384 took 90 ms on
        two workers, 79 on one; 16 documents 181 and 156; at 512 x 512 tiles or more heads two
        workers won by 5 to 13%)."""
        from .parallel import _UNIT_BYTES
        if (self.dev.type == "cpu" and not self.chosen and self.workers > 1 and unit_bytes <= _UNIT_BYTES // 2
                and dev_mod.threads_pay()):
            self.workers = 1

    def worker_start(self):
        if self.workers > 1:  # a worker thread of `run_tiles`: one torch thread of its own first
            dev_mod.hold_one_thread()

    def units(self, lead, rows, keys, n_q_tiles):
        if self.dev.type != "cpu":
            return [()]
        from .parallel import work_units
        return work_units(lead, rows, keys, n_q_tiles)

