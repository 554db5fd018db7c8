"""The canonical IR: the small DAG that canonicalize produces and that the matcher, the replacer
and the kernel generator all read. It sits apart from both so that data flows one way:
rewriter/ builds it, kernels/ consumes it, neither imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DtypeOf:
    """'the dtype of that tensor' in a pattern (`x.dtype`), resolved against the model at match time."""

    node: CNode


@dataclass(eq=False)
class CNode:
    op: str  # canonical op, 'input' for a graph input, 'opaque:<target>' for anything else
    args: tuple = ()  # CNode | number | torch.dtype | DtypeOf | None | tuple
    attrs: tuple = ()  # hashable extras: (('dims', (-1,)), ('keepdim', True))
    fx: torch.fx.Node | None = None
    cover: list = field(default_factory=list)  # fx nodes this canonical node stands for
    users: list = field(default_factory=list)
    name: str = ""
    # a value no fx node computes yet, made by a rewrite rule (the rows of h a sliced LM head reads):
    # its example value, and make(graph, fx_of) -> the fx node computing it, inserted where the graph
    # inserts now (fx_of: a canonical node -> the fx node that holds its value)
    value: torch.Tensor | None = None
    make: object = None
    # the fx node of the composite op whose primitive this is (F.layer_norm's mean, rsqrt...): where
    # the model called it, for the report of what a module computes
    origin: torch.fx.Node | None = None

    @property
    def meta(self):
        """The example value dynamo recorded (a fake tensor), or None in a traced pattern."""
        if self.fx is None:
            return self.value
        v = self.fx.meta.get("example_value", self.fx.meta.get("val"))
        return v if isinstance(v, torch.Tensor) else None

    def attr(self, key, default=None):
        return dict(self.attrs).get(key, default)

    def inputs(self):
        for a in self.args:
            if isinstance(a, CNode):
                yield a
            elif isinstance(a, DtypeOf):
                yield a.node

    def __repr__(self) -> str:
        return f"%{self.name}"


@dataclass
class CGraph:
    nodes: list[CNode]
    inputs: list[CNode]
    output: CNode | None
    of_fx: dict  # fx.Node -> CNode

    def text(self) -> str:
        """A stable printout; equal text means equal canonical graphs (used as a hash key)."""
        ids = {n: i for i, n in enumerate(self.nodes)}

        def fmt(a):
            if isinstance(a, CNode):
                return f"%{ids[a]}"
            if isinstance(a, DtypeOf):
                return f"dtype(%{ids[a.node]})"
            return repr(a)

        lines = [
            f"%{ids[n]} = {n.op}({', '.join(fmt(a) for a in n.args)}){dict(n.attrs) or ''}"
            for n in self.nodes
        ]
        lines.append(f"return %{ids[self.output]}" if self.output is not None else "return")
        return "\n".join(lines)
