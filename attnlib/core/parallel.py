"""Work units and the thread pool the kernels run them on, with the process-wide settings
(GIL switch interval, one BLAS thread) that make the threads pay.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
from threadpoolctl import ThreadpoolController


#: Bytes of one score tile ``(..., block_k, block_q)`` that a work unit aims at: heads are
#: grouped into a unit up to this size, so that the tile and its exponentials stay in a
#: core's L2 cache (1-2 MiB on the machines measured) while a unit still batches enough
#: heads for its matmuls to dwarf the per-tile Python work.  (1, 8, 4096, 64) causal on
#: one thread: 0.5 MiB units (one head) took 654 ms, 4 MiB (all eight heads) 672 ms;
#: decode (Sq = 1) puts hundreds of heads in one unit instead of one per unit.
_UNIT_BYTES = 1 << 20
#: Fewest work units worth making when heads can be split further (decode: one query
#: tile), so that threads have something to share; fixed, not taken from ``workers``,
#: so that the grouping, and with it every rounding, is the same for any thread count.
_MIN_UNITS = 8


def work_units(lead: tuple, n_rows: int, n_keys: int, n_q_tiles: int, itemsize: int = 8) -> list:
    """Split the head axes ``lead`` into work units: a list of index tuples into ``lead``.

    Each unit is an index that selects a block of whole heads (ints on the leading axes,
    then one slice), as many as keep a ``(heads, n_keys, n_rows)`` score tile within
    `_UNIT_BYTES`, but no more than leave `_MIN_UNITS` units over all ``n_q_tiles``, unless
    that would make a unit's tile smaller than an eighth of `_UNIT_BYTES` (decode: one
    query row per head, so hundreds of heads make one worthwhile step).
    Together the units cover every head exactly once, in C order.
    """
    n = math.prod(lead)
    head_tile = max(1, n_rows) * max(1, n_keys)  # scores per head in one tile
    per_unit = max(1, _UNIT_BYTES // (itemsize * head_tile))
    # Split further for more units, but not into tiles too small to be worth a step.
    smallest = -(-_UNIT_BYTES // (8 * itemsize * head_tile))
    per_unit = min(per_unit, max(smallest, n // -(-_MIN_UNITS // max(1, n_q_tiles))))  # both >= 1
    # The unit spans axes j.. whole (their product fits), and a chunk of axis j - 1.
    j = len(lead)
    while j > 0 and math.prod(lead[j - 1:]) <= per_unit:
        j -= 1
    if j == 0:
        return [()]
    inner = math.prod(lead[j:])
    chunk = max(1, per_unit // inner)
    return [u + (slice(c, min(c + chunk, lead[j - 1])),)
            for u in np.ndindex(*lead[:j - 1]) for c in range(0, lead[j - 1], chunk)]


def _unit_of(arr, unit: tuple):
    """``arr[unit]`` for an array whose head axes broadcast against the unit's: a size-1
    axis gives its one entry (index 0, or whole where the unit takes a slice)."""
    return arr[tuple(i if n != 1 else slice(None) if isinstance(i, slice) else 0
                     for n, i in zip(arr.shape, unit))]


class Aborted(Exception):
    """Raised in a worker that stops waiting because another worker failed."""


class Turns:
    """The additions to each ``dq`` tile in a fixed order across threads (both backwards):
    ``rank[..., a, b]`` is key tile ``b``'s turn at query tile ``a``, per leading index ``u``
    (a work unit's own heads; ``()`` when there is one); `turn` waits for it."""

    def __init__(self, rank: np.ndarray, threaded: bool):
        self.rank = rank
        self.done = np.zeros(rank.shape[:-1], dtype=np.int64)  # additions made per (unit, query tile)
        self.cond = threading.Condition() if threaded else None
        self.aborted = False

    @contextlib.contextmanager
    def turn(self, u, a, b):
        if self.cond is None:  # serial: key tiles come in order
            yield
            return
        at = u + (a,)
        with self.cond:
            self.cond.wait_for(lambda: self.aborted or self.done[at] == self.rank[at + (b,)])
            if self.aborted:
                raise Aborted("another worker failed")
        try:
            yield  # only this thread may add to query tile a now
        finally:
            with self.cond:
                self.done[at] += 1
                self.cond.notify_all()

    def abort(self):
        if self.cond is not None:
            with self.cond:
                self.aborted = True
                self.cond.notify_all()


def run_tiles(fn, items, workers: int) -> None:
    """``fn(item)`` for each item: in order when ``workers == 1``, else on a thread pool.

    numpy releases the GIL in matmul and ufuncs, so threads run tiles in parallel.  Two
    things do not cross into the threads by themselves and are carried over here: the
    caller's floating-point error state (numpy keeps it per thread, so strict mode would
    silently not apply) and a BLAS limited to one thread; the GIL switch interval is
    shortened meanwhile (both process-wide: see `_parallel_settings`).  BLAS is held to
    one thread with one worker too: tile-sized matmuls gain nothing from BLAS threads and
    lose badly to a busy machine.

    Each thread takes the next item in order from a shared counter, so an item starts only
    after every earlier one has started, and the bookkeeping is a few objects per thread,
    not one per item (a future per tile grew with the number of tiles).  After a failure no
    new item starts; the first exception in item order that is not `Aborted` is re-raised.
    """
    items = list(items)
    if workers == 1 or len(items) < 2:
        with _parallel_settings():
            for item in items:
                fn(item)
        return
    errors = np.geterr()
    lock = threading.Lock()
    cursor = iter(range(len(items)))
    failures = []  # (item index, exception)

    def worker():
        with np.errstate(**errors):
            while True:
                with lock:
                    i = None if failures else next(cursor, None)
                if i is None:
                    return
                try:
                    fn(items[i])
                except BaseException as e:  # reported by the caller's thread below
                    with lock:
                        failures.append((i, e))
                    return

    with _parallel_settings(), ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in range(min(workers, len(items))):
            pool.submit(worker)
    # Leaving the pool waited for every thread, so each failure is known.
    if failures:
        failures.sort(key=lambda f: f[0])
        raise next((e for _, e in failures if not isinstance(e, Aborted)), failures[0][1])


#: The GIL switch interval while workers run (Python's default is 5 ms).  Between the
#: large numpy calls that release the GIL, a tile does a dozen small ones (per-row max,
#: alpha, rescale) that hold it; a thread that then asks for the GIL waits up to the switch
#: interval for the other to let go.  Measured on (1, 1, 4096, 64) causal with 2 workers,
#: median of 15 interleaved runs, two runs: 75-79 ms at 5 ms, 77-78 ms at 0.1 ms, 54-58 ms
#: at 10 us, 50-57 ms at 1 us (1 worker: 81-102 ms); with 8 heads 502 ms at 0.1 ms and
#: 473 ms at 1 us.
_SWITCH_INTERVAL = 1e-6

# The state of `_parallel_settings`, shared by every thread of the process.
_settings_lock = threading.Lock()
_settings_users = 0  # calls inside the guard now
_settings_saved = None  # (switch interval, BLAS limiter or None) seen by the first entrant


def _blas_controller() -> ThreadpoolController:
    """The BLAS libraries loaded (about 1 ms to find), found again once modules were imported
    since: a library loaded later (scipy's own OpenBLAS) was left at its threads."""
    return _controller_for(len(sys.modules))


@lru_cache(maxsize=1)
def _controller_for(modules: int) -> ThreadpoolController:
    return ThreadpoolController()


@contextlib.contextmanager
def _parallel_settings():
    """Process-wide settings for our worker threads, reference-counted across threads.

    Two settings belong to the whole process, not to a call: the GIL switch interval is
    shortened to `_SWITCH_INTERVAL` (see there), and BLAS is limited to one thread
    (threadpoolctl; about 5 us).  Our threads already keep the cores busy, and a tile's
    matmuls are too small for BLAS threads to pay: a multithreaded BLAS inside each worker
    oversubscribes the machine (2 workers were 1.5x slower than 1 with a 2-thread
    OpenBLAS, and 1.6x faster with a 1-thread one), and even one worker with a 2-thread
    OpenBLAS took 1393 ms instead of 55 ms for (1, 1, 4096, 64) causal while another
    process kept a core busy: BLAS threads spin waiting for each other.

    Calls may overlap (threads each running ``attention(..., workers=2)``), so each cannot
    simply restore what it saw on entry: the second would see the first one's settings
    and put them back after the first had restored the originals, leaving them for the
    rest of the process.  Instead, under one lock, the first entrant saves the originals
    and applies the settings, later ones only count themselves in, and the last one out
    restores the originals, exactly once.  Nesting in one thread works the same way.
    """
    global _settings_users, _settings_saved
    with _settings_lock:
        if _settings_users == 0:
            old = sys.getswitchinterval()
            limiter = _blas_controller().limit(limits=1, user_api="blas")
            sys.setswitchinterval(min(old, _SWITCH_INTERVAL))
            _settings_saved = (old, limiter)
        _settings_users += 1
    try:
        yield
    finally:
        with _settings_lock:
            _settings_users -= 1
            if _settings_users == 0:
                old, limiter = _settings_saved
                _settings_saved = None
                sys.setswitchinterval(old)
                limiter.restore_original_limits()
