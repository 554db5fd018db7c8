"""The thorough property profile on a GPU, one process per spelling, a few at a time.

`pytest -m gpu` runs test_gpu.py::test_every_spelling_thorough_on_gpu (200 drawn cases per spelling
against float64 truth and CUDA eager) inside one run, where a spelling cut short by the run's time
says nothing and pytest-xdist keeps its workers' output until the end. Here each spelling is its
own pytest process with its own time limit and log, so a run cut short still tells, per spelling,
whether it passed, which case failed first, or how many cases ran without a failure.

    python tests/gpu/thorough_gpu.py --out DIR [--jobs 6] [--timeout 400] [--only lm_head_ce,rope.complex]
        [--gpus 2]

writes DIR/<spelling>.log and DIR/thorough.md (a table: spelling, result, cases, seconds) and
prints the table. Exit status 1 if a spelling failed. With --gpus N the processes are spread over
the host's first N GPUs (CUDA_VISIBLE_DEVICES), each GPU taking the next spelling as one of its own
processes ends.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST = "tests/gpu/test_gpu.py::test_every_spelling_thorough_on_gpu"


def spellings(only: str) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from kernelgraft.patterns import REGISTRY

    names = [s.qualname for s in REGISTRY.spellings()]
    if not only:
        return names
    want = [w.strip() for w in only.split(",") if w.strip()]
    return [n for n in names if any(n == w or n.startswith(w + ".") for w in want)]


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the logs and thorough.md")
    ap.add_argument("--jobs", type=int, default=6, help="spellings at once (each one process)")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per spelling")
    ap.add_argument("--only", default="", help="spellings or kernels, comma-separated (default: all)")
    ap.add_argument("--gpus", type=int, default=0, help="spread the processes over this many GPUs")
    ap.add_argument("--budget", type=int, default=0, help="seconds for the whole run: a spelling started "
                    "late gets what is left of it (0: no limit but --timeout)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = spellings(a.only)
    if not names:
        print(f"no spelling matches --only {a.only!r}", file=sys.stderr)
        return 2
    slots: queue.Queue = queue.Queue()  # one entry per running process: the GPU it runs on
    for i in range(a.jobs):
        slots.put(str(i % a.gpus) if a.gpus > 0 else None)

    end = time.monotonic() + a.budget if a.budget else float("inf")

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
    return 1 if any(r.startswith("FAILED") for _, r, _, _ in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
