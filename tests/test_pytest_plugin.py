"""attnlib's pytest plugin (`attnlib.pytest_plugin`, a ``pytest11`` entry point): a small
suite run by pytester with ``--attnlib-report`` (one kernel that forgot its causal mask), the
JSON rows and the HTML report; silence without the options; ``--attnlib-device``; the
``attnlib_case`` fixture; `attnlib.testing.record` and `recording`."""

import json
import re

import numpy as np
import pytest

# pytester's in-process runs drop the modules they imported when they end; ml_dtypes (which
# the check imports for its low-precision types) cannot register its dtypes twice, so it is
# imported here first: without it the suite's result depended on what ran before in the process.
try:
    import ml_dtypes  # noqa: F401
except ImportError:  # the check then has no low-precision types, and nothing to register twice
    pass

import attnlib  # noqa: E402
from attnlib import testing  # noqa: E402
from attnlib.check import check_kernel  # noqa: E402
from attnlib.pytest_plugin import CASES, Case  # noqa: E402
from attnlib.testing import assert_attention_close, record, recording  # noqa: E402

pytest_plugins = ["pytester"]

SUITE = '''
import numpy as np, pytest
from attnlib.check import check_kernel
from attnlib.pytest_plugin import Case
from attnlib.testing import assert_attention_close, record

TINY = [Case("decode", batch=2, heads=4, kv_heads=2, seqlen_q=1, seqlen_k=64, head_dim=16),
        Case("prefill-gqa", batch=1, heads=4, kv_heads=2, seqlen_q=64, seqlen_k=64, head_dim=16)]


def plain(q, k, v, causal):
    """The kernel under test: attention in float32, (batch, seqlen, heads, dim)."""
    q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))
    s = q @ k.swapaxes(-1, -2) / np.float32(np.sqrt(q.shape[-1]))
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool), s.shape[-1] - s.shape[-2]), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True) @ v).swapaxes(1, 2)


@pytest.mark.parametrize("attnlib_case", TINY, indirect=True)
def test_kernel(attnlib_case):
    q, k, v = attnlib_case.qkv()
    assert_attention_close(plain(q, k, v, causal=True), q, k, v, causal=True)


def test_forgot_the_mask():
    q, k, v = TINY[1].qkv()
    assert_attention_close(plain(q, k, v, causal=False), q, k, v, causal=True)


def test_checked_by_hand():
    q, k, v = TINY[0].qkv()
    record(check_kernel(q, k, v, plain(q, k, v, causal=False)))
'''
IDS = {"test_suite.py::test_kernel[decode]": "PASS", "test_suite.py::test_kernel[prefill-gqa]": "PASS",
       "test_suite.py::test_forgot_the_mask": "FAIL", "test_suite.py::test_checked_by_hand": "PASS"}


def run(pytester, *args):
    pytester.makepyfile(test_suite=SUITE)
    return pytester.runpytest("-p", "no:cacheprovider", *args)


def check_rows(data):
    rows = {r["test"]: r for r in data["rows"]}
    assert len(data["rows"]) == len(rows) == data["verdicts"] == 4 and data["failed"] == 1
    assert {t: r["verdict"] for t, r in rows.items()} == IDS
    bad = rows["test_suite.py::test_forgot_the_mask"]
    assert bad["diagnosis"] == ["the output matches attention with no causal mask"]
    assert bad["worst_ratio"] > 1e3 and bad["options"]["causal"] is True and bad["precision"] == "float32"
    assert np.array(bad["maps"]["head_row_ratio"]).shape == (4, 64) and len(bad["maps"]["row_ratio"]) == 64
    decode = rows["test_suite.py::test_kernel[decode]"]
    assert decode["shape"] == {"batch": 2, "heads_q": 4, "heads_k": 2, "seqlen_q": 1, "seqlen_k": 64,
                               "head_dim": 16, "head_dim_v": 16}
    assert all(r["worst_ratio"] < 1 and "maps" not in r for t, r in rows.items() if IDS[t] == "PASS")


