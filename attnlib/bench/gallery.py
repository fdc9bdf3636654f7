"""The programmable-attention gallery: masks and score modifications people write for
FlexAttention, run exactly by attnlib and compared with FlexAttention in eager float64.

Each entry is written once, with operations numpy arrays and torch tensors share (``abs``,
``%``, ``//``, ``&``, comparisons, indexing; `_tanh` and `_clip` pick the library), so the
same function is attnlib's ``mask_mod``/``score_mod`` and FlexAttention's.  Where attnlib has
a built-in equivalent (window, documents, softcap, ALiBi, causal) the entry names it, and the
report checks the two agree, tile map included.  Timings are interleaved runs (min, median, max) in one
process; peak memory is RSS growth (``memory_profiler``) in a fresh process per
implementation after a warm-up (torch's allocations are invisible to tracemalloc), and the
long-context runs are attnlib's exact traced peak (tracemalloc) in a fresh process.
"""

from __future__ import annotations

import statistics
import time
import tracemalloc
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..evidence.inputs import random_qkv
from ..core.tiled import attention
from ..evidence.fresh import run_fresh_or_error
from .timing import interleaved


def _tanh(x):
    return x.tanh() if hasattr(x, "tanh") else np.tanh(x)


def _clip(x, lo, hi):
    return x.clamp(lo, hi) if hasattr(x, "clamp") else np.clip(x, lo, hi)


def _table(like, arr):
    """``arr`` as the array type of ``like`` (numpy, or a torch tensor for FlexAttention)."""
    if type(like).__module__.startswith("torch"):
        import torch

        return torch.from_numpy(arr)
    return arr


@dataclass(frozen=True)
class Entry:
    """One gallery entry: its functions (for ``n`` keys, ``heads`` heads), their derivative
    for the backward, and attnlib's built-in equivalent (None: there is none)."""

    name: str
    mask_mod: object = None
    score_mod: object = None
    score_mod_grad: object = None
    built_in: dict | None = field(default=None)
    note: str = ""


