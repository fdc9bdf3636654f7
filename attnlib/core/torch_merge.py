"""`attnlib.core.online.merge_attention` in torch, on the partials' own device, in float64.

A module of its own because `attnlib.core.online` sits at the bottom of the core's import
graph (`validate` and `masks` import it), so it may reach torch only through modules that
import neither: this one imports `device` alone.  `merge_parts` and `lse_of` live here,
for `online` and for `attnlib.core.torch_tiled` (split-KV, the stream) alike.
"""

from __future__ import annotations

import math

from . import device as dev_mod
from .arrays import _is_torch_tensor


def lse_of(parts):
    """``m + log l`` of lse parts ``(..., 2)``; ``-inf`` where the row saw no key."""
    torch = dev_mod._torch()
    seen = torch.isfinite(parts[..., 1])
    return torch.where(seen, parts[..., 0] + torch.where(seen, parts[..., 1], 0.0), -math.inf)


def merge_parts(outs, parts):
    """`attnlib.core.online.merge_parts` in torch: partials with two-part lse ``(m, log l)``."""
    torch = dev_mod._torch()
    big_m = parts[0][..., 0]
    for p in parts[1:]:
        big_m = torch.maximum(big_m, p[..., 0])
    shift = torch.where(torch.isfinite(big_m), big_m, 0.0)
    logs = [(p[..., 0] - shift) + p[..., 1] for p in parts]  # log(l_r exp(m_r - M)); -inf: none
    top = logs[0]
    for c in logs[1:]:
        top = torch.maximum(top, c)
    ref = torch.where(torch.isfinite(top), top, 0.0)  # the largest term: its weight exp(0) keeps L >= 1
    big_l = sum(torch.exp(c - ref) for c in logs)
    seen = big_l > 0
    log_l = torch.where(seen, torch.log(torch.where(seen, big_l, 1.0)) + ref, -math.inf)  # log L, rel. to M
    out = torch.zeros_like(outs[0])
    for o_r, c in zip(outs, logs):
        w = torch.exp(c - torch.where(seen, log_l, 0.0))  # sums to 1 over the partials; 0 where none
        out = out + w[..., None] * torch.where(torch.isfinite(c)[..., None], o_r, 0.0)
    bound = max(float(o_r.abs().max()) if o_r.numel() else 0.0 for o_r in outs)
    merged = torch.stack([torch.where(seen, big_m, -math.inf), log_l], dim=-1)
    return out.clamp(-bound, bound), merged


def _real_float(x, name, dev, host_check):
    """``x`` as a float64 tensor on ``dev``, refused as `online._real_float` (``host_check``,
    which reads what is not a tensor) refuses it: a TypeError naming ``name`` unless it
    holds real floating numbers."""
    torch = dev_mod._torch()
    if _is_torch_tensor(x) and not x.is_floating_point():
        kind = "complex" if x.is_complex() else str(x.dtype).removeprefix("torch.")
        raise TypeError(f"{name} must be an array of real floating numbers, got {kind}")
    if not _is_torch_tensor(x):  # lists, numpy arrays: the host's checks and conversion
        x = host_check(x, name)
    return dev_mod.as_tensor(x, name, dev).to(torch.float64)


def merge_attention(outs, lses, dev, host_check):
    """`attnlib.core.online.merge_attention` computed with torch on ``dev``: the same checks
    in the same order (the values' checks gathered in one host synchronisation), float64
    tensors out.  ``host_check``: `online._real_float`, for the entries that are not tensors
    (passed in: this module may not import `online`)."""
    torch = dev_mod._torch()
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_attention needs as many outs as lses, at least one; "
                         f"got {len(outs)} and {len(lses)}")
    parts, flags, failed = [], [], None
    for r, (out, lse) in enumerate(zip(outs, lses)):
        try:  # the host checks of partial r (types, shapes), before the values of the ones before it
            out = _real_float(out, f"outs[{r}]", dev, host_check)
            lse = _real_float(lse, f"lses[{r}]", dev, host_check)
            if out.ndim < 2:
                raise ValueError(f"outs[{r}] must have shape (..., Sq, Dv), got {tuple(out.shape)}")
            if out.shape[:-1] != lse.shape:
                raise ValueError(f"outs[{r}] {tuple(out.shape)} and lses[{r}] {tuple(lse.shape)} do not "
                                 "match ((..., Sq, Dv) and (..., Sq))")
            if parts and out.shape != parts[0][0].shape:
                raise ValueError(f"outs[{r}] has shape {tuple(out.shape)}, outs[0] {tuple(parts[0][0].shape)}")
        except (TypeError, ValueError) as e:
            failed = e
            break
        flags += [(torch.isnan(lse) | torch.isposinf(lse)).any(), (~torch.isfinite(out)).any()]
        parts.append((out, lse))
    bad = [bool(b) for b in torch.stack(flags).cpu()] if flags else []  # one synchronisation
    for i, b in enumerate(bad):
        if b:
            r = i // 2
            raise ValueError(f"lses[{r}] must be finite or -inf" if i % 2 == 0 else
                             f"outs[{r}] contains NaN or inf")
    if failed is not None:
        raise failed
    with torch.no_grad():
        out, merged = merge_parts([o for o, _ in parts],
                                  [torch.stack([lse, torch.where(torch.isfinite(lse), 0.0, -math.inf)], dim=-1)
                                   for _, lse in parts])
        return out, lse_of(merged)
