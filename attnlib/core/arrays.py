"""Foreign arrays in, numpy arrays out: what a kernel's test suite hands the check.

A kernel under test lives in torch (on a GPU, in bfloat16), JAX, CuPy or numpy; the check
reads numpy.  `as_numpy` converts without the caller doing anything and without changing a
value: every floating type a kernel stores (float64/32/16, bfloat16, float8) is taken
exactly, the 8- and 16-bit types not numpy's own as `ml_dtypes` arrays (bit for bit), so
that the check still knows the type the kernel stored.

What holds no values to read is refused with an `UnreadableInput` naming the argument (a
``ValueError``, as `UnusableInput`, and a ``TypeError``): torch tensors on the ``meta``
device or fake ones, nested (ragged) and quantized tensors, complex ones, numpy masked
arrays with a masked entry, ragged or mixed Python lists.  What does hold them is read as it
is: sparse and mkldnn tensors densified, tensors requiring grad detached, conjugate and
negative views resolved, strided views as views; numpy subclasses (``np.matrix``,
``np.memmap``, a masked array with nothing masked) as plain ndarrays of the same memory.
Nothing given is ever modified.
"""

from __future__ import annotations

import math
import sys

import numpy as np


class UnusableInput(ValueError):
    """Inputs the check cannot judge (exit code 2); the message names the tensor and why."""


class UnreadableInput(UnusableInput, TypeError):
    """An argument whose values cannot be read as a numpy array; the message names it.  A
    ``ValueError`` (`UnusableInput`: exit code 2 in the CLI) and a ``TypeError`` alike, so
    that callers of `attnlib.attention` catching either see it."""


#: torch's floating types numpy lacks, by the ml_dtypes type of the same bits, and the
#: integer type of their width that torch can view them as.
_TORCH_ML = {"bfloat16": ("bfloat16", "int16"), "float8_e4m3fn": ("float8_e4m3fn", "int8"),
             "float8_e5m2": ("float8_e5m2", "int8"), "float8_e4m3fnuz": ("float8_e4m3fnuz", "int8"),
             "float8_e5m2fnuz": ("float8_e5m2fnuz", "int8")}


def _is_torch_tensor(x) -> bool:
    torch = sys.modules.get("torch")  # a tensor means torch is imported; never import it here
    return torch is not None and isinstance(x, torch.Tensor)


def _ml_dtype(name: str, what: str):
    try:
        import ml_dtypes
    except ImportError:
        raise UnusableInput(f"{what} is {name}, which numpy holds only through the ml_dtypes "
                            "package: pip install attnlib[lowp]") from None
    return np.dtype(getattr(ml_dtypes, name))


def _torch_refusal(t, what: str):
    """Why numpy cannot read torch tensor ``t``'s values, or None when it can."""
    import torch

    desc = f"({t.dtype}, shape {tuple(t.shape) if not t.is_nested else 'ragged'})"
    masked = getattr(getattr(torch, "masked", None), "MaskedTensor", None)
    if masked is not None and isinstance(t, masked):
        return (f"{what} is a torch MaskedTensor {desc}: its masked entries hold no values; pass "
                "a plain tensor and leave those entries out with kv_lengths, q_lengths or a mask_mod")
    fake = getattr(sys.modules.get("torch._subclasses.fake_tensor"), "FakeTensor", None)
    if t.device.type == "meta" or (fake is not None and isinstance(t, fake)):
        return (f"{what} is a torch tensor on the meta device {desc}, which holds no values"
                if t.device.type == "meta" else
                f"{what} is a torch FakeTensor {desc} (from torch.compile or FakeTensorMode), which "
                "holds no values")
    if t.is_nested:
        return (f"{what} is a nested (ragged) torch tensor of {t.dtype}: pad it into a dense tensor "
                "(to_padded_tensor) with kv_lengths/q_lengths, or judge a varlen kernel with "
                "layout='thd' and cu_seqlens_q/cu_seqlens_k")
    if t.is_quantized:
        return (f"{what} is a quantized torch tensor {desc}: its values are integers with a scale; "
                "pass dequantize()'s floating tensor")
    if t.is_complex():
        return f"{what} is a complex torch tensor {desc}: attention takes real floating values"
    return None


