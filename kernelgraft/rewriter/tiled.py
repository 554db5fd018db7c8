"""The op a tiled region runs as (rewriter/tiling.py): kernelgraft::tiled_region(key, tile, inputs).

The region's nodes are copied into graphs of their own (`register`), kept in TABLE under `key`, a
string made from their code (a graph cannot be an op's argument; the same region in every layer,
and in every process that captures it, is one key). The op is
opaque to dynamo, AOT autograd and inductor (a torch.library custom op with a fake implementation,
which runs the region's graph on the fake inputs for its outputs' shapes). Its forward runs the
region over tiles of `tile` positions of the sequence under no_grad and keeps only its inputs for
the backward; the backward (kernelgraft::tiled_region_bwd, opaque too) runs each tile again with
gradients and returns the token inputs' gradients whole and the weights' summed over the tiles in
float32, then cast to each weight's dtype. With backend="eager" the graph calls an
autograd.Function around the same two functions (lowering.eager_calls), without the dispatcher.
"""

from __future__ import annotations

import contextvars
import hashlib
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..kernels.fallback import as_in_eager
from ..kernels.family import define, register_eager_call

NARROW = (torch.bfloat16, torch.float16)
LINEARS = (F.linear, torch._C._nn.linear)
MATMULS = (torch.matmul, operator.matmul)
VIEWS = {"view", "reshape"}


@dataclass
class Tiled:
    forward: fx.GraphModule  # the region's nodes on its inputs -> its outputs
    backward: fx.GraphModule  # the same, its linears summing their weights' gradients (acc_linear)
    token: list  # per input: tiled along dim 1 (else the same tensor for every tile)
    summed: list  # per input: a weight whose gradient the backward's linears sum themselves


TABLE: dict[str, Tiled] = {}  # key (the op's first argument) -> the region it runs

# while a tile's backward graph runs its forward: input index -> the float32 sum of its gradient
_SUMS: contextvars.ContextVar = contextvars.ContextVar("kernelgraft_tile_sums", default=None)


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float32: exact products of 2-byte factors, float32 sums, no rounding to their dtype."""
    if a.dtype in NARROW and a.device.type == "cuda":
        try:  # the tensor cores' products, summed and returned in float32 (no float32 copies)
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):  # a torch without it: float32 copies
            pass
    return torch.mm(a.float(), b.float())


class _AccLinear(torch.autograd.Function):
    """linear(x, w, b) (or matmul(x, w)) whose backward adds w's (and b's) gradient for this tile
    to the float32 sums given, and returns x's gradient as autograd's linear does."""

    @staticmethod
    def forward(ctx, x, w, b, sums, transposed):
        ctx.save_for_backward(x, w)
        ctx.sums, ctx.transposed, ctx.bias = sums, transposed, b is not None
        return torch.matmul(x, w) if transposed else F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        sw, sb = ctx.sums
        gx = g.matmul(w.t() if ctx.transposed else w) if ctx.needs_input_grad[0] else None
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        if sw is not None:
            sw += _mm32(x2.t(), g2) if ctx.transposed else _mm32(g2.t(), x2)
        gb = None
        if sb is not None:
            sb += g2.float().sum(0)
        elif ctx.bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, None, gb, None, None


def acc_linear(x, w, b, slots, transposed):
    """What a tile's backward graph calls for a linear whose weight's gradient it sums itself:
    slots, the input indices of its weight and bias (None: not summed here)."""
    sums = _SUMS.get() or {}
    return _AccLinear.apply(x, w, b, tuple(sums.get(i) if i is not None else None for i in slots), transposed)


# ---- the region's graphs ------------------------------------------------------------------------


def _weight_slot(n: fx.Node, i) -> bool:
    """Argument i of n is the weight (or bias) of a linear or matmul."""
    return n.target in LINEARS and i in (1, 2) or n.target in MATMULS and i == 1


def summed_weights(nodes: list, inputs: list, token: list) -> list[bool]:
    """Per input: a weight (or bias) read only as such by the region's linears and matmuls."""
    ok = dict.fromkeys(inputs, True)
    for n in nodes:
        slots: dict = {}
        for i, x in [*enumerate(n.args), *n.kwargs.items()]:
            if isinstance(x, fx.Node):
                slots.setdefault(x, []).append(i)
        for a in n.all_input_nodes:
            if a in ok and not all(_weight_slot(n, i) for i in slots.get(a, [None])):
                ok[a] = False
    return [ok[a] and not t for a, t in zip(inputs, token)]


def is_view(n: fx.Node) -> bool:
    return n.target is torch.reshape or n.op == "call_method" and n.target in VIEWS


