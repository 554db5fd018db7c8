"""Gated MLP: act(gate) * up, the element-wise core of SwiGLU / GeGLU MLPs.

The projections stay with cuBLAS; the kernel computes the activation and the product in one pass
and saves only its inputs. Spellings by activation (each model family's ACT2FN entry):
silu (Llama, Mistral, Qwen, Phi-3, Granite, OLMo-2, Mixtral), gelu_tanh (Gemma family), exact gelu,
relu squared. `up * act(gate)` matches too (products commute), which also covers Phi-3's fused
gate_up_proj + chunk, where gate and up are strided halves of one tensor.
softcapped_silu: in float32, the gate's and up's factors each bounded by a softcap (tanh(v / c) * c)
while the sigmoid sees the raw gate, rounded once at the end (Inkling 2's experts).
clamped_swiglu: the gate clamped from above, up to [floor, limit], gate * sigmoid(alpha * gate)
times (up + 1) (GPT-OSS's experts, MiniMax-M3's; gate and up as chunk(2) halves or as interleaved
columns of one projection).
"""

import torch
import torch.nn.functional as F

from .registry import Scalar, dtype_check, pattern


@pattern("gated_mlp", spelling="silu", extra_check=dtype_check, recompute=True)
def gated_silu(gate, up):
    return F.silu(gate) * up


@pattern("gated_mlp", spelling="gelu_tanh", extra_check=dtype_check, recompute=True)
def gated_gelu_tanh(gate, up):
    return F.gelu(gate, approximate="tanh") * up


@pattern("gated_mlp", spelling="gelu", extra_check=dtype_check, recompute=True)
def gated_gelu(gate, up):
    return F.gelu(gate) * up


@pattern("gated_mlp", spelling="relu2", extra_check=dtype_check, recompute=True)
def gated_relu2(gate, up):
    return torch.square(F.relu(gate)) * up


def _example_caps(rows, n, dtype, g):
    """gate and up (rows, n), and Inkling 2's default caps (4 for the gate, 25 for up)."""
    gate = torch.randn(rows, n, generator=g).to(dtype).requires_grad_()
    up = torch.randn(rows, n, generator=g).to(dtype).requires_grad_()
    return {"gate": gate, "up": up, "gate_cap": 4.0, "up_cap": 25.0}


@pattern(
    "gated_mlp", spelling="softcapped_silu", extra_check=dtype_check, example=_example_caps, recompute=True
)
def gated_softcapped_silu(gate, up, gate_cap: Scalar, up_cap: Scalar):
    g, u = gate.float(), up.float()
    return (torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * (torch.tanh(u / up_cap) * up_cap)).to(
        gate.dtype
    )


def _example_limits(rows, n, dtype, g):
    """gate and up (rows, n) spread past the bounds, and GPT-OSS's defaults (limit 7, alpha 1.702)."""
    gate = (4 * torch.randn(rows, n, generator=g)).to(dtype).requires_grad_()
    up = (4 * torch.randn(rows, n, generator=g)).to(dtype).requires_grad_()
    return {"gate": gate, "up": up, "limit": 7.0, "floor": -7.0, "alpha": 1.702}


@pattern(
    "gated_mlp", spelling="clamped_swiglu", extra_check=dtype_check, example=_example_limits, recompute=True
)
def gated_clamped_swiglu(gate, up, limit: Scalar, floor: Scalar, alpha: Scalar):
    # the models write up.clamp(min=-limit, max=limit): their graphs hold -limit as a number, which
    # binds as a Scalar of its own (`floor`)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=floor, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu
