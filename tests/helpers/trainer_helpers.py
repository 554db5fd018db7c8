"""The Trainer runs the tests share: 8 padded examples of different lengths, a Trainer that takes one
SGD step with them, the parameters it leaves, what a data-parallel run wrapped the model in, and the
largest relative difference between two parameter sets. Used by tests/models/test_grad_accum.py,
tests/helpers/trainer_worker.py (one rank of its two-process run) and other tests that train."""

import torch
from tiny import VOCAB

LENGTHS = [5, 12, 7, 9, 4, 11, 6, 10]


def examples(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g)} for n in LENGTHS]


def collate(rows):
    S = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    labels = torch.full((len(rows), S), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = labels[i, :n] = r["input_ids"]
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def make_trainer(model, per_device, accumulation, tmp_path, **extra):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        **extra,
        output_dir=str(tmp_path),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,  # no clipping: the update is the gradient itself
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(model=model, args=args, train_dataset=examples(), data_collator=collate)


def train_one_step(model, per_device, accumulation, tmp_path, **extra):
    make_trainer(model, per_device, accumulation, tmp_path, **extra).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def wrapping(wrapped) -> dict:
    """What a data-parallel run trained (a Trainer's `model_wrapped`): whether it is DDP, which of
    its modules FSDP2 manages, and how many of its parameters are DTensors (FSDP2's shards)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    params = list(wrapped.parameters())
    return {
        "type": type(wrapped).__name__,
        "ddp": isinstance(wrapped, DistributedDataParallel),
        "fsdp2": sorted(n for n, m in wrapped.named_modules() if isinstance(m, FSDPModule)),
        "dtensors": sum(isinstance(p, DTensor) for p in params),
        "parameters": len(params),
    }


def check_wrapping(record: dict, how: str):
    """Fails unless `record` (from `wrapping`) is the tiny 2-layer Llama under the wrapper asked for:
    "ddp", DDP over plain tensors; "fsdp2", fully_shard on each decoder layer and the root, no DDP,
    every parameter a DTensor."""
    if how == "ddp":
        assert record["ddp"] and record["fsdp2"] == [] and record["dtensors"] == 0, f"not DDP: {record}"
    elif how == "fsdp2":
        layers = ["", "model.layers.0", "model.layers.1"]
        assert not record["ddp"] and record["fsdp2"] == layers, (
            f"not FSDP2 on each layer and the root: {record}"
        )
        assert record["dtensors"] == record["parameters"] > 0, f"parameters not all FSDP2 shards: {record}"
    else:
        raise ValueError(f"check_wrapping: unknown wrapper {how!r}; pass ddp or fsdp2")


def max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item() for n in a)
