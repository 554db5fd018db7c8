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
    elif mode == "kernelgraft":  # captured whole: the model's graphs are torch.compile's
        kernelgraft.optimize(model, backend="eager", capture="whole")
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
        left = [f for f in report.current().fallbacks if f.reason.startswith("left to inductor")]
        if inference == "kernels":
            assert not left and report.counts() == {"rms_norm": 5, "rope": 4, "gated_mlp": 2}
            continue
        # a record per site: captured per layer class, the layers' sites once for both layers
        L = 1 if report.captured_as["kind"] == "layers" else 2
        assert (
            not report.counts()
            and sorted(f.pattern for f in left) == ["gated_mlp"] * L + ["rms_norm"] * (2 * L + 1) + ["rope"] * (2 * L)
        )
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()  # gradients on: another capture, kernels served
        assert report.counts() == {"rms_norm": 5, "rope": 4, "gated_mlp": 2, "lm_head_ce": 1}


def test_the_decoding_steps_graph_gets_the_cpp_wrapper_on_cuda_and_the_others_python():
    """Inductor's C++ wrapper (its launches without Python) for a graph without gradients, with
    dynamic sizes and none of kernelgraft's kernels, on CUDA outside CUDA graphs: the graph of
    generate()'s decoding steps; Python's for every other graph, and for all with wrapper="python"."""
    from kernelgraft import Options

    auto = Options()
    assert auto.cpp_wrapper(training=False, cuda=True, dynamic=True, kernels=False)  # decoding steps
    assert not auto.cpp_wrapper(training=False, cuda=True, dynamic=False, kernels=False)  # a prompt's
    assert not auto.cpp_wrapper(training=False, cuda=True, dynamic=True, kernels=True)  # inference="kernels"
    assert not auto.cpp_wrapper(training=True, cuda=True, dynamic=True, kernels=False)
    assert not auto.cpp_wrapper(training=False, cuda=False, dynamic=True, kernels=False)  # the CPU
    assert not Options(mode="reduce-overhead").cpp_wrapper(False, True, True, False)  # replayed
    assert not Options(wrapper="python").cpp_wrapper(False, True, True, False)
    assert not Options(backend="eager").cpp_wrapper(False, True, True, False)


def test_a_graph_that_calls_kernelgrafts_ops_is_told_from_one_that_does_not():
    from kernelgraft.rewriter import backend

    torch._dynamo.reset()
    model = tiny_model("llama", torch.float32)
    gms = []
    kernelgraft.optimize(model, backend="eager")
    model._compiled_call_impl.args[0].grafter._lower = lambda gm, ex: gms.append(gm) or gm.forward
    model(**{"input_ids": torch.randint(3, 128, (1, 8))})
    stock = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert any(backend._has_kernels(gm) for gm in gms) and not backend._has_kernels(stock)


def test_a_cpp_wrapper_that_fails_to_compile_is_compiled_again_with_python(monkeypatch):
    """Where the C++ wrapper fails (no C++ compiler, say), the graph compiles with the Python
    wrapper, said in a warning, and computes what the model computes."""
    import torch._inductor.compile_fx as inductor_compile

    from kernelgraft.rewriter import backend

    real, asked = inductor_compile.compile_fx, []

    def compile_fx(gm, example_inputs, config_patches=None, **kw):
        asked.append(bool((config_patches or {}).get("cpp_wrapper")))
        if asked[-1]:
            raise RuntimeError("no C++ compiler on this machine")
        return real(gm, example_inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(inductor_compile, "compile_fx", compile_fx)
    monkeypatch.setattr(backend, "_on_cuda", lambda example_inputs: True)  # as a CUDA graph would be
    monkeypatch.setattr(backend, "_dynamic", lambda example_inputs: True)  # and a decoding step's
    torch._dynamo.reset()
    torch.manual_seed(0)
    stock = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    model = kernelgraft.optimize(torch.nn.Sequential(*[m for m in stock]))
    x = torch.randn(3, 8)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="C\\+\\+ wrapper failed to compile this graph"):
        got = model(x)
    # asked once with the C++ wrapper, then with Python's (inductor's compile_fx calls itself again)
    assert asked[0] and asked.count(True) == 1 and len(asked) >= 2
    torch.testing.assert_close(got, stock(x).detach())
    report = model.kernelgraft_report
    assert report.wrappers == {"Python (the C++ wrapper failed to compile)": 1}
    assert "1 Python (the C++ wrapper failed to compile)" in str(report)


def test_the_report_counts_the_graphs_by_their_wrapper(monkeypatch):
    """report.wrappers: a graph that gets the C++ wrapper is counted as C++, the others as Python."""
    import torch._inductor.compile_fx as inductor_compile

    from kernelgraft.rewriter import backend

    real = inductor_compile.compile_fx

    def compile_fx(gm, example_inputs, config_patches=None, **kw):
        if (config_patches or {}).get("cpp_wrapper"):
            return gm.forward  # as a C++ wrapper's compile would return a callable
        return real(gm, example_inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(inductor_compile, "compile_fx", compile_fx)
    monkeypatch.setattr(backend, "_on_cuda", lambda example_inputs: True)
    torch._dynamo.reset()
    model = kernelgraft.optimize(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.SiLU()))
    x = torch.randn(3, 8)
    with torch.no_grad():
        model(x)  # fixed sizes: Python
        model(torch.randn(5, 8))  # a second size: dynamo compiles with dynamic sizes, C++
    assert model.kernelgraft_report.wrappers == {"Python": 1, "C++": 1}
    assert "1 C++, 1 Python" in str(model.kernelgraft_report)
