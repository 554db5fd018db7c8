"""RoPE as other decoders spell it, each served by the spelling that says so and by the rule in a
model: the rotation the other way (`cat(x2, -x1)`), the interleaved pairs viewed back with
`reshape_as`, the product computed in float32 with q upcast first or the rotated q upcast."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kernelgraft
from kernelgraft.gradcheck import judge

D = 16


def _back(x):  # the rotation the other way: cat(x2, -x1)
    return torch.cat((x[..., D // 2 :], -x[..., : D // 2]), dim=-1)


def _pairs_reshape_as(x):  # the interleaved rotation, viewed back as x
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape_as(x)


def _half(x):
    return torch.cat((-x[..., D // 2 :], x[..., : D // 2]), dim=-1)


def _pairs(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


SPELLINGS = {  # how: (rope(q, cos, sin), the spelling that serves it, cos/sin in float32)
    "rotation the other way": (lambda q, c, s: q * c + _back(q) * s, "rotate_half_back", False),
    "pairs, reshape_as": (lambda q, c, s: q * c + _pairs_reshape_as(q) * s, "interleaved", False),
    "q upcast, then rotated": (
        lambda q, c, s: (q.float() * c + _half(q.float()) * s).to(q.dtype),
        "rotate_half_float32",
        False,
    ),
    "rotated, then upcast": (
        lambda q, c, s: (q.float() * c + _pairs(q).float() * s).to(q.dtype),
        "interleaved_float32",
        True,
    ),
    "pairs written in halves": (  # DeepSeek-V3's MLA: one angle per pair, the results de-interleaved
        lambda q, c, s: torch.cat(
            (q[..., 0::2] * c - q[..., 1::2] * s, q[..., 1::2] * c + q[..., 0::2] * s), -1
        ),
        "pairs_in_halves",
        False,
    ),
    "halves, chunked": (  # GPT-OSS: rotate-half written out over chunk(x, 2, -1), half-width angles
        lambda q, c, s: torch.cat(
            (q.chunk(2, -1)[0] * c - q.chunk(2, -1)[1] * s, q.chunk(2, -1)[1] * c + q.chunk(2, -1)[0] * s), -1
        ),
        "halves",
        False,
    ),
    "complex product": (  # Llama 4, DeepSeek-V2: the pairs as complex numbers times cos + i sin
        lambda q, c, s: torch.view_as_real(
            torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2)) * torch.complex(c, s)
        )
        .flatten(-2)
        .to(q.dtype),
        "complex",
        True,
    ),
}


class Rotary(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.rope, _, self.fp32 = SPELLINGS[how]
        self.proj = nn.Linear(32, 4 * D, bias=False)
        self.pairs = "pairs" in how or "rotated, then" in how
        self.halves = "halves" in how or "complex" in how

    def forward(self, x, angles):
        B, S, _ = x.shape
        q = self.proj(x).view(B, S, 4, D).transpose(1, 2)
        if self.halves:
            ang = angles
        else:
            ang = angles.repeat_interleave(2, -1) if self.pairs else angles.repeat(1, 2)
        dt = torch.float32 if self.fp32 else x.dtype
        cos, sin = ang.cos().to(dt)[None, None], ang.sin().to(dt)[None, None]
        return self.rope(q, cos, sin).sin().sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("how", list(SPELLINGS))
def test_each_rope_spelling_is_served_by_the_rule(how, dtype):
    torch.manual_seed(0)
    stock = Rotary(how).to(dtype)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    truth = copy.deepcopy(stock).double()
    runs = {"truth": [], "eager": [], "kg": []}
    for seed in range(4):  # each quantity judged over four batches: one draw of rounding is luck
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, 6, 32, generator=g).to(dtype)
        angles = torch.randn(6, D // 2, generator=g)
        for name, m in (("truth", truth), ("eager", stock), ("kg", mine)):
            xin = (x.double() if name == "truth" else x).clone().requires_grad_()
            loss = m(xin, angles.double() if name == "truth" else angles)
            loss.backward()
            runs[name].append([loss.detach(), xin.grad, m.proj.weight.grad.clone()])
            m.zero_grad()
    rep = mine.kernelgraft_report
    assert [(s.pattern, s.spelling) for s in rep.sites] == [("rope", SPELLINGS[how][1])], str(rep)
    joined = {k: [torch.cat([r[i].reshape(-1) for r in v]) for i in range(3)] for k, v in runs.items()}
    verdicts = [
        judge(what, t, k, e)
        for what, t, e, k in zip(
            ("loss", "grad x", "grad proj"), joined["truth"], joined["eager"], joined["kg"]
        )
    ]
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]


def apply_rotary_pos_emb(q, cos, sin):  # a rotary helper in a served spelling
    return q * cos + _half(q) * sin


def apply_rotary_emb(q, cos, sin):  # a running sum, not a rotation: nothing resembles it
    return torch.cumsum(q, -1) * cos


def mix_columns(q, cos, sin):  # the same math under a name that does not say rotary
    return torch.cumsum(q, -1) * cos


class Attn(nn.Module):
    def __init__(self, helper):
        super().__init__()
        self.helper = helper
        self.proj = nn.Linear(32, 4 * D, bias=False)

    def forward(self, x, angles):
        B, S, _ = x.shape
        q = self.proj(x).view(B, S, 4, D).transpose(1, 2)
        ang = torch.cat((angles, angles), dim=-1).unsqueeze(1)
        return self.helper(q, ang.cos(), ang.sin()).sum()


class Block(nn.Module):
    def __init__(self, helper):
        super().__init__()
        self.attn = Attn(helper)

    def forward(self, x, angles):
        return self.attn(x, angles)


@pytest.mark.parametrize("helper", [apply_rotary_pos_emb, apply_rotary_emb, mix_columns])
def test_a_rotary_helper_left_unserved_is_reported_with_what_it_computes(helper):
    """A rotary helper is a function, not a module: one whose name says rotary and in which no rope
    site was served, refused or came close is reported under the module that calls it, with the
    ops it computes; a served one is not reported, nor a function whose name does not say rotary."""
    torch.manual_seed(0)
    rep = kernelgraft.explain(Block(helper), torch.randn(2, 6, 32), torch.randn(2, 6, D // 2))
    rotary = [u for u in rep.unserved if u.kind == "rope"]
    if helper is apply_rotary_pos_emb:
        assert rep.counts().get("rope") == 1 and not rotary, str(rep)
    elif helper is mix_columns:
        assert not rep.counts().get("rope") and not rotary, str(rep)
    else:
        assert not rep.counts().get("rope"), str(rep)
        (u,) = rotary
        assert (u.module, u.cls) == ("attn", "apply_rotary_emb"), str(rep)
        assert "no rope pattern matched" in u.reason and "cumsum" in u.reason, u.reason
        assert str(u).startswith("attn (apply_rotary_emb, a rotary helper): "), str(u)
