"""False alarms over the space a user reaches: random problems, the correct kernels people run.

A check that fails a correct kernel once in a thousand runs gets switched off.  `run` draws
problems from the whole input space (decode and prefill, ``Sq`` 1 .. 4096, head dims 8 ..
256 with ``Dv != D``, GQA and MQA, causal and windowed masks, padded keys, softcap, sinks,
a given scale (ALiBi: `check_kernel` takes none yet); ``v`` and ``dout`` from 1e-6 to 1e4, logits up to ~10), runs on each
every correct kernel that can express it, in float32, bfloat16 and float16:

* attnlib's tiled kernel in the type (``compute_dtype``), at random tiles and key splits;
* PyTorch SDPA, math backend and the default choice (its CPU flash kernel where eligible),
  with the mask as a boolean ``attn_mask`` (no softcap or sinks: SDPA has neither);
* FlexAttention, eager (on every ``FLEX_EVERY``-th problem), with the mask as a ``mask_mod`` and the softcap as a ``score_mod``,
  and its LSE;
* FlexAttention compiled by ``torch.compile`` (Inductor's fused CPU kernel; on every
  ``FLEX_COMPILED_EVERY``-th problem, where a C++ compiler is present), the same mods, its
  output only (Inductor's CPU kernel returns no LSE);
* on the gradient problems, an eager kernel written in torch ops in the manner of Hugging Face's eager
  attention is (scores ``q k^T`` times the scale in the type, a softcap, the softmax and its LSE
  in float32, the weights rounded to the type before ``p @ v``; the sinks a last logit; rows that see
  no key 0, as FlashAttention's ``attention_ref`` fills them), its autograd
  gradients of a loss of ``out`` and the LSE: ``dout`` and a drawn ``dlse`` (ring attention's);
* the 2026 variants these kernels express, each on a `VARIANT_SHARE` of the problems: dropout with
  a drawn keep mask (``p`` 0.1, 0.3 or 0.5; the eager kernel, its weights dropped and scaled before
  ``p @ v``, with its gradients on the gradient problems) and ``p`` rounded to a narrower
  ``intermediate_dtype`` (attnlib's tiled kernel); the other kernels skip those problems;

and judges each with `check_kernel` (one reference per problem, `memo.shared`): out, LSE,
and on every ``GRADIENT_EVERY``-th problem (the long ones among them) the autograd gradients of
SDPA and of the eager kernel, with ``dlse`` (FlexAttention has no backward on the CPU).  Each run is one row; `summary` counts false alarms per precision and
kernel with the worst ratio of each tensor and an exact upper confidence bound on the rate.
Problem ``i`` of a seed is drawn from its own generator, so a run can resume (``rows``
written line by line to a JSON-lines file, problems already there skipped).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..core.device import warm_vml
from ..core.masks import mask_specs
from ..core.problem import precision
from ..core.tiled import attention
from . import memo
from .calibration import _to_numpy, _to_torch
from .naive import SAMPLE_ROWS
from .shapes import UnusableInput
from .verdict import check_kernel

PRECISIONS = ("float32", "bfloat16", "float16")
HEAD_DIMS = (8, 16, 32, 64, 96, 128, 192, 256)
#: ``batch * Hq * Sq * Sk * max(D, Dv)`` of the problems drawn: ordinary ones, and the
#: few long ones (one in ``LONG_EVERY``, the ``LONG_EVERY // 2``-th first) that reach Sq = Sk = 4096.
MAX_WORK, LONG_WORK, LONG_EVERY = 1 << 22, 1 << 30, 200
#: Every this-many-th problem also judges the autograd gradients, within a larger budget: its
#: prefill rows reach the hundreds (to 1024), where the check's naive backward runs on a sample
#: of the rows and keys (above `attnlib.check.naive.SAMPLE_ROWS`).
GRADIENT_EVERY, GRADIENT_WORK = 4, 1 << 24
#: FlexAttention runs on every this-many-th problem: eager on the CPU it traces its mods
#: anew for each problem (~0.35 s, ten times the check's own time).
FLEX_EVERY = 4
#: FlexAttention compiled runs on every this-many-th problem: Inductor compiles a kernel per
#: shape (3.4-3.8 s measured per problem here, float32 and bfloat16; the first ~20 s).
FLEX_COMPILED_EVERY = 20
#: The share of problems drawn with each 2026 variant the kernels here express: dropout (the eager
#: kernel, with its gradients on the gradient problems) and ``p`` rounded to an intermediate type
#: (attnlib's tiled kernel); the kernels that cannot express a problem's variant skip it.
VARIANT_SHARE = 0.1
#: The intermediate types drawn, each where it is no wider than the precision (`precision`).
INTERMEDIATES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


@dataclass
class Problem:
    q: np.ndarray  # (b, Hq, Sq, D), float64 values of the type
    k: np.ndarray  # (b, Hk, Sk, D)
    v: np.ndarray  # (b, Hk, Sk, Dv)
    dout: np.ndarray  # (b, Hq, Sq, Dv)
    dlse: np.ndarray  # (b, Hq, Sq), float32 values; None on the problems that judge no gradients
    options: dict  # attnlib's keywords: causal, window, kv_lengths, softcap, sinks, scale
    regime: str  # decode, short, prefill or long
    index: int  # its number in the run
    #: the check's keywords of a 2026 variant, which only some kernels express: dropout with the
    #: kernel's keep mask (``dropout_p``, ``dropout_mask``), or ``p`` rounded to ``intermediate_dtype``
    variant: dict = field(default_factory=dict)

    @property
    def shape(self) -> str:
        b, hq, sq, d = self.q.shape
        return f"({b}, {hq}/{self.k.shape[1]}, {sq}, {self.k.shape[2]}, {d}, {self.v.shape[-1]})"


def judges_gradients(index: int) -> bool:
    """Whether problem ``index`` also judges the autograd gradients (every `GRADIENT_EVERY`-th)."""
    return index % GRADIENT_EVERY == 0


def _log_int(rng, lo, hi) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def draw(rng, prec_name: str, index: int) -> Problem:
    """Problem ``index``: its shape, options and values, from ``rng`` alone."""
    prec = precision(prec_name)
    long = index % LONG_EVERY == LONG_EVERY // 2  # the 100th of each 200: one that judges gradients too
    # (gradient problems lean to prefill: the rows past 128 where the naive backward is sampled)
    weights = [0.25, 0.25, 0.5] if judges_gradients(index) else [0.4, 0.3, 0.3]
    regime = "long" if long else str(rng.choice(["decode", "short", "prefill"], p=weights))
    hk = int(rng.choice([1, 2, 4]))
    group = int(rng.choice([1, 2, 4, 8]))  # hk 1 and group > 1: MQA
    b = int(rng.choice([1, 2]))
    d = int(rng.choice(HEAD_DIMS))
    dv = d if rng.random() < 0.5 else int(rng.choice(HEAD_DIMS))
    if regime == "decode":
        sq, sk = int(rng.choice([1, 1, 1, 2, 4, 8])), _log_int(rng, 1, 4096)
    elif regime == "short":
        sq, sk = _log_int(rng, 2, 256), _log_int(rng, 1, 256)
    elif regime == "prefill":
        sq = _log_int(rng, 16, 1024)
        sk = sq if rng.random() < 0.6 else _log_int(rng, sq, 4 * sq)
    else:  # one head at long rows, head dims up to 64
        sq = sk = int(rng.choice([2048, 4096]))
        b, hk, group, d, dv = 1, 1, 1, min(d, 64), min(dv, 64)
    budget = LONG_WORK if long else GRADIENT_WORK if judges_gradients(index) else MAX_WORK
    while b * hk * group * sq * sk * max(d, dv) > budget:  # fewer heads, then shorter rows
        if group > 1:
            group //= 2
        elif hk > 1:
            hk //= 2
        elif b > 1:
            b = 1
        elif sk > sq and sk > 1:
            sk //= 2
        else:
            sq, sk = max(1, sq // 2), max(1, sk // 2)
    hq = hk * group
    options = {}
    if rng.random() < 0.4:
        options["causal"] = True
    if rng.random() < 0.15:
        options["window"] = (_log_int(rng, 1, sk + 1) - 1, 0 if options.get("causal") else _log_int(rng, 1, 64) - 1)
    if rng.random() < 0.15:
        options["kv_lengths"] = rng.integers(0 if rng.random() < 0.2 else 1, sk + 1, size=b)
    if rng.random() < 0.15:
        options["softcap"] = float(rng.choice([5.0, 20.0, 50.0]))
    if rng.random() < 0.1:
        options["sinks"] = rng.standard_normal(hq)
    if rng.random() < 0.1:
        options["scale"] = float(rng.uniform(0.5, 2.0) / math.sqrt(d))
    logits = 10.0 ** rng.uniform(-1, 1)  # the scores' standard deviation
    magnitude, grad_magnitude = 10.0 ** rng.uniform(-6, 4, size=2)
    if prec_name == "float16":  # dout . v and the sums of p v stay inside float16's range
        magnitude, grad_magnitude = min(magnitude, 1e3), min(grad_magnitude, 1e3)
    q = rng.standard_normal((b, hq, sq, d)) * logits
    k = rng.standard_normal((b, hk, sk, d))
    v = rng.standard_normal((b, hk, sk, dv)) * magnitude
    dout = rng.standard_normal((b, hq, sq, dv)) * grad_magnitude
    with np.errstate(over="ignore"):
        q, k, v, dout = (prec.round(x).astype(np.float64) for x in (q, k, v, dout))
    dlse = None
    if judges_gradients(index):  # of D_i = dout_i . out_i's size (ring attention's merge gives it so)
        top = 1e3 if prec_name == "float16" else math.inf  # p dlse in float16's range
        size = min(top, magnitude * grad_magnitude * 10.0 ** rng.uniform(-1, 1))
        dlse = (rng.standard_normal((b, hq, sq)) * size).astype(np.float32).astype(np.float64)
    variant, u = {}, rng.random()
    if u < VARIANT_SHARE and regime != "long":  # dropout with the keep mask the kernel drew (n^2 bools)
        rate = float(rng.choice([0.1, 0.3, 0.5]))
        variant = dict(dropout_p=rate, dropout_mask=rng.random((b, hq, sq, sk)) >= rate)
    elif u < 2 * VARIANT_SHARE:  # p rounded to a narrower type before p @ v
        narrower = [t for t in INTERMEDIATES if t != prec_name and _narrower(prec_name, t)]
        variant = dict(intermediate_dtype=str(rng.choice(narrower)))
    return Problem(q, k, v, dout, dlse, options, regime, index, variant)


def _narrower(prec_name: str, intermediate: str) -> bool:
    """Whether ``intermediate`` may hold ``p`` in a ``prec_name`` kernel (no wider than it)."""
    try:
        precision(prec_name, intermediate)
    except ValueError:
        return False
    return True


def _visible(p: Problem) -> np.ndarray:
    """``(b, 1, Sq, Sk)`` boolean: the problem's mask, pair by pair (attnlib's own specs)."""
    b, _, sq, _ = p.q.shape
    sk = p.k.shape[2]
    masks = {n: p.options[n] for n in ("causal", "window", "kv_lengths") if n in p.options}
    specs = mask_specs((b,), sq, sk, **masks)
    rows, cols = np.arange(sq), np.arange(sk)
    if () in specs:
        return np.broadcast_to(specs[()].visible(rows, cols), (b, 1, sq, sk))
    return np.stack([specs[(i,)].visible(rows, cols) for i in range(b)])[:, None]


def kernels(prec_name: str) -> dict:
    """``name -> fn(problem, rng, grads) -> dict of tensors, or None`` (the kernel cannot
    express the problem): the correct kernels of the sweep (see the module docstring)."""
    def tiled(p, rng, grads):
        if "dropout_p" in p.variant:
            return None
        tiles = dict(block_q=int(rng.choice([16, 32, 64, 128])), block_k=int(rng.choice([1, 16, 32, 64, 128])))
        if rng.random() < 0.25:
            tiles["kv_splits"] = int(rng.choice([2, 3, 4]))
        out, lse = attention(p.q, p.k, p.v, compute_dtype=prec_name, return_lse=True, **tiles, **p.options,
                             intermediate_dtype=p.variant.get("intermediate_dtype"))
        return dict(out=out.astype(np.float64), lse=lse.astype(np.float64))

    found = {f"attnlib tiled in {prec_name}": tiled}
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return found
    warm_vml()  # before these kernels' first torch ops (`device.warm_vml`)

    def backward(p, out, t):
        out.backward(_to_torch(prec_name, p.dout)[0])
        return dict(dq=_to_numpy(t[0].grad), dk=_to_numpy(t[1].grad), dv=_to_numpy(t[2].grad))

    def sdpa(backends):
        def run(p, rng, grads):
            if any(n in p.options for n in ("softcap", "sinks")) or p.variant:
                return None
            vis = _visible(p)
            if not vis.any(axis=-1).all():
                return None  # a row with no visible key: SDPA returns NaN there, the contract 0
            t = _to_torch(prec_name, p.q, p.k, p.v, grad=grads)
            with sdpa_kernel(backends), torch.set_grad_enabled(grads), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # why the flash kernel was not used
                out = F.scaled_dot_product_attention(*t, attn_mask=torch.from_numpy(np.array(vis)),
                                                     scale=p.options.get("scale"), enable_gqa=True)
            return dict(out=_to_numpy(out)) | (backward(p, out, t) if grads else {})
        return run

    def flex(compiled):
        every, offset = (FLEX_COMPILED_EVERY, 11) if compiled else (FLEX_EVERY, 1)

        def run(p, rng, grads):
            if "sinks" in p.options or p.variant or p.index % every != offset:
                return None
            vis = torch.from_numpy(np.array(_visible(p)[:, 0]))
            cap = p.options.get("softcap")

            def score_mod(score, b, h, i, j):
                return cap * torch.tanh(score / cap)

            def mask_mod(b, h, i, j):
                return vis[b, i, j]

            b, _, sq, _ = p.q.shape
            mask = create_block_mask(mask_mod, b, None, sq, p.k.shape[2], device="cpu")
            fn, aux = flex_attention, dict(return_lse=True)
            if compiled:
                # A fresh compile per problem: past dynamo's recompile limit a compiled function
                # falls back to eager silently, and fullgraph=True turns a graph break into an error.
                torch.compiler.reset()
                fn, aux = torch.compile(flex_attention, fullgraph=True, dynamic=False), {}  # no LSE on the CPU
            with warnings.catch_warnings(), torch.no_grad():  # FlexAttention has no backward on the CPU
                warnings.simplefilter("ignore")  # eager (unfused) on the CPU; return_lse's deprecation
                got = fn(*_to_torch(prec_name, p.q, p.k, p.v), score_mod=None if cap is None else score_mod,
                         block_mask=mask, scale=p.options.get("scale"), enable_gqa=True, **aux)
            return dict(out=_to_numpy(got)) if compiled else dict(out=_to_numpy(got[0]), lse=_to_numpy(got[1]))
        return run

    def eager(p, rng, grads):  # Hugging Face's eager attention, differentiated through its LSE too
        rate = p.variant.get("dropout_p")
        grads = grads and p.dlse is not None
        if not grads and rate is None or "intermediate_dtype" in p.variant:
            return None
        vis = torch.from_numpy(np.array(_visible(p)))
        sinks = p.options.get("sinks")
        # rows with no visible key (no sink): softmax gives NaN there; given 0 and an LSE of -inf,
        # as FlashAttention's attention_ref fills them (their scores made finite first: no NaN in autograd)
        empty = None if sinks is not None or vis.any(axis=-1).all() else ~vis.any(axis=-1, keepdim=True)
        q, k, v = _to_torch(prec_name, p.q, p.k, p.v, grad=grads)
        group = q.shape[1] // k.shape[1]
        dp = torch.from_numpy(p.dout) @ torch.from_numpy(p.v).repeat_interleave(group, 1).transpose(-1, -2)
        if grads and float(dp.abs().max()) / (1 - (rate or 0.0)) > float(torch.finfo(q.dtype).max):
            return None  # dp = dout v^T, which this kernel stores in the type, beyond it: it cannot hold the problem
        scale = p.options.get("scale", 1.0 / math.sqrt(q.shape[-1]))
        s = (torch.matmul(q, k.repeat_interleave(group, 1).transpose(-1, -2)) * scale).float()  # stored in the type
        if "softcap" in p.options:  # in float32: in float16 the chain rule's grad x cap overflowed (dk all inf)
            cap = p.options["softcap"]
            s = torch.tanh(s / cap) * cap
        s = s.masked_fill(~vis, -math.inf)
        if empty is not None:
            s = s.masked_fill(empty, 0.0)
        if sinks is not None:  # (gpt-oss's eager sinks: a float32 leaf, its gradient dsinks)
            sinks = torch.tensor(sinks, dtype=torch.float32, requires_grad=True)
            s = torch.cat([s, sinks[None, :, None, None].expand(s.shape[:-1] + (1,))], dim=-1)
        lse = torch.logsumexp(s, dim=-1)
        w = torch.softmax(s, dim=-1)
        w = w if sinks is None else w[..., :-1]
        if empty is not None:
            w, lse = w.masked_fill(empty, 0.0), lse.masked_fill(empty[..., 0], -math.inf)
        if rate is not None:  # dropout with the drawn keep mask, as FlashAttention's attention_ref applies it
            w = w * torch.from_numpy(p.variant["dropout_mask"]) / (1 - rate)
        out = torch.matmul(w.to(q.dtype), v.repeat_interleave(group, 1))
        if not grads:
            return dict(out=_to_numpy(out), lse=_to_numpy(lse))
        dout = _to_torch(prec_name, p.dout)[0]
        torch.autograd.backward([out, lse], [dout, torch.from_numpy(p.dlse).float()])
        return dict(out=_to_numpy(out), lse=_to_numpy(lse), dq=_to_numpy(q.grad), dk=_to_numpy(k.grad),
                    dv=_to_numpy(v.grad), dlse=p.dlse) | ({} if sinks is None else dict(dsinks=_to_numpy(sinks.grad)))

    version = torch.__version__
    found[f"torch {version} eager (float32 softmax), autograd with dlse"] = eager
    found[f"torch {version} SDPA, math backend"] = sdpa([SDPBackend.MATH])
    found[f"torch {version} SDPA, default backend"] = sdpa([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    found[f"torch {version} FlexAttention, eager"] = flex(compiled=False)
    if _cxx_compiler():
        found[f"torch {version} FlexAttention, compiled"] = flex(compiled=True)
    return found


def _cxx_compiler() -> bool:
    """Whether Inductor's CPU backend finds a C++ compiler (``$CXX``, or its defaults)."""
    import os
    import shutil
    return any(shutil.which(c) for c in filter(None, (os.environ.get("CXX"), "g++", "clang++", "c++")))


