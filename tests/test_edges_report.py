"""The report runner at its edges: resource bounds on every size-like parameter, refused
before anything runs, and a missing report extra as one line (no notebook is executed)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnlib import report
from attnlib.report import costs as report_costs
from attnlib.report import runner as report_runner
from attnlib.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
HUGE = 10**30  # past any machine's memory and any run's time, whatever the parameter sizes

# Parameters that are not sizes a run allocates or loops over, or whose large values cost
# nothing: the tests below do not expect a huge value of these to be refused.
NOT_BOUNDED = {
    "seed": "a seed, not a size",
    "space_seed": "a seed, not a size",
    "logit_stds": "scales of the logits, not sizes",
    "oracle_max_n": "a threshold: the oracle runs at adversarial_n, bounded there",
    "torch_max_n": "a threshold: torch runs at the n_values, bounded there",
    "memory_entries": "clipped to the gallery's entries",
    "mask_memory_cases": "clipped to the four mask cases",
    "block_q": "a tile size: the kernel clamps tiles to the lengths",
    "block_k": "a tile size: the kernel clamps tiles to the lengths",
    "blocks": "tile sizes: the kernel clamps tiles to the lengths",
    "sweep_sizes": "tile sizes: the kernel clamps tiles to the lengths",
    "scaleout.block": "a piece's query block and key range, clamped to the lengths",
    "long_block": "the long run's query block and key range, clamped to long_n",
    "project_block": "the projected plan's query block and key range, clamped to project_n",
    "project_d": "the projected head dim: arithmetic only, refused past float64's range",
}
SIZE_CHECKS = (report.positive, report.non_negative, report.sizes, report.check_shapes,
               report.power_shapes, report.model_cases)


@pytest.fixture(scope="module")
def defaults():
    return {name: report_runner._notebook_defaults(ROOT / "notebooks" / f"{name}.ipynb")
            for name in report.NOTEBOOKS}


def huge(check, value):
    """``value`` of a parameter checked by ``check`` with one size made `HUGE`."""
    if check is report.sizes:
        return list(value) + [HUGE]
    if check is report.check_shapes:  # [batch, heads, seqlen_q, seqlen_k, headdim, causal]
        return [[1, 1, 64, 64, HUGE, True]]
    if check is report.power_shapes:  # [batch, heads, kv_heads, seqlen_q, seqlen_k, headdim, causal]
        return [[1, 2, 2, 64, 64, HUGE, True]]
    if check is report.model_cases:  # [heads, n, block]
        return [[1, HUGE, 256]]
    return HUGE


def names(message, name):
    return re.search(rf"(?<![\w.]){re.escape(name)}\b", message) is not None


def size_parameters():
    return [(nb, name) for nb, notebook in report.NOTEBOOKS.items()
            for name, check in notebook.parameters.items()
            if check in SIZE_CHECKS and name not in NOT_BOUNDED and f"{nb}.{name}" not in NOT_BOUNDED]


# -- the defaults and every documented run still pass -----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("quick", [False, True])
def test_defaults_and_quick_values_pass_the_bounds(defaults, quick):
    for name, notebook in report.NOTEBOOKS.items():
        values = {**defaults[name], **(notebook.quick if quick else {})}
        costs = list(notebook.costs(report.check_params(name, **values)))
        assert costs and all(c.memory <= report.memory_limit() for c in costs), name
        assert sum(c.work for c in costs) <= report.WORK_LIMIT / 20, name  # far from the limit


@pytest.mark.parametrize("names_, overrides", [
    (["memory"], ["n=8192"]),  # docs/reports.md and Makefile: make report ARGS="--only memory -p n=8192"
    (["equivalence"], ["n_cases=200", "seed=3"]),
    (None, ["rescales.block_k=128"]),
    (["rescales"], ["n=2048", "block_q=32"]),  # the papermill line of docs/reports.md
    (["equivalence", "rescales"], ["seed=7", "rescales.n=128", "block_q=32"]),  # tests/test_notebooks.py
])
def test_documented_runs_pass_the_bounds(names_, overrides):
    assert report.plan(names_, overrides)


def test_gallery_entries_match_the_gallery():
    from attnlib.bench.gallery import gallery

    assert report.GALLERY_ENTRIES == len(gallery(64, 1))


# -- too large for the machine: refused before anything runs, naming the parameter -------------

@pytest.mark.parametrize("notebook, name", size_parameters())
def test_every_size_parameter_is_bounded(defaults, notebook, name):
    check = report.NOTEBOOKS[notebook].parameters[name]
    values = {**defaults[notebook], name: huge(check, defaults[notebook][name])}
    with pytest.raises(ValueError) as info:
        report.check_params(notebook, **values)
    message = str(info.value)
    assert names(message, name) and "\n" not in message, message


@pytest.mark.parametrize("overrides, name, limit", [
    # the three
    (["rescales.n=1000000000000"], "n", "GiB in memory"),
    (["rescales.d=1000000000"], "d", "GiB in memory"),
    (["memory.decode_keys=1000000000000000"], "decode_keys", "free"),
    # more notebooks and parameters
    (["equivalence.n_cases=1000000000"], "n_cases", "floating-point operations"),
    (["equivalence.layout_max_len=1000000"], "layout_max_len", "GiB in memory"),
    (["equivalence.paged_pages=[256, 1000000000]"], "paged_pages", "GiB in memory"),
    (["equivalence.adversarial_d=100000000"], "adversarial_d", "GiB in memory"),
    (["gradients.sweep=[1024, 100000000]"], "sweep", "GiB in memory"),
    (["gradients.varlen_cases=100000000000"], "varlen_cases", "floating-point operations"),
    (["memory.decode_queries=[1, 100000000]"], "decode_queries", "GiB in memory"),
    (["performance.workers=[1, 100000]"], "workers", "GiB in memory"),
    (["performance.repeats=1000000000"], "repeats", "floating-point operations"),
    (["performance.mask_n=1000000"], "mask_n", "GiB in memory"),
    (["performance.n_values=[512, 100000000]"], "n_values", "GiB in memory"),
    (["numerics.ds=[32, 1000000000]"], "ds", "GiB in memory"),
    (["scaleout.workers=[1, 100000]"], "workers", "GiB in memory"),
    (["scaleout.block=1", "scaleout.n=1000000"], "block", "GiB in memory"),
    (["scaleout.project_n=1000000000000"], "project_n", "GiB in memory"),
    (["scaleout.project_cores=1000000000000000000"], "project_cores", "2^53"),
    (["flex_gallery.block=1000000000"], "block", "GiB in memory"),
    (["flex_gallery.heads=1000000"], "heads", "GiB in memory"),
    (["flex_gallery.repeats=10000000000"], "repeats", "floating-point operations"),
    (["check_rule.n_seeds=10000000000"], "n_seeds", "floating-point operations"),
    (["check_rule.power_shapes=[[1, 4, 2, 64, 64, 1000000000, True]]"], "power_shapes", "GiB in memory"),
])
def test_too_large_values_are_refused_before_running(tmp_path, monkeypatch, overrides, name, limit):
    def never(*args, **kwargs):
        raise AssertionError("a notebook was started")

    monkeypatch.setattr(report_runner, "run_one", never)
    notebooks = sorted({o.split(".")[0] for o in overrides})
    lines = []
    status = report.run(notebooks, overrides, out_dir=tmp_path, log=lines.append)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {notebooks[0]}: parameter") and limit in lines[0], lines
    assert names(lines[0], name), lines
    assert not list(tmp_path.iterdir())  # nothing was run or written


def test_cli_refuses_with_one_line_and_exit_2(capsys):
    assert main(["report", "--only", "rescales", "-p", "n=1000000000000"]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err.count("\n") == 1, captured
    assert "n=1000000000000" in captured.err and "this machine allows" in captured.err


def test_python_api_raises_value_error_naming_the_parameter(defaults):
    with pytest.raises(ValueError, match=r"parameters decode_keys=1000000000000000, .* free"):
        report.check_params("memory", **{**defaults["memory"], "decode_keys": 10**15})
    with pytest.raises(ValueError, match=r"project_d=~1e\+400"):  # huge values shown short
        report.check_params("scaleout", **{**defaults["scaleout"], "project_d": 10**400})


def test_the_memory_limit_is_half_the_physical_memory(defaults, monkeypatch):
    values = {**defaults["equivalence"], "paged_pages": [256, 2**24]}  # a 256 GiB cache of k and v
    monkeypatch.setattr(report_costs, "physical_memory", lambda: 2**40)
    assert report.memory_limit() == 2**39
    report.check_params("equivalence", **values)
    monkeypatch.setattr(report_costs, "physical_memory", lambda: 2**36)
    with pytest.raises(ValueError, match=r"paged_pages=\[256, 16777216\].*this machine allows 32.0 GiB"):
        report.check_params("equivalence", **values)
    monkeypatch.setattr(report_costs, "physical_memory", lambda: 0)  # unreadable: the fallback
    assert report.memory_limit() == report.FALLBACK_MEMORY // 2


def test_disk_is_checked_against_the_temporary_folder(defaults, monkeypatch):
    monkeypatch.setattr(report_costs, "disk_limit", lambda: 2**30)  # 1 GiB free
    with pytest.raises(ValueError, match=r"decode_keys=1048577.*would write about 1.0 GiB.*1.0 GiB free"):
        report.check_params("memory", **{**defaults["memory"], "decode_keys": 2**20 + 1})
    monkeypatch.setattr(report_costs, "disk_limit", lambda: None)  # unknown: not checked
    report.check_params("memory", **{**defaults["memory"], "decode_keys": 2**20 + 1})


# -- without the report extra: one line, exit 2 ------------------------------------------------

def test_missing_extra_in_process_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "papermill", None)  # import papermill raises ImportError
    assert report.missing_report_modules() == ["papermill"]
    assert main(["report", "--only", "rescales", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err.count("\n") == 1, captured
    assert "pip install 'attnlib[report]'" in captured.err and "papermill" in captured.err
    assert "Traceback" not in captured.err and not list(tmp_path.iterdir())
    with pytest.raises(report.ReportError, match=re.escape("pip install 'attnlib[report]'")):
        report.plan(["rescales"])


BLOCKED = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("papermill", "nbconvert", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocked())
from attnlib.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv, code, stream, text", [
    (["report"], 2, "stderr", "pip install 'attnlib[report]'"),
    (["report", "--only", "memory", "-p", "n=8192"], 2, "stderr",
     "papermill, nbconvert, matplotlib not importable"),
    (["report", "--help"], 0, "stdout", "usage: python -m attnlib report"),
    (["--help"], 0, "stdout", "usage: attnlib"),
    (["check", "--help"], 0, "stdout", "usage: python -m attnlib check"),
])
@pytest.mark.slow
def test_missing_extra_in_a_fresh_process(tmp_path, argv, code, stream, text):
    proc = subprocess.run([sys.executable, "-c", BLOCKED, *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == code, proc
    assert text in getattr(proc, stream), proc
    if code == 2:
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and not proc.stdout, proc
