import numpy as np
import pytest

import attnlib
from attnlib import (FAMILIES, adversarial_qkv, log10_histogram, max_abs_error, naive_rel_error,
                     normwise_error, random_qkv, reference_scores, rel_error)


def test_random_qkv_shapes_and_seeding():
    q, k, v = random_qkv(5, 7, 4, 3, batch=(2,), heads=4, kv_heads=2, seed=1)
    assert (q.shape, k.shape, v.shape) == ((2, 4, 5, 4), (2, 2, 7, 4), (2, 2, 7, 3))
    again = random_qkv(5, 7, 4, 3, batch=(2,), heads=4, kv_heads=2, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v), again))
    assert not np.array_equal(q, random_qkv(5, 7, 4, 3, batch=(2,), heads=4, kv_heads=2, seed=2)[0])
    assert random_qkv(5, d=4)[0].shape == (5, 4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("causal, align", [(True, "bottom_right"), (True, "top_left"), (False, "bottom_right")])
def test_families_have_the_documented_structure(family, causal, align):
    sq, sk, bk = 96, 160, 16
    q, k, v = adversarial_qkv(family, sq, sk, d=16, block_k=bk, causal=causal, causal_align=align, seed=3)
    s = reference_scores(q, k, causal=causal, causal_align=align)
    rows = np.isfinite(s).any(axis=-1)
    row_max = s.max(axis=-1, initial=-np.inf)
    arg = s.argmax(axis=-1)
    last = np.where(np.isfinite(s), np.arange(sk), -1).max(axis=-1)
    if family == "negative":
        assert np.all(np.abs(s[np.isfinite(s)] + 1e4) < 20)
        return
    if family in ("plateau", "ramp", "ties", "sink"):  # 1e4 (+ 2 per key tile for the ramp) + O(1) noise
        ramp = 2.0 * np.arange(sk) / bk if family == "ramp" else np.zeros(sk)
        if family == "sink":  # key 0: the sink, 25 above the rest; it holds every row's max
            ramp[0] = 25.0
            assert np.all(arg[rows] == 0)
        noise = np.where(np.isfinite(s), s - 1e4 - ramp, 0.0)
        assert np.abs(noise).max() < 10 and np.abs(noise).max() > 0.1
        if family == "ties":  # identical keys: a row's visible logits are all the same number
            assert all(np.unique(s[i][np.isfinite(s[i])]).size == 1 for i in np.flatnonzero(rows))
        return
    if family == "growing":  # peak * (b + 1) / n_tiles at the row's last tile b
        expect = 1e4 * (last[rows] // bk + 1) / -(-sk // bk)
        np.testing.assert_allclose(row_max[rows], expect, atol=10)
    else:
        assert np.all(row_max[rows] > 0.99e4)
    if family == "first_tile":
        assert np.all(arg[rows] == 0)
    elif family == "last_tile":
        np.testing.assert_array_equal(arg[rows], (last[rows] // bk) * bk)
    else:  # growing: the max sits at the start of the last visible tile and every tile grows
        np.testing.assert_array_equal(arg[rows], (last[rows] // bk) * bk)
    # All other logits are O(1) noise when the family has one big logit per row.
    if family in ("first_tile", "last_tile"):
        others = s.copy()
        others[np.arange(sq)[rows], arg[rows]] = -np.inf
        assert np.abs(others[np.isfinite(others)]).max() < 10


def test_last_tile_with_more_tiles_than_channels():
    q, k, v = adversarial_qkv("last_tile", 300, d=4, block_k=16, seed=0)
    s = reference_scores(q, k, causal=True)
    last = np.arange(300)
    np.testing.assert_array_equal(s.argmax(axis=-1), (last // 16) * 16)


def test_family_validation():
    with pytest.raises(ValueError, match="family must be one of"):
        adversarial_qkv("huge", 8)
    with pytest.raises(ValueError, match="peak must be"):
        adversarial_qkv("growing", 8, peak=-1.0)
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        random_qkv(4, heads=3, kv_heads=2)
    # The letters, one each, in order ("" in "abcd" and "ab" in "abcd" both hold).
    assert [fam.letter for fam in FAMILIES.values()] == [chr(ord("a") + i) for i in range(len(FAMILIES))]
    assert all(fam.stresses for fam in FAMILIES.values())


def test_metrics_by_hand():
    ref = np.array([[1.0, -1.0], [0.0, 0.0]])
    ref_abs = np.array([[2.0, 4.0], [0.0, 0.0]])  # row 1: no visible key
    out = np.array([[1.0 + 1e-10, -1.0], [0.0, 3e-12]])
    assert rel_error(out, ref, ref_abs) == pytest.approx(5e-11, rel=1e-6)
    assert naive_rel_error(out, ref) == pytest.approx(1e-10, rel=1e-6)
    assert max_abs_error(out, ref) == pytest.approx(1e-10, rel=1e-6)
    assert normwise_error(out, ref) == pytest.approx(1e-10, rel=1e-6)
    out2 = np.array([[1.0, -1.0], [0.0, 3e-8]])
    assert rel_error(out2, ref, ref_abs) == pytest.approx(3e-8)  # absolute where P|V| = 0


@pytest.mark.slow
def test_rel_error_is_the_gate_naive_is_not():
    # Cancellation: values of both signs average to nearly 0, where any rounding looks large.
    q, k, v = random_qkv(2048, 2048, 64, seed=4)
    e = attnlib.attention_errors(attnlib.attention(q, k, v, block_q=64, block_k=64), q, k, v)
    assert e.rel_error < 1e-14
    assert e.naive_rel_error > 100 * e.rel_error


def test_reference_with_abs_is_p_times_abs_v():
    q, k, v = random_qkv(20, 30, 8, seed=5)
    ref, ref_abs = attnlib.reference_with_abs(q, k, v, causal=True)
    np.testing.assert_array_equal(ref, attnlib.reference_attention(q, k, v, causal=True))
    np.testing.assert_allclose(ref_abs, attnlib.reference_attention(q, k, np.abs(v), causal=True), rtol=1e-15)
    assert np.all(ref_abs >= np.abs(ref) - 1e-15)


def test_log10_histogram_counts_everything():
    # Every value in its own bin, not just a total (which clipping makes 7 by construction):
    # 0 and 1e-20 clip into the first bin, 1e-3 into the last, 1e-6 = 10**hi is the last
    # bin's closed right edge, 1e-15 = 10**-15 opens bin 3 and 9e-16 just misses it.
    values = [0.0, 1e-20, 9e-16, 1e-15, 3e-12, 1e-6, 1e-3]
    edges, counts = log10_histogram(values, lo=-18, hi=-6, bins_per_decade=1)
    np.testing.assert_array_equal(edges, np.arange(-18, -5))
    np.testing.assert_array_equal(counts, [2, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 2])
    # Default bins are quarter decades: log10(3e-12) = -11.52 falls in [-11.75, -11.5).
    edges, counts = log10_histogram([3e-12])
    assert len(edges) == 49 and np.flatnonzero(counts).tolist() == [25] and edges[25] == -11.75


def test_random_cases_are_seeded_and_cover_the_corners():
    a, b = attnlib.random_cases(20, seed=3), attnlib.random_cases(20, seed=3)
    assert a == b and a != attnlib.random_cases(20, seed=4)
    assert (a[0].sq, a[0].sk) == (4096, 4096)
    assert a[1].sq > a[1].sk and a[2].sq < a[2].sk
    assert all(1 <= c.sq <= 4096 and 1 <= c.sk <= 4096 and c.heads % c.kv_heads == 0 for c in a)


def test_expected_rescales_theory():
    # One row over t equal tiles expects H_t - 1 (the first tile is never an event).
    for t in (1, 2, 5, 64):
        harmonic = sum(1.0 / i for i in range(1, t + 1))
        e = attnlib.expected_rescales(1, 16 * t, 1, 16)
        assert e.shape == (1, t) and e[0, 0] == 0
        assert e.sum() == pytest.approx(harmonic - 1, rel=1e-14)
    # The figure quoted for n = 4096, causal, 64 x 64 tiles.
    assert attnlib.expected_rescales(4096, 4096, 64, 64, causal=True).sum() == pytest.approx(11432.8, abs=0.1)
    # A ragged last tile: c = 4 visible keys of C = 20 in all.
    assert attnlib.expected_rescales(1, 20, 1, 16)[0, 1] == pytest.approx(4 / 20)


@pytest.mark.slow
def test_expected_rescales_match_a_seeded_average():
    # Averaged over seeds, measured counts approach the i.i.d. expectation.
    totals = []
    for seed in range(20):
        q, k, v = random_qkv(256, d=16, seed=seed)
        _, stats = attnlib.attention(q, k, v, causal=True, block_q=16, block_k=16, return_stats=True)
        totals.append(stats.total_rescales)
    expected = attnlib.expected_rescales(256, 256, 16, 16, causal=True).sum()
    assert np.mean(totals) == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_max_rescales_is_every_visible_tile_after_the_first(align):
    sq, sk, bq, bk = 40, 70, 8, 16
    mask = attnlib.MaskSpec(sq, sk, True, align)
    vis = mask.visible(np.arange(sq), np.arange(sk))
    tiles_seen = np.stack([vis[:, b:b + bk].any(axis=1) for b in range(0, sk, bk)], axis=1)
    per_row = np.maximum(tiles_seen.sum(axis=1) - 1, 0)
    got = attnlib.max_rescales(sq, sk, bq, bk, causal=True, causal_align=align)
    assert got.sum() == per_row.sum()
    q, k, v = adversarial_qkv("growing", sq, sk, d=16, block_k=bk, causal_align=align, seed=0)
    _, stats = attnlib.attention(q, k, v, causal=True, causal_align=align, block_q=bq, block_k=bk,
                                 return_stats=True)
    np.testing.assert_array_equal(stats.rescales, got)
