"""Native sparse attention (docs/semantics.md, "Native sparse attention"): the three branches
and their gated sum against a dense construction of their definition, the selection, and the
check of a kernel branch by branch."""

import numpy as np
import pytest

import attnlib
from attnlib import NSA, nsa_attention
from attnlib.check.nsa import check_nsa

B, H, HK, S, D = 1, 4, 2, 300, 16
SIZES = NSA(block_size=32, stride=16, select_block_size=64, top_n=3, window=64)


def dense_softmax_out(s, visible, v):
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(-1, keepdims=True)
    p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return p, p @ v


def dense_nsa(q, k, v, g, nsa, pool):
    """NSA written out whole: the compressed blocks pooled, the importance and top-n by loops."""
    sq, sk, group = q.shape[-2], k.shape[-2], q.shape[1] // k.shape[1]
    scale, t = 1 / np.sqrt(q.shape[-1]), np.arange(sq)[:, None] + sk - sq
    n_cmp = (sk - nsa.block_size) // nsa.stride + 1
    starts = np.arange(n_cmp) * nsa.stride
    kc = np.stack([pool(k[..., c:c + nsa.block_size, :]) for c in starts], -2)
    vc = np.stack([pool(v[..., c:c + nsa.block_size, :]) for c in starts], -2)
    rep = lambda x: np.repeat(x, group, 1)  # noqa: E731
    p_cmp, o_cmp = dense_softmax_out(scale * q @ np.swapaxes(rep(kc), -1, -2),
                                     starts[None, :] + nsa.block_size - 1 <= t, rep(vc))
    n_slc = -(-sk // nsa.select_block_size)
    imp = np.zeros(p_cmp.shape[:-1] + (n_slc,))
    for j in range(n_slc):
        for c, start in enumerate(starts):
            if start < (j + 1) * nsa.select_block_size and start + nsa.block_size > j * nsa.select_block_size:
                imp[..., j] += p_cmp[..., c]
    imp = imp.reshape(q.shape[0], k.shape[1], group, sq, n_slc).sum(2)
    chosen = np.zeros(q.shape[:2] + (sq, sk), dtype=bool)
    for b, hk, i in np.ndindex(q.shape[0], k.shape[1], sq):
        reach = t[i, 0] // nsa.select_block_size + 1
        forced = [j for j in range(reach) if j < nsa.initial_blocks or j >= reach - nsa.local_blocks]
        rest = sorted((j for j in range(reach) if j not in forced), key=lambda j: (-imp[b, hk, i, j], j))
        for j in (forced + rest)[:nsa.top_n]:
            chosen[b, hk * group:(hk + 1) * group, i, j * nsa.select_block_size:(j + 1) * nsa.select_block_size] = True
    s = scale * q @ np.swapaxes(rep(k), -1, -2)
    keys = np.arange(sk)[None, :]
    o_slc = dense_softmax_out(s, chosen & (keys <= t), rep(v))[1]
    o_win = dense_softmax_out(s, (keys <= t) & (keys > t - nsa.window), rep(v))[1]
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win


@pytest.mark.parametrize("pool", [None, lambda x: x.max(axis=-2)])
def test_nsa_equals_a_dense_construction_of_its_definition(pool):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, S, D))
    k, v = (rng.standard_normal((B, HK, S, D)) for _ in range(2))
    gates = rng.random((B, H, S, 3))
    nsa = NSA(**{**SIZES.__dict__, "pool": pool})
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        out, branches = nsa_attention(q, k, v, gates, nsa, return_branches=True)
    want = dense_nsa(q, k, v, gates, nsa, pool or (lambda x: x.mean(axis=-2)))
    assert np.abs(out - want).max() < 1e-14
    assert branches["blocks"].shape == (B, HK, S, SIZES.top_n)
    # a selection given is used as it is: the last query's blocks moved changes only that branch
    moved = branches["blocks"].copy()
    moved[..., -1, :] = [0, 1, 2]
    again = nsa_attention(q, k, v, gates, nsa, selected=moved, return_branches=True)[1]
    assert np.array_equal(again["compressed"], branches["compressed"])
    assert not np.array_equal(again["selected"][..., -1, :], branches["selected"][..., -1, :])


def test_the_check_judges_a_kernel_branch_by_branch_and_names_its_mixups():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, H, S, 32)).astype(np.float32)
    k, v = (rng.standard_normal((B, HK, S, 32)).astype(np.float32) for _ in range(2))
    gates = rng.random((B, H, S, 3))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    _, ours = nsa_attention(q64, k64, v64, gates, SIZES, return_branches=True)
    k_cmp, v_cmp = SIZES.compressed(k64, v64)
    parts = [attnlib.attention(q64, k_cmp, v_cmp, mask_mod=SIZES.compressed_mod(S, S), compute_dtype="float32"),
             attnlib.attention(q64, k64, v64, gather_kv_indices=SIZES.keys_of(ours["blocks"], S), causal=True,
                               compute_dtype="float32"),
             attnlib.attention(q64, k64, v64, causal=True, window=(SIZES.window - 1, 0), compute_dtype="float32")]
    g = gates.astype(np.float32)
    kernel = g[..., 0:1] * parts[0] + g[..., 1:2] * parts[1] + g[..., 2:3] * parts[2]

    def bshd(x):
        return np.swapaxes(x, 1, 2)

    found = check_nsa(bshd(q), bshd(k), bshd(v), bshd(kernel), gates, SIZES, selected=ours["blocks"],
                      branches=dict(zip(("compressed", "selected", "window"), map(bshd, parts))))
    assert found.passed and set(found.branches) == {"compressed", "selected", "window"}
    assert found.selection_differs == 0
    swapped = g[..., 2:3] * parts[0] + g[..., 1:2] * parts[1] + g[..., 0:1] * parts[2]
    wrong = check_nsa(q, k, v, swapped, gates, SIZES, layout="bhsd")
    assert not wrong.passed and any("the gates applied in the order window, selected, compressed" in n
                                    for n in wrong.out.notes)
    dropped = g[..., 0:1] * parts[0] + g[..., 2:3] * parts[2]
    wrong = check_nsa(q, k, v, dropped, gates, SIZES, layout="bhsd")
    assert not wrong.passed and any("the selected branch left out" in n for n in wrong.out.notes)


