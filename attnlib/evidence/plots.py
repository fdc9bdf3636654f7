"""Figures and tables for the evidence notebooks.

Each function returns a matplotlib ``Figure`` (closed from pyplot, so a notebook shows it
once, as the cell's value) or a `Table` (shown as HTML).  matplotlib is imported here
only, so ``import attnlib`` does not need it.
"""

from __future__ import annotations

import html
import math

import numpy as np

from ..core.masks import FULL, PARTIAL, SKIP, TILE_KIND_NAMES
from ..judge.metrics import BOUND, log10_histogram

MIB = 2**20


def _figure(*args, **kwargs):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(*args, **kwargs)
    plt.close(fig)  # shown once, as the cell's value, not again by the inline backend
    return fig, ax


#: A table with more rows shows `SHOWN` of them (the worst first, where it says how) and
#: keeps all of them in a collapsed section under it.
SHOWN = 15


class Table:
    """Rows of dicts shown as an HTML table (``_repr_html_``) or Markdown (``str``).

    Longer than `SHOWN` rows, the HTML shows a summary line and `SHOWN` rows, the first or,
    with ``worst`` (a column, or a key function of a row), the largest by it, and holds every
    row in a collapsed ``<details>`` section.  With ``summary`` (text) instead, a long table
    shows that line only, and every row once, in the collapsed section: for a table with no
    rows worth picking out, such as a run's parameters.
    """

    def __init__(self, rows, columns, formats=None, title=None, worst=None, summary=None):
        self.rows, self.columns = list(rows), list(columns)
        self.formats = formats or {}
        self.title, self.worst, self.summary = title, worst, summary

    def _cell(self, row, col):
        value = row.get(col, "")
        fmt = self.formats.get(col)
        if value is None:
            return "n/a"
        if fmt is None:
            return f"{value:,}" if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else str(value)
        return fmt(value) if callable(fmt) else format(value, fmt)

    def _repr_html_(self):
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        def td(row, col):
            value = row.get(col, "")
            align = "right" if isinstance(value, (int, float, np.number)) else "left"
            return f'<td style="text-align: {align}">{html.escape(self._cell(row, col))}</td>'

        def table(rows, caption=""):
            body = "".join("<tr>" + "".join(td(r, c) for c in self.columns) + "</tr>" for r in rows)
            caption = f"<caption>{html.escape(caption)}</caption>" if caption else ""
            return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        if len(self.rows) <= SHOWN:
            return table(self.rows, self.title or "")
        title = f"{self.title}: " if self.title else ""
        every = (f"<details><summary>all {len(self.rows):,} rows"
                 f"{' of ' + html.escape(self.title) if self.title else ''}</summary>{table(self.rows)}</details>")
        if self.summary is not None:  # the line, and every row once, collapsed
            return f"<p><b>{html.escape(title + self.summary)}</b></p>{every}"
        if self.worst is None:
            shown, which = self.rows[:SHOWN], f"the first {SHOWN}"
        else:
            key = self.worst if callable(self.worst) else (lambda r, c=self.worst: _sort_value(r.get(c)))
            shown = sorted(self.rows, key=key, reverse=True)[:SHOWN]
            which = (f"the {SHOWN} largest by {self.worst}" if not callable(self.worst)
                     else f"the {SHOWN} worst")
        return table(shown, f"{title}{len(self.rows):,} rows; {which} shown, every row in the section below") + every

    def __str__(self):
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(self._cell(r, c) for c in self.columns) + " |" for r in self.rows]
        return "\n".join(lines)


