"""Gradient accumulation is exact with the fused LM head: Hugging Face's Trainer with per-device
batch 2 and 4 accumulation steps gives the parameters that batch 8 without accumulation gives
(padded sequences of different lengths, fp32, one optimizer step), and so does a hand-written loop
that passes `num_items_in_batch`."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import VOCAB, tiny_model

import kernelgraft

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


def train_one_step(model, per_device, accumulation, tmp_path, **extra):
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
    Trainer(model=model, args=args, train_dataset=examples(), data_collator=collate).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item() for n in a)


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
def test_trainer_accumulation_equals_the_full_batch(tmp_path):
    stock = tiny_model("llama")
    start = {n: p.detach().clone() for n, p in stock.named_parameters()}
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    acc = train_one_step(grafted, 2, 4, tmp_path / "a")
    # the Trainer passed num_items_in_batch: HF's sum / num_items spelling was fused
    assert {s.spelling for s in grafted.kernelgraft_report.sites if s.pattern == "lm_head_ce"} == {"hf_sum_n"}
    full = train_one_step(kernelgraft.optimize(copy.deepcopy(stock), backend="eager"), 8, 1, tmp_path / "b")
    ref = train_one_step(copy.deepcopy(stock), 8, 1, tmp_path / "c")
    moved = max_rel_diff(full, start)
    assert moved > 1e-3  # the step did something
    # equal to fp32 rounding, and to the stock model's step
    assert max_rel_diff(acc, full) < 1e-5, max_rel_diff(acc, full)
    assert max_rel_diff(full, ref) < 1e-5, max_rel_diff(full, ref)


def test_hand_written_loop_with_num_items_in_batch():
    stock = tiny_model("llama")
    model = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    rows = examples(1)
    full = collate(rows)
    n = (full["labels"][:, 1:] != -100).sum()  # the labels the shifted loss counts
    for m in (model, stock):
        m.zero_grad(set_to_none=True)
        for i in range(0, 8, 2):
            m(**collate(rows[i : i + 2]), num_items_in_batch=n).loss.backward()
    acc = {k: p.grad.clone() for k, p in model.named_parameters()}
    spellings = {s.spelling for s in model.kernelgraft_report.sites if s.pattern == "lm_head_ce"}
    assert spellings == {"hf_sum_n"}  # HF's sum / num_items_in_batch, fused
    stock_acc = {k: p.grad.clone() for k, p in stock.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(**full).loss.backward()  # mean over the same labels
    one = {k: p.grad.clone() for k, p in model.named_parameters()}
    assert model.kernelgraft_report.counts()["lm_head_ce"] == 1
    assert max_rel_diff(acc, one) < 1e-5
    assert max_rel_diff(acc, stock_acc) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_trainer_on_two_processes_equals_the_full_batch(tmp_path, how):
    # torchrun, 2 CPU processes over gloo: the Trainer wraps the model in DDP or FSDP2 itself, splits
    # the 8 examples between the ranks, counts num_items_in_batch over both and scales the loss by
    # the world size before the gradients are averaged (an incoming loss gradient of 2 for the
    # fused LM head)
    out = tmp_path / "params.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(Path(__file__).parent / "trainer_worker.py"), str(out), how]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = torch.load(out)
    assert got["world_size"] == 2 and got["lm_head_spellings"] == ["hf_sum_n"], got.get("lm_head_spellings")
    stock = tiny_model("llama")
    full = train_one_step(copy.deepcopy(stock), 8, 1, tmp_path / "full")
    start = {n: p.detach().clone() for n, p in stock.named_parameters()}
    assert max_rel_diff(full, start) > 1e-3  # the step did something
    # both ranks' halves of the batch make the one-process step, to fp32 rounding; kernelgraft's
    # as the stock model's
    assert max_rel_diff(got["stock"], full) < 1e-5, max_rel_diff(got["stock"], full)
    assert max_rel_diff(got["kernelgraft"], full) < 1e-5, max_rel_diff(got["kernelgraft"], full)


def test_trainer_with_lora_equals_the_stock_step(tmp_path):
    """peft's LoRA on every linear layer, one Trainer step with accumulation: every adapted layer is
    served, and the adapters move as the stock model's do (the base weights stay frozen)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    stock = get_peft_model(tiny_model("llama"), cfg)
    start = {n: p.detach().clone() for n, p in stock.named_parameters()}
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    mine = train_one_step(grafted, 2, 2, tmp_path / "a")
    ref = train_one_step(copy.deepcopy(stock), 2, 2, tmp_path / "b")
    assert grafted.kernelgraft_report.counts()["lora"] == 14
    adapters = [n for n in start if "lora_" in n]
    assert len(adapters) == 28
    assert max_rel_diff({n: mine[n] for n in adapters}, {n: start[n] for n in adapters}) > 1e-3
    assert all(torch.equal(mine[n], start[n]) for n in start if n not in adapters)  # frozen
    assert max_rel_diff(mine, ref) < 1e-5, max_rel_diff(mine, ref)
