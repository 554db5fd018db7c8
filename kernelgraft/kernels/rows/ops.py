"""One torch.library custom op pair per pattern spelling: kernelgraft::<pattern>__<spelling>__<key>
(forward: output and row statistics) and its _bwd, with fake (meta) and autograd registrations.
This is the composition torch.compile supports: dynamo and AOTAutograd see opaque ops with known
shapes, and inductor schedules around them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..family import cached_op, define, eager_call, op_name, register_eager_call, schema_args
from ..spec import build_spec
from . import launch
from .codegen import accumulates, adds_input
from .layout import layout, rows_like, split_args

ABI = 4  # in every op name (family.op_name): bump it when what an op returns changes


@dataclass
class GraftedOp:
    spelling: object
    name: str
    fwd: object  # the OpOverload kernelgraft::<name>
    bwd: object
    bwd_out: object = None  # kernelgraft::<name>_bwdo (recomputed sites): the gradients, then the output
    # kernelgraft::<name>_bwdoa: _bwdo with a tensor added to the first argument's gradient (norms)
    bwd_out_acc: object = None
    # kernelgraft::<name>_fwda: the forward with its first argument made as a sum, returned too (norms)
    fwd_add: object = None

    def __call__(self, *args):
        return self.fwd(*args)[0]

    def bind(self, args: dict, metas: dict, options) -> tuple:
        """The op's call arguments from the matched ones (fx nodes and numbers by spelling name)."""
        sp = self.spelling
        return tuple(float(args[a]) if a in sp.scalar_names else args[a] for a in sp.arg_names)


def _saved_args(ctx, n: int, tensor_idx: list, scalar_idx: list, tensors) -> tuple[list, list[bool]]:
    """The op's arguments back from what setup_context kept, and which tensors need a gradient."""
    args = [None] * n
    for i, t in zip(tensor_idx, tensors):
        args[i] = t
    for i, s in zip(scalar_idx, ctx.scalars):
        args[i] = s
    return args, [bool(ctx.needs_input_grad[i]) for i in tensor_idx]


def _input_grads(n: int, tensor_idx: list, grads, needs) -> tuple:
    out = [None] * n
    for i, g, need in zip(tensor_idx, grads, needs):
        out[i] = g if need else None
    return tuple(out)


def _faked(sp, args, rounding):
    """(tensors by name, layout, spec, the per-element tensors) of a call, for the fakes."""
    tensors, _ = split_args(sp, args)
    lay = layout(sp, tensors)
    spec = build_spec(sp, {n: t.dtype for n, t in tensors.items()}, lay.kinds, rounding)
    return tensors, lay, spec, [t for n, t in tensors.items() if lay.kinds[n] == "elem"]


def _first_input(sp, args, has) -> torch.Tensor | None:
    """The first tensor argument of a call (fake values will do) where `has(spec)` says the call's
    kernels have a variant and that argument is not broadcast; else None (also where the generator
    cannot specialize the call)."""
    try:
        tensors, lay, spec, _ = _faked(sp, tuple(args), "autograd")
    except Exception:  # noqa: BLE001 - refused by the generator: no such variant
        return None
    x = tensors[sp.tensor_names[0]]
    return x if has(spec) and tuple(x.shape) == tuple(lay.shape) else None


def accumulating_input(sp, args) -> torch.Tensor | None:
    """The norm input whose gradient the accumulating backward can store summed (codegen.accumulates)."""
    return _first_input(sp, args, accumulates)


def adding_input(sp, args) -> torch.Tensor | None:
    """The norm input the adding forward can make as a sum (codegen.adds_input)."""
    return _first_input(sp, args, adds_input)


def _fake(sp, args, rounding):
    """(out, row stats) as empty tensors of the shapes, dtypes and strides the launch makes."""
    tensors, lay, spec, elems = _faked(sp, args, rounding)
    dev = next(iter(tensors.values())).device
    K = max(len(spec.reductions), 1)
    out = rows_like(bool(spec.reductions), elems, lay.shape, spec.out_dtype, spec.fresh_out)
    return out, torch.empty((*lay.shape[:-1], K), dtype=torch.float32, device=dev)


def _grad_fakes(sp, args, needs, rounding) -> list:
    """The gradients of a call's tensor arguments as the launch makes them (empty where not needed):
    a full-size per-element one laid out by rows_like, any other contiguous."""
    tensors, lay, spec, elems = _faked(sp, args, rounding)
    out = []
    for (n, t), need in zip(tensors.items(), needs):
        if not need:
            out.append(t.new_empty(0))
        elif lay.kinds[n] == "elem" and tuple(t.shape) == tuple(lay.shape):
            out.append(rows_like(bool(spec.reductions), elems, lay.shape, t.dtype))
        else:
            out.append(t.new_empty(t.shape))
    return out


