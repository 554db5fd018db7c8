"""Gated MLP: act(gate) * up, the element-wise core of SwiGLU / GeGLU MLPs.

The projections stay with cuBLAS; the kernel computes the activation and the product in one pass
and saves only its inputs. Spellings by activation (each model family's ACT2FN entry):
silu (Llama, Mistral, Qwen, Phi-3, Granite, OLMo-2, Mixtral), gelu_tanh (Gemma family), exact gelu,
relu squared. `up * act(gate)` matches too (products commute), which also covers Phi-3's fused
gate_up_proj + chunk, where gate and up are strided halves of one tensor.
"""

import torch
import torch.nn.functional as F

from .registry import dtype_check, pattern


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
