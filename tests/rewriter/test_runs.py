"""Each optimized model runs the code compiled for it, and its report says what runs: across the graph
breaks that leave frames shared by every model in the process (DoRA breaks the graph at each
adapted layer), past dynamo's recompile limit, and over calls that capture anew. Kernels are
counted by their launches in Triton's interpreter."""

from __future__ import annotations

import collections
import contextlib
import gc
import warnings

import pytest
import torch
from tiny import batch, tiny_model

import kernelgraft
from kernelgraft.rewriter import runs

FULL = {"rms_norm": 5, "lm_head_ce": 1, "rope": 4, "gated_mlp": 2}  # a 2-layer tiny Llama


@contextlib.contextmanager
def launches():
    """Counter of Triton kernel launches inside the block (the interpreter's), by kernel name."""
    import triton.runtime.interpreter as interpreter

    seen: collections.Counter = collections.Counter()
    run = interpreter.InterpretedFunction.run

    def counting(self, *args, **kwargs):
        seen[getattr(self.fn, "__name__", "?")] += 1
        return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counting
    try:
        yield seen
    finally:
        interpreter.InterpretedFunction.run = run


def forward_launches(seen) -> dict:
    """Forward kernel launches by pattern (a paired RoPE launch serves two sites; the LM head's
    forward is one `_loss` launch a chunk)."""
    out: collections.Counter = collections.Counter()
    for name, n in seen.items():
        pattern = name.split("__")[0]
        if pattern == "rope" and "_fwd" in name:
            out[pattern] += 2 * n if name.endswith("2") else n
        elif pattern == "lm_head_ce" and name.endswith("_loss"):
            out[pattern] += n
        elif "_fwd" in name:
            out[pattern] += n
    return dict(out)


def dora():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True, lora_dropout=0.0)
    return get_peft_model(tiny_model("llama"), config)


@pytest.mark.slow  # three DoRA models compiled frame by frame: over 20 s on a 2-core CPU
def test_models_across_graph_breaks_each_run_their_own_kernels():
    """Three DoRA models (a graph break at each adapted layer), each with other patterns, one
    explained before it is optimized: each runs exactly its own kernels, step after step, and its
    report's counts are its launches."""
    first = dora()
    explained = kernelgraft.explain(first, **batch()).counts()
    models = {
        "all": kernelgraft.optimize(first, backend="eager"),
        "rms_norm only": kernelgraft.optimize(dora(), backend="eager", patterns=["rms_norm"]),
        "none": kernelgraft.optimize(dora(), backend="eager", patterns=[]),
    }
    want = {"all": FULL, "rms_norm only": {"rms_norm": 5}, "none": {}}
    for _ in range(2):
        for name, model in models.items():
            with launches() as seen:
                model(**batch()).loss.backward()
            rep = model.kernelgraft_report
            assert forward_launches(seen) == want[name], (name, dict(seen))
            assert rep.counts() == want[name], (name, str(rep))
            assert not rep.stock_runs, (name, rep.stock_runs)
            if name == "none":
                assert not seen
    assert explained == FULL  # explain sees every site, the frames resumed per layer included


@pytest.mark.slow  # a capture per length: about 20 s on a 2-core CPU
def test_a_recompile_limit_that_leaves_stock_code_is_said():
    """dynamic=False over more lengths than dynamo's recompile limit allows: a warning names the
    limit, and the report lists the calls (by their shapes) that ran stock code."""
    gc.collect()  # the limits' room is per live optimized model
    model = kernelgraft.optimize(tiny_model("llama"), backend="eager", dynamic=False)
    room = 1 << max(0, len(runs.LIVE) - 1).bit_length()
    lengths = list(range(4, 4 + 2 * room + 3))
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for S in lengths:
            with launches() as seen:
                model(**batch(S=S)).loss.backward()
            ran_kernels = bool(seen)
    said = [str(w.message) for w in caught if str(w.message).startswith("kernelgraft:")]
    assert any(f"recompile_limit ({2 * room}) reached" in s for s in said), said
    assert not ran_kernels  # the last length ran stock code
    rep = model.kernelgraft_report
    last = f"input_ids [2, {lengths[-1]}], labels [2, {lengths[-1]}]"
    assert any(line.startswith(last) and "ran stock code" in line for line in rep.stock_runs), rep.stock_runs
    assert "calls that did not run what kernelgraft compiled" in str(rep)
    # a length compiled before the limit still runs its kernels
    with launches() as seen:
        model(**batch(S=lengths[0])).loss.backward()
    assert forward_launches(seen) == FULL


@pytest.mark.slow  # two DoRA models with a recompile limit of one: over 20 s on a 2-core CPU
def test_another_models_graphs_running_in_a_call_are_said():
    """Past the recompile limit of a frame every model shares, dynamo runs whichever compiled entry's
    guards pass: a model then runs another model's graphs. That is said, in a warning and in the
    report of the model whose call ran them."""
    torch._dynamo.reset()  # no compiled entries of earlier tests' models in the shared frames
    gc.collect()
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = kernelgraft.optimize(dora(), backend="eager")
        second = kernelgraft.optimize(dora(), backend="eager", patterns=[])
        first(**batch()).loss.backward()
        with launches() as seen:
            second(**batch()).loss.backward()
    assert seen, "the planted case did not run the first model's kernels in the second's call"
    said = [str(w.message) for w in caught if "compiled for another model ran" in str(w.message)]
    assert said, [str(w.message) for w in caught]
    assert any("compiled for another model ran" in line for line in second.kernelgraft_report.stock_runs)
