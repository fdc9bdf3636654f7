"""The implementations timed: attnlib's kernels, the dense numpy reference, and PyTorch.

PyTorch is an optional peer (``pip install attnlib[peers]``), never a dependency: without
it the torch entries are simply absent.  Every entry is ``name: (prepare, run)``, as
`timing.time_cases` takes them: ``prepare(q, k, v, causal)`` builds the arguments (untimed),
``run(args)`` is the timed call.
"""

from __future__ import annotations

import numpy as np

from ..core.backward import attention_backward, reference_attention_backward
from ..core.reference import reference_attention
from ..core.tiled import attention

#: The name of attnlib's kernel called with default arguments (every CPU, BLAS at one thread).
DEFAULT = "attnlib"


def torch_or_none():
    """The torch module, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_name(torch) -> str:
    return f"torch {torch.__version__} SDPA"


def _serial_name(w: int) -> str:
    return f"attnlib w={w}"


def implementations(workers=(1,), include_torch=True, include_dense=True) -> dict:
    """Forward passes: attnlib by default, attnlib with each of ``workers`` threads, dense
    numpy and (when installed) torch SDPA with ``is_causal``."""
    impls = {DEFAULT: (_as_is, lambda a: attention(*a[:3], causal=a[3]))}
    for w in workers:
        impls[_serial_name(w)] = (_as_is, lambda a, w=w: attention(*a[:3], causal=a[3], workers=w))
    if include_dense:
        impls["dense numpy"] = (_as_is, lambda a: reference_attention(*a[:3], causal=a[3]))
    torch = torch_or_none() if include_torch else None
    if torch is not None:
        import torch.nn.functional as F

        impls[torch_name(torch)] = (
            lambda q, k, v, c: tuple(torch.from_numpy(x) for x in (q, k, v)) + (c,),
            lambda a: F.scaled_dot_product_attention(a[0], a[1], a[2], is_causal=a[3]))
    return impls


def backward_implementations(workers=(1,), include_torch=True, include_dense=True) -> dict:
    """Backward passes, as `implementations`: the forward (with ``lse``, or torch's
    autograd graph) is built in ``prepare``, so only the gradient is timed."""
    def upstream(q, v):  # the same dout for every implementation: (..., Sq, Dv)
        return np.random.default_rng(1).standard_normal(q.shape[:-1] + v.shape[-1:])

    def prepare(q, k, v, c):
        out, lse = attention(q, k, v, causal=c, return_lse=True)
        return q, k, v, out, lse, upstream(q, v), c

    impls = {DEFAULT: (prepare, lambda a: attention_backward(*a[:6], causal=a[6]))}
    for w in workers:
        impls[_serial_name(w)] = (prepare, lambda a, w=w: attention_backward(
            *a[:6], causal=a[6], workers=w))
    if include_dense:
        impls["dense numpy"] = (prepare, lambda a: reference_attention_backward(
            *a[:3], a[5], causal=a[6]))
    torch = torch_or_none() if include_torch else None
    if torch is not None:
        import torch.nn.functional as F

        def torch_prepare(q, k, v, c):
            dout = torch.from_numpy(upstream(q, v))
            q, k, v = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=c), (q, k, v), dout

        impls[torch_name(torch)] = (torch_prepare, lambda a: torch.autograd.grad(
            a[0], a[1], a[2], retain_graph=True))
    return impls


def _as_is(*args):
    return args
