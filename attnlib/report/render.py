"""The reports' HTML: an executed notebook rendered self-contained (`render_html`, under
the NON-DEFAULT PARAMETERS banner where it applies) and ``index.html`` (`write_index`),
one verdict line per report; every file written atomically."""

from __future__ import annotations

import contextlib
import html
import json
import os
import tempfile
from pathlib import Path

from .notebook import FINISHED, STRICT_TEXT, Verdict, _jsonable
from .params import NOTEBOOKS

#: The subfolder of a reports folder that holds its full runs (`make report-full`).
FULL = "full"

#: The nbconvert templates shipped in the package (``attnlib/templates``): ``offline``
#: embeds everything, no script or style from a CDN.
TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


def _describe(overrides: dict) -> str:
    return ", ".join(f"{name}={o['actual']!r} (default {o['default']!r})" for name, o in overrides.items())


def _banner(overrides: dict) -> str:
    """The NON-DEFAULT PARAMETERS banner put under a report's title."""
    return ('<div style="border: 3px solid #c0392b; background: #fdecea; padding: .6em 1em; '
            'margin: .5em 0; font-size: 1.1em"><b>NON-DEFAULT PARAMETERS</b>: '
            f"{html.escape(_describe(overrides))}. This is not the report of the notebook's "
            "defaults, which <code>reports/</code> holds.</div>")


_BADGE = {"PASS": "#2a9d8f", "FAIL": "#c0392b", "INFO": "#6c757d"}


def finished(data: dict) -> str:
    """When the report's run finished (UTC), as its JSON records it (`FINISHED`; reports written
    before it: their "date (UTC)", which `save_results` stamped at the same moment)."""
    env = data.get("environment", {})
    return str(env.get(FINISHED, env.get("date (UTC)", "?")))


def verdict_block(data: dict, notebook: str = "") -> str:
    """The HTML put under a report's title: its verdict line and claims table (from its
    results JSON), and where its code is (the rendered report shows outputs only)."""
    verdict = Verdict(data["passed"], data["verdict"], bool(data.get("strict")))
    color = _BADGE[verdict.label]
    parts = [f'<p style="font-size: 1.15em"><b style="background: {color}; color: white; padding: 0 .4em; '
             f'border-radius: 3px">{verdict.label}</b> {html.escape(verdict.line)}</p>']
    claims = data.get("claims") or []
    if claims:
        head = "".join(f"<th>{c}</th>" for c in ("claim", "measured", "bound", "met"))

        def table(rows):
            body = "".join(
                "<tr>" + "".join(f'<td style="text-align: left">{html.escape(str(c[k]))}</td>'
                                 for k in ("claim", "measured", "bound", "met")) + "</tr>"
                for c in rows)
            return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        shown = [c for c in claims if c.get("page", True)]  # reports written before "page": every claim
        rest = [c for c in claims if not c.get("page", True)]
        parts.append(table(shown))
        if rest:
            details = sum(bool(c.get("detail")) for c in rest)
            what = "; ".join(([f"{details} summed up by the claims above, case by case"] if details else [])
                             + ([f"{len(rest) - details} only shown, not gated"] if details < len(rest) else []))
            parts.append(f"<details><summary>{len(rest)} more claims ({what})</summary>{table(rest)}</details>")
    mode = ("Every kernel call ran under " + STRICT_TEXT if verdict.strict  # a sentence of its own, after the time
            else "NOT run in strict floating-point mode")
    where = f"<code>notebooks/{html.escape(notebook)}.ipynb</code>" if notebook else "its notebook"
    env = data.get("environment", {})
    made = (f"Run finished {html.escape(finished(data))} UTC (attnlib {html.escape(str(env.get('attnlib', '?')))}, "
            f"commit {html.escape(str(env.get('git commit', '?')))}), the time in the report's JSON. ")
    parts.append(f"<p><small>{made}{html.escape(mode)}. The code is hidden here: it is {where}; every "
                 "figure is also in the report's JSON beside this page.</small></p>")
    return "\n".join(parts)


def render_html(executed: Path, target: Path, banner: str = "", data: dict | None = None) -> None:
    """Executed notebook -> self-contained HTML, written atomically (tmp file + rename).

    ``banner`` (HTML) is shown under the notebook's first cell, its title, and then, from
    ``data`` (its results JSON), the verdict and claims table (`verdict_block`).  Code cells
    show their outputs only: the code is the notebook's.
    """
    import nbformat
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="offline", extra_template_basedirs=[str(TEMPLATES)],
                            exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    nb = nbformat.read(str(executed), as_version=4)
    first = nb.cells[0] if nb.cells else None
    if first is not None and first.cell_type == "markdown" and first.source.startswith("# "):
        title, _, story = first.source.partition("\n")  # the verdict goes under the title itself
        if story.strip():
            first.source = title
            nb.cells.insert(1, nbformat.v4.new_markdown_cell(story.strip("\n")))
    reported = data is not None and {"passed", "verdict"} <= set(data)  # a report's results JSON
    top = ([banner] if banner else []) + ([verdict_block(data, target.stem)] if reported else [])
    for i, text in enumerate(top, 1):
        nb.cells.insert(i, nbformat.v4.new_markdown_cell(text, metadata={"tags": ["attnlib-banner"]}))
    body, _ = exporter.from_notebook_node(nb)
    _write_atomic(target, body)

