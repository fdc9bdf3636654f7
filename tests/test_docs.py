"""Every Python code block of the README and of docs/ runs: each file's blocks in order, in one
namespace, in a fresh process (what a reader pastes, top to bottom).  A block that needs what
no test machine has (a SLURM or Kubernetes cluster) says so in an HTML comment
``<!-- not run: REASON -->`` on the line before it; those are listed and counted."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- not run: [^>]*-->\n)?```python\n(.*?)```", re.S)
#: The blocks no test machine can run, by page: each needs a cluster manager.
NOT_RUN = {"distributed.md": 2}


def blocks(page: Path):
    """``[(code, skipped), ...]`` of the page's Python blocks, in order."""
    return [(m.group(2), m.group(1) is not None) for m in BLOCK.finditer(page.read_text())]


def test_the_skipped_blocks_are_the_known_ones():
    assert {p.name: n for p in PAGES if (n := sum(s for _, s in blocks(p)))} == NOT_RUN


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_every_python_block_runs(page, tmp_path):
    code = "\n".join(c for c, skipped in blocks(page) if not skipped)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600, cwd=tmp_path)
