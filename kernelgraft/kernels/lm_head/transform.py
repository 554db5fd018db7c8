"""The LM head's logit transform, cut from the spelling: what lies between its `linear` and its
`cross_entropy` (a cast, Gemma-2's softcap, Granite's or Cohere's scale), made a spelling of its
own and given to the sympy generator, which returns its forward and its derivative with the
spelling's rounding points as Triton lines.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...ir import CGraph, CNode
from ...ir.sym import round_to
from .. import emit
from ..derive import derive
from ..family import Unsupported
from ..spec import LOW, build_spec


@dataclass
class Transform:
    scalars: list[str]  # spelling arguments it reads (cap, scale), in order
    fwd_lines: list[str]  # Triton lines computing y from v_x (and the scalars)
    fwd: str
    bwd_lines: list[str]  # Triton lines computing dx from v_x and g
    bwd: str
    out_dtype: torch.dtype  # what cross_entropy receives


class _TransformSpelling:
    """The slice of a spelling between its linear and its cross_entropy, as a spelling of its own."""

    def __init__(self, spelling, graph: CGraph, scalars: list[str]):
        self.pattern, self.name = spelling.pattern, f"{spelling.name}__logits"
        self.qualname = f"{spelling.qualname}.logits"
        self.arg_names = ("x", *scalars)
        self.scalar_names = frozenset(scalars)
        self.tensor_names = ("x",)
        self._graph = graph

    def canonical(self) -> CGraph:
        return self._graph


def parts(pg: CGraph) -> tuple[CNode, CNode]:
    """The spelling's linear and cross_entropy nodes."""
    lin = [n for n in pg.nodes if n.op == "linear"]
    ce = [n for n in pg.nodes if n.op == "cross_entropy"]
    if len(lin) != 1 or len(ce) != 1:
        raise TypeError("an lm_head_ce spelling has one F.linear and one F.cross_entropy")
    return lin[0], ce[0]


def transform_graph(spelling) -> tuple[CGraph, list[str]]:
    pg = spelling.canonical()
    lin, ce = parts(pg)
    made: dict = {}
    nodes: list[CNode] = []
    scalars: list[str] = []
    x = CNode("input", attrs=(("name", "x"), ("kind", "tensor")), name="x")
    nodes.append(x)

    def copy(n):
        if not isinstance(n, CNode):
            return n
        if n is lin:
            return x
        if n in made:
            return made[n]
        if n.op == "flatten_rows":  # a view: the transform is element-wise
            made[n] = copy(n.args[0])
            return made[n]
        if n.op == "input":
            if n.attr("kind") != "scalar":
                raise Unsupported(f"the logits are combined with the tensor `{n.attr('name')}`")
            c = CNode("input", attrs=n.attrs, name=n.name)
            scalars.append(n.attr("name"))
        else:
            c = CNode(n.op, tuple(copy(a) for a in n.args), n.attrs, name=n.name)
        made[n] = c
        nodes.append(c)
        return c

    out = copy(ce.args[0])
    return CGraph(nodes, [n for n in nodes if n.op == "input"], out, {}), scalars


@functools.cache
def transform(spelling, dtype: torch.dtype, rounding: str, device: str = "cpu") -> Transform:
    """The logit transform and its gradient. device: whose eager rounding the gradient reproduces
    where CPU and CUDA kernels differ (see rounds_as)."""
    graph, scalars = transform_graph(spelling)
    ts = _TransformSpelling(spelling, graph, scalars)
    spec = build_spec(ts, {"x": dtype}, {"x": "elem"}, rounding)
    if spec.reductions:
        raise Unsupported("the logit transform reduces along the vocabulary")
    bwd = derive(spec, device)
    y = round_to(spec.output, LOW.get(spec.out_dtype, "float32"))
    dx = round_to(bwd.grads["v_x"], LOW.get(dtype, "float32"))
    fl, (fe,) = emit.cse_lines([y], "f", "    ")
    bl, (be,) = emit.cse_lines([dx], "b", "            ")
    return Transform([f"v_{s}" for s in scalars], fl, fe, bl, be, spec.out_dtype)


