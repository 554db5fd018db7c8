"""A row split in two halves (chunk(2, -1), split, tensor_split, x[..., :h] / x[..., h:]) at odd and
even widths: an odd width splits in unequal halves (chunk: 8 and 7 of 15; slicing at h = 15 // 2:
7 and 8), which the kernels' rotation of two equal halves does not compute. Each spelling, drawn at
widths of either parity and optimized with both backends, gives the stock output and gradients; a
width the kernel does not serve runs the stock code and is reported as a fallback that names it,
never as a replaced site."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import kernelgraft
from kernelgraft import Scalar
from kernelgraft.gradcheck import judge
from kernelgraft.patterns import Registry


def _chunk(x):
    return x.chunk(2, -1)


def _split_half(x):  # the pattern's spelling: split at x.shape[-1] // 2 (two parts at even widths)
    return x.split(x.shape[-1] // 2, -1)


def _split_ceil(x):  # torch.chunk's own split size: two parts at every width (8 and 7 of 15)
    return x.split((x.shape[-1] + 1) // 2, -1)


def _split_sizes(x):  # two sizes that add up to the width (7 and 8 of 15)
    h = x.shape[-1] // 2
    return x.split([h, x.shape[-1] - h], -1)


def _tensor_split(x):
    return x.tensor_split(2, -1)


def _slices(x):
    h = x.shape[-1] // 2
    return x[..., :h], x[..., h:]


SPLITS = {
    "chunk": _chunk,
    "split": _split_half,
    "split_ceil": _split_ceil,
    "split_sizes": _split_sizes,
    "tensor_split": _tensor_split,
    "slices": _slices,
}

# (the pattern's spelling, the model's): a model spells the split as its pattern does, or, for
# split(h, -1) (three parts at odd widths, which the stock model cannot unpack), in the two ways
# that give two parts at every width
CASES = [
    ("chunk", "chunk"),
    ("split", "split_ceil"),
    ("split", "split_sizes"),
    ("tensor_split", "tensor_split"),
    ("slices", "slices"),
]


def swap_pattern(split: str, registry: Registry):
    halves = SPLITS[split]

    @kernelgraft.pattern("swap_halves", spelling=split, registry=registry)
    def swap_halves(x, w, eps: Scalar):
        a, b = halves(x)
        return torch.cat([-b, a], -1) * w + eps

    return swap_halves


class Swap(torch.nn.Module):
    def __init__(self, split: str, width: int, dtype: torch.dtype):
        super().__init__()
        self.halves = SPLITS[split]
        self.w = torch.nn.Parameter(torch.linspace(0.5, 2.0, width).to(dtype))

    def forward(self, x):
        a, b = self.halves(x)
        return torch.cat([-b, a], -1) * self.w + 0.25


def _run(model, x, g):
    x = x.detach().requires_grad_()
    out = model(x)
    gx, gw = torch.autograd.grad(out, (x, model.w), g)
    return out, gx, gw


def test_every_split_spelling_is_one_canonical_graph():
    reg = Registry()
    texts = {swap_pattern(s, reg).canonical().text() for s in ("chunk", "split", "tensor_split", "slices")}
    assert len(texts) == 1, texts
    assert "rotate_half" in texts.pop()


@pytest.mark.parametrize("pattern,spelled", CASES, ids=[f"{p}-{m}" for p, m in CASES])
@given(
    width=st.integers(2, 40),
    rows=st.integers(1, 6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    backend=st.sampled_from(["eager", "inductor"]),
    seed=st.integers(0, 2**16),
)
@example(width=15, rows=5, dtype=torch.float32, backend="eager", seed=0)
@example(width=15, rows=5, dtype=torch.float32, backend="inductor", seed=0)
@example(width=16, rows=5, dtype=torch.float32, backend="eager", seed=0)
@example(width=16, rows=5, dtype=torch.float32, backend="inductor", seed=0)
def test_halves_at_odd_and_even_widths(pattern, spelled, width, rows, dtype, backend, seed):
    reg = Registry()  # the test's pattern stays out of the global library
    swap_pattern(pattern, reg)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, width, generator=gen).to(dtype)
    g = torch.randn(rows, 3, width, generator=gen).to(dtype)
    stock = Swap(spelled, width, dtype)
    truth = _run(Swap(spelled, width, torch.float64), x.double(), g.double())
    eager = _run(stock, x, g)
    model = kernelgraft.optimize(Swap(spelled, width, dtype), backend=backend, patterns=reg)
    got = _run(model, x, g)
    # under inductor the kernel rounds as inductor's fused code: the rule's bound is the larger of
    # eager's and torch.compile's errors
    compiled = _run(torch.compile(Swap(spelled, width, dtype), backend="inductor"), x, g) if backend == "inductor" else None
    bad = [
        str(v)
        for v in (
            judge(what, t, k, e, c)
            for what, t, k, e, c in zip(("out", "grad x", "grad w"), truth, got, eager, compiled or (None,) * 3)
        )
        if not v.ok
    ]
    assert not bad, "\n".join(bad)

    rep = model.kernelgraft_report
    sites = [(s, "replaced") for s in rep.sites] + [(s, "fell back") for s in rep.fallbacks]
    assert [(s.pattern, s.spelling) for s, _ in sites] == [("swap_halves", pattern)], rep
    site, status = sites[0]
    if width % 2 == 0:
        assert status == "replaced", site.reason
    else:  # served only where it computes the stock halves: here, a fallback that says why
        assert status == "fell back" and f"{width} wide" in site.reason and "halves" in site.reason, site


class SwapOf(torch.nn.Module):
    """Swap with its weight an argument: with dynamic sizes, a width no parameter fixes."""

    def forward(self, x, w):
        a, b = x.chunk(2, -1)
        return torch.cat([-b, a], -1) * w + 0.25


@pytest.mark.parametrize("width", [15, 16])
def test_a_symbolic_width_runs_the_stock_code(width):
    """With dynamic sizes the width is a symbol when the graph is captured: the kernel cannot know
    that the halves will be equal, so the site runs the stock code and says why, at both parities."""
    reg = Registry()
    swap_pattern("chunk", reg)
    model = kernelgraft.optimize(SwapOf(), backend="eager", patterns=reg, dynamic=True)
    gen = torch.Generator().manual_seed(width)
    x, w, g = (torch.randn(*s, generator=gen) for s in ((4, width), (width,), (4, width)))
    for a, b in zip(_grads(model, x, w, g), _grads(SwapOf(), x, w, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    rep = model.kernelgraft_report
    assert not rep.sites and len(rep.fallbacks) == 1, rep
    assert "symbolic width" in rep.fallbacks[0].reason, rep.fallbacks[0].reason


def _grads(model, x, w, g):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = model(x, w)
    return (out, *torch.autograd.grad(out, (x, w), g))
