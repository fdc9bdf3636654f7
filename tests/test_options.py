"""One options object (issue 25): the contract's masking and score options parsed once into
`Options`, the same checks and the same refusals at every entry point."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnlib
from attnlib.core.options import MASKING, MODS, PAGING, SCORES, SPARSE, Options
from attnlib.judge.gate import row_stats, tolerance

Q, K, V = attnlib.random_qkv(6, 8, 4, heads=2, seed=0)
DOUT = np.random.default_rng(1).standard_normal(Q.shape)
OUT, LSE = attnlib.attention(Q, K, V, return_lse=True)
CU_Q, CU_K = np.array([0, 6]), np.array([0, 8])  # one sequence, packed (total, H, D)

#: Each entry point that takes the options as keyword arguments, on a valid small problem.
ENTRY_POINTS = {
    "attention": lambda **o: attnlib.attention(Q, K, V, **o),
    "attention_stream": lambda **o: attnlib.attention_stream(Q, [(K, V)], total_keys=8, **o),
    "attention_varlen": lambda **o: attnlib.attention_varlen(
        Q.swapaxes(0, 1), K.swapaxes(0, 1), V.swapaxes(0, 1), CU_Q, CU_K, **o),
    "attention_backward": lambda **o: attnlib.attention_backward(Q, K, V, OUT, LSE, DOUT, **o),
    "reference_attention": lambda **o: attnlib.reference_attention(Q, K, V, **o),
    "reference_attention_backward": lambda **o: attnlib.reference_attention_backward(Q, K, V, DOUT, **o),
    "oracle_attention": lambda **o: attnlib.oracle_attention(Q, K, V, **o),
    "reference_scores": lambda **o: attnlib.reference_scores(Q, K, **o),
    "Gate": lambda **o: attnlib.Gate(Q, K, V, **o),
    "GradientGate": lambda **o: attnlib.GradientGate(Q, K, V, DOUT, **o),
    "tolerance": lambda **o: tolerance(Q, K, V, None, **o),
    "row_stats": lambda **o: row_stats(Q, K, **o),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_an_unknown_option_is_a_type_error_naming_it(entry):
    with pytest.raises(TypeError, match="casual"):
        ENTRY_POINTS[entry](casual=True)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("bad, error, name", [
    (dict(causal=1), TypeError, "causal"),
    (dict(causal_align="bottom"), ValueError, "causal_align"),
    (dict(window=(-1, None)), ValueError, "window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale=True), TypeError, "scale"),
])
def test_the_same_checks_at_every_entry_point(entry, bad, error, name):
    with pytest.raises(error, match=name):
        ENTRY_POINTS[entry](**bad)


@pytest.mark.parametrize("entry, option", [
    ("attention_stream", dict(kv_lengths=[8])),
    ("attention_stream", dict(mask_mod=lambda b, h, i, j: i >= j)),
    ("attention_varlen", dict(q_lengths=[6])),
    ("attention_varlen", dict(score_mod=lambda s, b, h, i, j: s)),
    ("attention_stream", dict(gather_kv_indices=np.zeros((6, 1), int))),
    ("attention_varlen", dict(gather_kv_indices=np.zeros((6, 1), int))),
    ("attention_backward", dict(block_table=np.zeros((1, 1), int), cache_seqlens=[1])),
    ("reference_attention", dict(block_table=np.zeros((1, 1), int), cache_seqlens=[1])),
    ("row_stats", dict(block_table=np.zeros((1, 1), int), cache_seqlens=[1])),
])
def test_an_option_an_entry_point_cannot_honour_is_refused_by_name(entry, option):
    # The stream's signature has no such keyword (a TypeError naming it); the others parse
    # every option and refuse what they cannot honour (a ValueError naming it).
    name = "paged" if "block_table" in option else next(iter(option))
    with pytest.raises((TypeError, ValueError), match=name):
        ENTRY_POINTS[entry](**option)


def test_paging_needs_both_arrays():
    with pytest.raises(ValueError, match="block_table and cache_seqlens"):
        Options.parse(block_table=np.zeros((1, 1), int))


def test_the_groups_cover_the_fields_once():
    names = [f for group in (MASKING, SCORES, MODS, PAGING, SPARSE) for f in group]
    assert sorted(names) == sorted(Options.parse().__dataclass_fields__)


_windows = st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 50)),
                                          st.one_of(st.none(), st.integers(0, 50))))


@given(causal=st.booleans(), align=st.sampled_from(["bottom_right", "top_left"]), window=_windows,
       softcap=st.one_of(st.none(), st.just(0.0), st.floats(0.1, 100.0)),
       scale=st.one_of(st.none(), st.floats(-10.0, 10.0)))
@pytest.mark.slow
def test_given_round_trips(causal, align, window, softcap, scale):
    opts = Options.parse(causal=causal, causal_align=align, window=window, softcap=softcap, scale=scale)
    again = Options.parse(**opts.given())
    assert again.given() == opts.given()
    assert Options.parse(opts).given() == opts.given()  # an Options, with nothing on top
    assert opts.window == (tuple(window) if window is not None else (None, None))
    assert opts.softcap == (softcap or None)


def test_options_on_top_of_options_and_never_a_copy_of_an_array():
    lengths = np.array([8])
    opts = Options.parse(kv_lengths=lengths, causal=True)
    more = opts.replace(window=(2, 0))
    assert more.kv_lengths is lengths and more.causal and more.window == (2, 0)
    assert not opts.given().keys() - {"kv_lengths", "causal"}
    with pytest.raises(TypeError, match="options must be an attnlib Options"):
        Options.parse({"causal": True})


def test_an_entry_point_given_options_or_keywords_computes_the_same():
    opts = Options.parse(causal=True, window=(3, 0), softcap=5.0)
    gate = attnlib.Gate(Q, K, V, options=opts)
    assert gate.options.given() == opts.given()
    out, lse = attnlib.attention(Q, K, V, return_lse=True, **opts.given())
    assert gate.judge(out, lse)["passed"]
    np.testing.assert_array_equal(gate.ref, attnlib.Gate(Q, K, V, causal=True, window=(3, 0), softcap=5.0).ref)


@pytest.mark.parametrize("bad, error, name", [
    (dict(kv_splits=0), ValueError, "kv_splits"), (dict(block_q=-1), ValueError, "block_q"),
    (dict(block_k=1.5), TypeError, "block_k"), (dict(workers=0), ValueError, "workers"),
    (dict(rescale_threshold=-1.0), ValueError, "rescale_threshold"), (dict(return_lse=2), TypeError, "return_lse"),
    (dict(return_stats="yes"), TypeError, "return_stats"), (dict(compute_dtype="int8"), ValueError, "compute_dtype"),
    (dict(lse_base=3, return_lse=True), ValueError, "lse_base"), (dict(lse_sink="in"), ValueError, "lse_sink"),
])
def test_a_call_is_bound_once_every_argument_checked_by_name(bad, error, name):
    """`Call.bind` (what `attention`'s body binds from its arguments) checks each argument of
    the run, the outputs and the precision, naming it, the same as `attention` refuses it."""
    from attnlib.core.options import Call
    with pytest.raises(error, match=name):
        Call.bind({"causal": True, **bad})
    with pytest.raises(error, match=name):
        attnlib.attention(Q, K, V, **bad)


def test_a_bound_call_holds_what_the_kernel_reads():
    from attnlib.core.options import Call
    from attnlib.core.tiled import forward, run_call
    call = Call.bind(dict(causal=True, window=(2, None), q=Q, unrelated=1), return_lse=True, kv_splits=2,
                     compute_dtype="float32", block_k=4, workers=1)
    assert call.options.causal and call.options.window == (2, None) and call.return_lse
    assert (call.kv_splits, call.block_k, call.block_q, call.workers, call.precision.name) == (2, 4, None, 1, "float32")
    expected = attnlib.attention(Q, K, V, causal=True, window=(2, None), return_lse=True, kv_splits=2,
                                 compute_dtype="float32", block_k=4, workers=1)
    for got in (forward(Q, K, V, call), run_call(Q, K, V, call)):
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert Call.bind(options=call.options).options is call.options  # already checked: not parsed again


def test_a_misspelt_keyword_of_a_bound_call_is_refused_not_a_default():
    from attnlib.core.options import Call
    from attnlib.core.tiled import forward_on
    with pytest.raises(TypeError, match="retrun_lse"):
        Call.bind(retrun_lse=True)
    with pytest.raises(TypeError, match="retrun_lse"):
        forward_on(Q, K, V, Options.parse(causal=True), retrun_lse=True)
    with pytest.raises(TypeError, match="lse_base"):  # a convention is attention's to apply
        forward_on(Q, K, V, Options.parse(causal=True), return_lse=True, lse_base=2)
    Call.bind({"retrun_lse": True, "q": Q})  # an entry point's own locals: its other parameters pass by


def test_the_block_mask_keeps_its_sparsity():
    bm = attnlib.create_block_mask(lambda b, h, i, j: i >= j, 1, 1, 256, 256, block_q=64, block_k=64)
    assert bm.sparsity() == pytest.approx(6 / 16)
