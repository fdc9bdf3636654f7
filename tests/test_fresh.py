"""`attnlib.evidence.fresh.run_fresh`: one call in a fresh Python process, JSON both ways."""

import functools
import os
import signal
import sys
import time
import types

import pytest

from attnlib.evidence.fresh import FreshProcessError, FreshTimeout, run_fresh


def echo(*args, **kwargs):
    return {"args": args, "kwargs": kwargs}


def noisy(value):
    print("not the result", flush=True)
    print('{"a": "json line on stdout"}')
    print("warnings and the like", file=sys.stderr)
    return value


def fails(message):
    raise ValueError(message)


def sleeps(seconds):
    time.sleep(seconds)
    return seconds


def environment(name):
    return os.environ.get(name)


def exits_without_result():
    os._exit(0)


def killed():
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_result_round_trips():
    got = run_fresh(echo, 1, 2.5, "x", [1, None], (3, 4), key={"nested": [True, False]})
    assert got == {"args": [1, 2.5, "x", [1, None], [3, 4]], "kwargs": {"key": {"nested": [True, False]}}}


def test_prints_of_the_called_code_do_not_corrupt_the_result():
    assert run_fresh(noisy, [1, 2, 3]) == [1, 2, 3]


def test_a_failing_function_raises_with_the_childs_error():
    with pytest.raises(FreshProcessError, match="exit status 1") as info:
        run_fresh(fails, "the child's own words 1234")
    assert isinstance(info.value, RuntimeError) and info.value.returncode == 1
    assert "ValueError: the child's own words 1234" in str(info.value)
    assert "Traceback" in info.value.stderr


def test_a_timeout_raises_and_kills_the_child():
    start = time.perf_counter()
    with pytest.raises(FreshTimeout, match="timed out after 1 s"):
        run_fresh(sleeps, 60, timeout=1)
    assert time.perf_counter() - start < 30


def test_no_result_and_a_signal_are_failures():
    with pytest.raises(FreshProcessError, match="no result"):
        run_fresh(exits_without_result)
    with pytest.raises(FreshProcessError, match=f"killed by signal {signal.SIGKILL}"):
        run_fresh(killed)


def test_environment_is_inherited_and_extended(monkeypatch):
    monkeypatch.setenv("ATTNLIB_FRESH_TEST", "inherited")
    assert run_fresh(environment, "ATTNLIB_FRESH_TEST") == "inherited"
    assert run_fresh(environment, "ATTNLIB_FRESH_TEST", env={"ATTNLIB_FRESH_TEST": "set"}) == "set"
    assert run_fresh(environment, "ATTNLIB_FRESH_TEST", env={"ATTNLIB_FRESH_TEST": None}) is None


def test_lambdas_nested_functions_and_unnamed_objects_are_refused():
    with pytest.raises(ValueError, match="lambda or a nested function"):
        run_fresh(lambda: 1)

    def nested():
        return 1

    with pytest.raises(ValueError, match="lambda or a nested function"):
        run_fresh(nested)
    with pytest.raises(ValueError, match="no __module__/__qualname__"):
        run_fresh(functools.partial(echo, 1))
    with pytest.raises(ValueError, match="does not name"):  # its names lead to another object
        run_fresh(types.FunctionType(echo.__code__, globals(), "echo"))


def test_arguments_that_are_not_json_are_refused_here():
    with pytest.raises(TypeError):
        run_fresh(echo, object())


def test_the_child_is_fresh(tmp_path, monkeypatch):
    (tmp_path / "attnlib_fresh_probe.py").write_text(
        "import sys\n\n\ndef modules():\n    return sorted(sys.modules)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # found by the child through sys.path
    import numpy  # loaded here, not needed there
    import attnlib_fresh_probe

    assert numpy.__name__ in sys.modules and "pytest" in sys.modules
    loaded = run_fresh(attnlib_fresh_probe.modules)
    assert "attnlib_fresh_probe" in loaded
    for name in ("numpy", "pytest", "attnlib.core", "attnlib.evidence.memory", "subprocess", "pickle"):
        assert name not in loaded, name


def test_the_callers_measure_through_it():
    from attnlib.bench import gallery, masks

    got = gallery.peak(0, 64, 1, 16, 16, "attnlib", tool="tracemalloc")
    assert set(got) == {"bytes", "seconds"} and got["bytes"] > 0
    assert masks.peak_rss(0, 64, "no such implementation") == {
        "error": "exit status 1: [\"KeyError: 'no such implementation'\"]"}
