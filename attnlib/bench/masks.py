"""Masks that let work be skipped: attnlib against PyTorch given the same mask explicitly.

attnlib classifies every tile from the mask's closed form and never touches a SKIP tile,
so under a sliding window or a document mask it forms only the pairs of the tiles it
processes (what each visible pair then costs against SDPA's per pair is measured by the
performance report, not assumed).  PyTorch's SDPA with an
explicit boolean mask does all ``Sq x Sk`` work and holds the mask; FlexAttention in eager
mode (float64 runs there; compiled FlexAttention on CPU refuses float64) materialises the
scores.  Each case is timed interleaved in one process (medians), and its peak memory is
measured as RSS growth (``memory_profiler``) in a fresh process per implementation after a
warm-up call, the same way for every implementation (torch's allocations are invisible
to tracemalloc, so RSS is the common measure).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from ..evidence.inputs import random_qkv
from ..core.tiled import attention
from ..evidence.fresh import run_fresh_or_error
from .peers import DEFAULT, torch_or_none
from .timing import interleaved

#: The sliding window of the window case (FlashAttention's ``window_size = (256, 0)``).
WINDOW = 256
#: Documents in the document-mask case.
DOCUMENTS = 16


@dataclass(frozen=True)
class MaskCase:
    """One masked problem: ``(B, Hq, Sq, D)`` queries over ``(B, Hk, Sk, D)`` keys."""

    name: str
    b: int
    hq: int
    hk: int
    sq: int
    sk: int
    d: int = 64
    options: dict = field(default_factory=dict)  # attnlib's masking arguments

    @property
    def shape(self) -> str:
        return f"({self.b}, {self.hq}/{self.hk}, {self.sq}, {self.sk}, {self.d})"

    def visible(self) -> np.ndarray:
        """The boolean mask ``(B, 1, Sq, Sk)`` that torch is given (built from the options
        by the contract's rules, independently of attnlib's tile classes)."""
        i = np.arange(self.sq)[:, None]
        j = np.arange(self.sk)[None, :]
        o = self.options
        q_len = np.asarray(o.get("q_lengths", [self.sq] * self.b))
        kv_len = np.asarray(o.get("kv_lengths", [self.sk] * self.b))
        masks = []
        for b in range(self.b):
            off = kv_len[b] - q_len[b]  # bottom-right alignment
            vis = (i < q_len[b]) & (j < kv_len[b])
            if o.get("causal"):
                vis = vis & (j <= i + off)
            if o.get("window"):
                vis = vis & (j >= i + off - o["window"][0])
            if "q_segment_ids" in o:
                vis = vis & (np.asarray(o["q_segment_ids"])[b][:, None] == np.asarray(o["kv_segment_ids"])[b][None, :])
            masks.append(vis)
        return np.stack(masks)[:, None]


def mask_cases(n: int, decode_batch: int = 8) -> list[MaskCase]:
    """The cases at sequence length ``n``: a causal sliding window, causal documents,
    a padded batch (at ``n / 2``: torch's dense scores for four entries) and GQA decode over
    a ragged KV cache."""
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, n), DOCUMENTS - 1, replace=False))
    ids = np.repeat(np.arange(DOCUMENTS), np.diff(np.concatenate([[0], cuts, [n]])))[None, :]
    half = max(n // 2, 4)
    lengths = [half, 3 * half // 4, half // 2, half // 4]
    cache = [n - i * n // (2 * decode_batch) for i in range(decode_batch)]
    return [
        MaskCase(f"sliding window {WINDOW}, causal", 1, 1, 1, n, n,
                 options=dict(causal=True, window=(WINDOW, None))),
        MaskCase(f"{DOCUMENTS} documents, causal", 1, 1, 1, n, n,
                 options=dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids)),
        MaskCase("padded batch, causal", 4, 1, 1, half, half,
                 options=dict(causal=True, q_lengths=lengths, kv_lengths=lengths)),
        MaskCase("GQA decode, ragged cache", decode_batch, 32, 8, 1, n,
                 options=dict(kv_lengths=cache)),
    ]


def _inputs(case: MaskCase):
    q = random_qkv(case.sq, 0, case.d, batch=(case.b,), heads=case.hq, seed=0)[0]
    _, k, v = random_qkv(0, case.sk, case.d, batch=(case.b,), heads=case.hk, seed=1)
    return q, k, v


#: attnlib given torch tensors (its torch kernel, on the CPU here): `time_masks`'s optional row.
TORCH_TENSORS = "attnlib (torch tensors)"


def implementations(case: MaskCase, include_torch=True, include_flex=True, include_torch_tensors=False) -> dict:
    """``{name: (prepare, run)}`` for ``case``: attnlib with its masks, torch SDPA with the
    explicit boolean mask, FlexAttention (eager) with a ``mask_mod`` over the same mask
    (``include_flex``) and, with ``include_torch_tensors``, attnlib given torch tensors."""
    impls = {DEFAULT: (lambda q, k, v: (q, k, v), lambda a: attention(*a, **case.options))}
    torch = torch_or_none() if include_torch else None
    if torch is None:
        return impls
    import torch.nn.functional as F

    def tensors(*arrays):
        return tuple(torch.from_numpy(x) for x in arrays)

    if include_torch_tensors:
        impls[TORCH_TENSORS] = (tensors, lambda a: attention(*a, **case.options))
    gqa = case.hq != case.hk
    impls[f"torch {torch.__version__} SDPA + mask"] = (
        lambda q, k, v: tensors(q, k, v, case.visible()),
        lambda a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3], enable_gqa=gqa))
    if not include_flex:
        return impls
    try:
        import warnings

        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return impls

    def flex_prepare(q, k, v):
        vis = torch.from_numpy(case.visible()[:, 0])  # (B, Sq, Sk), looked up by the mask_mod

        def mask_mod(b, h, q_idx, kv_idx):
            return vis[b, q_idx, kv_idx]

        block = create_block_mask(mask_mod, case.b, None, case.sq, case.sk, device="cpu")
        return tensors(q, k, v) + (block,)

    def flex_run(a):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            return flex_attention(*a[:3], block_mask=a[3], enable_gqa=gqa)

    impls[f"torch {torch.__version__} FlexAttention (eager)"] = (flex_prepare, flex_run)
    return impls


def time_masks(cases, repeats=3, include_torch=True, log=None, include_flex=True,
               include_torch_tensors=False) -> list[dict]:
    """Median seconds of every implementation on every case (interleaved), the largest
    difference of each from attnlib over rows that see a key (torch gives NaN elsewhere),
    and the case's ``"dense / visible pairs"``: the pairs SDPA forms over those any pair
    skipping kernel must form (its gain over SDPA at SDPA's rate per pair)."""
    rows = []
    for case in cases:
        q, k, v = _inputs(case)
        impls = implementations(case, include_torch, include_flex, include_torch_tensors)
        vis = case.visible()
        # The most that computing only the visible pairs can gain, at SDPA's rate per pair.
        row = {"case": case.name, "shape": case.shape,
               "dense / visible pairs": vis.size / max(1, int(np.count_nonzero(vis)))}
        args, ok = {}, {}
        for name, (prep, run) in impls.items():
            try:
                args[name] = prep(q, k, v)
                result = run(args[name])  # warm-up, and the result compared below
            except Exception as e:  # a peer that cannot run this case: said in the table
                row[name] = None
                row[f"{name} error"] = f"{type(e).__name__}: {e}"[:200]
                continue
            ok[name] = np.asarray(result, dtype=np.float64)
        seen = vis.any(axis=-1)[..., None]  # (B, 1, Sq, 1): rows with a key
        for name in ok:
            if name != DEFAULT:
                diff = np.where(seen, np.abs(ok[name] - ok[DEFAULT]), 0.0)
                row[f"{name} max diff"] = float(np.max(diff)) if diff.size else 0.0  # NaN shows
        times = interleaved({name: impls[name][1] for name in ok}, repeats, args)
        row.update({name: statistics.median(t) for name, t in times.items()})
        row["times"] = times  # every repeat's seconds
        rows.append(row)
        if log:
            log(f"{case.name} {case.shape}: " + ", ".join(
                f"{n} {row[n]:.3f} s" for n in impls if row.get(n) is not None))
    return rows


def peak_rss(case_index: int, n: int, impl: str, timeout: float = 600.0) -> dict:
    """RSS growth of one call of ``impl`` on ``mask_cases(n)[case_index]``, in a fresh
    process after a warm-up call at a small size; ``{"rss_bytes", "seconds"}`` or
    ``{"error"}``."""
    return peak_rss_all(case_index, n, [impl], timeout)[impl]


def peak_rss_each(pairs, n: int, at_once: int = 2, timeout: float = 600.0) -> list[dict]:
    """`peak_rss` of each ``(case_index, impl)`` in ``pairs``, in that order, up to ``at_once``
    fresh processes at a time: each process's RSS is its own, so its neighbours change no
    figure, only the wall time (16 fresh processes, each importing torch, took 45 s one by one)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, at_once)) as pool:
        return list(pool.map(lambda pair: peak_rss(pair[0], n, pair[1], timeout), pairs))


def peak_rss_all(case_index: int, n: int, impls, timeout: float = 600.0) -> dict:
    """`peak_rss` of each of ``impls`` (names) on one case, in one fresh process per case:
    every implementation warmed up at a small size first, then each measured in the order
    given (attnlib first: nothing freed by an earlier call can flatter it), its RSS growth
    above what was resident just before it.  ``{name: {"rss_bytes", "seconds"} or {"error"}}``."""
    spec = {"case": case_index, "n": n, "impls": list(impls)}
    result = run_fresh_or_error(_measure_all, spec, timeout=timeout)
    return result if "error" not in result else {name: result for name in impls}


def _measure_all(spec: dict) -> dict:
    from memory_profiler import memory_usage

    from ..core.problem import STRICT

    np.seterr(**STRICT)
    warm = mask_cases(256)[spec["case"]]
    impls = implementations(warm, include_torch_tensors=True)
    for name in spec["impls"]:  # warm-up: imports, code paths, BLAS buffers
        prep, run = impls[name]
        run(prep(*_inputs(warm)))
    case = mask_cases(spec["n"])[spec["case"]]
    impls = implementations(case, include_torch_tensors=True)
    inputs = _inputs(case)
    out = {}
    for name in spec["impls"]:
        prep, run = impls[name]
        args = prep(*inputs)  # inputs (and torch's explicit mask) exist before the call
        base = memory_usage(-1, interval=0.01, timeout=0.01)[0]
        start = time.perf_counter()
        usage = memory_usage((run, (args,), {}), interval=0.005)
        out[name] = {"rss_bytes": int(max(0.0, max(usage) - base) * 2**20),
                     "seconds": time.perf_counter() - start}
        del args
    return out

