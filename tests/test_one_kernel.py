"""One kernel for numpy and torch (issue 45): each numerical step is written once, against
the arrays' backend (`attnlib.core.backend`), and the backends hold only primitives.

A static part reads the package's source: the shared steps are defined once, no backend
defines one, every backend method is a primitive (a few statements), and the backends
offer the same protocol.  A numerical part runs the torch CPU backend against numpy on
every forward option of the contract: ``out`` within ``1e-13 * (P @ |V|)`` entry by entry
(the size of what each entry sums, `attnlib.metrics`), ``lse`` and ``max_scores`` within
``1e-13`` of their own size; and on every option of the backward, each gradient within
``1e-13`` of the size of what its entry sums (the dense backward's ``return_abs``).
"""

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

import attnlib
from attnlib.core import backend
from attnlib.judge.metrics import reference_with_abs

PACKAGE = Path(attnlib.__file__).parent
#: The steps of the shared kernel (forward, split-KV merge, stream): one definition each.
STEPS = {"absorb": "core/tiles.py", "tile_scores": "core/tiles.py", "document_blocks": "core/tiles.py",
         "update": "core/online.py", "finalize": "core/online.py", "finalize_parts": "core/online.py",
         "merge": "core/online.py", "merge_parts": "core/online.py", "lse_of": "core/online.py",
         "run_keys": "core/tiled.py", "_forward": "core/tiled.py", "_stream": "core/stream.py",
         "unscale_values": "core/problem.py", "tiled_backward": "core/backward.py", "_backward_plan": "core/backward.py",
         "_rows_delta": "core/backward.py", "grad_exponent": "core/gradparts.py"}
#: Backend modules: primitives only.
BACKEND_MODULES = ("core/backend.py", "core/torch_backend.py")
#: Backend functions that are plumbing, not arithmetic (reading inputs, errors, device moves).
PLUMBING = {"__init__", "real_float", "_on_device", "finish", "refuse", "mask", "_bias", "mask_values", "distance", "threads", "checked_max",
            "score_values", "device_tiles", "maximum", "units", "from_host", "real_float"}
#: The torch modules of the core: the backend's primitives and a user's functions called on a
#: device.
TORCH_MODULES = {"torch_backend.py", "torch_flex.py"}
#: The injected defects are deliberate wrong copies of steps; they are not kernels.
NOT_KERNELS = ("evidence/defects.py",)


def _functions(path, kernels_only=False):
    """The functions defined in ``path``; ``kernels_only``: module-level ones and the methods of
    softmax-state classes (where a second copy of a step would live), not other classes'."""
    tree = ast.parse(path.read_text())
    if not kernels_only:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        if cls.name.endswith(("Softmax", "State", "Kernel")):
            found += [n for n in cls.body if isinstance(n, ast.FunctionDef) and not _extends(n)]
    return found


def _extends(method) -> bool:
    """Whether ``method`` calls ``super().<its own name>``: a subclass that adds to the step
    (`online.SizedSoftmax`), running the one definition, not a second copy of it."""
    return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == method.name
               and isinstance(c.func.value, ast.Call) and getattr(c.func.value.func, "id", None) == "super"
               for c in ast.walk(method))


def test_each_shared_step_is_defined_once():
    found = {name: [] for name in STEPS}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in NOT_KERNELS:
            continue
        for fn in _functions(path, kernels_only=True):
            if fn.name in found:
                found[fn.name].append(rel)
    for name, where in STEPS.items():
        assert found[name] == [where], f"step {name} defined in {found[name]}, expected only in {where}"


def test_the_backends_hold_primitives_only():
    for rel in BACKEND_MODULES:
        for fn in _functions(PACKAGE / rel):
            assert fn.name not in STEPS, f"{rel} defines the step {fn.name}"
            if fn.name in PLUMBING:
                continue
            body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            assert len(body) <= 4, f"{rel}: {fn.name} has {len(body)} statements: a primitive has a few"


