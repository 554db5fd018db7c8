"""One torch.library custom op pair per pattern spelling: kernelgraft::<pattern>__<spelling>__<key>
(forward: output and row statistics) and its _bwd, with fake (meta) and autograd registrations.
This is the composition torch.compile supports: dynamo and AOTAutograd see opaque ops with known
shapes, and inductor schedules around them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from . import rowkernel
from .spec import build_spec

_OPS: dict[str, GraftedOp] = {}
# In every op name: inductor's on-disk caches key compiled graphs by op name, so a change to what an
# op returns (shapes, strides of the fake implementation) must change the name. Bump it then.
ABI = 2


@dataclass
class GraftedOp:
    spelling: object
    name: str
    fwd: object  # the OpOverload kernelgraft::<name>
    bwd: object

    def __call__(self, *args):
        return self.fwd(*args)[0]


def _schema_args(sp) -> str:
    return ", ".join(f"float {a}" if a in sp.scalar_names else f"Tensor {a}" for a in sp.arg_names)


def op_for(spelling, rounding: str = "autograd") -> GraftedOp:
    """The custom op pair for `spelling`, defined on first use. rounding: 'autograd' rounds like
    eager PyTorch (the eager backend), 'fused' like inductor's fused kernels (the inductor backend)."""
    suffix = "" if rounding == "autograd" else f"__{rounding}"
    name = re.sub(r"\W", "_", f"{spelling.pattern}__{spelling.name}__{spelling.key}{suffix}_abi{ABI}")
    if name in _OPS:
        return _OPS[name]
    sp = spelling
    n_args = len(sp.arg_names)
    tensor_idx = [i for i, a in enumerate(sp.arg_names) if a not in sp.scalar_names]
    scalar_idx = [i for i, a in enumerate(sp.arg_names) if a in sp.scalar_names]

    def fwd_impl(*args):
        return rowkernel.forward(sp, args, rounding)

    def fwd_fake(*args):
        tensors, _ = rowkernel.split_args(sp, args)
        lay = rowkernel.layout(sp, tensors)
        spec = build_spec(sp, {n: t.dtype for n, t in tensors.items()}, lay.kinds, rounding)
        dev = next(iter(tensors.values())).device
        K = max(len(spec.reductions), 1)
        out = torch.empty(lay.shape, dtype=spec.out_dtype, device=dev)
        return out, torch.empty((*lay.shape[:-1], K), dtype=torch.float32, device=dev)

    def bwd_impl(grad, *rest):
        *args, stats, needs = rest
        return rowkernel.backward(sp, grad, tuple(args), stats, list(needs), rounding)

    def bwd_fake(grad, *rest):
        *args, stats, needs = rest
        return [
            args[i].new_empty(args[i].shape) if need else args[i].new_empty(0)
            for i, need in zip(tensor_idx, needs)
        ]

    lib = f"kernelgraft::{name}"
    fwd = torch.library.custom_op(
        lib, fwd_impl, mutates_args=(), schema=f"({_schema_args(sp)}) -> (Tensor, Tensor)"
    )
    fwd.register_fake(fwd_fake)
    bwd = torch.library.custom_op(
        f"{lib}_bwd",
        bwd_impl,
        mutates_args=(),
        schema=f"(Tensor grad, {_schema_args(sp)}, Tensor stats, bool[] needs) -> Tensor[]",
    )
    bwd.register_fake(bwd_fake)
    bwd_op = getattr(torch.ops.kernelgraft, f"{name}_bwd").default

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[i] for i in tensor_idx), output[1])
        ctx.scalars = [inputs[i] for i in scalar_idx]

    def backward(ctx, grad, _grad_stats):
        *tensors, stats = ctx.saved_tensors
        needs = [bool(ctx.needs_input_grad[i]) for i in tensor_idx]
        args = [None] * n_args
        for i, t in zip(tensor_idx, tensors):
            args[i] = t
        for i, s in zip(scalar_idx, ctx.scalars):
            args[i] = s
        grads = bwd_op(grad, *args, stats, needs)
        out = [None] * n_args
        for i, g, need in zip(tensor_idx, grads, needs):
            out[i] = g if need else None
        return tuple(out)

    fwd.register_autograd(backward, setup_context=setup_context)
    op = GraftedOp(sp, name, getattr(torch.ops.kernelgraft, name).default, bwd_op)
    _OPS[name] = op
    return op
