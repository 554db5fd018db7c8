"""Token-wise regions run over tiles of the sequence (Options.tile_tokens, rewriter/tiling.py): the
loss and every gradient by the rule against float64 truth, on both backends, in float32 and bf16;
the regions' intermediates not saved for the backward; short regions and tile_tokens=None left as
they are. The models are captured whole: the regions, their tiles and what each saves are read
per layer (`model.layers.0`...), and a region may cross a layer's boundary; the layers' graph per
class is tiled by the same pass."""

import copy

import pytest
import torch
from tiny import batch, compare_models, tiny_model

import kernelgraft
from kernelgraft import Grafter, Options
from kernelgraft.patterns import REGISTRY
from kernelgraft.rewriter import tiled
from kernelgraft.rewriter.pipeline import graft

TILE = 8


def _ok(verdicts):
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)


def _mlps_tiled(report, layers: int, tokens: set, gated=("gated_mlp.silu", "gated_mlp.gelu_tanh")):
    """Each layer's MLP is in a tiled region, for every sequence length the model was called with;
    every tiled region holds a gated product (`gated`: its op names; empty: not asked) and keeps
    one tile's share of its intermediates."""
    for i in range(layers):
        found = {t.tokens for t in report.tiles if t.tiled and f"model.layers.{i}.mlp" in t.modules}
        assert found == tokens, (i, [str(t) for t in report.tiles])
    for t in report.tiles:
        if t.tiled:
            assert t.tile == TILE and t.bytes_tile == t.bytes_untiled * TILE // t.tokens < t.bytes_untiled
            assert any(op in t.ops for op in gated) or not gated, str(t)


@pytest.mark.parametrize(
    "arch,backend,dtype,lengths",
    [
        ("llama", "eager", torch.float32, (24, 20)),
        ("llama", "eager", torch.bfloat16, (24, 20)),
        ("llama", "inductor", torch.float32, (24,)),
        ("llama", "inductor", torch.bfloat16, (20, 20)),
        ("qwen3", "eager", torch.float32, (20,)),
        ("qwen3", "eager", torch.bfloat16, (24,)),
    ],
)
def test_tiled_regions_keep_the_loss_and_every_gradient_by_the_rule(arch, backend, dtype, lengths):
    # 24 tokens: three tiles of 8; 20: two of 8 and one of 4. Beside torch.compile's reference one
    # length per model: its own compile of another length makes the next capture's sizes symbolic
    stock = tiny_model(arch, dtype)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend=backend, tile_tokens=TILE, dynamic=False, capture="whole")
    batches = [batch(seed=i, S=S) for i, S in enumerate(lengths)]
    # inductor's bf16 rounding is judged beside torch.compile's; the rest beside eager's alone (stricter)
    _ok(compare_models(mine, stock, batches, compiled=backend == "inductor" and dtype == torch.bfloat16))
    _mlps_tiled(mine.kernelgraft_report, stock.config.num_hidden_layers, set(lengths))
    if dtype == torch.bfloat16:  # a bf16 norm's weight gradient would be rounded per tile: left outside
        assert not any("rms_norm.llama" in t.ops for t in mine.kernelgraft_report.tiles if t.tiled)
    else:  # a float32 one is summed over the tiles in float32: the layer's region holds its norm
        assert any("rms_norm.llama" in t.ops for t in mine.kernelgraft_report.tiles if t.tiled)


def test_one_graph_of_symbolic_sizes_serves_every_length():
    # dynamic shapes: the regions judged by the captured length; a call shorter than the tile runs
    # one tile
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", tile_tokens=TILE, dynamic=True, capture="whole")
    _ok(compare_models(mine, stock, [batch(seed=i, S=S) for i, S in enumerate((24, 20, 6))], compiled=False))
    rep = mine.kernelgraft_report
    assert rep.graphs == 1
    _mlps_tiled(rep, stock.config.num_hidden_layers, {24})


def test_lora_adapters_on_every_linear_by_the_rule():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    stock = get_peft_model(tiny_model("llama", torch.bfloat16), cfg)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", tile_tokens=TILE, dynamic=False, capture="whole")
    verdicts = compare_models(mine, stock, batch(S=20), compiled=False)
    _ok(verdicts)
    assert sum("lora_A" in v.what or "lora_B" in v.what for v in verdicts) == 2 * 7 * 2  # every adapter
    tiles = [t for t in mine.kernelgraft_report.tiles if t.tiled]
    assert len(tiles) == 2 and all("lora.peft" in t.ops and "gated_mlp.silu" in t.ops for t in tiles)


