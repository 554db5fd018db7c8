import os

import pytest
import torch

# Hypothesis: a small profile in CI (CPU, Triton interpreter), a thorough one on the GPU.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    settings.register_profile(
        "thorough", max_examples=200, deadline=None, suppress_health_check=list(HealthCheck)
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
