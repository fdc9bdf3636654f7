"""Issue 44, "a check a CI can trust": the edges found there, each fixed and held.

1. ``lse_sink="excluded"`` checks the sinks as ``"included"`` does (shape, finite, range), on
   every backend, and keeps 2-D inputs 2-D.
2. The gradient diagnosis skips what it cannot compute (top-k lists with key_leftpad and
   chunks or sink tokens); torch names a wrongly shaped list as numpy does; a chunk of 2**63
   is one chunk, as a window side that wide is no bound.
3. The distributed oracle takes qv-only scores; qv-only descales are ``(batch, Hk)``;
   `assert_attention_close` takes every keyword `check_kernel` takes.
4. The verdict's header names every option judged; torch messages print tuples; the CLI's
   own messages for ``--v-from-k 0`` and ``--scale``; a mask_mod's own exception propagates; a
   scale fed to the CLI that is not the kernel's is diagnosed as one.
"""

import inspect
import math

import numpy as np
import pytest

import attnlib
from attnlib import check
from attnlib.check import check_kernel, format_text
from attnlib.core.options import Options
from attnlib.testing import assert_attention_close

STRICT = dict(divide="raise", over="raise", invalid="raise")


def qkv(b=1, h=2, sq=8, sk=8, d=4, hk=None, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, h, sq, d)), rng.standard_normal((b, hk or h, sk, d)),
            rng.standard_normal((b, hk or h, sk, d)))


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared below
        return type(e), str(e)
    return None


def frozen(*arrays):
    """The arrays made read-only: a write to an input raises."""
    for a in arrays:
        a.setflags(write=False)
    return arrays


# -- 1. the sinks checked whatever lse_sink is ------------------------------------------------------

BAD_SINKS = {
    "too many heads": np.zeros(3),
    "batch entries that are not": np.zeros((2, 2)),
    "NaN": np.array([0.0, np.nan]),
    "+inf": np.array([np.inf, 0.0]),
    "integers": np.array([1, 2]),
}


def _entry_points():
    points = {"attention": attnlib.attention, "reference_attention": attnlib.reference_attention}
    try:
        import torch
    except ImportError:
        return points

    def on_torch(fn):
        def call(q, k, v, sinks, **kw):
            t = [torch.tensor(x) for x in (q, k, v)]  # copies: the arrays are read-only
            return fn(*t, sinks=torch.tensor(sinks), **kw)
        return call

    points["attention (torch)"] = on_torch(attnlib.attention)
    points["reference_attention (torch)"] = on_torch(attnlib.reference_attention)
    return points


@pytest.mark.parametrize("entry", list(_entry_points()))
@pytest.mark.parametrize("bad", list(BAD_SINKS))
def test_excluded_sinks_are_checked_as_included_sinks(entry, bad):
    fn = _entry_points()[entry]
    q, k, v = frozen(*qkv())
    sinks = BAD_SINKS[bad]
    call = lambda sink: fn(q, k, v, sinks=sinks, return_lse=True, lse_sink=sink)  # noqa: E731
    with np.errstate(**STRICT):
        included, excluded = error_of(lambda: call("included")), error_of(lambda: call("excluded"))
    assert included is not None and included[0] in (ValueError, TypeError)
    assert excluded == included, (bad, excluded, included)
    assert "sinks" in excluded[1]


def test_excluded_sinks_of_a_paged_cache_are_checked_as_included_sinks():
    rng = np.random.default_rng(1)
    q, pages = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((6, 4, 2, 4))
    paged = dict(block_table=np.array([[0, 1, 2], [3, 4, 5]]), cache_seqlens=np.array([9, 5]))
    for sinks in (np.zeros(3), np.zeros((3, 2)), np.array([np.nan, 0.0])):
        errors = [error_of(lambda: attnlib.attention(q, pages, pages, sinks=sinks, return_lse=True, lse_sink=s,
                                                     **paged)) for s in ("included", "excluded")]
        assert errors[0] is not None and errors[1] == errors[0], errors
    sinks = np.array([[0.5, -1.0], [1.0, 2.0]])
    out, lse = attnlib.attention(q, pages, pages, sinks=sinks, return_lse=True, lse_sink="excluded", **paged)
    assert np.abs(out - attnlib.attention(q, pages, pages, sinks=sinks, **paged)).max() < 1e-14


