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


def _off_the_rule(stock, mine, batches) -> list[str]:
    """The loss, every input's and every parameter's gradient of `mine` against float64 truth
    beside `stock` (eager), each quantity judged on all batches at once (a loss is one number per
    batch, and one draw of its rounding is luck) -> the verdicts that fail."""
    truth = copy.deepcopy(stock).double()
    runs = {"truth": [], "eager": [], "kg": []}
    for xs in batches:
        for name, m in (("truth", truth), ("eager", stock), ("kg", mine)):
            xin = [(x.double() if name == "truth" else x).clone().requires_grad_() for x in xs]
            loss = m(*xin)
            loss.backward()
            runs[name].append([loss.detach(), *(x.grad for x in xin)] + [p.grad.clone() for p in m.parameters()])
            m.zero_grad()
    joined = {
        k: [torch.cat([r[i].reshape(-1) for r in v]) for i in range(len(v[0]))] for k, v in runs.items()
    }
    verdicts = (
        judge(f"#{i}", t, k, e) for i, (t, e, k) in enumerate(zip(joined["truth"], joined["eager"], joined["kg"]))
    )
    return [str(v) for v in verdicts if not v.ok]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hand_written_norms_are_served_by_the_rule(dtype):
    torch.manual_seed(0)
    stock = Block().to(dtype)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    bad = _off_the_rule(stock, mine, [(torch.randn(4, 24, 64).to(dtype),) for _ in range(4)])
    rep = mine.kernelgraft_report
    served = sorted(s.spelling for s in rep.sites)
    if dtype == torch.float32:
        assert served == ["no_cast", "no_weight"], str(rep)
    else:  # no_cast rounds after every op in bf16: refused there, with why, and the stock code runs
        assert served == ["no_weight"], str(rep)
        (refused,) = rep.fallbacks
        assert refused.spelling == "no_cast" and "served in float32" in refused.reason
    assert not bad, bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torchs_rms_norm_without_a_weight_is_read_as_its_primitives(dtype):
    """nn.RMSNorm(elementwise_affine=False) (F.rms_norm) is x * rsqrt(mean(x^2) + eps) in float32,
    rounded once: served as rms_norm.no_weight, eps None being float32's epsilon (PyTorch computes
    bf16 in float32, and takes that dtype's epsilon). With a weight in bf16 the rounding differs
    between PyTorch's CPU and CUDA kernels: it is left as stock code, and reported; in float32 it
    rounds nowhere else, and is served as the weight applied in float32 (rms_norm.olmo2)."""

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
    sites = sorted((s.spelling, s.module, s.scalars["eps"]) for s in rep.sites)
    plain = ("no_weight", "plain", torch.finfo(torch.float32).eps)
    if dtype == torch.float32:
        assert sites == [plain, ("olmo2", "weighted", 1e-5)] and not rep.unserved, str(rep)
    else:
        assert sites == [plain]
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


class GatedBlock(nn.Module):
    """Mamba-2's mixer output: y gated by silu(z) and normalized over groups of the row
    (transformers' gated norm of Mamba-2, named Mamba2RMSNormGated since 5.25, MambaRMSNormGated
    before), between two projections."""

    def __init__(self, n=64, group_size=64):
        from transformers.models.mamba2 import modeling_mamba2

        super().__init__()
        self.inp = nn.Linear(n, 2 * n, bias=False)
        gated = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
        self.norm = gated(n, group_size, eps=1e-5)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.1 * torch.randn(n))
        self.out = nn.Linear(n, n, bias=False)

    def forward(self, x):
        y, z = self.inp(x).chunk(2, dim=-1)
        return self.out(self.norm(y, z)).sin().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mamba2s_gated_norm_over_one_group_is_served_by_the_rule(dtype):
    """One group per row: the model's view to (..., 1, n) and back only adds a size-1 dim, which
    canonicalization reads through; the whole gated norm is one rms_norm.gated site (not the
    gated product alone, which gated_mlp.silu would take)."""
    torch.manual_seed(0)
    stock = GatedBlock().to(dtype)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    bad = _off_the_rule(stock, mine, [(torch.randn(4, 24, 64).to(dtype),) for _ in range(4)])
    rep = mine.kernelgraft_report
    assert [(s.pattern, s.spelling, s.module) for s in rep.sites] == [("rms_norm", "gated", "norm")], str(rep)
    assert not bad, bad


