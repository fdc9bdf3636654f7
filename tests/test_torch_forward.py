"""The forward on a torch device (`attnlib.core.torch_tiled`), tested on torch CPU tensors:
the same results as the numpy kernel (to rounding), the same tile classes and stats, the
same errors, torch tensors out, and computed with torch."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import attnlib
from attnlib.core import tiled

torch = pytest.importorskip("torch")

OPTION_CASES = [
    {},
    {"causal": True},
    {"causal": True, "causal_align": "top_left"},
    {"window": (17, 5)},
    {"causal": True, "window": (40, None)},
    {"window": (None, 0)},
    {"softcap": 3.0},
    {"alibi_slopes": np.linspace(0.05, 0.8, 4)},
    {"alibi_slopes": np.linspace(0.05, 0.8, 8).reshape(2, 4), "causal": True},
    {"sinks": np.array([-1.0, 0.5, 2.0, 8.0])},
    {"kv_lengths": [150, 1], "q_lengths": [90, 0], "causal": True},
    {"kv_lengths": [0, 77]},
    # Entries whose offsets differ (bottom_right with their own lengths) and whose band tiles
    # lie inside both lengths: a band mask kept for one must not serve the other.
    {"window": (40, 8), "kv_lengths": [150, 60]},
    {"causal": True, "kv_lengths": [150, 90], "q_lengths": [100, 70]},
    {"q_segment_ids": np.repeat([[0, 1, 2], [3, 3, 4]], [30, 40, 30], axis=1),
     "kv_segment_ids": np.repeat([[0, 1, 2], [3, 4, 4]], [50, 60, 40], axis=1)},
    {"scale": 0.3, "softcap": 2.0, "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4]), "window": (30, 10)},
    {"sinks": np.array([1.0, 2.0, 3.0, 4.0]), "kv_lengths": [0, 150]},
]


def _tensors(*xs):
    return [torch.from_numpy(np.ascontiguousarray(x)) for x in xs]


def _compare(q, k, v, *, tq=None, tk=None, tv=None, **kw):
    """The torch forward of (tq, tk, tv) (default: q, k, v as tensors) against numpy's on q, k, v."""
    ref_kw = {n: x for n, x in kw.items() if n in attnlib.core.options.Options.__dataclass_fields__}
    out, lse, stats = attnlib.attention(q, k, v, return_lse=True, return_stats=True, **kw)
    t = _tensors(q, k, v) if tq is None else (tq, tk, tv)
    t_out, t_lse, t_stats = attnlib.attention(*t, return_lse=True, return_stats=True, **kw)
    assert isinstance(t_out, torch.Tensor) and isinstance(t_lse, torch.Tensor)
    assert t_out.dtype == torch.float64 and t_out.shape == out.shape and t_lse.shape == lse.shape
    got, got_lse = t_out.numpy(), t_lse.numpy()
    err = attnlib.attention_errors(got, q, k, v, **ref_kw).rel_error
    assert err < 1e-13, err
    assert np.abs(got - out).max(initial=0) <= 1e-13 * max(1.0, np.abs(v).max(initial=0))
    np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(lse))
    np.testing.assert_array_equal(got_lse[~np.isfinite(lse)], lse[~np.isfinite(lse)])
    fin = np.isfinite(lse)
    assert np.all(np.abs(got_lse[fin] - lse[fin]) <= 1e-13 * np.maximum(1.0, np.abs(lse[fin])))
    np.testing.assert_array_equal(t_stats.tile_kind, stats.tile_kind)
    np.testing.assert_array_equal(t_stats.rescales, stats.rescales)
    assert t_stats.rescale_counts == stats.rescale_counts
    assert (t_stats.processed_tiles, t_stats.skipped_tiles) == (stats.processed_tiles, stats.skipped_tiles)
    return err


@pytest.mark.parametrize("kw", OPTION_CASES, ids=lambda kw: "-".join(kw) or "plain")
@pytest.mark.parametrize("tiles", [(32, 64), (512, 512)])
def test_every_option_equals_the_numpy_kernel(kw, tiles):
    q, k, v = attnlib.random_qkv(100, 150, 16, dv=24, batch=(2,), heads=4, kv_heads=2, seed=1)
    _compare(q, k, v, block_q=tiles[0], block_k=tiles[1], **kw)


