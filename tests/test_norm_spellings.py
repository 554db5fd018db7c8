"""RMSNorm as hand-written code spells it: without a weight (an L2-style norm), and without the
float32 upcast (nanoGPT-style `x * rsqrt(mean(x^2) + eps) * w`), served in a model and by the rule."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kernelgraft
from kernelgraft.gradcheck import judge


class WeightlessNorm(nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype)


class NoCastNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, n=64):
        super().__init__()
        self.a, self.b = NoCastNorm(n), WeightlessNorm()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return self.b(self.lin(self.a(x))).sin().mean()  # not mean(square): a norm makes that constant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hand_written_norms_are_served_by_the_rule(dtype):
    torch.manual_seed(0)
    stock = Block().to(dtype)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    truth = copy.deepcopy(stock).double()
    # four batches, each quantity judged on all of them at once: the loss is one number per batch,
    # and one draw of its rounding is luck
    xs = [torch.randn(4, 24, 64).to(dtype) for _ in range(4)]
    runs = {"truth": [], "eager": [], "kg": []}
    for x in xs:
        for name, m, xin in (("truth", truth, x.double()), ("eager", stock, x), ("kg", mine, x)):
            xin = xin.clone().requires_grad_()
            loss = m(xin)
            loss.backward()
            runs[name].append([loss.detach(), xin.grad] + [p.grad.clone() for p in m.parameters()])
            m.zero_grad()
    joined = {
        k: [torch.cat([r[i].reshape(-1) for r in v]) for i in range(len(v[0]))] for k, v in runs.items()
    }
    rep = mine.kernelgraft_report
    served = sorted(s.spelling for s in rep.sites)
    if dtype == torch.float32:
        assert served == ["no_cast", "no_weight"], str(rep)
    else:  # no_cast rounds after every op in bf16: refused there, with why, and the stock code runs
        assert served == ["no_weight"], str(rep)
        (refused,) = rep.fallbacks
        assert refused.spelling == "no_cast" and "served in float32" in refused.reason
    bad = [
        str(v)
        for v in (
            judge(f"#{i}", t, k, e)
            for i, (t, e, k) in enumerate(zip(joined["truth"], joined["eager"], joined["kg"]))
        )
        if not v.ok
    ]
    assert not bad, bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torchs_rms_norm_without_a_weight_is_read_as_its_primitives(dtype):
    """nn.RMSNorm(elementwise_affine=False) (F.rms_norm) is x * rsqrt(mean(x^2) + eps) in float32,
    rounded once: served as rms_norm.no_weight, eps None being float32's epsilon (PyTorch computes
    bf16 in float32, and takes that dtype's epsilon). With a weight the
    rounding differs between PyTorch's CPU and CUDA kernels: it is left as stock code, and reported."""

    class TwoNorms(nn.Module):
        def __init__(self, n=64):
            super().__init__()
            self.plain, self.weighted = nn.RMSNorm(n, elementwise_affine=False), nn.RMSNorm(n, eps=1e-5)

        def forward(self, x):
            return (self.plain(x).sin() + self.weighted(x).cos()).mean()

    torch.manual_seed(0)
    stock = TwoNorms().to(dtype)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    truth = copy.deepcopy(stock).double()
    runs = {}
    x = torch.randn(4, 24, 64).to(dtype)
    for name, m, xin in (("truth", truth, x.double()), ("eager", stock, x), ("kg", mine, x)):
        xin = xin.clone().requires_grad_()
        m(xin).backward()
        runs[name] = xin.grad
    rep = mine.kernelgraft_report
    assert [(s.spelling, s.module, s.scalars["eps"]) for s in rep.sites] == [
        ("no_weight", "plain", torch.finfo(torch.float32).eps)
    ]
    assert [u.module for u in rep.unserved] == ["weighted"] and "rms_norm" in rep.unserved[0].reason
    v = judge("grad x", runs["truth"], runs["kg"], runs["eager"])
    assert v.ok, str(v)


class TwoNorms(nn.Module):
    """NanoChat's shape: a weightless norm whose output (cast back with type_as) the next norm
    upcasts again, while the residual stream reads it too."""

    def __init__(self, n=64):
        super().__init__()
        self.a, self.b = WeightlessNorm(), WeightlessNorm()
        self.lin = nn.Linear(n, n, bias=False)

    def forward(self, x):
        h = self.a(x)
        return (h + self.lin(self.b(h))).sin().sum()


def test_a_norm_read_again_by_the_next_norm_leaves_both_served():
    x = torch.randn(2, 5, 64)
    rep = kernelgraft.explain(TwoNorms(), x)
    assert [s.spelling for s in rep.sites] == ["no_weight", "no_weight"], str(rep)
