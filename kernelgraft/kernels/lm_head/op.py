"""The LM head's custom op pair: the forward makes the loss and, in training, the gradients of h,
the weight and the bias where the head has one (for a loss gradient of 1), which wait outside the
autograd graph (the stash) until the backward hands them out, scaled by the loss's incoming
gradient. A kernel that failed runs the spelling itself.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass

import torch

from ..fallback import generation_failed, has_failed, spelling_vjp
from ..family import (
    Unsupported,
    cached_op,
    mark_traceable,
    op_name,
    save_inputs,
    saved_inputs,
    schema_args,
)
from ..launching import NotTraceable, tracing
from ..spec import SERVED
from .kernel import KernelFailed, _kernel, forward, kernel_name
from .transform import transform, transform_graph

ABI = 4  # in every op name (family.op_name): bump it when the ops' schemas change


# the differentiable arguments of a spelling, in the order of the op's flags and gradients
GRADS = ("h", "weight", "bias")
FLAGS = ", ".join(f"bool needs_{n}" for n in GRADS)  # the op's flags: which gradients to make


def reference(spelling, named: dict, needs: tuple, grad_scale: float = 1.0) -> tuple:
    """(loss, dh, dW, db) from the spelling itself (the stock code, full logits): the path of a
    kernel that failed. needs: whether each of GRADS is wanted."""
    named = dict(named, ignore_index=int(named["ignore_index"]))  # the op's schema carries it as a float
    empty = named["h"].new_empty(0)
    diff = [n for n, need in zip(GRADS, needs) if need]
    if not diff:
        with torch.no_grad():
            return spelling.fn(*(named[a] for a in spelling.arg_names)), empty, empty, empty
    loss, got = spelling_vjp(spelling, named, diff, lambda y: torch.ones_like(y) * grad_scale)
    return (loss, *(got.get(n, empty) for n in GRADS))


# The gradients the forward made, until the backward takes them: held here rather than saved in the
# autograd graph, so the backward can hand them out without a copy (a custom op may not return its
# input). Each entry lives as long as its ticket (a CPU scalar the graph saves): a graph freed
# without a backward frees its gradients too.
_STASH: dict[int, tuple[torch.Tensor, ...]] = {}
_NEXT = itertools.count(1)


def _ticket_like() -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


def _stash(grads: tuple[torch.Tensor, ...]) -> torch.Tensor:
    key = next(_NEXT)
    ticket = torch.tensor(key, dtype=torch.int64)
    if any(g.numel() for g in grads):
        _STASH[key] = grads
        weakref.finalize(ticket, _STASH.pop, key, None)
    return ticket


@dataclass
class LMHeadOp:
    spelling: object
    name: str
    fwd: object
    chunk: int = 0  # tokens per chunk when called directly (0: from the shapes)
    accumulate: str = "auto"
    memory: float = 0.0  # a budget in GiB (kernel.plan); -1: the least; 0: none

    def __call__(self, *args):
        """The loss, from the spelling's own arguments (what gradcheck and benchmarks call)."""
        named = dict(zip(self.spelling.arg_names, args))
        g = torch.is_grad_enabled()
        flags = (g and n in named and named[n].requires_grad for n in GRADS)
        return self.fwd(*args, *flags, self.chunk, self.accumulate, self.memory)[0]

    def configured(self, chunk: int = 0, accumulate: str = "auto", memory: float = 0.0) -> LMHeadOp:
        return LMHeadOp(self.spelling, self.name, self.fwd, chunk, accumulate, memory)

    def bind(self, args: dict, metas: dict, options) -> tuple:
        """The op's call arguments from the matched ones (fx nodes and numbers by spelling name)."""
        sp = self.spelling
        g = torch.is_grad_enabled()
        needs = (bool(g and metas.get(n) is not None and metas[n].requires_grad) for n in GRADS)
        out = [args[a] if a not in sp.scalar_names else float(args[a]) for a in sp.arg_names]
        return (
            *out,
            *needs,
            int(options.lm_head_chunk or 0),
            options.lm_head_accumulate,
            memory_gib(options.lm_head_memory),
        )


# Made in the forward (for a loss gradient of 1, scaled in the backward), the gradients cost the
# backward a read of its loss gradient on the host: the host waits there for the GPU to finish the
# forward, the LM head's matmuls last. Where the host sets the pace (small models, whose GPU idles
# part of a step), that wait is lost; deferred, the gradients cost one more logits matmul (2 T H V
# flops) instead. A head on a GPU whose extra matmul is at most DEFER_FLOPS is deferred: that
# matmul is short beside the wait it saves, so little is lost where the GPU sets the pace and more
# is won where the host does.
DEFER_FLOPS = 1e12


