"""The row-kernel family: element-wise math and row reductions, generated from the spelling.

spec (kernels/spec.py) -> derived backward (kernels/derive.py) -> Triton source (codegen.py) ->
built and cached once per specialization (build.py) -> launched with shapes and strides read in
place (layout.py, tuning.py, launch.py) -> torch.library custom ops (ops.py).
"""

from __future__ import annotations

import torch

from .. import derive, emit, spec
from ..fallback import generation_failed
from ..family import Family, KernelSource, Unsupported, defined_ops, register
from ..spec import halves_refusal
from . import build, codegen, launch, layout, ops, tuning
from .build import MAX_N, MAX_ROWS, RowKernel, rounds_for, row_kernel
from .codegen import backward_source, forward_source
from .ops import GraftedOp, accumulating_input, adding_input, op_for, pair_op_for

# why a row site of a graph without gradients is left to inductor (Options.rows_left_to_inductor)
INFERENCE = (
    "left to inductor: a graph without gradients, where inductor fuses this site with the ops around it "
    "(a residual add, a cache's concatenation) and rounds as the kernel would (inference='kernels' serves it)"
)


class RowFamily(Family):
    name = "row"

    def refusal(self, spelling, metas: dict, rounding: str, options=None, training: bool = True) -> str | None:
        if options is not None and options.rows_left_to_inductor(training):
            return INFERENCE
        first = metas[spelling.tensor_names[0]]
        N = first.shape[-1] if first.dim() else 1
        if isinstance(N, int) and N > MAX_N:
            return f"rows of {N} elements; generated kernels serve at most {MAX_N}"
        why = halves_refusal(spelling, metas)  # an odd width's halves are not two equal ones
        if why:
            return why
        try:
            lay = layout.layout(spelling, metas)
            if isinstance(lay.M, int) and lay.M > MAX_ROWS:
                return f"{lay.M} rows; generated kernels index at most {MAX_ROWS} rows in one tensor"
            dtypes = {n: t.dtype for n, t in metas.items()}
            row_kernel(spelling, dtypes, lay.kinds, rounding, rounds_for(first.device))
        except (Unsupported, ValueError) as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - a generator failure falls back, reported, never wrong
            return generation_failed(spelling.qualname, e)
        return None

    def op(self, spelling, rounding: str = "autograd", recompute: bool = False, options=None, metas=None) -> GraftedOp:
        return op_for(spelling, rounding, recompute)

    def pair_op(self, spelling, rounding: str = "autograd") -> GraftedOp:
        return pair_op_for(spelling, rounding)

    def source(self, spelling, dtype: torch.dtype) -> KernelSource:
        names = spelling.tensor_names
        kinds = {n: ("elem" if i == 0 else "col") for i, n in enumerate(names)}
        k = row_kernel(spelling, {n: dtype for n in names}, kinds)
        grads = {t.removeprefix("v_"): str(k.backward.grads[t]) for t in k.spec.tensors}
        return KernelSource(
            spelling.pattern,
            spelling.name,
            forward_source(k.spec),
            backward_source(k.spec, k.backward),
            str(k.path),
            grads,
        )

    serves = {"norm": ("rms_norm", "layer_norm"), "mlp": ("gated_mlp",), "rope": ("rope",)}

    def cache_files(self) -> tuple:
        # the generator's files too: a kernel whose source they change is not the one a cached graph ran
        made = (build.__file__, codegen.__file__, derive.__file__, emit.__file__, spec.__file__)
        return (
            ops.__file__,
            launch.__file__,
            layout.__file__,
            tuning.__file__,
            str(tuning.TABLE_PATH),
            *made,
        )

    def adding_input(self, spelling, args):
        return adding_input(spelling, args)

    def accumulating_input(self, spelling, args):
        return accumulating_input(spelling, args)

    def recomputed_ops(self) -> list[GraftedOp]:
        return [op for op in defined_ops() if isinstance(op, GraftedOp) and op.bwd_out is not None]


FAMILY = register(RowFamily())

__all__ = ["FAMILY", "MAX_N", "MAX_ROWS", "GraftedOp", "RowFamily", "RowKernel", "op_for", "pair_op_for", "row_kernel"]
