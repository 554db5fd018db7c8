"""LayerNorm (patterns/layer_norm.py). `F.layer_norm` / `nn.LayerNorm` is read as its primitives in
models and patterns alike, so a LayerNorm written either way matches a model written either way:
GPT-NeoX's nn.LayerNorm and Cohere's hand-written float32 LayerNorm are served, loss and every
gradient by the accuracy rule; a contributor's own three-line pattern, spelled in primitives or as
F.layer_norm, serves GPT-NeoX with no other change."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny import batch, compare_models, tiny_model

import kernelgraft
from kernelgraft import Scalar
from kernelgraft.patterns import Registry

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


def layer_norm_calls(model, b) -> int:
    """How many LayerNorm modules the model calls on batch b (hooks, eager): what kernelgraft should
    serve, counted from the model itself."""
    calls = []
    hooks = [
        m.register_forward_hook(lambda *a: calls.append(1))
        for m in model.modules()
        if type(m).__name__.endswith("LayerNorm")
    ]
    with torch.no_grad():
        model(**b)
    for h in hooks:
        h.remove()
    return len(calls)


def _judged(grafted, stock, b):
    # over four batches: a bias gradient (one sum over 24 tokens) is then a statistic of the
    # rounding, not one draw of it; against eager alone (stricter than max(eager, compile))
    verdicts = compare_models(grafted, stock, [batch(seed=1 + i) for i in range(4)], compiled=False)
    assert len(verdicts) == 1 + sum(1 for _ in stock.parameters())
    return [str(v) for v in verdicts if not v.ok]


@DTYPES
@pytest.mark.parametrize("arch", ["gpt_neox", "cohere", "olmo", "bloom"])
@pytest.mark.parametrize("capture", ["whole", "layers"])
def test_layer_norm_models_are_served_by_the_rule(capture, arch, dtype):
    # olmo: F.layer_norm(x.float(), ..., None, None, eps).to(x.dtype), no weight: the norm of a float32
    # copy ends in float32, and only the model's own cast brings it back (in bf16 it was missed).
    # bloom: its embedding norm's output is its first layer's norm's input, and the residual: in
    # float32 that norm's input is the first one's final cast, which changes nothing (it was missed,
    # and not reported). Captured per layer class, a final norm of the model's own class (OLMo's,
    # without weights) runs a compiled entry of its own
    stock = tiny_model(arch, dtype)
    b = batch()
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", capture=capture)
    bad = _judged(grafted, stock, b)
    assert not bad, "\n".join(bad)
    counts = grafted.kernelgraft_report.counts()
    assert counts["layer_norm"] == layer_norm_calls(stock, b) > 0, counts
    spellings = {s.spelling for s in grafted.kernelgraft_report.sites if s.pattern == "layer_norm"}
    assert (
        spellings
        == {"gpt_neox": {"affine"}, "cohere": {"weight_only"}, "olmo": {"plain"}, "bloom": {"affine"}}[arch]
    )


def _contributors_layer_norm(spelled: str, registry: Registry):
    if spelled == "primitives":

        @kernelgraft.pattern("my_layer_norm", registry=registry)
        def my_layer_norm(x, weight, bias, eps: Scalar):
            h = x.float()
            d = h - h.mean(-1, keepdim=True)
            return (
                d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps) * weight.float() + bias.float()
            ).to(x.dtype)

    else:

        @kernelgraft.pattern("my_layer_norm", registry=registry)
        def my_layer_norm(x, weight, bias, eps: Scalar):
            return F.layer_norm(x, x.shape[-1:], weight, bias, eps)

    return my_layer_norm


@DTYPES
@pytest.mark.parametrize("spelled", ["primitives", "F.layer_norm"])
def test_a_contributors_layer_norm_serves_gpt_neox(spelled, dtype):
    registry = Registry()
    sp = _contributors_layer_norm(spelled, registry)
    stock = tiny_model("gpt_neox", dtype)
    b = batch()
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", patterns=registry)
    bad = _judged(grafted, stock, b)
    assert not bad, "\n".join(bad)
    assert grafted.kernelgraft_report.counts() == {"my_layer_norm": layer_norm_calls(stock, b)}
    # both spellings are one canonical graph: the same kernel
    other = _contributors_layer_norm("F.layer_norm" if spelled == "primitives" else "primitives", Registry())
    assert sp.canonical().text() == other.canonical().text()


def test_a_norm_over_more_than_the_last_dim_stays_stock_code():
    class TwoDims(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm((4, 8))

        def forward(self, x):
            return self.norm(x).sum()

    rep = kernelgraft.explain(TwoDims(), torch.randn(3, 4, 8))
    assert "layer_norm" not in rep.counts()


def test_a_pattern_that_can_never_match_is_refused_where_it_is_written():
    with pytest.raises(TypeError, match=r"calls group_norm, which canonicalization does not read as math"):

        @kernelgraft.pattern("my_group_norm", registry=Registry())
        def my_group_norm(x, weight, bias, eps: Scalar):
            return F.group_norm(x, 4, weight, bias, eps)


def test_a_norm_nothing_resembles_is_reported_with_what_it_computes():
    class MaxNorm(torch.nn.Module):  # a norm no pattern spells: divided by the row's largest magnitude
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x / (x.abs().amax(-1, keepdim=True) + 1e-6) * self.weight

    class Block(torch.nn.Module):
        def __init__(self, n=32):
            super().__init__()
            self.norm, self.ln = MaxNorm(n), torch.nn.LayerNorm(n)

        def forward(self, x):
            return self.ln(self.norm(x)).sum()

    rep = kernelgraft.explain(Block(), torch.randn(2, 5, 32))
    assert rep.counts() == {"layer_norm": 1}
    (u,) = rep.unserved
    assert (u.module, u.cls, u.kind) == ("norm", "MaxNorm", "norm")
    assert "no norm pattern matched or came close; it computes" in u.reason and "amax" in u.reason
    assert "not served (1):" in str(rep) and "norm (MaxNorm, a norm)" in str(rep)


def test_a_composite_norm_left_unserved_is_reported_with_its_primitives():
    """F.layer_norm of a float32 copy used as float32 (no cast back, so no site ends where the
    patterns end): the report lists what the module computes, the composite's primitives included,
    not only the cast before it."""

    class Float32Norm(torch.nn.Module):
        def forward(self, x):
            return F.layer_norm(x.float(), (x.shape[-1],), None, None, 1e-5)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = Float32Norm()

        def forward(self, x):
            return self.norm(x).cos().mean()

    rep = kernelgraft.explain(Block(), torch.randn(2, 5, 32).bfloat16())
    assert "layer_norm" not in rep.counts(), str(rep)
    (u,) = rep.unserved
    assert (u.module, u.cls, u.kind) == ("norm", "Float32Norm", "norm")
    assert u.reason.endswith("it computes cast, mean, sub, square, add, rsqrt, mul"), u.reason


class HeadNorm(torch.nn.Module):
    """A norm over each head's columns written with var (xLSTM's multi-head norm), the weight over
    all heads applied after the heads are joined."""

    def __init__(self, heads=4, dim=8, unbiased=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(heads * dim))
        self.unbiased = unbiased

    def forward(self, x):  # x: (batch, positions, heads, dim)
        h = x.float()
        centered = h - h.mean(dim=-1, keepdim=True)
        y = centered * torch.rsqrt(h.var(dim=-1, keepdim=True, unbiased=self.unbiased) + 1e-6)
        return (y.to(x.dtype).reshape(*x.shape[:2], -1) * self.weight).sin().sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_norm_written_with_var_is_served_by_the_rule(dtype):
    """`x.var(unbiased=False)` of a float32 x reads as the mean of the squared deviations, and its
    deviations as the ones the model computed itself: the norm is LayerNorm with neither weight nor
    bias, served and by the rule. An unbiased var is another norm: left as it is."""
    from kernelgraft.gradcheck import judge

    torch.manual_seed(0)
    stock = HeadNorm().to(dtype)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    truth = copy.deepcopy(stock).double()
    x = torch.randn(2, 6, 4, 8).to(dtype)
    runs = {}
    for name, m in (("truth", truth), ("eager", stock), ("kg", mine)):
        xin = (x.double() if name == "truth" else x).clone().requires_grad_()
        loss = m(xin)
        loss.backward()
        runs[name] = (loss.detach(), xin.grad, m.weight.grad)
    assert [(s.pattern, s.spelling) for s in mine.kernelgraft_report.sites] == [("layer_norm", "plain")]
    for i, what in enumerate(("loss", "grad x", "grad weight")):
        v = judge(what, runs["truth"][i], runs["kg"][i], runs["eager"][i])
        assert v.ok, str(v)
    rep = kernelgraft.explain(HeadNorm(unbiased=True), torch.randn(2, 6, 4, 8))
    assert "layer_norm" not in rep.counts(), str(rep)