def gallery(n: int, heads: int) -> list[Entry]:
    """The entries for ``n`` positions and ``heads`` heads."""
    window, dilation, prefix = max(4, n // 16), 4, max(1, n // 8)
    docs = np.repeat(np.arange(6), np.diff(np.linspace(0, n, 7).astype(int)))  # 6 documents
    width = 32 if n % 32 == 0 else 1  # image tokens: rows of 32
    slopes = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
    t5 = np.random.default_rng(7).standard_normal((heads, 33)) * 0.5  # a learned bias per bucket
    cap = 30.0

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    def sliding_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= window)

    def dilated_window(b, h, q_idx, kv_idx):
        return (abs(q_idx - kv_idx) <= window) & ((q_idx - kv_idx) % dilation == 0)

    def documents(b, h, q_idx, kv_idx):
        doc = _table(q_idx, docs)
        return doc[q_idx] == doc[kv_idx]

    def document_window(b, h, q_idx, kv_idx):
        doc = _table(q_idx, docs)
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx) & (q_idx - kv_idx <= window)

    def neighbourhood_2d(b, h, q_idx, kv_idx):
        return (abs(q_idx // width - kv_idx // width) <= 3) & (abs(q_idx % width - kv_idx % width) <= 3)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - _table(q_idx, slopes)[h] * abs(q_idx - kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * _tanh(score / cap)

    def softcap_grad(score, b, h, q_idx, kv_idx):
        return 1.0 - _tanh(score / cap) ** 2

    def t5_bias(score, b, h, q_idx, kv_idx):
        return score + _table(q_idx, t5)[h, _clip(kv_idx - q_idx, -32, 0) + 32]

    def one(score, b, h, q_idx, kv_idx):  # d/ds of s + bias
        return 1.0 + 0.0 * score

    ids = docs[None]
    return [
        Entry("causal", causal, built_in=dict(causal=True)),
        Entry("prefix-LM", prefix_lm, note=f"bidirectional over the first {prefix} positions"),
        Entry("sliding window", sliding_window, built_in=dict(causal=True, window=(window, 0))),
        Entry("dilated window", dilated_window, note=f"|i - j| <= {window}, every {dilation}th key"),
        Entry("documents", documents, built_in=dict(q_segment_ids=ids, kv_segment_ids=ids)),
        Entry("document + window", document_window, note=f"causal within a document, {window} back"),
        Entry("2-D neighbourhood", neighbourhood_2d, note=f"image tokens, rows of {width}, 7 x 7"),
        Entry("ALiBi (score_mod)", causal, alibi, one, built_in=dict(causal=True, alibi_slopes=slopes)),
        Entry("softcap (score_mod)", None, softcap, softcap_grad, built_in=dict(softcap=cap)),
        Entry("T5 relative bias", causal, t5_bias, one, note="a learned bias per head and distance bucket"),
    ]


def run_entry(entry: Entry, n: int, heads: int, d: int, block: int, seed: int = 0, gates: dict | None = None) -> dict:
    """Equality figures of one entry at ``n``: attnlib against the dense reference (the gate)
    and against its built-in equivalent (values and tile map), its processed tiles against
    an independent dense count, and the backward against the dense gradient (judged by the
    gradient gate, `~attnlib.judge.gate.GradientGate`: ``grad_gate_ratio`` <= 1 passes).

    With ``gates`` (a dict), the entry's `~attnlib.judge.gate.Gate` is kept there under its
    name, so `versus_flex` judges FlexAttention against the same dense reference (same inputs)
    instead of computing it again."""
    from ..core.backward import attention_backward
    from ..core.flex import create_block_mask
    from ..judge.metrics import _gradient_figures
    from ..judge.gate import Gate, GradientGate
    from ..core.masks import SKIP

    q, k, v = random_qkv(n, n, d, batch=(1,), heads=heads, seed=seed)
    mods = dict(mask_mod=entry.mask_mod, score_mod=entry.score_mod)
    bm = None if entry.mask_mod is None else create_block_mask(entry.mask_mod, None, heads, n, n, block, block)
    out, lse, stats = attention(q, k, v, score_mod=entry.score_mod, block_mask=bm, block_q=block, block_k=block,
                                return_lse=True, return_stats=True)
    gate = Gate(q, k, v, block_k=block, **mods)
    judged = gate.judge(out, lse)
    if gates is not None:
        gates[entry.name] = gate
    row = {"entry": entry.name, "n": n, "rel_error": judged["rel_error"], "gate_ratio":
           max(judged["out_ratio"], judged["lse_ratio"]), "passed": judged["passed"],
           "tiles": int(stats.tile_kind.size), "processed": int(np.count_nonzero(stats.tile_kind != SKIP)),
           "tile_kind": stats.tile_kind[0], "dense_count": None, "count_agrees": None,
           "vs_built_in": None, "same_tile_map": None}  # None: no mask_mod, or no built-in equivalent
    if entry.mask_mod is not None:  # an independent count: tiles with a visible pair, from the dense mask
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        dense = np.broadcast_to(entry.mask_mod(np.zeros((1, 1, 1, 1), np.int64),
                                               np.arange(heads).reshape(1, heads, 1, 1), i, j), (1, heads, n, n))
        nt = -(-n // block)
        pad = np.zeros((1, heads, nt * block, nt * block), bool)
        pad[..., :n, :n] = dense
        visible = pad.reshape(heads, nt, block, nt, block).any(axis=(0, 2, 4))
        row["dense_count"] = int(visible.sum())
        row["count_agrees"] = bool(np.array_equal(stats.tile_kind[0] != SKIP, visible))
    if entry.built_in is not None:
        ref, ref_stats = attention(q, k, v, block_q=block, block_k=block, return_stats=True, **entry.built_in)
        row["vs_built_in"] = float(np.max(np.abs(out - ref)))
        row["same_tile_map"] = bool(np.array_equal(ref_stats.tile_kind[0], stats.tile_kind[0])) \
            if entry.mask_mod is not None else None
    small = min(n, 512)
    qs, ks, vs = (x[..., :small, :] for x in (q, k, v))
    o, l = attention(qs, ks, vs, return_lse=True, block_q=64, block_k=64, **mods)
    dout = np.random.default_rng(seed + 1).standard_normal(o.shape)
    grads = attention_backward(qs, ks, vs, o, l, dout, block_q=64, block_k=64,
                               score_mod_grad=entry.score_mod_grad, **mods)
    # One dense backward (with the componentwise sizes) for the metric and the gate.
    grad_gate = GradientGate(qs, ks, vs, dout, sizes=True, score_mod_grad=entry.score_mod_grad, **mods)
    errors = _gradient_figures(grads, grad_gate.ref, grad_gate.sizes)
    verdict = grad_gate.judge(grads)
    row["grad_error"] = max(errors[g] for g in ("dq", "dk", "dv"))
    row["grad_max_diff"] = max(float(np.max(np.abs(a - b))) for a, b in zip(grads, grad_gate.ref))
    row["grad_gate_ratio"] = max(verdict[f"{g}_ratio"] for g in grad_gate.names)
    row["grad_gate_e"] = grad_gate.e
    return row


def _flex(entry, heads):
    """``(prepare, run)`` of FlexAttention (eager) for the entry, or None without torch."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None

    def prepare(q, k, v):
        n = q.shape[-2]
        bm = None if entry.mask_mod is None else create_block_mask(entry.mask_mod, None, heads, n, n, device="cpu")
        return tuple(torch.from_numpy(x) for x in (q, k, v)) + (bm,)

    def run(a):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            return flex_attention(*a[:3], score_mod=entry.score_mod, block_mask=a[3])

    return prepare, run


def _attnlib(entry, heads, block, workers=None):
    from ..core.flex import create_block_mask

    def prepare(q, k, v):
        n = q.shape[-2]
        bm = None if entry.mask_mod is None else create_block_mask(entry.mask_mod, None, heads, n, n, block, block)
        return q, k, v, bm

    def run(a):
        return attention(*a[:3], score_mod=entry.score_mod, block_mask=a[3], workers=workers,
                         block_q=None if a[3] is not None else block, block_k=None if a[3] is not None else block)

    return prepare, run


def versus_flex(entries, n, heads, d, block, repeats=5, gates: dict | None = None) -> list[dict]:
    """Per entry: the largest difference from FlexAttention eager in float64 (``P @ |V|``
    relative, as the contract's ``rel_error``), FlexAttention's output against the verdict
    gate's out tolerance of the dense reference (``flex_gate_ratio``, <= 1 passes), and the
    min, median and max seconds of both over ``repeats`` interleaved runs (block masks made
    before timing).  ``gates``: `run_entry`'s, by entry name (the same inputs); an entry
    without one gets its `~attnlib.judge.gate.Gate` built here."""
    from ..judge.gate import Gate, _ratio
    from ..judge.metrics import rel_error

    q, k, v = random_qkv(n, n, d, batch=(1,), heads=heads, seed=0)
    rows = []
    for entry in entries:
        impls = {"attnlib": _attnlib(entry, heads, block)}
        flex = _flex(entry, heads)
        if flex is not None:
            impls["FlexAttention eager"] = flex
        args = {name: prep(q, k, v) for name, (prep, _) in impls.items()}
        results = {name: np.asarray(run(args[name]), dtype=np.float64) for name, (_, run) in impls.items()}
        row = {"entry": entry.name, "n": n}
        if flex is not None:
            gate = (gates or {}).get(entry.name) or Gate(q, k, v, block_k=block, mask_mod=entry.mask_mod,
                                                         score_mod=entry.score_mod)
            flex_out = results["FlexAttention eager"]
            row["vs_flex"] = rel_error(results["attnlib"], flex_out, gate.ref_abs)
            row["flex_gate_ratio"] = _ratio(np.abs(flex_out - gate.ref), gate.tol.allowed(gate.ref_abs))
        for name, t in interleaved({name: run for name, (_, run) in impls.items()}, repeats, args).items():
            row.update({f"{name} min (s)": min(t), f"{name} median (s)": statistics.median(t),
                        f"{name} max (s)": max(t)})
        rows.append(row)
    return rows


def peak(entry_index: int, n: int, heads: int, d: int, block: int, impl: str, tool: str = "rss",
         timeout: float = 900.0) -> dict:
    """One call of ``impl`` ("attnlib" or "FlexAttention eager") on gallery entry
    ``entry_index`` at ``n``, in a fresh process after a warm-up: ``{"bytes", "seconds"}``
    (RSS growth, or attnlib's exact traced peak with ``tool="tracemalloc"``, inputs and block
    mask made before), or ``{"error"}``."""
    spec = dict(entry=entry_index, n=n, heads=heads, d=d, block=block, impl=impl, tool=tool)
    return run_fresh_or_error(_measure, spec, timeout=timeout)


def _measure(spec: dict) -> dict:
    from ..core.problem import STRICT

    np.seterr(**STRICT)

    def impl(n):
        entry = gallery(n, spec["heads"])[spec["entry"]]
        # One worker: each thread holds its own tiles, and whether two threads' are alive at
        # once is a matter of timing (see attnlib.evidence.memory).
        pair = (_attnlib(entry, spec["heads"], spec["block"], workers=1) if spec["impl"] == "attnlib"
                else _flex(entry, spec["heads"]))
        if pair is None:
            raise SystemExit("torch is not installed")
        return pair

    prep, run = impl(256)
    run(prep(*random_qkv(256, 256, spec["d"], batch=(1,), heads=spec["heads"], seed=1)))  # warm-up
    prep, run = impl(spec["n"])
    args = prep(*random_qkv(spec["n"], spec["n"], spec["d"], batch=(1,), heads=spec["heads"], seed=0))
    start = time.perf_counter()
    if spec["tool"] == "tracemalloc":
        tracemalloc.start()
        out = run(args)
        used = tracemalloc.get_traced_memory()[1] - np.asarray(out).nbytes  # working: the output apart
        tracemalloc.stop()
    else:
        from memory_profiler import memory_usage

        base = memory_usage(-1, interval=0.01, timeout=0.01)[0]
        used = int(max(0.0, max(memory_usage((run, (args,), {}), interval=0.005)) - base) * 2**20)
    return {"bytes": int(used), "seconds": time.perf_counter() - start}

