"""Block-sparse index lists as the peers lay them out (docs/semantics.md, "Block-sparse lists"):
FlexAttention's / FlashAttention 4's counts and indices, FlashInfer's BSR; equal to the same mask
as a mask_mod on every path, their tile classes from the lists."""

import numpy as np
import pytest

import attnlib
from attnlib import block_mask_from_bsr, block_mask_from_kv_blocks
from attnlib.check import check_kernel
from attnlib.core.masks import FULL, PARTIAL, SKIP

B, H, SQ, SK, D = 2, 3, 200, 300, 16
BQ, BK = 32, 64
NQ, NK = -(-SQ // BQ), -(-SK // BK)


def lists(m, rng, fill=-7):
    """``(counts, indices)`` of the boolean block map ``m`` (B, H, nq, nk), in a random order per row,
    the unused slots holding ``fill`` (never read)."""
    counts = m.sum(-1)
    indices = np.full(m.shape, fill)
    for at in np.ndindex(m.shape[:-1]):
        listed = rng.permutation(np.flatnonzero(m[at]))
        indices[at + (slice(0, listed.size),)] = listed
    return counts, indices


def mod3(b, h, i, j):
    return (i + j) % 3 != 0


def inputs(seed=0, heads=H):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, heads, SQ, D))
    k, v = (rng.standard_normal((B, heads, SK, D)) for _ in range(2))
    return rng, q, k, v


