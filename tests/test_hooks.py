"""The kernels' declared steps (`attnlib.core.hooks`, issue 25).

Every kernel path calls its steps through the registry (a refactor that bypasses one fails
here), and every injected defect (`attnlib.evidence.defects`) is caught by the verdict gate
on each path it names and changes nothing, to the bit, on the others: on the numpy backend
and on the torch CPU backend (issue 45: one kernel, forward and backward, so the defects
reach both)."""

import functools

import numpy as np
import pytest

import attnlib
from attnlib.core import hooks
from attnlib.core.backward import attention_backward
from attnlib.core.masks import MaskSpec
from attnlib.core.online import OnlineSoftmax
from attnlib.core import tiles
from attnlib.evidence.defects import BACKWARD_DEFECTS, DEFECTS, PATHS, STEP_PATHS, Defect
from attnlib.judge.gate import Gate, GradientGate

N, D = 320, 64  # the problem of tests/test_gate.py: every forward defect shows on it
BQ = BK = 64  # 5 key tiles per row at the end: rescales, a last tile to drop
CHUNK = 128  # stream: 2 key tiles per chunk, 3 chunks (the last one short)
PAGE = 16  # paged: 4 pages a chunk, and a chunk is a key tile
SECOND = (130, 150)  # varlen: a second, shorter sequence after the problem
#: The backends the forward paths run on: torch's when torch is installed.
try:
    import torch
    BACKENDS = ("numpy", "torch")
except ImportError:  # pragma: no cover - the test extra installs torch
    torch = None
    BACKENDS = ("numpy",)


def _on(backend, *xs):
    """Arrays as the backend takes them: torch CPU tensors, or as they are."""
    if backend == "numpy":
        return xs
    return tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in xs)


def _host(result):
    return tuple(x.numpy() if torch is not None and isinstance(x, torch.Tensor) else x for x in result)


# ---------------------------------------------------------------------------------------
# The API


def test_the_steps_are_declared_with_their_defaults():
    assert set(hooks.STEPS) == {"state", "tile_scores", "tile_visible", "absorb", "document_blocks", "backward"}
    assert all(isinstance(text, str) and text for text in hooks.STEPS.values())
    assert hooks.default("state") is OnlineSoftmax
    assert hooks.default("tile_scores") is tiles.tile_scores
    assert hooks.default("tile_visible") is MaskSpec.tile_visible
    assert hooks.default("absorb") is tiles.absorb
    assert hooks.default("backward")("ds", x := object(), a=0, b=1) is x
    assert all(hooks.get(name) is hooks.default(name) for name in hooks.STEPS)
    assert hooks.replacements() == {}
    assert set(STEP_PATHS) == set(hooks.STEPS)


def test_replaced_nests_and_restores_even_on_error():
    def one(*a, **k):
        return tiles.absorb(*a, **k)

    def two(*a, **k):
        return tiles.absorb(*a, **k)

    with hooks.replaced(absorb=one):
        assert hooks.get("absorb") is one and hooks.replacements() == {"absorb": one}
        with pytest.raises(RuntimeError):
            with hooks.replaced(absorb=two, tile_scores=two):
                assert hooks.get("absorb") is two and hooks.get("tile_scores") is two
                raise RuntimeError("boom")
        assert hooks.get("absorb") is one and hooks.get("tile_scores") is tiles.tile_scores
    assert hooks.replacements() == {}


def test_unknown_steps_and_wrong_replacements_are_refused():
    with pytest.raises(ValueError, match="not a declared step"):
        hooks.get("update")
    with pytest.raises(ValueError, match="not a declared step"):
        with hooks.replaced(DEFECT_HOOK=lambda *a: None):
            pass
    with pytest.raises(TypeError, match="subclass"):
        with hooks.replaced(state=object):
            pass
    with pytest.raises(TypeError, match="callable"):
        with hooks.replaced(absorb=3):
            pass
    assert hooks.replacements() == {}
    with pytest.raises(ValueError, match="not declared steps"):
        Defect("x", "y", {"update": lambda: None}, ("forward",))
    with pytest.raises(ValueError, match="run none of its steps"):
        Defect("x", "y", {"backward": lambda: None}, ("forward",))


def test_the_backward_has_no_module_hook_any_more():
    import attnlib.core.backward as backward

    assert not hasattr(backward, "DEFECT_HOOK")


# ---------------------------------------------------------------------------------------
# The problems and the paths


