"""optimize() is in place, keeps checkpoints working, and touches nothing else in the process."""

import copy

import pytest
import torch
from tiny import batch, tiny_model
from transformers import AutoModelForCausalLM

import kernelgraft
from kernelgraft.kernels.rows import MAX_N, launch


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = launch.forward

    def counting(spelling, args, rounding="autograd"):
        if spelling.pattern == "rms_norm":
            calls.append(spelling.qualname)
        return real(spelling, args, rounding)

    monkeypatch.setattr(launch, "forward", counting)
    return calls


def test_optimize_returns_the_same_object_and_keeps_state_dict_keys():
    model = tiny_model("llama")
    keys = list(model.state_dict())
    assert kernelgraft.optimize(model, backend="eager") is model
    assert list(model.state_dict()) == keys
    assert not any("_orig_mod" in k for k in model.state_dict())


def test_no_global_side_effect(kernel_calls):
    grafted = kernelgraft.optimize(tiny_model("llama"), backend="eager")
    stock = tiny_model("llama", seed=1)
    b = batch()
    stock(**b).loss.backward()
    assert kernel_calls == []  # the un-optimized model in the same process ran the stock code
    grafted(**b).loss.backward()
    assert len(kernel_calls) == 5
    assert type(stock).forward is type(grafted).forward  # no class was patched


def test_save_pretrained_round_trip(tmp_path):
    model = kernelgraft.optimize(tiny_model("qwen3"), backend="eager")
    b = batch()
    with torch.no_grad():
        ref = model(**b).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert set(loaded.state_dict()) == set(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    kernelgraft.optimize(loaded, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**b).logits, ref, rtol=0, atol=0)


def test_named_backend_is_registered():
    norm = tiny_model("llama", layers=1).model.norm
    x = torch.randn(2, 3, 64, requires_grad=True)
    ref = norm(x)
    out = torch.compile(norm, backend="kernelgraft")(x)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_patterns_argument_selects_and_validates():
    model = tiny_model("llama")
    rep = kernelgraft.explain(model, patterns=[], **batch())
    assert rep.counts() == {}
    with pytest.raises(KeyError, match="no pattern named 'group_norm'"):
        kernelgraft.optimize(copy.deepcopy(model), patterns=["group_norm"])
    only_rope = kernelgraft.patterns.Registry()
    for sp in kernelgraft.patterns.REGISTRY.spellings(["rope"]):
        only_rope.add(sp)
    assert set(kernelgraft.explain(model, patterns=only_rope, **batch()).counts()) == {"rope"}


def test_bad_arguments_are_explained():
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        kernelgraft.optimize(lambda x: x)
    with pytest.raises(ValueError, match="backend must be one of"):
        kernelgraft.optimize(torch.nn.Linear(2, 2), backend="tensorrt")
    with pytest.raises(ValueError, match=r"wrapper must be one of \('auto', 'python'\), got 'c\+\+'"):
        kernelgraft.optimize(torch.nn.Linear(2, 2), wrapper="c++")
    with pytest.raises(ValueError, match="recompute must be True, False or 'separate', got 'fused'"):
        kernelgraft.optimize(torch.nn.Linear(2, 2), recompute="fused")
    for bad in (0, -5.0, "100", True):
        with pytest.raises(
            ValueError, match=r"ddp_piece_mb must be a positive, finite size in MiB or None \(DDP's own"
        ):
            kernelgraft.optimize(torch.nn.Linear(2, 2), ddp_piece_mb=bad)
    m = torch.nn.Linear(2, 2)
    assert kernelgraft.optimize(m, ddp_piece_mb=None) is m and kernelgraft.optimize(m, ddp_piece_mb=12.5) is m


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
def test_many_optimized_models_in_one_process_each_run_the_kernels(kernel_calls):
    # Dynamo's recompile limit is per code object; each optimized model must stay compiled.
    b = batch()
    for i in range(10):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        model = kernelgraft.optimize(tiny_model("llama", dtype=dtype, layers=1, seed=i), backend="eager")
        kernel_calls.clear()
        model(**b)
        assert len(kernel_calls) == 3, f"model {i} ran uncompiled"


def test_report_counts_the_code_that_runs_after_recompiles():
    model = kernelgraft.optimize(tiny_model("llama"), backend="eager")
    for S in (8, 12, 16):  # new sequence lengths: dynamo recompiles the same frame
        model(**batch(S=S))
    rep = model.kernelgraft_report
    assert rep.graphs >= 2
    assert rep.counts() == {"rms_norm": 5, "lm_head_ce": 1, "rope": 4, "gated_mlp": 2}


def test_rows_wider_than_the_kernels_serve_fall_back_reported():
    """A row over MAX_N elements is not served: the site keeps the stock code, explain says why, and
    the optimized model computes exactly what the stock one does."""
    class WideNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(MAX_N + 1) + 0.5)

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * h.to(x.dtype)

    x = torch.randn(2, MAX_N + 1)
    rep = kernelgraft.explain(WideNorm(), x)
    assert rep.counts() == {} and len(rep.fallbacks) == 1
    assert f"rows of {MAX_N + 1} elements" in rep.fallbacks[0].reason
    stock = WideNorm()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    torch.testing.assert_close(mine(x), stock(x), rtol=0, atol=0)
    assert mine.kernelgraft_report.counts() == {} and mine.kernelgraft_report.fallbacks
