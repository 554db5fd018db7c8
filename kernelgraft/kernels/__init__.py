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
from ..patterns.registry import SERVABLE
from . import fallback, lm_head, lora, rows
from .cache import cache_dir
from .family import FAMILIES, Family, KernelSource, Unsupported, family_of
from .rows import MAX_N, MAX_ROWS, row_kernel
from .spec import build_spec

KERNELS = tuple(FAMILIES)  # the kernel families a spelling can name


def _servable(spelling) -> str | None:
    """Why no family could serve any site of `spelling` (patterns.registry.SERVABLE asks at the
    decorator): a kernel no family is, or (row kernels) math the generator cannot emit whatever
    the arguments' shapes (tried with every tensor varying per element, which serves the most)."""
    if spelling.kernel not in FAMILIES:
        return f"names kernel={spelling.kernel!r}, which no kernel family serves (known: {tuple(FAMILIES)})"
    if spelling.kernel == "row":
        try:
            names = spelling.tensor_names
            build_spec(spelling, dict.fromkeys(names, torch.float32), dict.fromkeys(names, "elem"))
        except Unsupported as e:
            return f"is not what the row kernels compute ({e})"
        except Exception:  # noqa: BLE001 - a generator error is the site's to report, where it has shapes
            return None
    return None


SERVABLE.append(_servable)


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


def explain_withheld(out, withholds):
    """A model's output with every family's withheld markers (the fused LM head's logits) replaced
    by what explains them; `withholds()` confirms that the model withholds."""
    for family in FAMILIES.values():
        out = family.explain_withheld(out, withholds)
    return out


def served_kinds() -> dict:
    """{kind of module: the patterns that serve it} over every family ("norm": rms_norm, ...)."""
    kinds: dict = {}
    for family in FAMILIES.values():
        for kind, patterns in family.serves.items():
            kinds[kind] = tuple(dict.fromkeys((*kinds.get(kind, ()), *patterns)))
    return kinds


def cache_files() -> tuple:
    """The files every family's compiled ops depend on (inductor's caches are keyed by them)."""
    return tuple(f for family in FAMILIES.values() for f in family.cache_files())


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
    "cache_files",
    "explain_withheld",
    "failed_kernels",
    "family_of",
    "lm_head",
    "lora",
    "op_for",
    "refusal",
    "row_kernel",
    "rows",
    "served_kinds",
    "source",
]
