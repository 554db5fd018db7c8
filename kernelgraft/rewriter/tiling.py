"""Token-wise regions of a training graph run over tiles of the sequence (Options.tile_tokens).

Between two attention calls a decoder computes each token from that token alone: the o projection,
the residual add, the norm, the MLP's projections and gated product, the next norm and the q/k/v
projections. Such a region keeps its intermediates for the backward (the MLP's are the widest,
[B, S, intermediate]); here it becomes one call of `kernelgraft::tiled_region`, which runs the
region over tiles of `tile_tokens` positions of the sequence and keeps only its inputs. The
backward makes each tile again, with gradients, one tile at a time:

    forward   no_grad: out[:, t0:t1] = region(inputs[:, t0:t1])        for each tile
    backward  enable_grad: region(inputs[:, t0:t1]) again -> its input gradients, concatenated;
              the weights' gradients summed over the tiles in float32, cast to the weight's dtype

A node is token-wise where it maps token t of its inputs to token t of its output: element-wise
ops, casts and copies (a dropout that drops nothing), a linear or matmul against a weight (a
tensor without the token dims), views that keep the leading (batch, sequence) dims, chunks and
row reductions along a trailing dim, and the ops of the kernel families that compute each row
from its own rows (TOKEN_FAMILIES). Sizes may be symbolic (one graph for every length): a region
is judged by the length it was captured with, and a call shorter than a tile runs one tile. A
region is a maximal connected set of such nodes that no path leaves and re-enters (each node's
`depth`: the non-token nodes on its longest path from the inputs; a region's nodes share one), so
it can run at one point of the graph. Every other node (attention, the LM head's loss, embedding
lookups, anything reading other tokens, a view that flattens the tokens) bounds regions. A dry
run judges the graph as captured (stock norms where a run would have their kernels).

Rounding: every token-wise op computes each token as untiled (each tile runs the same ops, so the
forward, the loss included, is the untiled one's); only sums over tokens change. A linear
weight's gradient is taken here per tile as a float32 product of the tile's saved input and
output gradient (bf16/fp16 factors: exact products, float32 sums, as the untiled matmul
accumulates), summed over tiles in float32 and rounded once. Any other weight's gradient comes
from the tile's own backward in the weight's dtype: a 2-byte one would be rounded per tile (a bf16
norm's weight gradient, 16 tiles of a tiny Llama: 0.00584 against the rule's bound of 0.0059), so
an op with such a weight is left out of the regions. Under inductor a region's ops run as eager
runs them (inductor rounds the rest of the graph), which the rule judges beside torch.compile's.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ir import PRIMITIVES
from ..kernels import FAMILIES
from ..kernels.family import op_name
from .ddp import global_state_switch
from .replace import copy_source_meta
from .report import TileRecord, example_value, module_path
from .tiled import LINEARS, MATMULS, NARROW, TILED, VIEWS, is_view, register, summed_weights, view_sizes

# kernel families whose ops compute each row (token) of their outputs from that row of their inputs
TOKEN_FAMILIES = ("row", "lora")
CASTS = {"to", "float", "half", "bfloat16", "double", "type_as"}
COPIES = {"contiguous", "clone"}
DROPOUTS = (torch.nn.functional.dropout, torch.dropout)
SPLITS = (torch.chunk, torch.split)
# nodes that alias their input: bytes counted once, at the value they view
ALIASES = VIEWS | {"contiguous", "chunk", "split"}


# ---- which nodes are token-wise -------------------------------------------------------------------


def _size(d):
    """A size as compared here: an int, or a symbolic size's expression (compared without guards)."""
    return d if type(d) is int else str(d)


def _hint(d) -> int | None:
    """A size's value in the capture (a symbolic size's hint; None where it has none)."""
    return d if type(d) is int else getattr(getattr(d, "node", None), "hint", None)


