"""Canonicalize: an fx graph (a dynamo capture, or a traced pattern) -> a small DAG of canonical
ops, so that every spelling of the same math reads the same to the matcher. Calls of the math
primitives are looked up in the table (primitives.py); the structural ops (casts, views, halves,
concatenation, linear, cross_entropy) are lowered here; the rewrite rules (RULES) then bring each
node to one spelling (x*x and x.pow(2) -> square, 1/sqrt -> rsqrt, cat(-x2, x1) -> rotate_half).

The model's fx graph itself is never changed here: canonical nodes point back at the fx nodes they
cover, and only `replace` edits the graph. Rewrites that would change rounding for code that is not
replaced therefore cost nothing.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F

from .graph import CGraph, CNode, DtypeOf
from .primitives import PRIMITIVES

_CAST_METHODS = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
}
_TRANSPARENT_METHODS = frozenset({"contiguous"})


def _dtype_arg(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.dtype):
            return a
    if "dtype" in kwargs:
        return kwargs["dtype"]
    return None


def _as_dims(dim, rank):
    if dim is None:
        return None
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    if rank is None:
        return tuple(sorted(dims))
    return tuple(sorted(d - rank if d >= 0 else d for d in dims))


def _rank(node: CNode | Any):
    if isinstance(node, torch.Tensor):
        return node.dim()
    m = node.meta if isinstance(node, CNode) else None
    return m.dim() if m is not None else None


def _half_of(b, n, x: CNode, index) -> CNode | None:
    """x[..., :D/2] or x[..., D/2:] -> half(x, part). D/2 is `x.shape[-1] // 2` in a pattern and a
    number in a model graph, checked against the recorded last dim."""
    if not (
        isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)
    ):
        return None
    s = index[1]
    if s.step not in (None, 1):
        return None
    bound, part = (s.stop, 0) if s.start in (None, 0) else (s.start, 1)
    if isinstance(bound, torch.fx.Node):
        bound = b.of_fx.get(bound)
    if part == 1 and s.stop is not None:
        return None
    if isinstance(bound, CNode):
        ok = bound.op == "half_dim" and bound.args[0] is x
    else:
        meta = x.meta
        ok = isinstance(bound, int) and meta is not None and meta.shape[-1] == 2 * bound
    return b.new("half", (x,), (("part", part),), fx=n) if ok else None


class _Builder:
    def __init__(self):
        self.nodes: list[CNode] = []
        self.of_fx: dict = {}

    def arg(self, a):
        if isinstance(a, torch.fx.Node):
            return self.of_fx[a]
        if isinstance(a, (list, tuple)):
            return tuple(self.arg(x) for x in a)
        return a

    def new(self, op, args=(), attrs=(), fx=None) -> CNode:
        n = CNode(
            op,
            tuple(args),
            tuple(attrs),
            fx,
            [fx] if fx is not None else [],
            name=fx.name if fx is not None else op,
        )
        self.nodes.append(n)
        return n

    def alias(self, fx_node, target: CNode) -> CNode:
        """fx_node computes the same value as target (a no-op for the math): map it there."""
        target.cover.append(fx_node)
        self.of_fx[fx_node] = target
        return target


def _lower_fx_node(b: _Builder, n: torch.fx.Node) -> CNode:
    """One fx node -> one canonical node (before the rewrite rules run)."""
    if n.op == "placeholder":
        return b.new("input", attrs=(("name", n.target),), fx=n)
    if n.op not in ("call_function", "call_method"):
        return b.new(f"opaque:{n.op}:{n.target}", fx=n)
    target, args, kwargs = n.target, [b.arg(a) for a in n.args], {k: b.arg(v) for k, v in n.kwargs.items()}
    if target is getattr and len(args) == 2 and args[1] == "dtype":  # x.dtype in a traced pattern
        return b.new("dtype_of", (args[0],), fx=n)
    if target is getattr and len(args) == 2 and args[1] == "shape":  # x.shape in a traced pattern
        return b.new("shape_of", (args[0],), fx=n)
    if target is operator.getitem and isinstance(args[0], CNode):
        half = _half_of(b, n, args[0], args[1])
        if half is not None:
            return half
        if args[0].op == "shape_of" and args[1] == -1:
            return b.new("last_dim", (args[0].args[0],), fx=n)
        if args[0].op == "chunk2" and args[1] in (0, 1):
            return b.new("half", (args[0].args[0],), (("part", args[1]),), fx=n)
    if (
        target is operator.floordiv
        and isinstance(args[0], CNode)
        and args[0].op == "last_dim"
        and args[1] == 2
    ):
        return b.new("half_dim", (args[0].args[0],), fx=n)
    if target in (torch.cat, torch.concat) and len(args[0] if args else ()) == 2:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if dim == -1 or (dim is not None and _rank(n.meta.get("example_value")) == dim + 1):
            return b.new("cat2", tuple(args[0]), fx=n)
    if (
        target in (torch.chunk, "chunk")
        and len(args) >= 2
        and args[1] == 2
        and (args[2] if len(args) > 2 else kwargs.get("dim", 0)) == -1
    ):
        return b.new("chunk2", (args[0],), fx=n)
    if target in (F.linear, torch._C._nn.linear):
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if bias is None and len(args) >= 2:
            return b.new("linear", (args[0], args[1]), fx=n)
    if target is F.cross_entropy:
        return _cross_entropy(b, n, args, kwargs)
    if target in ("view", "reshape", torch.reshape) and len(args) >= 2:
        if _flatten_rows(n, args):
            return b.new("flatten_rows", (args[0],), fx=n)
    if n.op == "call_method" and target in _TRANSPARENT_METHODS:
        return b.alias(n, args[0])
    if n.op == "call_method" and target in _CAST_METHODS and not kwargs and len(args) == 1:
        return b.new("cast", (args[0], _CAST_METHODS[target]), fx=n)
    if n.op == "call_method" and target in ("to", "type"):
        dt = _dtype_arg(args[1:], kwargs)
        if dt is None:
            cand = args[1] if len(args) >= 2 else kwargs.get("dtype")
            if isinstance(cand, CNode):  # x.to(y.dtype) in a pattern, x.to(other_tensor) anywhere
                dt = DtypeOf(cand.args[0]) if cand.op == "dtype_of" else DtypeOf(cand)
        if dt is None:  # a device move: transparent when it stays on the device
            src, dst = args[0].meta if isinstance(args[0], CNode) else None, n.meta.get("example_value")
            if src is None or dst is None or src.device == dst.device:
                return b.alias(n, args[0])
            return b.new("opaque:to_device", tuple(args), fx=n)
        return b.new("cast", (args[0], dt), fx=n)
    if n.op == "call_method" and target == "type_as":
        return b.new("cast", (args[0], DtypeOf(args[1])), fx=n)
    prim = PRIMITIVES.of_target(target)
    if prim is None:
        name = getattr(target, "__name__", str(target))
        return b.new(f"opaque:{name}", tuple(args) + tuple(sorted(kwargs.items())), fx=n)
    return _lower_primitive(b, n, prim, args, kwargs)


def _lower_primitive(b: _Builder, n: torch.fx.Node, prim, args: list, kwargs: dict) -> CNode:
    """One use of a table primitive -> its canonical node, or an opaque one where the call's options
    change the math in a way the canonical form does not say (a reduction to a dtype, alpha != 1)."""
    op = prim.name
    for key, value, opaque in prim.requires:
        if kwargs.get(key, value) != value:
            return b.new(f"opaque:{opaque}", tuple(args), fx=n)
    if prim.kind == "reduction":
        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if kwargs.get("dtype") is not None or dim is None:
            return b.new(f"opaque:{op}", tuple(args), fx=n)
        return b.new(op, (x,), (("dims", _as_dims(dim, _rank(x))), ("keepdim", bool(keep))), fx=n)
    if prim.kind == "binary":
        other = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("exponent"))
        return b.new(op, (args[0], other), fx=n)
    # unary: the options that are part of the math (gelu's approximate) become attributes
    attrs = tuple(
        (key, args[1 + i] if len(args) > 1 + i else kwargs.get(key, default))
        for i, (key, default) in enumerate(prim.attrs)
    )
    rest = set(kwargs) - {k for k, _ in prim.attrs} - {"inplace"}
    if len(args) <= 1 + len(prim.attrs) and not rest and not kwargs.get("inplace"):
        return b.new(op, (args[0],), attrs, fx=n)
    return b.new(f"opaque:{op}", tuple(args) + tuple(sorted(kwargs.items())), fx=n)


_CE_PARAMS = (
    "input",
    "target",
    "weight",
    "size_average",
    "ignore_index",
    "reduce",
    "reduction",
    "label_smoothing",
)


def _cross_entropy(b, n, args, kwargs) -> CNode:
    """cross_entropy(input, target, ignore_index) with the reduction and the options that change
    the math (class weights, label smoothing, legacy size_average/reduce) as attributes."""
    bound = dict(zip(_CE_PARAMS, args))
    bound.update(kwargs)
    attrs = (
        ("reduction", bound.get("reduction", "mean")),
        ("weighted", bound.get("weight") is not None),
        ("label_smoothing", float(bound.get("label_smoothing", 0.0) or 0.0)),
        ("legacy", bound.get("size_average") is not None or bound.get("reduce") is not None),
    )
    ins = (bound.get("input"), bound.get("target"), bound.get("ignore_index", -100))
    return b.new("cross_entropy", ins, attrs, fx=n)


def _flatten_rows(n: torch.fx.Node, args) -> bool:
    """x.view(-1, D) / x.reshape(-1, D) where D is x's last dim: rows of the last dim, flattened."""
    x = args[0]
    shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    if len(shape) != 2 or shape[0] != -1 or not isinstance(x, CNode):
        return False
    if isinstance(shape[1], CNode):  # a traced pattern: x.shape[-1]
        return shape[1].op == "last_dim" and shape[1].args[0] is x
    src, out = x.meta, n.meta.get("example_value")
    if src is None or out is None or src.dim() < 1:
        return False
    return out.dim() == 2 and src.shape[-1] == out.shape[-1] == shape[1]


