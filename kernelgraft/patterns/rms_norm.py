"""RMSNorm, as Hugging Face decoders spell it.

llama: normalize in float32, round back to the input dtype, then multiply by the weight (in the
       weight's dtype: for bf16 models a second rounding). Llama, Mistral, Qwen2/3 (also the per-head
       q/k norms), Phi-3, Granite, OLMo-2, Mixtral...
gemma: normalize in float32, multiply by (1 + weight) in float32, round once at the end.
       Gemma, Gemma-2, Gemma-3.
olmo2: normalize in float32, multiply by the weight in float32, round once at the end. OLMo-2 (its
       q/k norms span all heads of the projection).
no_weight: normalize in float32, round back; no weight (Gemma-3n, Llama-4 and other weightless
       norms). A larger spelling that also matches (llama's, with its weight) is tried first.
no_weight_scale: no weight, the scale rounded to x's dtype before it multiplies x (DeepSeek-V4).
promoted: llama's math with x, not its float32 copy, times the float32 scale (type promotion
       upcasts it), the weight multiplied last (CPM-Ant).
no_cast: every op in x's dtype, the weight last (hand-written models).
l2_scaled: x times scale / max(||x||, eps), no weight (Zaya's q/k norm).
gated: x times silu(gate) in float32, then llama's norm (Mamba-2's gated norm: Mamba-2, Bamba,
       Zamba-2, GraniteMoeHybrid, Nemotron-H; served where the norm takes each row as one group).
"""

import torch
import torch.nn.functional as F

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


def _example_no_weight(rows, n, dtype, g):
    return {"x": torch.randn(rows, n, generator=g).to(dtype).requires_grad_(), "eps": 1e-6}


@pattern(
    "rms_norm", spelling="no_weight", extra_check=dtype_check, example=_example_no_weight, recompute=True
)
def rms_norm_no_weight(x, eps: Scalar):
    """No weight: Gemma-3n's and Llama-4's weightless norms, an L2-style norm of q and k."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype)


@pattern("rms_norm", spelling="l2", extra_check=dtype_check, example=_example_no_weight, recompute=True)
def rms_norm_l2(x, eps: Scalar):
    """The L2 norm of a row, no weight (Dory's L2Norm): the sum of squares where RMSNorm takes their mean."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps)
    return h.to(x.dtype)


@pattern(
    "rms_norm",
    spelling="no_weight_scale",
    extra_check=dtype_check,
    example=_example_no_weight,
    recompute=True,
)
def rms_norm_no_weight_scale(x, eps: Scalar):
    """No weight, the scale rounded to x's dtype before it multiplies x (DeepSeek-V4's unweighted norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


@pattern("rms_norm", spelling="promoted", extra_check=dtype_check, example=_example, recompute=True)
def rms_norm_promoted(x, weight, eps: Scalar):
    """x itself, not its float32 copy, times the float32 scale: PyTorch promotes x to float32 for
    the product, so the math is llama's; the weight multiplies last (CPM-Ant)."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def _float32_only(site) -> str | None:
    """no_cast in bf16/fp16 rounds after every op; eager's autograd rounds its backward at points
    the derived backward does not reproduce yet (its x gradient lands past eager's error), so only
    float32 is served."""
    low = sorted({str(t.dtype) for t in site.tensors.values() if t.dtype != torch.float32})
    if low:
        return (
            f"computed in {', '.join(low)} throughout (no float32 upcast): the kernel's backward does not "
            "round as eager's autograd does at each step; served in float32"
        )
    return dtype_check(site)


@pattern("rms_norm", spelling="no_cast", extra_check=_float32_only, example=_example, recompute=True)
def rms_norm_no_cast(x, weight, eps: Scalar):
    """No float32 upcast, every op in x's dtype: hand-written models (nanoGPT-style code)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _example_gated(rows, n, dtype, g):
    ex = _example(rows, n, dtype, g)
    ex["gate"] = torch.randn(rows, n, generator=g).to(dtype).requires_grad_()
    return {"x": ex["x"], "gate": ex["gate"], "weight": ex["weight"], "eps": ex["eps"]}


@pattern("rms_norm", spelling="gated", extra_check=dtype_check, example=_example_gated, recompute=True)
def rms_norm_gated(x, gate, weight, eps: Scalar):
    """Mamba-2's gated norm: x scaled by silu(gate) in float32, then normalized, rounded back, times
    the weight. The models write the norm over groups of the row (`view(*lead, groups, n //
    groups)`); with one group that view only adds a size-1 dim, which canonicalization sees through."""
    h = x.to(torch.float32)
    h = h * F.silu(gate.to(torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _example_l2_scaled(rows, n, dtype, g):
    return {"x": torch.randn(rows, n, generator=g).to(dtype).requires_grad_(), "scale": 4.0, "eps": 1e-6}


@pattern(
    "rms_norm", spelling="l2_scaled", extra_check=_float32_only, example=_example_l2_scaled, recompute=True
)
def rms_norm_l2_scaled(x, scale: Scalar, eps: Scalar):
    """x scaled to the L2 norm `scale`, its own norm clamped below at eps, every op in x's dtype
    (the norm accumulated in float32): Zaya's q/k norm. Served in float32, as no_cast: in bf16 its
    gradient where g is along x cancels to the roundings of eager's backward steps, and the
    kernel's differ, past eager's error on such a case."""
    return x * (scale / x.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
