"""Windows, padding, documents, softcap, ALiBi: hand-built references, then tiled vs dense."""

import math

import numpy as np
import pytest


from attnlib import (BOUND, FULL, PARTIAL, SKIP, MaskSpec, attention, attention_errors, random_qkv,
                     reference_attention, reference_scores)

EPS = np.finfo(np.float64).eps


def pattern(sq, sk, **kw):
    """The 0/1 visibility the reference applies (for 2-D inputs)."""
    rng = np.random.default_rng(0)
    s = reference_scores(rng.standard_normal((sq, 4)), rng.standard_normal((sk, 4)), **kw)
    return np.isfinite(s).astype(int)


# -- the reference against tiny hand-drawn masks ------------------------------------------

def test_window_both_sides():
    expect = [[1, 1, 0, 0, 0],
              [1, 1, 1, 0, 0],
              [0, 1, 1, 1, 0],
              [0, 0, 1, 1, 1],
              [0, 0, 0, 1, 1]]
    np.testing.assert_array_equal(pattern(5, 5, window=(1, 1)), expect)


def test_causal_window_forces_right_zero():
    expect = [[1, 0, 0, 0, 0],
              [1, 1, 0, 0, 0],
              [1, 1, 1, 0, 0],
              [0, 1, 1, 1, 0],
              [0, 0, 1, 1, 1]]
    np.testing.assert_array_equal(pattern(5, 5, causal=True, window=(2, 3)), expect)
    np.testing.assert_array_equal(pattern(5, 5, window=(2, 0)), expect)