def test_excluded_sinks_beyond_a_low_precision_range_are_refused():
    q, k, v = qkv()
    for sink in ("included", "excluded"):
        with pytest.raises(ValueError, match=r"sinks must be within \+-1e\+30"):
            attnlib.attention(q, k, v, sinks=np.array([1e31, 0.0]), compute_dtype="float32", return_lse=True,
                              lse_sink=sink)


@pytest.mark.parametrize("fn", [attnlib.attention, attnlib.reference_attention])
def test_excluded_sinks_keep_2d_inputs_2d(fn):
    q, k, v = frozen(*(x[0, 0] for x in qkv(sq=5, sk=7)))
    sinks = np.array([0.7])
    with np.errstate(**STRICT):
        out, lse = fn(q, k, v, sinks=sinks, return_lse=True, lse_sink="excluded")
        with_sink = fn(q, k, v, sinks=sinks)
        _, keys_lse = fn(q, k, v, return_lse=True)
    assert out.shape == (5, 4) and lse.shape == (5,)
    assert np.abs(out - with_sink).max() < 1e-15  # the same output, its lse without the sink
    assert np.array_equal(lse, keys_lse)


def test_excluded_sinks_per_batch_entry_on_torch_match_numpy():
    torch = pytest.importorskip("torch")
    q, k, v = qkv(b=2)
    sinks = np.array([[0.5, -1.0], [2.0, 0.0]])
    out, lse = attnlib.attention(q, k, v, sinks=sinks, return_lse=True, lse_sink="excluded")
    t_out, t_lse = attnlib.attention(*(torch.from_numpy(x) for x in (q, k, v)), sinks=torch.from_numpy(sinks),
                                     return_lse=True, lse_sink="excluded")
    assert t_out.shape == out.shape and np.abs(t_out.numpy() - out).max() < 1e-13
    assert np.abs(t_lse.numpy() - lse).max() < 1e-13


# -- 2. crashes ------------------------------------------------------------------------------------

def _lists(b, sq, sk, topk, seed=1):
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.permutation(sk)[:topk] for _ in range(sq)]) for _ in range(b)])


LIST_VARIANTS = {"chunks": dict(attention_chunk=4),
                 "sink tokens": dict(window=(3, None), sink_token_length=2)}


@pytest.mark.parametrize("variant", list(LIST_VARIANTS))
def test_a_failing_gradient_with_lists_and_key_leftpad_gets_a_verdict(variant):
    q, k, v = frozen(*qkv(b=2, sq=16, sk=16, d=8))
    opts = dict(key_leftpad=np.array([2, 3]), causal=True, gather_kv_indices=_lists(2, 16, 16, 6),
                **LIST_VARIANTS[variant])
    out, lse = attnlib.attention(q, k, v, return_lse=True, **opts)
    dout = np.random.default_rng(2).standard_normal(out.shape)
    dq, dk, dv = attnlib.attention_backward(q, k, v, out, lse, dout, **opts)
    with np.errstate(**STRICT):
        r = check_kernel(q, k, v, out, dout=dout, dq=2 * dq, dk=dk, dv=dv, layout="bhsd", **opts)
    assert r.out.passed and not r.passed and r.grads["dq"].passed is False
    assert any("times 2" in n for n in r.grads["dq"].notes), r.grads["dq"].notes


def test_the_cli_gives_its_verdict_on_such_a_gradient(tmp_path, capsys):
    q, k, v = qkv(b=2, sq=16, sk=16, d=8)
    idx = _lists(2, 16, 16, 6)
    opts = dict(key_leftpad=np.array([2, 3]), causal=True, gather_kv_indices=idx, attention_chunk=4)
    out, lse = attnlib.attention(q, k, v, return_lse=True, **opts)
    dout = np.random.default_rng(2).standard_normal(out.shape)
    dq, dk, dv = attnlib.attention_backward(q, k, v, out, lse, dout, **opts)
    code, text = run_cli(tmp_path, capsys, dict(q=q, k=k, v=v, out=out, dout=dout, dq=-dq, dk=dk, dv=dv,
                                                gather_kv_indices=idx),
                         "--layout", "bhsd", "--causal", "--key-leftpad", "2", "3", "--attention-chunk", "4")
    assert code == 1 and "dq: FAIL" in text and "verdict: FAIL (exit 1)" in text, text