def _sort_value(x):
    """A table cell as a sort key: numbers by value (None, text and NaN first)."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.number)) or x != x:
        return -math.inf
    return float(x)


FORWARD_ERRORS = {
    "rel_error": "rel_error: |out - ref| / (P @ |V|)",
    "normwise_error": "normwise: max|out - ref| / max|ref|",
    "naive_rel_error": "naive elementwise |out - ref| / |ref|",
}
GRADIENT_ERRORS = {
    "dq_error": "dq: |dq - ref| / (what it sums)",
    "dk_error": "dk: |dk - ref| / (what it sums)",
    "dv_error": "dv: |dv - ref| / (what it sums)",
}


def error_histogram(rows, bound=BOUND, series=None, lo=-18.0, hi=-6.0, title=None):
    """Histogram of per-case errors on a log10 axis, with the bound drawn.

    ``series`` maps a key of the ``rows`` dicts to its legend label (default
    `FORWARD_ERRORS`: the gate ``rel_error`` filled, the others as outlines).  The legend sits
    beside the axes, so that it covers neither the bars nor the bound's line.
    """
    series = FORWARD_ERRORS if series is None else series
    fig, ax = _figure(figsize=(11, 4.2))
    styles = [dict(alpha=0.75), dict(histtype="step", lw=2), dict(histtype="step", lw=2, ls="--")]
    for (key, label), style in zip(series.items(), styles):
        edges, counts = log10_histogram([r[key] for r in rows], lo, hi)
        ax.hist(edges[:-1], bins=edges, weights=counts, label=label, **style)
    ax.axvline(math.log10(bound), color="crimson", lw=2, label=f"the contract's bound, {bound:.0e}")
    ax.set(xlabel="log10(error)   (exact 0 and values below 1e-18 are counted in the first bin)", ylabel="cases",
           title=title or f"Tiled vs dense float64 reference, {len(rows)} random shapes")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: off the bars and the bound
    fig.tight_layout()
    return fig


def gate_power(rows, defects):
    """Each case's ratio to the gate (error / tolerance, the larger of out and lse), for the
    real kernel and for each injected defect, on a log10 axis with the gate at 1.

    ``rows``: `~attnlib.evidence.differential.run_case` (or `run_family`) rows with a
    ``"defects"`` entry, of every run the defects ran on (a defect absent from a row's entry
    did not run there and is not counted on it).  A defect is drawn only on the cases it changes
    (beyond float64's resolution there, `~attnlib.evidence.differential.defect_changed`):
    on the others it is the real kernel, already drawn, and would show a "pass" it never
    earned; each defect's label counts the cases it changes.  A ratio of 0 or inf is drawn at
    the axis edge.
    """
    from matplotlib.lines import Line2D
    from .differential import defect_changed

    lo, hi = -6.0, 16.0
    labels, points = ["real kernel"], [[(r, r) for r in rows]]
    for name in defects:
        ran = [(r, r["defects"][name]) for r in rows if name in r.get("defects", {})]
        changed = [(r, j) for r, j in ran if defect_changed(r, j)]
        labels.append(f"{name} ({len(changed)}/{len(ran)} changed)")
        points.append(changed)
    fig, ax = _figure(figsize=(8, 0.42 * len(labels) + 1.4))
    for y, pairs in enumerate(points):
        for _, j in pairs:
            ratio = max(j["out_ratio"], j["lse_ratio"])
            with np.errstate(divide="ignore"):
                x = float(np.clip(np.log10(ratio), lo, hi))
            ax.plot(x, y, "o", ms=4, alpha=0.6, color="tab:green" if ratio <= 1 else "crimson")
    ax.axvline(0.0, color="black", lw=1.5)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlim=(lo - 0.3, hi + 0.3), xlabel="log10(error / gate tolerance), per case")
    ax.set_title(f"The gate's power: the real kernel and {len(defects)} injected defects, {len(rows)} cases\n"
                 "(a defect on the cases it changes only)", fontsize=10)
    handles = [Line2D([], [], color="black", lw=1.5, label="gate: error = tolerance"),
               Line2D([], [], marker="o", ls="", color="tab:green", label="passes the gate"),
               Line2D([], [], marker="o", ls="", color="crimson", label="fails the gate (caught)"),
               Line2D([], [], ls="", label="cases a defect leaves unchanged: not drawn"),
               Line2D([], [], ls="", label=f"ratio 0 drawn at 1e{lo:.0f}, above 1e{hi:.0f} (or inf) at 1e{hi:.0f}")]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return fig


def _tile_classes(ax, kinds):
    """SKIP / PARTIAL / FULL tiles drawn grey / orange / green on ``ax``."""
    from matplotlib.colors import ListedColormap

    return ax.imshow(kinds, cmap=ListedColormap(["#f0f0f0", "#f4a261", "#2a9d8f"]), vmin=-0.5, vmax=2.5,
                     interpolation="nearest")


def tile_map(tile_kind, title="Tile classes"):
    """SKIP / PARTIAL / FULL map over (query tile, key tile)."""
    fig, ax = _figure(figsize=(5, 4.5))
    im = _tile_classes(ax, tile_kind)
    cbar = fig.colorbar(im, ax=ax, ticks=[SKIP, PARTIAL, FULL])
    cbar.ax.set_yticklabels([TILE_KIND_NAMES[k] for k in (SKIP, PARTIAL, FULL)])
    ax.set(xlabel="key tile", ylabel="query tile")
    counts = {TILE_KIND_NAMES[k]: int(np.count_nonzero(tile_kind == k)) for k in (SKIP, PARTIAL, FULL)}
    ax.set_title(f"{title}\n" + ", ".join(f"{k} {v}" for k, v in counts.items()), fontsize=10)
    return fig


def tile_map_grid(maps: dict, columns=5):
    """Several SKIP / PARTIAL / FULL maps side by side, ``{title: (n_q_tiles, n_k_tiles)}``."""
    rows = -(-len(maps) // columns)
    fig, axes = _figure(rows, columns, figsize=(2.6 * columns, 3.3 * rows), squeeze=False)
    for ax, (title, kinds) in zip(axes.flat, maps.items()):
        _tile_classes(ax, kinds)
        skipped = float(np.mean(kinds == SKIP)) if kinds.size else 0.0
        ax.set_title(f"{title}\n{skipped:.0%} SKIP", fontsize=9)
        ax.set(xticks=[], yticks=[])
        ax.set_xlabel(f"key tile (0..{kinds.shape[-1] - 1})", fontsize=8)
        ax.set_ylabel(f"query tile (0..{kinds.shape[0] - 1})", fontsize=8)
    for ax in list(axes.flat)[len(maps):]:
        ax.axis("off")
    fig.suptitle("Tile classes (grey SKIP, orange PARTIAL, green FULL); rows: query tiles, columns: key tiles",
                 fontsize=10)
    fig.tight_layout()
    return fig


def rescale_heatmaps(panels: dict, tile_kind=None, columns=2):
    """Per-tile rescale counts, one heatmap per entry of ``panels`` (title -> counts).

    SKIP tiles (from ``tile_kind``) are left blank: they are never processed.
    """
    n = len(panels)
    cols = min(columns, n)
    rows = -(-n // cols)
    fig, axes = _figure(rows, cols, figsize=(5.2 * cols, 4.4 * rows), squeeze=False)
    skipped = None if tile_kind is None else np.asarray(tile_kind) == SKIP
    for ax, (title, counts) in zip(axes.flat, panels.items()):
        data = np.asarray(counts, dtype=np.float64)
        if skipped is not None:
            data = np.where(skipped, np.nan, data)  # SKIP tiles: blank, not 0
        top = max(1.0, float(np.nanmax(data))) if np.isfinite(data).any() else 1.0
        im = ax.imshow(data, cmap="viridis", interpolation="nearest", vmin=0, vmax=top)
        ax.set_title(f"{title}\ntotal {int(np.sum(counts)):,}", fontsize=10)
        ax.set(xlabel="key tile", ylabel="query tile")
        fig.colorbar(im, ax=ax, label="rescale events")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def rescales_vs_expected(measured, expected, maximum=None, sigma=None):
    """Rescale events per key tile (summed over query tiles): measured vs i.i.d. theory;
    ``sigma`` (per key tile), the model's standard deviation of each count, drawn as a band."""
    fig, ax = _figure(figsize=(8, 4))
    x = np.arange(np.shape(measured)[1])

    def per_key_tile(counts):  # zeros (e.g. every row's first tile) are left out of the log plot
        total = np.sum(counts, axis=0).astype(np.float64)
        return np.where(total > 0, total, np.nan)

    ax.plot(x, per_key_tile(measured), "o-", ms=3, label=f"measured, total {int(np.sum(measured)):,}")
    line, = ax.plot(x, per_key_tile(expected), "-", lw=2, label=f"expected for i.i.d. scores, total {np.sum(expected):,.0f}")
    if sigma is not None:
        mean = np.sum(expected, axis=0)
        low = mean - np.asarray(sigma)
        ax.fill_between(x, np.where(low > 0, low, np.nan), mean + np.asarray(sigma), color=line.get_color(), alpha=0.25,
                        lw=0, label="expected ± 1 sigma per key tile (i.i.d. model)")
    if maximum is not None:
        ax.plot(x, per_key_tile(maximum), ":", color="grey", label=f"maximum possible, total {int(np.sum(maximum)):,}")
    ax.set(yscale="log", xlabel="key tile", ylabel="rescale events (all query rows)",
           title="Where the running max grows: a new max in tile b has probability c / C")
    ax.legend(fontsize=8)
    return fig


def memory_timelines(traces: dict, cap_bytes, output_bytes):
    """Memory over time, tiled vs dense: traced numpy bytes (left) and RSS (right).

    ``traces[(path, tool)]`` are `attnlib.evidence.memory.memory_timeline` results.  The cap is
    drawn over the output on the traced panel, the one it bounds (inputs are not counted in
    either panel).
    """
    fig, axes = _figure(1, 2, figsize=(12, 5.8))
    colors = {"tiled": "#2a9d8f", "dense": "#e76f51"}
    for ax, tool, label in ((axes[0], "tracemalloc", "numpy-allocated bytes (tracemalloc)"),
                            (axes[1], "rss", "process RSS over the pre-call RSS (memory_profiler)")):
        for path in ("tiled", "dense"):
            tr = traces.get((path, tool))
            if tr is None:
                continue
            ax.plot(tr["t"], np.asarray(tr["bytes"]) / MIB, "-", color=colors[path], lw=2,
                    label=f"{path}: peak {tr['peak_bytes'] / MIB:,.1f} MiB")
        if tool == "tracemalloc":  # the cap bounds traced working memory, not RSS
            ax.axhline((cap_bytes + output_bytes) / MIB, color="crimson", ls="--",
                       label=f"cap: {cap_bytes / MIB:.0f} MiB of working memory over the output "
                             f"({output_bytes / MIB:.2f} MiB)")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("time since the call started (s)")
        ax.set_ylabel("memory over the inputs (MiB, symlog)" if tool == "tracemalloc"
                      else "RSS over the pre-call level (MiB, symlog)")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1)  # below the axes
    fig.tight_layout()
    return fig


