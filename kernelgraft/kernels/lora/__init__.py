"""The LoRA family: peft's adapter path `(result + lora_B(lora_A(x.to(A.dtype))) * scaling)`, cast back
to the base output's dtype, served by fused Triton kernels that read x once in its own dtype and sum
the adapter products in float32, adding the scaled update to the base layer's output (`result`) in
one pass over it (kernel.py has the method). The base layer stays a plain linear (cuBLAS).
"""

from __future__ import annotations

import torch

from ..family import Family, register
from . import kernel, op, source
from .op import LoRAOp, op_for

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# spellings whose sum is not cast back to the base output's dtype: served where it is that dtype
SUM_NOT_CAST = frozenset({"peft_4bit_autocast"})


class LoRAFamily(Family):
    name = "lora"

    def refusal(
        self, spelling, metas: dict, rounding: str, options=None, training: bool = True
    ) -> str | None:
        x, res, A, B = (metas.get(n) for n in ("x", "result", "lora_a", "lora_b"))
        if not all(isinstance(t, torch.Tensor) for t in (x, res, A, B)):
            return "an argument without a recorded value"
        if x.dtype not in DTYPES or res.dtype not in DTYPES:
            return f"x is {x.dtype} and the base layer's output {res.dtype}; served: {DTYPES}"
        if A.dtype != B.dtype or A.dtype not in DTYPES:
            return f"adapters of {A.dtype} and {B.dtype}; served: one dtype of {DTYPES} for both"
        if len({t.device.type for t in (x, res, A, B)}) != 1:
            return "arguments on more than one device"
        if A.dim() != 2 or B.dim() != 2:
            return "adapter weights that are not matrices"
        wide = torch.promote_types(res.dtype, A.dtype)
        if spelling.name in SUM_NOT_CAST and wide != res.dtype:
            return (
                f"the sum is {wide}, wider than the base output's {res.dtype} (a layer's first of several "
                "active adapters): the kernels return the base output's dtype"
            )
        if A.shape[0] > kernel.MAX_RANK:
            return f"rank {A.shape[0]}; the kernels serve ranks up to {kernel.MAX_RANK}"
        return None

    def op(
        self, spelling, rounding: str = "autograd", recompute: bool = False, options=None, metas=None
    ) -> LoRAOp:
        return op_for(spelling)

    def cache_files(self) -> tuple:
        return (kernel.__file__, op.__file__, source.__file__)


FAMILY = register(LoRAFamily())

__all__ = ["FAMILY", "LoRAFamily", "LoRAOp", "op_for"]
