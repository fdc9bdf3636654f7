"""FlexAttention's ``mask_mod``, ``score_mod`` and block masks on a torch device.

The functions are called as FlexAttention calls them, with integer tensors on the device:
``b (*heads, 1, 1)``, ``h (*heads, 1, 1)``, ``q_idx (r, 1)``, ``kv_idx (1, c)`` per tile (and
``score`` for a ``score_mod``), so a function written with torch operations runs where the
tensors are.  A function written with numpy (one that raises on tensors, or returns no
tensor) is called on the host's index arrays instead (`attnlib.core.flex`), its result moved
to the device: correct anywhere, a host round trip per tile.

The block mask a ``mask_mod`` alone implies is made on the device (`block_mask`): the
function once per pair, a tile at a time, the classes read back once.
"""

from __future__ import annotations

import numpy as np

from . import device as dev_mod
from . import flex
from .masks import FULL, PARTIAL, SKIP


def on_device(fn, name: str, dev):
    """``fn`` as a function of device tensors returning a device tensor (None stays None)."""
    if fn is None:
        return None
    torch = dev_mod._torch()
    fn = flex._torch_source(fn) or fn  # a `flex.from_torch` wrapper: the torch function inside
    state = {}  # "torch" once the function has taken tensors, "host" once it has not

    def host(*args):
        arrays = [a.cpu().numpy() if isinstance(a, torch.Tensor) else a for a in args]
        return torch.as_tensor(np.asarray(flex._call(fn, arrays, name)), device=dev)

    def call(*args):
        if state.get("how") == "host":
            return host(*args)
        try:
            with dev_mod.float64_default():  # Python floats times index tensors: float64, as in numpy
                out = fn(*args)
        except Exception:  # noqa: BLE001 - a numpy-written function: the host computes it
            if state.get("how") == "torch":
                raise
            state["how"] = "host"
            return host(*args)
        # No tensor, or a numpy ufunc's result wrapped back into one (a mask as uint8): numpy-written.
        if not isinstance(out, torch.Tensor) or (name == "mask_mod" and out.dtype == torch.uint8):
            if state.get("how") == "torch":
                return out if isinstance(out, torch.Tensor) else torch.as_tensor(np.asarray(out), device=dev)
            state["how"] = "host"
            return host(*args)
        state["how"] = "torch"
        return out if out.device == dev else out.to(dev)

    call.__name__ = getattr(fn, "__name__", name)
    return call


def checked_mask(m, shape):
    """A ``mask_mod``'s result ``m`` over a tile, as a bool tensor of ``shape``, or a clear error."""
    torch = dev_mod._torch()
    if m.dtype != torch.bool:
        raise TypeError(f"mask_mod must return booleans (as FlexAttention's), got dtype {m.dtype}")
    try:
        return m.expand(shape)
    except RuntimeError:
        raise ValueError(f"mask_mod returned shape {tuple(m.shape)}, which does not broadcast to the "
                         f"tile's {tuple(shape)}: write it with elementwise operations on its index "
                         "arguments") from None


def checked_scores(out, s, name="score_mod"):
    """A ``score_mod``'s result ``out`` over the tile's scores ``s``: a new tensor of its shape
    and type, or a clear error."""
    torch = dev_mod._torch()
    if not isinstance(out, torch.Tensor):
        out = torch.as_tensor(np.asarray(out), device=s.device)
    if out.dtype == torch.bool or out.is_complex():
        raise TypeError(f"{name} must return numbers, got dtype {out.dtype}")
    try:
        return out.expand(s.shape).to(s.dtype).clone()
    except RuntimeError:
        raise ValueError(f"{name} returned shape {tuple(out.shape)}, which does not broadcast to "
                         f"the tile's {tuple(s.shape)}") from None


def device_mods(opts, pb, tiles, dev):
    """`Options.mods` for a device kernel: None without programmable options, else
    ``(mask_mod, score_mod, block_mask)`` checked, a ``mask_mod``'s block mask made on ``dev``."""
    if not opts.has_mods:
        return None
    if opts.mask_mod is not None and opts.block_mask is None:
        opts = opts.replace(block_mask=block_mask(opts.mask_mod, pb, tiles, dev))
    return opts.mods(pb, tiles)


def block_mask(mask_mod, pb, tiles, dev) -> flex.BlockMask:
    """`flex.create_block_mask` of ``mask_mod`` over the call's batch entries and query heads,
    evaluated on ``dev`` (one ``(B, H, block_q, block_k)`` tile at a time); the classes come
    back to the host once."""
    torch = dev_mod._torch()
    fn = on_device(mask_mod, "mask_mod", dev)
    nb = max(1, int(np.prod(pb.batch)))
    bq, bk = tiles.block_q, tiles.block_k
    nq, nk = -(-pb.sq // bq), -(-pb.sk // bk)
    b = torch.arange(nb, device=dev)[:, None, None, None]
    h = torch.arange(pb.hq, device=dev)[None, :, None, None]
    kinds = torch.empty((nb, pb.hq, nq, nk), dtype=torch.int8, device=dev)
    for a in range(nq):
        q_idx = torch.arange(a * bq, min(pb.sq, (a + 1) * bq), device=dev)[:, None]
        for t in range(nk):
            kv_idx = torch.arange(t * bk, min(pb.sk, (t + 1) * bk), device=dev)[None, :]
            m = checked_mask(fn(b, h, q_idx, kv_idx), (nb, pb.hq, len(q_idx), kv_idx.shape[1]))
            some, every = m.any(dim=-1).any(dim=-1), m.all(dim=-1).all(dim=-1)
            kinds[:, :, a, t] = torch.where(every, FULL, torch.where(some, PARTIAL, SKIP)).to(torch.int8)
    return flex.BlockMask(kinds.cpu().numpy(), bq, bk, pb.sq, pb.sk, mask_mod)
