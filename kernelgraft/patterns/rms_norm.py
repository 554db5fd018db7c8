"""RMSNorm, as Hugging Face decoders spell it.

llama: normalize in float32, round back to the input dtype, then multiply by the weight (in the
       weight's dtype: for bf16 models a second rounding). Llama, Mistral, Qwen2/3 (also the per-head
       q/k norms), Phi-3, Granite, OLMo-2, Mixtral...
gemma: normalize in float32, multiply by (1 + weight) in float32, round once at the end.
       Gemma, Gemma-2, Gemma-3.
olmo2: normalize in float32, multiply by the weight in float32, round once at the end. OLMo-2 (its
       q/k norms span all heads of the projection).
"""

import torch

from .registry import Scalar, dtype_check, pattern


def _example(rows, n, dtype, g):
    """x (rows, n) and a weight (n,) near 1 (near 0 for Gemma's 1 + w: it is perturbed either way)."""
    x = torch.randn(rows, n, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    return {"x": x, "weight": w, "eps": 1e-6}


@pattern("rms_norm", spelling="llama", extra_check=dtype_check, example=_example, recompute=True)
def rms_norm_llama(x, weight, eps: Scalar):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pattern("rms_norm", spelling="olmo2", extra_check=dtype_check, example=_example, recompute=True)
def rms_norm_olmo2(x, weight, eps: Scalar):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


@pattern("rms_norm", spelling="gemma", extra_check=dtype_check, example=_example, recompute=True)
def rms_norm_gemma(x, weight, eps: Scalar):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * (1.0 + weight.float())
    return h.type_as(x)