# ---- rewrite rules: canonical node -> an equivalent canonical spelling, or None ----------------
# Each rule is one line: when it fires, the node's op and args are replaced in place.


def _is(a, op):
    return isinstance(a, CNode) and a.op == op


def _num(a, *values):
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a in values


RULES: list[tuple[str, Any]] = [
    ("mul", lambda a, b: ("square", (a,)) if a is b else None),  # x*x -> x^2
    ("pow", lambda a, e: ("square", (a,)) if _num(e, 2) else None),  # x.pow(2) -> x^2
    ("pow", lambda a, e: ("sqrt", (a,)) if _num(e, 0.5) else None),  # x^0.5 -> sqrt
    ("pow", lambda a, e: ("rsqrt", (a,)) if _num(e, -0.5) else None),  # x^-0.5 -> rsqrt
    ("pow", lambda a, e: ("reciprocal", (a,)) if _num(e, -1) else None),  # x^-1 -> 1/x
    ("div", lambda a, b: ("reciprocal", (b,)) if _num(a, 1) else None),  # 1/x -> reciprocal
    ("reciprocal", lambda a: ("rsqrt", a.args) if _is(a, "sqrt") else None),  # 1/sqrt(x) -> rsqrt
    (
        "div",
        lambda a, b: ("mul", (a, _fresh("rsqrt", b.args, b))) if _is(b, "sqrt") else None,
    ),  # a/sqrt(v) -> a*rsqrt(v)
    (
        "cat2",
        lambda a, b: ("rotate_half", (b.args[0],)) if _rotates(a, b) else None,
    ),  # cat(-x2, x1) -> rotate_half(x)
]


