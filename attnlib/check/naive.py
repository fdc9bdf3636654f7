"""The check's naive baselines (`attnlib.check.rule`): plain attention in the kernel's precision
in its plain formulations, computed on a sample of the query rows, and the largest error among
them in ulps of each entry's own size, scaled to the whole tensor (`sampled_ratio`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np

from ..core.backward import FORMULATIONS, dense_backward
from ..core.options import Options
from ..core import validate
from ..core.parallel import _parallel_settings, run_tiles
from ..core.reference import dense_attention
from .shapes import UnusableInput


def naive_rows(ref_lse, least: int, every: int, worst=None):
    """The query rows a naive baseline computes (an index array), or None for all of them:
    ``max(least, ceil(Sq / every))`` rows spread evenly over the rows where some head sees a
    key, the first and last of them included, and the rows ``worst`` (`rule.worst_rows`; all rows
    when there are no more than that many)."""
    sq = ref_lse.shape[-1]
    return spread(np.isfinite(ref_lse).reshape(-1, sq).any(axis=0), least, every, worst)


def spread(seen, least: int, every: int, worst=None):
    """`naive_rows` over positions ``seen`` (a boolean vector: the rows, or keys, that count)."""
    sq = seen.size
    seen = np.flatnonzero(seen)
    want = max(least, -(-sq // every))
    if seen.size <= want:
        return None
    spread = seen[np.unique(np.round(np.linspace(0, seen.size - 1, want)).astype(np.int64))]
    return spread if worst is None else np.union1d(spread, worst)


#: The naive baselines' rows (`naive_rows`): all of them up to `SAMPLE_ROWS`, else that many or
#: every `SAMPLE_EVERY`-th, whichever is more (a baseline's scores cost about 12 reference
#: passes a row: its rows dense, masked pairs too, single-threaded, rounded at each step).
SAMPLE_ROWS, SAMPLE_EVERY = 128, 128
#: The key-by-key order's rows: it adds every product ``p_ij v_jc`` in a Python loop over the
#: keys, many times a BLAS product's cost per term, so it computes fewer rows, each with every key.
KEY_BY_KEY_ROWS, KEY_BY_KEY_EVERY = 32, 256
#: The rows where the kernel under test errs most, in ulps of each entry's size, join each
#: sample: a few rows can hold most of a correct kernel's error (float32 at large logits, one
#: dominant key early in a row summed key by key: 7 ulps there, 0.5 in the median row), where
#: the naive errs as much; a sample spread evenly missed them and left correct kernels at up to
#: 0.92 of the allowance (0.42 with every row computed).
KERNEL_ROWS = 32
#: The bytes of a dense baseline's working arrays at a time (its rows taken in chunks), over
#: the threads computing them: each chunk takes a `NAIVE_THREADS`-th.
NAIVE_CHUNK_BYTES = 1 << 28
#: The most threads the baselines run on, and the fewest parts the gradients' sampled rows and keys
#: are each split into: fixed, not taken from ``workers``, so that the split, and with it every
#: rounding, is the same for any thread count.
NAIVE_THREADS = 4


def _in_threads(tasks, workers: int) -> list:
    """``[task() for task in tasks]``, on ``workers`` threads (`attnlib.core.parallel.run_tiles`:
    BLAS held to one thread, the error state carried over): a baseline's formulations and parts
    are independent, and numpy releases the GIL in them."""
    done = [None] * len(tasks)
    run_tiles(lambda i: done.__setitem__(i, tasks[i]()), range(len(tasks)), workers)
    return done


def pool_axes(ndim: int, pool: str):
    """The axes a naive ratio is pooled over: every axis (``"tensor"``), or all but the head
    axis -3 (``"head"``; the whole tensor below three axes)."""
    return None if pool == "tensor" or ndim < 3 else tuple(a for a in range(ndim) if a != ndim - 3)


def sampled_ratio(draws, u, seen, pool: str = "tensor") -> np.ndarray:
    """``r``: the largest ``|naive - ref| / u`` over ``pool`` (`pool_axes`) and over the naive
    formulations' ``draws``, each ``(rows, err)``: ``err`` on those query rows (None: all).

    A formulation computed on a sample of the rows saw ``N_s`` of the pool's ``N`` entries
    (those of rows with a visible key, ``seen``): its largest ratio is scaled by ``sqrt(ln N /
    ln N_s)``.  Under the rounding model the errors are sums of independent roundings, close to
    normal, and the largest of ``N`` such draws grows as ``sqrt(2 ln N)`` times their spread:
    the scale gives back the maximum the whole tensor would show (measured in the check-rule
    report; without it, a sample's maximum is that of fewer entries, as a head's was, which
    left correct kernels at 0.55 of the allowance)."""
    axes = pool_axes(u.ndim, pool)
    seen = np.broadcast_to(seen, u.shape)
    every = np.sum(seen, axis=axes, keepdims=True)
    r = np.zeros(np.shape(every))
    for rows, err in draws:
        u_f, seen_f = (u, seen) if rows is None else (u[..., rows, :], seen[..., rows, :])
        ratio = np.max(np.where(seen_f, err / u_f, 0.0), axis=axes, keepdims=True, initial=0.0)
        if rows is not None:
            drawn = np.sum(seen_f, axis=axes, keepdims=True)
            ratio = ratio * np.sqrt(np.log(np.maximum(every, 2)) / np.log(np.maximum(drawn, 2)))
        np.maximum(r, ratio, out=r)
    return r


def _one_blas_thread(fn):
    """``fn`` with BLAS held to one thread (`attnlib.core.parallel`): the baselines' many
    products are small, and BLAS threads spin waiting for each other while another process
    holds a core (a test run's other worker): eight (2048 x 64) @ (64 x 170) float32 products
    took 64 ms on two OpenBLAS threads against 2.9 ms on one, measured under such load."""
    @functools.wraps(fn)
    def held(*args, **kwargs):
        with _parallel_settings():
            return fn(*args, **kwargs)
    return held


@_one_blas_thread
def naive_errors(qh, kh, vh, opts: Options, prec, ref, ref_lse, on=None, worst=None, workers=None):
    """``(naive_err, naive_lse_err, words, draws, lse_draws)``: the larger error of plain
    attention in ``prec`` over its plain formulations (see the module docstring), entry by
    entry, computed on a sample of the rows (`naive_rows`; 0 on the others); ``draws`` and
    ``lse_draws`` hold each formulation's ``(rows, |naive - ref|)`` (`sampled_ratio`).
    ``on``: an `OnDevice`, where every formulation runs with torch; ``worst``: rows every sample
    includes (`rule.worst_rows`); ``workers``: threads for the formulations on the host (None: every CPU)."""
    dense_forward = dense_attention if on is None else on.dense
    d = qh.shape[-1]
    scale = opts.scale if opts.scale is not None else 1.0 / math.sqrt(d)
    root = math.sqrt(abs(scale))
    unscaled = replace(opts, scale=1.0)  # q and k carry the scale
    rows = naive_rows(ref_lse, SAMPLE_ROWS, SAMPLE_EVERY, worst)
    in_order = naive_rows(ref_lse, KEY_BY_KEY_ROWS, KEY_BY_KEY_EVERY, worst)
    workers = 1 if on is not None else min(validate.workers(workers), NAIVE_THREADS)
    per_row = NAIVE_CHUNK_BYTES // max(1, 32 * NAIVE_THREADS * math.prod(qh.shape[:-2]) * kh.shape[-2])

    def naive(q, k, o, orders, at, eager=False):  # {order: (out, lse)} on the rows ``at`` (None: all), in chunks
        at = np.arange(qh.shape[-2]) if at is None else at
        parts = [dense_forward(q, k, v_r, o, return_lse=True, compute_dtype=prec, check_finite=False,
                               orders=orders, rows=at[c:c + max(1, per_row)], rounded=True, eager=eager)
                 for c in range(0, max(at.size, 1), max(1, per_row))]
        pick = (lambda x, f: x) if len(orders) == 1 else (lambda x, f: x[f])
        return {order: tuple(np.concatenate([np.asarray(pick(part[t], f), dtype=np.float64) for part in parts],
                                            axis=-1 - (t == 0)) for t in (0, 1))
                for f, order in enumerate(orders)}

    candidates = []  # (words, rows, (out, lse))
    with np.errstate(over="ignore", invalid="ignore"):  # a naive that overflows is left out below
        # q and k each scaled by sqrt(scale) and rounded, as PyTorch's math path does.
        # Every input rounded once, for every formulation (held in the accumulator's type).
        q_s, k_s = prec.round(qh * (root if scale >= 0 else -root)), prec.round(kh * root)
        q_r, k_r, v_r = (prec.round(x) for x in (qh, kh, vh))
        # The scale on the scores as an eager kernel applies it: q k^T stored in the type, then scaled
        # and stored (Hugging Face's eager attention), a softcap's steps each stored (its Gemma 2;
        # PyTorch's eager float16 softcap erred 1.08 of an allowance that kept them in float32).
        tasks = [(("eager: q k^T, then scaled, each stored, BLAS order",), rows,
                  lambda: naive(q_r, k_r, opts, ("blas",), rows, True))]  # (the names of a task's orders, rows, task)
        if np.isfinite(q_s).all() and np.isfinite(k_s).all():
            # PyTorch's math path, FlashAttention's test reference: softmax(s), rounded, @ v (not
            # fp8: p ~ 1/Sk among its subnormals)
            orders = ("blas",) if prec.p_type is not None and prec.p_type.itemsize == 1 else ("blas", "softmax_first")
            tasks += [(("BLAS order, q and k scaled by sqrt(scale) first", "softmax first, q and k scaled first"),
                       rows, lambda: naive(q_s, k_s, unscaled, orders, rows)),
                      (("key by key, q and k scaled first",), in_order,
                       lambda: naive(q_s, k_s, unscaled, ("key_by_key",), in_order))]
        for (names, at, _), found in zip(tasks, _in_threads([task for _, _, task in tasks], workers)):
            candidates += [(name, at, part) for name, part in zip(names, found.values())]
    empty = np.isneginf(ref_lse)
    r = np.where(empty, 0.0, ref_lse)  # lse on rows that see a key (empty rows: 0 against 0)
    naive_err = np.zeros(ref.shape)
    naive_lse_err = np.zeros(ref_lse.shape)
    draws, lse_draws, used = [], [], []
    for name, at, (out, lse) in candidates:
        at_ = slice(None) if at is None else at
        e, r_at = empty[..., at_], r[..., at_]
        if not (np.isfinite(out).all() and np.isfinite(np.where(e, 0.0, lse)).all()):
            continue  # e.g. float16 scores beyond 65504: the kernel may keep them in float32
        err, lse_err = np.abs(out - ref[..., at_, :]), np.abs(np.where(e, 0.0, lse) - r_at)
        naive_err[..., at_, :] = np.maximum(naive_err[..., at_, :], err)  # (an index array's rows: a copy)
        naive_lse_err[..., at_] = np.maximum(naive_lse_err[..., at_], lse_err)
        draws.append((at, err))
        lse_draws.append((at, lse_err[..., None]))
        used.append(name + ("" if at is None else f" ({at.size} of {ref.shape[-2]} rows)"))
    if not used:
        raise UnusableInput(f"plain attention in {prec.name} overflows on these inputs in every "
                            "formulation (scores beyond the type's range): there is no "
                            f"{prec.name} baseline to judge a kernel by; scale q or k down")
    return naive_err, naive_lse_err, f"{prec.label}: " + "; ".join(used), draws, lse_draws


@_one_blas_thread
def naive_gradient_errors(qh, kh, vh, douth, opts: Options, mod_grad, prec, ref_grads, stats, seen, worst,
                          workers=None, dlse=None):
    """``(errs, draws)`` per gradient name of ``ref_grads``: the larger error of the naive backward in
    ``prec`` over its formulations (`~attnlib.core.backward.FORMULATIONS`), entry by entry (0 off
    the sample; None where every formulation overflows the type), and each formulation's
    ``(positions, |naive - ref|)`` for `sampled_ratio`.

    ``dq`` on a sample of the query rows (`spread` over ``seen["dq"]``, with ``worst["dq"]``), each
    row's whole, and ``dsinks``, a sum of a term per row: its error over the 32 rows with the largest
    terms and, scaled to the rows they stand for, over the other sampled rows, plus the rounding of
    the whole sum; ``dk``, ``dv`` on a sample of the keys (``seen["dk"]``, ``worst["dk"]``), each
    key's sum over every row, with each row's softmax and ``D_i`` from ``stats = (ref_lse, ref,
    shift, d)`` (`dense_backward`'s ``keys``): the forward's rows as FlashAttention's formulation
    reads them, and the naive's own (`attnlib.core.gradsizes.GradSizes`'s ``naive``) for the
    formulations that store the scores in the type.  With every row computed anyway and the whole
    within `NAIVE_CHUNK_BYTES`, every key too; with both samples whole, the plain dense backward.
    ``workers``: threads for the parts (None: every CPU); ``dlse``: the loss's gradient with respect
    to the LSE (`dense_backward`'s), or None."""
    sq = qh.shape[-2]
    workers = min(validate.workers(workers), NAIVE_THREADS)
    rows = spread(seen["dq"], SAMPLE_ROWS, SAMPLE_EVERY, worst.get("dq"))
    keys = spread(seen["dk"], SAMPLE_ROWS, SAMPLE_EVERY, worst.get("dk"))
    heads = 32 * math.prod(qh.shape[:-2])  # bytes a pair takes over the heads (a few float32 and float64 arrays)
    if rows is None and heads * sq * kh.shape[-2] <= NAIVE_CHUNK_BYTES:
        # Every row computed anyway (decode, short prefill) and the whole fits: every key too, each
        # row's softmax its own (a bfloat16 eager decode's dk sat at 1.13 of the sampled keys'
        # allowance, 0.70 of the whole one's).
        keys = None
    groups, weights = [rows], [1.0]
    if "dsinks" in ref_grads and rows is not None:
        # dsinks sums a term per row, p_sink_i D_i: a few rows can hold most of it (at large logits
        # p_sink_i = exp(sink - lse_i) spans many decades), so the rows with the largest terms are
        # computed (weight 1) and the rest sampled, their error scaled to the rows they stand for.
        lse, out = stats[:2]
        with np.errstate(under="ignore"):
            p_sink = np.exp(np.asarray(opts.sinks, dtype=np.float64)[..., None] - np.where(np.isfinite(lse), lse, np.inf))
        d_size = np.sum(np.abs(douth * out), axis=-1) + (0.0 if dlse is None else np.abs(dlse))  # |D_i - dlse_i|'s
        by_row = (p_sink * d_size).reshape(-1, sq).max(axis=0)
        top = np.argsort(by_row, kind="stable")[::-1][:KERNEL_ROWS]
        top = np.sort(top[by_row[top] > 0])
        rest = np.setdiff1d(rows, top)
        groups = [top, rest]
        weights = [1.0, (np.count_nonzero(seen["dq"]) - np.count_nonzero(seen["dq"][top]))
                   / max(1, np.count_nonzero(seen["dq"][rest]))]

    def chunks(at, size, other):  # within the memory bound, at least two (rows and keys: the threads' parts)
        at = np.arange(size) if at is None else at
        step = max(1, min(NAIVE_CHUNK_BYTES // max(1, NAIVE_THREADS * heads * other), -(-at.size // 2)))
        return [at[c:c + step] for c in range(0, at.size, step)]

    def run(**part):  # every formulation's, sharing the scores they round alike
        return dense_backward(qh, kh, vh, douth, opts, mod_grad, compute_dtype=prec, formulation=FORMULATIONS,
                              check_finite=False, dlse=dlse, **part)

    errs, draws = dict.fromkeys(ref_grads), {n: [] for n in ref_grads}

    def add(name, at, x):
        x = np.asarray(x, dtype=np.float64)
        if not np.isfinite(x).all():  # this formulation overflows the type here: left out
            return
        ref = ref_grads[name] if at is None else ref_grads[name][..., at, :]
        e = np.abs(x - ref)
        if errs[name] is None:
            errs[name] = np.zeros(ref_grads[name].shape)
        whole = slice(None) if at is None else at
        errs[name][..., whole, :] = np.maximum(errs[name][..., whole, :], e)
        draws[name].append((at, e))

    names = tuple(ref_grads)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing formulation is left out
        if rows is None and keys is None:
            for grads in run():
                for n, x in zip(names, grads):
                    add(n, None, x if n != "dsinks" else np.asarray(x)[..., None, None])
            return errs, draws
        row_chunks = [(g, c) for g, at in enumerate(groups) for c in chunks(at, sq, kh.shape[-2]) if c.size]
        order = np.concatenate([c for _, c in row_chunks])  # the sampled rows, as computed
        key_chunks = chunks(keys, kh.shape[-2], sq)
        # (the keys' parts first: they sum two gradients, the rows' one)
        tasks = ([functools.partial(run, keys=c, stats=stats) for c in key_chunks]
                 + [functools.partial(run, rows=c) for _, c in row_chunks])
        if "dsinks" in names:  # the float64 sum of each group's terms, the naive's compared with it
            tasks += [functools.partial(dense_backward, qh, kh, vh, douth, opts, mod_grad, rows=c, check_finite=False,
                                        dlse=dlse) for _, c in row_chunks]
        done = _in_threads(tasks, workers)
        by_keys, by_rows = done[:len(key_chunks)], done[len(key_chunks):len(key_chunks) + len(row_chunks)]  # [chunk][formulation]
        if "dsinks" in names:
            in_float64 = done[len(row_chunks) + len(key_chunks):]
            exact = [sum(np.asarray(x[3]) for (g_c, _), x in zip(row_chunks, in_float64) if g_c == g)
                     for g in range(len(groups))]
            total = np.asarray(ref_grads["dsinks"], dtype=np.float64)[..., 0, 0]
        for f in range(len(FORMULATIONS)):
            add("dq", order, np.concatenate([np.asarray(x[f][0], dtype=np.float64) for x in by_rows], axis=-2))
            for t, n in enumerate(names[1:3], 1):
                add(n, keys, np.concatenate([np.asarray(x[f][t], dtype=np.float64) for x in by_keys], axis=-2))
            if "dsinks" in names:
                # each group's sum as the naive has it: its parts' sums (each left unrounded) added in
                # the accumulator's type, rounded once, whatever the split into parts
                parts = [[x[f][3] for (g_c, _), x in zip(row_chunks, by_rows) if g_c == g] for g in range(len(groups))]
                naive = [np.asarray(prec.round(functools.reduce(np.add, p, np.float32(0.0))), dtype=np.float64)
                         for p in parts]
                if all(np.isfinite(x).all() for x in naive):
                    # each group's error, scaled to the rows it stands for, and the naive's rounding
                    # of the whole sum to the type (which no part's scales to)
                    e = sum(w * np.abs(x - y) for w, x, y in zip(weights, naive, exact))
                    e = (e + np.abs(prec.round(total) - total))[..., None, None]
                    errs["dsinks"] = e if errs["dsinks"] is None else np.maximum(errs["dsinks"], e)
                    draws["dsinks"].append((None, e))
    return errs, draws


__all__ = ["naive_errors", "naive_gradient_errors", "spread", "naive_rows", "pool_axes", "sampled_ratio", "SAMPLE_ROWS", "SAMPLE_EVERY",
           "KEY_BY_KEY_ROWS", "KEY_BY_KEY_EVERY", "KERNEL_ROWS"]