def test_key_leftpad_positions_from_key_0_with_lists_is_named():
    """The alternative a kernel that masks the padding but counts positions from key 0 computes:
    with top-k lists (which take no mask_mod) the padding is taken out of the lists."""
    q, k, v = qkv(b=2, sq=32, sk=32, d=8)
    idx, pad = _lists(2, 32, 32, 12), np.array([3, 5])
    lists = np.where(idx < pad[:, None, None], -1, idx)
    wrong = attnlib.attention(q, k, v, causal=True, attention_chunk=8, gather_kv_indices=lists)
    r = check_kernel(q, k, v, wrong, layout="bhsd", causal=True, attention_chunk=8, key_leftpad=pad,
                     gather_kv_indices=idx)
    assert not r.passed
    assert any("key_leftpad masked but positions counted from key 0" in d for d in r.diagnosis), r.diagnosis


def test_torch_names_a_wrongly_shaped_list_as_numpy_does():
    torch = pytest.importorskip("torch")
    q, k, v = qkv(b=2, sq=16, sk=16)
    idx = _lists(2, 15, 16, 6)  # one query row short
    want = error_of(lambda: attnlib.attention(q, k, v, gather_kv_indices=idx))
    assert want[0] is ValueError and "gather_kv_indices must have shape (2, 16, 'topk')" in want[1]
    t = [torch.from_numpy(x) for x in (q, k, v)]
    assert error_of(lambda: attnlib.attention(*t, gather_kv_indices=idx)) == want
    assert error_of(lambda: attnlib.attention(*t, gather_kv_indices=torch.from_numpy(idx))) == want
    assert error_of(lambda: attnlib.reference_attention(*t, gather_kv_indices=idx)) == want


@pytest.mark.parametrize("huge", [2**62, 2**63, 2**64, 10**30])
def test_a_chunk_wider_than_any_sequence_is_one_chunk(huge):
    # Sq > Sk, no causal mask: the first query rows lie before the first key (i + o' < 0) and see
    # no key in any chunk wider than the problem (floor of a negative position is -1): a huge
    # chunk is not "no chunks", it is the one chunk of C = Sq + Sk.
    q, k, v = frozen(*qkv(sq=12, sk=5))
    with np.errstate(**STRICT):
        out, lse = attnlib.attention(q, k, v, attention_chunk=huge, return_lse=True)
        one, one_lse = attnlib.attention(q, k, v, attention_chunk=17, return_lse=True)
        ref = attnlib.reference_attention(q, k, v, attention_chunk=huge)
        dq = attnlib.attention_backward(q, k, v, out, lse, out, attention_chunk=huge)[0]
    assert np.array_equal(out, one) and np.array_equal(lse, one_lse)
    assert np.isneginf(lse[..., :7]).all() and np.isfinite(lse[..., 7:]).all()
    assert np.abs(ref - one).max() < 1e-15 and np.isfinite(dq).all()
    assert Options.parse(attention_chunk=huge).attention_chunk == 2**62
    window = attnlib.attention(q, k, v, window=(huge, None), sink_token_length=huge)
    assert np.array_equal(window, attnlib.attention(q, k, v))


def test_a_huge_chunk_on_torch_and_in_the_check():
    torch = pytest.importorskip("torch")
    q, k, v = qkv(sq=12, sk=5)
    one = attnlib.attention(q, k, v, attention_chunk=17)
    got = attnlib.attention(*(torch.from_numpy(x) for x in (q, k, v)), attention_chunk=2**63)
    assert np.abs(got.numpy() - one).max() < 1e-13
    assert check_kernel(q, k, v, one, layout="bhsd", attention_chunk=2**63).passed


