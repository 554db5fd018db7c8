"""Complex multiplication of a row's pairs, as the canonicalizer reads it: Llama 4's and DeepSeek-V2's
rotary embedding,

    z = view_as_complex(x.reshape(..., D/2, 2));  view_as_real(z * f).flatten(-2)

is the pairs' rotation written with complex numbers: with a, b = x[..., 0::2], x[..., 1::2] and
c, s the real and imaginary parts of f (one angle per pair, half a row wide),

    interleave2(a * c - b * s, a * s + b * c)

which is how the product of two complex numbers is computed (in the complex dtype's real dtype,
each product rounded, then the sum). The intermediate complex values get canonical nodes of their
own (complex_pairs, complex_mul, complex_as_real) that only this module reads; the flatten that ends
the chain becomes the real ops above, covering the whole chain. The parts of f are values no fx node
computes: made where a site needs them, as `torch.real(f)` and `torch.imag(f)` (views of f).
"""

from __future__ import annotations

import operator

import torch

from .graph import CNode
from .indexing import VIEWS

_COMPLEX = (torch.complex64, torch.complex128)


def _is_complex(c) -> bool:
    return isinstance(c, CNode) and isinstance(c.meta, torch.Tensor) and c.meta.dtype in _COMPLEX


def _split_pairs_source(b, view: torch.fx.Node) -> CNode | None:
    """view is x.reshape(..., D/2, 2) (x.view, x.unflatten(-1, (-1, 2))) of a real x of shape
    (..., D): -> x's canonical node."""
    if not isinstance(view, torch.fx.Node) or not view.args or not isinstance(view.args[0], torch.fx.Node):
        return None
    if view.target not in VIEWS and view.target not in ("unflatten", torch.unflatten):
        return None
    x = b.of_fx.get(view.args[0])
    out = view.meta.get("example_value")
    if not isinstance(x, CNode) or not isinstance(x.meta, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    src = tuple(x.meta.shape)
    if not src or src[-1] % 2 or tuple(out.shape) != (*src[:-1], src[-1] // 2, 2):
        return None
    return x


def _part(f: CNode, part: str) -> CNode:
    """The real or imaginary part of the complex value f, as a value made where a site reads it."""
    fn = torch.real if part == "real" else torch.imag

    def make(graph, fx_of, f=f, fn=fn):
        return graph.call_function(fn, (fx_of(f),))

    return CNode(f"complex_{part}", (f,), (), None, [], name=f"{f.name}_{part}", value=fn(f.meta), make=make)


def lower_complex(b, n: torch.fx.Node, target, args: list) -> CNode | None:
    """One fx node of the chain above -> its canonical node; None for anything else."""
    if target is torch.view_as_complex and len(args) == 1:
        x = _split_pairs_source(b, n.args[0])
        if x is None:
            return None
        node = b.new("complex_pairs", (x,), fx=n)
        node.cover.append(n.args[0])  # the reshape into pairs is part of what it stands for
        return node
    if target in (operator.mul, torch.mul, "mul") and len(args) == 2:
        z, f = args if isinstance(args[0], CNode) and args[0].op == "complex_pairs" else args[::-1]
        if isinstance(z, CNode) and z.op == "complex_pairs" and _is_complex(f):
            return b.new("complex_mul", (z, f), fx=n)
        return None
    if target is torch.view_as_real and len(args) == 1:
        if isinstance(args[0], CNode) and args[0].op == "complex_mul":
            return b.new("complex_as_real", (args[0],), fx=n)
        return None
    if target in ("flatten", torch.flatten) and args and isinstance(args[0], CNode):
        real = args[0]
        if real.op != "complex_as_real" or not isinstance(real.meta, torch.Tensor):
            return None
        rank = real.meta.dim()
        start = args[1] if len(args) > 1 else 0
        end = args[2] if len(args) > 2 else -1
        if start not in (-2, rank - 2) or end not in (-1, rank - 1):
            return None
        return _rotation(b, n, real)
    return None


def _rotation(b, n: torch.fx.Node, real: CNode) -> CNode:
    """flatten(view_as_real(view_as_complex(pairs of x) * f)) -> the real ops of the product."""
    mul = real.args[0]
    pairs, f = mul.args
    x = pairs.args[0]
    xm = x.meta
    a = CNode("pairs", (x,), (("part", 0),), None, [], name=f"{x.name}_even", value=xm[..., 0::2])
    bb = CNode("pairs", (x,), (("part", 1),), None, [], name=f"{x.name}_odd", value=xm[..., 1::2])
    c, s = _part(f, "real"), _part(f, "imag")
    made = [a, bb, c, s]

    def op(name, u, v):
        value = None
        if isinstance(u.meta, torch.Tensor) and isinstance(v.meta, torch.Tensor):
            value = {"mul": torch.mul, "sub": torch.sub, "add": torch.add}[name](u.meta, v.meta)
        node = CNode(name, (u, v), (), None, [], name=f"{n.name}_{name}{len(made)}", value=value)
        made.append(node)
        return node

    re = op("sub", op("mul", a, c), op("mul", bb, s))
    im = op("add", op("mul", a, s), op("mul", bb, c))
    b.nodes.extend(made)
    out = b.new("interleave2", (re, im), fx=n)
    for covered in (real, mul, pairs):
        out.cover.extend(fx for fx in covered.cover if fx not in out.cover)
    return out