def test_bad_nsa_arguments_are_refused():
    with pytest.raises(ValueError, match="multiples of stride"):
        NSA(block_size=30, stride=16)
    with pytest.raises(TypeError, match="pool must be a function"):
        NSA(pool=3)
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 80, 8)) for _ in range(3))
    with pytest.raises(ValueError, match="gates must have shape"):
        nsa_attention(q, k, v, np.ones((1, 2, 80, 2)), SIZES)
    with pytest.raises(ValueError, match="selected must be integer block indices"):
        nsa_attention(q, k, v, np.ones((1, 2, 80, 3)), SIZES, selected=np.zeros((1, 2, 80, 2), int))
    with pytest.raises(ValueError, match=r"selected must hold block indices in \[0, 2\)"):
        nsa_attention(q, k, v, np.ones((1, 2, 80, 3)), SIZES, selected=np.full((1, 2, 80, 3), 99))
    with pytest.raises(ValueError, match="pool must map the blocks"):
        nsa_attention(q, k, v, np.ones((1, 2, 80, 3)), NSA(**{**SIZES.__dict__, "pool": lambda x: x}))


def _low_selection(q, k, v, nsa, dtype, head=None, rows=None, order=-1):
    """A kernel's selection: the compressed weights rounded to ``dtype`` (its scores in float32),
    the importance summed in float32 over the group (``head``: one query head's only), the top-n by
    it (``order=+1``: the least important), of each query (``rows``: another row's)."""
    import ml_dtypes
    from attnlib.core.nsa import _weights
    sq, sk, group = q.shape[-2], k.shape[-2], q.shape[1] // k.shape[1]
    k_cmp, v_cmp = nsa.compressed(k, v)
    lse = attnlib.attention(q, k_cmp, v_cmp, mask_mod=nsa.compressed_mod(sq, sk), return_lse=True,
                            compute_dtype="float32")[1].astype(np.float64)
    p = _weights(q.astype(np.float32).astype(np.float64), k_cmp, lse, nsa.compressed_mod(sq, sk),
                 1 / np.sqrt(q.shape[-1]), group)[0]
    p = p.astype(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else dtype).astype(np.float32)
    if head is not None:  # one head's importance for the whole group
        p = np.repeat(p[:, head::group], group, axis=1)
    imp = nsa.importance(p.astype(np.float64), group).astype(np.float32).astype(np.float64)
    picked = nsa.select(order * -imp if order > 0 else imp, sq, sk)
    return picked if rows is None else picked[..., rows, :]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_selection_has_a_verdict_near_ties_free_and_wrong_selections_fail(dtype):
    rng = np.random.default_rng(3)
    nsa = NSA(block_size=16, stride=8, select_block_size=32, top_n=4, window=32)
    sq = sk = 512
    q = rng.standard_normal((1, 4, sq, 32)) * 2
    k, v = (rng.standard_normal((1, 2, sk, 32)) for _ in range(2))
    gates = rng.random((1, 4, sq, 3))
    kwargs = dict(layout="bhsd", dtype=dtype)
    for selected in (_low_selection(q, k, v, nsa, dtype),
                     nsa_attention(q, k, v, gates, nsa, return_branches=True)[1]["blocks"]):
        out = nsa_attention(q, k, v, gates, nsa, selected=selected)
        r = check_nsa(q, k, v, out, gates, nsa, selected=selected, **kwargs)
        assert r.selection is not None and r.selection.passed, r.selection.notes
    wrong = {"one head's importance": _low_selection(q, k, v, nsa, dtype, head=0),
             "the next query's blocks": _low_selection(q, k, v, nsa, dtype, rows=np.minimum(np.arange(sq) + 32, sq - 1)),
             "the least important": _low_selection(q, k, v, nsa, dtype, order=+1)}
    right = _low_selection(q, k, v, nsa, dtype)
    dup = right.copy()
    dup[..., 200:, -1] = dup[..., 200:, -2]
    wrong["a block listed twice"] = dup
    for words, selected in wrong.items():
        out = nsa_attention(q, k, v, gates, nsa, selected=np.maximum(selected, -1))
        r = check_nsa(q, k, v, out, gates, nsa, selected=selected, **kwargs)
        assert not r.selection.passed and not r.passed, words
