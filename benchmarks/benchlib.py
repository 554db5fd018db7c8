"""What the benchmark scripts share (imported as a sibling module: they run from this folder)."""

from __future__ import annotations

import torch


def peak_above(fn) -> int:
    """Bytes the CUDA allocator held at its peak while `fn()` ran, above what was allocated before
    (the inputs): a call's own memory, outputs and gradients included."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base