def _ratio(verdict):
    return None if verdict is None or verdict.passed is None else float(verdict.ratio)


def run_problem(prec_name: str, seed: int, index: int) -> list[dict]:
    """Problem ``index`` of ``seed`` in ``prec_name``: one row per kernel that can express it."""
    rng = np.random.default_rng([seed, index, PRECISIONS.index(prec_name) if prec_name in PRECISIONS else 9])
    p = draw(rng, prec_name, index)
    grads = judges_gradients(index)
    rows = []
    with memo.shared():  # one reference per problem
        for name, fn in kernels(prec_name).items():
            with np.errstate(all="ignore"):
                tensors = fn(p, rng, grads and "attnlib" not in name)
            if tensors is None:
                continue
            shown = {**p.options, **{"dropout" if n == "dropout_mask" else n: x for n, x in p.variant.items()}}
            row = dict(precision=prec_name, seed=seed, index=index, regime=p.regime, shape=p.shape,
                       rows=int(p.q.shape[2]), options=sorted(n for n in shown if n != "dropout_p"), kernel=name)
            try:
                r = check_kernel(p.q, p.k, p.v, tensors["out"], lse=tensors.get("lse"),
                                 dout=p.dout if "dq" in tensors else None, dq=tensors.get("dq"),
                                 dk=tensors.get("dk"), dv=tensors.get("dv"), dlse=tensors.get("dlse"),
                                 dsinks=tensors.get("dsinks"),
                                 layout="bhsd", dtype=prec_name, workers=1, **p.options, **p.variant)
            except UnusableInput as e:  # e.g. float16 scores beyond its range: no baseline
                rows.append(row | dict(judged=False, why=str(e)[:200]))
                continue
            ratios = {n: _ratio(v) for n, v in ({"out": r.out, "lse": r.lse} | r.grads).items()}
            rows.append(row | dict(judged=True, passed=bool(r.passed),
                                   **{f"{n}_ratio": x for n, x in ratios.items() if x is not None}))
    return rows


