"""capture="layers": one compiled graph per decoder-layer class serves every layer, so the work of
capture (the ops dynamo traces, the graph nodes the rewriter and the lowering process) does not grow
with depth, while every layer's sites are served and the numbers pass the accuracy rule; the report
says how the model was captured and what its first call spent its time on."""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from checks import assert_ok
from tiny import batch, compare_models, tiny_model

import kernelgraft

HERE = Path(__file__).resolve().parent


def names(model) -> list[str]:
    return ["loss"] + [f"grad {n}" for n, p in model.named_parameters() if p.requires_grad]


def grafter_of(model):
    return model._compiled_call_impl.args[0].grafter


def _decode(model, prompt):
    return model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)


def capture_work(make, kind: str, capture: str) -> tuple[dict, kernelgraft.RewriteReport, object]:
    """One call of `kind` ("training", "evaluation", "decoding") of make() optimized with `capture`,
    from dynamo's fresh state: the work it took (dynamo's traced calls, the nodes rewritten and
    lowered), its report, and what it returned (loss, logits or tokens)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = kernelgraft.optimize(make(), backend="eager", capture=capture)
    b = batch()
    if kind == "training":
        out = model(**b).loss
        out.backward()
    elif kind == "evaluation":
        with torch.no_grad():
            out = model(input_ids=b["input_ids"]).logits
    else:
        model.eval()
        out = _decode(model, b["input_ids"][:, :6])
    g = grafter_of(model)
    work = dict(
        traced=counters["stats"]["calls_captured"], rewritten=g.nodes["rewritten"], lowered=g.nodes["lowered"]
    )
    return work, model.kernelgraft_report, out


def _sites(arch: str, L: int) -> dict:
    """The row sites a tiny `arch` of L layers has: two norms (and Qwen3's q and k norms), q and k's
    RoPE and one gated MLP per layer, and the final norm."""
    norms = 4 if arch == "qwen3" else 2
    return {"rms_norm": norms * L + 1, "rope": 2 * L, "gated_mlp": L}


@pytest.mark.parametrize("kind", ["training", "evaluation", "decoding"])
# Qwen3's cases in the slow suite: each case compiles four models, over 20 s on a 2-core CPU
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_the_work_of_capture_does_not_grow_with_depth(arch, kind):
    work = {}
    for L in (2, 8):
        work[L], rep, _ = capture_work(lambda L=L: tiny_model(arch, layers=L), kind, "layers")
        counts = rep.counts(kind)
        if kind == "training":  # every layer's sites served: the counts scale with depth
            assert {k: counts.get(k) for k in _sites(arch, L)} == _sites(arch, L), (L, counts)
            assert counts.get("lm_head_ce") == 1
        else:  # evaluation and decoding leave the row sites to nothing here (the eager backend serves them)
            assert counts.get("rms_norm", 0) in (0, _sites(arch, L)["rms_norm"]), counts
        assert rep.captured_as["kind"] == "layers"
    for what in ("traced", "rewritten", "lowered"):
        assert work[8][what] <= 1.3 * work[2][what], (what, work)
    assert work[2]["traced"] > 0 and work[2]["rewritten"] > 0


def test_captured_whole_the_work_grows_with_depth():
    """The measure above can fail: the whole model's capture traces every layer."""
    work = {
        L: capture_work(lambda L=L: tiny_model("llama", layers=L), "training", "whole")[0] for L in (2, 8)
    }
    assert work[8]["traced"] > 2.5 * work[2]["traced"], work
    assert work[8]["rewritten"] > 2.5 * work[2]["rewritten"], work


@pytest.mark.slow  # over 20 s on a 2-core CPU
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_eight_layers_pass_the_rule_evaluate_and_decode_as_stock(arch):
    stock = tiny_model(arch, layers=8)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", capture="layers")
    assert_ok(compare_models(mine, stock, batch(), compiled=False), names(stock))
    b = batch()
    with torch.no_grad():
        torch.testing.assert_close(
            mine(input_ids=b["input_ids"]).logits, stock(input_ids=b["input_ids"]).logits
        )
    mine.eval(), stock.eval()
    prompt = b["input_ids"][:, :6]
    assert torch.equal(_decode(mine, prompt), _decode(stock, prompt))
    rep = mine.kernelgraft_report
    assert rep.captured_as["stack"].cache_views[1] == 0  # every layer read its slot: one graph for all
    said = str(rep)
    assert "captured per layer class: the 8 layers of model.layers" in said
    assert "first training call:" in said and "first decoding call:" in said


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_layers_decoding_steps_share_one_graph_from_the_first(cache):
    """generate() per layer class: the layers compile two graphs, the prompt's and the decoding
    steps' (a growing cache's length dynamic from the first step that reads it, laid out as the
    steps lay it; a static cache's as it is), not a third when that length first changes; the
    tokens are the stock model's."""
    torch._dynamo.reset()
    stock = tiny_model("llama", layers=4).eval()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", capture="layers")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        assert torch.equal(mine.generate(ids, **kw), stock.generate(ids, **kw))
    stack = mine.kernelgraft_report.captured_as["stack"]
    assert dict(stack.graphs) == {"decoding": 2}, stack.graphs
    assert stack.cache_views == [4 * 6, 0]  # every layer's call with the cache read its slot


def _lora(make):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(make(), cfg)


@pytest.mark.slow  # over 20 s on a 2-core CPU
def test_a_peft_lora_model_is_captured_per_layer_class():
    work = {}
    for L in (2, 8):
        work[L], rep, _ = capture_work(
            lambda L=L: _lora(lambda: tiny_model("llama", layers=L)), "training", "layers"
        )
        assert rep.counts("training").get("lora") == 7 * L and rep.counts("training")["rms_norm"] == 2 * L + 1
        assert rep.captured_as["stack"].path == "base_model.model.model.layers"
        # the first layer reads frozen embeddings, yet shares the others' graph
        assert dict(rep.captured_as["stack"].graphs) == {"training": 1}
    for what in ("traced", "rewritten", "lowered"):
        assert work[8][what] <= 1.3 * work[2][what], (what, work)
    stock = _lora(lambda: tiny_model("llama", layers=4))
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", capture="layers")
    assert_ok(compare_models(mine, stock, batch(), compiled=False), names(stock))


@pytest.mark.slow  # over 20 s on a 2-core CPU
def test_a_qlora_model_is_captured_per_layer_class(tmp_path):
    import bitsandbytes  # noqa: F401 - the qlora extra, which make test installs: fails here, not skipped, without it
    sys.path.insert(0, str(HERE.parent / "patterns"))
    from test_qlora import qlora_model

    work = {}
    for L in (2, 8):

        def make(L=L):
            return qlora_model("llama", torch.float32, tmp_path / f"q{L}", layers=L)

        work[L], rep, loss = capture_work(make, "training", "layers")
        assert rep.counts("training")["rms_norm"] == 2 * L + 1 and rep.counts("training").get("lora") == 7 * L
        assert torch.isfinite(loss)
    for what in ("traced", "rewritten", "lowered"):
        assert work[8][what] <= 1.3 * work[2][what], (what, work)
    stock = qlora_model("llama", torch.float32, tmp_path / "q2", layers=2)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", capture="layers")
    assert_ok(compare_models(mine, stock, batch(), compiled=False), names(stock))


@pytest.mark.parametrize("arch", ["gpt_neox", "bloom"])
def test_torchs_own_norms_outside_the_layers_are_served_as_captured_whole(arch):
    """A final nn.LayerNorm (and Bloom's embeddings' one) runs where the model's code around the
    layers' calls runs as Python, which dynamo does not trace into torch.nn: each runs a compiled
    entry of its own, served as in the whole capture, the numbers by the rule."""
    stock = tiny_model(arch)
    whole = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", capture="whole")
    whole(**batch()).loss.backward()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", capture="layers")
    assert_ok(compare_models(mine, stock, batch(), compiled=False), names(stock))
    want = whole.kernelgraft_report.counts("training")["layer_norm"]
    assert mine.kernelgraft_report.counts("training")["layer_norm"] == want == (6 if arch == "bloom" else 5)
    outside = [s.module for s in mine.kernelgraft_report.sites if s.pattern == "layer_norm" and ".*" not in s.module]
    assert outside == (
        ["transformer.word_embeddings_layernorm", "transformer.ln_f"] if arch == "bloom" else ["gpt_neox.final_layer_norm"]
    ), outside


def test_models_captured_per_layer_class_leave_the_processs_other_compiles_alone():
    """The frames around the layers' calls are each model's own: more models than dynamo's
    recompile limit are captured per layer class, each serves every site, and a plain torch.compile
    of the same class afterwards still compiles its graph (run as transformers wrote them, those
    frames would fill that limit for the whole process, and the plain compile would run uncompiled)."""
    from kernelgraft._dynamo import _LIMITS

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch._dynamo.config.patch(**{k: 2 for k in _LIMITS}):
        for seed in range(4):
            model = kernelgraft.optimize(tiny_model("llama", seed=seed), backend="eager", capture="layers")
            model(**batch()).loss.backward()
            counts = model.kernelgraft_report.counts("training")
            assert {k: counts.get(k) for k in _sites("llama", 2)} == _sites("llama", 2), (seed, counts)
            assert counts.get("lm_head_ce") == 1, (seed, counts)
        plain = torch.compile(tiny_model("llama"), backend=counting)
        plain(**batch())
    assert graphs, "the plain torch.compile ran uncompiled"


def test_the_forward_above_the_layers_reads_as_the_models_own():
    """The modules above the layers run copies of their forward; what reads a forward as a bound
    method reads the copy as it would the original (Trainer keeps the batch's columns the forward's
    signature names: a signature of *args would drop every column), and a copy of the model gets its
    class's forward back."""
    import inspect

    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", capture="layers")
    assert inspect.signature(mine.forward) == inspect.signature(stock.forward)
    assert mine.forward.__self__ is mine and mine.forward.__func__ is not type(mine).forward
    assert mine.forward.__func__.__code__ is not type(mine).forward.__code__
    # a copy is optimized anew, with copies of its own (what the original's forward pickles to, its
    # class's forward bound to the copy, is replaced)
    for again in (pickle.loads(pickle.dumps(mine)), copy.deepcopy(mine)):
        assert again.forward.__self__ is again, again.forward
        assert again.forward.__func__ not in (type(again).forward, mine.forward.__func__)
    assert pickle.loads(pickle.dumps(mine.forward)).__func__ is type(mine).forward  # alone: the class's
    # an instance that holds its class's forward bound to it takes the copy; one that holds a
    # forward of another's (accelerate's hooks) keeps it
    import types

    held = tiny_model("llama")
    held.forward = types.MethodType(type(held).forward, held)
    kernelgraft.optimize(held, backend="eager", capture="layers")
    assert held.forward.__func__ is not type(held).forward
    hooked = tiny_model("llama")
    theirs = hooked.forward = functools.partial(type(hooked).forward, hooked)
    kernelgraft.optimize(hooked, backend="eager", capture="layers")
    assert hooked.__dict__["forward"] is theirs


def test_the_report_says_how_the_model_was_captured():
    layered = kernelgraft.optimize(tiny_model("llama"), backend="eager", capture="layers")
    layered(**batch()).loss.backward()
    assert "captured per layer class: the 2 layers of model.layers" in str(layered.kernelgraft_report)
    whole = kernelgraft.optimize(tiny_model("llama"), backend="eager")  # the default
    whole(**batch()).loss.backward()
    said = str(whole.kernelgraft_report)
    assert 'captured whole: as capture="whole" asks' in said
    first = whole.kernelgraft_report.startup["training"]
    # the line names the parts of 0.05 s or more (the rewriting of a tiny model may take less)
    assert f"first training call: {first.wall:.1f} s (" in said
    assert first.wall > 0 and first.parts["kernelgraft's rewriting"] > 0
    assert first.wall >= first.parts["kernelgraft's rewriting"]
    with pytest.raises(ValueError, match="capture must be"):
        kernelgraft.optimize(tiny_model("llama"), capture="layer")
    # offload runs each layer as a graph of its own whatever capture says
    offloaded = kernelgraft.optimize(tiny_model("llama"), backend="eager", offload=True, capture="whole")
    assert offloaded.kernelgraft_report.captured_as["kind"] == "layers"


# ---- a warm start ----------------------------------------------------------------------------------

_STEP = textwrap.dedent(
    """
    import hashlib, json, sys, time
    import torch
    sys.path.insert(0, {helpers!r})
    from tiny import batch, tiny_model
    import kernelgraft
    from kernelgraft.kernels import cache
    from torch._dynamo.utils import counters

    model = kernelgraft.optimize(tiny_model("llama", layers=4), capture="layers", lm_head_chunk={chunk})
    start = time.perf_counter()
    loss = model(**batch()).loss
    loss.backward()
    took = time.perf_counter() - start
    grads = hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in model.parameters())).hexdigest()
    ind, aot = counters["inductor"], counters["aot_autograd"]
    print(json.dumps(dict(
        loss=loss.item(), grads=grads, took=took,
        fx_hit=ind["fxgraph_cache_hit"], fx_miss=ind["fxgraph_cache_miss"],
        aot_hit=aot["autograd_cache_hit"], aot_miss=aot["autograd_cache_miss"],
        kernels_hit=cache.STATS["hit"], kernels_written=cache.STATS["written"],
    )))
    """
)


def _step_in_a_process(caches: Path, chunk: int = 8) -> dict:
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
        TRITON_CACHE_DIR=str(caches / "triton"),
        KERNELGRAFT_CACHE_DIR=str(caches / "kernelgraft"),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
    )
    code = _STEP.format(helpers=str(HERE.parent / "helpers"), chunk=chunk)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # three processes, each an inductor compile of a training step: over a minute on a 2-core CPU
