"""audit_kernel flags deliberately broken kernels (no weight gradient; a cast at the wrong point; NaN
for large inputs) and passes correct ones, naming the rounding each reproduces."""

import pytest
import torch

from kernelgraft.gradcheck import audit_kernel
from kernelgraft.kernels import op_for
from kernelgraft.patterns import REGISTRY

SHAPES = [(1, 7), (33, 64), (5, 1024)]


def kinds(rep):
    return sorted({f.kind for f in rep.findings})


def llama_norm(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def test_the_spelling_itself_and_kernelgraft_kernels_pass():
    for pattern, spelling in [("rms_norm", "llama"), ("gated_mlp", "silu"), ("rope", "rotate_half")]:
        sp = REGISTRY.get(pattern, spelling)
        # Llama's norm rounds the same way op by op and fused (explicit casts); RoPE and the MLP do not
        same = "eager = inductor" if pattern == "rms_norm" else "eager"
        for fn in (sp.fn, op_for(sp)):
            rep = audit_kernel(fn, pattern, spelling, shapes=SHAPES)
            assert rep.ok and not rep.findings, str(rep)
            assert rep.rounding == {"bfloat16": same, "float16": same}, str(rep)


def test_inductor_rounding_is_recognized():
    sp = REGISTRY.get("gated_mlp", "silu")  # eager rounds silu's output, inductor keeps it in float32
    rep = audit_kernel(op_for(sp, "fused"), "gated_mlp", "silu", shapes=SHAPES)
    assert rep.ok, str(rep)
    assert rep.rounding == {"bfloat16": "inductor", "float16": "inductor"}, str(rep)


def test_missing_weight_gradient_is_flagged():
    def no_weight_grad(x, w, eps):
        return llama_norm(x, w.detach(), eps)

    rep = audit_kernel(no_weight_grad, "rms_norm", "llama", shapes=SHAPES)
    assert not rep.ok and kinds(rep) == ["missing gradient"]
    assert all(f.what == "grad weight" for f in rep.findings)


def test_zero_weight_gradient_is_flagged():
    class ZeroW(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, eps):
            return llama_norm(x, w, eps)

        @staticmethod
        def backward(ctx, g):
            return g, torch.zeros(1).expand(0) if False else None, None

    def zero_w(x, w, eps):
        y = llama_norm(x, w, eps)
        return y + 0 * w  # a gradient for w that is all zeros

    rep = audit_kernel(
        lambda x, w, eps: llama_norm(x.detach(), w, eps) * 0 + llama_norm(x, w.detach(), eps) + 0 * w,
        "rms_norm",
        "llama",
        shapes=SHAPES[:2],
    )
    assert "zero gradient" in kinds(rep), str(rep)
    del ZeroW, zero_w


def test_cast_at_the_wrong_point_is_flagged():
    def late_cast(x, w, eps):  # multiplies by the weight in float32, then casts (OLMo-2's order, not Llama's)
        h = x.float()
        return (w.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)

    rep = audit_kernel(late_cast, "rms_norm", "llama", shapes=SHAPES)
    assert rep.rounding == {"bfloat16": "neither", "float16": "neither"}, str(rep)
    assert "rounding" in kinds(rep)


def test_nan_for_large_inputs_is_flagged():
    def overflows(gate, up):  # silu as gate / (1 + exp(-gate)) * up, with exp(-gate) * 0 at the NaN
        s = gate / (1 + torch.exp(-gate))
        return torch.where(gate.abs() > 50, s * torch.exp(gate.abs()) * 0, s) * up

    rep = audit_kernel(overflows, "gated_mlp", "silu", shapes=SHAPES[:2])
    nans = [f for f in rep.findings if f.kind == "nan"]
    assert nans and all(f.case.endswith("x100") for f in nans), str(rep)
    assert not rep.ok


def test_a_crashing_kernel_is_reported_not_raised():
    def broken(x, w, eps):
        raise RuntimeError("kernel not built for this shape")

    rep = audit_kernel(broken, "rms_norm", "llama", dtypes=[torch.float32], shapes=SHAPES[:1])
    assert kinds(rep) == ["error"] and "not built" in rep.findings[0].detail


@pytest.mark.parametrize("spelling", ["hf_mean", "softcap_mean"])
def test_lm_head_kernel_audits_clean(spelling):
    sp = REGISTRY.get("lm_head_ce", spelling)
    rep = audit_kernel(
        op_for(sp), "lm_head_ce", spelling, dtypes=[torch.float32, torch.bfloat16], shapes=[(40, 32)]
    )
    assert rep.ok, str(rep)


def test_markdown_report_lists_the_findings():
    rep = audit_kernel(
        lambda x, w, eps: llama_norm(x, w.detach(), eps),
        "rms_norm",
        "llama",
        dtypes=[torch.float32],
        shapes=[(4, 16)],
        name="mine",
    )
    md = rep.to_markdown()
    assert md.startswith("### mine as rms_norm.llama: FLAGGED") and "| grad weight | missing gradient |" in md
