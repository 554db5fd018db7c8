"""One training step (forward + backward, no optimizer) of the Llama-3.2-1B shape, 8 x 2048, bf16,
random init, SDPA: eager, torch.compile, kernelgraft (inductor backend; and with the LM head's weight
gradient summed in bf16) and Liger (last: it patches classes module-wide), each with a freshly built
model, in one process. The measurement is benchmarks/suite.py's; this keeps the one-shape table.
"unsloth" and "unsloth (checkpointing)" in --modes measure Unsloth's full fine-tune of the shape, each
in a process of its own (bench_unsloth.py: Unsloth patches transformers' classes at import).
--rows also runs bench_unsloth.py's rows (the 1B and 8B LoRA steps, the 8B QLoRA step, the 1B full
fine-tune; eager, torch.compile, Liger, kernelgraft and Unsloth, with and without checkpointing),
each mode in a process of its own -> DIR/unsloth.json, DIR/unsloth.md.

    python benchmarks/bench_train_step.py [--out DIR] [--steps 5]   -> DIR/train_step.json
    PYTHONPATH=$PWD/.peers_site python benchmarks/bench_train_step.py --modes eager,kernelgraft,unsloth \\
        --rows "llama-8b QLoRA 2x4096"      (the peers installed by benchmarks/peers.py install)"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import bench_unsloth
import torch
from benchlib import names
from suite import measure_step

SHAPE = "llama-1b 8x2048"
MODES = "eager,torch.compile,kernelgraft,kernelgraft (bf16 dW),liger"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--modes",
        default=None,
        help=f"the shape's modes (default: {MODES}); with --rows, also the rows' (default: each row's own); "
        '"" with --rows: the rows only',
    )
    ap.add_argument(
        "--rows",
        default="",
        help=f"also bench_unsloth.py's rows, comma-separated, any of: {', '.join(bench_unsloth.ROWS)} "
        "(default: none)",
    )
    ap.add_argument(
        "--models", default="/tmp/kernelgraft_models", help="folder of the saved models Unsloth loads"
    )
    return ap


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    for row in names(a.rows):
        if row not in bench_unsloth.ROWS:
            ap.error(f"unknown row {row!r}; one of: {', '.join(bench_unsloth.ROWS)}")
    os.makedirs(a.out, exist_ok=True)
    res = dict(
        date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), shape=SHAPE, results={}
    )
    for mode in names(MODES if a.modes is None else a.modes):
        if mode.startswith("unsloth"):  # its own process: it patches transformers' classes at import
            row = bench_unsloth.ROW_OF_SHAPE[SHAPE]
            res["results"][mode] = bench_unsloth.run_in_process(row, mode, a.steps, a.models)
            print(mode, res["results"][mode], flush=True)
            json.dump(res, open(os.path.join(a.out, "train_step.json"), "w"), indent=1)
            continue
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
            peak = r.get("peak_gib", r.get("peak_above_start_gib"))  # Unsloth's rows: above the start
            print(f"| {m} | {r['tok_s']:,.0f} | {peak:.1f} | {r['first_step_s']:.1f} | {r['loss']:.4f} |")
    if names(a.rows):
        rows = ["--out", a.out, "--rows", a.rows, "--steps", str(a.steps), "--models", a.models]
        mine = [m for m in names(a.modes) if m in bench_unsloth.PEER_MODES]
        bench_unsloth.main(rows + ["--modes", ",".join(mine)])


if __name__ == "__main__":
    main()
