"""Linear layers that read the same input become one matmul (edits the fx graph: after the sites).

A decoder layer projects one normalized input three times (q, k and v) and its MLP twice (gate and
up). Where the host sets the pace (a small model's training step launches well over a thousand
kernels, a third of them matmuls), every matmul is a launch whose host time the GPU waits for. Here the k linears of a group become

    W = cat([W_1, ..., W_k])                # the weights stacked along the output dim
    y = linear(x, W)                        # one matmul: [..., N_1 + ... + N_k]
    y_i = y[..., o_i : o_i + N_i]           # each layer's output, a view

and AOT autograd derives the rest: the input gradient is one matmul over the stacked output
gradient (k matmuls and k - 1 adds before), the weight gradient one matmul whose rows are each
weight's gradient. Each output element is the same dot product, accumulated in float32 as before;
the input gradient is summed in float32 and rounded once where the k gradients were rounded and
then added in the input's dtype. A stacked weight of more than SAVE_BYTES is tagged for recompute,
so the backward stacks the weights again (they are at hand anyway) instead of keeping a copy; a
smaller one is saved: stacking it again would cost the host a launch per group for a copy that
takes the GPU less time than the launch takes the host (a 135M Llama's step: 60 launches, 138 MiB
saved, 4% of its memory above the start; a Llama-3.2-1B's groups are 12 and 64 MiB: recomputed).
One cost in memory remains:
an output saved for the backward as a view keeps the whole fused output alive. Attention saves v,
so a q/k/v group keeps q's and k's columns too (tokens x (N_q + N_k) per layer, small beside a
small model's peak); gate and up are both saved
by the gated MLP's backward anyway.

A group is fused only where it pays:
  - the graph is a training graph under the inductor backend (whose partitioner honours the
    recompute tag; in a graph without gradients the stacking copy would cost what it saves);
  - its sizes are static, and the fused matmul is small: at most FUSE_FLOPS. Above that the GPU
    sets the pace, and the stacking copies (the weights, and the output gradients of the sites'
    kernels) cost more device time than the launches save: a Llama-3.2-1B step's q/k/v matmul is
    2 x 16384 x 2048 x 3072 = 206 Gflop;
  - the weights are distinct tensors of one dtype and device, all with a bias or none, made before
    the first of the layers, with no grad-mode or autocast switch between the layers.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from .ddp import global_state_switch
from .replace import copy_source_meta, tag_recompute
from .report import SiteRecord, example_value, module_path

PATTERN, SPELLING = "linear", "shared_input"
REWRITES = {f"{PATTERN}.{SPELLING}": "linear layers that read one input fused into one matmul (Options.fuse_projections)"}
LINEARS = (F.linear, torch._C._nn.linear)
# the largest matmul (2 M K N flops) fused: one short enough that its launch, not its work, sets
# the pace (a 135M Llama's groups are under it, a 1B's over it)
FUSE_FLOPS = 1e11
# a stacked weight of at most this many bytes is saved for the backward, a larger one made again
SAVE_BYTES = 4 * 2**20


def _linear_args(n: fx.Node) -> tuple | None:
    """(x, w, b) of a linear call (b None without a bias), or None."""
    if n.op != "call_function" or n.target not in LINEARS:
        return None
    names = ("input", "weight", "bias")
    args = list(n.args) + [n.kwargs.get(k) for k in names[len(n.args) :]]
    if len(args) < 2 or any(k not in names for k in n.kwargs):
        return None
    x, w, b = (args + [None])[:3]
    return x, w, b


def _static(v) -> bool:
    return isinstance(v, torch.Tensor) and all(type(d) is int for d in v.shape)


def why_not(members: list[tuple], outs: list | None = None) -> str | None:
    """Why a group of linears reading one input is not fused (None: it is). members: (x, w, b)
    example values; outs: their outputs' (an autocast region's edge between them: dtypes differ)."""
    x = members[0][0]
    ws = [w for _, w, _ in members]
    if not _static(x) or not all(_static(w) and w.dim() == 2 for w in ws):
        return "symbolic sizes, or a weight that is not a matrix"
    if len({(w.dtype, w.device) for w in ws}) != 1:
        return "weights of different dtypes or devices"
    if outs is not None and len({getattr(o, "dtype", None) for o in outs}) != 1:
        return "outputs of different dtypes (computed under different autocast settings)"
    bs = [b for _, _, b in members]
    if any(b is None for b in bs) and not all(b is None for b in bs):
        return "some with a bias, some without"
    if any(b is not None and (not _static(b) or b.dim() != 1 or b.dtype != ws[0].dtype) for b in bs):
        return "a bias that is not a vector of the weights' dtype"
    flops = 2 * math.prod(x.shape[:-1]) * x.shape[-1] * sum(w.shape[0] for w in ws)
    if flops > FUSE_FLOPS:
        return f"a large matmul ({flops / 1e9:.0f} Gflop > {FUSE_FLOPS / 1e9:.0f}): the GPU sets the pace"
    return None


def groups(graph: fx.Graph) -> list[list[fx.Node]]:
    """Linear calls that read the same input with distinct weights, two or more, in graph order."""
    by_input: dict = {}  # x -> {weight node: its first linear}
    for n in graph.nodes:
        got = _linear_args(n)
        if got is not None and isinstance(got[0], fx.Node) and isinstance(got[1], fx.Node):
            by_input.setdefault(got[0], {}).setdefault(got[1], n)
    return [list(ms.values()) for ms in by_input.values() if len(ms) > 1]


def _out_of_order(order: dict, switches: list[int], nodes: list[fx.Node], args: list[tuple]) -> str | None:
    """Why the group cannot become one matmul placed at its first member: a weight or bias made after
    that (the fused matmul reads them all there), or a grad-mode or autocast switch between members
    (the fused matmul would run on one side of it). order: the graph's nodes -> position; switches:
    the positions of its switches."""
    first, last = order[nodes[0]], order[nodes[-1]]
    if any(isinstance(p, fx.Node) and order.get(p, last) >= first for _, w, b in args for p in (w, b)):
        return "a weight or bias computed after the first of the layers"
    if any(first < at < last for at in switches):
        return "a grad-mode or autocast switch between the layers"
    return None


def _common_module(nodes: list[fx.Node]) -> str:
    paths = [module_path(n).split(".") for n in nodes]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common) or "<top>"


def fuse(gm: fx.GraphModule, edit: bool = True) -> list[SiteRecord]:
    """Fuse every group that pays (module docstring); -> a record per group, fused or not (with why)."""
    records = []
    found = groups(gm.graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # fusing keeps the others' relative order
    switches = [i for n, i in order.items() if global_state_switch(n)]
    for nodes in found:
        args = [_linear_args(n) for n in nodes]
        members = [tuple(example_value(a) for a in xwb) for xwb in args]
        why = _out_of_order(order, switches, nodes, args) or why_not(members, [example_value(n) for n in nodes])
        rec = SiteRecord(
            PATTERN,
            SPELLING,
            _common_module(nodes),
            {module_path(n).rsplit(".", 1)[-1]: tuple(members[i][1].shape) for i, n in enumerate(nodes)},
            {"weight": str(members[0][1].dtype).removeprefix("torch.")},
            {},
            served=why is None,
            reason=why or "",
        )
        records.append(rec)
        if why is None and edit:
            _fuse_group(gm.graph, nodes, args, members)
    return records


def _fuse_group(graph: fx.Graph, nodes: list[fx.Node], args: list[tuple], members: list[tuple]) -> None:
    x = args[0][0]
    first = nodes[0]
    widths = [w.shape[0] for _, w, _ in members]
    with graph.inserting_before(first):
        w = graph.call_function(torch.cat, ([a[1] for a in args], 0))
        b = None
        if args[0][2] is not None:
            b = graph.call_function(torch.cat, ([a[2] for a in args], 0))
        y = graph.call_function(torch._C._nn.linear, (x, w) if b is None else (x, w, b))
        outs, at = [], 0
        for n in widths:
            outs.append(graph.call_function(operator.getitem, (y, (Ellipsis, slice(at, at + n)))))
            at += n
    copy_source_meta([w, y, *outs] + ([b] if b is not None else []), first)
    # large stacked weights are made again in the backward (the weights are at hand anyway), small
    # ones saved (a launch each saved: SAVE_BYTES)
    ws = [m[1] for m in members]
    stacked = sum(t.numel() * t.element_size() for t in ws) if all(isinstance(t, torch.Tensor) for t in ws) else None
    policy = (
        CheckpointPolicy.MUST_SAVE
        if stacked is not None and stacked <= SAVE_BYTES
        else CheckpointPolicy.MUST_RECOMPUTE
    )
    for cat in [w] + ([b] if b is not None else []):
        tag_recompute(cat, first, policy)
    # example values (fake tensors, made by their own methods: nothing is computed) for later passes
    xv, ys = members[0][0], [example_value(n) for n in nodes]
    if all(isinstance(v, torch.Tensor) for v in (xv, *ws, *ys)):
        w.meta["example_value"] = ws[0].new_empty((sum(widths), ws[0].shape[1]))
        if b is not None:
            b.meta["example_value"] = ws[0].new_empty((sum(widths),))
        yv = ys[0].new_empty((*ys[0].shape[:-1], sum(widths)))
        y.meta["example_value"] = yv
        at = 0
        for o, n in zip(outs, widths):
            o.meta["example_value"] = yv[..., at : at + n]
            at += n
    for old, new in zip(nodes, outs):
        old.replace_all_uses_with(new)
        graph.erase_node(old)