def _saved_shapes(model, b) -> tuple[list, torch.Tensor]:
    """The shapes of what a training step's forward saves for the backward, and its loss."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**b).loss
    loss.backward()  # what the backward saves, making a tile again, lives one tile at a time
    return shapes, loss.detach()


def test_a_tiled_regions_intermediates_are_not_saved_and_only_weight_sums_change():
    stock = tiny_model("llama")
    cfg, S = stock.config, 24
    b = batch(S=S)
    wide = (2, S, cfg.intermediate_size)  # the MLP's gate, up and gated product
    saved, loss, grads = {}, {}, {}
    for tile in (None, TILE):
        mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", tile_tokens=tile, dynamic=False, capture="whole")
        mine(**b).loss.backward()  # captured outside the hooks
        saved[tile], loss[tile] = _saved_shapes(mine, b)
        grads[tile] = {n: p.grad for n, p in mine.named_parameters()}
    assert saved[None].count(wide) >= 2 * cfg.num_hidden_layers, saved[None]
    assert wide not in saved[TILE], saved[TILE]
    # the region keeps its inputs: attention's output (heads split), the residual stream, the weights
    assert (2, S, cfg.num_attention_heads, cfg.head_dim) in saved[TILE]
    assert sum(map(_numel, saved[TILE])) < sum(map(_numel, saved[None]))
    # each token computed as untiled: the same loss, and the same gradients of the weights outside
    # the tiled regions (they read the token gradients the regions return); inside, only the sums
    # over the tiles differ (judged by the rule above)
    assert torch.equal(loss[TILE], loss[None])
    tiled_modules = {m for t in mine.kernelgraft_report.tiles if t.tiled for m in t.modules}
    outside = [n for n in grads[None] if n.rsplit(".", 1)[0] not in tiled_modules]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight"} <= set(
        outside
    )
    assert all(torch.equal(grads[TILE][n], grads[None][n]) for n in outside), outside


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _captured(model, b) -> torch.fx.GraphModule:
    """dynamo's graph of a training step of `model` (not grafted)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=keep, dynamic=False)(**b)
    (gm,) = graphs
    return gm


def test_short_regions_and_no_tile_change_nothing():
    b = batch(S=24)
    gm = _captured(tiny_model("llama"), b)
    spellings = REGISTRY.spellings()
    code, tiles = {}, {}
    for tile in (None, 24, 64):
        g = copy.deepcopy(gm)
        rep = graft(g, spellings, Options(backend="eager", tile_tokens=tile), training=True)
        code[tile], tiles[tile] = g.code, rep.tiles
    assert tiles[None] == [] and code[24] == code[64] == code[None]
    assert "tiled_region" not in code[None]
    assert tiles[24] and not any(t.tiled for t in tiles[24])
    mlp = [t for t in tiles[24] if "model.layers.0.mlp" in t.modules]
    assert [t.reason for t in mlp] == ["24 tokens, not more than a tile's 24"], [str(t) for t in tiles[24]]
    g = copy.deepcopy(gm)
    graft(g, spellings, Options(backend="eager", tile_tokens=TILE), training=True)
    calls = [n for n in g.graph.nodes if n.target is tiled.TILED]
    assert len(calls) == 2  # a region per layer: from o_proj through its MLP to the next norm's q/k/v


def test_a_dry_run_reports_the_tiles_and_runs_the_graph_as_captured():
    # a dry run judges the graph as captured: stock norms where a run would have their kernels
    model, b = tiny_model("llama"), batch(S=24)
    grafter = Grafter(options=Options(backend="eager", tile_tokens=TILE), dry_run=True, training=True)
    n = len(tiled.TABLE)
    with torch.no_grad():
        out = torch.compile(model, backend=grafter, dynamic=False)(**b).loss
        want = model(**b).loss
    assert torch.equal(out, want)
    assert len(tiled.TABLE) == n  # nothing registered: nothing replaced
    _mlps_tiled(grafter.report, model.config.num_hidden_layers, {24}, gated=())
    done = sum(t.tiled for t in grafter.report.tiles)
    assert f"token-wise regions: {done} of {len(grafter.report.tiles)} run over tiles" in str(grafter.report)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_checkpointed_layers_are_tiled_inside(backend):
    stock = tiny_model("llama")
    mine = copy.deepcopy(stock)
    mine.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    mine.train()
    kernelgraft.optimize(mine, backend=backend, tile_tokens=TILE, dynamic=False, capture="whole")
    _ok(compare_models(mine, stock, batch(S=20), compiled=False))
    tiles = [t for t in mine.kernelgraft_report.tiles if t.tiled]
    assert [t.module for t in tiles] == ["model.layers.0", "model.layers.1"]  # each layer's graph its own
