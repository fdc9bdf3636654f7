"""Bad input gets a clear TypeError/ValueError naming the argument and what was wrong."""

import numpy as np
import pytest

from attnlib import attention, random_qkv, reference_attention

ENTRY_POINTS = [attention, reference_attention]


def qkv(*shape_q, sk=6, hk=None, d=None, dv=4):
    q = np.ones(shape_q)
    *lead, hq, _, dq = shape_q
    d = dq if d is None else d
    hk = hq if hk is None else hk
    return q, np.ones((*lead, hk, sk, d)), np.ones((*lead, hk, sk, dv))


@pytest.mark.parametrize("fn", ENTRY_POINTS)
@pytest.mark.parametrize("args, exc, match", [
    ((np.ones(4), np.ones(4), np.ones(4)), ValueError, r"q must have at least 2 dimensions"),
    ((np.ones((2, 3, 4)), np.ones((3, 4)), np.ones((3, 4))), ValueError, r"same number of dimensions.*q \(2, 3, 4\)"),
    ((np.ones((2, 1, 3, 4)), np.ones((3, 1, 3, 4)), np.ones((3, 1, 3, 4))), ValueError, r"equal batch"),
    (qkv(3, 5, 4, hk=2), ValueError, r"Hq % Hk == 0.*Hq=3, Hk=2"),
    (qkv(2, 5, 4, d=8), ValueError, r"same head dim D"),
    (qkv(2, 5, 0, d=0), ValueError, r"head dims must be non-empty"),
    ((np.ones((5, 4)), np.ones((6, 4)), np.ones((7, 4))), ValueError, r"k and v must have the same heads and keys"),
    ((np.ones((5, 4), dtype=int), np.ones((6, 4)), np.ones((6, 4))), TypeError, r"q must have a real floating dtype.*int64"),
    ((np.ones((5, 4)), np.ones((6, 4), dtype=complex), np.ones((6, 4))), TypeError, r"k must have a real floating dtype.*complex"),
    ((np.ones((5, 4)), np.ones((6, 4)), np.ones((6, 4), dtype=bool)), TypeError, r"v must have a real floating dtype.*bool"),
])
def test_bad_shapes_and_dtypes(fn, args, exc, match):
    with pytest.raises(exc, match=match):
        fn(*args)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs(fn, name, bad):
    q, k, v = random_qkv(9, 7, 4, heads=2, seed=0)
    arrays = dict(q=q, k=k, v=v)
    arrays[name][1, 5, 2] = bad
    with pytest.raises(ValueError, match=rf"{name} contains NaN or inf \(first at index \(1, 5, 2\)\)"):
        fn(**arrays)
    with np.errstate(all="ignore"):  # the caller may opt out, and gets what they asked for
        fn(**arrays, check_finite=False)


def test_finite_check_scans_every_chunk(monkeypatch):
    from attnlib.core import arrays

    monkeypatch.setattr(arrays, "_FINITE_CHUNK", 8)
    q, k, v = random_qkv(50, 40, 4, seed=0)
    k[37, 1] = np.nan
    with pytest.raises(ValueError, match=r"k contains NaN or inf \(first at index \(37, 1\)\)"):
        attention(q, k, v)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(block_q=0), ValueError, r"block_q must be a positive integer, got 0"),
    (dict(block_k=-3), ValueError, r"block_k must be a positive integer, got -3"),
    (dict(block_q=16.0), TypeError, r"block_q must be a positive integer, got 16.0"),
    (dict(block_k=True), TypeError, r"block_k must be a positive integer"),
    (dict(causal=True, causal_align="top-left"), ValueError, r"causal_align must be one of"),
    (dict(causal="yes"), TypeError, r"causal must be a bool"),
    (dict(scale="0.1"), TypeError, r"scale must be a real number"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
    (dict(return_lse=1), TypeError, r"return_lse must be a bool"),
])
def test_bad_options(kw, exc, match):
    q, k, v = random_qkv(5, 6, 4, seed=0)
    with pytest.raises(exc, match=match):
        attention(q, k, v, **kw)


def test_numpy_integer_block_sizes_are_fine():
    q, k, v = random_qkv(5, 6, 4, seed=0)
    out = attention(q, k, v, block_q=np.int64(2), block_k=np.int32(3))
    assert out.tobytes() == attention(q, k, v, block_q=2, block_k=3).tobytes()


def test_unknown_alignment_refused_even_without_causal():
    q, k, v = random_qkv(5, 6, 4, seed=0)
    with pytest.raises(ValueError, match="causal_align"):
        reference_attention(q, k, v, causal_align="diagonal")