def _tokens(v) -> tuple | None:
    """(B, S) of a value laid out [B, S, ...] with at least one dim after them, S > 1 as captured."""
    if not isinstance(v, torch.Tensor) or v.dim() < 3:
        return None
    s = _hint(v.shape[1])
    return (_size(v.shape[0]), _size(v.shape[1])) if s is not None and s > 1 else None


def _operand(v, bs: tuple, rank: int) -> str | None:
    """How an op whose output is [B, S, ...] of `rank` dims reads operand v: "token" (its dim 1 is
    the sequence: tiled), "whole" (no token dims, or size 1 there: the same for every tile), None
    (the tokens some other way)."""
    if not isinstance(v, torch.Tensor):
        return "whole"
    k, lead = v.dim(), [_size(d) for d in v.shape[:2]]
    if k == rank:
        if lead[1] == bs[1]:
            return "token" if lead[0] in (bs[0], 1) else None
        return "whole" if lead[1] == 1 else None
    if k == rank - 1:  # its first dim faces the sequence
        return None if lead[0] == bs[1] else "whole"
    return "whole" if k < rank else None


def _dims(n: fx.Node, rank: int) -> list | None:
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if dim is None:
        return None
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    return [d % rank for d in dims] if all(type(d) is int for d in dims) else None


def _full(s) -> bool:
    return isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def _keeps_tokens(idx, rank: int) -> bool:
    """A tensor index that leaves dims 0 and 1 whole: x[:, :, a:b] or x[..., a:b]."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(i is None or isinstance(i, (fx.Node, torch.Tensor)) for i in idx):
        return False
    if idx and idx[0] is Ellipsis:
        return len(idx) - 1 <= rank - 2 and Ellipsis not in idx[1:]
    return len(idx) >= 2 and _full(idx[0]) and _full(idx[1]) and Ellipsis not in idx[2:]


def _family_op(n: fx.Node, spellings: dict):
    """(spelling) of a kernel op call of a token-wise family, found by its name (family.op_name)."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return None
    if n.target.namespace != "kernelgraft":
        return None
    name = n.target._opname
    for prefix, sp in spellings.items():
        if name.startswith(prefix) and sp.kernel in TOKEN_FAMILIES and sp.kernel in FAMILIES:
            return sp
    return None


def _kind(n: fx.Node, spellings: dict) -> str | None:
    """What a node is, where it can be token-wise: "linear", "matmul", "elementwise", "reduce",
    "cast", "copy", "view", "slice", "cat", "kernel"; None otherwise."""
    if n.op == "call_function":
        if n.target in LINEARS:
            return "linear"
        if n.target in MATMULS:
            return "matmul"
        if n.target is torch.cat:
            return "cat"
        if n.target is operator.getitem:
            return "slice"
        if is_view(n):
            return "view"
        if _family_op(n, spellings) is not None:
            return "kernel"
        if n.target in DROPOUTS and _no_dropout(n):
            return "copy"
        if n.target in SPLITS:
            return "split"
    elif n.op == "call_method":
        if n.target in {"chunk", "split"}:
            return "split"
        if n.target in CASTS:
            return "cast"
        if n.target in COPIES:
            return "copy"
        if is_view(n):
            return "view"
    else:
        return None
    p = PRIMITIVES.of_target(n.target)
    if p is None:
        return None
    return "reduce" if p.kind == "reduction" else "elementwise"


def _no_dropout(n: fx.Node) -> bool:
    """A dropout that drops nothing (p = 0, or not training): the identity, no random numbers."""
    p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
    training = n.args[2] if len(n.args) > 2 else n.kwargs.get("training", True)
    return p == 0 or training is False


def _args(n: fx.Node) -> list:
    return [*n.args, *n.kwargs.values()]


def _tensors(n: fx.Node) -> list:
    """The tensor values n reads, in argument order (lists flattened)."""
    found: list = []
    fx.node.map_arg(_args(n), lambda a: found.append(example_value(a)))
    return [v for v in found if isinstance(v, torch.Tensor)]


