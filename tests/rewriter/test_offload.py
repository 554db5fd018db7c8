"""Offloaded activations (Options.offload) and the memory budget's choice of levers (Options.memory):
each decoder layer keeps only its input for the backward, on the host, and runs again in the
backward; the loss and every gradient by the accuracy rule; what the budget chose, in the report."""

from __future__ import annotations

import copy

import pytest
import torch
from checks import assert_ok
from tiny import batch, compare_models, tiny_config, tiny_model

import kernelgraft
from kernelgraft.rewriter.layers import decoder_layers


def names(model) -> list[str]:
    return ["loss"] + [f"grad {n}" for n, p in model.named_parameters() if p.requires_grad]


def layers_of(model):
    return model._compiled_call_impl.args[0].layers


class Box:
    def __init__(self, t):
        self.t = t


def kept_shapes(model, b) -> list[tuple]:
    """The shapes of the tensors a step of `model` keeps for its backward once its forward is done
    (what autograd saved and still holds, not what a layer saved and dropped at once)."""
    import gc
    import weakref

    boxes = []

    def pack(t):
        box = Box(t)
        boxes.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        loss = model(**b).loss
    gc.collect()
    shapes = [tuple(r().t.shape) for r in boxes if r() is not None]
    loss.backward()
    model.zero_grad(set_to_none=True)
    return shapes


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_offloaded_layers_train_by_the_rule_and_serve_every_site(backend):
    stock = tiny_model("llama")
    plain = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend=backend, offload=True)
    b = batch()
    assert_ok(compare_models(mine, stock, b, compiled=False), names(stock))
    assert_ok(compare_models(plain, stock, b, compiled=False), names(stock))
    # every site served as without offloading, counted per step: one layer graph run for each layer
    # (the layers' causal mask is checked in their graph at run time: its attention sites count too)
    mine_counts = {k: v for k, v in mine.kernelgraft_report.counts().items() if k not in ("sdpa", "gqa")}
    assert mine_counts == {k: v for k, v in plain.kernelgraft_report.counts().items() if k not in ("sdpa", "gqa")}
    rep = mine.kernelgraft_report
    assert layers_of(mine).path == "model.layers" and len(layers_of(mine).layers) == 2
    assert "offloaded: the 2 layers of model.layers keep their inputs on the host" in str(rep)
    # the layers' one graph: its records name every layer's module
    assert {r.module for r in rep.sites if r.pattern == "gated_mlp"} == {"model.layers.*.mlp"}


def test_a_layer_keeps_only_its_input_on_the_host():
    stock = tiny_model("llama")
    cfg = stock.config
    b = batch(B=2, S=12)
    wide = (2, 12, cfg.intermediate_size)
    plain = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    assert wide in kept_shapes(plain, b)  # the MLP's intermediates are kept for the backward
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True)
    shapes = kept_shapes(mine, b)
    assert wide not in shapes and (2, 12, cfg.hidden_size) in kept_shapes(plain, b)
    off = layers_of(mine).offloader
    # the two layers' inputs, [2, 12, hidden] float32 each, were on the host at once; all given back
    assert off.peak_bytes == 2 * 2 * 12 * cfg.hidden_size * 4 and off.bytes == 0 and off.calls == []
    # an evaluation call offloads nothing and keeps nothing
    with torch.no_grad():
        mine(**b)
    assert off.calls == [] and off.bytes == 0


def grads(model, b) -> dict:
    model.zero_grad(set_to_none=True)
    model(**b).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # over 20 s on a 2-core CPU
def test_bf16_and_lora_adapters_by_the_rule_and_as_without_offloading():
    from peft import LoraConfig, get_peft_model

    stock = tiny_model("llama", dtype=torch.bfloat16)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True)
    assert_ok(compare_models(mine, stock, batch(), compiled=False), names(stock))
    cfg = LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(0)
    stock = get_peft_model(tiny_model("llama", dtype=torch.bfloat16), cfg)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True)
    batches = [batch(seed=s) for s in range(2)]
    assert_ok(compare_models(mine, stock, batches, compiled=False), names(stock))
    assert layers_of(mine).path.endswith("model.layers")
    assert mine.kernelgraft_report.counts()["lora"] == 14
    # the layers run the same kernels as without offloading: the same gradients, bit for bit
    plain = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    got, want = grads(mine, batches[0]), grads(plain, batches[0])
    assert got.keys() == want.keys() and len(got) == 28
    assert all(torch.equal(got[n], want[n]) for n in got)


