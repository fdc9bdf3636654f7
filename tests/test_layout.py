"""The house plan (issue 25), measured from the source: the import graph has no cycle, the
numerical core imports nothing of the evidence, the check, the report, the bench or the
distributed oracle, no source file exceeds 700 lines, and every public name of the layout
before it (frozen below) still resolves."""

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import attnlib

PACKAGE = pathlib.Path(attnlib.__file__).parent
MAX_LINES = 700
#: What the numerical core may never import (its imports point inward only).
OUTSIDE_CORE = ("attnlib.evidence", "attnlib.check", "attnlib.report", "attnlib.bench",
                "attnlib.distributed", "attnlib.testing")
#: What the evidence may never import: the machinery built on it.
ABOVE_EVIDENCE = ("attnlib.check", "attnlib.report", "attnlib.bench", "attnlib.distributed",
                  "attnlib.testing")

#: Every module's ``__all__`` before the re-layout (main 4240e42), by its old name; each must
#: resolve as ``attnlib.<old name>.<name>`` (old module names are attributes of the root).
PUBLIC = {
    'attnlib': ['attention', 'attention_stream', 'attention_varlen', 'attention_varlen_backward', 'reference_attention_varlen', 'create_block_mask', 'BlockMask', 'reference_attention', 'oracle_attention', 'ORACLE_PRECISION', 'attention_backward', 'reference_attention_backward', 'attention_vjp', 'gradient_errors', 'reference_scores', 'reference_rescales', 'AttentionStats', 'TileSizes', 'DEFAULT_TILES', 'LARGE_HEAD_TILES', 'default_tiles', 'OnlineSoftmax', 'merge_attention', 'MaskSpec', 'mask_specs', 'SKIP', 'PARTIAL', 'FULL', 'random_qkv', 'adversarial_qkv', 'FAMILIES', 'Case', 'random_cases', 'differential_cases', 'feature_cases', 'run_case', 'run_family', 'power_table', 'Gate', 'GradientGate', 'run_case_gradients', 'run_family_gradients', 'expected_rescales', 'max_rescales', 'BOUND', 'Errors', 'attention_errors', 'rel_error', 'naive_rel_error', 'max_abs_error', 'normwise_error', 'reference_with_abs', 'log10_histogram'],
    'attnlib.backward': ['attention_backward', 'reference_attention_backward', 'attention_vjp'],
    'attnlib.bench': ['main', 'under_load', 'mask_cases', 'time_masks', 'DEFAULT', 'implementations', 'backward_implementations', 'phase_breakdown', 'roofline_seconds', 'tile_rates', 'tile_sweep', 'BenchCase', 'CASES', 'QUICK_CASES', 'BACKWARD_CASES', 'QUICK_BACKWARD_CASES', 'SHAPES', 'time_cases'],
    'attnlib.check': ['check_kernel', 'KernelCheck', 'TensorVerdict', 'UnusableInput', 'UnreadableInput', 'format_text', 'load_and_check', 'save_json', 'main', 'NOTEBOOK_PARAMETERS', 'LAYOUTS', 'TENSORS', 'to_bhsd'],
    'attnlib.check.calibration': ['measure', 'summary', 'correct_kernels', 'defective_kernels', 'SHAPES'],
    'attnlib.check.diagnosis': ['diagnose', 'trend', 'row_ratios', 'guard_mods', 'ModFailed', 'DROPPED'],
    'attnlib.check.power': ['measure', 'summary', 'by_kernel', 'long_gradients', 'wrong_kernels', 'correct_kernels', 'problem', 'MAGNITUDES', 'SHAPES'],
    'attnlib.defects': ['Defect', 'DEFECTS', 'BACKWARD_DEFECTS', 'run_with'],
    'attnlib.differential': ['run_case', 'run_family', 'power_table', 'crossing_fraction', 'sink_rescales', 'run_varlen', 'run_paged'],
    'attnlib.distributed': ['attention', 'BlockError', 'DEFAULT_BLOCK', 'MERGE_FANIN', 'Block', 'Piece', 'count_tasks', 'make_plan', 'merge_groups'],
    'attnlib.flex': ['BlockMask', 'create_block_mask', 'from_torch'],
    'attnlib.gate': ['Gate', 'GradientGate', 'Tolerance', 'tolerance', 'gradient_rounding', 'row_stats', 'U', 'ETA', 'TINY', 'LAMBDA', 'C_EXP', 'C_LOG'],
    'attnlib.oracle': ['oracle_attention', 'ORACLE_PRECISION', 'DECIMAL_DIGITS'],
    'attnlib.paged': ['paged_attention', 'gather_pages', 'page_tables'],
    'attnlib.testing': ['assert_attention_close'],
    'attnlib.tiled': ['attention', 'AttentionStats', 'TileSizes', 'DEFAULT_TILES', 'LARGE_HEAD_TILES', 'default_tiles'],
    'attnlib.varlen': ['attention_varlen', 'reference_attention_varlen', 'attention_varlen_backward', 'sequences'],
}