def test_a_gated_norm_over_several_groups_keeps_its_stock_norm():
    """Four groups of 16 per row: each group has its own mean, which the row kernel does not
    compute. The norm stays stock code (its gated product may be grafted), with the same values."""
    torch.manual_seed(0)
    stock = GatedBlock(group_size=16)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    x = torch.randn(4, 24, 64)
    assert torch.allclose(mine(x), stock(x), rtol=1e-6, atol=1e-7)
    rep = mine.kernelgraft_report
    assert not [s for s in rep.sites if s.pattern == "rms_norm"], str(rep)
    # reported, though a site of another pattern (the gated product) was served inside the module
    (u,) = rep.unserved
    assert (u.module, u.cls, u.kind) == ("norm", type(stock.norm).__name__, "norm"), str(rep)
    assert "no norm pattern matched or came close (served inside it: gated_mlp.silu)" in u.reason, u.reason
    assert "mean" in u.reason and "rsqrt" in u.reason


class OverTheUnitDim(nn.Module):
    """A size-1 dim added before the last, then a mean over that dim (not over the row): the ops
    of a LayerNorm without weight, other math (the mean is h itself, the output 0). Dim 2 of the
    view is x's last dim: were the view read through, the mean would be taken over the row."""

    def forward(self, x):
        h = x.float().view(*x.shape[:-1], 1, x.shape[-1])
        c = h - h.mean(2, keepdim=True)
        y = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5)
        return (y.view(x.shape).to(x.dtype) + x).sin().sum()


def test_a_size_1_view_stays_a_view_where_an_op_reads_another_dim():
    x = torch.randn(4, 8, 64)
    mine = kernelgraft.optimize(OverTheUnitDim(), backend="eager")
    assert torch.allclose(mine(x), OverTheUnitDim()(x), rtol=1e-6)
    assert not mine.kernelgraft_report.sites, str(mine.kernelgraft_report)


def test_a_module_named_for_a_norm_it_holds_is_not_reported_as_a_norm():
    """RoBERTa-PreLayerNorm's attention, layer and output classes carry "Norm" in their names without
    being norms: only a name that ends in "Norm" (or "Norm" and a qualifier: MambaRMSNormGated,
    NemotronLayerNorm1P) is taken for a norm module, and a norm that is not served is still reported."""

    class PreLayerNormSelfAttention(nn.Module):
        def __init__(self, n=32):
            super().__init__()
            self.proj = nn.Linear(n, n)

        def forward(self, x):
            return self.proj(x).softmax(-1)

    class OddNorm1P(nn.Module):  # a norm nothing serves: x / max|x|
        def forward(self, x):
            return x / x.abs().amax(-1, keepdim=True)

    class Block(nn.Module):
        def __init__(self, n=32):
            super().__init__()
            self.attn, self.norm = PreLayerNormSelfAttention(n), OddNorm1P()

        def forward(self, x):
            return self.norm(self.attn(x)).sum()

    rep = kernelgraft.explain(Block(), torch.randn(2, 5, 32))
    assert [(u.module, u.kind, u.cls) for u in rep.unserved] == [("norm", "norm", "OddNorm1P")], str(rep)


class L2Scaled(nn.Module):
    """Zaya's q/k norm: x scaled to the norm `scale`, its own 2-norm clamped below at eps."""

    def __init__(self, how: str, eps=1e-6):
        super().__init__()
        self.how, self.eps = how, eps

    def forward(self, x):
        if self.how == "method":
            n = x.norm(p=2, dim=-1, keepdim=True)
        else:
            n = torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True)
        return x * (4.0 / n.clamp_min(self.eps))


