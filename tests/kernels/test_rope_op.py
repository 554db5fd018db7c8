"""The rotate-half RoPE op alone: vs float64 truth, eager and torch.compile; its derived backward is
the rotation by -theta; HF's layouts (transposed q, cos/sin unsqueezed on the head dim); partial
rotary served by matching the rotated slice."""

import pytest
import torch
from checks import assert_ok
from hypothesis import given
from hypothesis import strategies as st

import kernelgraft
from kernelgraft.gradcheck import check_spelling
from kernelgraft.kernels import op_for, source
from kernelgraft.patterns import REGISTRY

SP = REGISTRY.get("rope", "rotate_half")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def inputs(B, H, S, D, dtype, seed=0, transposed=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    q = (q.transpose(1, 2) if transposed else q.reshape(B, H, S, D)).detach().requires_grad_()
    ang = torch.randn(B, S, D // 2, generator=g).repeat(1, 1, 2)  # HF: emb = cat(freqs, freqs)
    return q, ang.cos().to(dtype).unsqueeze(1), ang.sin().to(dtype).unsqueeze(1)


WHATS = ["out", "grad x"]  # cos/sin need no gradient here


@pytest.mark.parametrize("D", [2, 16, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("rounding", ["autograd", "fused"])
def test_rope_matches_truth_eager_and_compile(rounding, dtype, D):
    assert_ok(check_spelling(SP, inputs(2, 4, 64, D, dtype), compile_ref=True, rounding=rounding), WHATS)


def test_backward_is_the_rotation_by_minus_theta():
    q, cos, sin = inputs(1, 2, 5, 8, torch.float32)
    g = torch.randn_like(q)
    (dq,) = torch.autograd.grad(op_for(SP)(q, cos, sin), (q,), g)
    # rotating by -theta: cos -theta = cos, sin -theta = -sin
    h = q.shape[-1] // 2
    rot = lambda t: torch.cat((-t[..., h:], t[..., :h]), dim=-1)  # noqa: E731
    expected = g * cos + rot(g * -sin)
    torch.testing.assert_close(dq, expected, rtol=1e-6, atol=1e-6)
    bwd = source("rope").backward
    assert (
        "pcols = (cols + N // 2) % N" in bwd and "g__p" in bwd
    )  # derived: gradient read at the rotated column


def test_partial_rotary_matches_the_rotated_slice():
    class PartialRope(torch.nn.Module):
        def forward(self, q, cos, sin):
            rd = cos.shape[-1]
            q_rot, q_pass = q[..., :rd], q[..., rd:]
            h = rd // 2
            q_rot = q_rot * cos + torch.cat((-q_rot[..., h:], q_rot[..., :h]), dim=-1) * sin
            return torch.cat((q_rot, q_pass), dim=-1)

    q = torch.randn(2, 4, 8, 32, requires_grad=True)
    _, cos, sin = inputs(2, 4, 8, 16, torch.float32)
    m = PartialRope()
    rep = kernelgraft.explain(m, q, cos, sin)
    assert rep.counts() == {"rope": 1}
    ref = m(q, cos, sin)
    (gref,) = torch.autograd.grad(ref.square().sum(), q)
    kernelgraft.optimize(m, backend="eager")
    out = m(q, cos, sin)
    (g,) = torch.autograd.grad(out.square().sum(), q)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g, gref, rtol=1e-5, atol=1e-5)


@given(
    B=st.integers(1, 3),
    H=st.integers(1, 5),
    S=st.integers(1, 40),
    D=st.sampled_from([2, 4, 6, 64, 96]),
    dtype=st.sampled_from(DTYPES),
    transposed=st.booleans(),
    rounding=st.sampled_from(["autograd", "fused"]),
    seed=st.integers(0, 2**16),
)
def test_rope_property(B, H, S, D, dtype, transposed, rounding, seed):
    S = max(S, -(-64 // (B * H * D)))  # at least 64 elements: the rule compares error statistics
    args = inputs(B, H, S, D, dtype, seed, transposed)
    assert_ok(check_spelling(SP, args, compile_ref=False, seed=seed, rounding=rounding), WHATS)
