import contextlib
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# CI never flakes: derandomized, bounded, no deadline.  Locally: random, still no deadline
# (timings on this shared machine are noise).
settings.register_profile(
    "ci", derandomize=True, max_examples=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture
def strict():
    """The contract's strict floating-point mode."""
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        yield


@pytest.fixture(scope="session")
def dask_client():
    """One LocalCluster of two worker processes for the whole pytest run (per xdist worker),
    shared by every module that computes on a cluster: a cluster start costs seconds."""
    import distributed  # the [distributed] extra; make test installs it

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as c:
        yield c


#: Modules slow as a whole (clusters, fresh processes, every notebook run): `make test-fast`
#: leaves them out.  Single slow tests carry ``@pytest.mark.slow`` where they are defined
#: (those over 1 s on a loaded 2-core machine, measured with --durations=0).
SLOW_MODULES = {"test_distributed", "test_edges_distributed", "test_cli_cluster", "test_scaleout",
                "test_memory", "test_fresh", "test_notebooks", "test_notebooks_measured",
                "test_report_framework"}


#: The modules with the most seconds of tests, longest first (--durations=0 on a 2-core machine):
#: they run first, so that pytest-xdist's workers (`make test`: --dist loadfile with
#: --no-loadscope-reorder, which keeps this order) end together on the many short files rather
#: than one waiting on a notebook module handed out last.
LONGEST_FIRST = ("test_notebooks", "test_distributed", "test_notebooks_measured", "test_compat_pytorch",
                 "test_edges_distributed", "test_masks", "test_cli_cluster", "test_scaleout",
                 "test_torch_bench", "test_attention", "test_memory", "test_docs", "test_pytest_plugin")


def _module_name(item):
    module = getattr(item, "module", None)  # doctests have none
    return None if module is None else module.__name__.rpartition(".")[2]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _module_name(item) in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module_name(item), len(rank)))  # stable: the rest in order


#: The CPUs this process could use before `pytest_configure` kept it to its share.
ALL_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@contextlib.contextmanager
def every_cpu():
    """Every CPU for tests that measure the machine (the scale-out report's clusters of 1 and 2
    workers, performance's thread counts, notebooks side by side) and those that compare the
    kernels' default thread count (every CPU) with one thread; the worker's share after."""
    if not ALL_CPUS:
        yield
        return
    share = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, ALL_CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, share)


@pytest.fixture
def all_cpus():
    with every_cpu():
        yield


@pytest.fixture(scope="module")
def all_cpus_module():
    with every_cpu():
        yield


def pytest_configure(config):
    """Under pytest-xdist, each worker process keeps to its share of the CPUs (`make test`: one
    worker per core), so the kernels' default thread count (every CPU the process may use) is
    that share: two threads per worker on a core the other worker holds paid for GIL hand-offs
    and thread starts on every call, for no parallelism (eight kernel test files, 2 workers:
    36.5-37.8 s unpinned, 31.8-32.5 s pinned).  Tests that ask for threads still get them."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cpus, count = sorted(os.sched_getaffinity(0)), int(count)
    if count <= len(cpus):
        os.sched_setaffinity(0, cpus[int(worker.removeprefix("gw")) :: count])
