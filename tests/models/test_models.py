"""Tiny random Llama, Gemma-2 and Qwen3: sites counted and explained, and the inductor backend by the
rule (loss and every gradient in float32 and bf16 with the eager backend: tests/models/test_coverage.py)."""

import copy

import pytest
import torch
from tiny import batch, compare_models, tiny_model

import kernelgraft

ARCHS = ["llama", "gemma2", "qwen3"]


def rms_norm_calls(model, b) -> int:
    """How many times the model actually calls an RMSNorm module (counted with hooks, eager)."""
    calls = []
    hooks = [
        m.register_forward_hook(lambda *a: calls.append(1))
        for m in model.modules()
        if "RMSNorm" in type(m).__name__
    ]
    with torch.no_grad():
        model(**b)
    for h in hooks:
        h.remove()
    return len(calls)


@pytest.mark.parametrize("arch,per_layer", [("llama", 2), ("gemma2", 4), ("qwen3", 4)])
def test_explain_counts_every_rms_norm_the_model_calls(arch, per_layer):
    model = tiny_model(arch, layers=3)
    b = batch()
    L = model.config.num_hidden_layers
    expected = rms_norm_calls(model, b)
    assert expected == per_layer * L + 1  # Llama 2L+1; Gemma-2 4L+1; Qwen3 4L+1 (q/k norms per head)
    rep = kernelgraft.explain(model, **b)
    assert rep.counts()["rms_norm"] == expected, str(rep)
    assert not rep.fallbacks
    mods = {s.module for s in rep.sites}
    assert "model.norm" in mods and "model.layers.0.input_layernorm" in mods
    if arch == "qwen3":
        q = next(s for s in rep.sites if s.module == "model.layers.0.self_attn.q_norm")
        assert q.shapes["x"][-2:] == (model.config.num_attention_heads, model.config.head_dim)
    # a rotation is its attention layer's, however transformers calls its helper (5.25 calls it
    # through a kernel-hub module held in a global)
    rope = sorted({s.module for s in rep.sites if s.pattern == "rope"})
    assert rope == [f"model.layers.{i}.self_attn" for i in range(L)], str(rep)
    text = str(rep)
    assert f"{len(rep.sites)} site(s) would be replaced" in text and "model.layers.0.input_layernorm" in text
    # explain leaves the model as it was
    assert model._compiled_call_impl is None


# Loss and every gradient of these models by the rule, in float32 and bf16, against eager alone (a
# stricter bound than beside torch.compile too): tests/models/test_coverage.py's
# test_loss_and_gradients_agree, which also counts every site against the model's own calls.


def test_inductor_backend_llama():
    stock = tiny_model("llama")
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="inductor")
    verdicts = compare_models(grafted, stock, batch(), compiled=False)
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    assert grafted.kernelgraft_report.counts() == {"rms_norm": 5, "lm_head_ce": 1, "rope": 4, "gated_mlp": 2}


def test_a_module_reached_through_a_global_is_not_a_sites_module():
    from kernelgraft.rewriter.report import own_modules

    stack = {
        "a": ("L['self'].model.layers[0].self_attn", object),
        "b": ("G['__import_m'].apply_rotary_pos_emb", object),
    }
    assert [p for p, _ in own_modules(stack)] == ["L['self'].model.layers[0].self_attn"]
    only = {"b": ("G['__import_m'].apply_rotary_pos_emb", object)}
    assert own_modules(only) == list(only.values()) and own_modules(None) == []
