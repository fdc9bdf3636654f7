"""Run one call in a fresh Python process and return its JSON result.

A memory measurement is only worth something in a process that nothing else has touched:
no earlier run's buffers, no module the measured call does not need.  `run_fresh` starts a
new interpreter (``sys.executable -m attnlib.evidence.fresh``), which imports the module of
the function it is given (named by the function object itself, ``__module__`` and
``__qualname__``), calls it once and hands back what it returned.

Arguments and result travel as JSON (tuples come back as lists), never as pickles: the
request goes to the child on its standard input and the result comes back through a
temporary file of its own, so whatever the measured code prints (to stdout or stderr)
cannot corrupt it.  A child that fails, is killed, runs past its timeout or writes no
result raises `FreshProcessError` (a `RuntimeError`), with the child's stderr.

This module imports only the standard library, and the child only ``importlib``, ``json``
and ``sys`` before the target's module (`run_fresh` imports what it needs when called),
so that the fresh process holds what the measured call needs and nothing else.
"""

from __future__ import annotations

import importlib
import json
import sys

#: How much of the child's stderr a `FreshProcessError`'s message carries.
TAIL_LINES = 20


class FreshProcessError(RuntimeError):
    """The fresh process failed: ``how`` says how (exit status, signal, timeout, no
    result), ``returncode`` is its exit status (negative: a signal; None: timed out) and
    ``stderr`` all it wrote to stderr."""

    def __init__(self, target: str, how: str, returncode: int | None, stderr: str):
        self.target, self.how, self.returncode, self.stderr = target, how, returncode, stderr
        tail = "\n".join(stderr.strip().splitlines()[-TAIL_LINES:])
        super().__init__(f"{target} in a fresh process failed ({how})"
                         + (f":\n{tail}" if tail else ""))


class FreshTimeout(FreshProcessError):
    """The fresh process ran past its timeout (and was killed)."""


def target_of(fn) -> tuple[str, str]:
    """``(module, qualname)`` by which a fresh process finds ``fn``; ValueError where it
    cannot: a lambda, a function nested in another, or one defined in ``__main__``."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise ValueError(f"{fn!r} has no __module__/__qualname__ to be found by in a fresh process")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError(f"{module}.{qualname} is a lambda or a nested function: a fresh process "
                         "can only call a function defined at the top level of a module (or a "
                         "class there)")
    if module == "__main__":
        raise ValueError(f"{qualname} is defined in __main__, which a fresh process cannot "
                         "import: define it in a module")
    obj = sys.modules.get(module)
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        obj = None
    if obj is not fn and obj != fn:
        raise ValueError(f"{module}.{qualname} does not name {fn!r}: a fresh process would "
                         "call something else")
    return module, qualname


def run_fresh(fn, *args, timeout: float | None = 600.0, env: dict | None = None, **kwargs):
    """``fn(*args, **kwargs)`` in a fresh Python process; its JSON-able result.

    ``fn`` must be a function (or class) at the top level of an importable module (see
    `target_of`); ``args``/``kwargs`` and the result must survive ``json.dumps`` (tuples
    come back as lists).  The child inherits this process's environment and working
    directory; ``env`` adds variables to that environment (a value of None removes one),
    e.g. ``{"OMP_NUM_THREADS": "1"}``.  The child sees this process's ``sys.path``
    entries after its own, so a module importable here is importable there.

    Raises `FreshTimeout` past ``timeout`` seconds (the child is killed), and
    `FreshProcessError` where the child exits non-zero, is killed by a signal or writes
    no result; both carry the child's stderr.  (``timeout`` and ``env`` are this
    function's: pass an ``fn`` argument of those names positionally.)
    """
    import os
    import subprocess
    import tempfile

    module, qualname = target_of(fn)
    target = f"{module}.{qualname}"
    fd, result_path = tempfile.mkstemp(prefix="attnlib-fresh-", suffix=".json")
    os.close(fd)
    try:
        request = json.dumps(dict(module=module, qualname=qualname, args=args, kwargs=kwargs,
                                  result=result_path, path=[str(p) for p in sys.path]))
        child_env = None if env is None else {
            name: str(value) for name, value in {**os.environ, **env}.items() if value is not None}
        try:
            proc = subprocess.run([sys.executable, "-m", __spec__.name], input=request,
                                  capture_output=True, text=True, timeout=timeout, env=child_env)
        except subprocess.TimeoutExpired as e:
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
            raise FreshTimeout(target, f"timed out after {timeout} s", None, stderr) from None
        if proc.returncode != 0:
            how = (f"killed by signal {-proc.returncode} (e.g. out of memory)" if proc.returncode < 0
                   else f"exit status {proc.returncode}")
            raise FreshProcessError(target, how, proc.returncode, proc.stderr)
        with open(result_path) as f:
            text = f.read()
        if not text.strip():
            raise FreshProcessError(target, "exit status 0 but no result written", 0, proc.stderr)
        return json.loads(text)
    finally:
        os.unlink(result_path)


def run_fresh_or_error(fn, *args, timeout: float | None = 600.0, **kwargs) -> dict:
    """`run_fresh`, with a child that failed (not one that timed out, which still raises) as
    ``{"error": "<how>: [its last stderr line]"}``: for a table that shows the failure in
    its row."""
    try:
        return run_fresh(fn, *args, timeout=timeout, **kwargs)
    except FreshTimeout:
        raise
    except FreshProcessError as e:
        return {"error": f"{e.how}: {e.stderr.strip().splitlines()[-1:] or ''}"}


def _child() -> None:
    """The fresh process: read the request from stdin, call, write the result's JSON."""
    request = json.loads(sys.stdin.read())
    sys.path.extend(p for p in request["path"] if p not in sys.path)
    obj = importlib.import_module(request["module"])
    for part in request["qualname"].split("."):
        obj = getattr(obj, part)
    text = json.dumps(obj(*request["args"], **request["kwargs"]))
    with open(request["result"], "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    _child()