def op_for(spelling, rounding: str = "autograd", recompute: bool = False) -> GraftedOp:
    """The custom op pair for `spelling`, defined on first use. rounding: 'autograd' rounds like
    eager PyTorch (the eager backend), 'fused' like inductor's fused kernels (the inductor backend).
    recompute: another name for the same op, for sites tagged to be recomputed in the backward."""
    suffix = ("" if rounding == "autograd" else f"__{rounding}") + ("__rc" if recompute else "")
    name = op_name(spelling, suffix, ABI)
    return cached_op(name, lambda: _single(spelling, name, rounding, recompute))


def _single(sp, name: str, rounding: str, recompute: bool) -> GraftedOp:
    n_args = len(sp.arg_names)
    tensor_idx = [i for i, a in enumerate(sp.arg_names) if a not in sp.scalar_names]
    scalar_idx = [i for i, a in enumerate(sp.arg_names) if a in sp.scalar_names]

    def fwd_impl(*args):
        return launch.forward(sp, args, rounding)

    def fwd_fake(*args):
        return _fake(sp, args, rounding)

    def bwd_impl(grad, *rest):
        *args, stats, needs = rest
        return launch.backward(sp, grad, tuple(args), stats, list(needs), rounding)

    def bwd_fake(grad, *rest):
        *args, stats, needs = rest
        return _grad_fakes(sp, args, needs, rounding)

    fwd, fwd_op = define(name, fwd_impl, fwd_fake, f"({schema_args(sp)}) -> (Tensor, Tensor)", traceable=True)
    bwd_schema = f"(Tensor grad, {schema_args(sp)}, Tensor stats, bool[] needs) -> Tensor[]"
    _, bwd_op = define(f"{name}_bwd", bwd_impl, bwd_fake, bwd_schema, traceable=True)
    bwd_out_op = _bwd_out_op(sp, name, rounding, bwd_fake) if recompute else None
    bwd_acc_op = _bwd_out_op(sp, name, rounding, bwd_fake, acc=True) if recompute else None
    fwd_add_op = _fwd_add_op(sp, name, rounding)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[i] for i in tensor_idx), output[1])
        ctx.scalars = [inputs[i] for i in scalar_idx]
        ctx.set_materialize_grads(False)  # no zero gradient allocated for the row statistics

    def backward_by(bwd):
        def backward(ctx, grad, _grad_stats):
            if grad is None:  # the output did not reach the loss
                return (None,) * n_args
            *tensors, stats = ctx.saved_tensors
            args, needs = _saved_args(ctx, n_args, tensor_idx, scalar_idx, tensors)
            return _input_grads(n_args, tensor_idx, bwd(grad, *args, stats, needs), needs)

        return backward

    fwd.register_autograd(backward_by(bwd_op), setup_context=setup_context)
    register_eager_call(fwd_op, eager_call(name, fwd_impl, setup_context, backward_by(bwd_impl)))
    return GraftedOp(sp, name, fwd_op, bwd_op, bwd_out_op, bwd_acc_op, fwd_add_op)


def _fwd_add_op(sp, name: str, rounding: str):
    """kernelgraft::<name>_fwda(a, b, the other args...) -> (out, row stats, a + b): the forward of
    a norm whose first tensor argument is a + b, made in the same pass (launch.forward_add). Not
    called by autograd: the rewriter's pass over the forward graph puts it in place of a norm call
    and the add that makes its input (a decoder's residual stream), where the add is eager's."""
    first = sp.arg_names.index(sp.tensor_names[0])
    rest_names = [a for i, a in enumerate(sp.arg_names) if i != first]

    def impl(a, b, *rest):
        return launch.forward_add(sp, a, b, (*rest[:first], None, *rest[first:]), rounding)

    def fake(a, b, *rest):
        h = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        out, stats = _fake(sp, (*rest[:first], h, *rest[first:]), rounding)
        return out, stats, h

    rest_schema = ", ".join(f"float {a}" if a in sp.scalar_names else f"Tensor {a}" for a in rest_names)
    return define(
        f"{name}_fwda",
        impl,
        fake,
        f"(Tensor add_a, Tensor add_b{', ' + rest_schema if rest_schema else ''}) -> (Tensor, Tensor, Tensor)",
        traceable=True,
    )[1]