# -- 3. paths that disagree ------------------------------------------------------------------------

def _qv_only(b=2, hq=4, hk=2, s=24, dv=8, seed=3):
    rng = np.random.default_rng(seed)
    descale = np.array([[1.0, 2.0], [0.5, 4.0]])[:b]
    return rng.standard_normal((b, hk, s, dv)), rng.standard_normal((b, hq, s, dv)), descale


def test_qv_only_takes_descales_of_shape_batch_by_kv_heads():
    v, qv, ds = _qv_only()
    with np.errstate(**STRICT):
        got = attnlib.attention(None, None, v, qv=qv, q_descale=ds, v_descale=2 * ds)
        ref = attnlib.reference_attention(None, None, v, qv=qv, q_descale=ds, v_descale=2 * ds)
    # By hand: the scores scale (qv q_descale) . (v v_descale), values v v_descale.
    g = 2
    qd, vd = qv * np.repeat(ds, g, axis=1)[..., None, None], v * (2 * ds)[..., None, None]
    want = attnlib.reference_attention(qd, np.repeat(vd, g, axis=1), np.repeat(vd, g, axis=1))
    assert np.abs(got - want).max() < 1e-13 and np.abs(ref - want).max() < 1e-13
    with pytest.raises(ValueError, match=r"v_descale must have the shape \(batch, kv heads\) = \(2, 2\)"):
        attnlib.attention(None, None, v, qv=qv, v_descale=np.ones((2, 3)))


def test_qv_only_descales_on_torch():
    torch = pytest.importorskip("torch")
    v, qv, ds = _qv_only()
    want = attnlib.attention(None, None, v, qv=qv, q_descale=ds, v_descale=ds)
    got = attnlib.attention(None, None, torch.from_numpy(v), qv=torch.from_numpy(qv), q_descale=ds, v_descale=ds)
    assert np.abs(got.numpy() - want).max() < 1e-13


@pytest.mark.slow  # an in-process cluster: about 1 s
def test_the_distributed_oracle_takes_qv_only_scores():
    distributed = pytest.importorskip("distributed")
    import attnlib.distributed as dd

    v, qv, ds = _qv_only()
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as client:
        for kw in ({}, dict(q_descale=ds, v_descale=0.5 * ds, causal=True)):
            want, want_lse = attnlib.attention(None, None, v, qv=qv, return_lse=True, **kw)
            got, lse = dd.attention(None, None, v, qv=qv, client=client, block_q=8, kv_block=8, return_lse=True, **kw)
            assert np.abs(got - want).max() < 1e-13 and np.abs(lse - want_lse).max() < 1e-13
            bshd = dd.attention(None, None, np.swapaxes(v, 1, 2).copy(), qv=np.swapaxes(qv, 1, 2).copy(),
                                client=client, block_q=8, kv_block=8, layout="bshd", **kw)
            assert np.abs(np.swapaxes(bshd, 1, 2) - want).max() < 1e-13
    with pytest.raises(ValueError, match="q is None: give q, or qv"):
        dd.attention(None, None, v)
    with pytest.raises(ValueError, match=r"k_descale must have the shape \(batch, kv heads\) = \(2, 2\)"):
        dd.attention(None, None, v, qv=qv, k_descale=np.ones(3))  # checked as attention checks it


def _keywords(fn):
    return [(n, p.default) for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]


def test_assert_attention_close_takes_every_keyword_of_check_kernel():
    assert _keywords(assert_attention_close) == _keywords(check_kernel)


