"""tests/conftest.py's options for the GPU runs: `--part K/N`, a long run (pytest -m gpu) split into N
parts that together select every test once, and `--record-json PATH`, the run kept as a JSON record;
and `make gpu-test`, which passes both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import pytest_collection_modifyitems, pytest_configure


class _Config:
    def __init__(self, part):
        self.part = part
        self.deselected = []
        self.hook = self

    def getoption(self, name):
        assert name == "--part"
        return self.part

    def pytest_deselected(self, items):
        self.deselected += items


class _Item:
    def __init__(self, i, marked=True, keywords=("gpu",)):
        self.i, self.marked, self.added = i, marked, []
        self.keywords = dict.fromkeys(keywords, True)

    def get_closest_marker(self, name):
        return pytest.mark.gpu.mark if name == "gpu" and self.marked else None

    def add_marker(self, marker):
        self.added.append(marker)


@pytest.mark.parametrize("n_items, n", [(126, 3), (10, 4), (3, 5), (1, 1)])
def test_the_parts_select_every_test_once(n_items, n):
    items = [_Item(i) for i in range(n_items)]
    seen = []
    for k in range(1, n + 1):
        part, config = list(items), _Config(f"{k}/{n}")
        pytest_collection_modifyitems(config, part)
        seen += [it.i for it in part]
        assert sorted(it.i for it in part + config.deselected) == list(range(n_items))
        assert len(part) in (n_items // n, -(-n_items // n))  # about as long as each other
    assert sorted(seen) == list(range(n_items))


@pytest.mark.parametrize("spec", ["3", "0/2", "3/2", "a/b"])
def test_a_malformed_part_says_what_it_wants(spec):
    with pytest.raises(pytest.UsageError, match="K/N"):
        pytest_collection_modifyitems(_Config(spec), [_Item(0)])


def test_without_cuda_only_tests_marked_gpu_are_skipped(monkeypatch):
    # a test in tests/gpu has "gpu" among its keywords (the folder) without the marker: it runs
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    marked, in_the_folder, plain = _Item(0), _Item(1, marked=False), _Item(2, marked=False, keywords=())
    pytest_collection_modifyitems(_Config(None), [marked, in_the_folder, plain])
    assert [m.name for m in marked.added] == ["skip"]
    assert in_the_folder.added == [] and plain.added == []


ROOT = Path(__file__).resolve().parents[2]
FOUR_OUTCOMES = """
import pytest

def test_passes():
    pass

def test_fails():
    assert False

@pytest.mark.xfail(strict=True)
def test_expected_to_fail():
    assert False

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("in setup")

def test_errors_in_setup(broken):
    pass
"""


def test_record_json_counts_a_run_under_xdist(tmp_path):
    # tests/conftest.py loaded as a plugin into a run of its own (an empty ini: none of the project's
    # options), with one xdist worker: the controller writes what the worker reported
    (tmp_path / "test_four.py").write_text(FOUR_OUTCOMES)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    env.pop("HYPOTHESIS_PROFILE", None)
    record = tmp_path / "out" / "{date}-gpu-test.json"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-n", "1"]
    cmd += ["--record-json", str(record), "test_four.py"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    (path,) = (tmp_path / "out").glob("*.json")
    rec = json.loads(path.read_text())
    assert path.name == f"{rec['date']}-gpu-test.json" and f"record: {path}" in p.stdout
    assert rec["counts"] == {"passed": 1, "failed": 1, "xfailed": 1, "xpassed": 0, "skipped": 1, "errors": 1}
    assert rec["failures"] == ["test_four.py::test_fails", "test_four.py::test_errors_in_setup"]
    names = ["test_passes", "test_fails", "test_expected_to_fail", "test_skipped", "test_errors_in_setup"]
    assert sorted(s["test"] for s in rec["slowest"]) == sorted(f"test_four.py::{t}" for t in names)
    assert rec["workers"] == 1 and rec["exit_status"] == 1 and rec["profile"] == "ci" and rec["wall_s"] > 0
    assert rec["command"].startswith("pytest -q -p conftest")
    assert set(rec["versions"]) == {"torch", "triton", "transformers"} and rec["gpu"] is None
    assert rec["commit"] is None or (len(rec["commit"]) == 40 and isinstance(rec["dirty"], bool))


class _PluginConfig:
    def __init__(self, path, worker):
        self.path, self.registered = path, []
        self.pluginmanager = self
        if worker:
            self.workerinput = {}

    def getoption(self, name):
        return {"--record-json": self.path, "--part": None}[name]

    def register(self, plugin, name):
        self.registered.append(name)


@pytest.mark.parametrize(
    "path, worker, registered", [("r.json", False, ["record-json"]), ("r.json", True, []), (None, False, [])]
)
def test_only_the_controller_records(path, worker, registered):
    # a pytest-xdist worker has workerinput; its reports reach the controller, which writes the one file
    config = _PluginConfig(path, worker)
    pytest_configure(config)
    assert config.registered == registered


def _make(*args):  # make runs the README's commands: a machine that runs the tests has it
    p = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return [line for line in p.stdout.splitlines() if "-m pytest" in line]


def test_make_gpu_test_runs_every_gpu_test_in_workers_and_records_it():
    (line,) = _make("gpu-test")
    assert " -m pytest -q -m gpu -n 4 --dist worksteal " in line and "--part" not in line
    assert "--record-json 'benchmarks/results/gpu_tests/{date}-gpu-test.json'" in line
    (line,) = _make("gpu-test", "PART=2/4", "GPU_WORKERS=3", "GPU_RECORDS=/tmp/back")
    assert "-n 3 " in line and line.endswith("--part 2/4")
    assert "--record-json '/tmp/back/{date}-gpu-test-2-of-4.json'" in line