def run(precisions=PRECISIONS, problems=100, seed=0, path=None, progress=None, code="") -> list[dict]:
    """``problems`` problems per precision, every kernel on each: the rows.  ``path``: a
    JSON-lines file the rows are appended to as they come, and read back first (problems
    already there are not run again: a long run resumes); ``code`` (the git commit) is kept
    in each row, and rows of other code are not read back.  ``progress(text)``: called per
    hundred problems."""
    done, rows = set(), []
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    row = json.loads(line) if line.strip() else {}
                    if row.get("code") == code and row.get("precision") in precisions and row["index"] < problems:
                        rows.append(row)
                        done.add((row["precision"], row["seed"], row["index"]))
        except FileNotFoundError:
            pass
        import os
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") if path is not None else contextlib.nullcontext() as out:
        for prec_name in precisions:
            for index in range(problems):
                if (prec_name, seed, index) in done:
                    continue
                new = run_problem(prec_name, seed, index) or [dict(precision=prec_name, seed=seed, index=index,
                                                                   kernel=None, judged=False)]
                new = [dict(r, code=code) for r in new]
                rows += new
                if out is not None:
                    out.write("".join(json.dumps(r) + "\n" for r in new))
                    out.flush()
                if progress is not None and index % 100 == 99:
                    progress(f"{prec_name}: problem {index + 1} of {problems}")
    return [r for r in rows if r.get("kernel")]