def test_assert_attention_close_forwards_qv_descales_lists_and_max_scores():
    rng = np.random.default_rng(4)
    q, k, v = qkv(b=2, sq=16, sk=16, d=8)
    qv = rng.standard_normal(q.shape)
    idx = _lists(2, 16, 16, 6)
    ds = np.array([[1.0, 0.5], [2.0, 1.0]])
    kw = dict(qv=qv, q_descale=ds, k_descale=ds, gather_kv_indices=idx, causal=True)
    out, lse, maxes = attnlib.attention(q, k, v, return_lse=True, return_max_scores=True, **kw)
    assert_attention_close(out, q, k, v, lse=lse, max_scores=maxes, layout="bhsd", **kw)
    with pytest.raises(AssertionError, match="max_scores: FAIL"):
        assert_attention_close(out, q, k, v, max_scores=maxes + 1, layout="bhsd", **kw)
    with pytest.raises(AssertionError, match="out: FAIL"):  # qv ignored: the check judged with it
        assert_attention_close(attnlib.attention(q, k, v, q_descale=ds, k_descale=ds, gather_kv_indices=idx,
                                                 causal=True), q, k, v, layout="bhsd", **kw)


# -- 4. words --------------------------------------------------------------------------------------

def test_the_header_names_every_option_judged():
    q, k, v = qkv(b=2, sq=16, sk=16, d=8)
    qv = np.random.default_rng(5).standard_normal(q.shape)
    ds = np.array([[1.0, 0.5], [2.0, 1.0]])
    opts = dict(key_leftpad=np.array([2, 3]), attention_chunk=4, window=(3, None), sink_token_length=1,
                causal=True, gather_kv_indices=_lists(2, 16, 16, 6))
    out = attnlib.attention(q, k, v, qv=qv, q_descale=ds, v_descale=ds, **opts)
    r = check_kernel(q, k, v, out, qv=qv, q_descale=ds, v_descale=ds, layout="bhsd", **opts)
    header = format_text(r).splitlines()[1]
    for words in ("key_leftpad [2, 3]", "attention_chunk 4", "sink_token_length 1", "gather_kv_indices (2, 16, 6)",
                  "qv (2, 2, 16, 8)", "q_descale (2, 2)", "v_descale (2, 2)"):
        assert words in header, (words, header)
    assert "k_descale" not in header


def test_torch_messages_print_shapes_as_tuples():
    torch = pytest.importorskip("torch")
    q, k, v = qkv(b=2)
    t = [torch.from_numpy(x) for x in (q, k, v)]
    for kw in (dict(q_lengths=np.array([1, 2, 3])), dict(sinks=np.zeros(5)), dict(alibi_slopes=np.zeros((3, 2))),
               dict(q_segment_ids=np.zeros((2, 3), int), kv_segment_ids=np.zeros((2, 8), int)),
               dict(key_leftpad=np.array([1]))):
        want = error_of(lambda: attnlib.attention(q, k, v, **kw))
        for fn in (attnlib.attention, attnlib.reference_attention):
            got = error_of(lambda: fn(*t, **kw))
            assert got == want and "torch.Size" not in got[1], (kw, got, want)
    out, lse = attnlib.attention(*t, return_lse=True)
    got = error_of(lambda: attnlib.attention_backward(*t, out, lse, out, q_lengths=np.array([1, 2, 3])))
    assert got[0] is ValueError and "(2,)" in got[1] and "torch.Size" not in got[1]


