"""Where CUDA's eager Gemma-2 softcap path rounds differently from the CPU's (and from the kernel).

The case it examines, drawn by the thorough property profile on an H200: lm_head_ce.softcap_mean
in bf16, `Case(rows=16, n=23, bf16, gaussian, seed=23)`. There a kernel that rounds as the CPU's eager
does has a grad h error of 0.0026, equal to the CPU eager's, while CUDA's eager gives 0.00209.
This script runs the spelling op by op on both devices, from the same inputs, and prints for each
intermediate (forward and the gradients flowing back) how many elements differ between CPU and CUDA
eager and between each and the fused kernel's logit gradient, so one GPU run says which op rounds
differently.

    python benchmarks/diag_softcap.py          (needs a CUDA GPU; prints a table)
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernelgraft.gradcheck.strategies import _values
from kernelgraft.kernels.launching import launch_options
from kernelgraft.kernels.lm_head import kernel as lm_kernel
from kernelgraft.patterns import REGISTRY


def chain(h, w, t, cap, ii, g):
    """The spelling's ops one at a time, each intermediate kept with its gradient."""
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    steps = {}
    z = F.linear(h, w)
    steps["z = linear(h, w)"] = z
    a = z / cap
    steps["a = z / cap"] = a
    b = torch.tanh(a)
    steps["b = tanh(a)"] = b
    c = b * cap
    steps["c = b * cap"] = c
    d = c.float()
    loss = F.cross_entropy(d, t, ignore_index=ii)
    for v in steps.values():
        v.retain_grad()
    d.retain_grad()
    loss.backward(g)
    out = {k: v.detach() for k, v in steps.items()}
    out["loss"] = loss.detach()
    out["grad d (fp32, from cross_entropy)"] = d.grad
    for k, v in steps.items():
        out[f"grad {k.split(' =')[0]}"] = v.grad
    out["grad h"], out["grad w"] = h.grad, w.grad
    return out


def main():
    # DIAG_CASE="spelling,rows,n,dtype,values,seed" (a Case the thorough profile reported)
    name, rows, n, dt, vals, seed = os.environ.get(
        "DIAG_CASE", "softcap_mean,16,23,bfloat16,gaussian,23"
    ).split(",")
    dt = getattr(torch, dt)
    sp = REGISTRY.get("lm_head_ce", name)
    h, w, t, cap, ii = _values(sp.example_args(int(rows), int(n), dt, int(seed)), vals)[:5]
    print(f"case: {name} rows {rows} n {n} {dt} {vals} seed {seed}")
    g = torch.randn((), generator=torch.Generator().manual_seed(0))
    cpu = chain(h, w, t, cap, ii, g)
    dev = os.environ.get("DIAG_DEVICE", "cuda")  # "cpu": a dry run of the script itself
    cuda = chain(h.to(dev), w.to(dev), t.to(dev), cap, ii, g.to(dev))
    # the kernel's logit gradient (what it writes over z), from CUDA's z and from the CPU's
    fn, _ = lm_kernel._kernel(sp, dt, "autograd", dev)
    counted = (t != ii).sum().float()
    kern = {}
    for name, z in (
        ("from CUDA z", cuda["z = linear(h, w)"]),
        ("from CPU z", cpu["z = linear(h, w)"].to(dev)),
    ):
        dz = z.clone()
        loss = torch.empty(z.shape[0], device=dev)
        fn.ce[(z.shape[0],)](
            dz, dz.stride(0), t.to(dev), loss, (g.to(dev) / counted.to(dev)).reshape(1), cap, z.shape[1], ii,
            GRAD=True, BLOCK_V=128, **launch_options("autograd", [dt], dev),
        )  # fmt: skip
        kern[name] = dz
    print(f"{'quantity':40s} {'n':>6s} {'cpu!=cuda':>10s} {'max |diff|':>12s}")
    for k in cpu:
        a, b = cpu[k], cuda[k].cpu()
        ne = (a != b).sum().item()
        md = (a.double() - b.double()).abs().max().item()
        print(f"{k:40s} {a.numel():6d} {ne:10d} {md:12.3e}")
    for name, dz in kern.items():
        for ref in ("cpu", "cuda"):
            want = (cpu if ref == "cpu" else cuda)["grad z"]
            ne = (dz.cpu() != want.cpu()).sum().item()
            print(f"kernel dz {name:14s} vs {ref:4s} eager grad z: {ne} of {dz.numel()} differ")
    # the errors the rule compares: each against float64 truth (the whole op, on `dev` for kernelgraft)
    from kernelgraft.gradcheck import rel_error
    from kernelgraft.kernels import op_for

    truth = chain(h.double(), w.double(), t, cap, ii, g.double())
    hk, wk = h.to(dev).detach().requires_grad_(), w.to(dev).detach().requires_grad_()
    op_for(sp)(hk, wk, t.to(dev), cap, ii).backward(g.to(dev))
    for what, got in (("grad h", "h"), ("grad w", "w")):
        errs = {k: rel_error(v[what], truth[what]) for k, v in (("cpu eager", cpu), ("cuda eager", cuda))}
        errs["kernelgraft"] = rel_error((hk if got == "h" else wk).grad, truth[what])
        print(what, "  ".join(f"{k} {e:.4g}" for k, e in errs.items()))


if __name__ == "__main__":
    main()
