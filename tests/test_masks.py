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


# tile_visible: the fast per-tile mask must equal the contract's `visible` everywhere.

from hypothesis import given
from hypothesis import strategies as st

from attnlib.core.masks import BAND_CACHE_BYTES, mask_specs


@st.composite
def masked_tiles(draw):
    sq, sk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    side = st.one_of(st.none(), st.integers(0, 45))
    options = dict(causal=draw(st.booleans()), causal_align=draw(st.sampled_from(["bottom_right", "top_left"])),
                   window=(draw(side), draw(side)), q_len=draw(st.one_of(st.none(), st.integers(0, sq))),
                   kv_len=draw(st.one_of(st.none(), st.integers(0, sk))))
    if draw(st.booleans()):  # documents: ascending (packed) or in any order
        n_docs = draw(st.integers(1, 5))
        q_ids = np.array(draw(st.lists(st.integers(0, n_docs), min_size=sq, max_size=sq)))
        kv_ids = np.array(draw(st.lists(st.integers(0, n_docs), min_size=sk, max_size=sk)))
        if draw(st.booleans()):
            q_ids, kv_ids = np.sort(q_ids), np.sort(kv_ids)
        options.update(q_segments=q_ids, kv_segments=kv_ids)
    # The 2026 variants: left-padded keys, chunks, sink tokens (each drawn or not).
    end = sk if options["kv_len"] is None else options["kv_len"]
    options.update(kv_start=draw(st.one_of(st.just(0), st.integers(0, end))),
                   chunk=draw(st.one_of(st.none(), st.integers(1, 12))),
                   sink_tokens=draw(st.one_of(st.just(0), st.integers(1, 5))))
    # A second batch entry with other lengths (another alignment offset) shares the cache.
    kv_len = draw(st.integers(0, sk))
    other = dict(options, q_len=draw(st.integers(0, sq)), kv_len=kv_len,
                 kv_start=min(options["kv_start"], kv_len))
    specs = [MaskSpec(sq, sk, **options), MaskSpec(sq, sk, **other)]
    bq, bk = draw(st.integers(1, sq)), draw(st.integers(1, sk))
    return specs, bq, bk


@pytest.mark.slow
@given(masked_tiles(), st.booleans())
def test_tile_visible_equals_visible(case, keys_first):
    specs, bq, bk = case
    cache = {}
    for spec in specs + specs:  # the second round reads the band masks from the cache
        # The contract's visibility of every pair, once: each tile must equal its slice.
        whole = spec.visible(np.arange(spec.sq), np.arange(spec.sk))

        def want(rows, k0, k1):
            return whole[rows, k0:k1].T if keys_first else whole[rows, k0:k1]

        for q0 in range(0, spec.sq, bq):
            rows = np.arange(q0, min(spec.sq, q0 + bq))
            for k0 in range(0, spec.sk, bk):
                k1 = min(spec.sk, k0 + bk)
                got = spec.tile_visible(rows, k0, k1, keys_first, contiguous=True, cache=cache)
                np.testing.assert_array_equal(got, want(rows, k0, k1))
                # Rows that are not one run (a GQA-packed tile repeats them): no cache.
                twice = np.tile(rows, 2)
                np.testing.assert_array_equal(spec.tile_visible(twice, k0, k1, keys_first, cache=cache),
                                              want(twice, k0, k1))


def test_tile_visible_cache_is_shared_by_a_diagonal_and_bounded():
    spec = MaskSpec(4096, 4096, causal=True, window=(100, None))
    cache = {}
    for q0 in range(0, 4096, 256):  # the diagonal tiles: one mask
        spec.tile_visible(np.arange(q0, q0 + 256), q0, q0 + 256, True, contiguous=True, cache=cache)
    assert len(cache) == 1
    for d in range(64):  # many offsets (different windows): the cache never outgrows its bound
        other = MaskSpec(4096, 4096, causal=True, window=(d, None))
        other.tile_visible(np.arange(512, 768), 512, 768, True, contiguous=True, cache=cache)
        assert sum(a.nbytes for a in cache.values()) <= BAND_CACHE_BYTES
    # A cached mask cannot be changed by a caller by mistake.
    assert not any(a.flags.writeable for a in cache.values())