@functools.lru_cache(maxsize=None)
def case(key):
    """``(q, k, v, dout, options, (q2, k2, v2))``: the problem a defect needs to show."""
    if key == "far":  # tiles far below an attention sink's max (skip_far_tiles)
        q, k, v = attnlib.adversarial_qkv("sink", N, d=D, block_k=BK, heads=2, seed=11)
    else:
        q, k, v = attnlib.random_qkv(N, d=D, heads=2, seed=11)
    options = {
        "causal": dict(causal=True),
        "far": dict(causal=True),
        "window": dict(causal=True, window=(50, None)),
        "alibi": dict(alibi_slopes=np.array([0.5, 0.25])),  # not causal: i + o - j < 0 too
        "softcap": dict(causal=True, softcap=5.0),
        "sinks": dict(causal=True, sinks=np.array([0.5, -1.0])),
        "low_sinks": dict(causal=True, sinks=np.array([-3.0, 1.0])),  # the first tile raises the max
    }[key]
    dout = np.random.default_rng(12).standard_normal(q.shape)
    second = attnlib.random_qkv(*SECOND, d=D, heads=2, seed=13)
    return q, k, v, dout, options, second


#: The problem of each defect (default: causal).
NEEDS = {"window_edge": "window", "alibi_signed": "alibi", "softcap_after_mask": "softcap",
         "sink_weight_dropped": "sinks", "sink_first_tile_unscaled": "low_sinks",
         "skip_far_tiles": "far", "dsinks_sign": "sinks"}


