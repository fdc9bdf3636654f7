import numpy as np

from attnlib import OnlineSoftmax


def state_over(s, v, splits):
    """An OnlineSoftmax fed the key ranges between ``splits`` one by one."""
    st = OnlineSoftmax.empty(s.shape[:-1], v.shape[-1])
    for a, b in zip(splits[:-1], splits[1:]):
        st.update(s[..., a:b], v[a:b])
    return st


def softmax_out(s, v):
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p @ v) / p.sum(axis=-1, keepdims=True), np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)


def test_tiles_in_any_split_give_the_softmax():
    rng = np.random.default_rng(0)
    s, v = 5 * rng.standard_normal((6, 40)), rng.standard_normal((40, 3))
    ref_out, ref_lse = softmax_out(s, v)
    for splits in ([0, 40], [0, 1, 2, 40], [0, 13, 26, 39, 40], list(range(41))):
        out, lse = state_over(s, v, splits).finalize()
        np.testing.assert_allclose(out, ref_out, rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-14)


def test_fully_masked_tile_leaves_state_bit_identical(strict):
    rng = np.random.default_rng(1)
    s, v = rng.standard_normal((4, 8)), rng.standard_normal((8, 2))
    st = state_over(s, v, [0, 8])
    m, l, acc = st.m.copy(), st.l.copy(), st.acc.copy()
    rescaled = st.update(np.full((4, 5), -np.inf), rng.standard_normal((5, 2)))
    assert not rescaled.any()
    np.testing.assert_array_equal(st.m, m)
    np.testing.assert_array_equal(st.l, l)
    np.testing.assert_array_equal(st.acc, acc)


def test_row_without_keys_finalizes_to_zero_and_minus_inf(strict):
    st = OnlineSoftmax.empty((3,), 2)
    st.update(np.full((3, 4), -np.inf), np.ones((4, 2)))
    out, lse = st.finalize()
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_rescale_events_are_strict_increases_of_a_finite_max():
    st = OnlineSoftmax.empty((1,), 1)
    v = np.ones((2, 1))
    events = [bool(st.update(np.array([x]), v)[0]) for x in ([-np.inf, -np.inf], [1.0, 0.0], [1.0, 0.5], [2.0, 0.0])]
    assert events == [False, False, False, True]


def test_merge_is_associative_and_empty_is_neutral(strict):
    rng = np.random.default_rng(2)
    s, v = 30 * rng.standard_normal((5, 30)), rng.standard_normal((30, 4))
    a, b, c = state_over(s[:, :10], v[:10], [0, 10]), state_over(s[:, 10:20], v[10:20], [0, 10]), state_over(s[:, 20:], v[20:], [0, 10])
    left = a.merge(b).merge(c).finalize()
    right = a.merge(b.merge(c)).finalize()
    whole = state_over(s, v, [0, 30]).finalize()
    for x, y in zip(left, right):
        np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-15)
    for x, y in zip(left, whole):
        np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-15)
    empty = OnlineSoftmax.empty((5,), 4)
    for x, y in zip(a.merge(empty).finalize(), a.finalize()):
        np.testing.assert_array_equal(x, y)
    out, lse = empty.merge(empty).finalize()
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_update_with_visible_equals_update_without():
    """Evaluating exp only on the visible entries (update's ``visible``) changes nothing."""
    rng = np.random.default_rng(3)
    for keys_first in (False, True):
        a = OnlineSoftmax.empty((2, 8), 5, keys_first=keys_first)
        b = OnlineSoftmax.empty((2, 8), 5, keys_first=keys_first)
        for t in range(4):
            s = rng.normal(size=(2, 6, 8) if keys_first else (2, 8, 6)) * 10
            vis = rng.random(s.shape) < 0.5
            if t == 0:
                vis[...] = False  # rows that see nothing yet
            s[~vis] = -np.inf
            v = rng.normal(size=(2, 6, 5))
            ea = a.update(s.copy(), v, keys_first=keys_first)
            eb = b.update(s.copy(), v, keys_first=keys_first, visible=vis)
            np.testing.assert_array_equal(ea, eb)
            for x, y in zip((a.m, a.l, a.acc), (b.m, b.l, b.acc)):
                np.testing.assert_array_equal(x, y)
