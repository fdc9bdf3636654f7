"""Judging a native sparse attention kernel (`docs/semantics.md`, "Native sparse attention"):
its gated output against the sum of the three branches, each branch's allowance by the rule of
its own problem (`attnlib.check.rule.expect`), and each branch output it gives on its own."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core import problem
from ..core.arrays import as_numpy
from ..core.nsa import BRANCHES, NSA, checked_selection, compressed_and_selection
from ..core.options import Options
from .rule import TensorVerdict, expect, judge
from .shapes import LAYOUTS, UnusableInput, positions, to_bhsd
from .verdict import check_kernel


@dataclass
class NSACheck:
    """``out``: the gated output's verdict; ``branches``: `KernelCheck` of each branch output
    the kernel gave; with the kernel's ``selected``: ``selection`` its verdict (`judge_selection`:
    None without), ``selection_differs`` the (query, kv head) rows whose blocks differ from the
    float64 selection (near-ties included)."""

    out: TensorVerdict
    branches: dict = field(default_factory=dict)
    selection_differs: int | None = None
    notes: list = field(default_factory=list)
    selection: "SelectionVerdict | None" = None

    @property
    def passed(self) -> bool:
        return (self.out.passed is not False and all(c.passed for c in self.branches.values())
                and (self.selection is None or self.selection.passed))


@dataclass
class SelectionVerdict:
    """A kernel's NSA selection judged (`judge_selection`): ``rows`` judged, ``failed`` rows, and
    the first failures in words."""

    passed: bool
    rows: int
    failed: int
    notes: list = field(default_factory=list)


def judge_selection(selected, importance, size, nsa: NSA, sq: int, sk: int, group: int, prec,
                    n_cmp: int) -> SelectionVerdict:
    """The kernel's ``selected`` ``(..., Hk, Sq, top_n)`` against the float64 ``importance``
    ``(..., Hk, Sq, n_slc)``: per row, every forced block it reaches taken, none past the query or
    twice, ``min(top_n, reach)`` blocks, and each chosen block as important as each reachable one
    left out up to the rounding ``t_j = 2 (eps + (eps + 2 eps_s) S_i + n_j eps_s) I_j`` (``size``: ``S_i``,
    ``(..., Hk, Sq)``; ``n_cmp``: the compressed blocks; ``docs/semantics.md``, "Native sparse attention")."""
    n_slc = -(-sk // nsa.select_block_size)
    forced, reach = nsa.forced_and_reach(sq, sk)  # (Sq, n_slc), (Sq,)
    imp = np.zeros(importance.shape[:-1] + (n_slc,))
    imp[..., :min(n_slc, importance.shape[-1])] = importance[..., :n_slc]
    terms = np.zeros(n_slc)  # the compressed weights each importance sums (per query head)
    terms[:min(n_slc, importance.shape[-1])] = [hi - lo for lo, hi in nsa.overlaps(n_cmp)][:n_slc]
    eps, eps_s = prec.eps, float(np.finfo(prec.accumulate).eps)
    # (the scores' rounding in the type, not only the state's: kernels store the pooled keys in the input
    # type, as fla's mean pooling does; a bfloat16 one then tied two blocks 3.9% apart in float64)
    tol = 2 * (eps + (eps + 2 * eps_s) * size[..., None] + group * terms * eps_s) * imp
    counts = np.zeros(selected.shape[:-1] + (n_slc + 1,), dtype=np.int64)  # column n_slc: the -1 entries
    for t in range(selected.shape[-1]):  # how often each block is listed
        counts += (np.where(selected[..., t:t + 1] < 0, n_slc, selected[..., t:t + 1]) == np.arange(n_slc + 1))
    taken = counts[..., :n_slc] > 0
    reachable = np.arange(n_slc)[None, :] < reach[:, None]  # (Sq, n_slc)
    want = np.minimum(nsa.top_n, reach)  # (Sq,)
    bad = {"a block listed twice": (counts[..., :n_slc] > 1).any(-1),
           "a block past the query": (taken & ~reachable).any(-1),
           "a forced block (initial or local) left out": (~taken & forced & reachable).any(-1),
           "fewer or more blocks than the row has to give": taken.sum(-1) != want}
    free = reachable & ~forced
    low = np.where(taken & free, imp + tol, np.inf).min(-1)  # the least important chosen, at its most
    high = np.where(~taken & free, imp - tol, -np.inf).max(-1)  # the most important left out, at its least
    bad["a block chosen over a more important one beyond rounding"] = low < high
    failed = np.zeros(taken.shape[:-1], dtype=bool)
    for b in bad.values():
        failed |= b
    notes = [f"{words}: {int(np.count_nonzero(b))} rows" for words, b in bad.items() if b.any()]
    if failed.any():
        at = np.argwhere(failed)[0]
        notes.append(f"first failing row: {dict(zip(('batch', 'kv_head', 'query')[-len(at):], map(int, at)))}, "
                     f"selected {sorted(int(x) for x in selected[tuple(at)] if x >= 0)}, float64 importance "
                     f"order {np.argsort(-imp[tuple(at)], kind='stable')[:nsa.top_n + 2].tolist()}")
    return SelectionVerdict(not failed.any(), int(failed.size), int(np.count_nonzero(failed)), notes)


def check_nsa(q, k, v, out, gates, nsa: NSA | None = None, *, selected=None, branches=None, layout="bshd",
              dtype=None, scale=None, workers=None) -> NSACheck:
    """An NSA kernel's ``out`` (and its ``branches``, ``{"compressed" | "selected" | "window":
    output}``) against attnlib's float64 branches: ``gates (batch, nheads, seqlen_q, 3)``; ``selected``
    the kernel's own selection ``(batch, nheads_k, seqlen_q, top_n)``, on which the branches are
    then judged.  The gated output's allowance is ``sum_b |g_b| allowance_b`` plus two roundings
    in the type of ``sum_b |g_b o_b|`` (the gated sum's products and additions)."""
    nsa = nsa or NSA()
    if layout not in LAYOUTS:
        raise UnusableInput(f"layout must be one of {LAYOUTS}, got {layout!r}")
    stored = [as_numpy(x, n) for x, n in zip((q, k, v, out), ("q", "k", "v", "out"))]
    try:
        prec = problem.precision(dtype if dtype is not None else stored[0].dtype.name)
    except ValueError:
        raise UnusableInput(f"dtype: give the kernel's precision (dtype=), q is {stored[0].dtype}") from None
    qh, kh, vh, kernel = (to_bhsd(np.asarray(x, dtype=np.float64) if x.dtype.kind == "f" else x.astype(np.float64),
                                  layout) for x in stored)
    g = np.asarray(as_numpy(gates, "gates"), dtype=np.float64)
    if g.shape != qh.shape[:-1] + (3,):
        raise UnusableInput(f"gates must have shape {qh.shape[:-1] + (3,)} (batch, nheads, seqlen_q, 3), got {g.shape}")
    if not np.isfinite(g).all():  # a NaN gate would hide its row from the verdict
        raise UnusableInput(f"gates hold NaN or inf (first at {tuple(int(x) for x in np.argwhere(~np.isfinite(g))[0])})")
    if kernel.shape != qh.shape[:-1] + (vh.shape[-1],):
        raise UnusableInput(f"out must have q's shape with v's head dim, {qh.shape[:-1] + (vh.shape[-1],)} in bhsd, "
                            f"got {kernel.shape}")
    try:
        _, ours, importance, row_size = compressed_and_selection(qh, kh, vh, nsa, scale=scale, workers=workers,
                                                             return_importance=True)  # the float64 selection
        blocks = ours if selected is None else checked_selection(selected, kh.shape, qh.shape[-2], nsa)
    except (ValueError, TypeError) as e:
        raise UnusableInput(str(e)) from e
    sq, sk = qh.shape[-2], kh.shape[-2]
    k_cmp, v_cmp = nsa.compressed(kh, vh)
    problems = {"compressed": (k_cmp, v_cmp, Options.parse(mask_mod=nsa.compressed_mod(sq, sk), scale=scale)),
                "selected": (kh, vh, Options.parse(gather_kv_indices=nsa.keys_of(blocks, sk), causal=True, scale=scale)),
                "window": (kh, vh, Options.parse(causal=True, window=(nsa.window - 1, 0), scale=scale))}
    expected = {b: expect(qh, kb, vb, opts, prec, workers) for b, (kb, vb, opts) in problems.items()}
    ref = sum(g[..., i:i + 1] * expected[b].ref for i, b in enumerate(BRANCHES))
    size = sum(np.abs(g[..., i:i + 1] * expected[b].ref) for i, b in enumerate(BRANCHES))
    allowance = sum(np.abs(g[..., i:i + 1]) * np.broadcast_to(expected[b].allowance, kernel.shape)
                    for i, b in enumerate(BRANCHES)) + 2 * prec.eps * size
    verdict = judge("out", kernel, ref, allowance, None, positions("query"))[0]
    if verdict.passed is False:  # the gates or branches mixed up: named where the output matches
        verdict.notes += _diagnose(kernel, g, [expected[b].ref for b in BRANCHES], allowance)
    result = NSACheck(verdict)
    result.notes.append(f"NSA: l = {nsa.block_size}, s = {nsa.stride}, l' = {nsa.select_block_size}, "
                        f"top_n = {nsa.top_n}, window = {nsa.window}; judged against the three branches gated"
                        + (" on the kernel's own selection" if selected is not None else ""))
    if selected is not None:
        mine = np.sort(np.where(ours < 0, np.iinfo(np.int64).max, ours), axis=-1)
        theirs = np.sort(np.where(blocks < 0, np.iinfo(np.int64).max, blocks), axis=-1)
        result.selection_differs = int(np.count_nonzero((mine != theirs).any(axis=-1)))
        result.selection = judge_selection(blocks, importance, row_size, nsa, sq, sk, qh.shape[-3] // kh.shape[-3], prec,
                                           k_cmp.shape[-2])
        result.notes.append(f"selection: {'PASS' if result.selection.passed else 'FAIL'}, "
                            f"{result.selection.failed} of {result.selection.rows} (query, kv head) rows failed; it "
                            f"differs from the float64 one on {result.selection_differs} rows (near-ties may)")
        result.notes += [f"selection: {n}" for n in result.selection.notes]
    def laid(x):  # attnlib's (..., H, S, X) in the kernel's layout
        return np.swapaxes(x, -2, -3) if layout == "bshd" else x

    for b, given in (branches or {}).items():
        if b not in BRANCHES:
            raise UnusableInput(f"branches: unknown branch {b!r}, the branches are {BRANCHES}")
        kb, vb, opts = problems[b]
        options = opts.given()
        if "gather_kv_indices" in options:  # per kv head: (batch, seqlen_q, nheads_k, topk) in bshd
            options["gather_kv_indices"] = laid(options["gather_kv_indices"])
        keys = (laid(kb), laid(vb)) if b == "compressed" else (stored[1], stored[2])
        result.branches[b] = check_kernel(stored[0], *keys, given, layout=layout, dtype=prec.name, workers=workers,
                                          **options)
    return result


def _diagnose(kernel, g, refs, allowance) -> list:
    """``diagnosis: ...`` notes: the gated sum with the gates in another order, or a branch left out."""
    import itertools

    head = allowance.reshape(allowance.shape[:-2] + (-1,)).max(axis=-1)[..., None, None]
    loose = np.broadcast_to(head, kernel.shape)

    def gated(order, drop=None):
        return sum(g[..., i:i + 1] * refs[j] for i, j in enumerate(order) if j != drop)

    alternatives = [(f"the gates applied in the order {', '.join(BRANCHES[j] for j in order)} (not "
                     f"{', '.join(BRANCHES)})", gated(order)) for order in itertools.permutations(range(3))
                    if order != (0, 1, 2)]
    alternatives += [(f"the {b} branch left out", gated((0, 1, 2), drop=n)) for n, b in enumerate(BRANCHES)]
    alternatives.append(("no gates (the three branches summed)", sum(refs)))
    found = [f"diagnosis: the output matches NSA with {words}" for words, alt in alternatives
             if np.all(np.abs(kernel - alt) <= loose)]
    return found or ["diagnosis: no known cause matched"]


__all__ = ["NSACheck", "SelectionVerdict", "check_nsa", "judge_selection"]
