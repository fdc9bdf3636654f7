"""The rule: how far a correct kernel's tensors may lie from attnlib's reference, per entry.

Every entry of a tensor gets an *allowance*, the largest ``|kernel - ref|`` a correct
kernel can show there, and the verdict is ``max |kernel - ref| / allowance <= 1`` (NaN and
inf are failures).  How the allowance is built depends on the kernel's precision:

*Below float64* (float32, float16, bfloat16) it is FlashAttention's test rule, "twice the
naive baseline's error plus an absolute term", with every error counted in ulps of each
entry's own size rather than in absolute units::

    size      = |ref| + sqrt(sum_j p_ij**2 v_jc**2)         (the entry's own size)
                + w S_i sqrt(sum_j p_ij**2 (v_jc - ref_ic)**2)
    unit      = eps size + tiny                             (an ulp of the type at that size)
    allowance = (2 max(|naive - ref| / unit) + 2) unit      (max over the tensor)

``ref`` is attnlib's float64 tiled reference, far more precise than the kernel; ``eps``
and ``tiny`` are the kernel type's machine epsilon and smallest subnormal.  The size has
two parts because a correct kernel's errors do: relative errors of the whole (the final
``1 / l``, the output's rounding) scale with ``|ref|``, and independent errors of the
terms (``p`` rounded, scores rounded, the sum's own roundings) with their root-sum-square
(Higham & Mary 2019), which cancellation between values of both signs does not shrink,
and the scores' rounding: a score off by ``ds_j`` moves the entry by ``sum_j p_j ds_j (v_j -
out)``, ``ds_j`` a few ulps of the row's score size ``S_i = sigma_i + |lse_i|`` (``sigma_i =
max_j |scale| sum_c |q_ic k_jc|``, `row_stats`; ``|lse_i|`` holds what is added to the scores
and the shift by the row max) in the state's type (``w``: its epsilon over the kernel type's,
1 for float32, ``2**-16`` for bfloat16).  Without that part a decode head, one row of few
entries, had too few naive errors to show it: 4 of 3,563 correct float32 runs failed (the
check-rule report's random problems measure the rate now).
The root-sum-squares come from the reference's own tiled pass (`attnlib.check.sizes.reference_sizes`:
``p**2`` summed beside ``p``), or, for a reference computed on a cluster, from a second pass
at doubled scores, ``softmax(2 s) = p**2 / sum p**2``.  ``FINAL_ROUNDINGS = 2`` ulps hold the kernel's own
rounding of its result and of one partial result.

*Why not FlashAttention's absolute term.*  Its ``atol = 2 max |fl(fl(ref + 0.3) - 0.3) -
ref|`` is the rounding of values near 0.3: below about ``ulp(0.3) / 2`` (bfloat16: 1e-3)
it becomes ``~2 |ref|``, so an all-zero output passed any bfloat16 problem whose values
were 1e-4 (the earlier rule here, measured in the check-rule report), and the pooled
error in units of ``P @ |V|`` (the sum of absolute terms) let a wrong softmax scale through
wherever long rows cancel.  In ulps of ``|ref| + rss`` the rule is the same at every
magnitude of ``v`` and ``dout``, from the subnormal range up.

``naive`` is plain attention computed in the kernel's precision (inputs, scores, ``p`` and
``out`` rounded to it, the softmax and sums in float32) in four plain formulations, and
``|naive - ref|`` is the largest of their errors, entry by entry:

* the scale applied to the scores as an eager kernel applies it, sums in BLAS order
  (`dense_attention` with ``compute_dtype`` and ``eager``: ``q k^T`` stored in the type, then
  its scaled value, and a softcap's steps each stored);
* ``q`` and ``k`` each multiplied by ``sqrt(scale)`` and rounded first, BLAS order;
* the same with the softmax first: ``p / l`` rounded to the type, then ``@ v`` (PyTorch's
  math path, FlashAttention's test ``attention_ref``);
* ``q`` and ``k`` scaled first, summed one key after another in float32 (the dense order
  ``"key_by_key"``, as a tiled kernel with one-key tiles accumulates).

Above `attnlib.check.naive.SAMPLE_ROWS` rows they are computed on a sample of the rows (spread
evenly, and the kernel's worst rows, `worst_rows`), and each formulation's largest ratio is
scaled to the whole tensor (`attnlib.check.naive.sampled_ratio`).

The ratio ``|naive - ref| / unit`` is pooled over the whole tensor for ``out`` and the LSE
(every entry is in ulps of its own size, so heads compare; a head of few entries drew too
few naive errors: PyTorch's float32 ``p @ v`` sums key after key, and with the row's
dominant key early its partial sum carries ~150 roundings, which one head's naive draws
missed: 3 of 20,583 correct runs sat at 0.53-0.55 of a per-head allowance), per head for
the gradients.

Which formulation errs most depends on the shape and the library (``docs/semantics.md``
has the measurements); `attnlib.check.space` measures the false alarms that remain over
random problems, `attnlib.check.power` the wrong kernels caught at every magnitude.

*float64* kernels make errors of the reference's own size, so "twice the naive error"
would compare rounding noise with rounding noise (below one key tile the naive dense
result is bit-identical to attnlib's and the bound collapses to ``atol``).  There the
allowance is the verdict gate's (`attnlib.judge.gate`): a first-order float64 rounding bound on
how far two correct implementations can differ, per row, relative to ``P @ |V|``, with
the kernel's tiling taken at its worst case (``block_k = 1``: any order of summation),
capped by the contract's ``rel_error < 1e-9``.  It needs no naive baseline and is sound
by derivation; the check report measures how far below it correct kernels sit.

*lse*: the same two rules on the row's log-sum-exp (below float64 the rule above, in ulps
of the state's type (float32 for 16-bit kernels) at the row's size ``S_i``), plus one ulp of ``|lse|`` in the type the kernel *stored* it
in (an LSE kept in bfloat16 is off by up to half an ulp of bfloat16 after an exact
computation).  Rows with no visible key must be ``-inf`` (attnlib, PyTorch) or ``+inf``
(FlashAttention).

*Gradients* below float64: the same rule, with the naive backward in the kernel's
precision in four formulations (`~attnlib.core.backward.FORMULATIONS`: PyTorch's eager
autograd; the same with ``scale * ds`` rounded, as Hugging Face's eager attention does;
FlashAttention's, with ``D = dout . out`` from the stored output; and one summed key by
key as a tiled kernel accumulates) and each entry's size ``|ref| + rss`` from the dense
float64 gradient (`reference_attention_backward` with ``return_rss``; ``ds`` counts the
rounding of ``D``'s terms, ``sum_j |p dp|``, which every entry of a row shares, the scores' rounding
(each term's ``p`` moved by ``S_i`` ulps of the state's type, ``rss_scores``: without it
PyTorch's float32 autograd failed at logits of standard deviation 5, ratio 1.8) and of
``D = dout . out`` from the stored output, and,
weighted by the accumulator's epsilon over the type's, what ``dp`` and ``D`` sum
componentwise: a float32 FlashAttention-2 backward failed at a row with one visible key,
where ``dp - D`` cancels exactly and the reference ``dq`` is 0, before it was counted).  A
formulation that overflows (float16 ``dp = dout . v`` beyond 65504) is left out.  The
earlier bound for float32, ``2 e_g`` times the componentwise size with a worst-case
``8 N u`` term, let ``dq, dk, dv`` scaled by ``1 + 1e-3`` pass at n = 1024: correct
autograd gradients sat at 6e-5 of it.  *float64* gradients: a first-order rounding bound
in the gate's terms (`gradient_rounding`), ``2 e_g`` times each entry's componentwise size
(what it sums, with ``|dout|, |q|, |k|, |v|`` and ``|dp| + |D|``), against the tiled float64
gradient with those sizes summed beside it (`attnlib.core.gradsizes`); with softcap (where no
bound is derived) the rule above against a long double dense gradient, and past the dense size
a softcapped float64 gradient is reported, not judged.  Below float64 the gradients' sizes come
from the same tiled pass and their naive backward runs on a sample of rows and keys
(`attnlib.check.naive.naive_gradient_errors`): judged at every length.

Rows with no visible key must be exactly 0 in ``out`` (the contract's and
FlashAttention's ``attention_ref``): their allowance is 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core import arrays
from ..core.device import as_tensor
from ..core.lse_conventions import NATURAL, LseConvention
from ..core.options import Options
from ..judge.gate import row_stats, tolerance
from ..judge.metrics import BOUND, TINY
from ..core.reference import dense_attention
from ..core.tiled import forward_on
from .shapes import positions
from .naive import KERNEL_ROWS, naive_errors, pool_axes, sampled_ratio
from .sizes import doubled_options, forward_rss, forward_sizes, reference_sizes, row_masks, score_size  # noqa: F401 (re-exported)


@dataclass
class TensorVerdict:
    """The rule applied to one tensor (``out``, ``lse``, ``dq``, ``dk`` or ``dv``)."""

    name: str
    max_err: float
    median_err: float
    ratio: float | None  # max |err| / allowance over entries (inf: NaN/inf or an error where 0 is allowed)
    allowance: float | None  # the allowance at the worst entry
    naive_max: float | None  # the naive baseline's max error (None: float64 gate, or no baseline)
    passed: bool | None  # None: reported, not judged
    heads: list = field(default_factory=list)  # per head: head, max, median, naive_max, ratio, passed
    worst: list = field(default_factory=list)  # the worst entries by ratio: position, kernel, ref, err, allowance (ulps)
    max_ulps: float | None = None  # max |err| / u: the error in ulps of each entry's own size (`unit`)
    nan: int = 0
    inf: int = 0
    nonfinite_at: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def nonfinite(self) -> int:
        return self.nan + self.inf


@dataclass
class Expected:
    """A problem's reference output and what a correct kernel may differ from it by."""

    ref: np.ndarray  # (..., Hq, Sq, Dv) float64
    ref_lse: np.ndarray  # (..., Hq, Sq); -inf on rows with no visible key
    allowance: np.ndarray  # (..., Hq, Sq, Dv): the largest |out - ref| a correct kernel has
    lse_allowance: np.ndarray  # (..., Hq, Sq), absolute
    naive_err: np.ndarray | None  # below float64: |naive - ref|, the larger of both orders
    naive_lse_err: np.ndarray | None  # (..., Hq, Sq), 0 on rows with no visible key
    baseline: str  # how the allowance was made, in words
    unit: np.ndarray | None = None  # (..., Hq, Sq, Dv): u, an ulp of the kernel's type at each entry's size
    scores: np.ndarray | None = None  # (..., Hq, Sq): each row's score size sigma_i + |lse_i| (`score_size`)

    @property
    def empty(self) -> np.ndarray:
        """``(..., Hq, Sq)``: rows with no visible key."""
        return np.isneginf(self.ref_lse)