#: The lazy root's names -> the module each comes from (``from attnlib import Gate`` imports
#: attnlib.judge.gate, ``from .. import metrics`` attnlib.judge.metrics).
ROOT_NAMES = {**attnlib._PUBLIC, **attnlib._MODULES}


def _modules() -> dict:
    """``{module name: path}`` of every source file of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """The attnlib modules ``name`` imports anywhere (lazy, in functions, too), and the
    packages that hold them (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]  # a module, or a name in one
        for target in targets:
            root_name = target[len("attnlib."):] if target.startswith("attnlib.") else None
            if target not in modules and root_name in ROOT_NAMES:  # the lazy root's names
                target = "attnlib." + ROOT_NAMES[root_name]
            while target and target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules:
                parts = target.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    found.discard(name)
    return {m for m in found if not name.startswith(m + ".")}  # a module's own packages


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


@pytest.mark.slow
def test_the_import_graph_has_no_cycle(graph):
    state = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_core_imports_only_the_core(graph):
    for name, deps in graph.items():
        if name.startswith("attnlib.core"):
            bad = sorted(d for d in deps if not d.startswith("attnlib.core"))
            assert not bad, f"{name} imports {bad}"  # the root too: its names lead anywhere


def test_the_core_imports_nothing_by_name_at_run_time():
    """No ``importlib.import_module``, ``__import__`` or ``import attnlib`` in the core (but its
    package's submodule lookup): every dependency of the core is an import statement above."""
    for path in sorted((PACKAGE / "core").glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                assert called not in ("import_module", "__import__"), f"{path.name}:{node.lineno}"
            if isinstance(node, ast.Name):
                assert node.id != "attnlib", f"{path.name}:{node.lineno}"


def test_the_evidence_imports_nothing_built_on_it(graph):
    for name, deps in graph.items():
        if name.startswith("attnlib.evidence"):
            bad = sorted(d for d in deps if d.startswith(ABOVE_EVIDENCE))
            assert not bad, f"{name} imports {bad}"


def test_the_judge_imports_only_the_core(graph):
    """`attnlib.judge` is what the check (the product) and the evidence (the lab) share."""
    for name, deps in graph.items():
        if name.startswith("attnlib.judge"):
            bad = sorted(d for d in deps if not d.startswith(("attnlib.core", "attnlib.judge")))
            assert not bad, f"{name} imports {bad}"


def test_the_check_judges_without_the_evidence(graph):
    """The product apart from the lab: only the rule's own calibration (its random problems)
    reaches into `attnlib.evidence`, only the CLI's ``--html`` into `attnlib.report`, and a
    check of a kernel loads neither."""
    allowed = {"attnlib.check.calibration": ("attnlib.evidence",), "attnlib.check.cli": ("attnlib.report",)}
    for name, deps in graph.items():
        if name.startswith("attnlib.check"):
            bad = sorted(d for d in deps if d.startswith(("attnlib.evidence", "attnlib.report"))
                         and not d.startswith(allowed.get(name, ("-",))))
            assert not bad, f"{name} imports {bad}"
    loaded = _loaded_after("import numpy as np; from attnlib.check import check_kernel; "
                           "from attnlib.core.tiled import attention; q = np.ones((1, 2, 8, 4)); "
                           "check_kernel(q, q, q, attention(q, q, q), layout='bhsd')")
    assert not [m for m in loaded if m.startswith(("attnlib.evidence", "attnlib.report"))], loaded


def test_no_source_file_exceeds_the_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_of_the_old_layout_resolves(module):
    try:  # a module of that name (attnlib.check.power), or the root's alias (attnlib.gate)
        obj = importlib.import_module(module)
    except ModuleNotFoundError:
        obj = attnlib
        for part in module.split(".")[1:]:
            obj = getattr(obj, part)
    missing = [name for name in PUBLIC[module] if not hasattr(obj, name)]
    assert not missing, f"{module}: {missing}"
    assert set(PUBLIC["attnlib"]) <= set(attnlib.__all__)


def _loaded_after(statement: str) -> list:
    code = f"import sys; {statement}; print(' '.join(m for m in sys.modules if m.startswith('attnlib')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_the_package_root_is_lazy():
    assert sorted(_loaded_after("import attnlib")) == ["attnlib", "attnlib._version"]
    loaded = _loaded_after("import attnlib; attnlib.attention")
    assert not [m for m in loaded if m.startswith(OUTSIDE_CORE)], loaded


def test_the_core_runs_without_the_evidence():
    loaded = _loaded_after("import numpy as np, attnlib.core.tiled as t; "
                           "t.attention(np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 2)))")
    assert not [m for m in loaded if m.startswith(OUTSIDE_CORE)], loaded