@pytest.mark.slow
def test_the_report_holds_every_verdict_and_maps_the_failure(pytester):
    result = run(pytester, "--attnlib-report", "reports/kernels")
    result.assert_outcomes(passed=3, failed=1)  # the report changes no outcome
    folder = pytester.path / "reports" / "kernels"
    assert sorted(p.name for p in folder.iterdir()) == ["pytest_report.html", "pytest_report.json"]
    data = json.loads((folder / "pytest_report.json").read_text())
    check_rows(data)
    assert data["run"]["outcome"] == {"passed": 3, "failed": 1} and data["run"]["command"].startswith("pytest ")
    assert {r["entry"] for r in data["rows"]} == {"assert_attention_close"}
    failure = next(r for r in data["rows"] if r["verdict"] == "FAIL")
    assert "worst:" in failure["text"] and "allowance" in failure["text"]  # the check's verdict in full
    result.stdout.fnmatch_lines([f"attnlib: 4 kernel verdicts, 1 failed: {folder / 'pytest_report.html'}"])
    page = (folder / "pytest_report.html").read_text()
    assert all(test in page for test in IDS)
    assert "FAIL</strong>: 1 of 4 kernel verdicts failed" in page and "no causal mask" in page
    assert len(re.findall(r'<img[^>]+src="data:image/png;base64,', page)) == 1  # the failure's map
    assert "import json" not in page  # the code is hidden
    assert not testing._listeners


@pytest.mark.slow
def test_xdist_workers_rows_are_merged_by_the_controller(pytester, monkeypatch):
    monkeypatch.setattr("attnlib.pytest_plugin.RENDER_MODULES", ("no_such_module_for_attnlib",))  # JSON only
    result = run(pytester, "-n", "2", "--attnlib-report", "out", "-W", "ignore::pytest.PytestWarning")
    result.assert_outcomes(passed=3, failed=1)
    check_rows(json.loads((pytester.path / "out" / "pytest_report.json").read_text()))
    assert [p.name for p in (pytester.path / "out").iterdir()] == ["pytest_report.json"]  # workers' files gone


def test_without_the_report_extra_a_warning_and_the_rows(pytester, monkeypatch):
    monkeypatch.setattr("attnlib.pytest_plugin.RENDER_MODULES", ("papermill", "no_such_module_for_attnlib"))
    result = run(pytester, "--attnlib-report", "out")
    result.assert_outcomes(passed=3, failed=1, warnings=1)
    out = result.stdout.str()
    assert ("PytestWarning: attnlib: --attnlib-report renders HTML with the report extra "
            "(no_such_module_for_attnlib not importable): pip install 'attnlib[report]'") in out
    assert "attnlib: 4 kernel verdicts, 1 failed; rows in " in out
    check_rows(json.loads((pytester.path / "out" / "pytest_report.json").read_text()))
    assert not (pytester.path / "out" / "pytest_report.html").exists()


def test_a_render_that_fails_is_a_warning_not_a_failure(pytester, monkeypatch, tmp_path):
    monkeypatch.setattr("attnlib.pytest_plugin.NOTEBOOK", tmp_path / "gone.ipynb")
    result = run(pytester, "--attnlib-report", "out")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=3, failed=1, warnings=1)
    result.stdout.fnmatch_lines(["*PytestWarning: attnlib: the HTML report could not be rendered "
                                 "(NotebookError: gone.ipynb failed: FileNotFoundError*); the rows are in *"])
    assert [p.name for p in (pytester.path / "out").iterdir()] == ["pytest_report.json"]


def test_without_its_options_the_plugin_writes_and_says_nothing(pytester):
    pytester.makepyfile(test_quiet=SUITE.replace("attnlib_case", "case").replace(", indirect=True", ""))
    before = {p.name for p in pytester.path.iterdir()}
    outputs = [pytester.runpytest("-p", "no:cacheprovider", *plugin) for plugin in ([], ["-p", "no:attnlib"])]
    for result in outputs:
        result.assert_outcomes(passed=3, failed=1)
    lines = [[re.sub(r"in [\d.]+s", "", line) for line in result.outlines if not line.startswith("plugins:")]
             for result in outputs]  # the header lists attnlib among the plugins, or not
    assert lines[0] == lines[1]
    # Python's own bytecode cache aside (pytest writes it where bytecode may be written).
    assert {p.name for p in pytester.path.iterdir()} - {"__pycache__"} == before
    assert not testing._listeners and testing._default_device is None


