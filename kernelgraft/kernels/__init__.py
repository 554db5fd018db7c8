"""Kernel generator: traced pattern -> sympy spec -> derived backward -> Triton source -> custom op."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import cache_dir
from .ops import op_for
from .rowkernel import row_kernel
from .spec import Unsupported


@dataclass
class KernelSource:
    """The generated forward and backward Triton source of one spelling at one specialization."""

    pattern: str
    spelling: str
    forward: str
    backward: str
    path: str

    def __str__(self) -> str:
        return f"# {self.pattern}.{self.spelling} ({self.path})\n{self.forward}\n\n{self.backward}"


def source(pattern: str, spelling: str | None = None, dtype: torch.dtype = torch.float32) -> KernelSource:
    """Generated Triton source of `pattern` (first spelling unless named) for inputs of `dtype`,
    with a per-column weight where the pattern has one.

    >>> import kernelgraft
    >>> src = kernelgraft.kernels.source("rms_norm")
    >>> "tl.rsqrt" in src.forward and "def rms_norm__llama_bwd" in src.backward
    True
    """
    from ..patterns import REGISTRY
    from .codegen import backward_source, forward_source

    sp = REGISTRY.get(pattern, spelling)
    names = sp.tensor_names
    kinds = {n: ("elem" if i == 0 else "col") for i, n in enumerate(names)}
    k = row_kernel(sp, {n: dtype for n in names}, kinds)
    return KernelSource(
        sp.pattern, sp.name, forward_source(k.spec), backward_source(k.spec, k.backward), str(k.path)
    )


__all__ = ["KernelSource", "Unsupported", "cache_dir", "op_for", "row_kernel", "source"]