def _bwd_out_op(sp, name: str, rounding: str, bwd_fake, acc: bool = False):
    """kernelgraft::<name>_bwdo(grad, args..., needs) -> [gradients..., output]: the backward of a
    site whose output is recomputed, making that output in the same pass (launch.backward_with_out).
    Not called by autograd: the rewriter's pass over the backward graph puts it where the
    recomputed forward and the backward read the same arguments. acc: kernelgraft::<name>_bwdoa(grad,
    args..., acc, needs), which adds acc to the first argument's gradient (a norm's input gradient
    joining the residual stream's: the rewriter's pass puts it in place of that add)."""

    def impl(grad, *rest):
        *args, needs = rest
        a = args.pop() if acc else None
        return launch.backward_with_out(sp, grad, tuple(args), list(needs), rounding, acc=a)

    def fake(grad, *rest):
        *args, needs = rest
        if acc:
            args.pop()
        return [*bwd_fake(grad, *args, None, needs), _fake(sp, tuple(args), rounding)[0]]

    return define(
        f"{name}_bwdo{'a' if acc else ''}",
        impl,
        fake,
        f"(Tensor grad, {schema_args(sp)}, {'Tensor acc, ' if acc else ''}bool[] needs) -> Tensor[]",
        traceable=True,
    )[1]


def pair_op_for(spelling, rounding: str = "autograd") -> GraftedOp:
    """Two sites of one spelling in one launch (q and k of a layer): kernelgraft::<name>_pair takes
    the first site's arguments, then the second site's tensor arguments (scalars are shared), and
    returns (out_0, out_1, stats_0, stats_1). Per-column arguments must be the same tensor in both
    (the rewriter pairs sites only then); where at run time the two cannot share a launch, the
    launcher makes two: same numbers."""
    name = f"{op_for(spelling, rounding).name}_pair"
    return cached_op(name, lambda: _pair(spelling, name, rounding))


def _pair(sp, name: str, rounding: str) -> GraftedOp:
    n_args = len(sp.arg_names)
    tensor_idx = [i for i, a in enumerate(sp.arg_names) if a not in sp.scalar_names]
    T = len(tensor_idx)

    def split(args):
        first = list(args[:n_args])
        second = list(first)
        for j, i in enumerate(tensor_idx):
            second[i] = args[n_args + j]
        return tuple(first), tuple(second)

    def fwd_impl(*args):
        (o0, s0), (o1, s1) = launch.forward_group(sp, list(split(args)), rounding)
        return o0, o1, s0, s1

    def fwd_fake(*args):
        a0, a1 = split(args)
        (o0, s0), (o1, s1) = _fake(sp, a0, rounding), _fake(sp, a1, rounding)
        return o0, o1, s0, s1

    def bwd_impl(g0, g1, *rest):
        *args, s0, s1, needs = rest
        r0, r1 = launch.backward_group(
            sp, [g0, g1], list(split(args)), [s0, s1], [needs[:T], needs[T:]], rounding
        )
        return [*r0, *r1]

    def bwd_fake(g0, g1, *rest):
        *args, s0, s1, needs = rest
        a0, a1 = split(args)
        return _grad_fakes(sp, a0, needs[:T], rounding) + _grad_fakes(sp, a1, needs[T:], rounding)

    second = ", ".join(f"Tensor {sp.arg_names[i]}_1" for i in tensor_idx)
    fwd, fwd_op = define(
        name,
        fwd_impl,
        fwd_fake,
        f"({schema_args(sp)}, {second}) -> (Tensor, Tensor, Tensor, Tensor)",
        traceable=True,
    )
    bwd_schema = (
        f"(Tensor grad_0, Tensor grad_1, {schema_args(sp)}, {second}, Tensor stats_0, Tensor stats_1, "
        "bool[] needs) -> Tensor[]"
    )
    _, bwd_op = define(f"{name}_bwd", bwd_impl, bwd_fake, bwd_schema, traceable=True)
    scalar_idx = [i for i, a in enumerate(sp.arg_names) if a in sp.scalar_names]
    all_tensor_idx = tensor_idx + [n_args + j for j in range(T)]

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[i] for i in all_tensor_idx), output[2], output[3])
        ctx.scalars = [inputs[i] for i in scalar_idx]
        ctx.set_materialize_grads(False)  # no zero gradient allocated for the row statistics

    def backward_by(bwd):
        def backward(ctx, g0, g1, _s0, _s1):
            if g0 is None and g1 is None:
                return (None,) * (n_args + T)
            *tensors, s0, s1 = ctx.saved_tensors
            args, needs = _saved_args(ctx, n_args + T, all_tensor_idx, scalar_idx, tensors)
            a0, a1 = split(args)
            g0 = g0 if g0 is not None else torch.zeros_like(_fake(sp, a0, rounding)[0])
            g1 = g1 if g1 is not None else torch.zeros_like(_fake(sp, a1, rounding)[0])
            return _input_grads(n_args + T, all_tensor_idx, bwd(g0, g1, *args, s0, s1, needs), needs)

        return backward

    fwd.register_autograd(backward_by(bwd_op), setup_context=setup_context)
    register_eager_call(fwd_op, eager_call(name, fwd_impl, setup_context, backward_by(bwd_impl)))
    return GraftedOp(sp, name, fwd_op, bwd_op)