def per_head_max(x: np.ndarray) -> np.ndarray:
    """``max |x|`` over every axis but the head axis (-3), kept as size-1 axes."""
    return np.max(x, axis=pool_axes(x.ndim, "head"), keepdims=True, initial=0.0)


#: Ulps allowed beyond twice the naive error: the kernel's own rounding of its result and of
#: one partial result (a GQA group's or a split's sum), each at most half an ulp of the
#: type, twice over (in float16's subnormal range, below 6.1e-5, each costs its absolute
#: resolution whatever the size: PyTorch's float16 flash backward erred 2.2 ulps there).
FINAL_ROUNDINGS = 2.0



def unit(size, dtype) -> np.ndarray:
    """``eps size + tiny``: an ulp of ``dtype`` at ``size``, from above.

    ``eps`` is the type's machine epsilon and ``tiny`` its smallest subnormal: for any
    ``|x| <= size`` the spacing of ``dtype`` at ``x`` is at most this, so one unit holds a
    correctly rounded result, and below the normal range (float16 from 6.1e-5) it is the
    type's absolute resolution.  It scales with the entry: no constant anchors it.
    """
    fi = arrays.finfo(dtype)
    return float(fi.eps) * np.asarray(size, dtype=np.float64) + float(fi.smallest_subnormal)


