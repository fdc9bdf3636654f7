"""Foreign arrays in, numpy arrays out: what a kernel's test suite hands the check.

A kernel under test lives in torch (on a GPU, in bfloat16), JAX, CuPy or numpy; the check
reads numpy.  `as_numpy` converts without the caller doing anything and without changing a
value: every floating type a kernel stores (float64/32/16, bfloat16, float8) is taken
exactly, the 8- and 16-bit types not numpy's own as `ml_dtypes` arrays (bit for bit), so
that the check still knows the type the kernel stored.
"""

from __future__ import annotations

import sys

import numpy as np

from .shapes import UnusableInput

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


def _from_torch(t, what: str) -> np.ndarray:
    """A torch tensor (any device, any layout, with or without grad) as numpy, exactly."""
    import torch

    t = t.detach()
    if t.is_sparse or t.layout != torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg().cpu()
    name = str(t.dtype).removeprefix("torch.")
    if name in _TORCH_ML:
        ml_name, int_name = _TORCH_ML[name]
        dtype = _ml_dtype(ml_name, what)
        # The bits, unchanged: view as an integer of the same width, then as ml_dtypes' type.
        return t.contiguous().view(getattr(torch, int_name)).numpy().view(dtype)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as e:
        raise UnusableInput(f"{what}: a torch tensor of {t.dtype} has no numpy form ({e})") from None


def as_numpy(x, what: str):
    """``x`` as a numpy array: numpy arrays and scalars as they are, torch tensors on any
    device and of any float type (exactly), anything with ``__dlpack__`` (JAX, CuPy on the
    host) or ``__array__``.  None stays None.  UnusableInput, naming ``what``, otherwise."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if _is_torch_tensor(x):
        return _from_torch(x, what)
    if hasattr(x, "__array__"):  # JAX (bfloat16 comes as ml_dtypes'), lists of numbers, memmaps
        try:
            return np.asarray(x)
        except (TypeError, ValueError, RuntimeError):
            pass  # e.g. CuPy refuses an implicit copy from the device: try DLPack
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, ValueError, RuntimeError, BufferError) as e:
            raise UnusableInput(f"{what}: numpy cannot read this {type(x).__module__}."
                                f"{type(x).__name__} through DLPack ({e}); copy it to the host "
                                "first") from None
    if isinstance(x, (list, tuple, int, float)):
        return np.asarray(x)
    raise UnusableInput(f"{what}: expected an array (numpy, torch, or anything with __array__ or "
                        f"__dlpack__), got {type(x).__module__}.{type(x).__name__}")
