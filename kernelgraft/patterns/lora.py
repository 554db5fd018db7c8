"""LoRA, as peft's `lora.Linear` computes an adapted layer (one active adapter, no dropout):

    result = base_layer(x)
    result = result + lora_B(lora_A(x.to(lora_A.weight.dtype))) * scaling
    result = result.to(torch_result_dtype)

The pattern is the adapter path from the base layer's output `result` on: the base layer stays a
plain linear (with or without a bias), its own node in the graph, as in the model. peft casts x to
the adapters' dtype only where they differ (float32 adapters on a bf16/fp16 model, its default), so
a layer whose adapters share x's dtype (a float32 model, or `autocast_adapter_dtype=False`) has no
cast: both are spelled. `scaling` is lora_alpha / r (or / sqrt(r) with rsLoRA): a number the
matcher captures.

peft's layers over bitsandbytes' 4-bit base layers (QLoRA) add each adapter's update cast to the
base output's dtype, `result + (lora_B(lora_A(x.to(A.dtype))) * scaling).to(result.dtype)`, to a
clone of the base output: the `peft_4bit` spellings (x cast to the adapters' dtype where it
differs; under autocast neither cast). Their gradients are the same; the kernels add
in float32 and round the sum once, where this spelling rounds the update first (no less accurate). Dropout before lora_A, several active adapters, DoRA and merged adapters are
other graphs, reported as near misses where they resemble these.
"""

import torch
import torch.nn.functional as F

from .registry import Scalar, pattern


def _example(rows, n, dtype, g, same=False):
    """x (rows, n), a base output (rows, n // 2 + 3) in x's dtype, adapters of rank 1-64 by n
    (float32, or x's dtype where `same`)."""
    N, r = n // 2 + 3, 1 + (37 * n) % 64
    ad = dtype if same else torch.float32
    x = torch.randn(rows, n, generator=g).to(dtype).requires_grad_()
    res = torch.randn(rows, N, generator=g).to(dtype).requires_grad_()
    a = (torch.randn(r, n, generator=g) / n**0.5).to(ad).requires_grad_()
    b = (torch.randn(N, r, generator=g) / r**0.5).to(ad).requires_grad_()
    return {"x": x, "result": res, "lora_a": a, "lora_b": b, "scaling": 2.0}


def _example_same(rows, n, dtype, g):
    return _example(rows, n, dtype, g, same=True)


@pattern("lora", spelling="peft", kernel="lora", example=_example)
def peft(x, result, lora_a, lora_b, scaling: Scalar):
    return (result + F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b) * scaling).to(result.dtype)


@pattern("lora", spelling="peft_same_dtype", kernel="lora", example=_example_same)
def peft_same_dtype(x, result, lora_a, lora_b, scaling: Scalar):
    return (result + F.linear(F.linear(x, lora_a), lora_b) * scaling).to(result.dtype)


@pattern("lora", spelling="peft_4bit", kernel="lora", example=_example)
def peft_4bit(x, result, lora_a, lora_b, scaling: Scalar):
    return result + (F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b) * scaling).to(result.dtype)


@pattern("lora", spelling="peft_4bit_same_dtype", kernel="lora", example=_example_same)
def peft_4bit_same_dtype(x, result, lora_a, lora_b, scaling: Scalar):
    return result + (F.linear(F.linear(x, lora_a), lora_b) * scaling).to(result.dtype)


# no near misses: a scaled matmul added to anything is every scaled residual (Granite's)
@pattern("lora", spelling="peft_4bit_autocast", kernel="lora", example=_example_same, near_misses=False)
def peft_4bit_autocast(x, result, lora_a, lora_b, scaling: Scalar):
    return result + F.linear(F.linear(x, lora_a), lora_b) * scaling
