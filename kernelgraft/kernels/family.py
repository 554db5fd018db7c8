"""Kernel families behind one interface, and the op naming and caching every family shares.

A spelling names the family that serves it (`@pattern(..., kernel="row")`). A family says:

- `refusal(spelling, metas, rounding, options, training)`: why it cannot serve a site with these
  argument metas (a reason string), or None;
- `op(spelling, rounding, recompute, options)`: the torch.library custom op that computes the
  spelling, with its gradients (options: the user's, where the op depends on them); the op's `bind(args, metas, options)` gives the call's arguments from the
  matched ones (fx nodes and numbers by argument name);
- `source(spelling, dtype)`: the Triton source it generates, for people to read;
- `pair_op(spelling, rounding)`: an op serving two sites in one launch, where it has one;
- `recomputed_ops()`: the ops whose output the backward graph may make again (the rewriter's
  recompute pass);
- `withheld_marker()`: what a graph returns for an intermediate the kernel never makes (logits),
  and `explain_withheld(out, withholds)`: a model's output with those markers made explanatory;
- `cache_files()`: the files whose code decides what the family's ops do in a compiled graph (their
  traced launches): inductor's caches are keyed by them, so a change to one compiles anew;
- `serves`: the kinds of module a model calls that its patterns serve ({"norm": ("rms_norm", ...)}),
  so that a module of that kind with no site is reported as not served;
- `adding_input(spelling, args)` / `accumulating_input(spelling, args)`: the input a site's kernel
  can make as a sum, or whose gradient it can store summed (the residual stream's adds), or None.

Every family falls back the same way (kernels/fallback.py): a kernel that fails to compile or
launch is recorded once, warned about, and its sites run the spelling's own PyTorch code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .fallback import AUTOCAST


class Unsupported(Exception):
    """A family cannot serve this spelling or site (the caller falls back and reports why)."""


@dataclass
class KernelSource:
    """The generated forward and backward Triton source of one spelling at one specialization."""

    pattern: str
    spelling: str
    forward: str
    backward: str
    path: str
    gradients: dict  # argument -> its derived gradient (sympy, in the spec's symbols; g: the incoming one)

    def __str__(self) -> str:
        return f"# {self.pattern}.{self.spelling} ({self.path})\n{self.forward}\n\n{self.backward}"


class Family:
    """The interface of a kernel family (see the module docstring); subclasses fill it in."""

    name = ""

    def refusal(self, spelling, metas: dict, rounding: str, options, training: bool) -> str | None:
        raise NotImplementedError

    def op(self, spelling, rounding: str = "autograd", recompute: bool = False, options=None, metas=None):
        """The op serving `spelling`; metas: the matched tensors' values (shapes, device) by name,
        where the family picks an op by them."""
        raise NotImplementedError

    def source(self, spelling, dtype: torch.dtype) -> KernelSource:
        raise NotImplementedError(f"the {self.name} family shows no generated source")

    def pair_op(self, spelling, rounding: str = "autograd"):
        return None

    def recomputed_ops(self) -> list:
        return []

    def withheld_marker(self):
        """The op a graph returns in place of an intermediate the kernel never makes (the LM head's
        logits), where the family's spellings may withhold one; None otherwise."""
        return None

    def explain_withheld(self, out, withholds):
        """A model's output with this family's withheld markers replaced by what explains them;
        `withholds()` confirms that the model withholds (asked only where an output looks like one)."""
        return out

    def cache_files(self) -> tuple:
        """The files whose code decides what this family's ops do in a compiled graph."""
        return ()

    serves: dict = {}

    def adding_input(self, spelling, args):
        return None

    def accumulating_input(self, spelling, args):
        return None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def family_of(spelling) -> Family:
    """The family that serves `spelling` (its `kernel`)."""
    fam = FAMILIES.get(spelling.kernel)
    if fam is None:
        raise ValueError(
            f"{spelling.qualname}: unknown kernel family {spelling.kernel!r}; known: {tuple(FAMILIES)}"
        )
    return fam


# ---- ops: one name per (spelling, variant, ABI), defined once per process -------------------------

_OPS: dict[str, object] = {}