@pytest.mark.parametrize("kw", [{"kv_splits": 3}, {"kv_splits": 3, "sinks": np.arange(4.0)},
                                {"rescale_threshold": 6.0}, {"workers": 1}, {"workers": 2}])
def test_execution_options_equal_the_numpy_kernel(kw):
    q, k, v = attnlib.random_qkv(130, 200, 16, batch=(2,), heads=4, kv_heads=1, seed=2)
    _compare(q, k, v, block_q=32, block_k=48, causal=True, **kw)


def test_bits_do_not_depend_on_the_thread_count():
    q, k, v = _tensors(*attnlib.random_qkv(300, 300, 32, heads=8, seed=3))
    one = attnlib.attention(q, k, v, causal=True, workers=1, block_q=64, block_k=64)
    two = attnlib.attention(q, k, v, causal=True, workers=2, block_q=64, block_k=64)
    assert torch.equal(one, two)


@settings(max_examples=25)
@given(sq=st.integers(0, 70), sk=st.integers(0, 90), heads=st.sampled_from([(1, 1), (4, 2), (3, 1)]),
       causal=st.booleans(), left=st.one_of(st.none(), st.integers(0, 40)), bq=st.integers(1, 40),
       bk=st.integers(1, 50), seed=st.integers(0, 99))
@pytest.mark.slow
def test_random_problems_equal_the_numpy_kernel(sq, sk, heads, causal, left, bq, bk, seed):
    q, k, v = attnlib.random_qkv(sq, sk, 8, heads=heads[0], kv_heads=heads[1], seed=seed)
    _compare(q, k, v, causal=causal, window=(left, None), block_q=bq, block_k=bk)


