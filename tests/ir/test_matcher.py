"""The matcher: spellings that mean the same match; ones that round differently do not."""

import pytest
import torch

import kernelgraft


class Norm(torch.nn.Module):
    def __init__(self, body, n=32):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(n))
        self.body = body

    def forward(self, x):
        return self.body(self, x)


def llama_std(m, x):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return m.weight * h.to(x.dtype)


def swapped_and_squared(m, x):  # n*w instead of w*n, x*x instead of pow(2), .float(), eps 1e-5
    h = x.float()
    var = (h * h).mean(dim=-1, keepdim=True)
    return (h * torch.rsqrt(var + 1e-5)).to(x.dtype) * m.weight


def sqrt_division(m, x):  # h / sqrt(v + eps) and torch.mean(..., dim=2) on a 3-d input
    h = x.to(torch.float32)
    h = h / torch.sqrt(torch.mean(torch.square(h), dim=2, keepdim=True) + 1e-5)
    return m.weight * h.type_as(x)


def gemma_std(m, x):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (h * (1.0 + m.weight.float())).type_as(x)


def cast_after_weight(m, x):  # rounds once, after an fp32 weight multiply: OLMo-2's path
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (m.weight.float() * h).to(x.dtype)


def cast_to_other_dtype(m, x):  # Llama's shape, but rounds to fp16 whatever x is
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return m.weight * h.to(torch.float16)


def variance_reused(m, x):  # the variance also leaves the pattern: replacing would compute it twice
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    return m.weight * (h * torch.rsqrt(var + 1e-6)).to(x.dtype) + var


@pytest.mark.parametrize(
    "body,spelling,eps",
    [
        (llama_std, "llama", 1e-6),
        (swapped_and_squared, "llama", 1e-5),
        (sqrt_division, "llama", 1e-5),
        (gemma_std, "gemma", 1e-6),
    ],
)
def test_equivalent_spellings_match_and_capture_eps(body, spelling, eps):
    rep = kernelgraft.explain(Norm(body), torch.randn(2, 5, 32))
    assert rep.counts() == {"rms_norm": 1}, str(rep)
    (site,) = rep.sites
    assert site.spelling == spelling
    assert site.scalars == {"eps": eps}
    assert site.shapes["x"] == (2, 5, 32) and site.dtypes["x"] == "float32"


@pytest.mark.parametrize("body", [swapped_and_squared, sqrt_division, gemma_std])
def test_matched_spellings_give_the_stock_numbers(body):
    torch.manual_seed(0)
    m = Norm(body)
    x = torch.randn(3, 4, 32, requires_grad=True)
    ref = m(x)
    (gx_ref,) = torch.autograd.grad(ref.sum(), x)
    kernelgraft.optimize(m, backend="eager")
    out = m(x)
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert m.kernelgraft_report.counts() == {"rms_norm": 1}
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)


def test_each_cast_point_picks_its_own_spelling():
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    rep = kernelgraft.explain(Norm(cast_after_weight).to(torch.bfloat16), x)
    assert [s.spelling for s in rep.sites] == ["olmo2"]
    rep = kernelgraft.explain(Norm(llama_std).to(torch.bfloat16), x)
    assert [s.spelling for s in rep.sites] == ["llama"]


def test_wrong_cast_point_is_a_near_miss_naming_the_difference():
    rep = kernelgraft.explain(
        Norm(cast_to_other_dtype).to(torch.bfloat16), torch.randn(2, 32, dtype=torch.bfloat16)
    )
    assert rep.counts() == {}
    assert rep.near_misses, str(rep)
    nm = max(rep.near_misses, key=lambda m: m.matched)
    assert nm.pattern == "rms_norm" and nm.module == "<top>"
    assert nm.matched >= nm.total / 2
    assert "casts to the dtype of `x` (torch.bfloat16) but the model casts to torch.float16" in nm.reason
    assert "near misses" in str(rep)


def test_intermediate_used_elsewhere_is_refused_with_reason():
    rep = kernelgraft.explain(Norm(variance_reused), torch.randn(2, 32))
    assert rep.counts() == {}
    assert any("also used" in m.reason for m in rep.near_misses), str(rep)


def test_unservable_dtype_falls_back_reported():
    m = Norm(llama_std).double()
    x = torch.randn(2, 32, dtype=torch.float64, requires_grad=True)
    rep = kernelgraft.explain(m, x)
    assert rep.counts() == {} and len(rep.fallbacks) == 1
    assert "float64" in rep.fallbacks[0].reason
    ref = m(x)
    kernelgraft.optimize(m, backend="eager")
    torch.testing.assert_close(m(x), ref, rtol=0, atol=0)  # the stock subgraph ran
