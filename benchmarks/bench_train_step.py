"""One training step (forward + backward, no optimizer) of the Llama-3.2-1B shape, 8 x 2048, bf16,
random init, SDPA: eager, torch.compile, kernelgraft (inductor backend; and with the LM head's weight
gradient summed in bf16) and Liger (last: it patches classes module-wide), each with a freshly built
model, in one process. The measurement is benchmarks/suite.py's; this keeps the one-shape table.

    python benchmarks/bench_train_step.py [--out DIR] [--steps 5]   -> DIR/train_step.json"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
from benchlib import names
from suite import measure_step

SHAPE = "llama-1b 8x2048"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="eager,torch.compile,kernelgraft,kernelgraft (bf16 dW),liger")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = dict(
        date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), shape=SHAPE, results={}
    )
    for mode in names(a.modes):
        try:
            res["results"][mode] = measure_step(SHAPE, mode, a.steps)
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