#: What the sweep's verdicts depend on: the check, the kernels, the gate and the inputs.
MEASURED = ("attnlib/check", "attnlib/core", "attnlib/judge", "attnlib/evidence/inputs.py")


def code_version() -> str:
    """The git objects of `MEASURED` this run judges with (rows of other code are not
    resumed); with uncommitted changes there, or no git, a tag no later run shares."""
    import hashlib
    import os
    import subprocess
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        tree = subprocess.run(["git", "ls-tree", "HEAD", *MEASURED], cwd=root, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *MEASURED], cwd=root, capture_output=True,
                               text=True, timeout=10)
        if tree.returncode == 0 and tree.stdout.strip() and not dirty.stdout.strip():
            return "check code " + hashlib.sha256(tree.stdout.encode()).hexdigest()[:12]
    except (OSError, subprocess.SubprocessError):
        pass
    return f"uncommitted, {time.time():.0f}"


def upper_bound(failures: int, runs: int, confidence: float = 0.95) -> float:
    """The exact (Clopper-Pearson) one-sided upper confidence bound on a rate seen as
    ``failures`` in ``runs``: with none, ``1 - (1 - confidence) ** (1 / runs)`` (~3 / runs)."""
    if runs == 0 or failures >= runs:
        return 1.0
    alpha = 1.0 - confidence

    def cdf(p):  # P(X <= failures) for X ~ Binomial(runs, p)
        return sum(math.comb(runs, i) * p ** i * (1 - p) ** (runs - i) for i in range(failures + 1))

    lo, hi = failures / runs, 1.0
    for _ in range(100):  # cdf falls as p grows: the p where it meets alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > alpha else (lo, mid)
    return hi


