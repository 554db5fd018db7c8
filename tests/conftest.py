import os
import sys
from pathlib import Path

import pytest
import torch

# The shared test modules (tiny models, the op checks, the Trainer's helpers, the subprocess workers)
# live in tests/helpers/: on the path, every test folder imports them by name.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
from run_record import of_part, part  # noqa: E402  (on the path from the line above)

# Hypothesis: a small profile in CI (CPU, Triton interpreter), a thorough one on the GPU.
try:
    from hypothesis import HealthCheck, settings

    # ci draws the same examples on every run (derandomize): a landing never hangs on a new draw; the
    # thorough profile draws anew each time, to explore (rare cases such as tests/gpu/test_gpu.py's float32
    # norm cases come from such draws)
    settings.register_profile(
        "ci", max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    settings.register_profile(
        "thorough", max_examples=200, deadline=None, suppress_health_check=list(HealthCheck)
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


def pytest_addoption(parser):
    parser.addoption(
        "--part",
        default=None,
        metavar="K/N",
        help="run the K-th of N parts of the selected tests (every N-th, from the K-th): a run longer "
        "than one sitting (pytest -m gpu) split into N",
    )
    parser.addoption(
        "--record-json",
        default=None,
        metavar="PATH",
        help="write the run as a JSON record to PATH ({date}: the day it started): counts, failing and "
        "slowest tests, commit, GPU and versions (tests/helpers/run_record.py); `make gpu-test` keeps "
        "it under benchmarks/results/gpu_tests/",
    )


def pytest_configure(config):
    path = config.getoption("--record-json")
    # the controller alone: under pytest-xdist it sees every worker's reports, and one file is written
    if path and not hasattr(config, "workerinput"):
        from run_record import PytestRecord

        config.pluginmanager.register(PytestRecord(config, path), "record-json")


def _part(spec: str) -> tuple[int, int]:
    try:
        return part(spec)
    except ValueError as e:
        raise pytest.UsageError(f"--part {e}") from None


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--part")
    if spec:
        k, n = _part(spec)
        keep = set(of_part(items, k, n))
        dropped = [it for it in items if it not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [it for it in items if it in keep]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on one)")
    for item in items:
        if item.get_closest_marker("gpu"):  # a marker, not the folder (tests/gpu is also a keyword)
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state, whatever ran before it: an unseeded
    torch.randn does not depend on the order or selection of tests (otherwise a bf16 check that holds
    for 5 seeds in 6 could pass alone and fail in the full run)."""
    torch.manual_seed(0)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