def test_a_second_process_with_the_same_caches_compiles_nothing_and_matches_bit_for_bit(tmp_path):
    cold = _step_in_a_process(tmp_path)
    assert cold["fx_miss"] > 0 and cold["kernels_written"] > 0
    warm = _step_in_a_process(tmp_path)
    assert warm["fx_miss"] == 0 and warm["aot_miss"] == 0 and warm["fx_hit"] + warm["aot_hit"] > 0, warm
    assert warm["kernels_written"] == 0 and warm["kernels_hit"] > 0, warm
    assert (warm["loss"], warm["grads"]) == (cold["loss"], cold["grads"])
    # another option: the graph it makes is another, and compiles anew
    other = _step_in_a_process(tmp_path, chunk=7)
    assert other["fx_miss"] > 0 or other["aot_miss"] > 0, other


def test_no_autotuning_on_the_first_step_unless_asked():
    """Launch configurations come from the tuned tables: no kernel of kernelgraft's is autotuned, and
    inductor autotunes only where the user's mode asks (max-autotune)."""
    import kernelgraft as package
    from kernelgraft.kernels import source

    root = Path(package.__file__).parent
    for path in root.rglob("*.py"):
        assert "triton.autotune" not in path.read_text() and "@autotune" not in path.read_text(), path
    for family in ("rms_norm", "rope", "gated_mlp"):
        assert "autotune" not in str(source(family))
    assert kernelgraft.Options().mode in (None, "default")