def _pages(k, v, seed=14):
    """``k, v (H, S, D)`` as a shuffled paged cache of one batch entry."""
    n = -(-k.shape[-2] // PAGE)

    def paged(x):
        pad = np.zeros((x.shape[0], n * PAGE - x.shape[1], x.shape[2]))
        return np.concatenate([x, pad], axis=1).reshape(x.shape[0], n, PAGE, x.shape[2]).transpose(1, 2, 0, 3)

    order = np.random.default_rng(seed).permutation(n)  # table entry t -> page order[t]
    kc, vc = np.empty_like(paged(k)), np.empty_like(paged(v))
    kc[order], vc[order] = paged(k), paged(v)
    return kc, vc, order[None, :], np.array([k.shape[-2]])


def _varlen(*problems):
    packed = [np.concatenate([np.swapaxes(p[i], 0, 1) for p in problems]) for i in range(3)]
    cu_q = np.cumsum([0] + [p[0].shape[-2] for p in problems])
    cu_k = np.cumsum([0] + [p[1].shape[-2] for p in problems])
    return packed, cu_q, cu_k


def forward_of(path, key, backend="numpy"):
    """The forward result of ``path`` on problem ``key`` with the steps now in force, on the
    ``backend``'s arrays (read back to numpy)."""
    return _host(_forward_of(path, key, backend))


def _forward_of(path, key, backend):
    q, k, v, _, options, second = case(key)
    tile = dict(block_q=BQ, block_k=BK, return_lse=True)
    if path == "forward":
        return attnlib.attention(*_on(backend, q, k, v), **tile, **options)
    if path == "stream":
        chunks = [_on(backend, k[..., i:i + CHUNK, :], v[..., i:i + CHUNK, :]) for i in range(0, N, CHUNK)]
        return attnlib.attention_stream(*_on(backend, q), chunks, total_keys=N, **tile, **options)
    if path == "paged":
        kc, vc, table, lens = _pages(k, v)
        out, lse = attnlib.attention(*_on(backend, q[None], kc, vc), block_table=table, cache_seqlens=lens,
                                     **tile, **options)
        return out[0], lse[0]
    if path == "varlen":
        (qp, kp, vp), cu_q, cu_k = _varlen((q, k, v), second)
        return attnlib.attention_varlen(*_on(backend, qp, kp, vp), cu_q, cu_k, **tile, **options)
    raise AssertionError(path)


@functools.lru_cache(maxsize=None)
def clean_forward(key):
    assert hooks.replacements() == {}
    return attnlib.attention(*case(key)[:3], block_q=BQ, block_k=BK, return_lse=True, **case(key)[4])


def result(path, key, backend="numpy"):
    """What ``path`` returns on problem ``key`` with the steps now in force; the backward's
    ``out`` and ``lse`` come from the clean forward."""
    if path != "backward":
        return forward_of(path, key, backend)
    q, k, v, dout, options, _ = case(key)
    out, lse = clean_forward(key)
    return _host(attention_backward(*_on(backend, q, k, v, out, lse, dout), block_q=BQ, block_k=BK, **options))


@functools.lru_cache(maxsize=None)
def clean(path, key, backend="numpy"):
    assert hooks.replacements() == {}
    return result(path, key, backend)


@functools.lru_cache(maxsize=None)
def gates(path, key):
    q, k, v, dout, options, second = case(key)
    if path == "backward":
        return (GradientGate(q, k, v, dout, **options),)
    if path == "varlen":
        return Gate(q, k, v, block_k=BK, **options), Gate(*second, block_k=BK, **options)
    return (Gate(q, k, v, block_k=BK, **options),)


def passes(path, key, got) -> bool:
    """The verdict gate on ``got``, a result of ``path`` on problem ``key``."""
    if path == "backward":
        return gates(path, key)[0].judge(got)["passed"]
    out, lse = got
    if path != "varlen":
        return gates(path, key)[0].judge(out, lse)["passed"]
    splits = np.cumsum([0, N, SECOND[0]])  # varlen: each sequence by its own gate
    return all(gate.judge(np.swapaxes(out[a:b], 0, 1), lse[:, a:b])["passed"]
               for gate, a, b in zip(gates(path, key), splits[:-1], splits[1:]))


def same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------
# Every step is called on every path that should call it


def _counting():
    """Pass-through wrappers of every default step and their call counts."""
    counts = dict.fromkeys(hooks.STEPS, 0)

    def counted(name):
        real = hooks.default(name)

        def step(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return step

    class State(OnlineSoftmax):
        __slots__ = ()

        @classmethod
        def empty(cls, *args, **kwargs):
            counts["state"] += 1
            return super().empty(*args, **kwargs)

    return counts, dict({name: counted(name) for name in hooks.STEPS if name != "state"}, state=State)


#: Each path on each backend that runs the shared kernel.
RUNS = [(path, backend) for path in PATHS for backend in BACKENDS]


@pytest.mark.parametrize("path, backend", RUNS)
def test_every_step_is_called_on_every_path_that_runs_it(path, backend):
    expected = clean(path, "sinks", backend)  # (and the backward's clean forward)
    counts, steps = _counting()
    with hooks.replaced(**steps):
        got = result(path, "sinks", backend)  # causal: PARTIAL tiles, and so their masks, on every path
    for name in hooks.STEPS:
        if path in STEP_PATHS[name]:
            assert counts[name] > 0, (name, path)
        else:
            assert counts[name] == 0, (name, path)
    assert same(got, expected)  # the wrappers change nothing


# ---------------------------------------------------------------------------------------
# Every defect is caught on every path it names, and changes nothing on the others


ALL = {**DEFECTS, **BACKWARD_DEFECTS}
ON = [(name, path, b) for name, d in ALL.items() for path in d.paths for b in BACKENDS if (path, b) in RUNS]
OFF = [(name, path, b) for name, d in ALL.items() for path in PATHS if path not in d.paths
       for b in BACKENDS if (path, b) in RUNS]


def test_every_defect_names_its_paths():
    assert not set(DEFECTS) & set(BACKWARD_DEFECTS)
    for name, d in ALL.items():
        assert d.paths and set(d.paths) <= set(PATHS), name
    assert all(d.paths == ("backward",) for d in BACKWARD_DEFECTS.values())


@pytest.mark.slow
@pytest.mark.parametrize("name, path, backend", ON, ids=[f"{n}-{p}-{b}" for n, p, b in ON])
def test_every_defect_fails_the_gate_on_each_of_its_paths(name, path, backend):
    key = NEEDS.get(name, "causal")
    assert passes(path, key, clean(path, key, backend))  # (and the backward's clean forward, before the defect)
    with ALL[name].active():
        bad = result(path, key, backend)
    assert hooks.replacements() == {}
    assert not same(bad, clean(path, key, backend)), f"{name} changes nothing on {path} ({backend})"
    assert not passes(path, key, bad), f"{name} passes the gate on {path} ({backend})"


@pytest.mark.parametrize("name, path, backend", OFF, ids=[f"{n}-{p}-{b}" for n, p, b in OFF])
def test_a_defect_changes_nothing_on_the_paths_it_does_not_name(name, path, backend):
    key = NEEDS.get(name, "causal")
    expected = clean(path, key, backend)
    with ALL[name].active():
        got = result(path, key, backend)
    assert same(got, expected), f"{name} changes {path} ({backend}): add it to its paths"


def test_blocks_that_end_out_of_order_leave_nothing_behind():
    """Two blocks (two threads' defects) that end in the other order than they began: each
    step falls back to what is still active, and at the end to its default."""
    one, two = hooks.replaced(absorb=lambda *a, **k: None), hooks.replaced(absorb=lambda *a, **k: 1)
    one.__enter__()
    two.__enter__()
    second = hooks.get("absorb")
    one.__exit__(None, None, None)
    assert hooks.get("absorb") is second  # the later block is still in force
    two.__exit__(None, None, None)
    assert hooks.replacements() == {} and hooks.get("absorb") is hooks.default("absorb")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", ["causal", "sinks"])
def test_a_neutral_mutated_update_is_the_real_update_to_the_bit(key, backend):
    """The update defects run `OnlineSoftmax.update`'s steps with one mutation: with none they
    give the real kernel's bits, so a defect changes a result only by its mutation (a copy of
    its own once counted rounding-level changes as the defect's, on problems it cannot affect)."""
    from attnlib.evidence.defects import _mutated_update
    for path in ("forward", "stream", "varlen"):
        with hooks.replaced(state=_mutated_update()):
            got = result(path, key, backend)
        assert same(got, clean(path, key, backend)), path