def worst_rows(kernel, ref, size, dtype, count: int = KERNEL_ROWS) -> np.ndarray:
    """The ``count`` query rows where ``kernel`` lies farthest from ``ref`` in ulps of ``dtype`` at
    ``size`` (`unit`; the largest over batch, heads and columns; rows with an error only,
    non-finite entries left out: they fail whatever the allowance), ascending."""
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(kernel - ref) / unit(size, dtype)
    err = np.where(np.isfinite(err), err, 0.0)
    by_row = err.max(axis=-1, initial=0.0).reshape(-1, err.shape[-2]).max(axis=0, initial=0.0)  # (Sq,)
    rows = np.argsort(by_row, kind="stable")[::-1][:count]
    return np.sort(rows[by_row[rows] > 0])


def medians(by_head) -> tuple:
    """``(per_row, whole)``: `np.median` of each row of ``by_head`` (a 2-D array, rows not empty)
    and of all its entries, exactly, from one copy partitioned once: the whole's middle values lie
    between the rows' least lower middle and largest upper middle (each row has more than half its
    entries on either side of its own), so only the entries in that range are partitioned again
    (two full partitions took half the verdict's time at n = 4096)."""
    work = np.array(by_head, dtype=np.float64)
    h, n = work.shape
    mid = sorted({(n - 1) // 2, n // 2})
    work.partition(mid, axis=1)
    per_row = np.mean(work[:, mid], axis=1)  # np.median's own: the mean of the middle one or two
    lo, hi = work[:, mid[0]].min(), work[:, mid[-1]].max()
    below = np.count_nonzero(work < lo)
    between = work[(work >= lo) & (work <= hi)]
    at = sorted({(h * n - 1) // 2 - below, h * n // 2 - below})
    between.partition(at)
    return per_row, float(np.mean(between[at]))


def naive_allowance(naive_err, u, pool=per_head_max) -> np.ndarray:
    """``(2 r + 2) u``, ``r = max(|naive - ref| / u)`` over ``pool`` (a head by default):
    FlashAttention's "twice the naive baseline's error", with the error measured in ulps of
    each entry's own size (``u``: its `unit`), plus `FINAL_ROUNDINGS` ulps for the kernel's own."""
    return (2 * pool(naive_err / u) + FINAL_ROUNDINGS) * u


class OnDevice:
    """The check's arrays on a torch device: ``put`` gives ``qh``, ``kh``, ``vh`` there once
    (each later call the same tensor), any other array by a copy (not kept); ``run`` is the
    tiled kernel there (`attnlib.core.tiled` on the torch backend), ``dense`` the dense reference
    (`attnlib.core.reference` on the torch backend), their results read back to the host."""

    def __init__(self, device, *arrays_):
        self.device = device
        self.kept = {id(x): (x, as_tensor(x, "input", device)) for x in arrays_}  # x kept: its id stays its own

    def put(self, x):
        found = self.kept.get(id(x))
        return as_tensor(x, "input", self.device) if found is None else found[1]

    def run(self, q, k, v, o, **run):
        result = forward_on(self.put(q), self.put(k), self.put(v), o, device=self.device, **run)
        return tuple(arrays.as_numpy(x, "the reference") for x in result)

    def dense(self, q, k, v, o, **run):
        result = dense_attention(self.put(q), self.put(k), self.put(v), o, dev=self.device, **run)
        return tuple(tuple(arrays.as_numpy(y, "the baseline") for y in x) if isinstance(x, tuple)
                     else arrays.as_numpy(x, "the baseline") for x in result)


def expect(qh, kh, vh, opts: Options, prec, workers, scheduler=None, device=None,
           pool="tensor", kernel=None, kernel_lse=None) -> Expected:
    """The reference and the allowance for ``attention(qh, kh, vh, **opts.given())`` (bhsd
    layout, float64) judged as a kernel in ``prec``.
    ``scheduler`` (a Dask client or scheduler address): the float64 reference and
    ``P @ |V|`` are computed on that cluster (`attnlib.distributed.attention`).  ``device``
    (a ``torch.device``): the reference, ``P @ |V|``, the score sizes of the allowance and the
    naive baselines are computed with torch there (`OnDevice`).  ``pool``: over what the
    naive error's ratio is pooled (`pool_axes`), ``"tensor"`` or ``"head"`` (
    the diagnosis, so that one head's loose baseline lends a neighbouring problem no match
    in another head).  ``kernel``, ``kernel_lse``: the output and the lse judged (bhsd, float64
    values; the lse in natural units), whose worst rows join the naive baselines' sample
    (`worst_rows`)."""
    on = None if device is None or scheduler is not None else OnDevice(device, qh, kh, vh)
    if scheduler is None:
        def run(q, k, v, o):
            return (forward_on if on is None else on.run)(q, k, v, o, return_lse=True, workers=workers)
    else:
        from ..distributed import attention as on_cluster

        def run(q, k, v, o):
            return on_cluster(q, k, v, return_lse=True, client=scheduler, **o.given())
    if prec.is_float64:  # with P @ |V|, the size of what each entry sums: one pass over [v, |v|]
        both, ref_lse = run(qh, kh, np.concatenate([vh, np.abs(vh)], axis=-1), opts)
        ref, ref_abs = both[..., :vh.shape[-1]], both[..., vh.shape[-1]:]
        tol = tolerance(*((qh, kh) if on is None else (on.put(qh), on.put(kh))), vh, ref_lse, block_k=1,
                        options=opts)
        allowance = np.minimum(tol.allowed(ref_abs), BOUND * np.maximum(ref_abs, TINY))
        return Expected(ref, ref_lse, allowance, tol.lse, None, None,
                        "float64 rounding bound (the verdict gate, any tiling)", unit(ref_abs, np.float64))
    if scheduler is None:  # the reference and its entries' sizes in one pass
        ref, ref_lse, rss, dev = reference_sizes(qh, kh, vh, opts, workers, None if on is None else on.device)
    else:
        ref, ref_lse = run(qh, kh, vh, opts)
        rss, dev = forward_sizes(run, qh, kh, vh, opts, ref, ref_lse)
    empty = np.isneginf(ref_lse)
    # Each entry's own size: |ref| (errors relative to the whole, as in 1 / l) plus the
    # root-sum-square of its terms (independent errors of p and of the sum); pooled over a
    # head in ulps of it, so a batch entry or row with large values lends the others nothing.
    # The scores' rounding moves each entry by sum_j p_j ds_j (v_j - out), ds_j up to a
    # few ulps of the row's score size in the state's type (float32 for 16-bit kernels):
    # its root-sum-square is the third part of the size (without it a head of one decode
    # row lent its few naive errors a size they lacked: 4 float32 false alarms in 3,563).
    scores = score_size(qh, kh, opts, ref_lse, None if on is None else on.device)
    state = float(arrays.finfo(prec.accumulate).eps) / float(arrays.finfo(prec.compute).eps)
    size = np.abs(ref) + rss + state * scores[..., None] * dev
    u = unit(size, prec.compute)
    # The kernel's worst rows join the baselines' sample (by the whole size: at large logits the
    # scores' part decides which rows those are).
    # (A wrong shape is refused by the judge, not here.)
    worst = [worst_rows(kernel, ref, size, prec.compute)] if np.shape(kernel) == ref.shape else []
    if kernel_lse is not None and np.size(kernel_lse) == ref_lse.size:  # the lse's, in ulps of its own size
        worst.append(worst_rows(np.reshape(kernel_lse, ref_lse.shape)[..., None], ref_lse[..., None],
                                scores[..., None], prec.accumulate))
    worst = np.unique(np.concatenate(worst)) if worst else None
    naive_err, naive_lse_err, baseline, draws, lse_draws = naive_errors(qh, kh, vh, opts, prec, ref, ref_lse, on,
                                                                        worst, workers)
    seen = ~empty[..., None]
    allowance = (2 * sampled_ratio(draws, u, seen, pool) + FINAL_ROUNDINGS) * u
    if prec.p_type is not None:
        # p rounded to a narrower type: equal weights round alike and their errors add, up to half
        # an ulp of that type of |ref| (twice it, the rule's factor): equal scores whose running max
        # moves at a tile boundary are rounded off their exact values, where the baselines' are exact
        # (a row of 63 scores at -ln 2 failed at 30 allowances in e5m2 before)
        allowance = allowance + float(arrays.finfo(prec.p_type).eps) * np.abs(ref)
    allowance = np.where(empty[..., None], 0.0, allowance)  # empty rows: exactly 0
    # lse: the same rule in ulps (of the state's type) of the row's own size |lse| + sigma
    # (its score terms' rounding, sum_j p_j ds_j, is up to a few ulps of sigma).
    lse_u = unit(scores[..., None], prec.accumulate)
    lse_allowance = ((2 * sampled_ratio(lse_draws, lse_u, seen, pool) + FINAL_ROUNDINGS) * lse_u)[..., 0]
    lse_allowance = np.where(empty, 0.0, lse_allowance)
    return Expected(ref, ref_lse, allowance, lse_allowance, naive_err, naive_lse_err, baseline, u, scores)


def ratios(kernel, ref, allowance):
    """``(err, ratio)``: ``|kernel - ref|`` (0 at NaN/inf) and ``err / allowance`` (inf at
    NaN/inf and wherever an error meets a zero allowance)."""
    finite = np.isfinite(kernel)
    err = np.abs(np.where(finite, kernel, 0.0) - ref).astype(np.float64)
    with np.errstate(over="ignore"):  # an error over a subnormal allowance: infinitely over
        ratio = np.divide(err, allowance, out=np.where(err > 0, np.inf, 0.0), where=allowance > 0)
    ratio[~finite] = np.inf
    return err, ratio


def judge(name, kernel, ref, allowance, naive_err, describe, u=None):
    """The rule on one tensor ``(..., H, S, X)``: ``(verdict, err, ratio)``; ``naive_err``
    is the naive baseline's ``|naive - ref|`` (None for the float64 rule); ``u``: each entry's
    `unit`, in which the errors are also given (``ulps``)."""
    err, ratio = ratios(kernel, ref, allowance)
    u = None if u is None else np.broadcast_to(u, err.shape)  # u > 0: it holds the smallest subnormal
    allowance = np.broadcast_to(allowance, err.shape)
    heads = []
    if err.ndim < 3:
        median = float(np.median(err)) if err.size else 0.0
    else:
        def by_head(x):
            return np.moveaxis(x, -3, 0).reshape(x.shape[-3], -1)
        h_err, h_ratio = by_head(err), by_head(ratio)
        h_naive = None if naive_err is None else by_head(naive_err)
        h_median, median = medians(h_err) if err.size else (np.zeros(err.shape[-3]), 0.0)
        for h in range(err.shape[-3]):
            hr = float(h_ratio[h].max(initial=0.0))
            heads.append({"head": h, "max": float(h_err[h].max(initial=0.0)),
                          "median": float(h_median[h]),
                          "naive_max": None if h_naive is None else float(h_naive[h].max(initial=0.0)),
                          "ratio": hr, "passed": hr <= 1})
    flat = ratio.ravel()
    # The worst entries by ratio; by error when nothing is judged (an infinite allowance).
    rank = flat if np.isfinite(allowance).any() else err.ravel()
    top = np.argsort(rank)[::-1][:5] if rank.size <= 5 else np.argpartition(rank, -5)[-5:]
    top = top[np.argsort(rank[top], kind="stable")[::-1]]
    with np.errstate(over="ignore"):  # an error over a subnormal unit: infinitely many ulps
        ulps = None if u is None else err / u
        at = [np.unravel_index(i, err.shape) for i in top]  # (ravel would copy a broadcast array)
        worst = [dict(describe(ix), kernel=float(kernel[ix]), ref=float(ref[ix]), err=float(err[ix]),
                      allowance=float(allowance[ix]), ratio=float(flat[i]))
                 | ({} if u is None else {"ulps": float(ulps[ix]), "allowance_ulps": float(allowance[ix] / u[ix])})
                 for i, ix in zip(top, at)]
    nan, inf = int(np.count_nonzero(np.isnan(kernel))), int(np.count_nonzero(np.isinf(kernel)))
    max_ratio = float(flat.max()) if flat.size else 0.0
    verdict = TensorVerdict(
        name=name, max_err=float(err.max(initial=0.0)),
        median_err=median, ratio=max_ratio,
        allowance=worst[0]["allowance"] if worst else None,
        naive_max=None if naive_err is None else float(naive_err.max(initial=0.0)),
        passed=max_ratio <= 1, heads=heads, worst=worst, nan=nan, inf=inf,
        max_ulps=None if ulps is None else float(np.max(ulps, initial=0.0)),
        nonfinite_at=[describe(ix) for ix in np.argwhere(~np.isfinite(kernel))[:5]])
    return verdict, err, ratio


def judge_out(out, expected: Expected):
    """``out`` (bhsd, float64 values) against the expectation: ``(verdict, err, ratio)``."""
    return judge("out", out, expected.ref, expected.allowance, expected.naive_err, positions(), expected.unit)


def _judge_row_values(name, kernel, ref, empty, allowance, naive_err, stored, convention) -> TensorVerdict:
    """The rule on one value per row, ``(..., Hq, Sq)`` in natural units (an lse, a max score),
    with one ulp of the type ``stored`` it was kept in (and the product by ln 2 of a base-2
    one) added to ``allowance``; rows in ``empty`` are judged by their caller (0 against 0 here)."""
    allowance = np.array(allowance, dtype=np.float64)
    stored, f = np.dtype(stored), convention.factor  # natural = stored * f
    top = np.abs(np.where(empty, 0.0, ref)) / f  # |value| as the kernel stored it
    if arrays.finfo(stored).nmant < 52:  # rounded to a coarser type when stored: one of its ulps
        with np.errstate(over="ignore"):
            top = np.minimum(top, float(arrays.finfo(stored).max))
            allowance += np.abs(np.spacing(top.astype(stored)).astype(np.float64)) * f
    if f != 1.0:  # the product by ln 2 rounds once more, in float64
        allowance += np.spacing(top * f)

    def as_entries(x):  # (..., Hq, Sq) as (..., Hq, Sq, 1), with a head axis at 1-D
        return None if x is None else (x[None] if x.ndim == 1 else x)[..., None]

    k = np.where(empty, 0.0, kernel)
    r = np.where(empty, 0.0, ref)
    verdict = judge(name, *map(as_entries, (k, r, allowance, naive_err)), positions())[0]
    for w in verdict.worst + verdict.nonfinite_at:
        w.pop("dim")
    return verdict


def judge_lse(lse, expected: Expected, stored, convention: LseConvention = NATURAL) -> TensorVerdict:
    """``lse`` against the expectation; ``stored``: the dtype the kernel stored it in;
    ``convention``: its base and what its empty rows hold (`attnlib.core.lse_conventions`;
    the sink's place is the expectation's: that of the problem with or without sinks).

    Rows without a visible key have ``ref = -inf``; the kernel may write ``-inf``
    (attnlib, PyTorch) or ``+inf`` (FlashAttention) there, or the one it is told, nothing else.
    """
    ref_lse = expected.ref_lse
    lse = convention.to_natural(np.asarray(lse, dtype=np.float64).reshape(ref_lse.shape))
    empty = expected.empty
    # Empty rows are judged below, by what they hold: here they are 0 against 0.
    verdict = _judge_row_values("lse", lse, ref_lse, empty, expected.lse_allowance, expected.naive_lse_err,
                                stored, convention)
    nan_empty = int(np.count_nonzero(empty & np.isnan(lse)))
    finite_empty = int(np.count_nonzero(empty & np.isfinite(lse)))
    wrong_inf = 0 if convention.empty is None else int(np.count_nonzero(empty & (lse == -convention.empty)))
    if nan_empty or finite_empty or wrong_inf:
        verdict.passed = False
        verdict.ratio = float("inf")
        verdict.nan += nan_empty
        parts = ([f"{nan_empty} hold NaN"] if nan_empty else []) + (
            [f"{finite_empty} hold a finite value"] if finite_empty else []) + (
            [f"{wrong_inf} hold {'-inf' if convention.empty > 0 else '+inf'}"] if wrong_inf else [])
        told = "-inf (or +inf)" if convention.empty is None else \
            f"{'+inf' if convention.empty > 0 else '-inf'} (lse_empty)"
        verdict.notes.append(f"rows without a visible key must have lse {told}: {' and '.join(parts)}")
    return verdict


def expect_max_scores(qh, kh, vh, opts: Options, prec, expected: Expected, workers=None, dense=True,
                      on=None):
    """``(ref, allowance, naive_err)`` for a kernel's ``max_scores`` (`docs/semantics.md`):
    the float64 reference's, by attnlib's tiled kernel, and what a correct kernel may differ by,
    entry by entry, ``(..., Hq, Sq)``.

    A row's largest score is off by at most its worst score's rounding.  In float64: twice the
    verdict gate's bound on a row's score error (``delta``: the kernel's and the reference's)
    plus an ulp of ``|max|``; below it, twice the larger error of the naive baselines' maxima
    (tiled with float32 scores; dense, its scores stored in the type) in units of each row's own
    score size ``sigma_i + |max_i|`` (``sigma_i = max_j |scale| sum_c |q_ic| |k_jc|`` over its
    visible keys, `row_stats`; ``|max_i|`` holds the softcap's and ALiBi's part), pooled per
    head in those units, plus an ulp of ``|max_i|`` in the state's type.
    ``on``: an `OnDevice` to run the forwards on."""
    run = forward_on if on is None else on.run
    ref = run(qh, kh, vh, opts, return_max_scores=True, workers=workers)[1]
    if on is not None:
        ref = arrays.as_numpy(ref, "max_scores")
    empty = np.isneginf(ref)
    r = np.where(empty, 0.0, ref)
    if prec.is_float64:
        tol = tolerance(*((qh, kh) if on is None else (on.put(qh), on.put(kh))), vh, expected.ref_lse,
                        block_k=1, options=opts)
        return ref, 2 * np.asarray(tol.delta) + unit(np.abs(r), np.float64), None
    naive_err = np.zeros(ref.shape)
    runs = [lambda: run(qh, kh, vh, opts, return_max_scores=True, compute_dtype=prec, workers=workers,
                        check_finite=False)[1]]
    if dense:
        runs.append(lambda: (dense_attention if on is None else on.dense)(
            qh, kh, vh, opts, return_max_scores=True, compute_dtype=prec, check_finite=False)[1])
    for naive in runs:
        with np.errstate(over="ignore", invalid="ignore"):  # a naive that overflows is left out
            m = np.asarray(arrays.as_numpy(naive(), "max_scores"), dtype=np.float64)
        if np.isfinite(np.where(empty, 0.0, m)).all():
            np.maximum(naive_err, np.abs(np.where(empty, 0.0, m) - r), out=naive_err)
    sigma = row_stats(qh, kh, options=row_masks(opts), device=None if on is None else on.device)[0]
    size = np.asarray(arrays.as_numpy(sigma, "sigma"), dtype=np.float64).reshape(ref.shape) + np.abs(r)
    rel = np.divide(naive_err, size, out=np.zeros_like(naive_err), where=size > 0)
    allowance = 2 * per_head_max(rel[..., None])[..., 0] * size + unit(np.abs(r), prec.accumulate)
    return ref, np.where(empty, 0.0, allowance), naive_err


def judge_max_scores(kernel, ref, allowance, naive_err, stored, convention: LseConvention = NATURAL) -> TensorVerdict:
    """A kernel's ``max_scores (..., Hq, Sq)`` against ``ref`` (`expect_max_scores`), stored in
    ``stored`` and in ``convention``'s base; rows without a visible key must hold ``-inf``."""
    kernel = convention.to_natural(np.asarray(kernel, dtype=np.float64).reshape(ref.shape))
    empty = np.isneginf(ref)
    verdict = _judge_row_values("max_scores", kernel, ref, empty, allowance, naive_err, stored, convention)
    wrong = int(np.count_nonzero(empty & ~np.isneginf(kernel)))
    if wrong:
        verdict.passed, verdict.ratio = False, float("inf")
        verdict.notes.append(f"rows without a visible key must have max_scores -inf: {wrong} do not")
    return verdict