def _from_torch(t, what: str) -> np.ndarray:
    """A torch tensor (any device, any layout, with or without grad) as numpy, exactly."""
    import torch

    why = _torch_refusal(t, what)
    if why is not None:
        raise UnreadableInput(why)
    try:
        t = t.detach()  # never touches t's values, nor its autograd graph
        if t.layout != torch.strided:  # sparse (COO, CSR, CSC, BSR, BSC), mkldnn
            t = t.to_dense()
        t = t.resolve_conj().resolve_neg().cpu()
        name = str(t.dtype).removeprefix("torch.")
        if name in _TORCH_ML:
            ml_name, int_name = _TORCH_ML[name]
            dtype = _ml_dtype(ml_name, what)
            # The bits, unchanged: view as an integer of the same width, then as ml_dtypes' type.
            return t.contiguous().view(getattr(torch, int_name)).numpy().view(dtype)
        return t.numpy()
    except UnusableInput:
        raise
    except Exception as e:  # noqa: BLE001  a tensor subclass, a dtype numpy lacks, ...
        raise UnreadableInput(f"{what}: numpy cannot read this {type(t).__name__} of {t.dtype} "
                              f"(layout {t.layout}, on {t.device}): {e}") from None


def _from_subclass(x: np.ndarray, what: str) -> np.ndarray:
    """A numpy subclass as a plain ndarray of the same memory; a masked array only when no
    entry is masked (the values under a mask are not the array's)."""
    if isinstance(x, np.ma.MaskedArray):
        masked = int(np.count_nonzero(np.ma.getmaskarray(x)))
        if masked:
            raise UnreadableInput(
                f"{what} is a numpy masked array with {masked} masked entries of {x.size}: the values "
                "under a mask are not read as the array's; fill them (x.filled(...)) and leave "
                "them out with kv_lengths, q_lengths or a mask_mod")
        return np.ma.getdata(x)
    return np.asarray(x)  # np.matrix (always 2-D), np.memmap, ...: the same memory as an ndarray


def _leaves(x):
    """The non-sequence items of a nested list or tuple."""
    stack = [x]
    while stack:
        for item in stack.pop():
            if isinstance(item, (list, tuple)):
                stack.append(item)
            else:
                yield item


def _from_sequence(x, what: str) -> np.ndarray:
    """A (nested) list or tuple of numbers as an ndarray; ragged or unreadable ones refused."""
    for item in _leaves(x):
        if isinstance(item, np.ma.MaskedArray) and np.ma.getmaskarray(item).any():
            raise UnreadableInput(f"{what}: a {type(x).__name__} holding a numpy masked array with "
                                  "masked entries, whose values are not the array's")
    try:
        return np.asarray(x)
    except Exception as e:  # noqa: BLE001  ragged nesting, items numpy cannot read
        raise UnreadableInput(f"{what}: this {type(x).__name__} is not a rectangular array of numbers "
                              f"({e})") from None


def as_numpy(x, what: str):
    """``x`` as a numpy array: numpy arrays and scalars as they are, torch tensors on any
    device and of any float type (exactly), anything with ``__dlpack__`` (JAX, CuPy on the
    host) or ``__array__``.  None stays None.  An ndarray subclass comes back as a plain
    ndarray of the same memory (`UnreadableInput` for a masked array with masked entries).
    UnusableInput, naming ``what``, otherwise: `UnreadableInput` where there are no values to
    read (a meta tensor, a ragged list, ...)."""
    if x is None or type(x) is np.ndarray:
        return x
    if isinstance(x, np.ndarray):
        return _from_subclass(x, what)
    if _is_torch_tensor(x):
        return _from_torch(x, what)
    if isinstance(x, (list, tuple)):
        return _from_sequence(x, what)
    failed = None
    if hasattr(x, "__array__"):  # JAX (bfloat16 comes as ml_dtypes'), numpy scalars
        try:
            return np.asarray(x)
        except Exception as e:  # noqa: BLE001  e.g. CuPy refuses an implicit copy: try DLPack
            failed = e
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except Exception as e:  # noqa: BLE001
            raise UnreadableInput(f"{what}: numpy cannot read this {type(x).__module__}."
                                  f"{type(x).__name__} through DLPack ({e}); copy it to the host "
                                  "first") from None
    if failed is not None:
        raise UnreadableInput(f"{what}: numpy cannot read this {type(x).__module__}.{type(x).__name__} "
                              f"({type(failed).__name__}: {failed})") from None
    if isinstance(x, (int, float)):  # bool is an int: refused later as not floating
        return np.asarray(x)
    raise UnreadableInput(f"{what}: expected an array (numpy, torch, or anything with __array__ or "
                          f"__dlpack__), got {type(x).__module__}.{type(x).__name__}")