def op_name(spelling, suffix: str, abi: int) -> str:
    """kernelgraft::<pattern>__<spelling>__<key><suffix>_abi<abi>. The ABI number is in every name:
    inductor's on-disk caches key compiled graphs by op name, so a change to what an op returns
    (shapes, strides of its fake implementation) must change the name."""
    return re.sub(r"\W", "_", f"{spelling.pattern}__{spelling.name}__{spelling.key}{suffix}_abi{abi}")


def cached_op(name: str, make):
    """The op called `name`, made by `make()` the first time it is asked for."""
    if name not in _OPS:
        _OPS[name] = make()
    return _OPS[name]


def defined_ops() -> list:
    """Every op defined so far in this process, in definition order."""
    return list(_OPS.values())


# op overload -> its implementation, where that implementation can be traced for inductor (its
# Triton launches recorded, launching.traced_launches): the rewriter's lowering pass puts it in the
# compiled graph in place of the op call, so inductor's generated code makes the launches
_TRACEABLE: dict[object, object] = {}


def define(name: str, impl, fake, schema: str, traceable: bool = False):
    """kernelgraft::<name>, functional, from its implementation, fake implementation and schema ->
    (its CustomOpDef, for an autograd registration; its default OpOverload, to call). traceable:
    `impl` runs under launching.traced_launches() on fake tensors, its launches recorded."""
    op = torch.library.custom_op(f"kernelgraft::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    overload = getattr(torch.ops.kernelgraft, name).default
    if traceable:
        mark_traceable(overload, impl)
    return op, overload


def mark_traceable(overload, impl) -> None:
    """`impl`, the implementation of op overload `overload`, runs under
    launching.traced_launches() on fake tensors, its launches recorded (the lowering pass's)."""
    _TRACEABLE[overload] = impl


def save_inputs(ctx, inputs, tensor_idx: list, *extra: torch.Tensor) -> None:
    """An op's setup_context: `extra` (outputs the backward reads) and the inputs at tensor_idx
    saved through autograd (so saved-tensor hooks see them: checkpointing, offloading), the other
    inputs (numbers, flags) kept as they are."""
    ctx.save_for_backward(*extra, *(inputs[i] for i in tensor_idx))
    ctx.rest = [None if i in tensor_idx else a for i, a in enumerate(inputs)]


def saved_inputs(ctx, tensor_idx: list, n_extra: int) -> tuple[list, list]:
    """(the extra tensors, every input in place) as save_inputs kept them."""
    saved = ctx.saved_tensors
    args = list(ctx.rest)
    for i, t in zip(tensor_idx, saved[n_extra:]):
        args[i] = t
    return list(saved[:n_extra]), args


def traceable_impl(target):
    """The traceable implementation of op overload `target` (see define), or None."""
    return _TRACEABLE.get(target)


# op overload -> a plain function computing the same, with the same gradients, through an
# autograd.Function: what a graph run as it is (the eager backend) calls instead of the op, without
# the dispatcher's and torch.library's work on each call, a large part of a small op's host time
_EAGER: dict[object, object] = {}


def eager_call(name: str, impl, setup_context, backward):
    """impl (the op's implementation) as an autograd.Function's forward, with the op's own
    setup_context and backward (which should call the backward's implementation, not its op)."""

    def forward(ctx, *args):
        if torch._C._is_any_autocast_enabled():  # as the dispatcher calls an op: autocast off inside
            with torch._C._ExcludeDispatchKeyGuard(AUTOCAST):
                out = impl(*args)
        else:
            out = impl(*args)
        setup_context(ctx, args, out)
        return out

    def backward_(ctx, *grads):
        if torch._C._is_any_autocast_enabled():
            with torch._C._ExcludeDispatchKeyGuard(AUTOCAST):
                return backward(ctx, *grads)
        return backward(ctx, *grads)

    fn = type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward_)},
    )

    def call(*args):
        return fn.apply(*args)

    call.__name__ = call.__qualname__ = f"kernelgraft_{name}"
    return call


def register_eager_call(target, call) -> None:
    _EAGER[target] = call


def eager_call_of(target):
    """The eager call standing for op overload `target` (see eager_call), or None."""
    return _EAGER.get(target)


def schema_args(spelling) -> str:
    """A spelling's arguments in a custom op's schema: `float` for Scalars, `Tensor` otherwise."""
    return ", ".join(
        f"float {a}" if a in spelling.scalar_names else f"Tensor {a}" for a in spelling.arg_names
    )
