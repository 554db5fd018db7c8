"""Checks shared by the op tests: the verdicts of `check_spelling`, an RMSNorm op's inputs, the dtypes
a spelling is drawn in, and the generated kernels' bf16 rounding built alone."""

from __future__ import annotations

import torch

from kernelgraft.gradcheck import strategies
from kernelgraft.kernels.lm_head.transform import transform


def assert_ok(verdicts, whats):
    """Every verdict passes the accuracy rule, and the quantities compared are `whats` in order (the
    output and each gradient, e.g. ["out", "grad x"]): a gradient never compared fails too."""
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    assert [v.what for v in verdicts] == list(whats)


def rms_norm_inputs(M, N, dtype, seed=0, device="cpu"):
    """x (M rows of N) and a weight near 1, both needing gradients: an RMSNorm op's tensor arguments."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, N, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(N, generator=g)).to(device=device, dtype=dtype).requires_grad_()
    return x, w


def served_dtypes(sp) -> tuple:
    """The dtypes the spelling's own check serves (its example at each dtype, through extra_check):
    a spelling that refuses a dtype is a fallback there, checked in tests of its own."""
    from kernelgraft.patterns import Site

    out = []
    for dt in strategies.DTYPES:
        args = sp.example_args(4, 8, dt, 0)
        tensors = {n: v for n, v in zip(sp.arg_names, args) if isinstance(v, torch.Tensor)}
        if sp.extra_check is None or sp.extra_check(Site(sp.pattern, sp.name, tensors, {})) is None:
            out.append(dt)
    return tuple(out)


def dtypes_for(sp):
    """bf16/fp16 logits handed straight to cross_entropy (a plain loop) round inside PyTorch's loss in
    ways the kernel does not copy; its logit gradient is the correctly rounded one instead, which
    tests/kernels/test_lm_head.py checks directly. Those spellings are drawn in float32."""
    if (
        sp.kernel == "lm_head_ce"
        and transform(sp, torch.bfloat16, "autograd").out_dtype != torch.float32
    ):
        return (torch.float32,)
    return served_dtypes(sp)


ROUNDING_KERNELS = """

@triton.jit
def rnd(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, _round_bf16(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


@triton.jit
def both(x_ptr, bits_ptr, cast_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m)
    tl.store(bits_ptr + i, _round_bf16_bits(x), mask=m)
    tl.store(cast_ptr + i, _round_bf16_cast(x), mask=m)
"""


def rounding_module(interpret: bool):
    """The generated kernels' header with two test kernels (tests/kernels/test_kernels.py and
    tests/gpu/test_gpu.py): its interpreter's instance, or its compiled one."""
    from kernelgraft.kernels.cache import load_module
    from kernelgraft.kernels.emit import HEADER

    src = HEADER.format(qual="a test of the header", dtypes="-", kinds="-", out="float32") + ROUNDING_KERNELS
    return load_module("test_round_bf16", src, interpret=interpret)[0]
