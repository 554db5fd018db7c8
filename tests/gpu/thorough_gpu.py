"""The thorough property profile on a GPU, one process per spelling, a few at a time.

`make gpu-test` runs tests/gpu/test_gpu.py::test_every_spelling_on_gpu with the default hypothesis
profile, a few fixed cases per spelling. The "thorough" profile draws 200 per spelling anew (against
float64 truth and CUDA eager), more than one pytest run holds: there a spelling cut short by the
run's time says nothing, and pytest-xdist keeps its workers' output until the end. Here each
spelling is its own pytest process with its own time limit and log, so a run cut short still tells,
per spelling, whether it passed, which case failed first, or how many cases ran without a failure.

    python tests/gpu/thorough_gpu.py --out DIR [--part 2/4] [--jobs 6] [--timeout 400] [--budget 520]
        [--only lm_head_ce,rope.complex] [--gpus 2] [--record PATH]

writes DIR/<spelling>.log and DIR/thorough.md (a table: spelling, result, cases, seconds) and
prints the table. Exit status 1 if a spelling failed or ended in an error. --part K/N takes every
N-th spelling of the registry from the K-th (after --only), as `make gpu-test-thorough PART=K/N`
does, the default --budget ending the part inside 9 minutes. With --gpus N the processes are spread
over the host's first N GPUs (CUDA_VISIBLE_DEVICES), each GPU taking the next spelling as one of its
own processes ends. --record PATH writes the run as JSON (tests/helpers/run_record.py), `{date}` and
`{part}` (K-of-N) filled in.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST = "tests/gpu/test_gpu.py::test_every_spelling_on_gpu"
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
import run_record  # noqa: E402  (tests/helpers/ is on the path once the line above ran)


def spellings(only: str) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from kernelgraft.patterns import REGISTRY

    names = [s.qualname for s in REGISTRY.spellings()]
    if not only:
        return names
    want = [w.strip() for w in only.split(",") if w.strip()]
    return [n for n in names if any(n == w or n.startswith(w + ".") for w in want)]


def part(spec: str) -> tuple[int, int]:
    """(K, N) of `--part K/N` (argparse's type: a malformed one is a usage error)."""
    try:
        return run_record.part(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


of_part = run_record.of_part  # as tests/conftest.py's --part takes tests


def summarize(qualname: str, text: str, rc: int) -> tuple[str, str]:
    """(result, cases) from one spelling's log and exit status."""
    first = re.search(rf"{re.escape(qualname)}: first failing case (.*)", text)
    done = re.search(rf"{re.escape(qualname)}: (\d+) examples\s*$", text, re.M)
    so_far = re.findall(rf"{re.escape(qualname)}: (\d+) examples so far", text)
    if rc == 0 and done:
        return "passed", done.group(1)
    if first:
        return f"FAILED: {first.group(1)[:300]}", done.group(1) if done else (so_far[-1] if so_far else "?")
    if rc in (124, -9):
        return "cut short by its time, no failure", f">= {so_far[-1]}" if so_far else "< 50"
    return f"error (exit {rc}): see its log", so_far[-1] if so_far else "?"


def run_one(
    qualname: str, out: Path, timeout: int, gpu: str | None = None, threads: int = 0
) -> tuple[str, str, str, float]:
    env = dict(os.environ, HYPOTHESIS_PROFILE="thorough")
    if threads:  # torch's CPU threads per process: the host's cores shared, not each process taking all
        env.setdefault("OMP_NUM_THREADS", str(threads))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-s", "-q", "-p", "no:cacheprovider", f"{TEST}[{qualname}]"]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = 124
    took = time.monotonic() - t0
    (out / f"{qualname}.log").write_text(text)
    result, cases = summarize(qualname, text, rc)
    where = f", GPU {gpu}" if gpu is not None else ""
    print(f"{qualname}: {result} ({cases} cases, {took:.0f} s{where})", flush=True)
    return qualname, result, cases, took


def outcome(result: str) -> str:
    """Which count of a record a spelling's result adds to."""
    if result == "passed":
        return "passed"
    if result.startswith("FAILED"):
        return "failed"
    return "cut_short" if result.startswith("cut short") else "errors"


def record(
    rows: list[tuple[str, str, str, float]], date: str, command: str, spec: str | None, wall_s: float, **settings
) -> dict:
    """The run as a record (tests/helpers/run_record.py): counts, failing spellings' test ids, and
    each spelling's result, cases and seconds."""
    counts = dict.fromkeys(run_record.COUNTS, 0) | {"cut_short": 0}
    for _, result, _, _ in rows:
        counts[outcome(result)] += 1
    return run_record.provenance(date) | {
        "tier": "gpu-test-thorough",
        "command": command,
        "profile": "thorough",
        "part": spec,
        **settings,
        "wall_s": round(wall_s, 1),
        "counts": counts,
        "failures": [f"{TEST}[{q}]" for q, r, _, _ in rows if outcome(r) in ("failed", "errors")],
        "spellings": [
            {"spelling": q, "result": r, "cases": int(c) if c.isdigit() else c, "s": round(t, 1)}
            for q, r, c, t in rows
        ],
    }


def main(argv: list[str] | None = None) -> int:
    t0, date = time.monotonic(), run_record.today()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the logs and thorough.md ({part}: K-of-N)")
    ap.add_argument("--part", type=part, default=None, metavar="K/N",
                    help="every N-th spelling of the registry from the K-th (default: all)")
    ap.add_argument("--jobs", type=int, default=6, help="spellings at once (each one process)")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per spelling")
    ap.add_argument("--only", default="", help="spellings or kernels, comma-separated (default: all)")
    ap.add_argument("--gpus", type=int, default=0, help="spread the processes over this many GPUs")
    ap.add_argument("--budget", type=int, default=520, help="seconds for the whole run: a spelling started "
                    "late gets what is left of it; the default ends a run inside 9 minutes (0: no limit but "
                    "--timeout)")
    ap.add_argument("--record", default="", metavar="PATH",
                    help="write the run as JSON to PATH ({date}: the day it started, {part}: K-of-N)")
    a = ap.parse_args(argv)
    k, n = a.part or (1, 1)
    part_name = f"{k}-of-{n}"
    out = run_record.filled(a.out, date, part_name)
    out.mkdir(parents=True, exist_ok=True)
    names = of_part(spellings(a.only), k, n)
    if not names:
        print(f"no spelling matches --only {a.only!r} in part {k}/{n}", file=sys.stderr)
        return 2
    slots: queue.Queue = queue.Queue()  # one entry per running process: the GPU it runs on
    for i in range(a.jobs):
        slots.put(str(i % a.gpus) if a.gpus > 0 else None)

    end = t0 + a.budget if a.budget else float("inf")

    def on_a_free_slot(name: str):
        gpu = slots.get()
        try:
            timeout = int(max(1, min(a.timeout, end - time.monotonic())))
            return run_one(name, out, timeout, gpu, max(1, (os.cpu_count() or 1) // a.jobs))
        finally:
            slots.put(gpu)

    with ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(on_a_free_slot, names))
    lines = ["| spelling | result | cases | s |", "|---|---|---|---|"]
    lines += [f"| `{q}` | {r} | {c} | {t:.0f} |" for q, r, c, t in rows]
    table = "\n".join(lines) + "\n"
    (out / "thorough.md").write_text(table)
    print(table)
    bad = any(outcome(r) in ("failed", "errors") for _, r, _, _ in rows)
    if a.record:
        command = shlex.join(["python", "tests/gpu/thorough_gpu.py", *(sys.argv[1:] if argv is None else argv)])
        settings = {"jobs": a.jobs, "timeout": a.timeout, "budget": a.budget, "gpus": a.gpus, "only": a.only}
        spec = f"{k}/{n}" if a.part else None
        doc = record(rows, date, command, spec, time.monotonic() - t0, exit_status=int(bad), **settings)
        print(f"record: {run_record.write(a.record, doc, part_name)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
