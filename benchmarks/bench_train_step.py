"""One training step (forward + backward, no optimizer) of the Llama-3.2-1B shape, 8 x 2048, bf16,
random init, SDPA: eager, torch.compile, kernelgraft (inductor backend) and Liger (last: it patches
classes module-wide), each with a freshly built model, in one process.

    python benchmarks/bench_train_step.py [--out DIR] [--steps 5]   -> DIR/train_step.json"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kernelgraft

CFG = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=4096,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


def step_bench(mode, B, S, steps):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG)).to("cuda", torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    if mode == "torch.compile":
        model.compile()
    elif mode == "kernelgraft":
        kernelgraft.optimize(model, backend="inductor")
    elif mode == "kernelgraft (bf16 dW)":  # the LM head's weight gradient accumulated in bf16
        kernelgraft.optimize(model, backend="inductor", lm_head_accumulate="weight")
    elif mode == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    ids = torch.randint(0, CFG["vocab_size"], (B, S), device="cuda")

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    torch.cuda.synchronize()
    t = time.perf_counter()
    first_loss = step()
    first = time.perf_counter() - t
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    med = sorted(times)[len(times) // 2]
    out = dict(
        tok_s=B * S / med,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30,
        first_step_s=first,
        loss=first_loss,
    )
    if mode.startswith("kernelgraft"):
        out["sites"] = model.kernelgraft_report.counts()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="eager,torch.compile,kernelgraft,kernelgraft (bf16 dW),liger")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = dict(
        date=datetime.date.today().isoformat(),
        gpu=torch.cuda.get_device_name(),
        shape="Llama-3.2-1B 8x2048",
        results={},
    )
    for mode in a.modes.split(","):
        try:
            res["results"][mode] = step_bench(mode, 8, 2048, a.steps)
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a failing peer is reported, the others still run
            res["results"][mode] = dict(error=repr(e)[:300])
        print(mode, res["results"][mode], flush=True)
        json.dump(res, open(os.path.join(a.out, "train_step.json"), "w"), indent=1)
    print("| mode | tokens/s | peak GiB | first step s | loss |\n|---|---|---|---|---|")
    for m, r in res["results"].items():
        if "error" in r:
            print(f"| {m} | error: {r['error'][:80]} | | | |")
        else:
            print(
                f"| {m} | {r['tok_s']:,.0f} | {r['peak_gib']:.1f} | {r['first_step_s']:.1f} | {r['loss']:.4f} |"
            )


if __name__ == "__main__":
    main()
