"""Write benchmarks/RESULTS.md from the JSON files under benchmarks/results/.

`python benchmarks/results_md.py` writes it; `--check` exits 1 where the committed file differs.
Each table names the files it reads; a table reads the newest file (by the date its name starts
with) of each kind it asks for, so a new run saved as `<folder>/<date>-<kind>.json` replaces the
figures it measured. A cell is text with `{alias|path|format}` fields: path is a `/`-separated
walk into the JSON (a list step is an index or `key=value&key=value`), format one of FORMATS or
a Python format spec. Cells that are text only were derived by hand from the file they cite. A
table marked `optional` is left out until a file it reads exists; its rows may be a function of the
files' data, for a benchmark whose rows are the entries its run measured.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
OUT = ROOT / "RESULTS.md"

H200 = "NVIDIA H200"
FIELD = re.compile(r"\{([^{}|]+)\|([^{}|]+)\|([^{}|]*)\}")


def _e(v: float) -> str:
    mant, exp = f"{v:.2e}".split("e")
    return f"{mant}e{int(exp)}"


FORMATS = {
    "k": lambda v: f"{v / 1000:.1f}k",  # thousands, one decimal: 71,634 -> 71.6k
    "n": lambda v: f"{v:,.0f}",
    "n1": lambda v: f"{v:,.1f}",
    "e": _e,  # 0.00233 -> 2.33e-3
    "s": str,
}


def newest(kind: str) -> Path:
    """The newest `<folder>/<date>-<name>.json` for kind `folder/name`."""
    folder, name = kind.split("/", 1)
    if re.match(r"\d{4}-\d\d-\d\d-", name):  # a dated name asks for that file, not the newest
        name, found = name[11:], [RESULTS / folder / f"{name}.json"]
        found = [p for p in found if p.exists()]
    else:
        found = sorted((RESULTS / folder).glob(f"????-??-??-{name}.json"))
    if not found:
        raise SystemExit(f"results_md: no file benchmarks/results/{folder}/<date>-{name}.json; "
                         f"run the benchmark that writes it or drop the table that reads it")
    return found[-1]


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"results_md: {path.relative_to(ROOT.parent)} is not readable JSON ({exc}); "
                         f"fix or remove it") from exc


def walk(data, path: str, where: str):
    node = data
    for step in path.split("/"):
        if isinstance(node, list):
            if step.isdigit():
                node = node[int(step)]
                continue
            want = dict(kv.split("=", 1) for kv in step.split("&"))
            hits = [x for x in node if all(str(x.get(k)) == v for k, v in want.items())]
            if len(hits) != 1:
                raise SystemExit(f"results_md: {where}: {len(hits)} list entries match {step!r}")
            node = hits[0]
        elif isinstance(node, dict) and step in node:
            node = node[step]
        else:
            raise SystemExit(f"results_md: {where}: no key {step!r} on the path {path!r}")
    return node


def fill(cell: str, files: dict[str, tuple[Path, dict]]) -> str:
    def one(m: re.Match) -> str:
        alias, path, fmt = m.groups()
        value = walk(files[alias][1], path, f"{files[alias][0].name}")
        if fmt in FORMATS:
            return FORMATS[fmt](value)
        return format(value, fmt) if fmt else str(value)

    return FIELD.sub(one, cell)


def provenance(path: Path, data: dict) -> str:
    card = data.get("gpu") or data.get("device_name") or "-"
    versions = data.get("versions", "-")
    if isinstance(versions, dict):
        versions = ", ".join(f"{k} {v}" for k, v in versions.items())
    line = f"`{path.relative_to(RESULTS).as_posix()}`: {data.get('date', '-')}, {card}, {versions}"
    src = data.get("source")
    if isinstance(src, dict):
        line += f"; read from `{src['path']}` at commit {src['commit'][:12]}"
    return line


def present(spec: dict) -> bool:
    """Whether a table is rendered: always, unless its spec is `optional` and a file it reads is not
    there yet (a benchmark not yet published)."""
    if not spec.get("optional"):
        return True
    try:
        for kind in spec["files"].values():
            newest(kind)
    except SystemExit:
        return False
    return True


def table(spec: dict) -> str:
    files = {alias: (p := newest(kind), load(p)) for alias, kind in spec["files"].items()}
    head = spec["columns"]
    lines = [f"### {spec['title']}", ""]
    if spec.get("about"):
        lines += [spec["about"], ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    # rows given as a function are made from the files' data (a row per entry a run measured)
    rows = spec["rows"]
    if callable(rows):
        rows = rows({alias: data for alias, (_, data) in files.items()})
    for row in rows:
        if len(row) != len(head):
            raise SystemExit(f"results_md: a row of {spec['title']!r} has {len(row)} cells for "
                             f"{len(head)} columns")
        lines.append("| " + " | ".join(fill(c, files) for c in row) + " |")
    lines += ["", "Data: " + "; ".join(provenance(p, d) for p, d in files.values()) + ".", ""]
    return "\n".join(lines)


GPU_TESTS = "gpu_tests"
SHOWN_FAILURES = 5


def _commit(data: dict) -> str:
    head = data.get("commit")
    return f"`{head[:12]}`" + (" (dirty)" if data.get("dirty") else "") if head else "-"


def _result(data: dict) -> str:
    """Whether the run passed whole, then each count above zero and the first failing ids."""
    counts = data["counts"]
    bad = counts.get("failed", 0) + counts.get("errors", 0) + counts.get("cut_short", 0)
    whole = not bad and counts.get("passed") and not data.get("exit_status")
    named = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if v) or "nothing ran"
    text = ("passed whole: " if whole else "not whole: ") + named
    fails = data.get("failures", [])
    if fails:
        more = f" and {len(fails) - SHOWN_FAILURES} more" if len(fails) > SHOWN_FAILURES else ""
        text += "; failing: " + ", ".join(f"`{f}`" for f in fails[:SHOWN_FAILURES]) + more
    return text.replace("|", "/")


def gpu_runs() -> str:
    """The section "GPU test runs": the newest record of `make gpu-test` (the whole run, not a part)
    and, for the parts of the newest `make gpu-test-thorough` record, each part's newest; '' until
    benchmarks/results/gpu_tests/ holds a record."""
    folder = RESULTS / GPU_TESTS
    whole = sorted(folder.glob("????-??-??-gpu-test.json"))
    thorough = sorted(folder.glob("????-??-??-gpu-test-thorough-*-of-*.json"))
    rows, files = [], []
    if whole:
        data = load(whole[-1])
        files.append((whole[-1], data))
        rows.append(["`make gpu-test`", data["date"], data.get("gpu") or "-", _commit(data),
                     _result(data), f"{data['wall_s']:.0f}"])
    if thorough:
        n = int(re.search(r"-of-(\d+)\.json$", thorough[-1].name).group(1))
        for k in range(1, n + 1):
            found = sorted(folder.glob(f"????-??-??-gpu-test-thorough-{k}-of-{n}.json"))
            run = f"`make gpu-test-thorough PART={k}/{n}`"
            if not found:
                rows.append([run, "-", "-", "-", "no record", "-"])
                continue
            data = load(found[-1])
            files.append((found[-1], data))
            rows.append([run, data["date"], data.get("gpu") or "-", _commit(data),
                         _result(data), f"{data['wall_s']:.0f}"])
    if not rows:
        return ""
    lines = [
        "## GPU test runs",
        "",
        "The newest record of each tier of the GPU tests: `make gpu-test` runs every test marked `gpu` "
        "once with the default hypothesis profile; `make gpu-test-thorough` the thorough profile's 200 "
        "drawn cases per spelling, in parts. Each run writes its record to "
        f"`benchmarks/results/{GPU_TESTS}/` (`tests/helpers/run_record.py`). A run passed whole where "
        "nothing failed, raised or was cut short by its time.",
        "",
        "| run | date | card | commit | result | wall s |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "Data: " + "; ".join(provenance(p, d) for p, d in files) + ".", ""]
    return "\n".join(lines)


sys.path.insert(0, str(ROOT))  # the tables live beside this script, which also runs as a module
from results_tables import HOW, INTRO, TABLES  # noqa: E402


def render() -> str:
    parts = [INTRO] + [table(t) for t in TABLES if present(t)] + [gpu_runs(), HOW]
    return "\n".join(p for p in parts if p).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if benchmarks/RESULTS.md differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("benchmarks/RESULTS.md differs from the data: run python benchmarks/results_md.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
