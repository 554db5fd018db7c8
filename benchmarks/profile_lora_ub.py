"""LoRA's du and dB from one read of the output's gradient (`grad_ub`) against the two kernels apart
(`grad_u`, `grad_b`), in one process: the training step's wall time with the two builds taking
turns, and each build's device time by kernel, grouped (cuBLAS, attention, LoRA, inductor's own
kernels, the rest).

    python benchmarks/profile_lora_ub.py [--shape "llama-1b LoRA 8x2048"] [--rounds 7]
        -> OUT/profile_lora_ub.json, OUT/profile_lora_ub.md

The switch (`kernels/lora/kernel.py`, FUSED_UB) is read when a graph is compiled, so each build is
compiled with its value and inductor's caches are off for the run (the second build would load the
first's graphs from them). A build whose profiled step ran the other's kernels is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from suite import SHAPES, build  # noqa: E402

BUILDS = {"du and dB from one read": True, "du and dB apart": False}


def group(name: str) -> str:
    """The kind of a kernel, from its name."""
    if name.startswith("lora__"):
        return "LoRA"
    if name.startswith("triton_"):
        return "inductor"
    if any(k in name for k in ("flash", "fmha", "cudnn")):
        return "attention"
    if any(k in name for k in ("gemm", "nvjet", "cutlass", "sm90_")):
        return "cuBLAS"
    return "the rest (norms, RoPE, SwiGLU, LM head)"


def by_kernel(step) -> dict:
    """{kernel name: [device ms, launches]} of one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms, n = out.get(e.name, (0.0, 0))
            out[e.name] = (ms + e.device_time / 1e3, n + 1)
    return {k: list(v) for k, v in out.items()}


def run(shape: str, rounds: int) -> dict:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    import kernelgraft.kernels.lora.kernel as lora_kernel

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    s = SHAPES[shape]
    ids = torch.randint(0, s["cfg"]["vocab_size"], (s["B"], s["S"]), device="cuda")
    steps, was = {}, lora_kernel.FUSED_UB
    # one reset before both builds, none between them: a reset drops the first model's compiled
    # code, which its first timed step would then recompile with the second build's switch
    torch._dynamo.reset()
    try:
        for name, fused in BUILDS.items():
            lora_kernel.FUSED_UB = fused
            model = build(shape, "kernelgraft (inductor)")

            def step(model=model):
                model(input_ids=ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)

            for _ in range(3):  # compiled, then warm
                step()
            steps[name] = step
    finally:
        lora_kernel.FUSED_UB = was
    torch.cuda.synchronize()
    walls: dict = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls[name].append(time.perf_counter() - t)
    out = {}
    for name, step in steps.items():
        kernels = by_kernel(step)
        fused = any(re.search(r"_grad_ub\d*$", k) for k in kernels)
        if fused != BUILDS[name]:  # it was recompiled with the other build's switch
            raise RuntimeError(f"{name}: the step ran {'grad_ub' if fused else 'grad_u and grad_b'}")
        groups: dict = {}
        for k, (ms, _) in kernels.items():
            groups[group(k)] = groups.get(group(k), 0.0) + ms
        w = sorted(walls[name])
        out[name] = dict(
            wall_ms=w[len(w) // 2] * 1e3,
            wall_least_ms=w[0] * 1e3,
            walls_ms=[round(t * 1e3, 2) for t in walls[name]],
            device_ms=sum(ms for ms, _ in kernels.values()),
            groups_ms=groups,
            kernels=kernels,
        )
    return out


def markdown(res: dict, top: int = 20) -> str:
    names = list(res)
    L = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    L.append("| wall ms, median (least) | " + " | ".join(f"{res[n]['wall_ms']:.1f} ({res[n]['wall_least_ms']:.1f})" for n in names) + " |")
    L.append("| device ms | " + " | ".join(f"{res[n]['device_ms']:.1f}" for n in names) + " |")
    for g in sorted({g for n in names for g in res[n]["groups_ms"]}):
        L.append(f"| {g} | " + " | ".join(f"{res[n]['groups_ms'].get(g, 0.0):.1f}" for n in names) + " |")
    L += ["", "| kernel | " + " | ".join(f"{n}: ms (launches)" for n in names) + " |", "|---|" + "---|" * len(names)]
    every = {k for n in names for k in res[n]["kernels"]}
    most = sorted(every, key=lambda k: -max(res[n]["kernels"].get(k, (0, 0))[0] for n in names))[:top]
    for k in most:
        cells = [res[n]["kernels"].get(k, (0.0, 0)) for n in names]
        L.append(f"| `{k[:80]}` | " + " | ".join(f"{ms:.2f} ({c})" for ms, c in cells) + " |")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--shape", default="llama-1b LoRA 8x2048")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_lora_ub.py needs a CUDA GPU")
        return 1
    res = run(a.shape, a.rounds)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile_lora_ub.json"), "w") as f:
        json.dump(dict(shape=a.shape, rounds=a.rounds, builds=res), f, indent=1)
    md = markdown(res)
    with open(os.path.join(a.out, "profile_lora_ub.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
