"""Rotary position embedding, rotate-half form, as Hugging Face decoders spell it:

    q * cos + rotate_half(q) * sin,  rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

cos and sin arrive unsqueezed on the head dim and already cast to the activation dtype (HF computes
them in float32 and casts), so the products round like the spelling. rotate_half is a permutation
within the row with a sign; the generator reads the input at the rotated column and derives the
adjoint, a rotation the other way (by -theta). One site per tensor: q and k are matched separately.
"""

import torch

from .registry import dtype_check, pattern


@pattern("rope", spelling="rotate_half", extra_check=dtype_check)
def rope_rotate_half(x, cos, sin):
    h = x.shape[-1] // 2
    rotated = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rotated * sin
