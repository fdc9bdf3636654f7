import numpy as np
import pytest

from attnlib import FULL, PARTIAL, SKIP, MaskSpec


def brute_kind(mask, q0, q1, k0, k1):
    vis = mask.visible(np.arange(q0, q1), np.arange(k0, k1))
    return SKIP if not vis.any() else FULL if vis.all() else PARTIAL


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("sq, sk", [(37, 37), (50, 13), (13, 50), (1, 64), (64, 1)])
@pytest.mark.parametrize("bq, bk", [(8, 8), (5, 7), (16, 3), (64, 64)])
def test_closed_form_tile_kinds_match_brute_force(causal, align, sq, sk, bq, bk):
    mask = MaskSpec(sq, sk, causal, align)
    kinds = mask.tile_kinds(bq, bk)
    assert kinds.shape == (-(-sq // bq), -(-sk // bk))
    for a in range(kinds.shape[0]):
        for b in range(kinds.shape[1]):
            q0, q1, k0, k1 = a * bq, min(sq, a * bq + bq), b * bk, min(sk, b * bk + bk)
            assert kinds[a, b] == brute_kind(mask, q0, q1, k0, k1) == mask.tile_kind(q0, q1, k0, k1)


def test_causal_square_grid():
    kinds = MaskSpec(8, 8, True).tile_kinds(4, 4)
    np.testing.assert_array_equal(kinds, [[PARTIAL, SKIP], [FULL, PARTIAL]])


def test_unknown_alignment_is_refused():
    with pytest.raises(ValueError, match="causal_align"):
        MaskSpec(3, 3, True, "top_right")
