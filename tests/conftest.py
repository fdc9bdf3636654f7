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
