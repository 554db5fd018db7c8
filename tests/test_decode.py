"""Decoding after optimize(): generate() compiles as many graphs as torch.compile does (prefill and
one-token decode steps, then the sizes made dynamic once), the kernels serve them, and the tokens
are eager's."""

from __future__ import annotations

import pytest
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


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
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


def test_under_inductor_a_graph_without_gradients_leaves_its_row_sites_to_inductor():
    """generate() under the inductor backend: the norms, RoPE and MLPs of its graphs are left to
    inductor (fused with the residual adds and the cache's concatenation), reported with why, and
    the tokens are eager's; a training step of the same model then serves every site, and
    inference="kernels" serves the decoding graphs too."""
    torch._dynamo.reset()
    stock = tiny_model("llama", torch.float32).eval()
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.no_grad():
        want = stock.generate(ids, **kw)
    for inference in ("inductor", "kernels"):
        model = kernelgraft.optimize(tiny_model("llama", torch.float32).eval(), inference=inference)
        with torch.no_grad():
            got = model.generate(ids, **kw)
        assert torch.equal(got, want), inference
        report = model.kernelgraft_report
        left = [f for f in report.fallbacks if f.reason.startswith("left to inductor")]
        if inference == "kernels":
            assert not left and report.counts() == {"rms_norm": 5, "rope": 4, "gated_mlp": 2}
            continue
        assert (
            not report.counts()
            and sorted(f.pattern for f in left) == ["gated_mlp"] * 2 + ["rms_norm"] * 5 + ["rope"] * 4
        )
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()  # gradients on: another capture, kernels served
        assert report.counts() == {"rms_norm": 5, "rope": 4, "gated_mlp": 2, "lm_head_ce": 1}
