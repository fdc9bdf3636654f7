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
