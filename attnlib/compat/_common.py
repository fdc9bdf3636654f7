"""What every drop-in reference shares: reading the caller's arrays, moving axes in the
caller's own kind (numpy or torch, on its device), the peers' LSE conventions, and the assert
twins' path into `attnlib.testing.assert_attention_close` (so the pytest plugin records them).

The references compute with `attnlib.attention` (and its varlen and paged forms) on the
caller's arrays as they are: torch tensors on their device, numpy on the host; results are
float64 of the same kind.  Nothing here is numerical: the attention is attnlib's.
"""

from __future__ import annotations

import math

import numpy as np

from ..core.arrays import _is_torch_tensor, as_numpy


def is_torch(x) -> bool:
    return _is_torch_tensor(x)


def swap(x, a: int = -3, b: int = -2):
    """``x`` with axes ``a`` and ``b`` exchanged, a view in its own kind (``bshd`` <-> ``bhsd``)."""
    if x is None:
        return None
    return x.transpose(a, b) if is_torch(x) else np.swapaxes(x, a, b)


def float64(x, name: str):
    """``x`` in float64, exactly, in its own kind (a torch tensor stays on its device)."""
    if x is None:
        return None
    if is_torch(x):
        import torch
        if not (x.is_floating_point()):
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
        return x.detach().to(torch.float64)
    from ..core.arrays import as_float_array
    return np.asarray(as_float_array(x, name), dtype=np.float64)


def as_host(x) -> np.ndarray:
    """A host numpy copy of ``x`` (exact)."""
    return np.asarray(as_numpy(x, "array"))


def ints(x, name: str, length: int | None = None) -> np.ndarray | None:
    """An integer argument (int, list, numpy or torch) as a host int64 array, or None;
    ``length``: an int is broadcast to it, an array must have it."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be integers, got {x!r}")
    if isinstance(x, (int, np.integer)) and length is not None:
        return np.full(length, int(x), np.int64)
    arr = np.asarray(as_numpy(x, name))
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    arr = arr.astype(np.int64)
    if length is not None and arr.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {tuple(arr.shape)}")
    return arr


def like(x, template):
    """``x`` in ``template``'s kind: a torch tensor on its device, or a numpy array."""
    if is_torch(template) and not is_torch(x):
        import torch
        return torch.as_tensor(np.asarray(as_numpy(x, "array")), device=template.device)
    if not is_torch(template) and is_torch(x):
        return np.asarray(as_numpy(x, "array"))
    return x


def index(x, idx: np.ndarray):
    """``x[idx]`` (a gather along the first axis) with a host index, in ``x``'s kind."""
    if is_torch(x):
        import torch
        return x[torch.as_tensor(idx, device=x.device)]
    return x[idx]


def zeros_like(x, shape):
    """float64 zeros of ``shape`` in ``x``'s kind and device."""
    if is_torch(x):
        import torch
        return torch.zeros(shape, dtype=torch.float64, device=x.device)
    return np.zeros(shape, np.float64)


def concat(parts, like, axis: int = 0):
    if is_torch(like):
        import torch
        return torch.cat(list(parts), dim=axis)
    return np.concatenate(list(parts), axis=axis)


def empty_like_peer(like):
    """The empty tensor a peer returns in place of an output it did not compute."""
    if is_torch(like):
        import torch
        return torch.empty(0, dtype=torch.float64, device=like.device)
    return np.empty(0, np.float64)


def scalar(x, name: str, *, default=None, positive=False, allow_zero=True):
    """A real Python float (None and ``default`` as given): a clear error otherwise."""
    if x is None:
        return default
    if getattr(x, "ndim", None) == 0 and hasattr(x, "item"):  # a 0-d tensor or array, as torch takes
        x = x.item()
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {x!r}")
    x = float(x)
    if not math.isfinite(x) or (positive and (x < 0 or (x == 0 and not allow_zero))):
        raise ValueError(f"{name} must be a finite{' non-negative' if positive else ''} number, got {x!r}")
    return x


def dtype_name(x) -> str:
    """The name of ``x``'s type as the check takes it (``dtype=``): torch's without ``torch.``."""
    return str(x.dtype).replace("torch.", "")


def no_own_keywords(check: dict, own, peer: str) -> None:
    """A ``TypeError`` for check keywords a twin sets itself from the peer's own arguments."""
    given = sorted(set(check) & set(own))
    if given:
        raise TypeError(f"{', '.join(given)}: given by {peer}'s own arguments (pass those instead), "
                        "not by the check's keywords")


def assert_close(out, q, k, v, **check):
    """The assert twins' one path: `attnlib.testing.assert_attention_close` (the plugin's
    recorder sees every verdict, under the twin's name: the nearest public ``assert_*`` caller)."""
    import inspect

    from .. import testing
    name = next((f.function for f in inspect.stack()[1:8] if f.function.startswith("assert_")
                 and f.function.endswith("_close") and "compat" in f.filename), "assert_close")
    token = testing._entry.set(name)
    try:
        testing.assert_attention_close(out, q, k, v, **check)
    finally:
        testing._entry.reset(token)


def result_lse(result, name: str, *, position: int = 1):
    """``(out, lse)`` of a kernel's result: a tensor alone (no lse) or a tuple/list whose
    ``position``-th item is the lse (None allowed)."""
    if isinstance(result, (tuple, list)):
        if not result:
            raise ValueError(f"{name}: an empty result")
        lse = result[position] if len(result) > position else None
        if lse is not None and hasattr(lse, "numel") and lse.numel() == 0 and position:
            lse = None
        return result[0], lse
    return result, None
