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
from tiny import tiny_model
from trainer_helpers import check_wrapping, collate, examples, max_rel_diff, train_one_step, wrapping

import kernelgraft


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
@pytest.mark.parametrize(
    "how",
    [pytest.param("ddp", id="ddp_wrapped_by_the_trainer"), pytest.param("fsdp2", id="fsdp2_sharded_by_hand")],
)
def test_trainer_on_two_processes_equals_the_full_batch(tmp_path, how):
    # torchrun, 2 CPU processes over gloo: the Trainer splits the 8 examples between the ranks,
    # counts num_items_in_batch over both and scales the loss by the world size before the
    # gradients are averaged (an incoming loss gradient of 2 for the fused LM head). "ddp": the
    # Trainer wraps the model in DDP itself; "fsdp2": the model reaches the Trainer already sharded
    # with fully_shard (tests/helpers/trainer_worker.py says why)
    out = tmp_path / "params.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(Path(__file__).resolve().parents[1] / "helpers" / "trainer_worker.py"), str(out), how]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = torch.load(out)
    assert got["world_size"] == 2 and got["lm_head_spellings"] == ["hf_sum_n"], got.get("lm_head_spellings")
    for name in ("stock", "kernelgraft"):  # the Trainer trained the wrapper asked for
        check_wrapping(got[f"{name} wrapping"], how)
    if how == "fsdp2":
        # why the model is sharded by hand: a Trainer given its own FSDP2 arguments on these CPU
        # processes gets no FSDP from accelerate, and would train DDP
        assert not got["accelerate enables fsdp"], (
            "accelerate runs FSDP on the CPU: test the Trainer's own FSDP2"
        )
        check_wrapping(got["accelerate wraps"], "ddp")
    stock = tiny_model("llama")
    full = train_one_step(copy.deepcopy(stock), 8, 1, tmp_path / "full")
    start = {n: p.detach().clone() for n, p in stock.named_parameters()}
    assert max_rel_diff(full, start) > 1e-3  # the step did something
    # both ranks' halves of the batch make the one-process step, to fp32 rounding; kernelgraft's
    # as the stock model's
    assert max_rel_diff(got["stock"], full) < 1e-5, max_rel_diff(got["stock"], full)
    assert max_rel_diff(got["kernelgraft"], full) < 1e-5, max_rel_diff(got["kernelgraft"], full)


def test_the_wrapper_check_tells_ddp_from_fsdp2():
    """The check the two-process Trainer test applies to what was trained, on one gloo process: a
    DDP-wrapped model passes as DDP and fails as FSDP2; a model under fully_shard (as trainer_worker
    shards it) the other way round."""
    import torch.distributed as dist
    from dist_worker import wrap
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = wrapping(DistributedDataParallel(tiny_model("llama")))
        fsdp2 = wrapping(wrap(tiny_model("llama"), "fsdp2"))
    finally:
        dist.destroy_process_group()
    check_wrapping(ddp, "ddp")
    check_wrapping(fsdp2, "fsdp2")
    with pytest.raises(AssertionError, match="not FSDP2"):
        check_wrapping(ddp, "fsdp2")
    with pytest.raises(AssertionError, match="not DDP"):
        check_wrapping(fsdp2, "ddp")


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


def test_trainer_torch_compile_flag_runs_kernelgrafts_graphs(tmp_path):
    """TrainingArguments(torch_compile=True) around an optimized model: the Trainer's torch.compile
    adds nothing, said once; the model runs its own graphs, every site served, and the step gives
    the stock Trainer's parameters."""
    import warnings

    stock = tiny_model("llama")
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = train_one_step(grafted, 2, 1, tmp_path / "a", torch_compile=True)
    said = [str(w.message) for w in caught if str(w.message).startswith("kernelgraft:")]
    assert len(said) == 1 and "the outer torch.compile adds nothing" in said[0], said
    counts = grafted.kernelgraft_report.counts()
    assert {k: counts.get(k) for k in ("rms_norm", "rope", "gated_mlp", "lm_head_ce")} == {
        "rms_norm": 5, "rope": 4, "gated_mlp": 2, "lm_head_ce": 1,
    }  # fmt: skip
    ref = train_one_step(copy.deepcopy(stock), 2, 1, tmp_path / "b")
    assert max_rel_diff(mine, ref) < 1e-5, max_rel_diff(mine, ref)
