"""Decoding after optimize(): generate() compiles as many graphs as torch.compile does (prefill and
one-token decode steps, then the sizes made dynamic once), the kernels serve them, and the tokens
are eager's."""

from __future__ import annotations

import torch
from tiny import tiny_model
from torch._dynamo.utils import counters

import kernelgraft


def _generate(mode: str):
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama", torch.float32).eval()
    if mode == "torch.compile":
        model.compile(backend="eager")
    elif mode == "kernelgraft":
        kernelgraft.optimize(model, backend="eager")
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():  # three prompt lengths: the second makes dynamo's sizes dynamic
        out = [
            model.generate(ids[:, :n], attention_mask=torch.ones_like(ids[:, :n]), **kw) for n in (16, 9, 13)
        ]
    return model, out, counters["stats"]["unique_graphs"]


def test_generate_compiles_as_many_graphs_as_torch_compile_and_gives_eager_tokens():
    _, want, _ = _generate("eager")
    _, compiled, graphs_compile = _generate("torch.compile")
    model, got, graphs = _generate("kernelgraft")
    assert graphs == graphs_compile <= 4, (graphs, graphs_compile)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(want, compiled))
    report = model.kernelgraft_report
    assert report.graphs == graphs
    assert report.counts() == {"rms_norm": 5, "rope": 4, "gated_mlp": 2}  # every site of the last graph
    assert not report.fallbacks