def _write_atomic(target: Path, text: str) -> None:
    """Write ``text`` to a uniquely named file beside ``target``, then rename it over ``target``:
    a reader sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_json(target: Path, data: dict) -> None:
    _write_atomic(target, json.dumps(data, indent=1, default=_jsonable))

def _load(out_dir: Path, name: str):
    results, page = out_dir / f"{name}.json", out_dir / f"{name}.html"
    status_file = out_dir / f"{name}.status.json"
    data = json.loads(results.read_text()) if results.exists() and page.exists() else None
    status = json.loads(status_file.read_text()) if status_file.exists() else None
    return data, status


def _badge(label: str, text: str | None = None) -> str:
    return f'<span class="{label.lower()}">{text or label}</span>'


#: The words of a key figure taken from a verdict line, for a report that names none.
_KEY_FALLBACK = 8


def key_figure(data: dict) -> str:
    """A report's line in the index: its ``key`` figure, or its verdict line's first words."""
    key = " ".join(str(data.get("key") or "").split())
    if key:
        return key
    words = str(data.get("verdict", "")).split()
    return " ".join(words[:_KEY_FALLBACK]) + (" ..." if len(words) > _KEY_FALLBACK else "")


def _index_item(name: str, title: str, out_dir: Path, full_dir: Path | None = None) -> str:
    """One short line: badge, name (linked; its title, verdict line and time on hover), the
    key figure, the commit; the full run's badge and link; an error above it."""
    data, status = _load(out_dir, name)
    lines = []
    if status is not None:
        where = f"{status['notebook']}, {status['cell']}" if status.get("cell") else status["notebook"]
        previous = (f"the report below is from the previous run that completed, of "
                    f"{finished(data)} UTC, and is not this run's"
                    if data is not None else "there is no earlier report")
        kept = (f" (the executed notebook is kept locally as failed/{html.escape(name)}.ipynb)"
                if status.get("executed") else "")
        lines.append(f'{_badge("ERROR")} in {html.escape(where)}: '
                     f'{html.escape(status["error"])} ({html.escape(status.get("date (UTC)", "?"))} UTC) — '
                     f"{previous}{kept}")
    if data is None:
        item = f"<b>{html.escape(name)}</b>: " + (lines.pop() if lines else "not run yet")
    else:
        verdict = Verdict(data["passed"], data["verdict"], bool(data.get("strict")))
        env = data.get("environment", {})
        hover = f'{title}. {data["verdict"]} ({data.get("seconds", "?")} s)'
        item = (f'{_badge(verdict.label)} <a href="{name}.html" title="{html.escape(hover)}">{html.escape(name)}</a>: '
                f'{html.escape(key_figure(data))} <small>({html.escape(str(env.get("git commit", "?")))}'
                f'{"" if verdict.strict else ", NOT strict"})</small>')
        if data.get("overrides"):
            item = (f'{_badge("NONDEFAULT", "NON-DEFAULT PARAMETERS")} '
                    f'{html.escape(_describe(data["overrides"]))}<br>' + item)
    if full_dir is not None:
        full, full_status = _load(full_dir, name)
        if full is not None:
            fv = Verdict(full["passed"], full["verdict"], bool(full.get("strict")))
            hover = f'{full["verdict"]} ({full.get("seconds", "?")} s)'
            env = full.get("environment", {})  # the full run's commit and day (it may be older than this run)
            at = f'{env.get("git commit", "?")}, {(str(env.get("run finished (UTC)", "")).split() or ["?"])[0]}'
            item += (f' · <a href="{full_dir.name}/{name}.html" title="{html.escape(hover)}">full run</a>: '
                     f'{_badge(fv.label)} <small>({html.escape(at)})</small>')
        if full_status is not None:
            item += f' · full run: {_badge("ERROR")} {html.escape(full_status["error"])}'
    lines.append(item)
    return "<li>" + "<br>".join(lines) + "</li>"


def write_index(out_dir: Path) -> Path:
    """``index.html`` linking every report in ``out_dir`` with its verdict line (and, where
    ``out_dir/full`` holds one, its full run's).

    A notebook whose last run failed shows ERROR with the notebook, the cell and the error,
    above its previous report (if any); reports made at non-default parameters are marked.
    """
    full_dir = out_dir / FULL
    full_dir = full_dir if full_dir.is_dir() else None
    items = [_index_item(name, nb.title, out_dir, full_dir) for name, nb in NOTEBOOKS.items()]
    # The full runs' own measured times (each full report's ``seconds``), not a word for them.
    full_seconds = [] if full_dir is None else [
        float(data["seconds"]) for data in (_load(full_dir, name)[0] for name in NOTEBOOKS)
        if data is not None and isinstance(data.get("seconds"), (int, float))]
    full_runs = "the full runs" + (f" ({len(full_seconds)} of them, {sum(full_seconds):,.0f} s together in their last runs)"
                                   if full_seconds else "")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>attnlib reports</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60em; margin: 2em auto; line-height: 1.5; }}
li {{ margin-bottom: .6em; }}
.pass, .fail, .info, .error, .nondefault {{ font-weight: bold; padding: 0 .4em; border-radius: 3px; color: white; }}
.pass {{ background: #2a9d8f; }} .fail, .error {{ background: #c0392b; }} .info {{ background: #6c757d; }}
.nondefault {{ background: #d35400; }} small {{ color: #555; }}
</style></head><body>
<h1>attnlib: the evidence</h1>
<p>Each line: a notebook run by papermill (<code>make report</code>; {full_runs}, made
less often: <code>make report-full</code>, each at the commit and time it names), its verdict, its key
figure and the commit; its whole
verdict line and its time are on the link (hover), and first on its page. Every kernel call ran under
<code>{html.escape(STRICT_TEXT)}</code> unless the line says NOT strict.</p>
<ul>
{chr(10).join(items)}
</ul></body></html>
"""
    index = out_dir / "index.html"
    _write_atomic(index, page)
    return index
