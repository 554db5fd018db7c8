"""RoPE and SwiGLU fwd+bwd on a GPU at the reference shapes (RoPE q 8x32x2048x128 and k 8x8x2048x128,
SwiGLU 16384x14336): eager, torch.compile, Liger-Kernel
(when importable) and kernelgraft, side by side in one process, each with its error vs float64.

    python benchmarks/bench_ops.py [--out DIR]      -> DIR/ops.json, DIR/ops.md"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F
from benchlib import COPY_RATE, failed_kernels_note
from triton.testing import do_bench

from kernelgraft.gradcheck import rel_error
from kernelgraft.kernels import op_for
from kernelgraft.kernels.rows import pair_op_for
from kernelgraft.patterns import REGISTRY


def hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos, sin):  # transformers' apply_rotary_pos_emb, cos/sin (B, S, D)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + hf_rotate_half(q) * sin, k * cos + hf_rotate_half(k) * sin


def swiglu(gate, up):
    return F.silu(gate) * up


def rope_impls():
    out = {"eager": hf_rope, "torch.compile": torch.compile(hf_rope, dynamic=False)}
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        out["liger"] = liger_rotary_pos_emb
    except Exception as e:  # noqa: BLE001 - optional peer
        print("liger rope unavailable:", e)
    pair = pair_op_for(REGISTRY.get("rope", "rotate_half"))

    def kg(q, k, cos, sin):  # what the rewriter puts in a layer: one launch for q and k, in place
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        yq, yk, _, _ = pair.fwd(q, cos, sin, k, cos, sin)
        return yq, yk

    out["kernelgraft"] = kg
    return out


def swiglu_impls():
    out = {"eager": swiglu, "torch.compile": torch.compile(swiglu, dynamic=False)}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        out["liger"] = LigerSiLUMulFunction.apply
    except Exception as e:  # noqa: BLE001
        print("liger swiglu unavailable:", e)
    op = op_for(REGISTRY.get("gated_mlp", "silu"))
    out["kernelgraft"] = lambda g, u: op(g, u)
    return out


def run(name, impls, inputs, truth_fn, floor_bytes):
    rows = {}
    leaves = [t for t in inputs if t.requires_grad]
    t64 = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    outs64 = truth_fn(*t64)
    outs64 = outs64 if isinstance(outs64, tuple) else (outs64,)
    gens = [torch.randn_like(o, dtype=inputs[0].dtype) for o in outs64]
    grads64 = torch.autograd.grad(outs64, [t for t in t64 if t.requires_grad], [g.double() for g in gens])
    # Liger writes gradients into its inputs and incoming gradients (in place): run it last
    for impl, f in sorted(impls.items(), key=lambda kv: kv[0] == "liger"):
        gs = [g.clone() for g in gens]  # Liger may write into incoming gradients
        outs = f(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads = torch.autograd.grad(outs, leaves, gs)
        err = max(rel_error(o, t) for o, t in zip(outs, outs64))
        gerr = max(rel_error(g, t) for g, t in zip(grads, grads64))

        def fb(f=f, gs=gs):
            o = f(*inputs)
            torch.autograd.grad(o if isinstance(o, tuple) else (o,), leaves, gs)

        ms = do_bench(fb, warmup=25, rep=100, return_mode="median")
        rows[impl] = dict(fwd_bwd_ms=ms, err_out=err, err_grad=gerr)
    return dict(name=name, floor_ms=floor_bytes / COPY_RATE * 1e3, impls=rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    # HF's layout: q_proj(h).view(B, S, H, D).transpose(1, 2), a strided view
    q = torch.randn(8, 2048, 32, 128, **bf).transpose(1, 2).requires_grad_()
    k = torch.randn(8, 2048, 8, 128, **bf).transpose(1, 2).requires_grad_()
    # HF's cos/sin: emb = cat(freqs, freqs), both halves equal (Liger's kernel reads only the first half)
    ang = torch.randn(8, 2048, 64, device="cuda").repeat(1, 1, 2)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    qk_bytes = 2 * 2 * (q.numel() + k.numel()) * 2  # read q,k + write out, fwd and bwd (grads), bf16
    res = [run("RoPE q 8x32x2048x128, k 8x8x2048x128", rope_impls(), (q, k, cos, sin), hf_rope, qk_bytes)]
    gate = torch.randn(16384, 14336, **bf).requires_grad_()
    up = torch.randn(16384, 14336, **bf).requires_grad_()
    res.append(run("SwiGLU 16384x14336", swiglu_impls(), (gate, up), swiglu, 7 * gate.numel() * 2))
    doc = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), results=res)
    lines = [f"fwd+bwd, {doc['gpu']}, {doc['date']}, bf16\n"]
    for r in res:
        e, c = r["impls"]["eager"]["fwd_bwd_ms"], r["impls"]["torch.compile"]["fwd_bwd_ms"]
        lines += [
            f"\n**{r['name']}** (floor {r['floor_ms']:.3f} ms)\n",
            "| impl | fwd+bwd ms | vs eager | vs compile | err out | err grad |",
            "|---|---|---|---|---|---|",
        ]
        for n, v in r["impls"].items():
            lines.append(
                f"| {n} | {v['fwd_bwd_ms']:.3f} | {e / v['fwd_bwd_ms']:.2f}x | {c / v['fwd_bwd_ms']:.2f}x | "
                f"{v['err_out']:.2e} | {v['err_grad']:.2e} |"
            )
    md = "\n".join(lines) + "\n" + failed_kernels_note(doc)
    open(os.path.join(a.out, "ops.md"), "w").write(md)
    json.dump(doc, open(os.path.join(a.out, "ops.json"), "w"), indent=1)
    print(md)


if __name__ == "__main__":
    main()