def _rotates(a, b) -> bool:
    """cat((-x[..., D/2:], x[..., :D/2])): the two halves of one tensor, the second negated."""
    return (
        _is(a, "neg")
        and _is(a.args[0], "half")
        and a.args[0].attr("part") == 1
        and _is(b, "half")
        and b.attr("part") == 0
        and a.args[0].args[0] is b.args[0]
    )


_pending: list[CNode] = []


def _fresh(op, args, covering: CNode) -> CNode:
    """A canonical node created by a rule, standing for the fx node(s) of `covering`."""
    n = CNode(op, tuple(args), (), covering.fx, list(covering.cover), name=f"{covering.name}_{op}")
    _pending.append(n)
    return n


def _apply_rules(b: _Builder, n: CNode) -> None:
    changed = True
    while changed:
        changed = False
        for op, rule in RULES:
            if n.op != op:
                continue
            out = rule(*n.args)
            if out is not None:
                old = n.args
                n.op, n.args = out
                _absorb(n, old)
                for p in _pending:  # nodes a rule created go before the node that uses them
                    b.nodes.insert(b.nodes.index(n), p)
                _pending.clear()
                changed = True
                break


def _absorb(n: CNode, old_args) -> None:
    """Nodes a rewrite made unreachable from n (the halves and the negation of a rotate_half) are
    now part of what n stands for: replacing n must remove them too. If anything else reads them,
    the matcher sees their fx nodes used outside the site and refuses the match."""
    seen, stack = set(), [a for a in old_args if isinstance(a, CNode)]
    while stack:
        d = stack.pop()
        if id(d) in seen or d.op == "input" or any(d is a for a in n.args):
            continue
        seen.add(id(d))
        n.cover.extend(c for c in d.cover if c not in n.cover)
        stack.extend(d.inputs())


