"""The op a tiled region runs as (rewriter/tiling.py): kernelgraft::tiled_region(key, tile, inputs).

The region's graphs are kept in TABLE under `key` (a graph cannot be an op's argument). The op is
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
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..kernels.fallback import as_in_eager
from ..kernels.family import define, register_eager_call

NARROW = (torch.bfloat16, torch.float16)


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
