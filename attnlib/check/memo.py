"""One reference per problem: the check's pure computations, shared by the kernels judged on it.

`check_kernel` computes, for every kernel it judges, the float64 reference, ``P @ |V|``, the
naive baselines, the dense gradients and the neighbouring problems its diagnosis tries: all
functions of the problem alone.  The measurements (`attnlib.check.power`,
`attnlib.check.mixups`) judge many kernels on one problem; inside `shared` each of those
computations runs once per distinct set of arguments and is handed back as a fresh copy, so
the verdicts are the same bits as without it (``tests/test_report_check_rule.py``), only
computed once.

Arguments are keyed by value (arrays by shape, type, a 64-bit sum and two checksums of their bytes); a call with
an argument that has no such key (a function: a ``mask_mod``, a ``score_mod``) runs uncached.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import zlib

import numpy as np

from ..core import problem


class _Uncacheable(Exception):
    pass


def _key(x):
    if x is None or isinstance(x, (bool, int, float, str, complex, np.generic)):
        return (type(x).__name__, x)
    if isinstance(x, np.ndarray):
        return _array_key(x)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__,) + tuple(_key(y) for y in x)
    if isinstance(x, dict):
        return ("dict",) + tuple((k, _key(v)) for k, v in sorted(x.items()))
    if isinstance(x, problem.Precision):
        return ("precision", x.name, None if x.p_type is None else x.p_type.name)
    if isinstance(x, np.dtype):
        return ("dtype", x.str)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # Options: every field by value
        return (type(x).__name__,) + tuple((f.name, _key(getattr(x, f.name))) for f in dataclasses.fields(x))
    raise _Uncacheable(type(x).__name__)


#: ``id(array) -> (array, its sum, its key)`` for the arrays keyed in this `shared` context: one
#: array passed to many calls is hashed once (its sum re-checked on each call; the array is
#: held, so its id is not reused).
_SEEN: dict = {}
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: a change of one entry always changes the sum


def _sum(x) -> int:
    """The array's bytes summed as 64-bit words (times an odd constant, wrapping), with the tail."""
    b = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    n = b.size // 8 * 8
    with np.errstate(over="ignore"):
        words = int((b[:n].view(np.uint64) * _MULT).sum(dtype=np.uint64))
    return words ^ int.from_bytes(b[n:].tobytes(), "little")


def _array_key(x):
    seen = _SEEN.get(id(x))
    total = _sum(x)
    if seen is not None and seen[0] is x and seen[1] == total:
        return seen[2]
    data = np.ascontiguousarray(x).reshape(-1).view(np.uint8).data
    key = ("array", x.shape, x.dtype.str, total, zlib.crc32(data), zlib.adler32(data))
    _SEEN[id(x)] = (x, total, key)
    return key


def _copy(x):
    """A result as fresh arrays: a caller that writes into one cannot change the cached one."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, (tuple, list)):
        return type(x)(_copy(y) for y in x)
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    return copy.copy(x)


def _memoized(fn, cache, lock, stats):
    def run(*args, **kwargs):
        try:
            key = (id(fn), _key(args), _key(kwargs))
        except _Uncacheable:
            stats["uncached"] += 1
            return fn(*args, **kwargs)
        with lock:
            hit = key in cache
        if not hit:
            result = fn(*args, **kwargs)
            with lock:
                cache[key] = result
            stats["computed"] += 1
        else:
            stats["reused"] += 1
        return _copy(cache[key])
    run.__wrapped__ = fn
    return run


def _targets():
    from . import diagnosis, gradrule, rule, verdict
    return [(rule, "forward_on"), (rule, "dense_attention"), (gradrule, "dense_backward"), (gradrule, "tiled_backward"),
            (verdict, "dense_backward"), (verdict, "forward_on"), (diagnosis, "forward_on")]


@contextlib.contextmanager
def shared(*extra):
    """Within it, the check's pure computations (and ``extra``: ``(module, name)`` pairs) run
    once per distinct arguments; yields the counts ``{"computed", "reused", "uncached"}``.
    Leave it between problems (the cache holds every result until then)."""
    cache, lock = {}, threading.Lock()
    stats = {"computed": 0, "reused": 0, "uncached": 0}
    saved = []
    try:
        for module, name in _targets() + list(extra):
            fn = getattr(module, name)
            saved.append((module, name, fn))
            setattr(module, name, _memoized(fn, cache, lock, stats))
        yield stats
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)
        cache.clear()
        _SEEN.clear()


__all__ = ["shared"]