def _finish(b: _Builder, output) -> CGraph:
    live = b.nodes
    for n in live:
        n.users = []
    for n in live:
        for i in n.inputs():
            if n not in i.users:
                i.users.append(n)
    inputs = [n for n in live if n.op == "input"]
    return CGraph(live, inputs, output, b.of_fx)


def canonicalize(graph: torch.fx.Graph) -> CGraph:
    """Canonicalize a model graph (dynamo's torch-IR, with example values in node.meta)."""
    b = _Builder()
    for n in graph.nodes:
        if n.op == "output":
            continue
        if n in b.of_fx:
            continue
        c = _lower_fx_node(b, n)
        b.of_fx.setdefault(n, c)
        _apply_rules(b, c)
        _fold_dtypes(c)
    return _finish(b, None)


def _fold_dtypes(c: CNode) -> None:
    """In a model graph dtypes are known: `type_as(y)` / `.to(y)` become a literal dtype."""
    if c.op == "cast" and isinstance(c.args[1], DtypeOf) and c.args[1].node.meta is not None:
        c.args = (c.args[0], c.args[1].node.meta.dtype)


def canonicalize_pattern(spelling) -> CGraph:
    """Trace a pattern spelling with torch.fx and canonicalize it like a model graph."""
    try:
        gm = torch.fx.symbolic_trace(spelling.fn)
    except Exception as e:  # noqa: BLE001 - re-raised with what to do
        raise TypeError(
            f"kernelgraft.pattern({spelling.pattern!r}): could not trace {spelling.fn.__name__} with torch.fx "
            f"({e}). Write the pattern as straight-line PyTorch on its arguments."
        ) from e
    b = _Builder()
    out = None
    for n in gm.graph.nodes:
        if n.op == "output":
            res = n.args[0]
            if not isinstance(res, torch.fx.Node):
                raise TypeError(
                    f"kernelgraft.pattern({spelling.pattern!r}): the pattern must return one tensor"
                )
            out = b.of_fx[res]
            continue
        c = _lower_fx_node(b, n)
        if n.op == "placeholder":
            kind = "scalar" if n.target in spelling.scalar_names else "tensor"
            c.attrs = (("name", n.target), ("kind", kind))
        b.of_fx.setdefault(n, c)
        _apply_rules(b, c)
    for n in b.nodes:
        if n.op == "cast" and isinstance(n.args[1], CNode) and n.args[1].op == "dtype_of":
            n.args = (n.args[0], DtypeOf(n.args[1].args[0]))
        if n.op in PRIMITIVES.names("reduction") and any(d >= 0 for d in n.attr("dims")):
            raise TypeError(
                f"kernelgraft.pattern({spelling.pattern!r}): reduce over negative dims (dim=-1), "
                f"not {n.attr('dims')}: a pattern does not know the rank of the tensors it will meet"
            )
    b.nodes = [n for n in b.nodes if n.op != "dtype_of"]
    g = _finish(b, out)
    _prune_to_output(g)
    return g


def _prune_to_output(g: CGraph) -> None:
    keep, stack = set(), [g.output]
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        keep.add(n)
        stack.extend(n.inputs())
    keep |= set(g.inputs)
    g.nodes = [n for n in g.nodes if n in keep]
    for n in g.nodes:
        n.users = [u for u in n.users if u in keep]