def test_window_alignments():
    # Sq = 2, Sk = 5: bottom_right o = 3, top_left o = 0; window (1, 0).
    np.testing.assert_array_equal(pattern(2, 5, window=(1, 0)), [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(pattern(2, 5, window=(1, 0), causal_align="top_left"),
                                  [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(pattern(2, 5, window=(None, 1), causal_align="top_left"),
                                  [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])


def test_padding_uses_the_actual_lengths_for_alignment():
    # Arrays Sq = 4, Sk = 6; actual q_len 2, kv_len 3: o = 3 - 2 = 1.
    q, k = np.ones((1, 1, 4, 2)), np.ones((1, 1, 6, 2))
    s = reference_scores(q, k, causal=True, q_lengths=[2], kv_lengths=[3])
    expect = [[1, 1, 0, 0, 0, 0],
              [1, 1, 1, 0, 0, 0],
              [0, 0, 0, 0, 0, 0],
              [0, 0, 0, 0, 0, 0]]
    np.testing.assert_array_equal(np.isfinite(s[0, 0]).astype(int), expect)


def test_documents():
    q, k = np.ones((1, 4, 2)), np.ones((1, 5, 2))
    s = reference_scores(q[None], k[None], q_segment_ids=[[0, 0, 1, 1]], kv_segment_ids=[[0, 1, 1, 1, 2]])
    expect = [[1, 0, 0, 0, 0],
              [1, 0, 0, 0, 0],
              [0, 1, 1, 1, 0],
              [0, 1, 1, 1, 0]]
    np.testing.assert_array_equal(np.isfinite(s[0, 0]).astype(int), expect)


def test_softcap_by_hand():
    q, k = np.array([[3.0]]), np.array([[2.0], [-1.0], [40.0]])
    v = np.array([[1.0], [2.0], [4.0]])
    s = [30 * math.tanh(x / 30) for x in (6.0, -3.0, 120.0)]
    w = [math.exp(x) for x in s]
    out, lse = reference_attention(q, k, v, scale=1.0, softcap=30.0, return_lse=True)
    assert out[0, 0] == pytest.approx(sum(wi * vi for wi, vi in zip(w, (1, 2, 4))) / sum(w), rel=1e-14)
    assert lse[0] == pytest.approx(math.log(sum(w)), rel=1e-14)
    np.testing.assert_allclose(reference_scores(q, k, scale=1.0, softcap=30.0)[0], s, rtol=1e-15)


def test_alibi_by_hand():
    # One head, Sq = 2, Sk = 3, bottom_right o = 1, slope 0.5; causal hides (0, 2).
    q, k = np.zeros((1, 2, 1)), np.zeros((1, 3, 1))
    s = reference_scores(q, k, causal=True, alibi_slopes=[0.5])
    expect = [[-0.5, 0.0, -np.inf],
              [-1.0, -0.5, 0.0]]
    np.testing.assert_array_equal(s[0], expect)
    # Per-batch slopes (batch, Hq) and top_left alignment.
    s2 = reference_scores(q[None].repeat(2, 0), k[None].repeat(2, 0), alibi_slopes=[[1.0], [2.0]],
                          causal_align="top_left")
    np.testing.assert_array_equal(s2[1, 0], [[0, -2, -4], [-2, 0, -2]])


def test_zero_key_batch_entry_and_empty_rows(strict):
    q, k, v = random_qkv(6, 5, 4, batch=(2,), heads=2, seed=0)
    out, lse = reference_attention(q, k, v, kv_lengths=[3, 0], q_lengths=[4, 6], return_lse=True)
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    assert np.all(out[0, :, 4:] == 0) and np.all(lse[0, :, 4:] == -np.inf)
    sub = reference_attention(q[0, :, :4], k[0, :, :3], v[0, :, :3])
    np.testing.assert_allclose(out[0, :, :4], sub, rtol=0, atol=1e-15)


# -- closed-form tile classes against brute force ------------------------------------------

def brute(spec, q0, q1, k0, k1):
    vis = spec.visible(np.arange(q0, q1), np.arange(k0, k1))
    return SKIP if not vis.any() else FULL if vis.all() else PARTIAL


@pytest.mark.parametrize("seed", range(60))
def test_tile_kinds_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    sq, sk = (int(x) for x in rng.integers(1, 90, 2))
    side = lambda: None if rng.random() < 0.3 else int(rng.integers(0, 40))  # noqa: E731
    spec = MaskSpec(sq, sk, causal=bool(rng.random() < 0.5),
                    causal_align=str(rng.choice(["bottom_right", "top_left"])),
                    window=(side(), side()), q_len=int(rng.integers(0, sq + 1)),
                    kv_len=int(rng.integers(0, sk + 1)))
    bq, bk = (int(x) for x in rng.integers(1, 33, 2))
    kinds = spec.tile_kinds(bq, bk)
    for a in range(kinds.shape[0]):
        for b in range(kinds.shape[1]):
            q0, k0 = a * bq, b * bk
            assert kinds[a, b] == brute(spec, q0, min(sq, q0 + bq), k0, min(sk, k0 + bk)), (spec, a, b)


@pytest.mark.parametrize("sorted_ids", [True, False])
def test_segment_tile_kinds_are_sound(sorted_ids):
    rng = np.random.default_rng(1)
    proved = {True: 0, False: 0}  # SKIP/FULL tiles classified exactly / left PARTIAL
    for _ in range(20):
        sq, sk = 70, 90
        q_ids, kv_ids = rng.integers(0, 4, sq), rng.integers(0, 4, sk)
        if sorted_ids:
            q_ids, kv_ids = np.sort(q_ids), np.sort(kv_ids)
        spec = MaskSpec(sq, sk, causal=bool(rng.random() < 0.5), q_segments=q_ids, kv_segments=kv_ids)
        kinds = spec.tile_kinds(16, 16)
        for a in range(kinds.shape[0]):
            for b in range(kinds.shape[1]):
                truth = brute(spec, a * 16, min(sq, a * 16 + 16), b * 16, min(sk, b * 16 + 16))
                # SKIP and FULL must be exact; PARTIAL may stand for either (id ranges only).
                assert kinds[a, b] == truth or kinds[a, b] == PARTIAL
                if truth != PARTIAL:
                    proved[kinds[a, b] == truth] += 1
    # Sound alone would pass a classifier that never skips: the id ranges must prove almost
    # every SKIP or FULL tile (measured: all but 2 of 344 sorted, 3 of 57 unsorted).
    assert proved[True] > 0 and proved[False] <= proved[True] // 10, proved


# -- the tiled kernel against the dense reference ------------------------------------------

def largest_logit(q, k, **kw):
    """``max(1, max |s|)`` over the visible scores: float64 rounds each logit by about
    ``eps * |s|``, which moves its softmax weight by as much, relatively."""
    s = reference_scores(q, k, **kw)
    visible = np.abs(s[np.isfinite(s)])
    return max(1.0, float(visible.max())) if visible.size else 1.0


def check(q, k, v, strict=True, **kw):
    tiles = dict(block_q=kw.pop("block_q", 32), block_k=kw.pop("block_k", 48))
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        out, lse = attention(q, k, v, return_lse=True, **tiles, **kw)
        ref, ref_lse = reference_attention(q, k, v, return_lse=True, **kw)
        err = attention_errors(out, q, k, v, **kw).rel_error
    assert err < BOUND, (kw, err)
    # BOUND is the contract; float64 rounding justifies a few eps per unit of the largest
    # logit (measured over this file: out at most 2.7 eps * max|s|, lse 5.6), so that a
    # feature computed wrong by 1e-12 relative (a slope, a cap, a window edge) fails here.
    tol = 32 * EPS * largest_logit(q, k, **kw)
    assert err < tol, (kw, err, tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=0, atol=tol)
    assert np.all(out[~fin] == 0)
    return err


ALIGNS = ["bottom_right", "top_left"]
SHAPES = [(150, 150), (97, 230), (230, 97)]


@pytest.mark.slow
@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("sq, sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_windows(align, sq, sk, causal):
    rng = np.random.default_rng(sq * sk)
    q, k, v = random_qkv(sq, sk, 16, batch=(2,), heads=4, kv_heads=2, seed=sq + sk)
    windows = [(0, 0), (0, None), (None, 0), (None, None)]
    windows += [tuple(None if rng.random() < 0.2 else int(rng.integers(0, 120)) for _ in range(2))
                for _ in range(4)]
    for window in windows:
        check(q, k, v, causal=causal, causal_align=align, window=window)


@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("sq, sk", SHAPES)
def test_padded_batches(align, sq, sk):
    rng = np.random.default_rng(sq)
    q, k, v = random_qkv(sq, sk, 16, 8, batch=(4,), heads=2, kv_heads=1, seed=sq)
    kv_lengths = rng.integers(0, sk + 1, 4)
    kv_lengths[1] = 0  # one batch entry with no keys at all
    q_lengths = rng.integers(0, sq + 1, 4)
    for causal in (False, True):
        check(q, k, v, causal=causal, causal_align=align, kv_lengths=kv_lengths)
        check(q, k, v, causal=causal, causal_align=align, kv_lengths=kv_lengths, q_lengths=q_lengths,
              window=(20, None))


@pytest.mark.slow
@pytest.mark.parametrize("sq, sk", SHAPES)
def test_packed_documents(sq, sk):
    rng = np.random.default_rng(sk)
    q, k, v = random_qkv(sq, sk, 16, batch=(2,), heads=4, kv_heads=1, seed=sk)
    q_ids = np.sort(rng.integers(0, 5, (2, sq)), axis=-1)
    kv_ids = np.sort(rng.integers(0, 5, (2, sk)), axis=-1)
    for causal in (False, True):
        check(q, k, v, causal=causal, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    check(q, k, v, q_segment_ids=rng.integers(0, 3, (2, sq)), kv_segment_ids=rng.integers(0, 3, (2, sk)))


@pytest.mark.slow
@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("sq, sk", SHAPES)
@pytest.mark.parametrize("cap", [30.0, 50.0])
def test_softcap_and_alibi(align, sq, sk, cap):
    q, k, v = random_qkv(sq, sk, 32, batch=(2,), heads=4, kv_heads=2, seed=7)
    q, k = 8 * q, 8 * k  # logits far beyond the cap
    slopes = 2.0 ** -np.arange(1, 5)  # the ALiBi paper's geometric slopes for 4 heads
    for causal in (False, True):
        check(q, k, v, causal=causal, causal_align=align, softcap=cap)
        check(q, k, v, causal=causal, causal_align=align, alibi_slopes=slopes)
        check(q, k, v, causal=causal, causal_align=align, softcap=cap, alibi_slopes=slopes,
              window=(40, 10), kv_lengths=[sk, sk // 2])
    batch_slopes = np.abs(np.random.default_rng(0).standard_normal((2, 4)))
    check(q, k, v, causal=True, causal_align=align, alibi_slopes=batch_slopes)


def test_softcap_zero_means_off():
    q, k, v = random_qkv(20, 30, 8, seed=1)
    np.testing.assert_array_equal(attention(q, k, v, softcap=0.0), attention(q, k, v))


def test_window_touches_o_n_window_tiles():
    n, w, b = 8192, 256, 128
    q, k, v = random_qkv(n, d=16, seed=0)
    out, stats = attention(q, k, v, causal=True, window=(w, None), block_q=b, block_k=b,
                           return_stats=True)
    _, causal_stats = attention(q[:1024], k[:1024], v[:1024], causal=True, block_q=b, block_k=b,
                                return_stats=True)
    n_tiles = n // b
    # Each query tile sees its diagonal tile and at most w / b + 1 tiles to the left.
    assert stats.processed_tiles <= n_tiles * (w // b + 2)
    # Here w = 2 b exactly: query tile a sees key tiles a - 2 .. a, none before the first.
    assert stats.processed_tiles == 3 * n_tiles - 3
    assert stats.processed_tiles + stats.skipped_tiles == n_tiles ** 2
    causal_full = MaskSpec(n, n, True).tile_kinds(b, b)
    assert np.count_nonzero(causal_full != SKIP) == n_tiles * (n_tiles + 1) // 2
    assert stats.processed_tiles < np.count_nonzero(causal_full != SKIP) / 10
    # Documents skip the tiles between documents, too.
    ids = np.repeat(np.arange(8), 128)
    _, doc_stats = attention(q[:1024], k[:1024], v[:1024], causal=True,
                             q_segment_ids=ids, kv_segment_ids=ids, block_q=b, block_k=b,
                             return_stats=True)
    assert doc_stats.processed_tiles == 8 < causal_stats.processed_tiles == 36
    # The window result itself, checked on a slice of rows against a dense slice.
    rows = slice(n - 300, n)
    ref = reference_attention(q[rows], k[n - 300 - w:], v[n - 300 - w:], causal=True, window=(w, None))
    np.testing.assert_allclose(out[rows], ref, rtol=0, atol=1e-13)


def test_stats_per_batch_entry_with_padding():
    q, k, v = random_qkv(64, 64, 8, batch=(3,), heads=2, seed=2)
    _, stats = attention(q, k, v, kv_lengths=[64, 16, 0], block_q=16, block_k=16, return_stats=True)
    assert stats.tile_kind.shape == (3, 4, 4)
    assert (stats.tile_kind[1] != SKIP).sum() == 4 and (stats.tile_kind[2] == SKIP).all()
    assert stats.processed_tiles == 2 * (16 + 4 + 0)
    assert stats.skipped_tiles == 2 * (0 + 12 + 16)
    assert stats.rescales[2].sum() == 0


# -- validation ----------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [attention, reference_attention])
@pytest.mark.parametrize("kw, exc, match", [
    (dict(window=(1, 2, 3)), ValueError, r"window must be a pair \(left, right\) or None"),
    (dict(window=(-1, None)), ValueError, r"window left must be a non-negative integer or None, got -1"),
    (dict(window=(None, 2.5)), ValueError, r"window right must be a non-negative integer"),
    (dict(kv_lengths=[3]), ValueError, r"kv_lengths must have the batch shape \(2,\), got shape \(1,\)"),
    (dict(kv_lengths=[3, 9]), ValueError, r"kv_lengths must be in \[0, Sk=7\], got values in \[3, 9\]"),
    (dict(q_lengths=[-1, 2]), ValueError, r"q_lengths must be in \[0, Sq=5\]"),
    (dict(kv_lengths=[1.0, 2.0]), TypeError, r"kv_lengths must hold integers"),
    (dict(q_segment_ids=np.zeros((2, 5), int)), ValueError, r"must be given together"),
    (dict(q_segment_ids=np.zeros((2, 4), int), kv_segment_ids=np.zeros((2, 7), int)), ValueError,
     r"q_segment_ids must have shape \(2, 5\) \(batch axes, Sq\), got \(2, 4\)"),
    (dict(q_segment_ids=np.zeros((2, 5), int), kv_segment_ids=np.zeros((7,), int)), ValueError,
     r"kv_segment_ids must have shape \(2, 7\)"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number >= 0"),
    (dict(softcap="30"), TypeError, r"softcap must be a real number"),
    (dict(alibi_slopes=[0.1, 0.2]), ValueError, r"alibi_slopes must have shape \(3,\) or \(2, 3\)"),
    (dict(alibi_slopes=[0.1, np.nan, 0.1]), ValueError, r"alibi_slopes must be finite"),
])
def test_bad_mask_arguments(fn, kw, exc, match):
    q, k, v = random_qkv(5, 7, 4, batch=(2,), heads=3, seed=0)
    with pytest.raises(exc, match=match):
        fn(q, k, v, **kw)


def test_bad_kv_splits():
    q, k, v = random_qkv(5, 7, 4, seed=0)
    with pytest.raises(ValueError, match="kv_splits must be a positive integer"):
        attention(q, k, v, kv_splits=0)


def _packed_ids(rng, n, docs):
    """Ascending document ids of ``n`` positions in ``docs`` runs (some may be empty)."""
    cuts = np.sort(rng.integers(0, n + 1, docs - 1))
    return np.searchsorted(cuts, np.arange(n), side="right")


def _scored_pairs():
    """A `tile_scores` step that counts the score pairs it forms, and the count."""
    from attnlib.core import hooks

    pairs = [0]

    def tile_scores(q_i, k_j, *args, **kwargs):
        pairs[0] += q_i.shape[-2] * k_j.shape[-2]
        return hooks.default("tile_scores")(q_i, k_j, *args, **kwargs)

    return tile_scores, pairs


def _document_case(case):
    """Packed documents with other options by ``case``: ``q, k, v, options``."""
    rng = np.random.default_rng(case)
    sq = int(rng.integers(200, 700))
    sk = sq if case % 2 else int(rng.integers(200, 700))
    q_ids = _packed_ids(rng, sq, int(rng.integers(2, 9)))[None]
    kv_ids = q_ids if sq == sk else _packed_ids(rng, sk, int(rng.integers(2, 9)))[None]
    q, k, v = random_qkv(sq, sk, 16, batch=(1,), heads=4, kv_heads=2, seed=case)
    opts = dict(causal=case % 3 != 0, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                block_q=int(rng.choice([64, 128, 256])), block_k=int(rng.choice([64, 128, 256])))
    if case % 4 == 1:
        opts.update(window=(int(rng.integers(10, 200)), None), sink_token_length=3)
    if case % 4 == 2:
        opts.update(softcap=5.0, alibi_slopes=[0.1, 0.2, 0.3, 0.4], sinks=[0.5, -1.0, 2.0, 0.0])
    if case % 4 == 3:
        opts.update(kv_lengths=[sk - 37], q_lengths=[sq - 11], rescale_threshold=2.0)
    return q, k, v, opts


def _same_up_to_rounding(got, whole):
    """Two runs' ``(out, lse, max_scores, stats)``: the same tile map and rescale counts, the
    rest equal up to rounding (a block's product rounds as its shape has it)."""
    np.testing.assert_array_equal(got[3].tile_kind, whole[3].tile_kind)
    np.testing.assert_array_equal(np.asarray(got[3].rescales), np.asarray(whole[3].rescales))  # per head
    for a, b in zip(got[1:3], whole[1:3]):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
        np.testing.assert_allclose(a[np.isfinite(a)], b[np.isfinite(b)], rtol=0, atol=1e-13)
    out, out_w = np.asarray(got[0]), np.asarray(whole[0])
    np.testing.assert_allclose(out, out_w, rtol=0, atol=1e-13 * np.abs(out_w).max())


@pytest.mark.slow
@pytest.mark.parametrize("case", range(10))
def test_a_packed_documents_tile_computes_each_documents_block_alone(case, monkeypatch):
    # The blocks (`MaskSpec.document_blocks`) give what the whole masked tile gives (the same
    # tile map, rescale counts; out, lse and max scores up to rounding), within the contract's
    # bound of the reference, with fewer score pairs formed.
    from attnlib.core import hooks, tiles

    q, k, v, opts = _document_case(case)
    runs = {}
    for least in (0, math.inf):  # every tile of several documents by blocks, then every tile whole
        monkeypatch.setattr(tiles, "DOCUMENT_BLOCK_PAIRS", least)
        counted, pairs = _scored_pairs()
        with hooks.replaced(tile_scores=counted), np.errstate(divide="raise", over="raise", invalid="raise"):
            out, lse, maxes, stats = attention(q, k, v, return_lse=True, return_max_scores=True,
                                               return_stats=True, **opts)
        runs[least] = out, lse, maxes, stats, pairs[0]
    (*got, pairs), (*whole, pairs_w) = runs.values()
    assert pairs < pairs_w
    _same_up_to_rounding(got, whole)
    out = got[0]
    masks = {name: opts[name] for name in opts if name not in ("block_q", "block_k", "rescale_threshold")}
    assert attention_errors(out, q, k, v, **masks).rel_error < BOUND


@pytest.mark.slow
@pytest.mark.parametrize("case", range(8))
def test_torch_cpu_computes_a_packed_documents_tile_by_blocks_too(case, monkeypatch):
    # The torch backend takes the same blocks (the shared kernel's step): what its whole tiles
    # give, and the numpy kernel's stats.
    torch = pytest.importorskip("torch")
    from attnlib.core import hooks, tiles

    q, k, v, opts = _document_case(case)
    calls = []
    shipped = hooks.get("document_blocks")

    def counted(*args):
        found = shipped(*args)
        if found is not None:
            calls.append(1)
        return found

    runs = []
    for least in (0, math.inf):
        monkeypatch.setattr(tiles, "DOCUMENT_BLOCK_PAIRS", least)
        with hooks.replaced(document_blocks=counted):
            runs.append(attention(*(torch.from_numpy(x) for x in (q, k, v)), return_lse=True,
                                  return_max_scores=True, return_stats=True, **opts))
        if least == 0:
            assert calls
    _same_up_to_rounding(runs[0], runs[1])
    _same_up_to_rounding(runs[0], attention(q, k, v, return_lse=True, return_max_scores=True,
                                            return_stats=True, **opts))


def test_torch_sinks_are_not_written_by_a_one_row_tile_of_document_blocks(monkeypatch):
    # A one-row tile's state started as a view of the sinks themselves; its blocks wrote the
    # rows' max into them, changing every later tile (review).
    torch = pytest.importorskip("torch")
    from attnlib.core import tiles

    monkeypatch.setattr(tiles, "DOCUMENT_BLOCK_PAIRS", 0)  # blocks for these small tiles too
    q, k, v = random_qkv(193, 8, 8, batch=(1,), heads=1, seed=0)
    opts = dict(q_segment_ids=np.array([[0] * 150 + [1] * 43]), kv_segment_ids=np.array([[1, 1, 1, 2, 2, 3, 4, 4]]),
                block_q=32, block_k=128)
    expect = attention(q, k, v, sinks=[-1.5], **opts)
    for sinks in ([-1.5], torch.tensor([-1.5], dtype=torch.float64)):
        out = attention(*(torch.from_numpy(x) for x in (q, k, v)), sinks=sinks, **opts)
        np.testing.assert_allclose(out.numpy(), expect, rtol=0, atol=1e-15)
        assert list(sinks) == [-1.5]


def test_a_document_block_edge_off_by_one_is_caught(monkeypatch):
    # Power: the key before each document block in it too is a visible error against the reference.
    rng = np.random.default_rng(5)
    ids = _packed_ids(rng, 500, 6)[None]
    q, k, v = random_qkv(500, 500, 16, batch=(1,), heads=2, seed=5)
    opts = dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    assert attention_errors(attention(q, k, v, **opts), q, k, v, **opts).rel_error < BOUND
    shipped = MaskSpec.document_blocks

    def off_by_one(self, rows, cols):
        blocks = shipped(self, rows, cols)
        return None if blocks is None else [(r0, r1, max(c0 - 1, 0), c1) for r0, r1, c0, c1 in blocks]

    monkeypatch.setattr(MaskSpec, "document_blocks", off_by_one)
    assert attention_errors(attention(q, k, v, **opts), q, k, v, **opts).rel_error > 1e3 * BOUND


@pytest.mark.slow
def test_the_defects_reach_a_tile_computed_by_document_blocks():
    # Power on the block path: a documents-only mask (every block FULL, no PARTIAL tile's mask
    # formed) still fails the off-by-one mask (the blocks' edges shifted), causal blocks the
    # softcap after the mask, and a subclass state's own slot (the sink's first-tile defect)
    # survives a block's row slice (review).
    from attnlib.core import hooks
    from attnlib.evidence.defects import DEFECTS
    from attnlib.judge.gate import Gate

    rng = np.random.default_rng(3)
    ids = _packed_ids(rng, 1024, 24)[None]
    q, k, v = random_qkv(1024, 1024, 32, batch=(1,), heads=2, seed=3)
    split = []

    def counted(*args):
        blocks = hooks.default("document_blocks")(*args)
        split.append(blocks is not None)
        return blocks

    for opts, names in ((dict(softcap=5.0), ("off_by_one_mask",)),
                        (dict(causal=True, softcap=5.0), ("off_by_one_mask", "softcap_after_mask")),
                        (dict(causal=True, sinks=[0.5, -1.0]), ("sink_first_tile_unscaled", "sink_weight_dropped"))):
        opts.update(q_segment_ids=ids, kv_segment_ids=ids, block_q=512, block_k=512)
        gate = Gate(q, k, v, **{n: x for n, x in opts.items() if n != "block_q"})
        split.clear()
        with hooks.replaced(document_blocks=counted):
            assert gate.judge(*attention(q, k, v, return_lse=True, **opts))["passed"]
        assert any(split)  # the real kernel took the block path
        for name in names:
            with DEFECTS[name].active(), np.errstate(divide="raise", over="raise", invalid="raise"):
                assert not gate.judge(*attention(q, k, v, return_lse=True, **opts))["passed"], name


@pytest.mark.slow
def test_the_packed_documents_cases_take_the_block_path():
    # The equivalence report's packed-documents problems are computed by document blocks.
    from attnlib.evidence.differential import run_case
    from attnlib.evidence.inputs import DOCUMENT_OPTIONS, document_cases

    cases = document_cases(8, seed=1, max_len=2048)
    assert all(c.sq == c.sk and c.shared_documents for c in cases)
    assert {"causal/bottom_right", "none"} == {c.mask_name for c in cases}
    assert all(any(o.split("=")[0] in c.features or (o == "lazy" and "lazy" in c.features)
                   for c in cases) for o in ("window", "softcap", "alibi", "sinks", "kv_splits"))
    assert len(DOCUMENT_OPTIONS) == 6
    q_ids, kv_ids = cases[0].segment_ids()
    np.testing.assert_array_equal(q_ids, kv_ids)
    for case in cases[:3]:
        row = run_case(case)
        assert row["passed"] and row["document_block_tiles"] > 0, case


def test_a_state_step_keeps_its_own_attributes_over_document_blocks(monkeypatch):
    # A replaced state class (slotted or not) sees its own attributes come back after each
    # block (`OnlineSoftmax.put_rows`), as on whole tiles (review: a __dict__ counter was lost).
    from attnlib.core import hooks, tiles
    from attnlib.core.online import OnlineSoftmax

    class Counted(OnlineSoftmax):  # no __slots__: its attributes live in __dict__
        def update(self, s, v, **kwargs):
            self.updates = getattr(self, "updates", 0) + 1
            return super().update(s, v, **kwargs)

        def finalize(self):
            seen.append(self.updates)
            return super().finalize()

    rng = np.random.default_rng(0)
    ids = _packed_ids(rng, 300, 5)[None]
    q, k, v = random_qkv(300, 300, 8, batch=(1,), heads=1, seed=0)
    counts = {}
    for least in (0, math.inf):
        monkeypatch.setattr(tiles, "DOCUMENT_BLOCK_PAIRS", least)
        seen = []
        with hooks.replaced(state=Counted):
            attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, block_q=128, block_k=128)
        counts[least] = seen
    assert all(c > 0 for c in counts[0]) and len(counts[0]) == len(counts[math.inf])