@pytest.mark.slow
def test_attnlib_device_sets_the_default_and_is_validated(pytester):
    pytest.importorskip("torch")
    pytester.makepyfile(test_device='''
        import attnlib
        import attnlib.testing as t

        def test_default(monkeypatch):
            seen, real = [], t.check_kernel
            monkeypatch.setattr(t, "check_kernel", lambda *a, **kw: seen.append(kw["device"]) or real(*a, **kw))
            q, k, v = attnlib.random_qkv(16, 16, 8, heads=2, seed=0)
            t.assert_attention_close(attnlib.attention(q, k, v), q, k, v, layout="bhsd")
            t.assert_attention_close(attnlib.attention(q, k, v), q, k, v, layout="bhsd", device="cpu:0")
            assert seen == ["cpu", "cpu:0"]
    ''')
    pytester.runpytest("-p", "no:cacheprovider", "--attnlib-device", "cpu").assert_outcomes(passed=1)
    assert testing._default_device is None  # restored at the end of the session
    bad = pytester.runpytest("-p", "no:cacheprovider", "--attnlib-device", "nowhere")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--attnlib-device nowhere: device='nowhere' is not a torch device such as*"])


def test_attnlib_case_runs_a_test_at_each_common_shape(pytester):
    pytester.makepyfile(test_shapes="def test_shape(attnlib_case):\n    assert attnlib_case.qkv()[0].ndim == 4\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-v", "-k", "decode")  # the cheap ones
    result.assert_outcomes(passed=2, deselected=2)
    result.stdout.fnmatch_lines(["*test_shape?decode-d64? PASSED*", "*test_shape?decode-gqa-d128? PASSED*"])
    assert {c.name for c in CASES} == {"prefill-d64", "prefill-gqa-d128", "decode-d64", "decode-gqa-d128"}


def test_case_makes_seeded_inputs_in_either_layout():
    case = Case("tiny", batch=1, heads=4, kv_heads=2, seqlen_q=8, seqlen_k=16, head_dim=8, seed=3)
    q, k, v = case.qkv()
    assert (q.shape, k.shape, v.shape, q.dtype) == ((1, 8, 4, 8), (1, 16, 2, 8), (1, 16, 2, 8), np.float32)
    qh, kh, _ = case.qkv("float16", layout="bhsd")
    assert qh.shape == (1, 4, 8, 8) and qh.dtype == np.float16
    np.testing.assert_array_equal(qh, q.swapaxes(1, 2).astype(np.float16))
    np.testing.assert_array_equal(case.qkv()[1], k)  # seeded
    with pytest.raises(ValueError, match="layout must be 'bshd' or 'bhsd', got 'thd'"):
        case.qkv(layout="thd")
    with pytest.raises(ValueError, match="dtype must be a floating type, got 'int32'"):
        case.qkv("int32")
    with pytest.raises(ValueError, match=r"heads \(3\) must be a multiple of kv_heads \(2\)"):
        Case("bad", batch=1, heads=3, kv_heads=2, seqlen_q=1, seqlen_k=1, head_dim=8)
    with pytest.raises(TypeError, match="seqlen_q must be an int, got 1.5"):
        Case("bad", batch=1, heads=2, kv_heads=2, seqlen_q=1.5, seqlen_k=1, head_dim=8)


def test_recording_collects_every_verdict_passing_or_failing():
    q, k, v = attnlib.random_qkv(32, 32, 16, heads=2, seed=0)
    out = attnlib.attention(q, k, v)
    with recording() as outer:
        with recording() as inner:
            assert_attention_close(out, q, k, v, layout="bhsd")
        with pytest.raises(AssertionError):
            assert_attention_close(out, q, k, v, layout="bhsd", causal=True)
        record(check_kernel(q, k, v, out, layout="bhsd"))
    assert [r.passed for r in inner] == [True] and [r.passed for r in outer] == [True, False, True]
    assert not testing._listeners
    with pytest.raises(TypeError, match="result must be a KernelCheck"):
        record({"passed": True})