def defers(metas: dict) -> bool:
    """Whether a head with these matched tensors (h, weight) makes its gradients in the backward."""
    h, w = metas.get("h"), metas.get("weight")
    if not isinstance(h, torch.Tensor) or not isinstance(w, torch.Tensor) or h.device.type != "cuda":
        return False
    dims = (*h.shape, *w.shape)
    if not all(isinstance(d, int) for d in dims) or w.dim() != 2:  # symbolic sizes: no estimate
        return False
    T = math.prod(h.shape[:-1])
    V, H = w.shape
    return 2 * T * H * V <= DEFER_FLOPS


def op_for(spelling, rounding: str = "autograd", deferred: bool = False) -> LMHeadOp:
    """The fused LM head's op for `spelling`, defined on first use. deferred: the gradients are
    made in the backward, for the loss gradient it is given (read on the device): for CUDA
    graphs, where no value may be read on the host and nothing kept outside the graph (the
    stash). It costs one more logits matmul per chunk than making them in the forward."""
    name = op_name(spelling, f"__{rounding}" + ("__deferred" if deferred else ""), ABI)
    return cached_op(name, lambda: _define(spelling, name, rounding, deferred))


def _define(sp, name: str, rounding: str, deferred: bool = False) -> LMHeadOp:
    names = list(sp.arg_names)
    n_args = len(names)
    tf_scalars = None
    k = len(GRADS)

    def unpack(args):
        nonlocal tf_scalars
        named = dict(zip(names, args[:n_args]))
        needs, how = tuple(args[n_args : n_args + k]), args[n_args + k :]  # how: chunk, accumulate, memory
        if tf_scalars is None:
            graph, tf_scalars = transform_graph(sp)
        return named, needs, how

    def run(args, grad_scale=1.0, check=True):
        """check: the labels are checked (the forward; a backward making the gradients again does not)."""
        named, needs, how = unpack(args)
        W = named["weight"]
        if has_failed(kernel_name(sp, W.dtype, rounding), W.device.type):
            if tracing():
                raise NotTraceable(f"{kernel_name(sp, W.dtype, rounding)} failed in this process")
            return reference(sp, named, needs, grad_scale)
        try:
            return fused(named, needs, how, grad_scale, check)
        except KernelFailed:
            return reference(sp, named, needs, grad_scale)

    def fused(named, needs, how, grad_scale, check):
        chunk, accumulate, memory = how
        return forward(
            sp,
            named["h"],
            named["weight"],
            named["target"],
            named.get("n"),
            [float(named[x]) for x in tf_scalars],
            named["ignore_index"],
            needs[0],
            needs[1],
            chunk,
            accumulate,
            rounding,
            grad_scale=grad_scale,
            memory=memory,
            bias=named.get("bias"),
            needs_b=needs[2],
            check=check,
        )

    def impl(*args):
        if deferred:  # the loss only; the backward makes the gradients (the second output: unused)
            loss, *_ = run((*args[:n_args], *(False,) * k, *args[n_args + k :]))
            return loss, loss.new_empty(0)
        loss, *grads = run(args)
        return loss, _stash(tuple(grads))

    def fake(*args):
        named, _, _ = unpack(args)
        h, W = named["h"], named["weight"]
        loss = h.new_empty((), dtype=_out_dtype(sp, W.dtype))
        return loss, (loss.new_empty(0) if deferred else _ticket_like())

    tensor_idx = [i for i, a in enumerate(names) if a not in sp.scalar_names]
    args_schema = schema_args(sp)
    lib = f"kernelgraft::{name}"
    op = torch.library.custom_op(
        lib,
        impl,
        mutates_args=(),
        schema=f"({args_schema}, {FLAGS}, int chunk, str accumulate, float memory) -> (Tensor, Tensor)",
    )
    op.register_fake(fake)
    grad_idx = [names.index(n) if n in names else None for n in GRADS]  # h, weight, bias

    def bwd_impl(g, ticket, *args):
        if deferred:  # g stays on the device: folded in where the softmax gradient rounds
            _, *grads = run(args, grad_scale=g, check=False)
            return tuple(grads)
        return stashed_bwd(g, ticket, *args)

    def stashed_bwd(g, ticket, *args):
        """The gradients for the loss's incoming gradient g, from the ones the forward made for 1.
        Scaling by a power of two (1 in plain training, a loss scale) is exact and done in place;
        any other g, or a second backward through a retained graph (the stash was handed out),
        makes the gradients again with g folded in before the softmax gradient rounds, as the
        unfused model does."""
        gv = float(g)
        got = _STASH.pop(int(ticket), None)
        mant, _ = math.frexp(gv)
        if got is not None and (gv == 0.0 or abs(mant) == 0.5):
            if gv != 1.0:
                for t in got:
                    t.mul_(gv)
            return got
        del got
        _, *grads = run(args, grad_scale=gv, check=False)
        return tuple(grads)

    def bwd_fake(g, ticket, *args):
        named, needs, _ = unpack(args)
        empty = named["h"].new_empty(0)
        return tuple(torch.empty_like(named[n]) if need else empty for n, need in zip(GRADS, needs))

    bwd = torch.library.custom_op(
        f"{lib}_bwd",
        bwd_impl,
        mutates_args=(),
        schema=f"(Tensor g, Tensor ticket, {args_schema}, {FLAGS}, int chunk, "
        "str accumulate, float memory) -> (Tensor, Tensor, Tensor)",
    )
    bwd.register_fake(bwd_fake)
    bwd_op = getattr(torch.ops.kernelgraft, f"{name}_bwd").default

    def setup_context(ctx, inputs, output):
        save_inputs(ctx, inputs, tensor_idx, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    def backward(ctx, g, _ticket):
        grads = [None] * (n_args + k + 3)
        if g is None:
            return tuple(grads)
        (ticket,), args = saved_inputs(ctx, tensor_idx, 1)
        for i, got in zip(grad_idx, bwd_op(g, ticket, *args)):
            if i is not None and ctx.needs_input_grad[i] and got.numel():
                grads[i] = got.view(args[i].shape)
        return tuple(grads)

    op.register_autograd(backward, setup_context=setup_context)
    if deferred:  # nothing read on the host, nothing kept outside the graph: inductor launches it
        mark_traceable(getattr(torch.ops.kernelgraft, name).default, impl)
        mark_traceable(bwd_op, bwd_impl)
    return LMHeadOp(sp, name, getattr(torch.ops.kernelgraft, name).default)


def memory_gib(memory) -> float:
    """The op's `memory` argument for Options.lm_head_memory: GiB, -1 for "min", 0 for none."""
    if memory is None:
        return 0.0
    return -1.0 if memory == "min" else float(memory)


def _out_dtype(spelling, dtype: torch.dtype) -> torch.dtype:
    try:
        return transform(spelling, dtype, "autograd").out_dtype
    except Unsupported:
        return dtype


def refusal(spelling, metas: dict, rounding: str, training: bool) -> str | None:
    """Why the fused LM head cannot serve this site (None: it can). training: the site runs with
    gradients (captured with them, or judged as a training step would be: explain, audit)."""
    h, W, t = metas.get("h"), metas.get("weight"), metas.get("target")
    if h is None or W is None or t is None:
        return "no shape/dtype recorded for h, weight or target"
    if not training:
        return "captured without gradients (evaluation): the logits are returned, nothing to fuse"
    if W.dim() != 2 or h.shape[-1] != W.shape[1]:
        return f"weight {tuple(W.shape)} does not multiply h {tuple(h.shape)}"
    if h.dtype != W.dtype or W.dtype not in SERVED:
        return f"h is {h.dtype} and the weight {W.dtype}; the fused LM head serves one of {SERVED}"
    b = metas.get("bias")
    if "bias" in spelling.arg_names and (b is None or b.shape != W.shape[:1] or b.dtype != W.dtype):
        got = "no shape/dtype recorded" if b is None else f"{tuple(b.shape)} {b.dtype}"
        return f"bias {got}: the fused LM head adds a bias of the weight's rows ({W.shape[0]},) in {W.dtype}"
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        return f"target is {t.dtype}; class indices (integers) are served, probabilities are not"
    if len({x.device.type for x in (h, W, t)}) > 1:
        return "h, weight and target are on different devices"
    if W.device.type not in ("cuda", "cpu"):
        return f"device {W.device.type}: kernels run on cuda, or on cpu through Triton's interpreter"
    try:
        transform(spelling, W.dtype, rounding)
    except Unsupported as e:
        return str(e)
    try:  # generated and loaded now, so a kernel that cannot be is a fallback reported here
        _kernel(spelling, W.dtype, rounding, W.device.type)
    except Unsupported as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a generator or cache failure falls back, reported, never wrong
        return generation_failed(spelling.qualname, e)
    return None


