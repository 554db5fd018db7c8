"""A run of the GPU tests kept as data: one JSON file saying where and on what it ran and what passed.

`make gpu-test` writes one through tests/conftest.py's `--record-json PATH` (the `PytestRecord`
plugin below, on the controller of a pytest-xdist run) and `make gpu-test-thorough` through
tests/gpu/thorough_gpu.py's `--record PATH`, both into benchmarks/results/gpu_tests/, where
benchmarks/results_md.py lists the newest of each in RESULTS.md. A record holds the date, the commit
(`git rev-parse HEAD`) and whether tracked files differed from it (`dirty`), the GPU's name, the
torch, triton and transformers versions, the command, its wall seconds, the counts of each outcome
and the failing tests' ids; the pytest run adds its slowest tests, the thorough runner each spelling's
result, cases and seconds.

In PATH, `{date}` stands for the record's date (the day the run started, UTC: the file's name and its
`date` field agree however long the run) and `{part}` for the thorough runner's part, `K-of-N`.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import time
from collections import defaultdict
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DISTS = ("torch", "triton", "transformers")
COUNTS = ("passed", "failed", "xfailed", "xpassed", "skipped", "errors")
SLOWEST = 20


def part(spec: str) -> tuple[int, int]:
    """(K, N) of a part spec "K/N", 1 <= K <= N; ValueError saying what is wrong otherwise."""
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise ValueError(f"wants K/N (two integers, e.g. 2/4), got {spec!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"K/N needs 1 <= K <= N, got {spec!r}")
    return k, n


def of_part(items: list, k: int, n: int) -> list:
    """The K-th of N parts: every N-th item from the K-th (the parts about as long, a parametrized
    test's cases spread over them)."""
    return items[k - 1 :: n]


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def commit(root: Path = ROOT) -> tuple[str | None, bool | None]:
    """(HEAD's hash, whether tracked files differ from it); (None, None) outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return None, None


def gpu_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def versions() -> dict[str, str | None]:
    """The installed version of each of DISTS (None: not installed), read without importing them."""
    found = {}
    for dist in DISTS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def provenance(date: str) -> dict:
    """The fields every record starts with: date, commit, dirty, gpu, versions."""
    head, dirty = commit()
    return {"date": date, "commit": head, "dirty": dirty, "gpu": gpu_name(), "versions": versions()}


def filled(pattern: str, date: str, part: str = "") -> Path:
    """PATH with its `{date}` and `{part}` filled in."""
    return Path(pattern.replace("{date}", date).replace("{part}", part))


def write(pattern: str, record: dict, part: str = "") -> Path:
    path = filled(pattern, record["date"], part)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def outcome(report) -> str | None:
    """Which of COUNTS a phase's report adds to, as pytest's summary line counts it (None: none)."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if xfail:
            return "xfailed" if report.skipped else "xpassed"
        return {"passed": "passed", "failed": "failed", "skipped": "skipped"}[report.outcome]
    if report.failed:  # a setup or teardown that raised
        return "errors"
    if report.skipped:  # a skip mark, pytest.skip() in a fixture, or xfail(run=False)
        return "xfailed" if xfail else "skipped"
    return None


class PytestRecord:
    """The plugin behind `--record-json PATH`: registered on the controller alone, where pytest-xdist
    replays each worker's reports, it counts outcomes and sums each test's seconds as the reports
    arrive and writes the record when the session ends."""

    def __init__(self, config, pattern: str):
        self.config, self.pattern = config, pattern
        self.date, self.t0 = today(), time.monotonic()
        self.counts = dict.fromkeys(COUNTS, 0)
        self.failures: list[str] = []
        self.seconds: dict[str, float] = defaultdict(float)
        self.path: Path | None = None

    def _count(self, nodeid: str, what: str | None) -> None:
        if what is None:
            return
        self.counts[what] += 1
        if what in ("failed", "errors") and nodeid not in self.failures:
            self.failures.append(nodeid)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration
        self._count(report.nodeid, outcome(report))

    def pytest_collectreport(self, report):
        if report.failed:  # a test file that did not import
            self._count(report.nodeid, "errors")

    def pytest_sessionfinish(self, session, exitstatus):
        config = self.config
        slowest = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:SLOWEST]
        record = provenance(self.date) | {
            "tier": "gpu-test",
            "command": "pytest " + shlex.join(config.invocation_params.args),
            "profile": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
            "part": config.getoption("--part"),
            "workers": getattr(config.option, "numprocesses", None),
            "exit_status": int(exitstatus),
            "wall_s": round(time.monotonic() - self.t0, 1),
            "counts": self.counts,
            "failures": self.failures,
            "slowest": [{"test": t, "s": round(s, 2)} for t, s in slowest],
        }
        self.path = write(self.pattern, record)

    def pytest_terminal_summary(self, terminalreporter):
        if self.path is not None:
            terminalreporter.write_line(f"record: {self.path}")