def _reads(n: fx.Node, bs: tuple, rank: int, kind: str) -> bool:
    """Whether n reads every tensor token by token or whole, for its output [B, S, ...] of `rank`."""
    vals = _tensors(n)
    if kind in ("linear", "matmul"):
        x, w = (example_value(a) for a in n.args[:2]) if len(n.args) > 1 else (None, None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or _operand(x, bs, rank) != "token":
            return False
        # autocast's linear (its output in another dtype) would not be autocast inside the op
        return x.dtype == w.dtype == example_value(n).dtype and all(v.dim() <= 1 for v in vals[2:])
    if kind in ("view", "slice", "copy", "cast"):  # x's tokens checked by the caller; type_as's other
        vals = vals[1:]
    kinds = [_operand(v, bs, rank) for v in vals]
    if None in kinds:
        return False
    # a 2-byte weight's gradient from a tile's own backward is rounded per tile (module docstring)
    return not any(k == "whole" and v.requires_grad and v.dtype in NARROW for k, v in zip(kinds, vals))


def token_wise(n: fx.Node, spellings: dict) -> tuple | None:
    """(B, S) where node n is token-wise (module docstring), its output laid out [B, S, ...]; None
    where it is not. A call with several outputs (a kernel op's, a chunk) is judged by the outputs
    read (its getitems), which share it."""
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        if _kind(n.args[0], spellings) in ("kernel", "split"):
            return token_wise(n.args[0], spellings)
    kind = _kind(n, spellings)
    if kind is None:
        return None
    if kind in ("kernel", "split"):
        outs = list(n.users)
        if not outs or any(u.target is not operator.getitem for u in outs):
            return None
        found = {_tokens(example_value(u)) for u in outs}
        if len(found) != 1 or None in found:
            return None
        (bs,) = found
        if kind == "split":
            x = example_value(n.args[0])
            dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
            return bs if _tokens(x) == bs and type(dim) is int and dim % x.dim() >= 2 else None
        return bs if _reads(n, bs, example_value(outs[0]).dim(), kind) else None
    out = example_value(n)
    bs = _tokens(out)
    if bs is None:
        return None
    rank = out.dim()
    x = example_value(n.args[0]) if n.args else None
    if kind in ("view", "slice", "copy", "cast") and _tokens(x) != bs:
        return None
    if kind == "slice" and not _keeps_tokens(n.args[1], x.dim()):
        return None
    if kind == "reduce" and (
        not isinstance(x, torch.Tensor) or x.dim() != rank or min(_dims(n, rank) or [0]) < 2
    ):
        return None
    if kind == "cat":
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        if type(dim) is not int or dim % rank < 2:
            return None
    if isinstance(x, torch.Tensor) and out.device != x.device:
        return None
    return bs if _reads(n, bs, rank, kind) else None


# ---- regions ----------------------------------------------------------------------------------


@dataclass
class Region:
    nodes: list  # its nodes, in graph order
    bs: tuple  # (B, S)
    inputs: list  # the nodes outside it that it reads, in graph order
    token: list  # per input: tiled along the sequence (else passed whole to every tile)
    outputs: list  # its nodes read outside it
    why: str = ""  # why it cannot run as one op ("" where it can)


def regions(graph: fx.Graph, spellings: dict) -> list[Region]:
    """The token-wise regions of a graph: maximal connected sets of token-wise nodes of one (B, S)
    and one depth (the non-token nodes on the longest path to them from a node of a region), so that
    no path between two of a region's nodes leaves it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    bs = {n: t for n in graph.nodes if (t := token_wise(n, spellings)) is not None}
    depth: dict = {}
    tainted: set = set()  # nodes downstream of a token-wise node: a path through them can re-enter
    parent = {n: n for n in bs}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in graph.nodes:
        d = 0
        for p in n.all_input_nodes:
            inside = p in bs and n in bs and bs[p] == bs[n]
            d = max(d, depth[p] + (0 if inside or p not in tainted else 1))
        depth[n] = d
        if n in bs or any(p in tainted for p in n.all_input_nodes):
            tainted.add(n)
        for p in n.all_input_nodes:
            if p in bs and n in bs and bs[p] == bs[n] and depth[p] == d:
                parent[find(p)] = find(n)
    groups: dict = {}
    for n in bs:
        groups.setdefault(find(n), []).append(n)
    return [_region(sorted(ms, key=order.get), bs[ms[0]], order) for ms in groups.values()]


def _region(nodes: list, bs: tuple, order: dict) -> Region:
    inside = set(nodes)
    inputs: dict = {}
    reads: dict = {}  # input -> how its readers read it
    for n in nodes:
        rank = _rank(n)
        linear = n.target in LINEARS + MATMULS
        # a view's batch and sequence sizes are read from its input in each tile (tiled.register)
        sizes_read = set(view_sizes(n)[:2]) - {n.args[0]} if is_view(n) else set()
        if is_view(n) and any(isinstance(d, fx.Node) for d in view_sizes(n)[2:]):
            reads.setdefault(n, set()).add("number")
        for a in n.all_input_nodes:
            if a in inside or a in sizes_read:
                continue
            inputs.setdefault(a, None)
            v = example_value(a)
            how = "whole" if linear and a is not n.args[0] else _operand(v, bs, rank)
            reads.setdefault(a, set()).add(how if isinstance(v, torch.Tensor) else "number")
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    ins = sorted(inputs, key=order.get)
    token = ["token" in reads[a] for a in ins]
    own = [
        example_value(a) for a, t, s in zip(ins, token, summed_weights(nodes, ins, token)) if not t and not s
    ]
    why = ""
    if any(reads[a] - {"token", "whole"} or len(reads[a]) > 1 for a in reads):
        why = "a number read from the graph (a symbolic size), or an input read two ways"
    elif any(_tokens(example_value(o)) != bs for o in outputs):
        why = "an output not laid out by tokens"
    elif any(isinstance(v, torch.Tensor) and v.requires_grad and v.dtype in NARROW for v in own):
        why = "a 2-byte weight besides a linear's: each tile's backward would round its gradient"
    return Region(nodes, bs, ins, token, outputs, why)


def _rank(n: fx.Node) -> int:
    v = example_value(n)
    if not isinstance(v, torch.Tensor):  # a kernel op's call: its first output read
        v = example_value(next(iter(n.users)))
    return v.dim()


def _bytes(v) -> int:
    """A value's bytes as captured."""
    if not isinstance(v, torch.Tensor):
        return 0
    out = v.element_size()
    for d in v.shape:
        out *= _hint(d) or 0
    return out


def _aliases(n: fx.Node) -> bool:
    """n is a view of its first input (its bytes are that value's)."""
    if n.op == "call_method" and n.target in ALIASES:
        return True
    if n.target is torch.reshape or n.target in SPLITS:
        return True
    if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        return isinstance(example_value(n.args[0]), torch.Tensor) or _aliases(n.args[0])
    return (
        n.op == "call_method"
        and n.target in CASTS
        and example_value(n).dtype == example_value(n.args[0]).dtype
    )


def sizes(r: Region) -> tuple[int, int]:
    """(bytes of the values made inside the region and not read outside it, bytes of its token
    inputs and outputs)."""
    root = {}
    for n in r.nodes:
        a = n.args[0] if _aliases(n) else None
        root[n] = root.get(a, a) if a is not None else n
    out_roots = {root[o] for o in r.outputs}
    inner = sum(_bytes(example_value(n)) for n in r.nodes if root[n] is n and n not in out_roots)
    edges = sum(_bytes(example_value(a)) for a, t in zip(r.inputs, r.token) if t)
    edges += sum(_bytes(example_value(o)) for o in {root[o]: o for o in r.outputs}.values())
    return inner, edges


# ---- the pass -----------------------------------------------------------------------------------


def _prefixes(spellings) -> dict:
    """The op-name prefix of each spelling's kernel ops (family.op_name without its variant and ABI)."""
    return {op_name(sp, "", 0).removesuffix("_abi0"): sp for sp in spellings}


def _holds_work(r: Region, spellings: dict) -> bool:
    return any(n.target in LINEARS + MATMULS or _kind(n, spellings) == "kernel" for n in r.nodes)


def _name(n: fx.Node, spellings: dict) -> str:
    if _kind(n, spellings) == "kernel":
        sp = _family_op(n, spellings)
        return f"{sp.pattern}.{sp.name}"
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def _common(paths: list) -> str:
    common = []
    for parts in zip(*(p.split(".") for p in paths)):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common) or "<top>"


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def tile_graph(gm: fx.GraphModule, tile: int, spellings, edit: bool = True) -> list[TileRecord]:
    """Each token-wise region with a matmul or a kernel op in it -> a record, tiled (and, with
    edit, replaced by one tiled_region call) where it has more than `tile` tokens and its
    intermediates outweigh its token inputs and outputs."""
    prefixes = _prefixes(spellings)
    graph = gm.graph
    autocast = _autocast_on() or any(n.target is torch.amp._enter_autocast for n in graph.nodes)
    records, moved = [], {}  # moved: a tiled region's output -> the op's getitem standing for it
    for r in regions(graph, prefixes):
        if not _holds_work(r, prefixes):
            continue
        r.inputs = [moved.get(a, a) for a in r.inputs]
        order = {n: i for i, n in enumerate(graph.nodes)}
        heads = max((order[n] for n in graph.nodes if n.op in ("placeholder", "get_attr")), default=-1)
        if not r.outputs:  # nothing reads it
            continue
        inner, edges = sizes(r)
        S = _hint(example_value(r.outputs[0]).shape[1])  # a symbolic size: as captured
        paths = list(dict.fromkeys(module_path(n) for n in r.nodes))
        names = [_name(n, prefixes) for n in r.nodes if not _aliases(n) and n.target is not operator.getitem]
        rec = TileRecord(_common(paths), names, S, tile, inner, inner * min(tile, S) // S, modules=paths)
        at = max([order[a] for a in r.inputs] + [order[r.nodes[0]] - 1, heads])
        first, last = min(at, order[r.nodes[0]]), order[r.nodes[-1]]
        why = r.why
        if not why and autocast:
            why = "autocast: the op's ops would run without it"
        if not why and S <= tile:
            why = f"{S} tokens, not more than a tile's {tile}"
        if not why and inner <= edges:
            why = f"its intermediates ({inner} bytes) do not outweigh its token inputs and outputs ({edges} bytes)"
        if not why and any(first < order[n] < last for n in graph.nodes if global_state_switch(n)):
            why = "a grad-mode or autocast switch among its ops"
        if not why and any(order[u] <= at for o in r.outputs for u in o.users if u not in r.nodes):
            why = "an output read before the last of its inputs is made"
        rec.tiled, rec.reason = not why, why
        records.append(rec)
        if not why and edit:
            moved.update(_replace(gm, r, tile, list(graph.nodes)[at]))
    return records


def _replace(gm: fx.GraphModule, r: Region, tile: int, after: fx.Node) -> dict:
    """The region's nodes -> one tiled_region call after `after`; -> {its output: the getitem now}."""
    key = register(r.nodes, r.inputs, r.token, r.outputs, example_value)
    graph = gm.graph
    with graph.inserting_after(after):
        call = graph.call_function(TILED, (key, tile, list(r.inputs)))
    with graph.inserting_after(call):
        outs = [graph.call_function(operator.getitem, (call, i)) for i in range(len(r.outputs))]
    copy_source_meta([call, *outs], r.outputs[-1])
    for o, new in zip(r.outputs, outs):
        v = example_value(o)
        new.meta["example_value"] = v.new_empty(v.shape)  # made by the op: fresh, contiguous
        for u in [u for u in o.users if u not in r.nodes]:
            u.replace_input_with(o, new)
    for n in reversed(r.nodes):
        graph.erase_node(n)
    return dict(zip(r.outputs, outs))