def test_the_backends_offer_one_protocol():
    pytest.importorskip("torch")
    from attnlib.core.torch_backend import Torch

    def methods(cls):
        return {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}

    assert methods(backend.Numpy) - {"name", "dev", "float64", "int64"} <= methods(Torch) | {"float64", "int64"}
    missing = methods(backend.Numpy) - methods(Torch) - {"float64", "int64", "dev"}
    assert not missing, missing


def test_no_torch_twin_of_the_forward():
    present = {p.name for p in (PACKAGE / "core").glob("torch_*.py")}
    assert present <= TORCH_MODULES, present - TORCH_MODULES
    assert not {"torch_tiled.py", "torch_merge.py", "torch_stream.py", "torch_backward.py", "torch_reference.py"} & present


# -- torch against numpy on every forward option ---------------------------------------------

torch = pytest.importorskip("torch")

B, HQ, HK, SQ, SK, D, DV = 2, 4, 2, 70, 110, 16, 24


def _mods():
    def mask_mod(b, h, i, j):
        return (i - j) % 3 != 1

    def score_mod(s, b, h, i, j):
        return s + 0.01 * (h + 1) * (i - j)
    return mask_mod, score_mod


_MASK, _SCORE = _mods()
_LISTS = np.sort(np.random.default_rng(5).integers(-1, SK, (B, SQ, 20)), -1)
#: Every option of the contract's forward (the low compute precisions apart: their roundings
#: follow each library's own BLAS, compared in tests/test_torch_forward.py).
OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "top_left": {"causal": True, "causal_align": "top_left"},
    "window": {"window": (17, 5)},
    "causal window": {"causal": True, "window": (40, None)},
    "padding": {"kv_lengths": [110, 3], "q_lengths": [60, 0], "causal": True},
    "documents": {"q_segment_ids": np.repeat([[0, 1, 2], [3, 3, 4]], [20, 30, 20], axis=1),
                  "kv_segment_ids": np.repeat([[0, 1, 2], [3, 4, 4]], [40, 40, 30], axis=1)},
    "leftpad": {"key_leftpad": [5, 0], "kv_lengths": [100, 110], "causal": True},
    "chunks": {"attention_chunk": 32, "causal": True},
    "sink tokens": {"window": (20, 0), "sink_token_length": 4},
    "softcap": {"softcap": 3.0, "causal": True},
    "alibi": {"alibi_slopes": np.linspace(0.05, 0.8, HQ)},
    "sinks": {"sinks": np.array([-1.0, 0.5, 2.0, 8.0]), "causal": True},
    "scale": {"scale": 0.3, "softcap": 2.0, "alibi_slopes": np.linspace(0.1, 0.4, HQ), "window": (30, 10)},
    "kv_splits": {"kv_splits": 3, "sinks": np.arange(4.0), "causal": True},
    "lazy rescale": {"rescale_threshold": 8.0, "causal": True},
    "mask_mod": {"mask_mod": _MASK},
    "score_mod": {"score_mod": _SCORE, "causal": True},
    "top-k lists": {"gather_kv_indices": _LISTS},
    "lse base 2, sinks excluded": {"lse_base": 2, "sinks": np.arange(4.0), "lse_sink": "excluded"},
    "lse empty +inf": {"kv_lengths": [0, 50], "lse_empty": "+inf"},
    "descales": {"q_descale": np.array([[0.5, 2.0]] * B), "k_descale": np.array([[1.5, 0.25]] * B),
                 "v_descale": np.array([[3.0, 0.5]] * B)},
}


def _inputs(name):
    q, k, v = attnlib.random_qkv(SQ, SK, D, dv=DV, batch=(B,), heads=HQ, kv_heads=HK, seed=1)
    return q * 3, k, v  # logits of a few units: rescales happen