def run_cli(tmp_path, capsys, tensors, *args):
    argv = []
    for name, x in tensors.items():
        path = tmp_path / f"{name}.npy"
        np.save(path, x)
        argv += [f"--{name.replace('_', '-')}", str(path)]
    code = check.main(argv + list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_cli_v_from_k_0_gets_its_own_message(tmp_path, capsys):
    q, k, _ = (x.astype(np.float32) for x in qkv(d=8))
    with pytest.raises(SystemExit) as e:
        run_cli(tmp_path, capsys, dict(q=q, k=k, out=q), "--layout", "bhsd", "--v-from-k", "0")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --v-from-k: 0: v is the first DV >= 1 dimensions" in err, err
    assert "give v (--v FILE) or v_from_k" not in err


def test_cli_scale_help_gives_the_qv_default(capsys):
    with pytest.raises(SystemExit):
        check.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "softmax scale (default 1/sqrt(headdim); with --qv 1/sqrt(headdim + Dv)" in text


class Boom(Exception):
    pass


def _mask_boom(b, h, i, j):
    raise Boom("the user's own")


def _score_boom(s, b, h, i, j):
    raise Boom("the user's own")


def test_a_mod_that_raises_raises_its_own_exception():
    q, k, v = qkv()
    out, lse = attnlib.attention(q, k, v, return_lse=True)
    calls = [lambda **m: attnlib.attention(q, k, v, **m), lambda **m: attnlib.reference_attention(q, k, v, **m),
             lambda **m: attnlib.attention_backward(q, k, v, out, lse, out, **m, **(
                 dict(score_mod_grad=lambda s, *_: 1 + 0 * s) if "score_mod" in m else {})),
             lambda **m: check_kernel(q, k, v, out, layout="bhsd", **m)]
    for call in calls:
        for mod in (dict(mask_mod=_mask_boom), dict(score_mod=_score_boom)):
            with pytest.raises(Boom, match="the user's own"):
                call(**mod)
    with pytest.raises(Boom):
        attnlib.create_block_mask(_mask_boom, None, None, 8, 8, 4, 4)


def test_a_mod_that_raises_raises_its_own_exception_on_torch():
    torch = pytest.importorskip("torch")
    t = [torch.from_numpy(x) for x in qkv()]
    for mod in (dict(mask_mod=_mask_boom), dict(score_mod=_score_boom)):
        with pytest.raises(Boom, match="the user's own"):
            attnlib.attention(*t, **mod)


def test_the_check_chains_a_mods_own_value_error():
    q, k, v = qkv()
    out = attnlib.attention(q, k, v)

    def bad(b, h, i, j):
        raise ValueError("the table has no such head")

    with pytest.raises(ValueError, match="no such head") as e:
        check_kernel(q, k, v, out, layout="bhsd", mask_mod=bad)
    assert isinstance(e.value.__cause__, ValueError) and "no such head" in str(e.value.__cause__)


def test_cli_a_scale_that_is_not_the_kernels_is_diagnosed_as_one(tmp_path, capsys):
    # A float32 kernel at its default scale 1/sqrt(32); the CLI fed --scale rounded to four
    # digits (before: "judged as a bfloat16 kernel the output passes"), or another one (before:
    # "no known cause matched"), while check_kernel given the exact scale passes it.
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 64, 32)).astype(np.float32) for _ in range(3))
    out = attnlib.attention(q, k, v, causal=True, compute_dtype="float32", block_k=16)
    assert check_kernel(q, k, v, out, layout="bhsd", causal=True, scale=1 / math.sqrt(32)).passed
    for given in ("0.1768", "0.125"):
        code, text = run_cli(tmp_path, capsys, dict(q=q, k=k, v=v, out=out), "--layout", "bhsd", "--causal",
                             "--scale", given)
        assert code == 1, text
        assert "the output matches attention with the default scale 1/sqrt(D) = 0.1767766953" in text, text
        assert f"not the scale given, {given}" in text and "bfloat16" not in text.split("diagnosis")[1]
    # The kernel that applied the scale it was given twice.
    twice = attnlib.attention(q, k, v, causal=True, compute_dtype="float32", block_k=16, scale=0.125 ** 2)
    code, text = run_cli(tmp_path, capsys, dict(q=q, k=k, v=v, out=twice), "--layout", "bhsd", "--causal",
                         "--scale", "0.125")
    assert code == 1 and "the scale given applied twice" in text, text


def test_the_printed_rule_the_help_and_the_docstring_describe_the_rule_in_force():
    """The rule line, the CLI's --help and assert_attention_close's docstring say what
    attnlib.check.rule computes (ulps of |ref| + rss, pooled per head, FINAL_ROUNDINGS more),
    not FlashAttention's 0.3-anchored atol, which the contract rejects."""
    import contextlib
    import io

    from attnlib.check import cli, rule, text

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        cli.main(["--help"])
    for words in (text.rule_text("bfloat16"), help_text.getvalue(), assert_attention_close.__doc__):
        flat = " ".join(words.split())
        assert "+ atol" not in flat and "0.3 -" not in flat, flat
        assert f"(2 r + {rule.FINAL_ROUNDINGS:g})" in flat and "sqrt(sum" in flat, flat
