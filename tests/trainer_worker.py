"""One rank of tests/test_grad_accum.py's multi-process Trainer run (started by torchrun, 2 CPU
processes, gloo): Hugging Face's Trainer wraps the model itself, in DDP (argv[2] "ddp") or FSDP2
("fsdp": fully_shard per decoder layer, through accelerate). Each rank trains the stock model and
the optimized one for one optimizer step (per-device batch 2, 2 accumulation steps: the 8 examples
in all) and rank 0 saves both parameter sets, whole, to argv[1]."""

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


FSDP = dict(
    fsdp="full_shard auto_wrap",  # newer transformers prefer fsdp=True with the rest in fsdp_config
    fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "version": 2},
)


def main(out: str, how: str):
    from test_grad_accum import train_one_step
    from tiny import tiny_model, whole

    import kernelgraft

    stock = tiny_model("llama")
    runs = {}
    for name in ("stock", "kernelgraft"):
        model = copy.deepcopy(stock)
        if name == "kernelgraft":
            model = kernelgraft.optimize(model, backend="eager")
        extra = dict(ddp_backend="gloo", **(FSDP if how == "fsdp" else {}))
        params = train_one_step(model, 2, 2, os.path.join(os.path.dirname(out), name), **extra)
        runs[name] = {n: whole(p) for n, p in params.items()}  # FSDP2 leaves shards
        if name == "kernelgraft":
            sites = {s.spelling for s in model.kernelgraft_report.sites if s.pattern == "lm_head_ce"}
            runs["lm_head_spellings"] = sorted(sites)
    if int(os.environ.get("RANK", "0")) == 0:
        runs["world_size"] = int(os.environ["WORLD_SIZE"])
        torch.save(runs, out)
    # both ranks leave together, the process group shut down (a rank exiting while gloo's threads
    # still run can abort with "terminate called without an active exception")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