# The finite check looks at this many elements at a time, so it keeps the kernel's
# memory bound (a full ``np.isfinite(q)`` would allocate a bool copy of q).
_FINITE_CHUNK = 1 << 16

# Floating types of ml_dtypes (bfloat16, float8): not numpy floating subtypes, but real
# floating values all the same, converted to float64 exactly.
_ML_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2",
              "float8_e5m2fnuz", "float8_e4m3", "float8_e3m4", "float8_e8m0fnu", "float6_e2m3fn",
              "float6_e3m2fn", "float4_e2m1fn")


def _is_ml_float(dtype: np.dtype) -> bool:
    ml_dtypes = sys.modules.get("ml_dtypes")  # an array of its types means it is imported
    if ml_dtypes is None:
        return False
    return any(dtype == np.dtype(t) for t in (getattr(ml_dtypes, n, None) for n in _ML_FLOATS)
               if t is not None)


def as_float_array(x, name: str) -> np.ndarray:
    """``x`` as an ndarray of a real floating dtype (no copy for numpy float arrays).

    Arrays of the ml_dtypes floating types (bfloat16, float8) are converted to float64
    (exactly): numpy does not count them as floating, but they are real floats.  torch
    tensors (any device, any float type, with or without grad) are read exactly as well.
    """
    arr = np.asarray(as_numpy(x, name))  # tensors, lists, subclasses (masked arrays): read exactly or refused
    if not np.issubdtype(arr.dtype, np.floating):
        if _is_ml_float(arr.dtype):
            return arr.astype(np.float64)
        kind = "complex" if np.iscomplexobj(arr) else str(arr.dtype)
        raise TypeError(
            f"{name} must have a real floating dtype (float16/32/64, bfloat16), got {kind}"
        )
    # The kernels see C-contiguous arrays only (a view is copied once, here): BLAS sums in
    # another order on strided operands (4.4e-16 apart on AMD EPYC), so bits never depend on strides.
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def check_finite(x: np.ndarray, name: str) -> float:
    """``max |x|``, or ValueError if ``x`` holds NaN or inf.

    Two reductions, no temporary: ``min`` and ``max`` propagate NaN and show inf, so finite
    extremes prove the whole array finite, and give ``max |x|`` on the way (`parse` keeps
    it in the `Problem`, for `scores_may_overflow` and the value scaling).  Only an array
    that fails is scanned again, along the sequence axis in chunks, to name the first bad
    entry.
    """
    if x.size == 0:
        return 0.0
    low, high = float(x.min()), float(x.max())
    if math.isfinite(low) and math.isfinite(high):
        return max(abs(low), abs(high))
    per_row = x.size // x.shape[-2] if x.shape[-2] else 1
    step = max(1, _FINITE_CHUNK // max(per_row, 1))
    for s0 in range(0, x.shape[-2], step):
        finite = np.isfinite(x[..., s0 : s0 + step, :])
        if not finite.all():
            where = np.argwhere(~finite)[0]
            where[-2] += s0
            raise ValueError(
                f"{name} contains NaN or inf (first at index {tuple(int(w) for w in where)});"
                " pass check_finite=False to skip this check"
            )


def abs_max(x: np.ndarray) -> float:
    """``max |x|`` from two reductions (no ``|x|`` copy); 0 for an empty array."""
    if not x.size:
        return 0.0
    return max(abs(float(x.max())), abs(float(x.min())))


def finfo(dtype):
    """``np.finfo``, or ``ml_dtypes.finfo`` for its types (bfloat16), which numpy does not know."""
    try:
        return np.finfo(dtype)
    except ValueError:
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
