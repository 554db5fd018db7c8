"""`kernelgraft bench`'s command line answers --help without importing torch, and a bad argument is
one line with exit code 2, before the suite (and torch) is loaded."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
from kernelgraft import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("torch imported:", "torch" in sys.modules, "exit:", code, file=sys.stderr)
"""


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK, "bench", *args], capture_output=True, text=True, timeout=120)


def test_bench_help_lists_every_option_with_its_values_without_torch():
    run = _bench("--help")
    assert "torch imported: False exit: 0" in run.stderr, run.stderr
    for option in ("--out", "--parts", "--shapes", "--modes", "--steps", "--profile", "--turns"):
        assert option in run.stdout
    assert "patterns,lm_head,steps,curves,decode" in run.stdout  # the valid parts, listed


def test_a_bad_bench_argument_is_one_line_before_any_work():
    run = _bench("--steps", "x")
    lines = [line for line in run.stderr.splitlines() if not line.startswith("torch imported")]
    assert lines == ["kernelgraft bench: error: argument --steps: invalid int value: 'x'; see kernelgraft bench --help"]
    assert "torch imported: False exit: 2" in run.stderr
