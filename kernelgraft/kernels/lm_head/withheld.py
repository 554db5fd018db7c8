"""Logits the fused LM head never made. In training the graph's `logits` output is withheld: the
graph returns an empty marker there (the custom op below), and the model's call turns it into a
`WithheldLogits`, which raises on any use of its values, saying how to get logits.
"""

from __future__ import annotations

import torch

WITHHELD_MESSAGE = (
    "kernelgraft fused the LM head with the loss, so these logits were never computed (that is the "
    "memory saving). To get logits: call the model without labels, or under torch.no_grad(), or "
    "optimize(model, keep_logits=True)."
)


def marker_op():
    """kernelgraft::withheld_logits: what the graph returns in place of logits the fused LM head
    never made (an empty tensor)."""
    return torch.ops.kernelgraft.withheld_logits.default


@torch.library.custom_op("kernelgraft::withheld_logits", mutates_args=())
def _withheld(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


@_withheld.register_fake
def _(like):
    return like.new_empty(0)


def _withheld_ctx(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


_withheld.register_autograd(lambda ctx, grad: None, setup_context=_withheld_ctx)


# What wrappers read from every tensor a model returns without using its values: DDP (with
# find_unused_parameters, as Hugging Face's Trainer sets it) reads each output's grad_fn and passes
# the outputs through an autograd function that clones them.
_INSPECTED = tuple(
    getattr(torch.Tensor, a).__get__ for a in ("grad_fn", "requires_grad", "is_leaf", "device")
)
_PASSED_ON = (torch.Tensor.clone, torch.Tensor.detach)


class WithheldLogits(torch.Tensor):
    """Stands where a training forward would have returned logits that the fused LM head never made:
    any use of their values raises an error that says how to get them. Autograd metadata can be
    read, and a clone or detach gives another marker (what DDP does to a model's outputs)."""

    @staticmethod
    def __new__(cls):
        return torch.Tensor._make_subclass(cls, torch.empty(0), False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _INSPECTED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func in _PASSED_ON:
            return WithheldLogits()
        raise RuntimeError(WITHHELD_MESSAGE)

    def __repr__(self) -> str:
        return f"WithheldLogits({WITHHELD_MESSAGE})"

    __str__ = __repr__


def _marker(v) -> bool:
    return (
        isinstance(v, torch.Tensor) and not isinstance(v, WithheldLogits) and v.dim() == 1 and v.numel() == 0
    )


def explain_markers(out, withholds):
    """A model's output with the graph's empty markers, where the logits were withheld, replaced by
    WithheldLogits. `withholds()` confirms that the model withholds logits (asked only when an
    output looks like a marker: two type checks per call otherwise)."""
    if isinstance(out, dict) and _marker(out.get("logits")):  # ModelOutput is a dict
        if withholds():
            out["logits"] = WithheldLogits()
    elif isinstance(out, tuple) and len(out) > 1 and _marker(out[1]):  # return_dict=False: (loss, logits, ...)
        if withholds():
            out = (out[0], WithheldLogits(), *out[2:])
    return out