def test_two_dimensional_and_empty_inputs():
    q, k, v = attnlib.random_qkv(40, 50, 8, seed=4)  # (S, D): one head
    _compare(q, k, v, block_q=16, block_k=16, causal=True)
    for sq, sk in [(0, 5), (5, 0), (0, 0)]:
        q, k, v = attnlib.random_qkv(sq, sk, 8, heads=2, seed=0)
        out, lse = attnlib.attention(*_tensors(q, k, v), return_lse=True)
        ref, ref_lse = attnlib.attention(q, k, v, return_lse=True)
        np.testing.assert_array_equal(out.numpy(), ref)
        np.testing.assert_array_equal(lse.numpy(), ref_lse)
    q, k, v = (np.zeros((0, 2, 5, 8)),) * 3  # a zero-size batch axis
    assert attnlib.attention(*_tensors(q, k, v)).shape == (0, 2, 5, 8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_low_precision_inputs_are_read_exactly_and_computed_in_float64(dtype):
    q, k, v = attnlib.random_qkv(90, 120, 16, heads=4, kv_heads=2, seed=5)
    tq, tk, tv = (t.to(getattr(torch, dtype)) for t in _tensors(q, k, v))
    exact = [t.to(torch.float64).numpy() for t in (tq, tk, tv)]
    before = [t.clone() for t in (tq, tk, tv)]
    _compare(*exact, tq=tq, tk=tk, tv=tv, causal=True, block_q=32, block_k=32)
    assert all(torch.equal(a, b) for a, b in zip(before, (tq, tk, tv)))  # never modified


def test_float8_inputs():
    q, k, v = attnlib.random_qkv(40, 60, 16, heads=2, seed=6)
    t = [x.to(torch.float8_e4m3fn) for x in _tensors(q, k, v)]
    _compare(*[x.to(torch.float64).numpy() for x in t], tq=t[0], tk=t[1], tv=t[2], block_q=16, block_k=16)


def test_adversarial_and_huge_magnitudes(strict):
    q, k, v = attnlib.random_qkv(64, 96, 8, heads=2, seed=7)
    q = q * 1e4 / np.abs(q).max()  # logits of ~1e4
    assert _compare(q, k, v, causal=True, block_q=16, block_k=32) < 1e-13
    big_v = v * 1e307  # sums of the values beyond float64: the values are scaled by 2**-e
    _compare(q, k, big_v, block_q=16, block_k=32)


def test_strict_floating_point_mode(strict):
    q, k, v = attnlib.random_qkv(50, 70, 8, heads=4, kv_heads=2, seed=8)
    _compare(q, k, v, causal=True, window=(20, None), kv_lengths=[0] if False else None,
             sinks=np.zeros(4), softcap=4.0, block_q=16, block_k=16)


def test_requires_grad_tensors_are_read_and_left_alone():
    q, k, v = _tensors(*attnlib.random_qkv(30, 40, 8, heads=2, seed=9))
    for t in (q, k, v):
        t.requires_grad_(True)
    out = attnlib.attention(q, k, v, causal=True)
    assert not out.requires_grad and q.grad is None


def test_numpy_inputs_with_device_come_back_as_numpy():
    q, k, v = attnlib.random_qkv(60, 80, 16, heads=2, seed=10)
    out, lse = attnlib.attention(q, k, v, causal=True, return_lse=True, device="cpu")
    assert type(out) is np.ndarray and type(lse) is np.ndarray
    ref = attnlib.attention(q, k, v, causal=True)
    assert np.abs(out - ref).max() < 1e-14
    out2 = attnlib.attention(q, k, v, causal=True, device=torch.device("cpu"))
    np.testing.assert_array_equal(out, out2)


def test_the_torch_path_runs_the_one_kernel_on_tensors(monkeypatch):
    # One implementation (`attnlib.core.backend`): the torch path runs the shared steps, with
    # the inputs as tensors throughout (the host's reading of the inputs is never called).
    q, k, v = _tensors(*attnlib.random_qkv(60, 80, 16, heads=2, seed=11))
    from attnlib.core import hooks, problem

    def refuse(*args, **kwargs):
        raise AssertionError("the inputs were read on the host")

    seen = []
    shipped = hooks.get("absorb")

    def absorb(state, q_i, *args, **kwargs):
        seen.append(isinstance(state.acc, torch.Tensor) and isinstance(q_i, torch.Tensor))
        return shipped(state, q_i, *args, **kwargs)

    monkeypatch.setattr(problem, "parse", refuse)
    with hooks.replaced(absorb=absorb):
        out = attnlib.attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and seen and all(seen)
    with pytest.raises(AssertionError, match="on the host"):
        attnlib.attention(q.numpy(), k.numpy(), v.numpy(), causal=True)


PAGED_CASES = [{}, {"causal": True}, {"causal": True, "window": (5, None), "softcap": 3.0,
                                      "alibi_slopes": np.linspace(0.1, 0.4, 4), "sinks": np.arange(4.0)}]


@pytest.mark.parametrize("kw", PAGED_CASES, ids=lambda kw: "-".join(kw) or "plain")
def test_a_paged_cache_on_the_device(kw):
    rng = np.random.default_rng(0)
    k_cache, v_cache = rng.standard_normal((2, 20, 8, 2, 16))
    q = rng.standard_normal((3, 4, 5, 16))
    table = np.array([rng.permutation(20)[:6] for _ in range(3)])
    lens = [40, 0, 17]
    out, lse = attnlib.attention(q, k_cache, v_cache, block_table=table, cache_seqlens=lens, return_lse=True, **kw)
    t_out, t_lse = attnlib.attention(*_tensors(q, k_cache, v_cache), block_table=table, cache_seqlens=lens,
                                     return_lse=True, **kw)
    assert isinstance(t_out, torch.Tensor) and np.abs(t_out.numpy() - out).max() < 1e-13
    fin = np.isfinite(lse)
    np.testing.assert_array_equal(np.isfinite(t_lse.numpy()), fin)
    assert np.abs(t_lse.numpy()[fin] - lse[fin]).max() < 1e-13
    bad = k_cache.copy()
    bad[table[2, 1], 3, 1, 0] = np.nan  # key 11 of entry 2
    with pytest.raises(ValueError, match=f"k_cache page {table[2, 1]} holds NaN or inf \\(key [0-9]+ of batch entry"):
        attnlib.attention(*_tensors(q, bad, v_cache), block_table=table, cache_seqlens=lens)
    with pytest.raises(ValueError, match="kv_lengths"):
        attnlib.attention(*_tensors(q, k_cache, v_cache), block_table=table, cache_seqlens=lens, kv_lengths=lens)


@pytest.mark.parametrize("device, error", [("meta", ValueError), ("nonsense", ValueError),
                                           (3, TypeError), (True, TypeError)])
def test_bad_devices_are_refused(device, error):
    q, k, v = attnlib.random_qkv(8, 8, 4, seed=0)
    with pytest.raises(error, match="device"):
        attnlib.attention(q, k, v, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_device_is_refused():
    q, k, v = attnlib.random_qkv(8, 8, 4, seed=0)
    with pytest.raises(ValueError, match="CUDA"):
        attnlib.attention(q, k, v, device="cuda")


def test_bad_tensors_get_the_host_paths_errors():
    q, k, v = _tensors(*attnlib.random_qkv(20, 30, 8, heads=2, seed=0))
    bad = q.clone()
    bad[0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"q contains NaN or inf \(first at index \(0, 3, 1\)\)"):
        attnlib.attention(bad, k, v)
    with pytest.raises(TypeError, match="k must have a real floating dtype"):
        attnlib.attention(q, k.to(torch.int64), v)
    with pytest.raises(TypeError, match="meta"):
        attnlib.attention(q, k, torch.empty(v.shape, device="meta"))
    with pytest.raises(ValueError, match="same head dim"):
        attnlib.attention(q, k[..., :4], v)
    huge = q * 1e300
    with pytest.raises(ValueError, match="scores overflow"):
        attnlib.attention(huge, k * 1e10, v)
    with pytest.raises(ValueError, match="scores overflow"):
        attnlib.attention(huge.numpy(), k.numpy() * 1e10, v.numpy())


@pytest.mark.slow
def test_numpy_calls_never_import_torch():
    code = ("import numpy as np, sys, attnlib\n"
            "q, k, v = attnlib.random_qkv(64, 64, 8, heads=2, seed=0)\n"
            "attnlib.attention(q, k, v, causal=True, return_stats=True)\n"
            "attnlib.reference_attention(q, k, v, causal=True)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
def test_vml_functions_are_first_called_by_one_thread_alone():
    # MKL's VML picks a function's kernel on its first call; racing first calls can run a
    # low-accuracy one (`device.warm_vml`).  A fresh process: the first exp is the warm-up's,
    # made by the calling thread before the two workers of the backward start.
    code = ("import threading, numpy as np, torch, attnlib\n"
            "from attnlib.core import device\n"
            "calls, exp = [], torch.exp\n"
            "torch.exp = lambda *a, **k: (calls.append(threading.current_thread().name), exp(*a, **k))[1]\n"
            "q, k, v = attnlib.random_qkv(256, 256, 16, seed=0)\n"
            "out, lse = attnlib.attention(q, k, v, return_lse=True)  # numpy: no torch op yet\n"
            "t = [torch.from_numpy(x) for x in (q, k, v, out, lse, np.ones_like(out))]\n"
            "attnlib.attention_backward(*t, workers=2, block_q=64, block_k=64)\n"
            "assert device._vml_warm and calls[0] == 'MainThread', calls[:3]\n"
            "assert len(set(calls)) > 1, 'the backward ran on one thread: nothing tested'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_warmed_vml_function_exists_in_torch():
    from attnlib.core import device
    assert all(callable(getattr(torch, name)) for name in device._VML_FUNCTIONS)


@pytest.mark.parametrize("compute_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kw", [{}, {"causal": True, "kv_splits": 3},
                                {"softcap": 3.0, "alibi_slopes": np.linspace(0.1, 0.5, 4), "sinks": np.arange(4.0)},
                                {"rescale_threshold": 5.0, "window": (20, 30)}], ids=lambda kw: "-".join(kw) or "plain")
def test_a_lower_compute_precision_follows_the_numpy_emulation(compute_dtype, kw):
    """The same rounding steps: the outputs within an ulp of the type, the lse of float32."""
    from attnlib.core.arrays import as_numpy, finfo
    q, k, v = attnlib.random_qkv(130, 200, 16, heads=4, kv_heads=2, batch=(2,), seed=0)
    out, lse = attnlib.attention(q, k, v, compute_dtype=compute_dtype, return_lse=True, block_q=32,
                                 block_k=64, **kw)
    t_out, t_lse = attnlib.attention(*_tensors(q, k, v), compute_dtype=compute_dtype, return_lse=True,
                                     block_q=32, block_k=64, **kw)
    assert str(t_out.dtype) == f"torch.{compute_dtype}" and t_lse.dtype == torch.float32
    got = as_numpy(t_out, "out")
    assert got.dtype == out.dtype
    eps = float(finfo(out.dtype).eps)
    assert np.abs(got.astype(np.float64) - out.astype(np.float64)).max() <= 2 * eps * np.abs(v).max()
    fin = np.isfinite(lse)
    np.testing.assert_array_equal(np.isfinite(t_lse.numpy()), fin)
    assert np.abs(t_lse.numpy()[fin] - lse[fin]).max() <= 8 * np.finfo(np.float32).eps * np.abs(lse[fin]).max()
    host = attnlib.attention(q, k, v, compute_dtype=compute_dtype, block_q=32, block_k=64, device="cpu", **kw)
    assert type(host) is np.ndarray and host.dtype == out.dtype


def test_float64_to_float16_rounds_once_as_numpy_does():
    from attnlib.core.device import rounded
    x = np.random.default_rng(0).standard_normal(10**6) * np.logspace(-9, 4, 10**6)
    x[:4] = [65504.0, 65519.99, -70000.0, 2.0 ** -25]  # the largest, the last below inf, beyond, a tie to 0
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = rounded(torch.from_numpy(x), torch.float16).numpy()
    np.testing.assert_array_equal(got, want)
    assert torch.equal(rounded(torch.from_numpy(x), torch.bfloat16),
                       torch.from_numpy(x).to(torch.bfloat16))


DOCS = np.repeat(np.arange(5), [20, 30, 10, 25, 15])  # per position, 100 positions


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _doc_numpy(b, h, q_idx, kv_idx):  # numpy-written: indexes a numpy table
    return DOCS[np.asarray(q_idx)] == DOCS[np.asarray(kv_idx)]


def _head_window(b, h, q_idx, kv_idx):  # depends on the head and the batch entry
    return (q_idx - kv_idx).abs() <= 8 * (h + 1) + 4 * b


def _alibi(score, b, h, q_idx, kv_idx):
    return score - 0.1 * (h + 1) * (q_idx - kv_idx).abs()


def _mask_by_score(score, b, h, q_idx, kv_idx):  # -inf masks, FlexAttention's way
    return torch.where((q_idx + kv_idx) % 7 == 0, float("-inf"), score * 1.5)


MOD_CASES = [
    {"mask_mod": _causal},
    {"mask_mod": _doc_numpy},
    {"mask_mod": _head_window},
    {"score_mod": _alibi},
    {"score_mod": _mask_by_score, "causal": True},
    {"mask_mod": _head_window, "score_mod": _alibi, "softcap": 5.0, "kv_lengths": [100, 70]},
]


@pytest.mark.parametrize("kw", MOD_CASES, ids=lambda kw: "-".join(
    f"{n}={getattr(x, '__name__', '')}" if callable(x) else n for n, x in kw.items()))
def test_flex_mods_on_the_device_equal_the_numpy_kernel(kw):
    from attnlib.core.flex import from_torch
    q, k, v = attnlib.random_qkv(100, 100, 16, batch=(2,), heads=4, kv_heads=2, seed=12)
    host_kw = {n: (from_torch(x) if callable(x) and x is not _doc_numpy else x) for n, x in kw.items()}
    out, lse, stats = attnlib.attention(q, k, v, return_lse=True, return_stats=True, block_q=32, block_k=16,
                                        **host_kw)
    t_out, t_lse, t_stats = attnlib.attention(*_tensors(q, k, v), return_lse=True, return_stats=True,
                                              block_q=32, block_k=16, **kw)
    assert np.abs(t_out.numpy() - out).max() < 1e-13
    fin = np.isfinite(lse)
    np.testing.assert_array_equal(np.isfinite(t_lse.numpy()), fin)
    assert np.abs(t_lse.numpy()[fin] - lse[fin]).max(initial=0) < 1e-12
    np.testing.assert_array_equal(t_stats.tile_kind, stats.tile_kind)
    np.testing.assert_array_equal(t_stats.rescales, stats.rescales)


@pytest.mark.slow
def test_block_masks_on_the_device():
    q, k, v = attnlib.random_qkv(100, 100, 16, heads=2, seed=13)
    bm = attnlib.create_block_mask(_causal, None, None, 100, 100, 32, 32)
    want = attnlib.attention(q, k, v, block_mask=bm)
    got = attnlib.attention(*_tensors(q, k, v), block_mask=bm)
    assert np.abs(got.numpy() - want).max() < 1e-13
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    torch_bm = flex.create_block_mask(_causal, None, None, 100, 100, device="cpu", BLOCK_SIZE=32)
    got = attnlib.attention(*_tensors(q, k, v), block_mask=torch_bm)
    assert np.abs(got.numpy() - want).max() < 1e-13


def test_a_score_mod_giving_nan_is_refused_on_the_device():
    q, k, v = _tensors(*attnlib.random_qkv(40, 40, 8, heads=2, seed=0))
    with pytest.raises(ValueError, match="score_mod returned NaN or \\+inf"):
        attnlib.attention(q, k, v, score_mod=lambda s, b, h, i, j: torch.where(i == j, float("nan"), s))
    # hidden by the mask: no error
    attnlib.attention(q, k, v, causal=True, score_mod=lambda s, b, h, i, j: torch.where(j > i, float("nan"), s))


@pytest.mark.parametrize("kw", MOD_CASES, ids=lambda kw: "-".join(
    f"{n}={getattr(x, '__name__', '')}" if callable(x) else n for n, x in kw.items()))
@pytest.mark.parametrize("compute_dtype", [None, "bfloat16"])
def test_flex_mods_in_the_device_reference(kw, compute_dtype):
    from attnlib.core.flex import from_torch
    q, k, v = attnlib.random_qkv(100, 100, 16, batch=(2,), heads=4, kv_heads=2, seed=14)
    host_kw = {n: (from_torch(x) if callable(x) and x is not _doc_numpy else x) for n, x in kw.items()}
    out, lse = attnlib.reference_attention(q, k, v, return_lse=True, compute_dtype=compute_dtype, **host_kw)
    t_out, t_lse = attnlib.reference_attention(*_tensors(q, k, v), return_lse=True, compute_dtype=compute_dtype,
                                               **kw)
    from attnlib.core.arrays import as_numpy
    tol = 1e-13 if compute_dtype is None else 2 ** -7
    assert np.abs(as_numpy(t_out, "out").astype(np.float64) - out.astype(np.float64)).max() <= tol
    fin = np.isfinite(lse)
    np.testing.assert_array_equal(np.isfinite(t_lse.numpy()), fin)


def test_python_floats_in_torch_written_mods_are_float64():
    """`0.1 * (q_idx - kv_idx)` on index tensors is float32 under torch's default: computed
    under a float64 default on the device and through from_torch, as numpy computes it."""
    from attnlib.core.flex import from_torch
    q, k, v = attnlib.random_qkv(64, 64, 16, batch=(3,), heads=2, seed=15)
    bias = lambda s, b, h, q_idx, kv_idx: s - 0.1 * (q_idx - kv_idx)  # noqa: E731
    host = attnlib.attention(q, k, v, score_mod=bias)
    for out in (attnlib.attention(*_tensors(q, k, v), score_mod=bias).numpy(),
                attnlib.reference_attention(*_tensors(q, k, v), score_mod=bias).numpy(),
                attnlib.attention(q, k, v, score_mod=from_torch(bias))):
        assert attnlib.attention_errors(out, q, k, v, score_mod=bias).rel_error < 1e-13
    assert torch.get_default_dtype() == torch.float32  # restored
    from attnlib.check import check_kernel
    assert check_kernel(*_tensors(q, k, v, host), layout="bhsd", score_mod=bias).passed


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's __array_wrap__, under numpy 2
def test_numpy_ufunc_masks_fall_back_to_the_host():
    q, k, v = attnlib.random_qkv(64, 64, 16, heads=2, seed=16)
    mm = lambda b, h, q_idx, kv_idx: np.logical_or(kv_idx <= q_idx, kv_idx % 3 == 0)  # noqa: E731
    want = attnlib.attention(q, k, v, mask_mod=mm)
    assert np.abs(attnlib.attention(*_tensors(q, k, v), mask_mod=mm).numpy() - want).max() < 1e-14
    assert np.abs(attnlib.reference_attention(*_tensors(q, k, v), mask_mod=mm).numpy() - want).max() < 1e-14


def test_device_errors_are_flags_per_thread_not_per_tile(monkeypatch):
    """The overflow check on: a few tile-sized flags per thread, never one per tile."""
    from attnlib.core import torch_backend
    seen = []
    original = torch_backend.Torch.finish

    def spy(self):
        seen.append([len(flags) for flags in self._flags])  # per thread, one flag per kind of error
        return original(self)

    monkeypatch.setattr(torch_backend.Torch, "finish", spy)
    q, k, v = _tensors(*attnlib.random_qkv(256, 256, 8, heads=2, seed=17))
    attnlib.attention(q * 1e150, k * 1e150, v, block_q=16, block_k=16, workers=2, causal=True,
                      score_mod=lambda s, b, h, i, j: s)
    assert seen and 1 <= len(seen[0]) <= 2 and all(n <= 2 for n in seen[0]), seen


def test_empty_batches_with_per_entry_masks_in_the_device_reference():
    q = torch.zeros(0, 2, 5, 4, dtype=torch.float64)
    for kw in ({"kv_lengths": np.array([], dtype=int)}, {"q_lengths": np.array([], dtype=int)}):
        assert attnlib.reference_attention(q, q, q, **kw).shape == (0, 2, 5, 4)


def test_one_head_of_small_tiles_runs_one_worker_with_torchs_threads(monkeypatch):
    """`Torch.fit_workers`: where every head's tiles together are at most half a work unit and
    torch's threads pay here, the default workers become one (torch's threads inside each op);
    a caller's workers are never changed, and the bits are the same either way."""
    from attnlib.core import device, torch_backend
    monkeypatch.setattr(device, "threads_pay", lambda: True)
    seen = []
    real = torch_backend.Torch.fit_workers

    def spy(self, unit_bytes):
        real(self, unit_bytes)
        seen.append((unit_bytes, self.workers))
    monkeypatch.setattr(torch_backend.Torch, "fit_workers", spy)
    q, k, v = (torch.from_numpy(x) for x in attnlib.random_qkv(600, 600, 32, heads=1, batch=(1,), seed=0))
    options = dict(causal=True, window=(100, None), return_lse=True)
    default = attnlib.attention(q, k, v, **options)
    assert seen[-1] == (8 * 256 * 256, 1)
    two = attnlib.attention(q, k, v, workers=2, **options)
    assert seen[-1][1] == 2  # the caller's choice
    assert all(torch.equal(a, b) for a, b in zip(default, two))
    q4, k4, v4 = (x.expand(1, 4, -1, -1).contiguous() for x in (q, k, v))
    attnlib.attention(q4, k4, v4, **options)  # four heads fill a unit: the workers stay
    assert seen[-1][1] == torch_backend.Torch(torch.device("cpu")).workers