@pytest.mark.parametrize("tiles", [(32, 64), None], ids=["32x64", "default"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_torch_equals_numpy_within_1e13_of_p_abs_v(name, tiles):
    kw = dict(OPTIONS[name])
    if tiles is not None and "block_mask" not in kw:
        kw.update(block_q=tiles[0], block_k=tiles[1])
    q, k, v = _inputs(name)
    want = attnlib.attention(q, k, v, return_lse=True, return_max_scores=True, **kw)
    got = attnlib.attention(*(torch.from_numpy(x) for x in (q, k, v)), return_lse=True, return_max_scores=True,
                            **kw)
    assert all(isinstance(x, torch.Tensor) for x in got)
    out, lse, mx = (x.numpy() for x in got)
    ref_kw = {n: x for n, x in kw.items() if n not in ("block_q", "block_k", "kv_splits", "rescale_threshold",
                                                        "lse_base", "lse_sink", "lse_empty")}
    size = reference_with_abs(q, k, v, **ref_kw)[1] if "descale" not in name else np.abs(want[0]) + 1.0
    assert np.all(np.abs(out - want[0]) <= 1e-13 * size + 1e-300), np.abs(out - want[0]).max()
    for a, b in ((lse, want[1]), (mx, want[2])):
        assert np.array_equal(np.isfinite(a), np.isfinite(b)) and np.array_equal(a[~np.isfinite(a)], b[~np.isfinite(b)])
        fin = np.isfinite(b)
        assert np.all(np.abs(a[fin] - b[fin]) <= 1e-13 * np.maximum(1.0, np.abs(b[fin])))


def _score_mod_grad(s, b, h, i, j):
    return np.ones_like(s) if isinstance(s, np.ndarray) else torch.ones_like(s)


#: Every option of the backward (the forward's masks and score terms; not its split-KV, lazy
#: rescaling, LSE conventions or descales, which change how out and lse are made, not what).
GRAD_OPTIONS = {name: dict(OPTIONS[name]) for name in OPTIONS
                if name not in ("kv_splits", "lazy rescale", "lse base 2, sinks excluded", "lse empty +inf",
                                "descales")}
GRAD_OPTIONS["score_mod"]["score_mod_grad"] = _score_mod_grad


@pytest.mark.parametrize("tiles", [(32, 64), None], ids=["32x64", "default"])
@pytest.mark.parametrize("name", list(GRAD_OPTIONS))
def test_torch_gradients_equal_numpys_within_1e13_of_their_size(name, tiles):
    from attnlib.core.backward import reference_attention_backward
    kw = dict(GRAD_OPTIONS[name])
    fwd = {n: x for n, x in kw.items() if n != "score_mod_grad"}
    tile_kw = {} if tiles is None else dict(block_q=tiles[0], block_k=tiles[1])
    q, k, v = _inputs(name)
    dout = np.random.default_rng(7).standard_normal((B, HQ, SQ, DV))
    out, lse = attnlib.attention(q, k, v, return_lse=True, **fwd)
    want = attnlib.attention_backward(q, k, v, out, lse, dout, **tile_kw, **kw)
    got = attnlib.attention_backward(*(torch.from_numpy(x) for x in (q, k, v, out, lse, dout)), **tile_kw, **kw)
    assert len(got) == len(want) and all(isinstance(x, torch.Tensor) for x in got)
    sizes = reference_attention_backward(q, k, v, dout, return_abs=True, **kw)[1]
    for g, w, size, n in zip(got, want, sizes, ("dq", "dk", "dv", "dsinks")):
        err = np.abs(g.numpy() - w)
        assert np.all(err <= 1e-13 * size + 1e-300), (n, float(err.max()))


# -- what the second reader found (issue 45's refactor) ----------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_row_stats_are_float64_and_alike_on_both_backends(dtype):
    from attnlib.judge.gate import row_stats
    q, k, _ = attnlib.random_qkv(40, 50, 8, heads=2, seed=3)
    q, k = q.astype(dtype), k.astype(dtype)
    sigma, n_vis = row_stats(q, k, causal=True)
    t_sigma, t_vis = row_stats(torch.from_numpy(q), torch.from_numpy(k), causal=True)
    assert sigma.dtype == np.float64 and t_sigma.dtype == np.float64
    np.testing.assert_array_equal(n_vis, t_vis)
    # The host sums in the inputs' own type (a size, not a result), the device in float64.
    np.testing.assert_allclose(t_sigma, sigma, rtol=16 * np.finfo(dtype).eps)
    b_sigma, _ = row_stats(torch.from_numpy(q).to(torch.bfloat16), torch.from_numpy(k).to(torch.bfloat16),
                           causal=True)
    assert b_sigma.dtype == np.float64


def test_update_copies_any_scores_into_the_states_type():
    from attnlib.core.online import OnlineSoftmax
    st = OnlineSoftmax.empty((2,), 3)
    st.update([[0.5, 1.0], [2.0, -1.0]], np.ones((2, 3)))
    st32 = OnlineSoftmax.empty((2,), 3)
    st32.update(np.array([[0.5, 1.0], [2.0, -1.0]], dtype=np.float32), np.ones((2, 3)))
    assert st.l.dtype == np.float64 and np.array_equal(st.l, st32.l)


def test_a_replacement_step_of_the_old_signature_still_runs_on_the_host():
    from attnlib.core import hooks
    shipped = hooks.default("tile_scores")

    def tile_scores(q_i, k_j, spec, rows, cols, kind, cap=None, slopes=None, keep_tanh=False, out=None,
                    post_scale=None, check=False, keys_first=False, vis=None, mods=None, mod_grad=None):
        return shipped(q_i, k_j, spec, rows, cols, kind, cap, slopes, keep_tanh, out, post_scale, check,
                       keys_first, vis, mods, mod_grad)

    q, k, v = attnlib.random_qkv(40, 50, 8, seed=4)
    with hooks.replaced(tile_scores=tile_scores):
        got = attnlib.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(got, attnlib.attention(q, k, v, causal=True))


@pytest.mark.parametrize("compute_dtype, big", [(None, 1e154), ("float32", 1e19), ("bfloat16", 1e19)])
def test_a_visible_score_shifted_below_minus_max_weighs_zero_on_torch(compute_dtype, big):
    """Row 1 sees -max and +max (a partial, causal tile): exp(-max - max) is the exact 0 on
    both backends, forward and backward (the second reader found torch's masked exp giving it
    weight 1 when it multiplied by the mask instead of by where the shifted scores were finite)."""
    q, k, v = np.array([[1.0], [big]]), np.array([[-2 * big], [2 * big]]) / (2 if big > 1e100 else 1), np.array([[1.0], [2.0]])
    kw = dict(scale=1.0, causal=True, compute_dtype=compute_dtype)
    want = attnlib.attention(q, k, v, **kw)
    got = attnlib.attention(*(torch.from_numpy(x) for x in (q, k, v)), **kw)
    np.testing.assert_array_equal(got.float().numpy(), np.asarray(want, dtype=np.float32))
    if compute_dtype is None:
        out, lse = attnlib.attention(q, k, v, return_lse=True, **kw)
        dout = np.ones_like(out)
        want = attnlib.attention_backward(q, k, v, out, lse, dout, scale=1.0, causal=True)
        got = attnlib.attention_backward(*(torch.from_numpy(x) for x in (q, k, v, out, lse, dout)), scale=1.0,
                                         causal=True)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.numpy(), w)


def test_dsinks_of_rows_without_keys_is_plus_zero():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 2, 4, 3))
    dout = rng.standard_normal((2, 4, 3))
    kw = dict(sinks=np.array([0.3, 0.7]), kv_lengths=np.array(0))
    out, lse = attnlib.attention(q, k, v, return_lse=True, **kw)
    dsinks = attnlib.attention_backward(q, k, v, out, lse, dout, **kw)[3]
    assert np.array_equal(dsinks, [0.0, 0.0]) and not np.signbit(dsinks).any()
