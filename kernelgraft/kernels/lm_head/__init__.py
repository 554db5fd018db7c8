"""The LM-head family: `cross_entropy(linear(h, W) [transformed], target)` served by a fused,
chunked kernel that never holds the full logits (kernel.py has the method). transform.py cuts the
logit transform out of the spelling for the sympy generator; op.py is the custom op pair;
withheld.py stands in for the logits a training forward no longer makes.
"""

from __future__ import annotations

import torch

from ..family import Family, KernelSource, register
from . import kernel, op, transform
from .kernel import kernel_name, kernel_source, rounds_as
from .op import LMHeadOp, defers, op_for, refusal
from .withheld import WITHHELD_MESSAGE, WithheldLogits, explain_markers, marker_op


class LMHeadFamily(Family):
    name = "lm_head_ce"

    def refusal(self, spelling, metas: dict, rounding: str, options=None, training: bool = True) -> str | None:
        return refusal(spelling, metas, rounding, training)

    def op(self, spelling, rounding: str = "autograd", recompute: bool = False, options=None, metas=None) -> LMHeadOp:
        # under CUDA graphs, and for a small head on a GPU, the gradients are made in the backward
        # (nothing read on the host: op.defers)
        graphs = bool(options is not None and options.cuda_graphs)
        return op_for(spelling, rounding, deferred=graphs or defers(metas or {}))

    def source(self, spelling, dtype: torch.dtype) -> KernelSource:
        tf = transform.transform(spelling, dtype, "autograd", rounds_as("cpu"))
        src = kernel_source(kernel_name(spelling, dtype, "autograd"), tf, spelling.qualname)
        # one kernel makes the loss and, with GRAD, the logits' gradient in place: both are here
        return KernelSource(spelling.pattern, spelling.name, src, "", "", {"logits": tf.bwd})

    def withheld_marker(self):
        return marker_op()

    def explain_withheld(self, out, withholds):
        return explain_markers(out, withholds)

    def cache_files(self) -> tuple:
        return (kernel.__file__, op.__file__)


FAMILY = register(LMHeadFamily())

__all__ = ["FAMILY", "WITHHELD_MESSAGE", "LMHeadFamily", "LMHeadOp", "WithheldLogits", "explain_markers", "op_for"]
