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

from .notebook import Verdict, _jsonable
from .params import NOTEBOOKS

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


def render_html(executed: Path, target: Path, banner: str = "") -> None:
    """Executed notebook -> self-contained HTML, written atomically (tmp file + rename).

    ``banner`` (HTML) is shown under the notebook's first cell, its title.
    """
    import nbformat
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="offline",
                            extra_template_basedirs=[str(TEMPLATES)])
    nb = nbformat.read(str(executed), as_version=4)
    if banner:
        nb.cells.insert(1, nbformat.v4.new_markdown_cell(banner, metadata={"tags": ["attnlib-banner"]}))
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

def _index_item(name: str, title: str, out_dir: Path) -> str:
    results, page = out_dir / f"{name}.json", out_dir / f"{name}.html"
    status_file = out_dir / f"{name}.status.json"
    data = json.loads(results.read_text()) if results.exists() and page.exists() else None
    status = json.loads(status_file.read_text()) if status_file.exists() else None
    lines = []
    if status is not None:
        where = f"{status['notebook']}, {status['cell']}" if status.get("cell") else status["notebook"]
        previous = (f"the report below is from the previous run that completed, of "
                    f"{data.get('environment', {}).get('date (UTC)', '?')} UTC, and is not this run's"
                    if data is not None else "there is no earlier report")
        kept = (f" (the executed notebook is kept locally as failed/{html.escape(name)}.ipynb)"
                if status.get("executed") else "")
        lines.append(f'<span class="error">ERROR</span> in {html.escape(where)}: '
                     f'{html.escape(status["error"])} ({html.escape(status.get("date (UTC)", "?"))} UTC) — '
                     f"{previous}{kept}")
    if data is None:
        if status is None:
            return f"<li><b>{html.escape(title)}</b>: not run yet</li>"
        return f"<li><b>{html.escape(title)}</b><br>{lines[0]}</li>"
    env = data.get("environment", {})
    verdict = Verdict(data["passed"], data["verdict"], bool(data.get("strict")))
    badge = verdict.label.lower()
    mode = f" — {html.escape(verdict.mode)}" if verdict.strict else ""
    lines.append(f'<span class="{badge}">{badge.upper()}</span> '
                 f'<a href="{name}.html">{html.escape(title)}</a>')
    if data.get("overrides"):
        lines.append(f'<span class="nondefault">NON-DEFAULT PARAMETERS</span> '
                     f'{html.escape(_describe(data["overrides"]))}')
    lines.append(f'{html.escape(data["verdict"])}{mode}')
    lines.append(f'<small>{data.get("seconds", "?")} s, {html.escape(env.get("date (UTC)", "?"))} UTC, '
                 f'commit {html.escape(env.get("git commit", "?"))}, attnlib {html.escape(env.get("attnlib", "?"))}, '
                 f'numpy {html.escape(env.get("numpy", "?"))}</small>')
    return "<li>" + "<br>".join(lines) + "</li>"


def write_index(out_dir: Path) -> Path:
    """``index.html`` linking every report in ``out_dir`` with its verdict line.

    A notebook whose last run failed shows ERROR with the notebook, the cell and the error,
    above its previous report (if any); reports made at non-default parameters are marked.
    """
    items = [_index_item(name, nb.title, out_dir) for name, nb in NOTEBOOKS.items()]
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>attnlib reports</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 52em; margin: 2em auto; line-height: 1.5; }}
li {{ margin-bottom: 1em; }}
.pass, .fail, .info, .error, .nondefault {{ font-weight: bold; padding: 0 .4em; border-radius: 3px; color: white; }}
.pass {{ background: #2a9d8f; }} .fail, .error {{ background: #c0392b; }} .info {{ background: #6c757d; }}
.nondefault {{ background: #d35400; }} small {{ color: #555; }}
</style></head><body>
<h1>attnlib: the evidence</h1>
<p>Exact, memory-tiled attention in numpy, checked against a dense float64 reference.
Each report below was produced by running its notebook with papermill
(<code>make report</code>); its parameters and environment are stated at its top.</p>
<ul>
{chr(10).join(items)}
</ul></body></html>
"""
    index = out_dir / "index.html"
    _write_atomic(index, page)
    return index