@pytest.mark.parametrize("how", ["method", "linalg"])
def test_an_l2_norm_clamped_below_is_served_in_float32_and_reported_in_bf16(how):
    """x.norm(p=2, dim=-1, keepdim=True) and torch.linalg.vector_norm read as sqrt of the row's sum
    of squares: served as rms_norm.l2_scaled in float32, by the rule; in bf16 it is refused, and says
    why."""
    torch.manual_seed(0)
    x = torch.randn(4, 24, 64)
    stock = L2Scaled(how)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    g = torch.randn(4, 24, 64)
    runs = {}
    for name, m, xin in (("truth", stock, x.double()), ("eager", stock, x), ("kg", mine, x)):
        xin = xin.clone().requires_grad_()
        out = m(xin)
        out.backward(g.to(out.dtype))
        runs[name] = (out.detach(), xin.grad)
    rep = mine.kernelgraft_report
    assert [(s.spelling, s.scalars) for s in rep.sites] == [("l2_scaled", {"scale": 4.0, "eps": 1e-6})], str(rep)
    for i, what in enumerate(("out", "grad x")):
        v = judge(what, runs["truth"][i], runs["kg"][i], runs["eager"][i])
        assert v.ok, str(v)
    low = kernelgraft.explain(L2Scaled(how), x.bfloat16())
    assert not low.sites and "float32" in low.fallbacks[0].reason, str(low)


def test_a_clamped_norm_at_its_bound_passes_the_gradient_as_autograd_does():
    """clamp_min's gradient passes where x >= min, a tie included: a row whose norm is exactly eps
    (0.5 = ||(0.5, 0, ...)||) gets the gradient through the norm, bitwise as eager's float32."""
    x = torch.zeros(2, 8)
    x[:, 0] = 0.5
    x[1, 1] = 0.25  # a row above its bound, beside the tie
    g = torch.arange(16, dtype=torch.float32).view(2, 8) / 7 - 1
    stock = L2Scaled("method", eps=0.5)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    got = {}
    for name, m in (("eager", stock), ("kg", mine)):
        xin = x.clone().requires_grad_()
        m(xin).backward(g)
        got[name] = xin.grad
    assert mine.kernelgraft_report.counts() == {"rms_norm": 1}
    # at the tie the gradient through the norm cancels the direct one in x's own direction: 0 at
    # column 0; were the tie not passed, 8 g there
    assert got["eager"][0, 0] == 0 and 8 * g[0, 0] != 0
    assert torch.equal(got["kg"][0], got["eager"][0]), (got["kg"][0], got["eager"][0])
    assert torch.allclose(got["kg"], got["eager"], rtol=1e-6, atol=0), (got["kg"], got["eager"])


def test_a_norm_of_a_value_the_model_made_float32_is_served_in_bf16():
    """A bf16 model that casts a value up itself and normalizes it in float32 (Inkling 2's block
    residual: cat, .float(), then a weightless norm whose own .float() and .to(input dtype) are
    casts to the dtype the value has): the pattern's `x.float()` meets the model's cast as that
    cast's value (a cast of a cast to the same dtype is one cast), so no_weight serves it, in
    float32 with nothing rounded back, by the rule."""

    class StackedNorm(nn.Module):
        def forward(self, a, b):
            s = torch.cat([a, b.unsqueeze(-2)], dim=-2).float()
            h = s.float()
            h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6)
            return h.to(s.dtype).sin().mean()

    torch.manual_seed(0)
    stock = StackedNorm()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    batches = [(torch.randn(2, 5, 3, 64).bfloat16(), torch.randn(2, 5, 64).bfloat16()) for _ in range(4)]
    bad = _off_the_rule(stock, mine, batches)
    served = [(s.pattern, s.spelling) for s in mine.kernelgraft_report.sites]
    assert served == [("rms_norm", "no_weight")], str(mine.kernelgraft_report)
    assert not bad, bad