@pytest.mark.slow
@given(masked_tiles(), st.data())
def test_a_piece_sees_what_the_whole_sees(case, data):
    """MaskSpec.piece: the rule of a (query range, key range) piece in its own positions."""
    for spec in case[0]:
        q0 = data.draw(st.integers(0, spec.sq - 1))
        q1 = data.draw(st.integers(q0 + 1, spec.sq))
        k0 = data.draw(st.integers(0, spec.sk - 1))
        k1 = data.draw(st.integers(k0 + 1, spec.sk))
        piece = spec.piece(q0, q1, k0, k1)
        whole = spec.visible(np.arange(q0, q1), np.arange(k0, k1))
        np.testing.assert_array_equal(piece.visible(np.arange(q1 - q0), np.arange(k1 - k0)), whole)
        kind = SKIP if not whole.any() else FULL if whole.all() else PARTIAL
        ranges = piece.kv_ranges(np.array([0]))
        got = piece.tile_kind(0, q1 - q0, 0, k1 - k0, ranges)
        # The closed form may call a tile with no visible pair PARTIAL (documents, chunks
        # and sink tokens with other rules), never the other way round.
        inexact = spec.q_segments is not None or spec.chunk is not None or spec.sink_tokens
        assert got == kind or (got == PARTIAL and kind == SKIP and inexact)


@pytest.mark.slow
@given(masked_tiles(), st.data())
def test_any_visible_is_exact(case, data):
    for spec in case[0]:
        q0 = data.draw(st.integers(0, spec.sq - 1))
        q1 = data.draw(st.integers(q0 + 1, spec.sq))
        k0 = data.draw(st.integers(0, spec.sk - 1))
        k1 = data.draw(st.integers(k0 + 1, spec.sk))
        assert spec.any_visible(q0, q1, k0, k1) == spec.visible(np.arange(q0, q1), np.arange(k0, k1)).any()
    # Single pairs and a short key range from every row: the edges of windows and documents.
    spec, full = case[0][0], case[0][0].visible(np.arange(case[0][0].sq), np.arange(case[0][0].sk))
    if spec.q_segments is not None or spec.chunk is not None or spec.sink_tokens:
        for i in range(spec.sq):
            for j in range(spec.sk):
                assert spec.any_visible(i, i + 1, j, j + 1) == full[i, j]
                assert spec.any_visible(i, i + 1, j, min(spec.sk, j + 3)) == full[i, j:j + 3].any()
                assert spec.any_visible(i, i + 1, max(0, j - 2), j + 1) == full[i, max(0, j - 2):j + 1].any()


# -- the 2026 variants, hand-built (FlashAttention's masks: tests/test_variants.py) --------------

def test_the_contracts_drawings():
    """The 0/1 matrices of docs/semantics.md (Sq = 4, Sk = 8, causal, bottom_right)."""
    def drawn(**kw):
        spec = mask_specs((1,), 4, 8, causal=True, **kw)
        spec = spec[(0,)] if (0,) in spec else spec[()]
        return spec.visible(np.arange(4), np.arange(8)).astype(int).tolist()

    assert drawn(attention_chunk=4) == [[0, 0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 0, 0],
                                        [0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1]]
    assert drawn(window=(1, None), sink_token_length=2) == [[1, 1, 0, 1, 1, 0, 0, 0], [1, 1, 0, 0, 1, 1, 0, 0],
                                                            [1, 1, 0, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 1, 1]]
    assert drawn(key_leftpad=[3]) == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0, 0],
                                      [0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("given, error, match", [
    (dict(attention_chunk=-1), ValueError, "attention_chunk"),
    (dict(attention_chunk=2.5), TypeError, "attention_chunk"),
    (dict(sink_token_length=-2), ValueError, "sink_token_length"),
    (dict(key_leftpad=[9]), ValueError, "key_leftpad"),
    (dict(key_leftpad=[5], kv_lengths=[4]), ValueError, "key_leftpad must not exceed"),
    (dict(key_leftpad=[1, 2]), ValueError, "key_leftpad"),
])
def test_bad_variant_arguments_are_named(given, error, match):
    with pytest.raises(error, match=match):
        mask_specs((1,), 4, 8, **given)


def test_a_left_padded_tile_past_every_rows_reach_is_skipped():
    # Found in review: the right bound was tested against k0, not the first valid key, so
    # this tile (every row's reach ends inside the padding) was PARTIAL and any_visible True.
    spec = MaskSpec(8, 6, causal=True, kv_start=2)  # o = -2: rows 0..3 reach keys <= 1
    assert not spec.visible(np.arange(4), np.arange(6)).any()
    assert spec.tile_kind(0, 4, 0, 6) == SKIP and not spec.any_visible(0, 4, 0, 6)
