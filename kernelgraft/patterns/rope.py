"""Rotary position embedding, rotate-half form, as Hugging Face decoders spell it:

    q * cos + rotate_half(q) * sin,  rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

cos and sin arrive unsqueezed on the head dim and already cast to the activation dtype (HF computes
them in float32 and casts), so the products round like the spelling. rotate_half is a permutation
within the row with a sign; the generator reads the input at the rotated column and derives the
adjoint, a rotation the other way (by -theta). One site per tensor: q and k are matched separately.
"""

import torch

from .registry import dtype_check, pattern


def _example(rows, n, dtype, g):
    """HF's layout: q (1, heads, S, n) as a transposed view, cos/sin (1, 1, S, n) with equal halves."""
    heads, n = 4, n + n % 2
    S = max(1, rows // heads)
    q = torch.randn(1, S, heads, n, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    ang = torch.randn(1, S, n // 2, generator=g).repeat(1, 1, 2)
    return {"x": q, "cos": ang.cos().to(dtype).unsqueeze(1), "sin": ang.sin().to(dtype).unsqueeze(1)}


@pattern("rope", spelling="rotate_half", extra_check=dtype_check, example=_example)
def rope_rotate_half(x, cos, sin):
    h = x.shape[-1] // 2
    rotated = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rotated * sin
