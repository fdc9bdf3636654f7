"""Why an output fails: NaN and inf, empty rows, alternatives it matches, where errors start.

Every finding is scored on rows (one query position of one head of one batch entry), so
that a cause explaining most of the failing rows is named with its fraction, and the
alternatives are tried on the batch entries that fail, not on the first one.

A diagnosis never turns a verdict into a traceback: each alternative runs the user's
``mask_mod``/``score_mod`` on another problem (other scales and masks, the failing batch
entries alone, the tensors read in the other layout, whose heads are the declared query
positions), and a function written for the problem as given may fail there (a table of
per-head slopes indexed by a head it does not have).  `guard_mods` wraps them so that
anything they raise is a `ModFailed`, and such an alternative is dropped (`DROPPED`); an
exception of attnlib's own code other than its ``ValueError``/``TypeError`` refusals still
propagates.  The failing entries' ``b`` is the entries' index in the problem as given.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import numpy as np

from ..core import arrays
from ..core import problem
from ..core.lse_conventions import LN2, NATURAL, LseConvention
from ..core.options import Options
from ..judge.gate import row_stats
from ..core.reference import dense_attention
from ..core.tiled import forward_on
from .rule import expect, per_head_max, ratios, row_masks
from .shapes import AXES, other_layout, positions, shape_problem, to_bhsd, where

#: At most this many failing batch entries are re-run under each alternative.
MAX_ENTRIES = 8
#: An alternative is named when it explains at least this fraction of the failing rows.
MIN_FRACTION = 0.5
#: A failure whose worst finite error is within this many allowances is called marginal.
MARGINAL = 4.0


class ModFailed(Exception):
    """The user's ``mask_mod``, ``score_mod`` or ``score_mod_grad`` raised while evaluated for
    an alternative problem (raised only by the wrappers of `guard_mods`, so never by a bug of
    attnlib's own)."""


#: What trying an alternative may raise and only drop it: attnlib's refusals of the
#: alternative's options or of what a mod returned there (ValueError, TypeError), and the
#: user's functions failing on the alternative's indices (ModFailed).
DROPPED = (ValueError, TypeError, ModFailed)

#: The user's functions among the options, and where their batch index ``b`` is (the
#: ``score_mod_grad`` beside them: `guard_grad`).
_MODS = (("mask_mod", 0), ("score_mod", 1))


def guard_mods(opts: Options, entries=None) -> Options:
    """``opts`` with the user's functions wrapped for an alternative problem: whatever
    they raise becomes `ModFailed` (the alternative is dropped, see `DROPPED`).  ``entries``:
    the batch entries of the problem as given that the alternative's batch axis holds, so
    that a function indexing a per-entry table (document ids) sees the right ``b``."""
    return replace(opts, **{name: _guarded(getattr(opts, name), name, b_at, entries)
                            for name, b_at in _MODS if getattr(opts, name) is not None})


def guard_grad(mod_grad, entries=None):
    """The ``score_mod_grad`` wrapped as `guard_mods` wraps the mods (None stays None)."""
    return None if mod_grad is None else _guarded(mod_grad, "score_mod_grad", 1, entries)


def _guarded(fn, name, b_at, entries):
    def guarded(*args):
        if entries is not None:
            args = args[:b_at] + (_take(entries, args[b_at]),) + args[b_at + 1:]
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the user's function, on another problem
            raise ModFailed(f"{name} raised {type(e).__name__}: {e}") from e

    # No functools.wraps; a `from_torch` wrapper's mark is kept, so that attnlib.core.flex calls
    # the guarded function as it would the user's (never retried with tensors).
    if getattr(fn, "_attnlib_torch_source", None) is not None:
        guarded._attnlib_torch_source = fn._attnlib_torch_source
    if getattr(fn, "_attnlib_neighbours", None) is not None:  # a mask's own neighbours (`_mask_neighbours`), guarded alike
        guarded._attnlib_neighbours = [(_guarded(f, name, b_at, entries), words) for f, words in fn._attnlib_neighbours]
    return guarded


def _take(entries, b):
    """``entries[b]`` for numpy index arrays and, through `attnlib.core.flex.from_torch`, tensors."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(b, torch.Tensor):
        return torch.as_tensor(entries, device=b.device)[b]
    return entries[np.asarray(b)]


def row_ratios(err, ratio, allowance):
    """``(Sq,)``: the worst finite ``err / allowance`` per query position, over batch,
    heads and dims, on entries with a positive allowance (NaN/inf and empty rows left out)."""
    finite = np.isfinite(ratio) & (np.broadcast_to(allowance, err.shape) > 0)
    r = np.where(finite, ratio, 0.0).max(axis=-1)  # (..., H, S)
    return r.reshape((-1, r.shape[-1])).max(axis=0) if r.ndim > 1 else r


def trend(row_ratio) -> str:
    """How the error runs along the query positions, in units of the allowance.

    Rounding spreads evenly along the positions (the allowance already follows the
    naive baseline's or the rounding bound's dependence on them); a bug shows as the
    worst ratio of the last eighth of the positions 10x that of the first, or the reverse.
    Ratios below 1e-3 count as 1e-3: far inside the allowance, noise.
    """
    if row_ratio.size < 16:
        return "too few query positions to tell"
    eighths = np.array_split(np.asarray(row_ratio), 8)
    first, last = (max(float(e.max()), 1e-3) for e in (eighths[0], eighths[-1]))
    words = f"error / allowance, worst per position: first eighth {first:.3g}, last eighth {last:.3g}"
    if max(first, last) <= 1 and float(np.max(row_ratio)) <= 1:
        return f"within the allowance at every position ({words})"
    if last >= 10 * first:
        return f"grows with the query position ({words})"
    if first >= 10 * last:
        return f"shrinks with the query position ({words})"
    return f"no trend ({words})"


def diagnose(kernel, qh, kh, vh, opts: Options, expected, ratio, shape, layout, given, prec,
             workers, device=None, mixups=()) -> list:
    """Likely causes of a failing ``out`` (``kernel``: bhsd, float64 values); ``device``: where
    the alternatives' references are computed with torch (None: the host); ``mixups``: the
    problem's inputs mishandled, an iterable of ``(words, (q, k, v), options)`` (fp8 descales,
    MLA's qv) read only as far as the first match."""
    found = []
    finite_row = np.isfinite(kernel).all(axis=-1)  # (..., H, S)
    row_bad = ratio.max(axis=-1, initial=0.0) > 1  # NaN/inf rows included (ratio inf)
    empty = expected.empty

    # NaN and inf, by name, and whether they sit in rows with no visible key.
    if not finite_row.all():
        nan = int(np.isnan(kernel).sum())
        inf = int(np.isinf(kernel).sum())
        rows = ~finite_row
        words = f"{nan} NaN and {inf} inf values in {int(rows.sum())} rows"
        if (rows <= empty).all():
            words += (": all in rows with no visible key, where the output must be 0 (typically "
                      "0 / 0 in the final normalisation: a row whose running sum l is 0)")
        elif (rows & empty).any():
            words += f" ({int((rows & empty).sum())} of them rows with no visible key)"
        if not (row_bad & finite_row).any():
            words += "; every finite row is within the allowance"
        found.append(words)

    # Empty rows holding something other than 0: the mask sentinel's signature.
    nonzero_empty = empty & finite_row & (kernel != 0).any(axis=-1)
    if nonzero_empty.any():
        words = (f"{int(nonzero_empty.sum())} rows without a visible key (every key masked for "
                 "them) are not 0, as the contract and FlashAttention's reference have them")
        if _rows_hold_mean_v(kernel, vh, nonzero_empty, prec):
            words += ("; they hold the mean of v over all keys: the kernel masks with a finite "
                      "value (e.g. -1e30 or the type's min) and then normalises a row of equal "
                      "scores; zero rows whose running max is still the mask value")
        found.append(words)

    # Alternatives, re-run on the batch entries that fail.
    todo = row_bad & finite_row & ~empty  # rows not already explained above
    worst = float(np.max(ratio.max(axis=-1, initial=0.0)[todo], initial=0.0))
    marginal = todo.any() and worst <= MARGINAL
    if marginal:
        found.append(f"marginal: the worst finite error is {worst:.3g}x its allowance, the size of "
                     "the differences between plain formulations of attention in this precision; a "
                     "correct kernel that sums or scales in yet another order can land here, while "
                     "the bugs the check looks for fail by orders of magnitude")
    if todo.any() and not marginal and prec.p_type is not None and prec.p_type.itemsize == 1:
        found += _normalised_weights(kernel, qh, kh, vh, opts, prec, expected)
    if todo.any():
        found += _input_mixups(kernel, mixups, prec, workers, device)
        found += _alternatives(kernel, qh, kh, vh, opts, todo, shape, expected, workers, device,
                               prec=prec)
        if not marginal:
            found += _tile_boundary(todo, qh, kh, opts, device)
    # The other layout, and axes swapped inside the output.
    other = other_layout(layout)
    if given["out"].ndim >= 3 and shape_problem(given, other)[0] is None:
        q1, k1, v1, kern1 = (to_bhsd(given[n], other).astype(np.float64) for n in ("q", "k", "v", "out"))
        # The mods as given: if the files are in the other layout, they were written for that
        # problem; one indexing a table by the declared heads fails here, and the reading with it.
        if _matches(kern1, q1, k1, v1, opts, prec, workers, device):
            found.append(f"read as --layout {other} {AXES[other]}, every tensor fits and the output "
                         f"passes: the files are in {other}, not {layout}")
    if shape["sq"] == shape["hq"] and given["out"].ndim >= 3:
        if _passes(np.swapaxes(kernel, -2, -3), expected.ref, expected.allowance):
            found.append(f"the output matches the reference with its seqlen and heads axes swapped: "
                         f"the kernel writes {other} {AXES[other]}, not {layout}")
    # One head, or a few.
    if kernel.ndim >= 3 and not marginal:
        head_bad = todo.reshape((-1,) + todo.shape[-2:]).any(axis=(0, 2))  # (H,): finite failures
        if 0 < head_bad.sum() < head_bad.size:
            found.append(f"only heads {np.flatnonzero(head_bad).tolist()} fail: look at the head "
                         "indexing (GQA mapping, strides)")
    if todo.any() and not marginal and len(found) == 0:
        found += _lower_precision(kernel, qh, kh, vh, opts, prec, workers, device)
    if not found:
        first = positions()(tuple(np.argwhere(row_bad)[0]) + (0,)) if row_bad.any() else None
        found.append("no known cause matched; see the worst positions and the error along the "
                     "query position" + (f" (first failing row: {_row_words(first)})" if first else ""))
    return found


#: Lower precisions a kernel may compute in without saying so (TF32 has float16's mantissa).
_LOWER = {"float64": ("float32",), "float32": ("bfloat16", "float16")}


def _lower_precision(kernel, qh, kh, vh, opts: Options, prec, workers, device=None) -> list:
    """Whether the output passes when judged as a kernel of a lower precision."""
    for name in _LOWER.get(prec.name, ()):
        try:
            low = problem.precision(name)
            problem.check_representable(low, q=qh, k=kh, v=vh)  # values beyond it: not that kernel
            q, k, v = (low.round(x).astype(np.float64) for x in (qh, kh, vh))
        except DROPPED:  # bfloat16 without ml_dtypes, inputs beyond float16's range (a mod failing: _matches)
            continue
        if _matches(kernel, q, k, v, opts, low, workers, device):
            tf32 = " (or TF32, whose 10-bit mantissa is float16's)" if name == "float16" else ""
            return [f"judged as a {name} kernel the output passes: the kernel computes in {name}{tf32}, "
                    f"not {prec.name}; check its input casts and matmul precision settings, or pass "
                    f"--dtype {name}"]
    return []


def _normalised_weights(kernel, qh, kh, vh, opts: Options, prec, expected) -> list:
    """Whether the output is plain attention with the *normalised* weights rounded to the fp8
    type of ``p`` (FlashAttention's ``attention_ref(intermediate_dtype=)`` order), or ``p`` rounded
    twice (before and after it is normalised), within the allowance: at long rows ``p ~ 1/Sk``
    falls among fp8's subnormals."""
    t = prec.p_type.name
    with np.errstate(over="ignore", invalid="ignore"):
        alts = [dense_attention(qh, kh, vh, opts, compute_dtype=prec, orders=(order,), check_finite=False)
                for order in ("softmax_first", "rounded_twice")]
    for alt, words in zip(alts, (f"the normalised weights p / l rounded to {t} before p @ v (the order of "
                                 "FlashAttention's attention_ref with intermediate_dtype)",
                                 f"p rounded to {t} twice: p = exp(s - m) rounded, divided by l, and rounded again")):
        alt = np.asarray(alt, dtype=np.float64)
        if np.isfinite(alt).all() and _passes(kernel, alt, expected.allowance):
            return [f"the output matches {words}: at long rows p ~ 1/Sk falls among {t}'s subnormals; round p = "
                    "exp(s - m) <= 1 once and divide by l after"]
    return []


def _row_words(p) -> str:
    return where({k: v for k, v in p.items() if k != "dim"})


def _rows_hold_mean_v(kernel, vh, rows, prec) -> bool:
    """Whether every row in ``rows`` equals the mean of v over all keys of its head."""
    if vh.shape[-2] == 0:
        return False
    mean = vh.mean(axis=-2)  # (..., Hk, Dv), broadcast along the rows
    if kernel.ndim >= 3:
        mean = np.repeat(mean, kernel.shape[-3] // mean.shape[-2], axis=-2)[..., None, :]  # GQA: (..., Hq, 1, Dv)
    tol = 4 * prec.eps * max(float(np.abs(vh).max(initial=0.0)), np.finfo(np.float64).tiny)
    return bool((np.abs(kernel - mean).max(axis=-1) <= tol)[rows].all())


def _alternatives(kernel, qh, kh, vh, opts: Options, todo, shape, expected, workers, device=None,
                  prec=None) -> list:
    """Other problems the failing rows match: scales, masks, alignment, padding.

    Each alternative's float64 reference is computed on the failing batch entries, and a
    row matches it when its error against it is within its head's largest allowance.  Another scale changes
    the size of every logit and so the rounding a correct kernel of that problem makes: with
    ``prec`` given, a scale alternative is judged by its own problem's allowance (`expect`),
    not the given one's (scale 1 at D = 32 has logits ~5.7x larger; judged by the given
    allowance, whether it matched depended on the CPU's BLAS kernels).
    """
    # The failing batch entries (at most MAX_ENTRIES), whole: causal alignment needs full rows.
    entries = None
    if kernel.ndim == 4:
        failing_entries = np.flatnonzero(todo.any(axis=(-1, -2)))
        entries = failing_entries[:MAX_ENTRIES]
    opts = guard_mods(opts, entries)  # b: the entry's index in the problem as given
    d = qh.shape[-1]
    s0 = opts.scale if opts.scale is not None else 1.0 / math.sqrt(d)
    log2e = 1.0 / math.log(2.0)
    alternatives = [
        (dict(scale=1.0), "scale 1 (the softmax scale is never applied)"),
        (dict(scale=1.0 / d), f"scale 1/D = {1.0 / d:.4g} instead of {s0:.4g} (the scale applied twice, or 1/D for 1/sqrt(D))"),
        (dict(scale=s0 * log2e), "scale x log2(e) (an exp2-based softmax given a pre-multiplied scale)"),
        (dict(scale=s0 / log2e), "scale / log2(e) (an exp2-based softmax without the log2(e) factor)"),
    ]
    default = 1.0 / math.sqrt(d)  # [q, qv]'s head dim with MLA: 1/sqrt(D + Dv)
    if opts.scale is not None and opts.scale != default:
        # The scale given (--scale 0.1768 for 1/sqrt(32)) is not the kernel's: its default, or applied twice.
        alternatives += [(dict(scale=default), f"the default scale 1/sqrt(D) = {default:.10g} (D + Dv with qv), "
                          f"not the scale given, {s0:.10g} (pass the kernel's exact scale, or none)"),
                         (dict(scale=s0 * s0), f"the scale given applied twice, {s0:.4g}^2 = {s0 * s0:.4g}")]
    if opts.causal:
        alternatives.append((dict(causal=False), "no causal mask"))
        alternatives.append((dict(causal=False, window=(opts.window[0], 1)),
                             "a causal mask that lets each query see one future key (off by one)"))
        if shape["sq"] != shape["sk"]:
            other = "top_left" if opts.causal_align == "bottom_right" else "bottom_right"
            alternatives.append((dict(causal_align=other), f"causal alignment {other} instead of {opts.causal_align}"))
    else:
        alternatives.append((dict(causal=True), "a causal mask (bottom_right) that was not asked for"))
    if opts.kv_lengths is not None:
        alternatives.append((dict(kv_lengths=None), "kv_lengths ignored (padding keys attended)"))
    if opts.softcap is not None and (opts.causal or opts.window != (None, None)):
        alternatives.append((_softcap_after_mask(opts, shape),
                             "the softcap applied after masking (masked pairs get -softcap, not -inf)"))
    if opts.mask_mod is not None:
        alternatives += _mask_neighbours(opts.mask_mod, shape["sq"], shape["sk"])

    # A row's allowance follows its own problem's spread of values (a row of one visible key
    # has no score term, 0 with none); under an alternative it may see other keys: each row
    # is matched within its head's largest allowance.
    allowance = np.broadcast_to(per_head_max(expected.allowance), kernel.shape)
    scope = ""
    if entries is not None:
        if failing_entries.size > entries.size:
            scope = f" in the first {entries.size} failing batch entries (of {failing_entries.size})"
        taken = {}
        for key in ("kv_lengths", "q_lengths", "key_leftpad"):  # per batch entry: those of the failing entries
            if getattr(opts, key) is not None:
                taken[key] = np.broadcast_to(np.ravel(getattr(opts, key)), (shape["batch"],))[entries]
        if opts.sinks is not None and np.ndim(opts.sinks) == 2:  # (batch, H)
            taken["sinks"] = opts.sinks[entries]
        if opts.gather_kv_indices is not None:  # (batch, [Hk,] Sq, topk)
            taken["gather_kv_indices"] = np.asarray(opts.gather_kv_indices)[entries]
        opts = replace(opts, **taken)
    alternatives += variant_alternatives(opts, shape["sk"])  # (with the failing entries' own key_leftpad)
    q, k, v, kern, failing, allow = (x if entries is None else x[entries]
                                     for x in (qh, kh, vh, kernel, todo, allowance))
    n_fail = int(failing.sum())
    scored = []
    for change, words in alternatives:
        try:  # the change checked as the user's options are (a scale x log2(e) beyond the range)
            if prec is not None and set(change) == {"scale"}:  # judged by its own problem's allowance
                judged = expect(q, k, v, opts.replace(**change), prec, workers, device=device, pool="head")
                alt, alt_allow = judged.ref, np.broadcast_to(per_head_max(judged.allowance), kern.shape)
            else:
                alt, alt_allow = forward_on(q, k, v, opts.replace(**change), workers=workers, device=device), allow
        except DROPPED:  # e.g. a mask_mod that indexes past its ids at q_idx + 1
            continue
        row_ok = ratios(kern, alt, alt_allow)[1].max(axis=-1, initial=0.0) <= 1
        hits = int((failing & row_ok).sum())
        if row_ok.all():
            scored.append((2.0, f"the output matches attention with {words}{scope}"))
        elif hits == n_fail:
            scored.append((1.5, f"every failing row{scope} ({n_fail}) matches attention with {words}; "
                                "the passing rows do not (the defect is confined to the failing rows)"))
        elif hits >= MIN_FRACTION * n_fail:
            miss = np.argwhere(failing & ~row_ok)[0]
            p = positions()(tuple(miss) + (0,))
            if entries is not None:
                p["batch"] = int(entries[p["batch"]])
            scored.append((hits / n_fail,
                           f"{hits / n_fail:.0%} of the failing rows{scope} ({hits} of {n_fail}) match "
                           f"attention with {words}; the others do not (e.g. {_row_words(p)})"))
    # A problem that explains every failing row makes the partial explanations noise: left out.
    whole = any(score >= 1.5 for score, _ in scored)
    return [words for score, words in sorted(scored, key=lambda s: -s[0]) if score >= 1.5 or not whole]


def _input_mixups(kernel, candidates, prec, workers, device=None) -> list:
    """The first of ``candidates`` (``(words, (q, k, v), options)``: the inputs mishandled)
    whose attention the output matches, whole, by the rule's allowance for that problem (its
    values' sizes differ)."""
    for words, (q, k, v), opts in candidates:
        if _matches(kernel, q, k, v, opts, prec, workers, device):
            return [f"the output matches attention with {words}"]
    return []


def variant_alternatives(opts: Options, sk=None) -> list:
    """``(change, words)``: the 2026 variants a kernel may have dropped or misplaced (left
    padding, chunks, sink tokens, top-k lists: with ``sk``, the keys, their -1 entries
    wrapped or clamped), for the options given."""
    alts = []
    if opts.key_leftpad is not None:
        alts.append((dict(key_leftpad=None), "key_leftpad ignored (the left padding attended, positions from key 0)"))
        if opts.attention_chunk is not None or opts.sink_token_length or opts.causal_align == "top_left":
            # (else the same problem: bottom_right's offset does not depend on where keys start)
            hide = (dict(gather_kv_indices=_lists_from_leftpad(opts)) if opts.gather_kv_indices is not None
                    else dict(mask_mod=_hide_keys_before(opts)))  # top-k lists take no mask_mod: ANDed in
            alts.append((dict(key_leftpad=None, **hide),
                         "key_leftpad masked but positions counted from key 0 (not from the first valid key)"))
    if opts.attention_chunk is not None:
        alts.append((dict(attention_chunk=None), "attention_chunk ignored (no chunks)"))
    if opts.sink_token_length and opts.window[0] is not None:
        alts.append((dict(sink_token_length=0), "sink_token_length ignored (the sink tokens slid out of the window)"))
    if opts.gather_kv_indices is not None:
        indices = np.asarray(opts.gather_kv_indices).astype(np.int64)  # int8 lists: + Sk fits
        alts.append((dict(gather_kv_indices=None), "gather_kv_indices ignored (every key attended; "
                     "FlashAttention's test reference skips the mask when topk >= Sk)"))
        if sk is not None and ((indices < 0) & (indices >= -sk)).any():
            wrapped = np.where((indices < 0) & (indices >= -sk), indices + sk, indices)
            alts.append((dict(gather_kv_indices=wrapped), "the -1 entries read as key Sk - 1 (a negative "
                         "index wrapped around, as Python's indexing does), not as no key"))
        if sk is not None and (indices < 0).any():
            alts.append((dict(gather_kv_indices=np.where(indices < 0, 0, indices)),
                         "the -1 entries read as key 0 (clamped), not as no key"))
        if sk is not None and (indices >= sk).any():
            alts.append((dict(gather_kv_indices=np.where(indices >= sk, sk - 1, indices)),
                         "the entries past the keys (>= Sk) read as key Sk - 1 (clamped), not as no key"))
    return alts



def _hide_keys_before(opts: Options):
    """A ``mask_mod`` hiding each entry's keys before its ``key_leftpad`` (AND the problem's
    own ``mask_mod``): the padding without the shift of positions."""
    pad = np.asarray(opts.key_leftpad).reshape(-1)
    own = opts.mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx >= pad[b]
        return keep if own is None else keep & own(b, h, q_idx, kv_idx)

    return mask_mod


def _lists_from_leftpad(opts: Options) -> np.ndarray:
    """The top-k lists ``gather_kv_indices`` without the keys before each entry's
    ``key_leftpad`` (-1 in their place): `_hide_keys_before` for lists, which take no
    ``mask_mod``.  The lists' leading axes are the batch axes of ``key_leftpad``."""
    indices = np.asarray(opts.gather_kv_indices).astype(np.int64)
    pad = np.asarray(opts.key_leftpad).astype(np.int64)
    pad = pad.reshape(pad.shape + (1,) * (indices.ndim - pad.ndim))
    return np.where(indices < pad, -1, indices)


def _softcap_after_mask(opts: Options, shape) -> dict:
    """The change to ``opts`` that turns the mask into ``-cap`` scores after the softcap, as a
    kernel that caps the masked scores does (``c tanh(-inf / c) = -c``)."""
    cap = float(opts.softcap)
    o = shape["sk"] - shape["sq"] if opts.causal_align == "bottom_right" else 0
    left, right = opts.window
    right = 0 if opts.causal else right
    user = opts.score_mod  # the problem's own, on the capped scores (attnlib's order)

    def score_mod(score, b, h, i, j):
        vis = np.ones(np.broadcast(i, j).shape, dtype=bool)
        if left is not None:
            vis &= j >= i + o - left
        if right is not None:
            vis &= j <= i + o + right
        return np.where(vis, score if user is None else np.asarray(user(score, b, h, i, j)), -cap)
    return dict(causal=False, window=(None, None), score_mod=score_mod)


def _mask_neighbours(mask_mod, sq, sk) -> list:
    """``(change, words)``: a ``mask_mod`` off by one key or query, or one key narrower or
    wider at either edge of its runs of visible keys (a window or document one key off), and the
    mask's own neighbours (``_attnlib_neighbours``), else, where ``sq == sk``, transposed."""
    def clip(x, top):  # in the index's own kind: numpy's, or torch's on a device path
        return x.clamp(0, top) if hasattr(x, "clamp") else np.clip(x, 0, top)

    def at(di, dj):  # mask_mod at shifted positions, clipped into the problem
        return lambda b, h, i, j: np.asarray(mask_mod(b, h, clip(i + di, max(sq - 1, 0)),
                                                      clip(j + dj, max(sk - 1, 0))), dtype=bool)

    def both(f, g, op):
        return lambda b, h, i, j: op(np.asarray(f(b, h, i, j), dtype=bool), g(b, h, i, j))

    same = at(0, 0)
    # The mask's own neighbours (block-sparse lists read transposed, `block_sparse`; a KV source
    # left out or its mask ignored, `sources`), else, on square problems, q_idx and kv_idx swapped
    own = getattr(mask_mod, "_attnlib_neighbours", None)
    transposed = ([(dict(mask_mod=fn), words) for fn, words in own] if own is not None else [] if sq != sk else
                  [(dict(mask_mod=lambda b, h, i, j: np.asarray(mask_mod(b, h, j, i), dtype=bool)),
                    "the mask transposed (q_idx and kv_idx swapped)")])
    return transposed + [
        (dict(mask_mod=at(0, -1)), "mask_mod at kv_idx - 1 (the mask one key to the right: an off-by-one key index)"),
        (dict(mask_mod=at(0, 1)), "mask_mod at kv_idx + 1 (the mask one key to the left: an off-by-one key index)"),
        (dict(mask_mod=at(-1, 0)), "mask_mod at q_idx - 1 (an off-by-one query index, e.g. document ids shifted)"),
        (dict(mask_mod=at(1, 0)), "mask_mod at q_idx + 1 (an off-by-one query index, e.g. document ids shifted)"),
        (dict(mask_mod=both(same, at(0, -1), np.logical_and)),
         "the mask one key narrower on the left of each run of visible keys (a window or document one key short)"),
        (dict(mask_mod=both(same, at(0, 1), np.logical_and)),
         "the mask one key narrower on the right of each run of visible keys"),
        (dict(mask_mod=both(same, at(0, -1), np.logical_or)),
         "the mask one key wider on the right of each run of visible keys (a window or document one key long)"),
        (dict(mask_mod=both(same, at(0, 1), np.logical_or)),
         "the mask one key wider on the left of each run of visible keys"),
    ]


def _tile_boundary(todo, qh, kh, opts: Options, device=None) -> list:
    """Rows that see at most T keys pass and rows that see a few more than T fail (T a power
    of two): the error comes from combining key tiles.  Counts visible keys per row, so rows
    with none and problems where every row sees the same keys never trigger it."""
    n_vis = row_stats(qh, kh, options=row_masks(opts), device=device)[1]  # (..., H, S)
    seen = n_vis > 0
    bad_counts = n_vis[todo & seen]
    if not bad_counts.size:
        return []
    first = int(bad_counts.min())
    tile = 1 << ((first - 1).bit_length() - 1) if first > 1 else 0  # the largest power of two < first
    if tile < 16 or first - tile >= tile // 2:
        return []
    short = seen & (n_vis <= tile)
    if not short.any() or (todo & short).any():
        return []
    return [f"every row that sees at most {tile} keys is within the allowance, and the failing rows "
            f"see more (the first ones {first}): rows whose keys fit in one tile of {tile} are right, so "
            "the error comes from combining key tiles (e.g. a missing rescale of the running sum "
            "and output when a later tile raises the row max)"]


__all__ = ["diagnose", "trend", "row_ratios", "guard_mods", "guard_grad", "ModFailed", "DROPPED"]


# -- gradients and the LSE ------------------------------------------------------------------------

def _passes(kernel, ref, allowance) -> bool:
    return bool(ratios(kernel, ref, allowance)[1].max(initial=0.0) <= 1)


def _matches(kernel, q, k, v, opts: Options, prec, workers, device=None) -> bool:
    """Whether ``kernel`` passes as a kernel in ``prec`` of the problem ``q, k, v, opts`` (its
    mods guarded), by that problem's own allowance; False where the problem is dropped."""
    try:
        alt = expect(q, k, v, guard_mods(opts), prec, workers, device=device, pool="head")
    except DROPPED:
        return False
    return _passes(kernel, alt.ref, alt.allowance)


def _head_swap(kernel, ref, allowance):
    """Heads of ``kernel`` that hold another head's ``ref``: ``[(h, other), ...]``."""
    if kernel.ndim < 3 or kernel.shape[-3] < 2:
        return []
    allowance = np.broadcast_to(allowance, kernel.shape)
    found = []
    for h in range(kernel.shape[-3]):
        if _passes(kernel[..., h, :, :], ref[..., h, :, :], allowance[..., h, :, :]):
            continue
        for other in range(kernel.shape[-3]):
            if other != h and _passes(kernel[..., h, :, :], ref[..., other, :, :], allowance[..., other, :, :]):
                found.append((h, other))
                break
    return found


def diagnose_gradient(name, kernel, ref, allowance, scale, alternatives=(), prec_name=None) -> list:
    """Likely causes of a failing gradient ``name`` (``kernel``, ``ref``, ``allowance``:
    bhsd float64).  ``alternatives``: ``(words, ref_of_that_problem)`` pairs, the dense
    gradients of other problems (no causal mask, another scale, ...) to match against;
    ``prec_name``: the precision the kernel was judged in (a gradient rounded to a lower
    one is named)."""
    if not np.isfinite(kernel).all():
        return [f"{name} holds {int(np.isnan(kernel).sum())} NaN and {int(np.isinf(kernel).sum())} inf values"]
    if not kernel.any() and ref.any():
        return [f"{name} is all zeros: the gradient was never written or accumulated"]
    if _passes(-kernel, ref, allowance):
        return [f"{name} has the wrong sign: it matches -{name} (e.g. ds = p (D - dp), or the loss's sign)"]
    if name in ("dq", "dk") and scale not in (0.0, 1.0):
        if _passes(kernel * scale, ref, allowance):
            return [f"{name} is missing the softmax scale: it matches {name} / scale (scale = {scale:.4g})"]
        if _passes(kernel / scale, ref, allowance):
            return [f"{name} carries the softmax scale twice: it matches {name} * scale (scale = {scale:.4g})"]
    # Another problem's gradient has other sizes: matched within the head's largest allowance.
    loose = np.broadcast_to(per_head_max(np.broadcast_to(allowance, kernel.shape)), kernel.shape)
    for words, alt in alternatives:
        if alt is not None and alt.shape == kernel.shape and _passes(kernel, alt, loose):
            return [f"{name} matches the gradient of attention with {words}"]
    swaps = _head_swap(kernel, ref, allowance)
    if swaps:
        axis = "kv head" if name in ("dk", "dv") else "head"
        return ["; ".join(f"{name} of {axis} {h} holds {axis} {o}'s gradient" for h, o in swaps)
                + ": look at the head indexing (the GQA mapping, strides)"]
    dot = float(np.vdot(ref, ref))
    if dot > 0:
        c = float(np.vdot(kernel, ref)) / dot  # the best single factor
        if c != 1.0 and _passes(kernel / c, ref, allowance):
            return [f"{name} is the right gradient times {c:.9g} (off by a relative {c - 1:+.3g} "
                    "throughout): a factor applied once too often, or a constant rounded"]
    lower = []
    for low in _LOWER.get(prec_name, ()):
        try:
            lower.append((low, arrays.finfo(problem.precision(low).compute)))
        except ValueError:  # bfloat16 without ml_dtypes
            continue
    err, ratio = ratios(kernel, ref, np.broadcast_to(allowance, ref.shape))
    failing = ratio > 1
    for low, fi in sorted(lower, key=lambda x: float(x[1].eps)):  # the finest type that explains it
        # The right gradient rounded to the lower type is off by half an ulp of it, plus rounding.
        half_ulp = 0.5 * (float(fi.eps) * np.abs(ref) + float(fi.smallest_subnormal))
        rounded = 2 * half_ulp + np.broadcast_to(allowance, ref.shape)
        # The story needs errors of that type's size where it fails, not far below its ulp.
        sized = failing.any() and float(np.median((err / half_ulp)[failing])) >= 0.05
        if sized and _passes(kernel, ref, rounded):
            tf32 = " (or TF32, whose 10-bit mantissa is float16's)" if low == "float16" else ""
            return [f"{name} is the right gradient to within {low}'s rounding{tf32}: it was stored, "
                    f"accumulated or computed in {low}, not {prec_name}"]
    bad = ratio.max(axis=-1) > 1  # (..., H, S)
    if kernel.ndim >= 3:
        heads = np.flatnonzero(bad.reshape((-1,) + bad.shape[-2:]).any(axis=(0, 2)))
        if 0 < heads.size < bad.shape[-2]:
            return [f"only heads {heads.tolist()} of {name} fail: look at the head indexing"]
    return []


def diagnose_max_scores(kernel, ref, allowance, opts: Options, convention: LseConvention, scale) -> list:
    """Names for a failing ``max_scores``: the first neighbour the kernel matches on every row
    that sees a key, as stored (in the base told), by the allowance: the other base, the sink
    taken as a score (a running max started at the sink), the scores before the scale."""
    kernel = np.asarray(kernel, dtype=np.float64).reshape(ref.shape)
    seen = ~np.isneginf(ref)
    f = convention.factor
    other = 1.0 if f != 1.0 else LN2
    # (values as stored, their allowance's factor, words): each neighbour's error scales with it.
    candidates = [(ref / other, 1 / other, f"max_scores in base {'e' if other == 1.0 else '2'} (told base "
                                           f"{'2' if f != 1.0 else 'e'}: lse_base)")]
    if opts.sinks is not None:
        sink = np.broadcast_to(np.asarray(opts.sinks, dtype=np.float64), ref.shape[:-1])[..., None]
        candidates.append((np.maximum(ref, sink) / f, 1 / f, "the sink taken as a score (the running max "
                                                             "started at the sink, not the keys' own max)"))
    if scale not in (0.0, 1.0) and opts.softcap is None and opts.alibi_slopes is None and opts.score_mod is None:
        candidates.append((ref / scale / f, 1 / abs(scale * f), "the scores before the scale (q . k, not scale q . k)"))
    for cand, factor, words in candidates:
        with np.errstate(over="ignore", invalid="ignore"):
            ok = np.abs(kernel - cand) <= allowance * factor
        if seen.any() and ok[seen].all():
            return [f"diagnosis: the max_scores match {words}"]
    return []


def diagnose_lse(kernel, ref, allowance, empty, alternatives=(), convention: LseConvention = NATURAL,
                 other_sink=None) -> list:
    """Likely causes of a failing ``lse`` (``(..., H, S)``, float64 as the kernel stored it;
    ``empty``: rows with no visible key).  ``convention``: the one it was told to follow;
    ``alternatives``: ``(words, lse_of_that_problem)`` pairs; ``other_sink``: the reference
    LSE with the sink's place swapped (excluded for included, and back), when there are sinks."""
    found = []
    told = convention.empty
    if told is not None and (empty & (kernel == -told)).any():
        other = "+inf (FlashAttention's convention)" if told < 0 else "-inf (attnlib's and PyTorch's convention)"
        found.append(f"rows without a visible key hold {other}: pass lse_empty="
                     f"'{'+inf' if told < 0 else '-inf'}' if that is the kernel's convention (or leave "
                     "lse_empty out to accept either)")
    seen = ~empty & np.isfinite(kernel)
    if not seen.any():
        return found
    k, r = np.where(seen, kernel, 0.0), np.where(seen, ref, 0.0)
    a = np.where(seen, np.broadcast_to(allowance, kernel.shape), np.inf)

    def fits(x, y):
        return bool((np.abs(x - y) <= a)[seen].all())

    f = convention.factor
    natural = k * f  # the kernel's lse read as it was told
    if fits(natural, r):  # the rows that see a key are right: only the empty rows' value is wrong
        return found
    if f == 1.0 and fits(k * LN2, r):
        return found + ["the lse is in base 2 (log2 of the row's sum, FlashInfer's and JAX Pallas's "
                        "convention): times ln 2 it matches; pass lse_base=2 (--lse-base 2) if that is "
                        "the kernel's convention: a base-2 lse fed into a natural-log merge weights the "
                        "partials wrongly"]
    if f == 1.0 and fits(k / LN2, r):
        return found + ["the lse is the natural one times ln 2 (a base-2 lse converted the wrong way)"]
    if f != 1.0 and fits(k, r):
        return found + ["the lse is the natural log (base e), not base 2 as told (lse_base=2): leave "
                        "lse_base out if that is the kernel's convention"]
    if other_sink is not None:
        o = np.where(seen, other_sink, 0.0)
        for reading, base_words, base_arg in (
                (natural, "", ""),
                (k * (LN2 if f == 1.0 else 1.0), " in base 2" if f == 1.0 else " in base e",
                 " and lse_base=2" if f == 1.0 else " and lse_base left out")):
            if fits(reading, o):
                if convention.sink == "included":
                    words = ("the lse excludes the sink (FlashMLA's convention: the keys' log-sum-exp "
                             f"only){base_words}; pass lse_sink='excluded' (--lse-sink excluded){base_arg} "
                             "if that is the kernel's convention")
                else:
                    words = ("the lse includes the sink (FlashAttention 4's convention, lse_sink="
                             f"'included', the default){base_words}, not excluded as told{base_arg and ';'}"
                             f"{base_arg.replace(' and ', ' ') if base_arg else ''}")
                return found + [words]
    for words, alt in alternatives:
        if alt is not None and alt.shape == kernel.shape and fits(natural, np.where(seen, alt, 0.0)):
            return found + [f"the lse matches that of attention with {words}"]
    if kernel.shape[-1] > 1:
        for shift, words in ((1, "previous"), (-1, "next")):
            rolled = np.roll(r, shift, axis=-1)
            close = (np.abs(natural - rolled) <= a) & seen
            interior = seen.copy()
            interior[..., 0 if shift == 1 else -1] = False
            if interior.any() and close[interior].mean() >= 0.9:
                return found + [f"each row holds the {words} query row's lse (an off-by-one row index or stride)"]
    return found
