"""The package's text speaks of the software as it is: no file under kernelgraft/ carries a date
(YYYY-MM-DD) or speaks of another build ("the build before", "this build"). Figures with a date
belong to the results (benchmarks/) or to a tuning table's provenance, without the date."""

import re
from pathlib import Path

import kernelgraft

PACKAGE = Path(kernelgraft.__file__).resolve().parent
# a calendar date, or a phrase that compares builds
STALE = re.compile(
    r"\b\d{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b|\bbuild before\b|\bthis build\b", re.IGNORECASE
)
SKIPPED_SUFFIXES = {".pyc", ".pyo", ".so"}


def package_files() -> list[Path]:
    return sorted(
        p
        for p in PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in SKIPPED_SUFFIXES
    )


def stale_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line of `text` with a date or a comparison of builds."""
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1) if STALE.search(line)]


def test_the_pattern_finds_dates_and_build_comparisons_and_nothing_else():
    text = (
        "# tuned 2026-11-30 on a GPU\n"
        "# slower than the build before\n"
        "# This build sums in float64\n"
        "# 4096 wide, 0.084 ms\n"
        "# rebuild before launching\n"
        "x = f(2026 - 11 - 30)\n"
        "# a version 5.24, a shape 8192-4096-128256\n"
    )
    assert [n for n, _ in stale_lines(text)] == [1, 2, 3]


def test_no_package_file_has_a_date_or_speaks_of_another_build():
    files = package_files()
    assert PACKAGE / "__init__.py" in files and PACKAGE / "kernels" / "rows" / "launch_configs.json" in files
    found = [
        f"{p.relative_to(PACKAGE.parent)}:{n}: {line}"
        for p in files
        for n, line in stale_lines(p.read_bytes().decode("utf-8", errors="replace"))
    ]
    assert not found, f"{len(found)} lines with a date or a build comparison:\n" + "\n".join(found)
