"""One rank of tests/test_grad_accum.py's multi-process Trainer run (started by torchrun, 2 CPU
processes, gloo): Hugging Face's Trainer wraps the model in DDP itself. Each rank trains the stock
model and the optimized one for one optimizer step (per-device batch 2, 2 accumulation steps: the 8
examples in all) and rank 0 saves both parameter sets to argv[1]."""

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(out: str):
    from test_grad_accum import train_one_step
    from tiny import tiny_model

    import kernelgraft

    stock = tiny_model("llama")
    runs = {}
    for name in ("stock", "kernelgraft"):
        model = copy.deepcopy(stock)
        if name == "kernelgraft":
            model = kernelgraft.optimize(model, backend="eager")
        runs[name] = train_one_step(model, 2, 2, os.path.join(os.path.dirname(out), name), ddp_backend="gloo")
        if name == "kernelgraft":
            sites = {s.spelling for s in model.kernelgraft_report.sites if s.pattern == "lm_head_ce"}
            runs["lm_head_spellings"] = sorted(sites)
    if int(os.environ.get("RANK", "0")) == 0:
        runs["world_size"] = int(os.environ["WORLD_SIZE"])
        torch.save(runs, out)


if __name__ == "__main__":
    main(sys.argv[1])