def _where(row) -> str:
    """A run's kernel, regime, shape and options, in words."""
    return f"{row['kernel']}, {row['regime']} {row['shape']} {'+'.join(row['options']) or 'no options'}"


def summary(rows) -> dict:
    """Per precision and kernel (and ``all``): runs judged, false alarms, their 95% upper
    bound, the worst ratio of ``out`` and of the LSE and where (``worst_at``), of the gradients and
    where (``worst_grad_at``); the gradient runs where some gradient had no verdict, those above
    `SAMPLE_ROWS` query rows (the naive backward on a sample), their worst ratio and most rows."""
    out = {}
    for r in rows:
        for key in (r["precision"], f"{r['precision']} | {r['kernel']}", "all"):
            s = out.setdefault(key, dict(runs=0, unjudged=0, false_alarms=0, worst_out=0.0, worst_lse=None,
                                         worst_grad=None, gradient_runs=0, gradients_partly_judged=0,
                                         sampled_gradient_runs=0, worst_sampled_grad=None, deepest_sampled=0,
                                         worst_at="", worst_grad_at=""))
            if not r["judged"]:
                s["unjudged"] += 1
                continue
            s["runs"] += 1
            s["false_alarms"] += int(not r["passed"])
            worst = max([r.get("out_ratio", 0.0), r.get("lse_ratio", 0.0)])
            if worst > max(s["worst_out"], s["worst_lse"] or 0.0):
                s["worst_at"] = _where(r)
            s["worst_out"] = max(s["worst_out"], r.get("out_ratio", 0.0))
            if "lse_ratio" in r:
                s["worst_lse"] = max(s["worst_lse"] or 0.0, r["lse_ratio"])
            g = [r[f"{n}_ratio"] for n in ("dq", "dk", "dv") if f"{n}_ratio" in r]
            if g:
                s["gradient_runs"] += 1
                s["gradients_partly_judged"] += len(g) < 3  # a gradient without a verdict (beyond the type's range)
                if max(g) > (s["worst_grad"] or 0.0):
                    s["worst_grad_at"] = _where(r)
                s["worst_grad"] = max([s["worst_grad"] or 0.0] + g)
                if r.get("rows", 0) > SAMPLE_ROWS:  # the naive backward on a sample of the rows and keys
                    s["sampled_gradient_runs"] += 1
                    s["worst_sampled_grad"] = max([s["worst_sampled_grad"] or 0.0] + g)
                    s["deepest_sampled"] = max(s["deepest_sampled"], r["rows"])
    for s in out.values():
        s["upper_95"] = upper_bound(s["false_alarms"], s["runs"])
    return out


def main(argv=None) -> int:
    """``python -m attnlib.check.space [--problems N] [--seed S] [--jsonl PATH]``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m attnlib.check.space",
                                description="Measure the check's false alarms over random problems and correct kernels.")
    p.add_argument("--problems", type=int, default=100, help="problems per precision (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--jsonl", default=None, metavar="PATH", help="append the rows here; resume from it")
    args = p.parse_args(argv)
    # Tagged with the code it judges with, as the report's run is: either resumes the other's rows.
    rows = run(args.precisions, args.problems, args.seed, args.jsonl,
               progress=lambda text: print(text, file=sys.stderr, flush=True), code=code_version())
    print(json.dumps(summary(rows), indent=1))
    return 0


__all__ = ["code_version", "draw", "kernels", "run", "run_problem", "summary", "upper_bound", "Problem", "PRECISIONS"]

if __name__ == "__main__":
    raise SystemExit(main())
