"""RMSNorm fwd+bwd on a GPU: eager, torch.compile, Liger-Kernel (when importable) and kernelgraft,
side by side in one process, with each one's error against float64 truth.

    python benchmarks/bench_rms_norm.py [--out DIR] [--shapes 16384x4096,...]

Writes DIR/rms_norm.json, DIR/rms_norm.md and DIR/rms_norm.png. Times are medians of
triton.testing.do_bench; bytes are each tensor read or written once (the floor)."""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
from benchlib import COPY_RATE, peak_above, profile_kernels
from triton.testing import do_bench

from kernelgraft.gradcheck import rel_error
from kernelgraft.kernels import op_for
from kernelgraft.patterns import REGISTRY

SP = REGISTRY.get("rms_norm", "llama")


def hf_rms(x, w, eps=1e-6):  # LlamaRMSNorm.forward, as transformers writes it
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def impls():
    out = {"eager": hf_rms, "torch.compile": torch.compile(hf_rms, dynamic=False)}
    try:
        from liger_kernel.transformers.functional import liger_rms_norm

        out["liger"] = lambda x, w: liger_rms_norm(x, w, 1e-6)
    except Exception as e:  # noqa: BLE001 - an optional peer
        print(f"liger-kernel not importable ({e}); its column stays empty")
    op = op_for(SP)
    out["kernelgraft"] = lambda x, w: op(x, w, 1e-6)
    return out


def measure(M, N, dtype=torch.bfloat16):
    torch.manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype).requires_grad_()
    g0 = torch.randn(M, N, device="cuda", dtype=dtype)
    g = g0
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    gx64, gw64 = torch.autograd.grad(y64, (x64, w64), g.double())
    floor_bytes = 5 * M * N * x.element_size() + 3 * N * w.element_size() + 2 * M * 4
    rows = {}
    for name, f in impls().items():
        g = g0.clone()  # Liger's backward writes into the incoming gradient (in_place=True, its default)
        y = f(x, w)
        gx, gw = torch.autograd.grad(y, (x, w), g)
        err = dict(out=rel_error(y, y64), grad_x=rel_error(gx, gx64), grad_w=rel_error(gw, gw64))

        def fwd(f=f):
            with torch.no_grad():
                f(x, w)

        def fwd_bwd(f=f, g=g):
            torch.autograd.grad(f(x, w), (x, w), g)

        t_f = do_bench(fwd, warmup=25, rep=100, return_mode="median")
        t_fb = do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median")
        peak = peak_above(fwd_bwd) / 2**20
        rows[name] = dict(
            fwd_ms=t_f, fwd_bwd_ms=t_fb, peak_mib=peak, gbps=floor_bytes / t_fb / 1e6, errors=err
        )
        if name == "kernelgraft":
            rows[name]["kernels_us"] = kernel_times(fwd_bwd)
    return dict(M=M, N=N, dtype=str(dtype), floor_ms=floor_bytes / COPY_RATE * 1e3, impls=rows)


def kernel_times(fn, iters=20) -> dict:
    """Device time per launch of each CUDA kernel fn launches (torch.profiler), in microseconds."""
    return {k[:60]: round(ms * 1e3, 1) for ms, _, k in profile_kernels(fn, iters) if ms > 0}


def markdown(res) -> str:
    lines = []
    for r in res["results"]:
        lines.append(
            f"\n**RMSNorm {r['M']}x{r['N']} {r['dtype'].replace('torch.', '')}** "
            f"(floor {r['floor_ms']:.3f} ms at 4275 GB/s)\n"
        )
        lines.append(
            "| impl | fwd ms | fwd+bwd ms | vs eager | vs compile | GB/s (floor bytes) | peak MiB | "
            "err out | err grad x | err grad w |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        e, c = r["impls"]["eager"]["fwd_bwd_ms"], r["impls"]["torch.compile"]["fwd_bwd_ms"]
        for name, v in r["impls"].items():
            er = v["errors"]
            lines.append(
                f"| {name} | {v['fwd_ms']:.3f} | {v['fwd_bwd_ms']:.3f} | {e / v['fwd_bwd_ms']:.2f}x | "
                f"{c / v['fwd_bwd_ms']:.2f}x | {v['gbps']:.0f} | {v['peak_mib']:.0f} | {er['out']:.2e} | "
                f"{er['grad_x']:.2e} | {er['grad_w']:.2e} |"
            )
        k = r["impls"]["kernelgraft"].get("kernels_us")
        if k:
            lines.append(
                "\nkernelgraft device time per fwd+bwd (us): " + ", ".join(f"{n} {t}" for n, t in k.items())
            )
    return "\n".join(lines) + "\n"


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['M']}x{r['N']}" for r in res["results"]]
    names = list(res["results"][0]["impls"])
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar(
            [j + i * width for j in range(len(labels))],
            [r["impls"][n]["fwd_bwd_ms"] for r in res["results"]],
            width,
            label=n,
        )
    ax.plot(
        [j + 0.4 - width / 2 for j in range(len(labels))],
        [r["floor_ms"] for r in res["results"]],
        "k_",
        markersize=30,
        label="memory floor",
    )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels)
    ax.set_ylabel("fwd+bwd ms (lower is better)")
    dt = res["results"][0]["dtype"].replace("torch.", "") if res["results"] else "bf16"
    ax.set_title(f"RMSNorm {dt} on {res['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--shapes", default="16384x4096,4096x4096,16384x5120,65536x128")
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="float32: the kernel computes in float64 there (kernelgraft.kernels.rows.codegen.in_float64)",
    )
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import transformers
    import triton

    res = dict(
        date=datetime.date.today().isoformat(),
        gpu=torch.cuda.get_device_name(),
        versions=dict(
            torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__
        ),
        results=[],
    )
    for s in a.shapes.split(","):
        M, N = map(int, s.split("x"))
        res["results"].append(measure(M, N, getattr(torch, a.dtype)))
        print(markdown(dict(res, results=res["results"][-1:])), flush=True)
    with open(os.path.join(a.out, "rms_norm.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = f"RMSNorm fwd+bwd, {res['gpu']}, {res['date']}, {res['versions']}\n" + markdown(res)
    with open(os.path.join(a.out, "rms_norm.md"), "w") as f:
        f.write(md)
    plot(res, os.path.join(a.out, "rms_norm.png"))
    print(md)


if __name__ == "__main__":
    main()
