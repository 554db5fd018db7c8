"""One rank of tests/models/test_grad_accum.py's multi-process Trainer run (started by torchrun, 2 CPU
processes, gloo). argv[2] says who wraps the model:

- "ddp": Hugging Face's Trainer wraps it itself (accelerate's `DistributedDataParallel`).
- "fsdp2": the model is sharded by hand before the Trainer sees it (dist_worker.wrap: `fully_shard`
  per decoder layer, then the root), because accelerate enables FSDP only for GPU-like distributed
  types and wraps the model in DDP on the CPU whatever the Trainer's `fsdp` arguments say. The rank
  also records whether a Trainer given those arguments enables FSDP.

Each rank trains the stock model and the optimized one for one optimizer step (per-device batch 2,
2 accumulation steps: the 8 examples in all) and rank 0 saves both parameter sets, whole, with what
the Trainer trained (trainer_helpers.wrapping of `trainer.model_wrapped`), to argv[1]."""

import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the Trainer's own FSDP2 request (the string form: deprecated in newer transformers, taken by 5.17 and 5.24)
FSDP = dict(
    fsdp="full_shard auto_wrap",
    fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "version": 2},
)


def main(out: str, how: str):
    from dist_worker import leave, watch, wrap
    from tiny import tiny_model, whole
    from trainer_helpers import make_trainer, wrapping

    import kernelgraft

    watch()
    if how not in ("ddp", "fsdp2"):
        raise SystemExit(f"trainer_worker.py: unknown wrapper {how!r}; pass ddp or fsdp2")
    if how == "fsdp2":
        dist.init_process_group("gloo")  # fully_shard needs the group before the Trainer makes it
    stock = tiny_model("llama")
    runs = {}
    for name in ("stock", "kernelgraft"):
        model = copy.deepcopy(stock)
        if name == "kernelgraft":
            model = kernelgraft.optimize(model, backend="eager")
        if how == "fsdp2":
            wrap(model, "fsdp2")
            # accelerate's prepare() returns a model so marked as it is; unmarked, on the CPU it would
            # wrap the sharded model in DDP
            model._is_accelerate_prepared = True
        trainer = make_trainer(model, 2, 2, os.path.join(os.path.dirname(out), name), ddp_backend="gloo")
        trainer.train()
        runs[name] = {n: whole(p).detach().clone() for n, p in model.named_parameters()}  # FSDP2: shards
        runs[f"{name} wrapping"] = wrapping(trainer.model_wrapped)
        if name == "kernelgraft":
            sites = {s.spelling for s in model.kernelgraft_report.sites if s.pattern == "lm_head_ce"}
            runs["lm_head_spellings"] = sorted(sites)
    if how == "fsdp2":  # last: a Trainer's arguments reset accelerate's state, so this one sees its own
        asked = make_trainer(tiny_model("llama"), 2, 2, os.path.dirname(out), ddp_backend="gloo", **FSDP)
        runs["accelerate enables fsdp"] = asked.is_fsdp_enabled
        runs["accelerate wraps"] = wrapping(asked.accelerator.prepare_model(asked.model))
    if int(os.environ.get("RANK", "0")) == 0:
        runs["world_size"] = int(os.environ["WORLD_SIZE"])
        torch.save(runs, out)
    leave()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
