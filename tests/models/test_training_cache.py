"""A training forward whose layers are graphs of their own (offloaded layers; FSDP2's sharded ones)
builds no KV cache unless asked: the layers' one graph compiles once, and what the caller asks of
the cache is kept."""

from __future__ import annotations

import pytest
import torch
from tiny import batch, compare_models, tiny_model

import kernelgraft


def layer_compiles(rep) -> dict[int, set[int]]:
    """{frame: the compiles of that frame} among the frames holding a `gated_mlp` site."""
    out: dict[int, set[int]] = {}
    for r in rep.sites:
        if r.pattern == "gated_mlp":
            out.setdefault(r.graph[0], set()).add(r.graph[1])
    return out


def test_layers_as_separate_graphs_compile_once_and_train_by_the_rule():
    torch.manual_seed(0)
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(tiny_model("llama"), backend="eager", offload=True)
    mine.load_state_dict(stock.state_dict())
    b = batch()
    out = mine(**b)
    assert out.past_key_values is None  # the training step filled no cache
    compiles = layer_compiles(mine.kernelgraft_report)
    # one frame for both layers, compiled once: the layer index is no guard without the cache
    assert len(compiles) == 1 and list(compiles.values()) == [{0}], compiles
    # the one graph runs once per layer: its kernels launch twice a step
    assert mine.kernelgraft_report.counts()["gated_mlp"] == 2
    out.loss.backward()
    verdicts = compare_models(mine, stock, b, compiled=False)
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad and len(verdicts) == 1 + len(list(stock.parameters())), "\n".join(bad)


@pytest.mark.slow  # over 20 s on a 2-core CPU
def test_what_the_caller_asks_of_the_cache_is_kept():
    mine = kernelgraft.optimize(tiny_model("llama"), backend="eager", offload=True)
    b = batch()
    assert mine(**b).past_key_values is None
    assert mine(**b, use_cache=True).past_key_values is not None  # asked for: kept
    plain = kernelgraft.optimize(tiny_model("llama"), backend="eager")
    assert plain(**b).past_key_values is not None  # one graph for every layer: the model's own way
    with torch.no_grad():  # evaluation and decoding fill it as the model's config says
        assert mine(input_ids=b["input_ids"]).past_key_values is not None
    mine.eval()
    assert mine(input_ids=b["input_ids"]).past_key_values is not None
