"""LM head + cross-entropy fwd+bwd on a GPU at the reference shapes (8192 tokens x H 4096 x V 128256,
and the Gemma-2 shape 8192 x 2304 x 256000): eager, torch.compile, Liger's
fused linear cross-entropy and Cut Cross-Entropy (when importable) and kernelgraft (fp32 and weight-dtype accumulation of
the weight gradient; and under memory budgets: torch.compile's measured memory, half of it, "min"), side by side in one process: time, peak memory above the inputs (the weight
gradient included), and the error of the loss and both gradients vs float64.

    python benchmarks/bench_lm_head.py [--out DIR]      -> DIR/lm_head.json, DIR/lm_head.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F
from benchlib import cuda_kernels, failed_kernels_note, peak_above
from triton.testing import do_bench

from kernelgraft.gradcheck import rel_error
from kernelgraft.kernels import op_for
from kernelgraft.patterns import REGISTRY

SHAPES = [(8192, 4096, 128256), (8192, 2304, 256000)]
CHUNKS = (512, 1536, 2048, 3072, 4096)  # tokens per chunk, bf16 sums (--chunks)
SWEEP = False
ONLY = None  # --only: the implementations to measure (None: all)


def eager(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)


def impls():
    out = {"eager": eager, "torch.compile": torch.compile(eager, dynamic=False)}
    op = op_for(REGISTRY.get("lm_head_ce", "hf_mean"))
    out["kernelgraft (default)"] = lambda h, w, t: op.configured()(h, w, t, -100)
    out["kernelgraft (fp32 dW)"] = lambda h, w, t: op.configured(accumulate="fp32")(h, w, t, -100)
    for c in CHUNKS if SWEEP else ():
        out[f"kernelgraft (bf16 dW, chunk {c})"] = lambda h, w, t, c=c: op.configured(c, "weight")(
            h, w, t, -100
        )
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda h, w, t: liger(w, h, t)
    except Exception as e:  # noqa: BLE001 - optional peer
        print("liger unavailable:", e)
    try:
        from cut_cross_entropy import linear_cross_entropy

        out["cut cross-entropy"] = lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=-100)
    except Exception as e:  # noqa: BLE001 - optional peer
        print("cut cross-entropy unavailable:", e)
    return out


def budget_impls(compile_gib: float, T: int, H: int, V: int) -> list:
    """kernelgraft under optimize(lm_head_memory=...) budgets: torch.compile's measured memory, half
    of it, half of the unfused path's estimate from the shape alone (bf16 logits and weight
    gradient: what a per-shape default could use), and "min" (kernel.plan picks the chunk and the
    accumulation)."""
    from kernelgraft.kernels.lm_head.op import memory_gib

    op = op_for(REGISTRY.get("lm_head_ce", "hf_mean"))
    unfused = (T * V + V * H) * 2 / 2**30
    out = []
    budgets = (
        ("torch.compile's", compile_gib),
        ("half torch.compile's", compile_gib / 2),
        ("min", "min"),
    ) + ((("half the unfused estimate", unfused / 2),) if SWEEP else ())
    for label, budget in budgets:
        cfg = op.configured(0, "fp32", memory_gib(budget))
        out.append((f"kernelgraft (memory: {label})", lambda h, w, t, cfg=cfg: cfg(h, w, t, -100)))
    return out


def measure(T, H, V):
    torch.manual_seed(0)
    dev = "cuda"
    h = (torch.randn(T, H, device=dev) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device=dev) / H**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, V, (T,), device=dev)
    t[::13] = -100
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    l64 = F.cross_entropy(h64 @ w64.t(), t, ignore_index=-100)
    gh64, gw64 = torch.autograd.grad(l64, (h64, w64))
    del h64, w64
    torch.cuda.empty_cache()
    rows = {}
    todo = [(n, f) for n, f in impls().items() if ONLY is None or n in ONLY]
    budgets_added = False
    while todo:
        name, f = todo.pop(0)
        try:
            loss = f(h, w, t)
            gh, gw = torch.autograd.grad(loss, (h, w))
            errs = dict(
                err_loss=rel_error(loss, l64), err_grad_h=rel_error(gh, gh64), err_grad_w=rel_error(gw, gw64)
            )
            del loss, gh, gw

            def step(f=f):
                torch.autograd.grad(f(h, w, t), (h, w))

            ms = do_bench(step, warmup=100, rep=600, return_mode="median")
            peak = peak_above(step) / 2**30
            rows[name] = dict(fwd_bwd_ms=ms, peak_gib_above_inputs=peak, **errs)
            print(f"{T}x{H}x{V} {name}: {ms:.2f} ms, {peak:.2f} GiB, errors {errs}", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing implementation must not hide the others
            traceback.print_exc()
            rows[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
        torch.cuda.empty_cache()
        if not budgets_added and "peak_gib_above_inputs" in rows.get("torch.compile", {}):
            todo += [
                (n, f)
                for n, f in budget_impls(rows["torch.compile"]["peak_gib_above_inputs"], T, H, V)
                if ONLY is None or n in ONLY
            ]
            budgets_added = True
    if PROFILE:
        rows["profile"] = profile(impls()["kernelgraft (default)"], h, w, t)
    floor = 3 * 2 * T * H * V / 730e12 * 1e3  # three matmuls at a 730 TFLOP/s bf16 matmul rate
    return dict(shape=f"{T} tok x H {H} x V {V}", floor_ms=floor, impls=rows)


PROFILE = False
TRACE = None


def tune_ce(T=1024, V=128256):
    """The CE kernel alone on one chunk of bf16 logits, over (BLOCK_V, num_warps): the table that
    CE_CONFIG["cuda"] is set from."""
    from kernelgraft.kernels.lm_head import kernel as lm_kernel

    fn = lm_kernel._kernel(REGISTRY.get("lm_head_ce", "hf_mean"), torch.bfloat16, "autograd", "cuda")[0].ce
    z0 = torch.randn(T, V, device="cuda").bfloat16()
    t = torch.randint(0, V, (T,), device="cuda")
    loss = torch.empty(T, device="cuda")
    scale = torch.full((1,), 1.0 / T, device="cuda")
    out = []
    for bv in (1024, 2048, 4096, 8192):
        for nw in (4, 8, 16):
            z = z0.clone()

            def run(z=z, bv=bv, nw=nw):
                fn[(T,)](z, z.stride(0), t, loss, scale, V, -100, GRAD=True, BLOCK_V=bv, num_warps=nw)

            try:
                ms = do_bench(run, warmup=25, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"  BLOCK_V {bv} warps {nw}: {type(e).__name__}")
                continue
            gbps = 3 * z.numel() * 2 / ms / 1e6
            out.append(dict(block_v=bv, num_warps=nw, ms=ms, gb_s=gbps))
            print(
                f"  CE kernel {T}x{V}: BLOCK_V {bv:5d} warps {nw:2d}: {ms * 1e3:7.1f} us  {gbps:6.0f} GB/s",
                flush=True,
            )
    return out


def profile(f, h, w, t) -> list:
    """CUDA time per kernel of one fwd+bwd, largest first: where the time above the floor goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    for _ in range(3):
        torch.autograd.grad(f(h, w, t), (h, w))
    torch.cuda.synchronize()
    n = 3
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        for _ in range(n):
            torch.autograd.grad(f(h, w, t), (h, w))
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n * 1e3
    if TRACE:  # where the GPU waits for the host: a Chrome trace of the same fwd+bwd calls
        p.export_chrome_trace(TRACE)
    rows = cuda_kernels(p, n)
    for ms, c, k in rows[:12]:
        print(f"  {ms:8.2f} ms  x{c:<4d} {k[:110]}")
    busy = sum(ms for ms, _, _ in rows)
    print(f"  {busy:8.2f} ms  device time per fwd+bwd; wall {wall:.2f} ms back to back ({n} in a row)")
    return [dict(kernel=k[:200], ms=ms, count=c) for ms, c, k in rows[:20]] + [
        dict(kernel="(total device time)", ms=busy, count=0),
        dict(kernel="(wall, back to back)", ms=wall, count=n),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--profile", action="store_true", help="also print kernelgraft's CUDA time per kernel")
    ap.add_argument("--only", help="comma-separated implementation names to measure (default: all)")
    ap.add_argument("--rows", help="comma-separated indices into SHAPES, in the order to run (default: all)")
    ap.add_argument("--chunks", action="store_true", help="also sweep the chunk (bf16 sums) and a budget of half the unfused head")
    ap.add_argument(
        "--tune-ce", action="store_true", help="time the CE kernel alone over launch configs first"
    )
    a = ap.parse_args()
    global PROFILE, TRACE, SWEEP, ONLY
    PROFILE = a.profile
    SWEEP = a.chunks
    ONLY = set(a.only.split(",")) if a.only else None
    os.makedirs(a.out, exist_ok=True)
    TRACE = os.path.join(a.out, "lm_head_trace.json") if a.profile else None
    tuned = tune_ce() if a.tune_ce else None
    rows = [SHAPES[int(i)] for i in a.rows.split(",")] if a.rows else SHAPES
    res = [measure(*s) for s in rows]
    doc = dict(
        date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), results=res, ce_tuning=tuned
    )
    lines = [f"LM head + cross-entropy fwd+bwd, bf16, {doc['gpu']}, {doc['date']}\n"]
    for r in res:
        e = r["impls"].get("eager", {}).get("fwd_bwd_ms")
        c = r["impls"].get("torch.compile", {}).get("fwd_bwd_ms")
        lines += [
            f"\n**{r['shape']}** (matmul floor {r['floor_ms']:.1f} ms)\n",
            "| impl | fwd+bwd ms | vs eager | vs compile | peak GiB above inputs | err loss | err grad h | err grad W |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for n, v in r["impls"].items():
            if n == "profile":
                continue
            if "error" in v:
                lines.append(f"| {n} | failed: {v['error'][:80]} | | | | | | |")
                continue
            ms = v["fwd_bwd_ms"]
            lines.append(
                f"| {n} | {ms:.2f} | {f'{e / ms:.2f}x' if e else '-'} | {f'{c / ms:.2f}x' if c else '-'} | "
                f"{v['peak_gib_above_inputs']:.2f} | "
                f"{v['err_loss']:.2e} | {v['err_grad_h']:.2e} | {v['err_grad_w']:.2e} |"
            )
    md = "\n".join(lines) + "\n" + failed_kernels_note(doc)
    open(os.path.join(a.out, "lm_head.md"), "w").write(md)
    json.dump(doc, open(os.path.join(a.out, "lm_head.json"), "w"), indent=1)
    print(md)


if __name__ == "__main__":
    main()
