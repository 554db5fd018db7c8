"""Kernels: a spelling's math -> Triton, behind one interface per kernel family (family.py).

Families today: "row" (rows/: element-wise math and row reductions, generated from the spelling by
the sympy generator in spec.py and derive.py), "lm_head_ce" (lm_head/: linear + cross-entropy,
chunked, its logit transform generated) and "lora" (lora/: a low-rank adapter's path, its two
small matmuls and their adjoints fused with the spelling's roundings). They share the op naming and caching (family.py), the
fallback to the spelling's own code (fallback.py) and the on-disk source cache (cache.py).
"""

from __future__ import annotations

import torch

from ..patterns import REGISTRY
from . import fallback, lm_head, lora, rows
from .cache import cache_dir
from .family import FAMILIES, Family, KernelSource, Unsupported, family_of
from .rows import MAX_N, MAX_ROWS, row_kernel

KERNELS = tuple(FAMILIES)  # the kernel families a spelling can name


def op_for(spelling, rounding: str = "autograd", recompute: bool = False):
    """The custom op serving `spelling` (defined on first use), from its kernel family. Called
    with the spelling's own arguments, it computes what the spelling computes, with gradients.
    recompute: the op of a site whose output is to be recomputed in the backward (row kernels; the
    same kernels under another op name, so a compiled graph's cache entry tells the two apart).

    >>> import torch, kernelgraft
    >>> sp = kernelgraft.patterns.REGISTRY.get("gated_mlp", "silu")
    >>> gate, up = torch.randn(4, 8), torch.randn(4, 8)
    >>> op = kernelgraft.kernels.op_for(sp)
    >>> torch.allclose(op(gate, up), sp.fn(gate, up), rtol=1e-6, atol=1e-7)
    True
    """
    return family_of(spelling).op(spelling, rounding, recompute)


def refusal(
    spelling, metas: dict, rounding: str = "autograd", options=None, training: bool = True
) -> str | None:
    """Why the kernels cannot serve a site with these argument metas (None: they can). training:
    the site runs with gradients (the LM head is fused only then).

    >>> import torch, kernelgraft
    >>> sp = kernelgraft.patterns.REGISTRY.get("rms_norm", "llama")
    >>> kernelgraft.kernels.refusal(sp, {"x": torch.empty(2, 70000), "weight": torch.empty(70000)})
    'rows of 70000 elements; generated kernels serve at most 65536'
    >>> kernelgraft.kernels.refusal(sp, {"x": torch.empty(2, 64), "weight": torch.empty(64)}) is None
    True
    """
    return family_of(spelling).refusal(spelling, metas, rounding, options, training)


def source(pattern: str, spelling: str | None = None, dtype: torch.dtype = torch.float32) -> KernelSource:
    """Generated Triton source of `pattern` (first spelling unless named) for inputs of `dtype`,
    with a per-column weight where the pattern has one.

    >>> import kernelgraft
    >>> src = kernelgraft.kernels.source("rms_norm")
    >>> "_rsqrt(" in src.forward and "def rms_norm__llama_bwd" in src.backward
    True
    >>> sorted(src.gradients)  # derived with sympy: one expression per tensor argument
    ['weight', 'x']
    """
    sp = REGISTRY.get(pattern, spelling)
    return family_of(sp).source(sp, dtype)


def failed_kernels() -> dict:
    """Generated kernels that failed to compile or launch in this process, with why:
    {(kernel name, device type): reason}. Their sites run the stock PyTorch code (a warning said so).

    >>> import kernelgraft
    >>> isinstance(kernelgraft.kernels.failed_kernels(), dict)
    True
    """
    return dict(fallback.FAILED)


__all__ = [
    "FAMILIES",
    "KERNELS",
    "MAX_N",
    "MAX_ROWS",
    "Family",
    "KernelSource",
    "Unsupported",
    "cache_dir",
    "failed_kernels",
    "family_of",
    "lm_head",
    "lora",
    "op_for",
    "refusal",
    "row_kernel",
    "rows",
    "source",
]
