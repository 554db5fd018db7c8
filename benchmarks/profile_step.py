"""Where a training step's host time goes, per mode, side by side in one process: the step's wall
time, the host time to launch its forward and its backward (nothing waits for the GPU in them),
the kernels it launches and their device time (in all and by kernel), the host time of each op and kernel launch per call (torch.profiler's
self CPU time: a kernel launched by inductor costs the host its launch path, a matmul its dispatch),
and the Python functions that took the most host time (cProfile, one step). The host's speed moves
between steps (one mode's steps ranged over 1.4x on an H200 host): each time is given as the median
and the least of the steps.

    python benchmarks/profile_step.py [--shape "llama-135m 8x1024"] [--modes "torch.compile,kernelgraft (inductor)"]
        [--wrappers] -> OUT/profile_step.json, OUT/profile_step.md

--wrappers also reads the code inductor generated for each mode (compiled into a new cache
directory): per step, kernelgraft's launches and inductor's, the arguments each passes, the extern
calls, the views of buffers it makes and the buffers it allocates.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import json
import os
import pstats
import re
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from suite import SHAPES, build  # noqa: E402


def profile_mode(shape: str, mode: str, steps: int = 10, top: int = 30) -> dict:
    s = SHAPES[shape]
    model = build(shape, mode)
    ids = torch.randint(0, s["cfg"]["vocab_size"], (s["B"], s["S"]), device="cuda")
    host = {"fwd": [], "bwd": []}
    graphs = "reduce-overhead" in mode

    def step(record=True):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if record:
            host["fwd"].append(t1 - t0)
            host["bwd"].append(t2 - t1)
        return loss

    for _ in range(3):
        step(False)
    torch.cuda.synchronize()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    med = lambda v: sorted(v)[len(v) // 2] * 1e3  # noqa: E731
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(False)
        torch.cuda.synchronize()
    host_ops = host_by_op(prof, 3, top)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = kernels[: len(kernels) // 3]  # one step's
    by_name: dict = {}
    for e in kernels:  # where the device time goes: kernels of one name summed
        ms, n = by_name.get(e.name, (0.0, 0))
        by_name[e.name] = (ms + e.device_time / 1e3, n + 1)
    top_kernels = sorted(((ms, n, k[:90]) for k, (ms, n) in by_name.items()), reverse=True)[:top]
    pr = cProfile.Profile()
    pr.enable()
    step(False)
    pr.disable()
    torch.cuda.synchronize()
    out = dict(
        wall_ms=med(walls),
        wall_least_ms=min(walls) * 1e3,
        host_fwd_ms=med(host["fwd"]),
        host_bwd_ms=med(host["bwd"]),
        host_least_ms=min(f + b for f, b in zip(host["fwd"], host["bwd"])) * 1e3,
        kernels=len(kernels),
        device_ms=sum(e.device_time for e in kernels) / 1e3,
        top_kernels=[dict(ms=ms, count=n, kernel=k) for ms, n, k in top_kernels],
        host_ops=host_ops,
        cprofile=cprofile_top(pr, top),
    )
    rep = getattr(model, "kernelgraft_report", None)
    if rep is not None:
        out["launched_by"] = dict(rep.launched_by)
    model.to("meta")  # its memory back before the next mode is built
    torch.cuda.empty_cache()
    return out


def wrapper_launches(code: str, ours) -> dict:
    """What one of inductor's generated wrappers does on the host per call, read from its source
    (the `call` function): the Triton launches (`<kernel>.run(...)`) split into kernelgraft's
    (`ours(name)`) and inductor's own, with the arguments each passes (grid and stream aside); the
    extern calls (matmuls, attention); the views it makes of buffers (`reinterpret_tensor`); and
    the buffers it allocates."""
    body = code[code.index("def call(") :] if "def call(" in code else ""
    out = dict(ours_launches=0, ours_args=0, inductor_launches=0, inductor_args=0, extern=0)
    for line in body.splitlines():
        m = re.match(r"\s*(\w+)\.run\(", line)
        if m:
            try:
                call = ast.parse(line.strip()).body[0].value
            except SyntaxError:  # a launch over several lines: not what inductor writes
                continue
            n = len(call.args) + sum(1 for k in call.keywords if k.arg != "stream")
            who = "ours" if ours(m.group(1)) else "inductor"
            out[f"{who}_launches"] += 1
            out[f"{who}_args"] += n
        elif re.match(r"\s*(\w+\s*=\s*)?(extern_kernels|torch\.ops\.\w+)\.[\w.]+\(", line):
            out["extern"] += 1
    out["reinterpret_tensor"] = body.count("reinterpret_tensor(")
    out["buffers"] = body.count("empty_strided_cuda(")
    return out


def wrappers_since(root: str, before: set, ours) -> dict:
    """The totals of wrapper_launches over the wrappers inductor wrote under `root` that are not in
    `before` (one mode's graphs), and how many there were."""
    total: dict = {"graphs": 0}
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            if not f.endswith(".py") or path in before:
                continue
            code = open(path).read()
            if "def call(" not in code:
                continue
            total["graphs"] += 1
            for k, v in wrapper_launches(code, ours).items():
                total[k] = total.get(k, 0) + v
    return total


def _py_files(root: str) -> set:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")}


_GRAPH_RECORD = re.compile(r"^## Call\s+CompiledFxGraph\s+(\w+) ##$")


def event_name(key: str) -> str:
    """A profiler record's name as the tables print it: inductor's record of running one compiled
    graph (its key between "## Call" and "##") as `compiled graph <key>`."""
    m = _GRAPH_RECORD.match(key)
    return f"compiled graph {m.group(1)}" if m else key


def host_by_op(prof, steps: int, top: int = 30) -> list[dict]:
    """torch.profiler's CPU events -> the ops and kernel launches that took the most host time, per
    step: [{name, calls, self_us (per step), us_per_call}], most first. Self time: the event's own
    host time, its children's (an op's dispatch to the ops it calls) left out."""
    rows = []
    for e in prof.key_averages():
        if e.self_cpu_time_total <= 0 or e.key.startswith("ProfilerStep"):
            continue
        calls = e.count / steps
        rows.append(
            dict(
                name=event_name(e.key)[:90],
                calls=calls,
                self_us=e.self_cpu_time_total / steps,
                us_per_call=e.self_cpu_time_total / max(e.count, 1),
            )
        )
    return sorted(rows, key=lambda r: -r["self_us"])[:top]


def cprofile_top(pr: cProfile.Profile, top: int = 30) -> list[dict]:
    """The Python functions (and builtins) with the most host time of their own in a cProfile run:
    [{function, calls, tottime_ms, cumtime_ms}], most first."""
    st = pstats.Stats(pr)
    rows = []
    for (path, line, fn), (_cc, nc, tt, ct, _) in st.stats.items():
        where = fn if path == "~" else f"{os.path.basename(path)}:{line}({fn})"
        rows.append(dict(function=where[:100], calls=nc, tottime_ms=tt * 1e3, cumtime_ms=ct * 1e3))
    return sorted(rows, key=lambda r: -r["tottime_ms"])[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--shape", default="llama-135m 8x1024")
    ap.add_argument("--modes", default="torch.compile,kernelgraft (inductor)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--wrappers",
        action="store_true",
        help="compile into a new inductor cache directory and read each mode's generated wrappers: "
        "launches, launch arguments, views and buffers per step",
    )
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    root = None
    if a.wrappers:  # before anything compiles: inductor reads it when it first writes
        root = tempfile.mkdtemp(prefix="kg_wrappers_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = root
    res = {}
    for mode in a.modes.split(","):
        before = _py_files(root) if root else set()
        res[mode] = profile_mode(a.shape, mode, a.steps)
        if root:
            from kernelgraft.kernels.launching import is_kernelgraft_kernel

            res[mode]["wrappers"] = wrappers_since(root, before, lambda n: is_kernelgraft_kernel(re.sub(r"_\d+$", "", n)))
        brief = {k: v for k, v in res[mode].items() if k not in ("cprofile", "top_kernels", "host_ops")}
        print(mode, brief, flush=True)
    json.dump(
        dict(shape=a.shape, gpu=torch.cuda.get_device_name(), modes=res),
        open(os.path.join(a.out, "profile_step.json"), "w"),
        indent=1,
    )
    L = [
        f"**Host and device time of one training step, {a.shape}** ({torch.cuda.get_device_name()})\n",
        "| mode | wall ms (least) | host fwd ms | host bwd ms | host fwd+bwd, least ms | kernels | device ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in res.items():
        L.append(
            f"| {m} | {r['wall_ms']:.2f} ({r['wall_least_ms']:.2f}) | {r['host_fwd_ms']:.2f} | "
            f"{r['host_bwd_ms']:.2f} | {r['host_least_ms']:.2f} | {r['kernels']} | {r['device_ms']:.2f} |"
        )
    if root:
        L += [
            "\nWhat the generated wrappers do on the host per step (inductor's code, read)\n",
            "| mode | graphs | kernelgraft launches (arguments) | inductor's launches (arguments) | extern calls | views made | buffers |",
            "|---|---|---|---|---|---|---|",
        ]
        for m, r in res.items():
            w = r["wrappers"]
            L.append(
                f"| {m} | {w['graphs']} | {w.get('ours_launches', 0)} ({w.get('ours_args', 0)}) | "
                f"{w.get('inductor_launches', 0)} ({w.get('inductor_args', 0)}) | {w.get('extern', 0)} | "
                f"{w.get('reinterpret_tensor', 0)} | {w.get('buffers', 0)} |"
            )
    for m, r in res.items():
        L += [f"\n{m}: device time by kernel (one step)\n", "| ms | launches | kernel |", "|---|---|---|"]
        L += [f"| {k['ms']:.3f} | {k['count']} | `{k['kernel']}` |" for k in r["top_kernels"]]
    for m, r in res.items():
        L += [
            f"\n{m}: host time by op and kernel launch (torch.profiler, self time, per step)\n",
            "| self µs | calls | µs per call | op or kernel |",
            "|---|---|---|---|",
        ]
        L += [
            f"| {o['self_us']:.0f} | {o['calls']:.0f} | {o['us_per_call']:.1f} | `{o['name']}` |" for o in r["host_ops"]
        ]
    for m, r in res.items():
        L += [
            f"\n{m}: host time by Python function (cProfile, one step)\n",
            "| own ms | with callees ms | calls | function |",
            "|---|---|---|---|",
        ]
        L += [
            f"| {f['tottime_ms']:.2f} | {f['cumtime_ms']:.2f} | {f['calls']} | `{f['function']}` |"
            for f in r["cprofile"]
        ]
    md = "\n".join(L) + "\n"
    open(os.path.join(a.out, "profile_step.md"), "w").write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
