"""The dense reference against hand-built cases, so it cannot be wrong together with the kernel."""

import math

import numpy as np
import pytest

from attnlib import reference_attention, reference_rescales, reference_scores


def test_single_key_returns_its_value():
    q = np.array([[0.3, -1.0]])
    k = np.array([[2.0, 5.0]])
    v = np.array([[7.0, -8.0, 9.0]])
    out, lse = reference_attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out, v)
    assert lse[0] == pytest.approx((0.3 * 2 - 5.0) / math.sqrt(2), rel=1e-15)


def test_two_keys_by_hand():
    # scale 1: s = [1, 0]; p = [e, 1] / (e + 1)
    q = np.array([[1.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.0, 3.0]])
    v = np.array([[1.0], [-2.0]])
    out, lse = reference_attention(q, k, v, scale=1.0, return_lse=True)
    e = math.e
    assert out[0, 0] == pytest.approx((e * 1.0 + 1 * -2.0) / (e + 1), rel=1e-15)
    assert lse[0] == pytest.approx(math.log(e + 1), rel=1e-15)


def test_equal_scores_average_the_values():
    q = np.zeros((3, 4))
    k = np.ones((5, 4))
    v = np.arange(10.0).reshape(5, 2)
    out, lse = reference_attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, np.tile(v.mean(axis=0), (3, 1)), rtol=1e-15)
    np.testing.assert_allclose(lse, math.log(5), rtol=1e-15)


def test_huge_logits_pick_the_max_without_overflow(strict):
    q = np.array([[1.0]])
    k = np.array([[1e4], [0.0], [-1e4]])
    v = np.array([[3.0], [4.0], [5.0]])
    out, lse = reference_attention(q, k, v, scale=1.0, return_lse=True)
    assert out[0, 0] == 3.0
    assert lse[0] == 1e4


def test_all_very_negative_logits_still_normalise(strict):
    q = np.array([[1.0]])
    k = np.array([[-1e4], [-1e4 - math.log(3)]])
    v = np.array([[1.0], [0.0]])
    out, lse = reference_attention(q, k, v, scale=1.0, return_lse=True)
    assert out[0, 0] == pytest.approx(0.75, rel=1e-12)
    assert lse[0] == pytest.approx(-1e4 + math.log(4 / 3), rel=1e-15)


# The causal masks of the contract, drawn by hand (1 = visible).
HAND_MASKS = {
    (2, 5, "bottom_right"): [[1, 1, 1, 1, 0],
                             [1, 1, 1, 1, 1]],
    (2, 5, "top_left"): [[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0]],
    (5, 2, "bottom_right"): [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]],
    (5, 2, "top_left"): [[1, 0], [1, 1], [1, 1], [1, 1], [1, 1]],
    (3, 3, "bottom_right"): [[1, 0, 0], [1, 1, 0], [1, 1, 1]],
}


@pytest.mark.parametrize("sq, sk, align", sorted(HAND_MASKS))
def test_causal_masks_match_hand_drawn(sq, sk, align):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((sq, 4)), rng.standard_normal((sk, 4))
    s = reference_scores(q, k, causal=True, causal_align=align)
    np.testing.assert_array_equal(np.isfinite(s).astype(int), HAND_MASKS[sq, sk, align])


def test_fully_masked_rows_give_zero_and_minus_inf(strict):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((2, 4)), rng.standard_normal((2, 3))
    out, lse = reference_attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(out[:3], 0.0)
    assert np.all(lse[:3] == -np.inf)
    # Row 3 sees only key 0: its output is v[0].
    np.testing.assert_array_equal(out[3], v[0])


def test_empty_keys(strict):
    out, lse = reference_attention(np.ones((3, 4)), np.ones((0, 4)), np.ones((0, 2)), return_lse=True)
    assert out.shape == (3, 2) and np.all(out == 0) and np.all(lse == -np.inf)


def test_gqa_reads_contiguous_head_groups():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 6, 7, 8))
    k = rng.standard_normal((2, 3, 9, 8))
    v = rng.standard_normal((2, 3, 9, 5))
    out = reference_attention(q, k, v, causal=True)
    for h in range(6):
        one = reference_attention(q[:, h], k[:, h // 2], v[:, h // 2], causal=True)
        np.testing.assert_array_equal(out[:, h], one)


def test_softmax_written_out_for_one_row():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 6)), rng.standard_normal((4, 6)), rng.standard_normal((4, 2))
    s = [sum(q[0, t] * k[j, t] for t in range(6)) / math.sqrt(6) for j in range(4)]
    w = [math.exp(x) for x in s]
    expect = [sum(w[j] * v[j, c] for j in range(4)) / sum(w) for c in range(2)]
    out, lse = reference_attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out[0], expect, rtol=1e-14)
    assert lse[0] == pytest.approx(math.log(sum(w)), rel=1e-14)


def test_reference_rescales_by_hand():
    # One row, tiles of 2 keys: tile maxima 1, 0, 5, 5, 7 -> events in tiles 2 and 4.
    s = np.array([[1.0, -1.0, 0.0, 0.0, 5.0, 2.0, 5.0, 5.0, 7.0, -np.inf]])
    np.testing.assert_array_equal(reference_rescales(s, 1, 2), [[0, 0, 1, 0, 1]])
    # A row whose first tiles are masked: the first finite max is not an event.
    s = np.array([[-np.inf, -np.inf, 3.0, 4.0, 9.0]])
    np.testing.assert_array_equal(reference_rescales(s, 1, 2), [[0, 0, 1]])
