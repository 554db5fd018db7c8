"""Kernel generator: traced pattern -> sympy spec -> derived backward -> Triton source -> custom op."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import lm_head, ops
from .cache import cache_dir
from .rowkernel import MAX_N, MAX_ROWS, layout, row_kernel
from .spec import Unsupported

KERNELS = ("row", "lm_head_ce")  # the kernel families a spelling can name


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
    if spelling.kernel == "lm_head_ce":
        return lm_head.op_for(spelling, rounding)
    if spelling.kernel != "row":
        raise ValueError(f"{spelling.qualname}: unknown kernel family {spelling.kernel!r}; known: {KERNELS}")
    return ops.op_for(spelling, rounding, recompute)


def refusal(spelling, metas: dict, rounding: str = "autograd", options: dict | None = None) -> str | None:
    """Why the kernels cannot serve a site with these argument metas (None: they can).

    >>> import torch, kernelgraft
    >>> sp = kernelgraft.patterns.REGISTRY.get("rms_norm", "llama")
    >>> kernelgraft.kernels.refusal(sp, {"x": torch.empty(2, 70000), "weight": torch.empty(70000)})
    'rows of 70000 elements; generated kernels serve at most 65536'
    >>> kernelgraft.kernels.refusal(sp, {"x": torch.empty(2, 64), "weight": torch.empty(64)}) is None
    True
    """
    if spelling.kernel == "lm_head_ce":
        return lm_head.refusal(spelling, metas, rounding, options or {})
    first = metas[spelling.tensor_names[0]]
    N = first.shape[-1] if first.dim() else 1
    if isinstance(N, int) and N > MAX_N:
        return f"rows of {N} elements; generated kernels serve at most {MAX_N}"
    try:
        lay = layout(spelling, metas)
        if isinstance(lay.M, int) and lay.M > MAX_ROWS:
            return f"{lay.M} rows; generated kernels index at most {MAX_ROWS} rows in one tensor"
        row_kernel(spelling, {n: t.dtype for n, t in metas.items()}, lay.kinds, rounding)
    except (Unsupported, ValueError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a generator failure falls back, reported, never wrong
        return f"kernel generation failed: {type(e).__name__}: {e}"
    return None


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


def source(pattern: str, spelling: str | None = None, dtype: torch.dtype = torch.float32) -> KernelSource:
    """Generated Triton source of `pattern` (first spelling unless named) for inputs of `dtype`,
    with a per-column weight where the pattern has one.

    >>> import kernelgraft
    >>> src = kernelgraft.kernels.source("rms_norm")
    >>> "tl.rsqrt" in src.forward and "def rms_norm__llama_bwd" in src.backward
    True
    >>> sorted(src.gradients)  # derived with sympy: one expression per tensor argument
    ['weight', 'x']
    """
    from ..patterns import REGISTRY
    from .codegen import backward_source, forward_source

    sp = REGISTRY.get(pattern, spelling)
    names = sp.tensor_names
    kinds = {n: ("elem" if i == 0 else "col") for i, n in enumerate(names)}
    k = row_kernel(sp, {n: dtype for n in names}, kinds)
    grads = {t.removeprefix("v_"): str(k.backward.grads[t]) for t in k.spec.tensors}
    return KernelSource(
        sp.pattern, sp.name, forward_source(k.spec), backward_source(k.spec, k.backward), str(k.path), grads
    )


def failed_kernels() -> dict:
    """Generated kernels that failed to compile or launch in this process, with why:
    {(kernel name, device type): reason}. Their sites run the stock PyTorch code (a warning said so).

    >>> import kernelgraft
    >>> isinstance(kernelgraft.kernels.failed_kernels(), dict)
    True
    """
    from .rowkernel import FAILED

    return dict(FAILED)


__all__ = [
    "KERNELS",
    "KernelSource",
    "Unsupported",
    "cache_dir",
    "failed_kernels",
    "op_for",
    "refusal",
    "row_kernel",
    "source",
]
