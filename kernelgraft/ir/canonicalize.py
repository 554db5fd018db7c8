"""Canonicalize: an fx graph (a dynamo capture, or a traced pattern) -> a small DAG of canonical
ops, so that every spelling of the same math reads the same to the matcher. Calls of the math
primitives are looked up in the table (primitives.py); the structural ops (casts, views, halves,
concatenation, linear, cross_entropy) are lowered here; the rewrite rules (rules.py) then bring each
node to one spelling (x*x and x.pow(2) -> square, 1/sqrt -> rsqrt, cat(-x2, x1) -> rotate_half).
A row split in two (slices, chunk, split, tensor_split) is two `half` nodes (ir/indexing.py).
Views: one to the same shape is dropped; one that merges the leading dims and keeps the last
(view(-1, V), reshape, flatten(0, 1), sizes) is one node, flatten_rows, however spelled; `.contiguous()`
is dropped (the values are the same); a slice of the leading dims is row_slice.

The model's fx graph itself is never changed here: canonical nodes point back at the fx nodes they
cover, and only `replace` edits the graph. Rewrites that would change rounding for code that is not
replaced therefore cost nothing.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F

from .complex import lower_complex
from .decompose import (
    CLAMPS,
    LAYER_NORMS,
    RMS_NORMS,
    VECTOR_NORMS,
    clamp,
    layer_norm,
    rms_norm,
    variance,
    vector_norm,
)
from .graph import CGraph, CNode, DtypeOf
from .indexing import VIEWS, half_of, pairs_of, row_index, split_in_two, units_read_by_rows, view_kind
from .primitives import PRIMITIVES
from .rules import apply_rules

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
        half = half_of(b, n, args[0], args[1])
        if half is not None:
            return half
        pairs = pairs_of(b, n, args[0], args[1])
        if pairs is not None:
            return pairs
        if args[0].op == "shape_of" and args[1] == -1:
            return b.new("last_dim", (args[0].args[0],), fx=n)
        if args[0].op == "shape_of" and args[1] == slice(-1, None, None):  # x.shape[-1:]
            return b.new("last_shape", (args[0].args[0],), fx=n)
        if args[0].op == "chunk2" and args[1] in (0, 1):  # an odd width's halves keep its `first`
            return b.new("half", (args[0].args[0],), (("part", args[1]), *args[0].attrs), fx=n)
        rows = row_index(args[0], args[1])
        if rows is not None:
            return b.new("row_slice", (args[0],), (("index", rows),), fx=n)
    if (
        target is operator.floordiv
        and isinstance(args[0], CNode)
        and args[0].op == "last_dim"
        and args[1] == 2
    ):
        return b.new("half_dim", (args[0].args[0],), fx=n)
    cplx = lower_complex(b, n, target, args)  # view_as_complex(pairs of x) * f, back to real
    if cplx is not None:
        return cplx
    if target is torch.stack and len(args[0] if args else ()) == 2:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        out = n.meta.get("example_value")
        if dim == -1 or (isinstance(out, torch.Tensor) and dim == out.dim() - 1):
            return b.new("stack2", tuple(args[0]), fx=n)
    if (
        target in ("flatten", torch.flatten)
        and args
        and isinstance(args[0], CNode)
        and args[0].op == "stack2"
    ):
        start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
        end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
        meta = args[0].meta
        last_two = start == -2 or (meta is not None and start == meta.dim() - 2)
        if last_two and (end in (-1, None) or (meta is not None and end == meta.dim() - 1)):
            stacked = args[0]
            node = b.new("interleave2", stacked.args, fx=n)
            node.cover.extend(stacked.cover)  # the stack is part of what the interleave stands for
            return node
    if (target in VIEWS or target in ("reshape_as", "view_as")) and args and _merges_a_stack(args[0], n):
        # stack((a, b), -1).reshape(..., 2 D) (reshape_as(x), view(...)): the flatten above, in a model
        node = b.new("interleave2", args[0].args, fx=n)
        node.cover.extend(args[0].cover)
        return node
    if target in (torch.cat, torch.concat) and len(args[0] if args else ()) == 2:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if dim == -1 or (dim is not None and _rank(n.meta.get("example_value")) == dim + 1):
            return b.new("cat2", tuple(args[0]), fx=n)
    two = split_in_two(b, n, target, args, kwargs)  # chunk(2, -1), split, tensor_split: two halves
    if two is not None:
        return two
    if target in (F.linear, torch._C._nn.linear) and len(args) >= 2:
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        ins = args[:2] if bias is None else [*args[:2], bias]  # linear(h, W) or linear(h, W, b)
        return b.new("linear", tuple(_autocast_inputs(b, n, ins)), fx=n)
    if target is F.cross_entropy:
        return _cross_entropy(b, n, args, kwargs)
    if target in LAYER_NORMS:
        return layer_norm(b, n, args, kwargs)
    if target in RMS_NORMS:
        return rms_norm(b, n, args, kwargs)
    if target in VECTOR_NORMS and (n.op == "call_method") == (target == "norm"):
        return vector_norm(b, n, args, kwargs)
    if target is torch.var or (n.op == "call_method" and target == "var"):
        return variance(b, n, args, kwargs)
    if target in CLAMPS and (n.op == "call_method") == isinstance(target, str):
        return clamp(b, n, args, kwargs)
    if target in VIEWS and args and isinstance(args[0], CNode):
        kind = view_kind(n, args, kwargs)
        if kind == "identity":
            return b.alias(n, args[0])
        if kind == "rows":  # the leading dims merged, the rows unchanged (one form however spelled)
            return b.new("flatten_rows", (args[0],), fx=n)
        if kind == "units":  # x.view(*lead, 1, n) and back: a norm over one group per row
            src, out = args[0].meta, n.meta.get("example_value")
            if out.dim() > src.dim() and units_read_by_rows(n):
                return b.alias(n, args[0])
            if out.dim() < src.dim() and not args[0].op.startswith(("input", "opaque")):
                # the source's op again, standing for this node: a site that reads it gets this
                # node's shape (an alias would hand it the source's, with the size-1 dims)
                again = b.new(args[0].op, args[0].args, args[0].attrs, fx=n)
                again.cover.extend(args[0].cover)
                return again
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


_LOW = (torch.bfloat16, torch.float16)


def _merges_a_stack(x, n: torch.fx.Node) -> bool:
    """n views a last-dim stack2 x (..., D, 2) as (..., 2 D): its shape recorded by dynamo."""
    if not isinstance(x, CNode) or x.op != "stack2" or not isinstance(x.meta, torch.Tensor):
        return False
    out = n.meta.get("example_value")
    src = tuple(x.meta.shape)
    return isinstance(out, torch.Tensor) and len(src) >= 2 and tuple(out.shape) == (*src[:-2], src[-2] * 2)


def _autocast_inputs(b: _Builder, n: torch.fx.Node, args) -> list:
    """Autocast made explicit: a matmul that autocast ran in bf16/fp16 on float32 inputs reads
    those inputs cast to that dtype (what autocast does), as canonical nodes no fx node computes yet
    (made, where a site needs them, as `x.to(dtype)`). A pattern then sees the math that runs: an
    LM head under autocast is a bf16 linear, and its kernel gets what the stock code's linear got."""
    out = n.meta.get("example_value")
    if not isinstance(out, torch.Tensor) or out.dtype not in _LOW:
        return list(args)
    res = []
    for a in args:
        meta = a.meta if isinstance(a, CNode) else None
        if not isinstance(meta, torch.Tensor) or meta.dtype != torch.float32:
            res.append(a)
            continue

        def make(graph, fx_of, a=a, dt=out.dtype):
            return graph.call_method("to", (fx_of(a), dt))

        c = CNode(
            "cast",
            (a, out.dtype),
            (),
            None,
            [],
            name=f"{a.name}_autocast",
            value=meta.to(out.dtype),
            make=make,
        )
        b.nodes.append(c)
        res.append(c)
    return res


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
    # over the last dim of rows (2-D input, or one the view algebra took rows of) - or, for an input
    # of 3 or more dims, over dim 1 (PyTorch's class dim), which the LM-head kernel does not serve
    x = n.args[0] if n.args else n.kwargs.get("input")
    meta = x.meta.get("example_value", x.meta.get("val")) if isinstance(x, torch.fx.Node) else None
    src = b.of_fx.get(x) if isinstance(x, torch.fx.Node) else None
    rows = (isinstance(src, CNode) and src.op == "flatten_rows") or (
        isinstance(meta, torch.Tensor) and meta.dim() <= 2
    )
    attrs += (("rows", rows),)
    ins = (bound.get("input"), bound.get("target"), bound.get("ignore_index", -100))
    return b.new("cross_entropy", ins, attrs, fx=n)


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
        apply_rules(b.nodes, c)
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
        apply_rules(b.nodes, c)
    for n in b.nodes:
        if n.op == "cast" and isinstance(n.args[1], CNode) and n.args[1].op == "dtype_of":
            n.args = (n.args[0], DtypeOf(n.args[1].args[0]))
        if n.op in PRIMITIVES.names("reduction") and any(d >= 0 for d in n.attr("dims")):
            raise TypeError(
                f"kernelgraft.pattern({spelling.pattern!r}): reduce over negative dims (dim=-1), "
                f"not {n.attr('dims')}: a pattern does not know the rank of the tensors it will meet"
            )
    b.nodes = [n for n in b.nodes if n.op != "dtype_of"]
    out = _shared(b, out)
    g = _finish(b, out)
    _prune_to_output(g)
    return g


def _shared(b: _Builder, out: CNode) -> CNode:
    """A traced pattern with each value computed once: a node with the op, options and arguments of
    an earlier one is that one (a pattern that writes `h - mean` twice reads as one that names it).
    Inputs and opaque ops are kept apart. -> the output, as merged."""
    seen: dict = {}
    same: dict = {}

    def key_of(a):  # of arguments already merged (sub)
        if isinstance(a, CNode):
            return ("node", id(a))
        if isinstance(a, DtypeOf):
            return ("dtype_of", id(a.node))
        if isinstance(a, tuple):
            return tuple(key_of(x) for x in a)
        return (type(a).__name__, a)

    def sub(a):
        if isinstance(a, CNode):
            return same.get(a, a)
        if isinstance(a, DtypeOf):
            return DtypeOf(same.get(a.node, a.node))
        if isinstance(a, tuple):
            return tuple(sub(x) for x in a)
        return a

    kept = []
    for n in b.nodes:
        n.args = sub(n.args)
        if n.op != "input" and not n.op.startswith("opaque"):
            key = (n.op, key_of(n.args), n.attrs)
            if key in seen:
                same[n] = seen[key]
                continue
            seen[key] = n
        kept.append(n)
    b.nodes = kept
    return same.get(out, out)


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