@pytest.mark.parametrize("shared", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("with_mod", [True, False])
def test_kv_block_lists_equal_the_same_mask_as_a_mask_mod_on_every_path(shared, with_mod):
    rng, q, k, v = inputs()
    shape = (1 if shared[0] else B, 1 if shared[1] else H, NQ, NK)
    full = rng.random(shape) < 0.3
    part = (rng.random(shape) < 0.4) & ~full
    (pc, pi), (fc, fi) = lists(part, rng), lists(full, rng)
    mod = mod3 if with_mod else None
    block_mask = block_mask_from_kv_blocks(pc, pi, fc, fi, block_size=(BQ, BK), mask_mod=mod, seq_lengths=(SQ, SK))

    def same(b, h, i, j):  # the mask the lists describe
        at = (b if shape[0] > 1 else 0, h if shape[1] > 1 else 0, i // BQ, j // BK)
        return full[at] | (part[at] & (mod3(b, h, i, j) if with_mod else True))

    assert np.array_equal(block_mask.kinds, np.where(full, FULL, np.where(part, PARTIAL if with_mod else FULL, SKIP)))
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        out, lse = attnlib.attention(q, k, v, block_mask=block_mask, return_lse=True)
        want, want_lse = attnlib.attention(q, k, v, mask_mod=same, block_q=BQ, block_k=BK, return_lse=True)
        ref = attnlib.reference_attention(q, k, v, mask_mod=same)
        dout = rng.standard_normal(out.shape)
        grads = attnlib.attention_backward(q, k, v, out, lse, dout, block_mask=block_mask)
        ref_grads = attnlib.reference_attention_backward(q, k, v, dout, mask_mod=same)
    assert np.array_equal(out, want) and np.array_equal(lse, want_lse)
    assert np.abs(out - ref).max() < 1e-14
    assert all(np.abs(g - r).max() < 1e-13 for g, r in zip(grads, ref_grads))
    torch = pytest.importorskip("torch")
    on_torch = attnlib.attention(*(torch.tensor(x) for x in (q, k, v)), block_mask=block_mask)
    assert np.abs(on_torch.numpy() - out).max() < 1e-14


def test_the_lists_classes_skip_what_is_not_listed_and_call_mask_mod_on_partial_blocks_only():
    rng, q, k, v = inputs(1, heads=2)
    full = rng.random((1, 1, NQ, NK)) < 0.25  # shared by the batch and heads: one unit's tiles
    part = (rng.random((1, 1, NQ, NK)) < 0.25) & ~full
    pairs = []

    def counted(b, h, i, j):
        pairs.append(np.broadcast_shapes(np.shape(b), np.shape(h), np.shape(i), np.shape(j)))
        return mod3(b, h, i, j)

    block_mask = block_mask_from_kv_blocks(*lists(part, rng), *lists(full, rng), block_size=(BQ, BK),
                                           mask_mod=counted, seq_lengths=(SQ, SK))
    assert not pairs  # made from the lists alone
    _, stats = attnlib.attention(q, k, v, block_mask=block_mask, return_stats=True)
    listed = int((full | part).sum())
    assert stats.skipped_tiles == B * 2 * (NQ * NK - listed) and stats.processed_tiles == B * 2 * listed
    # mask_mod only on the partial tiles' pairs (a few probes of its elementwise check aside)
    evaluated = sum(int(np.prod(s)) for s in pairs)
    assert evaluated <= int(part.sum()) * BQ * BK * B * 2 + 64


def test_torch_block_mask_lists_are_read_alike():
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import BlockMask
    rng, q, k, v = inputs(2)
    full = rng.random((B, H, NQ, NK)) < 0.3
    part = (rng.random((B, H, NQ, NK)) < 0.4) & ~full
    (pc, pi), (fc, fi) = lists(part, rng, fill=0), lists(full, rng, fill=0)
    as_torch = BlockMask.from_kv_blocks(*(torch.tensor(x, dtype=torch.int32) for x in (pc, pi, fc, fi)),
                                        BLOCK_SIZE=(BQ, BK), mask_mod=lambda b, h, i, j: (i + j) % 3 != 0,
                                        seq_lengths=(SQ, SK))
    ours = block_mask_from_kv_blocks(as_torch.kv_num_blocks, as_torch.kv_indices, as_torch.full_kv_num_blocks,
                                     as_torch.full_kv_indices, block_size=(BQ, BK), mask_mod=mod3,
                                     seq_lengths=(SQ, SK))
    assert np.array_equal(attnlib.attention(q, k, v, block_mask=ours), attnlib.attention(q, k, v, block_mask=as_torch))


@pytest.mark.parametrize("with_mask", [True, False])
def test_flashinfer_bsr_equals_its_mask(with_mask):
    rng, q, k, v = inputs(3)
    r, c = 16, 32  # SQ, SK not multiples: the last blocks are cut
    nq, nk = -(-SQ // r), -(-SK // c)
    m = rng.random((nq, nk)) < 0.3
    indptr = np.concatenate([[0], np.cumsum(m.sum(1))])
    indices = np.concatenate([rng.permutation(np.flatnonzero(row)) for row in m])
    mask = rng.random((indices.size, r, c)) < 0.7 if with_mask else None
    if with_mask:
        mask[0], mask[1] = True, False  # a block every pair of which is visible (FULL), one with none (SKIP)
    block_mask = block_mask_from_bsr(indptr, indices, r, c, SQ, SK, mask=mask)
    position = np.full((nq, nk), -1)
    position[np.repeat(np.arange(nq), m.sum(1)), indices] = np.arange(indices.size)

    def same(b, h, i, j):
        t = position[i // r, j // c]
        return (t >= 0) & (mask[np.maximum(t, 0), i % r, j % c] if with_mask else True)

    out = attnlib.attention(q, k, v, block_mask=block_mask)
    assert np.array_equal(out, attnlib.attention(q, k, v, mask_mod=same, block_q=r, block_k=c))
    assert np.abs(out - attnlib.reference_attention(q, k, v, mask_mod=same)).max() < 1e-14
    kinds = block_mask.kinds[0, 0]
    assert np.array_equal(kinds != SKIP, m if not with_mask else m & (position != 1))
    if with_mask:
        first = np.argwhere(position == 0)[0]
        assert kinds[tuple(first)] == FULL


def test_the_check_takes_list_made_block_masks_and_fails_transposed_lists():
    rng, q, k, v = inputs(4)
    q, k, v = (x[:, :, :192] for x in (q, k, v))
    n = 192 // 32
    part = rng.random((1, 1, n, n)) < 0.5
    part[..., np.arange(n), np.arange(n)] = True  # every row sees a block
    block_mask = block_mask_from_kv_blocks(*lists(part, rng), block_size=32, mask_mod=mod3)
    flipped = block_mask_from_kv_blocks(*lists(np.swapaxes(part, -1, -2), rng), block_size=32, mask_mod=mod3)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    right = attnlib.attention(q32, k32, v32, block_mask=block_mask, compute_dtype="float32")
    assert check_kernel(q32, k32, v32, right, block_mask=block_mask, layout="bhsd").passed
    wrong = attnlib.attention(q32, k32, v32, block_mask=flipped, compute_dtype="float32")
    verdict = check_kernel(q32, k32, v32, wrong, block_mask=block_mask, layout="bhsd")
    assert not verdict.passed and any("the block lists transposed" in d for d in verdict.diagnosis), verdict.diagnosis


def test_bad_lists_are_refused_naming_them():
    counts = np.array([[[1, 2]]])
    indices = np.array([[[[0, 9], [1, 0]]]])  # slot 1 of row 0 unused: never read
    block_mask_from_kv_blocks(counts, indices, block_size=32, seq_lengths=(64, 64))
    with pytest.raises(ValueError, match="kv_num_blocks must lie in"):
        block_mask_from_kv_blocks(counts + 1, indices, block_size=32, seq_lengths=(64, 64))
    with pytest.raises(ValueError, match="kv_indices must list key blocks"):
        block_mask_from_kv_blocks(np.array([[[2, 2]]]), indices, block_size=32, seq_lengths=(64, 64))
    with pytest.raises(ValueError, match="full_kv_num_blocks and full_kv_indices go together"):
        block_mask_from_kv_blocks(counts, indices, counts, None, block_size=32, seq_lengths=(64, 64))
    with pytest.raises(TypeError, match="kv_indices must hold integers"):
        block_mask_from_kv_blocks(counts, indices.astype(float), block_size=32, seq_lengths=(64, 64))
    with pytest.raises(ValueError, match="indptr must be"):
        block_mask_from_bsr(np.array([0, 2, 1]), np.array([0, 1]), 32, 32, 64, 64)
    with pytest.raises(ValueError, match="indices must list key blocks"):
        block_mask_from_bsr(np.array([0, 1, 2]), np.array([0, 2]), 32, 32, 64, 64)
    with pytest.raises(ValueError, match="lists a block twice"):
        block_mask_from_bsr(np.array([0, 2]), np.array([0, 0]), 1, 2, 1, 2, mask=np.ones((2, 1, 2), bool))
    with pytest.raises(ValueError, match="mask must be boolean"):
        block_mask_from_bsr(np.array([0, 1, 2]), np.array([0, 1]), 32, 32, 64, 64, mask=np.ones((2, 32, 16), bool))
