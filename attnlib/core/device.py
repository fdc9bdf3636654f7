"""Where a call computes: numpy on the host's cores, or torch on a tensor's own device.

A kernel engineer's tensors live on a GPU.  Given torch tensors (or an explicit ``device=``)
the entry points compute with torch where the tensors are, in float64, and return torch
tensors there: the same contract, the same tile classes and stats as the numpy kernel.  torch
is imported only when a tensor or ``device=`` asks for it (`_is_torch_tensor` looks in
``sys.modules``; a tensor means torch is already imported).

Tensors are read exactly: every torch floating type (float64/32/16, bfloat16, float8) is
kept as stored and converted to float64 one tile at a time, so the inputs are never copied
whole.  What holds no values (meta, fake, nested, quantized, complex tensors) is refused with
the host path's messages (`arrays._torch_refusal`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings

import numpy as np

from . import problem
from .arrays import UnreadableInput, _is_torch_tensor, _torch_refusal, as_float_array, as_numpy


def _torch():
    try:
        import torch
    except ImportError:
        raise ValueError("device= needs torch: pip install attnlib[torch]") from None
    if not _vml_warm:
        warm_vml()
    return torch


#: The unary functions ATen hands to MKL's VML on the CPU (``aten/src/ATen/cpu/vml.h``).
_VML_FUNCTIONS = ("exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "tanh", "sin", "cos", "tan",
                  "asin", "acos", "atan", "erf", "erfc", "trunc")
_vml_lock = threading.Lock()
_vml_warm = False


def warm_vml():
    """Each function torch hands to MKL's VML called once, by this thread alone, in float64 and
    float32.  oneMKL 2024.2 (torch 2.13's CPU wheels) picks a VML kernel on a function's first
    call, and first calls racing on several threads can run part of it with a low-accuracy kernel
    (pytorch/pytorch#188792: 216 of 4,160 racing first calls wrong, 0 of 5,200 after a warm-up):
    the likely cause of a torch CPU backward, its process's first, seen once off by a gate ratio
    of 1380 (1e-9 noise in one tile's ``exp`` gives that; not reproduced in 323 fresh processes).
    About 5 ms once per process; later calls unchanged."""
    global _vml_warm
    import torch
    with _vml_lock:
        if _vml_warm:
            return
        for dtype in (torch.float64, torch.float32):
            x = torch.full((16,), 0.5, dtype=dtype)  # 16 entries: computed in this thread alone
            for name in _VML_FUNCTIONS:
                getattr(torch, name)(x)
        _vml_warm = True


def parse_name(device, accepted="a torch device"):
    """The torch device named ``device`` (a string or a ``torch.device``), refusing a name no
    torch device has (the error says the ``accepted`` names) and ``meta``, which holds no
    values; whether this machine has it is not asked (`resolve` asks)."""
    torch = _torch()
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device={device!r} is not {accepted} ({e})") from None
    if dev.type == "meta":
        raise ValueError("device='meta' holds no values to compute with")
    return dev


def resolve(device, *arrays):
    """The torch device a call computes on, or None for the numpy kernel.

    ``device``: None (torch tensors among ``arrays`` choose: all on one device), or what
    ``torch.device`` takes (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``).
    """
    tensors = [x for x in arrays if _is_torch_tensor(x)]
    if device is None and not tensors:
        return None
    torch = _torch()
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a string such as 'cuda' or 'cpu', or a torch.device; "
                            f"got {device!r}")
        dev = parse_name(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: torch {torch.__version__} sees no CUDA device here")
        return dev
    devices = {x.device for x in tensors if x.device.type != "meta"}  # meta: refused by name later
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1:
        raise ValueError(f"the tensors are on different devices ({', '.join(sorted(map(str, devices)))}): "
                         "move them to one, or pass device=")
    return devices.pop()


def as_tensor(x, name: str, dev):
    """``x`` as a real floating torch tensor on ``dev``, exactly: a tensor keeps its type (read
    one tile at a time), a numpy array becomes a tensor of its memory on the CPU."""
    torch = _torch()
    if _is_torch_tensor(x):
        why = _torch_refusal(x, name)
        if why is not None:
            raise UnreadableInput(why)
        t = x.detach()  # never touches x's values, nor its autograd graph
        if t.layout != torch.strided:  # sparse, mkldnn
            t = t.to_dense()
        t = t.resolve_conj().resolve_neg()
        if not t.is_floating_point():  # the host path's words
            raise TypeError(f"{name} must have a real floating dtype (float16/32/64, bfloat16), "
                            f"got {str(t.dtype).removeprefix('torch.')}")
    else:
        arr = as_float_array(x, name)  # numpy, lists, JAX, ml_dtypes (as float64): read exactly
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only array: never written here
            try:
                t = torch.from_numpy(arr)
            except (TypeError, ValueError, RuntimeError):  # negative strides, a non-native byte order
                t = torch.from_numpy(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("=")))
    t = t if t.device == dev else t.to(dev)
    # Contiguous, as on the host (`as_float_array`): the bits never depend on the strides.
    return t.contiguous()


def index_tensor(x, dev, dtype=None):
    """Integers computed on the host (positions, lengths, ids) as a tensor on ``dev``."""
    return _torch().as_tensor(np.array(x), device=dev, dtype=dtype)  # a copy: small, and writable


def _first_bad(t, name):
    """ValueError naming the first NaN or inf of ``t``, found a few rows at a time."""
    torch = _torch()
    rows = t.shape[-2]
    step = max(1, (1 << 16) // max(1, t.numel() // max(rows, 1)))
    for s0 in range(0, rows, step):
        bad = ~torch.isfinite(t[..., s0:s0 + step, :])
        if bool(bad.any()):
            where = [int(w) for w in torch.nonzero(bad)[0].tolist()]
            where[-2] += s0
            raise ValueError(f"{name} contains NaN or inf (first at index {tuple(where)}); "
                             "pass check_finite=False to skip this check")


def _extremes(t):
    """``[max, min]`` of ``t`` as a float64 tensor on its device (no host synchronisation)."""
    torch = _torch()
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=t.device)
    if t.element_size() == 1:  # float8: no reductions of its own; a few rows at a time in float32
        rows = t.shape[-2]
        step = max(1, (1 << 20) // max(1, t.numel() // max(rows, 1)))
        parts = [_extremes(t[..., s0:s0 + step, :].to(torch.float32)) for s0 in range(0, rows, step)]
        stacked = torch.stack(parts)
        return torch.stack([stacked[:, 0].max(), stacked[:, 1].min()])
    lo, hi = torch.aminmax(t)
    return torch.stack([hi, lo]).to(torch.float64)


def parse(q, k, v, *, scale, check_finite_inputs: bool, dev, extremes=None):
    """`problem.parse` for the torch kernel: ``(q5, k5, v5, problem)`` with grouped tensor views
    on ``dev`` in their stored types.  The maxima are always found (one host synchronisation
    for the three); with ``check_finite_inputs`` non-finite ones are refused, naming the entry.
    ``extremes``, a dict: receives ``{"q": (max, min), ...}`` (for `problem.check_representable`)."""
    q, k, v = (as_tensor(x, name, dev) for x, name in ((q, "q"), (k, "k"), (v, "v")))

    def maxima():
        ext = np.asarray(_torch().stack([_extremes(x) for x in (q, k, v)]).cpu())  # (3, 2): one copy
        if extremes is not None:
            extremes.update(zip("qkv", ext))
        if check_finite_inputs and not np.isfinite(ext).all():
            for x, name, (hi, lo) in zip((q, k, v), "qkv", ext):
                if not (np.isfinite(hi) and np.isfinite(lo)):
                    _first_bad(x, name)
        return tuple(float(np.abs(e).max()) for e in ext)

    return problem.group(q, k, v, scale=scale, maxima=maxima)


_worker = threading.local()


def hold_one_thread():
    """The calling thread's torch threads held to one, once per thread: a worker thread's
    OpenMP and MKL settings are its own, which `threads` (run in the caller's thread) does not
    reach, and each worker's products would start a team of the process's default size on
    cores the other workers already use."""
    if not getattr(_worker, "held", False):
        _torch().set_num_threads(1)
        _worker.held = True


@contextlib.contextmanager
def threads(dev, workers):
    """torch's intra-op threads on the CPU held to ``workers`` (None: as they are) for a call."""
    torch = _torch()
    if dev.type != "cpu" or workers is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(workers)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=1)
def threads_pay() -> bool:
    """Whether torch's own threads make a tile's product at least 1.3 times faster on this
    CPU: a ``(256, 64) @ (64, 256)`` float64 product timed on one thread and on torch's
    default threads, medians of 21, once per process (a few milliseconds).  They do on an Intel
    Xeon (103 against 58 us, 2 threads, measured), and did not on an AMD EPYC (165 against
    330 us): the choice is measured where the kernel runs."""
    torch = _torch()
    n_threads = torch.get_num_threads()
    if n_threads < 2:
        return False
    a = torch.ones((1, 256, 64), dtype=torch.float64)
    b = torch.ones((1, 64, 256), dtype=torch.float64)
    out = torch.empty((1, 256, 256), dtype=torch.float64)

    def median(n):
        with threads(torch.device("cpu"), n):
            torch.matmul(a, b, out=out)  # warm-up: the threads started
            times = []
            for _ in range(21):
                start = time.perf_counter()
                torch.matmul(a, b, out=out)
                times.append(time.perf_counter() - start)
        return sorted(times)[10]

    return median(1) >= 1.3 * median(n_threads)


def on_device(result, given):
    """A result as the caller gave its inputs: tensors stay on the device; numpy inputs run
    with ``device=`` get numpy back (stats and other host objects pass through)."""
    if any(_is_torch_tensor(x) for x in given):
        return result
    torch = _torch()

    def host(x):  # exactly: bfloat16 as ml_dtypes'
        return as_numpy(x, "the result") if isinstance(x, torch.Tensor) else x

    return tuple(host(x) for x in result) if isinstance(result, tuple) else host(result)


def rounded(x, dtype):
    """``x`` rounded to the torch type ``dtype`` once, to nearest, as numpy rounds it.

    torch converts float64 to float16 through float32, rounding twice (50 of 10**6 standard
    normal values differ from numpy's by an ulp, measured): float64 goes to float32 rounded
    to odd (truncated, the last bit set when inexact), whose extra 13 bits make the second
    rounding the correct one.  bfloat16 and the other conversions round once already.
    """
    torch = _torch()
    if x.dtype != torch.float64 or dtype != torch.float16:
        return x.to(dtype)
    r = x.to(torch.float32)
    back = r.to(torch.float64)
    inexact = back != x
    r = torch.where(inexact & (back.abs() > x.abs()), torch.nextafter(r, torch.zeros_like(r)), r)
    return torch.where(inexact, (r.view(torch.int32) | 1).view(torch.float32), r).to(dtype)


# `float64_default`'s state, shared by every thread of the process.
_default_lock = threading.Lock()
_default_users = 0
_default_saved = None


@contextlib.contextmanager
def float64_default():
    """torch's default dtype float64 meanwhile, so that a user's ``mask_mod``/``score_mod``
    written with torch computes a Python float times an index tensor in float64, as numpy
    does (under torch's float32 default, ``0.1 * (q_idx - kv_idx)`` is rounded to float32:
    1.3e-7 off, measured).  Reference-counted across threads, like `parallel._parallel_settings`:
    the first entrant saves the default and the last one out restores it, exactly once."""
    global _default_users, _default_saved
    torch = _torch()
    with _default_lock:
        if _default_users == 0:
            _default_saved = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)
        _default_users += 1
    try:
        yield
    finally:
        with _default_lock:
            _default_users -= 1
            if _default_users == 0:
                torch.set_default_dtype(_default_saved)
                _default_saved = None
