"""What every family's launcher shares: the Triton options that keep the reference's roundings,
and the integer helpers of launch grids (host-side: cheap on every call)."""

from __future__ import annotations

import torch


def pow2(n: int) -> int:
    """The next power of two (triton.next_power_of_2 is a constexpr function: slow on the host)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)



def launch_options(rounding: str, dtypes, device_type: str) -> dict:
    """Triton options for a kernel that must round where the reference rounds. On the GPU Triton
    contracts a multiply and an add into one FMA by default, and LLVM first narrows float ops on
    values rounded to fp16/bf16 into half-precision ops: the LM head's `1 - round(y*y)` became
    fma(-y, y, 1), one rounding where CUDA eager's tanh_backward has two (measured on an H200,
    2026-11-30: 53232 of 200000 fp16 results differed from aten's; benchmarks/diag_softcap.py found
    the case). Without contraction every rounding written in the generated source is kept, as eager
    keeps each op's. Under inductor's rounding ("fused") contraction stays on, as inductor's own."""
    low = any(d in (torch.bfloat16, torch.float16) for d in dtypes)
    if device_type == "cuda" and rounding == "autograd" and low:
        return {"enable_fp_fusion": False}
    return {}
