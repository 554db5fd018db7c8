"""Where a training step's host time goes, per mode, side by side in one process: the step's wall
time, the host time to launch its forward and its backward (nothing waits for the GPU in them),
the kernels it launches and their device time (in all and by kernel), and the Python functions that took the most host
time (cProfile, one step).

    python benchmarks/profile_step.py [--shape "llama-135m 8x1024"] [--modes "torch.compile,kernelgraft (inductor)"]
        -> OUT/profile_step.json, OUT/profile_step.md
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
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

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(False)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
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
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    pstats.Stats(pr, stream=buf).sort_stats("cumtime").print_stats(top)
    out = dict(
        wall_ms=med(walls),
        host_fwd_ms=med(host["fwd"]),
        host_bwd_ms=med(host["bwd"]),
        kernels=len(kernels),
        device_ms=sum(e.device_time for e in kernels) / 1e3,
        top_kernels=[dict(ms=ms, count=n, kernel=k) for ms, n, k in top_kernels],
        cprofile=buf.getvalue(),
    )
    rep = getattr(model, "kernelgraft_report", None)
    if rep is not None:
        out["launched_by"] = dict(rep.launched_by)
    model.to("meta")  # its memory back before the next mode is built
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--shape", default="llama-135m 8x1024")
    ap.add_argument("--modes", default="torch.compile,kernelgraft (inductor)")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    res = {}
    for mode in a.modes.split(","):
        res[mode] = profile_mode(a.shape, mode, a.steps)
        print(mode, {k: v for k, v in res[mode].items() if k not in ("cprofile", "top_kernels")}, flush=True)
    json.dump(
        dict(shape=a.shape, gpu=torch.cuda.get_device_name(), modes=res),
        open(os.path.join(a.out, "profile_step.json"), "w"),
        indent=1,
    )
    L = [
        f"**Host and device time of one training step, {a.shape}** ({torch.cuda.get_device_name()})\n",
        "| mode | wall ms | host fwd ms | host bwd ms | kernels | device ms |",
        "|---|---|---|---|---|---|",
    ]
    for m, r in res.items():
        L.append(
            f"| {m} | {r['wall_ms']:.2f} | {r['host_fwd_ms']:.2f} | {r['host_bwd_ms']:.2f} | {r['kernels']} | {r['device_ms']:.2f} |"
        )
    for m, r in res.items():
        L += [f"\n{m}: device time by kernel (one step)\n", "| ms | launches | kernel |", "|---|---|---|"]
        L += [f"| {k['ms']:.3f} | {k['count']} | `{k['kernel']}` |" for k in r["top_kernels"]]
    for m, r in res.items():
        L += [
            f"\n{m}: host time by function (cProfile, one step)\n",
            "```",
            r["cprofile"].strip()[-12000:],
            "```",
        ]
    md = "\n".join(L) + "\n"
    open(os.path.join(a.out, "profile_step.md"), "w").write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