def dense_projection(dense, ns) -> tuple[list, dict]:
    """The dense working memory at each ``n`` of ``ns`` beyond the measured ``dense`` runs
    (`~attnlib.evidence.memory.peak_memory` results), grown as ``n^2``: ``(model, ranges)``,
    ``model`` the ``[(n, bytes)]`` projected from the largest measured run, ``ranges``
    ``{n: [bytes, ...]}`` the same projection from each measured run (its spread: how far the
    runs are from ``n^2``).  A projection, not a measurement."""
    largest = max(dense, key=lambda r: r["sq"])
    beyond = [m for m in ns if m > largest["sq"]]
    model = [(m, largest["working_bytes"] * (m / largest["sq"]) ** 2) for m in beyond]
    ranges = {m: [r["working_bytes"] * (m / r["sq"]) ** 2 for r in dense] for m in beyond}
    return model, ranges


def memory_vs_n(tiled, dense, dense_model, cap_bytes, machine_bytes=None,
                title="Working memory vs sequence length (tracemalloc, fresh process each)", ranges=None,
                output="output"):
    """Peak working memory vs n: tiled (measured), dense (measured, then computed).

    ``tiled``/``dense`` are `attnlib.evidence.memory.peak_memory` results; ``dense_model`` is a
    list of ``(n, bytes)`` computed beyond the sizes dense was run at, and ``ranges``
    (`dense_projection`'s) each one's range, drawn as a bar; ``output`` names what the call
    returns (the gradients, for a backward).
    """
    fig, ax = _figure(figsize=(11, 4.5))
    ax.plot([r["sq"] for r in tiled], [r["working_bytes"] / MIB for r in tiled], "o-",
            color="#2a9d8f", lw=2, label=f"tiled, measured (working = peak - {output})")
    ax.plot([r["sq"] for r in tiled], [r["peak_bytes"] / MIB for r in tiled], "o:",
            color="#2a9d8f", alpha=0.6, label=f"tiled, measured peak incl. its {output}")
    ax.plot([r["sq"] for r in dense], [r["working_bytes"] / MIB for r in dense], "s-",
            color="#e76f51", lw=2, label="dense, measured")
    if dense_model:
        # Start the computed line at the largest measured point it extrapolates from.
        dense_model = [(dense[-1]["sq"], dense[-1]["working_bytes"])] + list(dense_model)
        ax.plot([n for n, _ in dense_model], [b / MIB for _, b in dense_model], "s--",
                color="#e76f51", alpha=0.6, label="dense, projected (n^2 from the largest measured)")
        if ranges:
            ns = sorted(ranges)
            mid = dict(dense_model)
            lo = [mid[m] - min(ranges[m]) for m in ns]
            hi = [max(ranges[m]) - mid[m] for m in ns]
            ax.errorbar(ns, [mid[m] / MIB for m in ns], yerr=[np.asarray(lo) / MIB, np.asarray(hi) / MIB], fmt="none",
                        ecolor="#e76f51", capsize=4, alpha=0.8, label="dense, projection's range (n^2 from each measured run)")
    ax.axhline(cap_bytes / MIB, color="crimson", ls="--", label=f"cap on working memory, {cap_bytes / MIB:.0f} MiB")
    if machine_bytes:
        ax.axhline(machine_bytes / MIB, color="black", ls=":", label=f"this machine's memory, {machine_bytes / 2**30:.0f} GiB")
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="n = Sq = Sk (tokens, log2 scale)",
           ylabel="traced memory over the inputs (MiB, log scale)", title=title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def decode_memory(traced, rss, cap_bytes):
    """The streaming decode over a memmapped cache: what tracemalloc and the OS see.

    ``traced``/``rss`` are `attnlib.evidence.memory.peak_memory` / `attnlib.evidence.memory.rss_growth`
    results for the same decode runs, in the same order.  Left: the RSS over time of the
    run with the most queries, total and split into anonymous and file-backed (where
    ``/proc`` gives the split).  Right: per run, the traced working memory, the anonymous
    and the file-backed RSS growth against the cache size and the cap.
    """
    fig, axes = _figure(1, 2, figsize=(12, 5.8))
    ax = axes[0]
    last = rss[-1]
    ax.plot(last["t"], np.asarray(last["bytes"]) / MIB, "-", color="grey", lw=5, alpha=0.45,
            label=f"total RSS (memory_profiler): peak {last['rss_bytes'] / MIB:,.1f} MiB")
    if last.get("anon_bytes") is not None:
        ax.plot(last["split_t"], np.asarray(last["file"]) / MIB, "-", color="#457b9d", lw=1.5,
                label=f"file-backed RSS (memmapped cache pages): peak {last['file_bytes'] / MIB:,.1f} MiB")
        ax.plot(last["split_t"], np.asarray(last["anon"]) / MIB, "-", color="#2a9d8f", lw=2,
                label=f"anonymous RSS: peak {last['anon_bytes'] / MIB:,.2f} MiB")
    else:
        ax.text(0.02, 0.5, "anonymous / file-backed split: not measured\n" + last.get("rss_split", ""),
                transform=ax.transAxes, fontsize=8)
    ax.axhline(last["cache_bytes"] / MIB, color="black", ls=":",
               label=f"KV cache on disk, {last['cache_bytes'] / MIB:,.0f} MiB")
    ax.axhline(cap_bytes / MIB, color="crimson", ls="--", label=f"cap, {cap_bytes / MIB:.0f} MiB")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set(ylim=(0, None), xlabel="time since the call started (s)", ylabel="RSS over the pre-call level (MiB, symlog)")
    ax.set_title(f"RSS during the decode of {last['sq']} queries over {last['sk']:,} keys", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16))  # below the axes

    ax = axes[1]
    x = np.arange(len(traced))
    series = [("traced working (tracemalloc)", [r["working_bytes"] for r in traced], "#e9c46a"),
              ("anonymous RSS growth", [r.get("anon_bytes") for r in rss], "#2a9d8f"),
              ("file-backed RSS growth", [r.get("file_bytes") for r in rss], "#457b9d")]
    width = 0.8 / len(series)
    for i, (label, values, color) in enumerate(series):
        shown = [(j, v) for j, v in zip(x, values) if v is not None]
        if shown:
            ax.bar([j + (i - 1) * width for j, _ in shown], [max(v, 1) / MIB for _, v in shown],
                   width, color=color, label=label)
    ax.axhline(traced[0]["cache_bytes"] / MIB, color="black", ls=":", label="KV cache on disk")
    ax.axhline(cap_bytes / MIB, color="crimson", ls="--", label="cap")
    ax.axhline(traced[0]["cache_bytes"] / 100 / MIB, color="grey", ls="-.", label="1% of the cache")
    ax.set_xticks(x, [str(r["sq"]) for r in traced])
    ax.set(xlabel="decode queries per call (count)", yscale="log", ylabel="memory (MiB, log scale)")
    ax.set_title("Per run: traced working vs RSS growth by kind", fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def time_vs_n(rows, names, title="Forward time vs sequence length"):
    """Median seconds vs ``n`` per implementation (log-log), bars from the fastest to the
    slowest repeat (``row["times"][name]``, where the rows carry them), with an ``n²`` guide
    through the first implementation's curve; the legend sits beside the axes, off the data."""
    fig, ax = _figure(figsize=(10, 4.5))
    for name in names:
        pts = [(r["n"], r[name], r.get("times", {}).get(name)) for r in rows if r.get(name) is not None]
        if pts:
            ns, med = [p[0] for p in pts], [p[1] for p in pts]
            lo = [m - (min(t) if t else m) for _, m, t in pts]
            hi = [(max(t) if t else m) - m for _, m, t in pts]
            reps = min((len(t) for _, _, t in pts if t), default=1)
            ax.errorbar(ns, med, yerr=[lo, hi], fmt="o-", capsize=3,
                        label=f"{name} (median, bars min–max of {reps})")
    ref = [(r["n"], r[names[0]]) for r in rows if r.get(names[0]) is not None]
    if ref:
        n0, t0 = ref[len(ref) // 2]
        ns = np.array([p[0] for p in ref], dtype=float)
        ax.plot(ns, t0 * (ns / n0) ** 2, ":", color="grey", label=f"n² through {names[0]} at n = {n0}")
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="sequence length n = Sq = Sk (tokens, log scale)",
           ylabel="seconds per call (log scale)", title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def tile_sweep_heatmap(sweep, default=None):
    """Median seconds of the tiled forward per ``(block_q, block_k)`` (a `attnlib.bench.tile_sweep`),
    each cell with its min–max over the repeats; ``default`` (``(block_q, block_k)``) is outlined."""
    sizes, secs = sweep["sizes"], np.asarray(sweep["seconds"])
    lo, hi = np.asarray(sweep.get("min", secs)), np.asarray(sweep.get("max", secs))
    fig, ax = _figure(figsize=(6.5, 5))
    im = ax.imshow(secs, cmap="viridis_r", interpolation="nearest")
    for i in range(len(sizes)):
        for j in range(len(sizes)):
            ax.text(j, i, f"{secs[i, j]:.3f}\n({lo[i, j]:.3f}–{hi[i, j]:.3f})", ha="center", va="center",
                    fontsize=8, color="white" if secs[i, j] > secs.mean() else "black")
    drawn = default is not None and default[0] in sizes and default[1] in sizes
    if drawn:
        i, j = sizes.index(default[0]), sizes.index(default[1])
        ax.add_patch(__import__("matplotlib.patches", fromlist=["Rectangle"]).Rectangle(
            (j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="crimson", linewidth=2.5))
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_yticks(range(len(sizes)), sizes)
    ax.set(xlabel="block_k (keys per tile)", ylabel="block_q (queries per tile)")
    ax.set_title(f"Tile-size sweep, {sweep['case']}, workers={sweep['workers']}\n"
                 f"median (min–max) seconds of {sweep.get('repeats', 'the')} repeats"
                 + (f"; outlined: the default {default[0]}×{default[1]}" if drawn else
                    f"; the default {default[0]}×{default[1]} not swept" if default is not None else ""), fontsize=10)
    fig.colorbar(im, ax=ax, label="median seconds per call")
    return fig


def lines(rows, x, y, group, *, logx=False, logy=True, xlabel=None, ylabel=None, title=None,
          hline=None):
    """One line per value of ``group``: ``y`` against ``x`` over the ``rows`` dicts (the legend
    to the right of the axes, off the lines)."""
    fig, ax = _figure(figsize=(10, 4.2))
    for key in dict.fromkeys(r[group] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[group] == key)
        ax.plot(*zip(*pts), "o-", label=f"{group} = {key}")
    if hline is not None:
        ax.axhline(hline[0], color="crimson", ls="--", label=hline[1])
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set(xlabel=xlabel or x, ylabel=ylabel or y, title=title or f"{y} vs {x}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def sink_rescales(rows, rows_total):
    """Rescale events against the sink's value (`attnlib.evidence.differential.sink_rescales` rows):
    the kernel's count, the independent recount, the level without a sink, and the share of
    rows whose running max never leaves the sink (right axis, of ``rows_total``)."""
    fig, ax = _figure(figsize=(8, 4.2))
    with_sink = [r for r in rows if r["sink"] != "none"]
    xs = [r["sink"] for r in with_sink]
    ax.plot(xs, [r["total_rescales"] for r in with_sink], "o-", label="kernel (stats.total_rescales)")
    ax.plot(xs, [r["reference_rescales"] for r in with_sink], "x", ms=9, color="black",
            label="independent recount (reference_rescales)")
    for r in rows:
        if r["sink"] == "none":
            ax.axhline(r["total_rescales"], color="gray", ls="--", label="no sink")
    ax.set(xlabel="sink logit (every head)", ylabel="rescale events")
    right = ax.twinx()
    right.plot(xs, [r["rows_held_by_sink"] / rows_total for r in with_sink], "s:", color="C2",
               label="rows whose max stays the sink")
    right.set(ylabel="share of rows held by the sink", ylim=(0, 1.05))
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="center left")
    ax.set_title("Rescales against the sink: a sink below the scores adds each row's first tile, "
                 "one above them holds the max", fontsize=9)
    return fig


def kernel_error_heatmap(head_row_ratio, max_columns=512):
    """A kernel's worst ``|err| / allowance`` over (query position, head), log colour scale.

    Positions are grouped into at most ``max_columns`` bins (the max of each); cells above
    1 (the cyan line) fail.  NaN/inf entries (ratio inf) are drawn at the top of the scale.
    """
    from matplotlib.colors import LogNorm

    ratio = np.asarray(head_row_ratio, dtype=np.float64)  # (Hq, Sq)
    sq = ratio.shape[1]
    groups = np.array_split(np.arange(sq), min(sq, max_columns))
    binned = np.stack([ratio[:, g].max(axis=1) for g in groups], axis=1)
    finite = binned[np.isfinite(binned)]
    top = max(float(finite.max()) if finite.size else 1.0, 1.0) * 1.01
    floor = 1e-4
    fig, ax = _figure(figsize=(9, 1.2 + 0.25 * ratio.shape[0]))
    im = ax.imshow(np.clip(binned, floor, top), aspect="auto", interpolation="nearest", cmap="magma",
                   norm=LogNorm(vmin=floor, vmax=top), extent=(0, sq, ratio.shape[0] - 0.5, -0.5))
    cbar = fig.colorbar(im, ax=ax)
    cbar.ax.axhline(1.0, color="cyan", lw=2)
    cbar.set_label("max |kernel - ref| / allowance (cyan: 1)")
    cells = f"{int((binned > 1).sum())} of {binned.size} " + ("binned " if binned.shape[1] < sq else "")
    ax.set(xlabel="query position", ylabel="head",
           title=f"Kernel error by head and query position ({cells}cells fail)")
    return fig


def kernel_error_by_head(ratio):
    """A one-query (decode) problem's worst ``|err| / allowance`` per head, log scale; 1 fails."""
    r = np.asarray(ratio, dtype=np.float64)
    fig, ax = _figure(figsize=(9, 3))
    heads = np.arange(len(r))
    ax.bar(heads, np.clip(np.where(np.isfinite(r), r, np.nanmax(r[np.isfinite(r)], initial=1.0) * 10), 1e-4, None),
           color=np.where(r > 1, "tab:red", "tab:blue"))
    ax.axhline(1.0, color="k", lw=1)
    ax.set_yscale("log")
    ax.set(xlabel="head", ylabel="max |kernel - ref| / allowance",
           title=f"Kernel error by head, one query ({int((r > 1).sum())} of {len(r)} heads fail)")
    return fig


def kernel_error_vs_position(row_ratio, row_naive_ratio=None):
    """Worst ``|err| / allowance`` per query position: the kernel's and, below float64,
    the naive baseline's (at most 0.5 by the rule's construction); 1 is the limit."""
    fig, ax = _figure(figsize=(9, 4))
    pos = np.arange(len(row_ratio))
    floor = 1e-6
    ax.plot(pos, np.maximum(row_ratio, floor), lw=1, label="kernel")
    if row_naive_ratio is not None:
        ax.plot(pos, np.maximum(row_naive_ratio, floor), lw=1, alpha=0.8, label="naive, same precision")
    ax.axhline(1.0, color="crimson", lw=1.5, ls="--", label="allowance")
    ax.set(yscale="log", xlabel="query position", ylabel="max |x - ref| / allowance over batch, heads, dims",
           title="Error along the query position")
    ax.legend(fontsize=8, loc="best")
    return fig


def kernel_error_histogram(ratios, naive_ratios=None):
    """Distribution of ``|kernel - ref| / allowance`` (and the naive baseline's, same entries)."""
    series = [(ratios, "kernel", dict(alpha=0.7))]
    if naive_ratios is not None:
        series.append((naive_ratios, "naive, same precision", dict(histtype="step", lw=2)))
    both = np.concatenate([np.ravel(x) for x, _, _ in series])
    positive = both[both > 0]
    hi = math.ceil(math.log10(max(float(both.max()), 1.0))) + 0.0 if both.size else 0.0
    lo = math.floor(math.log10(positive.min())) if positive.size else hi - 6
    lo = max(lo, hi - 12)
    fig, ax = _figure(figsize=(8, 4))
    for data, label, style in series:
        edges, counts = log10_histogram(data, lo, hi)
        ax.hist(edges[:-1], bins=edges, weights=counts, label=label, **style)
    ax.axvline(0.0, color="crimson", lw=2, label="allowance (ratio 1)")
    ax.set(yscale="log", xlabel=f"log10 (|x - ref| / allowance)   (zeros and values below 1e{lo:.0f} in the first bin)",
           ylabel="entries", title=f"Errors of {np.size(ratios):,} output entries, in units of their allowance")
    ax.legend(fontsize=8, loc="best")
    return fig


def check_rule_ratios(rows):
    """Worst ``|err| / allowance`` per (precision, shape, kernel), over the seeds: correct
    kernels must sit below 1, defective ones above it."""
    precs = list(dict.fromkeys(r["precision"] for r in rows))
    fig, ax = _figure(figsize=(9, 1.5 + 0.6 * len(precs)))
    for kind, style, offset, label in (
            ("correct", dict(marker="o", color="tab:green"), -0.2, "correct kernels"),
            ("baseline", dict(marker="s", color="tab:gray"), 0.0, "the rule's own baseline (not counted)"),
            ("defective", dict(marker="x", color="crimson"), 0.2, "defective kernels")):
        pts = [(max(r["worst_out_ratio"], r["worst_lse_ratio"] or 0.0), precs.index(r["precision"]))
               for r in rows if r["kind"] == kind]
        if pts:
            x, y = zip(*pts)
            ax.scatter(np.maximum(x, 1e-6), np.array(y) + offset, s=22, alpha=0.7, label=label, **style)
    ax.axvline(1.0, color="black", lw=1.5, ls="--", label="allowance (ratio 1)")
    ax.set_yticks(range(len(precs)), precs)
    ax.set(xscale="log", xlabel="worst |kernel - ref| / allowance over the seeds (one point per shape and kernel)",
           title="The check rule: correct kernels below 1, defects above")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the data
    fig.tight_layout()
    return fig


def power_by_magnitude(rows, apart=None):
    """One panel per precision: ``|err| / allowance`` against the magnitude of ``v`` and
    ``dout`` (`attnlib.check.power`), correct kernels (circles) below 1, wrong ones (crosses)
    above it; the kernel named ``apart`` (the rule's own reference rounded, which cannot
    fail) in grey, not among the correct kernels."""
    precs = list(dict.fromkeys(r["precision"] for r in rows))
    fig, axes = _figure(1, len(precs), figsize=(4.2 * len(precs), 3.6), sharey=True, squeeze=False)
    for ax, prec in zip(axes[0], precs):
        for kind, style, shift, label in (
                ("correct", dict(marker="o", color="tab:green"), 0.85, "correct kernels"),
                ("wrong", dict(marker="x", color="crimson"), 1.15, "wrong kernels"),
                ("apart", dict(marker=".", color="grey"), 1.0, f"{apart} (apart)")):  # side by side
            pts = [(r["magnitude"], r["ratio"]) for r in rows if r["precision"] == prec
                   and ((r["kernel"] == apart) if kind == "apart" else (r["kind"] == kind and r["kernel"] != apart))]
            if pts:
                x, y = zip(*pts)
                ax.scatter(np.array(x) * shift, np.clip(y, 1e-3, 1e9), s=18, alpha=0.6, label=label, **style)
        ax.axhline(1.0, color="black", lw=1.5, ls="--", label="allowance")
        ax.set(xscale="log", yscale="log", title=prec, xlabel="magnitude of v and dout (standard deviation)")
    axes[0][0].set_ylabel("worst |kernel - ref| / allowance")
    fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=4)  # off the data
    fig.suptitle("The check at every magnitude: correct kernels below 1, wrong kernels above")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