def view_sizes(n: fx.Node) -> list:
    """A view's sizes, given as varargs or as one sequence."""
    shape = list(n.args[1:])
    return list(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape


def _graph(nodes: list, inputs: list, outputs: list, summed: list, backward: bool) -> fx.GraphModule:
    """The region's nodes on placeholders for its inputs, returning its outputs; a view's batch and
    sequence sizes read from its input (a tile's); in the backward's graph, linears whose weights
    are summed here call acc_linear."""
    g = fx.Graph()
    env = {a: g.placeholder(f"in{i}") for i, a in enumerate(inputs)}
    index = {a: i for i, a in enumerate(inputs)}
    for j, n in enumerate(nodes):
        if is_view(n):
            x = env[n.args[0]]
            dims = view_sizes(n)
            lead = [g.call_method("size", (x, 0)) if isinstance(dims[0], fx.Node) else dims[0]]
            args, kwargs = (x, (*lead, g.call_method("size", (x, 1)), *dims[2:])), {}
        else:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        target, op = n.target, n.op
        w = n.args[1] if backward and n.target in LINEARS + MATMULS else None
        if w in index and summed[index[w]]:  # the weight's gradient summed by the linear itself
            b = n.args[2] if len(n.args) > 2 else None
            sums = (index[w], index[b] if b in index and summed[index[b]] else None)
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            op, target, args, kwargs = (
                "call_function",
                acc_linear,
                (args[0], args[1], bias, sums, n.target in MATMULS),
                {},
            )
        env[n] = g.create_node(op, target, tuple(args), kwargs, name=f"v{j}")
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(torch.nn.Module(), g)


def register(nodes: list, inputs: list, token: list, outputs: list, meta) -> str:
    """The region's graphs in TABLE; -> their key. meta(node): the value a node held when traced."""
    summed = summed_weights(nodes, inputs, token)
    fwd = _graph(nodes, inputs, outputs, summed, backward=False)
    what = [fwd.code]
    for a, tok in zip(inputs, token):
        v = meta(a)
        what.append((tok, str(v.dtype), v.dim(), () if tok else tuple(str(d) for d in v.shape)))
    key = "region_" + hashlib.sha1(repr(what).encode()).hexdigest()[:16]
    if key not in TABLE:
        TABLE[key] = Tiled(fwd, _graph(nodes, inputs, outputs, summed, backward=True), list(token), summed)
    return key


# ---- the op -------------------------------------------------------------------------------------


def _tiles(t: Tiled, inputs: list, tile: int):
    """(start, length, the inputs of that tile) for each tile of the sequence."""
    S = next(x.shape[1] for x, tok in zip(inputs, t.token) if tok)
    for s in range(0, S, tile):
        n = min(tile, S - s)
        yield s, n, [x.narrow(1, s, n) if tok else x for x, tok in zip(inputs, t.token)]


def forward(key: str, tile: int, inputs: list) -> list:
    t = TABLE[key]
    outs = None
    with torch.no_grad():
        for s, n, args in _tiles(t, inputs, tile):
            got = t.forward(*args)
            if outs is None:
                S = next(x.shape[1] for x, tok in zip(inputs, t.token) if tok)
                outs = [o.new_empty((o.shape[0], S, *o.shape[2:])) for o in got]
            for o, y in zip(outs, got):
                o.narrow(1, s, n).copy_(y)
    return outs


def _forward_fake(key: str, tile: int, inputs: list) -> list:
    return [o.new_empty(o.shape) for o in TABLE[key].forward(*inputs)]


def backward(key: str, tile: int, inputs: list, grads: list, needs: list) -> list:
    t = TABLE[key]
    sums = {
        i: torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for i, (x, need, tok) in enumerate(zip(inputs, needs, t.token))
        if need and not tok
    }
    res = [x.new_zeros(x.shape) if need and tok else None for x, need, tok in zip(inputs, needs, t.token)]
    with as_in_eager(), torch.enable_grad():
        mark = _SUMS.set({i: s for i, s in sums.items() if t.summed[i]})
        try:
            for s, n, args in _tiles(t, inputs, tile):
                leaves = [a.detach().requires_grad_(need) for a, need in zip(args, needs)]
                outs = t.backward(*leaves)
                pairs = [
                    (o, g.narrow(1, s, n)) for o, g in zip(outs, grads) if g is not None and o.requires_grad
                ]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                for i, a in enumerate(leaves):
                    if a.grad is None or t.summed[i]:
                        continue
                    if res[i] is not None:
                        res[i].narrow(1, s, n).copy_(a.grad)
                    elif i in sums:
                        sums[i] += a.grad.float()
        finally:
            _SUMS.reset(mark)
    for i, s in sums.items():
        res[i] = s.to(inputs[i].dtype)
    return [r if r is not None else x.new_empty(0) for r, x in zip(res, inputs)]


def _backward_fake(key: str, tile: int, inputs: list, grads: list, needs: list) -> list:
    return [x.new_empty(x.shape) if need else x.new_empty(0) for x, need in zip(inputs, needs)]


ABI = 1  # in the ops' names: bump it when what they take or return changes
_fwd, TILED = define(
    f"tiled_region_abi{ABI}", forward, _forward_fake, "(str key, SymInt tile, Tensor[] inputs) -> Tensor[]"
)
_, TILED_BWD = define(
    f"tiled_region_bwd_abi{ABI}",
    backward,
    _backward_fake,
    "(str key, SymInt tile, Tensor[] inputs, Tensor?[] grads, bool[] needs) -> Tensor[]",
)


def _setup(ctx, inputs, output):
    key, tile, xs = inputs
    ctx.key, ctx.tile = key, tile
    ctx.save_for_backward(*xs)
    ctx.set_materialize_grads(False)  # an output that does not reach the loss: no zeros made


def _backward(ctx, grads):
    needs = [bool(n) for n in ctx.needs_input_grad[2]]
    got = TILED_BWD(ctx.key, ctx.tile, list(ctx.saved_tensors), list(grads), needs)
    return None, None, [g if need else None for g, need in zip(got, needs)]


_fwd.register_autograd(_backward, setup_context=_setup)


class _Eager(torch.autograd.Function):
    @staticmethod
    def forward(ctx, key, tile, *inputs):
        ctx.key, ctx.tile = key, tile
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)
        return tuple(forward(key, tile, list(inputs)))

    @staticmethod
    def backward(ctx, *grads):
        needs = list(ctx.needs_input_grad[2:])
        got = backward(ctx.key, ctx.tile, list(ctx.saved_tensors), list(grads), needs)
        return None, None, *(g if need else None for g, need in zip(got, needs))


def _eager(key, tile, inputs):
    return list(_Eager.apply(key, tile, *inputs))


register_eager_call(TILED, _eager)
