"""The verdict as the CLI prints it."""

from __future__ import annotations

import numpy as np

from .rule import FINAL_ROUNDINGS, TensorVerdict
from .shapes import where
from .verdict import KernelCheck


def _fmt(x):
    return "n/a" if x is None else f"{x:.2e}"


def _ratio(x):
    return "n/a" if x is None else ("inf" if x == float("inf") else f"{x:.3g}")


def _verdict_word(passed):
    return {True: "PASS", False: "FAIL", None: "INFO"}[passed]


def rule_text(dtype: str) -> str:
    """The rule in one line, for the kernel's precision."""
    if dtype == "float64":
        return ("rule: |kernel - ref| <= the float64 rounding bound of two correct implementations, "
                "per row (relative to P @ |V|; any tiling)")
    return (f"rule: |kernel - ref| <= (2 r + {FINAL_ROUNDINGS:g}) u per entry, u = an ulp of {dtype.split(' (')[0]} at the "
            "entry's size |ref| + sqrt(sum p^2 v^2) + w S sqrt(sum p^2 (v - ref)^2) (S: the row's score "
            "size, w: the state's epsilon over the type's), r = max over the tensor of |naive - ref| / u "
            f"(naive: plain attention in {dtype}); no 0.3-anchored atol")


def format_text(check: KernelCheck) -> str:
    """The verdict as the CLI prints it."""
    s, o = check.shape, check.options
    mask = "causal (" + o["causal_align"] + ")" if o["causal"] else "no causal mask"
    if o["window"] is not None:
        mask += f", window {o['window']}"
    def ints(x):
        return [int(n) for n in np.ravel(x)]

    # Each option given, as it reads: lengths by value, arrays by shape (a number 0: not given).
    shown = (("softcap", str), ("q_lengths", ints), ("kv_lengths", ints), ("sinks", np.shape), ("key_leftpad", ints),
             ("attention_chunk", str), ("sink_token_length", str), ("gather_kv_indices", np.shape))
    extras = [f"{n} {fmt(o[n])}" for n, fmt in shown
              if o.get(n) is not None and not (np.ndim(o[n]) == 0 and not o[n])]
    extras += [f"qv {tuple(o['qv'])} (MLA)" if o.get("qv") is not None else "",
               *(f"{n} {np.shape(o[n])}" for n in ("q_descale", "k_descale", "v_descale") if o.get(n) is not None),
               f"lse {o['lse_convention']}" if o.get("lse_convention") else "", o.get("layout_note", "")]
    dv = "" if s["dv"] == s["d"] else f" (v: {s['dv']})"
    lines = [
        "attnlib check: the kernel's output against attnlib's float64 reference",
        f"  batch {s['batch']}, seqlen_q {s['sq']}, seqlen_k {s['sk']}, heads {s['hq']} (kv heads "
        f"{s['hk']}), head dim {s['d']}{dv}; {mask}" + "".join(f", {e}" for e in extras if e),
        f"  kernel precision {check.dtype}; "
        + (f"allowance: {check.baseline}" if check.dtype == "float64" else f"naive baseline: {check.baseline}"),
        f"  {rule_text(check.dtype)}",
        "",
    ]
    for v in check.judged:
        lines += format_tensor(v)
        if v is check.out:
            lines.append(f"  error along the query position: {check.trend}")
            lines += [f"  diagnosis: {d}" for d in check.diagnosis]
        lines.append("")
    lines.append(f"verdict: {'PASS' if check.passed else 'FAIL'} (exit {check.exit_code})")
    return "\n".join(lines)


def _in_u(worst_entry, key) -> str:
    """`` (12.5 u)``: a worst entry's figure in ulps of its own size, where the rule has them."""
    return f" ({worst_entry[key]:.3g} u)" if key in worst_entry else ""


def format_tensor(v: TensorVerdict) -> list:
    naive = "" if v.naive_max is None else f", naive {_fmt(v.naive_max)}"
    ulps = "" if v.max_ulps is None else f"; largest err {v.max_ulps:.3g} u"
    lines = [f"{v.name}: {_verdict_word(v.passed)}  max |err| {_fmt(v.max_err)}{naive}, median "
             f"{_fmt(v.median_err)}; worst err / allowance {_ratio(v.ratio)}{ulps}"]
    if v.nonfinite:
        at = "; ".join(where(p) for p in v.nonfinite_at)
        lines.append(f"  {v.nan} NaN and {v.inf} inf values" + (f", first at {at}" if at else ""))
    lines += [f"  note: {n}" for n in v.notes]
    if len(v.heads) > 1:
        show_naive = any(h["naive_max"] is not None for h in v.heads)
        lines.append("  head   max |err|  median     " + ("naive max  " if show_naive else "")
                     + "err/allow  verdict")
        shown = v.heads if len(v.heads) <= 16 else sorted(v.heads, key=lambda h: -h["ratio"])[:16]
        for h in shown:
            lines.append(f"  {h['head']:<5}  {h['max']:.2e}   {h['median']:.2e}   "
                         + (f"{_fmt(h['naive_max'])}   " if show_naive else "")
                         + f"{_ratio(h['ratio']):<9}  {_verdict_word(h['passed'] if v.passed is not None else None)}")
        if len(v.heads) > 16:
            lines.append(f"  ({len(v.heads) - 16} more heads; the 16 worst shown)")
    if v.worst and (v.max_err > 0 or v.nonfinite):
        lines.append("  worst: " + "; ".join(
            f"{where(w)}: kernel {w['kernel']:.9g}, ref {w['ref']:.9g}, err {w['err']:.2e}" + _in_u(w, "ulps")
            + ("" if v.passed is None else f", allowance {w['allowance']:.2e}" + _in_u(w, "allowance_ulps"))
            for w in v.worst[:3]))
    return lines
