"""Where a row kernel computes and sums in float64: a norm whose tensors are all float32 (in_float64),
and the per-column gradients of such a kernel, summed in float64 over blocks and programs."""

from __future__ import annotations

import torch

from ..spec import LOW, Spec


def in_float64(spec: Spec) -> bool:
    """Whether a kernel with row statistics (a norm) computes in float64: where every tensor is
    float32 and no value of the spelling is narrower. Loads and stores stay float32, and each stored
    value (output, statistic, gradient) is rounded once, at its store. In float32 two values lose
    to eager's:
    - the statistic: Triton sums a long row partly in sequence in each thread, and on constant rows
      (every term the same sign) the output's error grows well past eager's;
    - the x gradient rstd * (g*w - x * sum(g*w*x) * rstd^2 / N) cancels where g is nearly parallel
      to x (Gemma's norm with g = x), each float32 rounding of the two terms amplified by the
      cancellation.
    A bf16/fp16 path keeps float32: its roundings are the reference's, and they dominate. Kernels
    without statistics (RoPE, gated MLP) keep float32 too: each element is a short expression of
    its own, with no sum along the row."""
    if not spec.reductions:
        return False
    if any(dt != torch.float32 for dt in (*spec.dtypes.values(), spec.out_dtype)):
        return False
    return not any(n.dtype in LOW for n in spec.nodes)


def sum_type(wide: bool) -> str:
    """The type a per-column gradient is summed in over blocks and programs: float64 in a kernel
    that computes in it (in_float64: every tensor float32), rounded once at the end. A float32 sum
    of the blocks' partial sums, each program's in sequence, leaves a float32 weight gradient past
    eager's error (which sums in a cascade), and past the rule's floor where that error outgrows it
    (Gemma 4's k_norm)."""
    return "tl.float64" if wide else "tl.float32"


def column_sum_dtype(spec: Spec) -> torch.dtype:
    """The torch dtype of the backward programs' partial rows of a per-column gradient."""
    return torch.float64 if in_float64(spec) else torch.float32