def test_it_replaces_hugging_faces_checkpointing():
    stock = tiny_model("llama")
    mine = copy.deepcopy(stock)
    mine.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mine = kernelgraft.optimize(mine, backend="eager", offload=True)
    ran = []
    off = layers_of(mine).offloader
    offload = off.offload
    off.offload = lambda t: ran.append(tuple(t.shape)) or offload(t)
    assert_ok(compare_models(mine, stock, batch(), compiled=False), names(stock))
    # one offloaded input per layer: the layers ran once each in the forward, not inside a checkpoint
    assert ran == [(2, 12, stock.config.hidden_size)] * 2
    assert all(layer.gradient_checkpointing for layer in mine.model.layers)  # as the user left it


def test_copies_offload_their_own_layers():
    mine = kernelgraft.optimize(tiny_model("llama"), backend="eager", offload=True)
    twin = copy.deepcopy(mine)
    assert layers_of(twin) is not layers_of(mine) and layers_of(twin).installed
    b = batch()
    for m in (mine, twin):
        m(**b).loss.backward()
    assert torch.equal(mine.model.layers[0].mlp.up_proj.weight.grad, twin.model.layers[0].mlp.up_proj.weight.grad)
    assert layers_of(twin).offloader.peak_bytes > 0 and "forward" in twin.model.layers[0].__dict__


def test_a_model_without_decoder_layers_is_told_what_to_do():
    with pytest.raises(ValueError, match="offload=True needs decoder layers .* Linear"):
        kernelgraft.optimize(torch.nn.Linear(4, 4), offload=True)
    assert decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None


def test_a_budget_the_step_fits_in_pulls_no_lever():
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", memory=1000.0)
    assert_ok(compare_models(mine, stock, batch(), compiled=False), names(stock))
    choice = mine.kernelgraft_report.memory
    assert (choice.offload, choice.tile_tokens, choice.lm_head_memory) == (False, None, None)
    assert layers_of(mine) is None and choice.tokens == 24  # captured whole, as the default capture says
    assert "no lever" in str(mine.kernelgraft_report) and "The step fits" in str(choice)


def test_a_small_budget_offloads_and_says_why():
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", memory=0.001)
    assert_ok(compare_models(mine, stock, batch(), compiled=False), names(stock))
    choice = mine.kernelgraft_report.memory
    assert choice.offload and layers_of(mine).offload and choice.budget_gib == pytest.approx(0.001)
    # a tile is at least 1024 positions: a 12-token sequence is not tiled, and the report says so
    assert choice.tile_tokens is None and "Not tiled" in str(choice)
    assert choice.lm_head_memory == "min"
    # a lever given its own value keeps it
    kept = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", memory=0.001, offload=False)
    kept(**batch()).loss.backward()
    assert not kept.kernelgraft_report.memory.offload and layers_of(kept) is None
    assert "offload=False as given" in str(kept.kernelgraft_report.memory)


def test_memory_is_chosen_at_the_first_training_call_not_at_evaluation():
    mine = kernelgraft.optimize(tiny_model("llama"), backend="eager", memory=0.001)
    b = batch()
    with torch.no_grad():
        mine(**b)
    assert mine.kernelgraft_report.memory is None
    mine(**b).loss.backward()
    assert mine.kernelgraft_report.memory.tokens == 24


def test_a_causal_mask_reaching_the_layers_is_checked_and_attention_runs_causal(monkeypatch):
    import transformers.masking_utils as mu

    # the full causal mask, as transformers builds it under compile in some releases: it reaches
    # each layer's own graph as an input
    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True)
    assert_ok(compare_models(mine, stock, batch(), compiled=False), names(stock))
    checks = mine.kernelgraft_report.mask_checks
    # the layers' graph checks its mask input at run time: causal in every check
    assert checks and sum(c.runs[0] for c in checks) >= 1 and sum(c.runs[1] for c in checks) == 0
    assert "checked at run time" in str(mine.kernelgraft_report)
    kept = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True, causal_attention=False)
    assert_ok(compare_models(kept, stock, batch(), compiled=False), names(stock))
    assert not kept.kernelgraft_report.mask_checks


