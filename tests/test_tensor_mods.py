"""attnlib.tensor_mods: a boolean mask or an additive bias tensor as FlexAttention mods, exact on
the numpy and torch paths and in the backward."""

import numpy as np
import pytest
import torch

import attnlib


def dense(q, k, v, mask, bias):
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]) + bias
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return (p / np.where(l > 0, l, 1)) @ v, (p / np.where(l > 0, l, 1)) @ np.abs(v)


@pytest.mark.parametrize("bias_shape,mask_shape", [((2, 1, 5, 7), (5, 7)), ((7,), (2, 3, 1, 7)), ((3, 5, 7), (1, 1, 5, 1))])
def test_tensor_mods_exact_forward_torch_backward(bias_shape, mask_shape):
    rng = np.random.default_rng(len(bias_shape) + 3 * len(mask_shape))
    q, k, v = rng.standard_normal((2, 3, 5, 8)), rng.standard_normal((2, 3, 7, 8)), rng.standard_normal((2, 3, 7, 4))
    bias = rng.standard_normal(bias_shape)
    bias.reshape(-1)[:2] = -np.inf
    mask = rng.random(mask_shape) > 0.3
    copies = bias.copy(), mask.copy()
    mods = attnlib.tensor_mods(attn_mask=mask, attn_bias=bias, batch=(2,), heads=3, sq=5, sk=7)
    out, lse = attnlib.attention(q, k, v, mask_mod=mods["mask_mod"], score_mod=mods["score_mod"], return_lse=True,
                                 block_q=2, block_k=3)
    ref, pv = dense(q, k, v, mask, bias)
    assert (np.abs(out - ref) <= 1e-13 * pv + 1e-300).all()
    out_t = attnlib.attention(*(torch.from_numpy(x) for x in (q, k, v)), mask_mod=mods["mask_mod"],
                              score_mod=mods["score_mod"])
    assert (np.abs(out_t.numpy() - ref) <= 1e-13 * pv + 1e-300).all()
    dout = rng.standard_normal(out.shape)
    grads = attnlib.attention_backward(q, k, v, out, lse, dout, **mods)
    qt, kt, vt = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    s = qt @ kt.transpose(-1, -2) / np.sqrt(8) + torch.from_numpy(bias)
    s = s.masked_fill(~torch.from_numpy(np.broadcast_to(mask, s.shape).copy()), -np.inf)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    (p @ vt).backward(torch.from_numpy(dout))
    for g, t in zip(grads, (qt, kt, vt)):
        assert np.abs(g - t.grad.numpy()).max() <= 1e-13 * (np.abs(t.grad.numpy()).max() + 1)
    assert np.array_equal(bias, copies[0]) and np.array_equal(mask, copies[1])


def test_tensor_mods_errors():
    with pytest.raises(ValueError, match="attn_bias"):
        attnlib.tensor_mods(attn_bias=np.ones((3, 4)), heads=1, sq=5, sk=4)
    with pytest.raises(TypeError, match="attn_mask"):
        attnlib.tensor_mods(attn_mask=np.ones((5, 4)), heads=1, sq=5, sk=4)
    with pytest.raises(ValueError, match="NaN"):
        attnlib.tensor_mods(attn_bias=np.full((5, 4), np.nan), heads=1, sq=5, sk=4)
