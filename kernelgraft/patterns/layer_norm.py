"""LayerNorm, as decoders write it: `nn.LayerNorm` / `F.layer_norm` over the last dim (GPT-NeoX,
Phi, Falcon, StableLM, StarCoder2, OPT, BLOOM, GPT-2...), with and without its bias or weight, and
the hand-written float32 LayerNorm of Cohere's models. Canonicalization reads `F.layer_norm` as its
primitives, rounded as PyTorch rounds it (x, weight and bias read in float32, the biased variance,
one rounding to the output's dtype), so each spelling below also matches the same math written out
(`h = x.float(); d = h - h.mean(-1, keepdim=True); ...`).

affine:      weight and bias (nn.LayerNorm's default).
weight_only: no bias (`nn.LayerNorm(bias=False)`; Cohere's hand-written norm).
plain:       neither (`elementwise_affine=False`; OLMo-1's norm).
"""

import torch
import torch.nn.functional as F

from .registry import Scalar, dtype_check, pattern


def _example(rows, n, dtype, g, weight=True, bias=True):
    x = torch.randn(rows, n, generator=g).to(dtype).requires_grad_()
    out = {"x": x}
    if weight:
        out["weight"] = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    if bias:
        out["bias"] = (0.1 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    out["eps"] = 1e-5
    return out


@pattern("layer_norm", spelling="affine", extra_check=dtype_check, example=_example, recompute=True)
def layer_norm_affine(x, weight, bias, eps: Scalar):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


@pattern(
    "layer_norm",
    spelling="weight_only",
    extra_check=dtype_check,
    example=lambda rows, n, dtype, g: _example(rows, n, dtype, g, bias=False),
    recompute=True,
)
def layer_norm_weight_only(x, weight, eps: Scalar):
    return F.layer_norm(x, x.shape[-1:], weight, None, eps)


@pattern(
    "layer_norm",
    spelling="plain",
    extra_check=dtype_check,
    example=lambda rows, n, dtype, g: _example(rows, n, dtype, g, weight=False, bias=False),
)
def layer_norm_plain(x, eps: Scalar):
    return F.layer_norm(x, x.shape[-1:], None, None, eps)
