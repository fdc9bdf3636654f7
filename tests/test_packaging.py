"""What `pip install attnlib` gets: the wheel holds the package data `check --html` and the
report renderer need, and the `attnlib` console command."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_has_the_notebook_the_templates_and_the_command(tmp_path):
    src = tmp_path / "src"  # a copy: the build writes build/ and egg-info where it runs
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "attnlib", src / "attnlib", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("attnlib-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "attnlib/check/kernel_check.ipynb" in names
    assert any(n.startswith("attnlib/templates/offline/") for n in names)
    assert "attnlib = attnlib.__main__:main" in entry_points
    assert not any(n.startswith(("tests/", "notebooks/", "reports/")) for n in names)
