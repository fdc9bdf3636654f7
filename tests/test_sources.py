"""Several KV sources in one softmax (docs/semantics.md, "Several KV sources"): equal to the
joined problem (keys concatenated, each under its source's mask) forward and backward, numpy
and torch; the check judges it and names the source a wrong kernel got wrong."""

import numpy as np
import pytest

import attnlib
from attnlib import attention_sources, attention_sources_backward, join_sources, source
from attnlib.check import UnusableInput, check_sources

B, H, HK, SQ, D = 2, 4, 2, 40, 16


def problem(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, SQ, D)).astype(dtype)
    window = [rng.standard_normal((B, HK, 300, D)).astype(dtype) for _ in range(2)]
    compressed = [rng.standard_normal((B, HK, 75, D)).astype(dtype) for _ in range(2)]
    idx = rng.integers(-1, 75, size=(B, SQ, 8))
    sources = [source(*window, "window", causal=True, window=(63, 0), kv_lengths=np.array([300, 250])),
               source(*compressed, "compressed", mask_mod=lambda b, h, i, j: j * 4 + 3 <= i + 260),
               source(*compressed, "top-k", gather_kv_indices=idx)]
    return rng, q, sources, rng.standard_normal(H)


@pytest.mark.parametrize("with_sinks", [True, False])
def test_sources_equal_the_joined_problem_forward_and_backward(with_sinks):
    rng, q, sources, sinks = problem()
    sinks = sinks if with_sinks else None
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        out, lse = attention_sources(q, sources, sinks=sinks, return_lse=True)
        k, v, mask_mod = join_sources(q, sources)
        joined, joined_lse = attnlib.attention(q, k, v, mask_mod=mask_mod, sinks=sinks, return_lse=True)
        ref = attnlib.reference_attention(q, k, v, mask_mod=mask_mod, sinks=sinks)
        dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
        grads = attention_sources_backward(q, sources, out, lse, dout, dlse=dlse, sinks=sinks)
        ref_grads = attnlib.reference_attention_backward(q, k, v, dout, dlse=dlse, mask_mod=mask_mod, sinks=sinks)
    assert np.abs(out - joined).max() < 1e-14 and np.abs(out - ref).max() < 1e-14
    assert np.array_equal(np.isfinite(lse), np.isfinite(joined_lse))
    assert np.abs(np.where(np.isfinite(lse), lse - joined_lse, 0)).max() < 1e-13
    got = (grads[0], np.concatenate(grads[1], axis=-2), np.concatenate(grads[2], axis=-2)) + tuple(grads[3:])
    assert len(got) == len(ref_grads)
    assert all(np.abs(g - r).max() < 1e-13 for g, r in zip(got, ref_grads))


def test_sources_on_torch_tensors():
    torch = pytest.importorskip("torch")
    _, q, sources, sinks = problem(1)
    on_torch = [source(torch.tensor(s.k), torch.tensor(s.v), s.name, **s.options) for s in sources]
    out = attention_sources(torch.tensor(q), on_torch, sinks=sinks)
    assert isinstance(out, torch.Tensor)
    assert np.abs(out.numpy() - attention_sources(q, sources, sinks=sinks)).max() < 1e-14


def test_the_check_passes_a_correct_kernel_and_names_the_source_it_got_wrong():
    _, q, sources, sinks = problem(2, np.float32)

    def kernel(srcs):  # float64 attention of the float32 inputs, rounded once
        as64 = [source(s.k.astype(np.float64), s.v.astype(np.float64), s.name, **s.options) for s in srcs]
        return attention_sources(q.astype(np.float64), as64, sinks=sinks).astype(np.float32)

    assert check_sources(q, sources, kernel(sources), layout="bhsd", sinks=sinks).passed
    for n, s in enumerate(sources):
        verdict = check_sources(q, sources, kernel(sources[:n] + sources[n + 1:]), layout="bhsd", sinks=sinks)
        assert not verdict.passed and any(f"source {s.label} ({n + 1} of 3) left out" in d for d in verdict.diagnosis)
        unmasked = [source(x.k, x.v, x.name) if i == n else x for i, x in enumerate(sources)]
        verdict = check_sources(q, sources, kernel(unmasked), layout="bhsd", sinks=sinks)
        assert not verdict.passed and any(f"source {s.label}'s mask ignored" in d for d in verdict.diagnosis)


def test_the_check_takes_the_gradients_per_source_in_bshd():
    rng, q, sources, sinks = problem(3)
    out, lse = attention_sources(q, sources, sinks=sinks, return_lse=True)
    dout = rng.standard_normal(out.shape)
    dq, dks, dvs, dsinks = attention_sources_backward(q, sources, out, lse, dout, sinks=sinks)

    def bshd(x):
        return np.swapaxes(x, 1, 2).astype(np.float32)

    laid = [source(bshd(s.k), bshd(s.v), s.name, **s.options) for s in sources]
    verdict = check_sources(bshd(q), laid, bshd(out), layout="bshd", sinks=sinks, dout=bshd(dout), dq=bshd(dq),
                            dk=[bshd(x) for x in dks], dv=[bshd(x) for x in dvs], dsinks=dsinks.astype(np.float32))
    assert verdict.passed and set(verdict.grads) == {"dq", "dk", "dv", "dsinks"}
    swapped = [bshd(x) for x in dks[::-1]] if dks[0].shape == dks[-1].shape else [bshd(x) * 1.01 for x in dks]
    assert not check_sources(bshd(q), laid, bshd(out), layout="bshd", sinks=sinks, dout=bshd(dout), dq=bshd(dq),
                             dk=swapped, dv=[bshd(x) for x in dvs]).passed


def test_bad_sources_are_refused_by_name():
    _, q, sources, _ = problem()
    with pytest.raises(TypeError, match="scale is no source option"):
        source(sources[0].k, sources[0].v, "w", scale=0.5)
    with pytest.raises(ValueError, match="at least one Source"):
        attention_sources(q, [])
    with pytest.raises(TypeError, match=r"sources\[1\] must be an attnlib Source"):
        attention_sources(q, [sources[0], (sources[1].k, sources[1].v)])
    with pytest.raises(UnusableInput, match="each source's mask is its own"):
        check_sources(q, sources, q, layout="bhsd", causal=True)
    with pytest.raises(UnusableInput, match="one gradient per source"):
        check_sources(q, sources, q, layout="bhsd", dout=q, dk=[sources[0].k])