def tiny_jamba():
    """A tiny Jamba: its decoder layers are of two classes (Mamba and attention), so it has no stack
    of one class."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config("jamba")
    cfg.attn_layer_period, cfg.attn_layer_offset = 2, 1  # of the 2 layers, the second attends
    return AutoModelForCausalLM.from_config(cfg)


def test_a_budget_offloads_nothing_in_a_model_without_a_layer_stack():
    stock = tiny_jamba()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", memory=0.001)
    assert_ok(compare_models(mine, stock, batch(), compiled=False), names(stock))
    choice = mine.kernelgraft_report.memory
    assert not choice.offload and layers_of(mine) is None and choice.lm_head_memory == "min"
    assert "Not offloaded" in str(choice) and "no layer stack" in str(mine.kernelgraft_report)
    # offload asked for by name is refused at once, saying why
    with pytest.raises(ValueError, match="needs decoder layers .* JambaForCausalLM.* of one class"):
        kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True)


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(d), torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Wide(Block):
    def forward(self, x):
        return x + torch.sigmoid(self.fc(self.norm(x)))


class TwoHeads(torch.nn.Module):
    """Blocks, then two output heads in a ModuleList that hold more parameters than the blocks; the
    loss the sum of both heads'. `mixed`: the blocks of two classes in a ModuleList, with a config
    that counts 2 layers (the heads are then the only one-class list as long as it says)."""

    def __init__(self, d: int = 16, vocab: int = 128, mixed: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, d)
        if mixed:
            import types

            self.config = types.SimpleNamespace(hidden_size=d, num_hidden_layers=2, vocab_size=vocab)
            self.blocks = torch.nn.ModuleList([Block(d), Wide(d)])
        else:
            self.blocks = torch.nn.Sequential(*(Block(d) for _ in range(3)))
        self.heads = torch.nn.ModuleList(torch.nn.Linear(d, vocab) for _ in range(2))

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        loss = torch.nn.functional.cross_entropy
        return sum(loss(head(h).flatten(0, 1), ids.flatten()) for head in self.heads)


def train_like(mine, stock, steps: int = 2):
    """Each step's loss and gradients of `mine` as the stock model's, by relative error."""
    ids = batch()["input_ids"]
    for _ in range(steps):
        for m in (mine, stock):
            m.zero_grad(set_to_none=True)
            m(ids).backward()
        for (n, p), q in zip(mine.named_parameters(), stock.parameters()):
            assert (p.grad - q.grad).norm() <= 1e-5 * q.grad.norm(), n


def test_the_blocks_of_a_sequential_are_offloaded_not_the_heads_beside_them():
    stock = TwoHeads()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True)
    train_like(mine, stock)
    # the heads hold the most parameters: their first call showed that they are not layers
    rep = mine.kernelgraft_report
    assert layers_of(mine).path == "blocks" and layers_of(mine).offload and len(layers_of(mine).layers) == 3
    assert layers_of(mine).offloader.peak_bytes == 3 * 2 * 12 * 16 * 4
    assert rep.notes == [
        "layers: heads (2 Linear) is not the model's layer stack: its first training call returns "
        "[2, 12, 128] for hidden states of [2, 12, 16]; blocks is captured per class instead"
    ]


def test_heads_are_not_offloaded_as_layers():
    stock = TwoHeads(mixed=True)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", memory=1e-6)
    train_like(mine, stock)
    rep = mine.kernelgraft_report
    assert layers_of(mine) is None and rep.captured_as["kind"] == "whole" and not rep.memory.offload
    said = str(rep)
    assert "heads (2 Linear) is not the model's layer stack" in said and "captured whole" in said
    assert "Not offloaded after all" in str(rep.memory)
    # asked for by name: a clear error at the first training call
    asked = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True)
    refused = r"heads: its first training call returns \[2, 12, 128\] for hidden .* Leave offload"
    with pytest.raises(ValueError, match=refused):
        asked(batch()["input_ids"])
    train_like(asked, stock, steps=1)  # and the model trains on, without offload
