"""Composite ops read as their primitives: a model that calls `F.layer_norm` (or `nn.LayerNorm`)
and a pattern that writes LayerNorm out in primitives, or calls `F.layer_norm` itself, canonicalize
to the same nodes, rounded as PyTorch rounds the composite. The primitives' nodes stand for no fx
node (the composite's last one stands for its call); each carries its example value and how to
make it as an fx node, should a site need it as an argument.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from .graph import CNode, DtypeOf
from .rules import apply_rules

LAYER_NORMS = (F.layer_norm, torch.layer_norm)
CLAMPS = (torch.clamp, torch.clip, "clamp", "clip")
RMS_NORMS = (F.rms_norm, torch.rms_norm) if hasattr(F, "rms_norm") else ()
VECTOR_NORMS = (torch.norm, "norm", torch.linalg.vector_norm)


def _over_last_dim(shape, x: CNode) -> bool:
    """Whether a norm's normalized_shape is x's last dim alone: `(N,)` or N in a model graph (N its
    recorded last dim), `x.shape[-1:]` or `(x.shape[-1],)` in a traced pattern."""
    if isinstance(shape, CNode):
        return shape.op == "last_shape" and shape.args[0] is x
    if isinstance(shape, (tuple, list, torch.Size)):
        if len(shape) != 1:
            return False
        shape = shape[0]
    if isinstance(shape, CNode):
        return shape.op == "last_dim" and shape.args[0] is x
    meta = x.meta
    return isinstance(shape, int) and meta is not None and meta.dim() >= 1 and meta.shape[-1] == shape


def layer_norm(b, n: torch.fx.Node, args, kwargs) -> CNode:
    """F.layer_norm over the last dim -> its primitives, rounded as PyTorch rounds it: x, the weight
    and the bias read in float32, mean and variance (biased) over the row, one rounding to the
    output's dtype at the end. A pattern spelled in primitives and a model's nn.LayerNorm then
    read the same. Any other normalized_shape stays opaque."""
    bound = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), args))
    bound.update(kwargs)
    x, w, bias, eps = bound.get("input"), bound.get("weight"), bound.get("bias"), bound.get("eps", 1e-5)
    eps_ok = _is_number(eps) or (isinstance(eps, CNode) and eps.op == "input")
    if not isinstance(x, CNode) or not eps_ok or not _over_last_dim(bound.get("normalized_shape"), x):
        return b.new("opaque:layer_norm", tuple(args) + tuple(sorted(kwargs.items())), fx=n)
    out = n.meta.get("example_value")
    out_dtype = out.dtype if isinstance(out, torch.Tensor) else DtypeOf(x)
    d = _Decomposed(b, x.meta, n)
    h = d.cast(x, torch.float32)
    centered = d.binary("sub", h, d.row_mean(h))
    y = d.binary(
        "mul", centered, d.unary("rsqrt", d.binary("add", d.row_mean(d.unary("square", centered)), eps))
    )
    if isinstance(w, CNode):
        y = d.binary("mul", y, d.cast(w, torch.float32))
    if isinstance(bias, CNode):
        y = d.binary("add", y, d.cast(bias, torch.float32))
    if out_dtype == torch.float32 and _float32_copy(x):
        # the norm of a float32 copy (OLMo: F.layer_norm(x.float(), ...).to(x.dtype)) ends in float32
        # with no cast of its own: the model's cast back is the one the pattern's final cast meets
        return b.alias(n, y)
    return b.new("cast", (y, out_dtype), fx=n)


def _float32_copy(x: CNode) -> bool:
    """x is a cast to float32 of a value that is not float32 already (of a pattern's input, whose
    dtype is not known, too). Not the output of another norm in a float32 model, which ends in a
    cast to float32 that changes nothing: a LayerNorm of a LayerNorm (Bloom's embedding norm, then
    its first layer's) keeps its own final cast, the site's output."""
    if x.op != "cast" or x.args[1] != torch.float32:
        return False
    src = x.args[0]
    meta = src.meta if isinstance(src, CNode) else None
    return meta is None or meta.dtype != torch.float32


def clamp(b, n: torch.fx.Node, args, kwargs) -> CNode:
    """`x.clamp(min, max)` (torch.clamp, clip) -> clamp_min, then clamp_max, each where its bound
    is given: max(x, min) then min(., max), as PyTorch computes it (max wins where min > max) and
    differentiates it (x's gradient passes where min <= x <= max, ties included). Both bounds given
    with one a tensor stay opaque: autograd then hands each bound a gradient where min > max."""
    bound = dict(zip(("input", "min", "max"), args))
    bound.update(kwargs)
    x, lo, hi = bound.get("input"), bound.get("min"), bound.get("max")
    both = lo is not None and hi is not None
    if not isinstance(x, CNode) or (lo is None and hi is None) or (both and (_tensor(lo) or _tensor(hi))):
        return b.new("opaque:clamp", tuple(args) + tuple(sorted(kwargs.items())), fx=n)
    if hi is None:
        return b.new("clamp_min", (x, lo), fx=n)
    if lo is not None:
        x = _Decomposed(b, x.meta, n).binary("clamp_min", x, lo)
    return b.new("clamp_max", (x, hi), fx=n)


def _tensor(a) -> bool:
    """a is a tensor value: not a number, nor a pattern's Scalar (or arithmetic of Scalars)."""
    if not isinstance(a, CNode):
        return False
    if a.op == "input":
        return a.attr("kind") != "scalar"
    return isinstance(a.meta, torch.Tensor) or any(_tensor(i) for i in a.inputs())


def _is_number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


class _Decomposed:
    """The canonical nodes of a composite op's primitives (no fx node computes them): each with its
    example value (from the input's, in a model graph) and how to make it as an fx node, should a
    site need it as an argument."""

    def __init__(self, b, like, origin=None):  # b: the canonicalizer's builder (its nodes, in order)
        self.b, self.like, self.origin = b, like, origin  # origin: the composite's fx node

    def _node(self, op, args, attrs, value, make) -> CNode:
        c = CNode(
            op, tuple(args), tuple(attrs), name=f"{op}_decomposed", value=value, make=make, origin=self.origin
        )
        self.b.nodes.append(c)
        apply_rules(self.b.nodes, c)
        return c

    def _value(self, shape_of: CNode, dtype=None, row=False):
        v = shape_of.meta if isinstance(shape_of, CNode) else None
        if v is None:
            return None
        shape = (*v.shape[:-1], 1) if row else v.shape
        return v.new_empty(shape, dtype=dtype or v.dtype)

    def cast(self, a: CNode, dtype) -> CNode:
        return self._node(
            "cast",
            (a, dtype),
            (),
            self._value(a, dtype),
            lambda g, fx_of: g.call_method("to", (fx_of(a), dtype)),
        )

    def row_mean(self, a: CNode) -> CNode:
        return self._row("mean", a)

    def row_sum(self, a: CNode) -> CNode:
        return self._row("sum", a)

    def _row(self, op: str, a: CNode) -> CNode:
        """A reduction of each row (dim=-1, keepdim=True)."""
        return self._node(
            op,
            (a,),
            (("dims", (-1,)), ("keepdim", True)),
            self._value(a, row=True),
            lambda g, fx_of: g.call_method(op, (fx_of(a), -1), {"keepdim": True}),
        )

    def unary(self, op: str, a: CNode) -> CNode:
        fn = {"square": torch.square, "rsqrt": torch.rsqrt, "sqrt": torch.sqrt}[op]
        return self._node(op, (a,), (), self._value(a), lambda g, fx_of: g.call_function(fn, (fx_of(a),)))

    def binary(self, op: str, a: CNode, c) -> CNode:
        fn = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "clamp_min": torch.clamp_min}[op]
        big = (
            a
            if not isinstance(c, CNode) or a.meta is None or c.meta is None or a.meta.dim() >= c.meta.dim()
            else c
        )
        value = None
        if isinstance(a, CNode) and a.meta is not None:
            other = c.meta if isinstance(c, CNode) else None
            shape = torch.broadcast_shapes(a.meta.shape, other.shape) if other is not None else a.meta.shape
            value = big.meta.new_empty(shape, dtype=a.meta.dtype)

        def make(g, fx_of):
            return g.call_function(fn, (fx_of(a), fx_of(c) if isinstance(c, CNode) else c))

        return self._node(op, (a, c), (), value, make)


def variance(b, n: torch.fx.Node, args, kwargs) -> CNode:
    """`x.var(dim=-1, keepdim=True, unbiased=False)` (or `correction=0`) of a float32 x -> the mean
    of the squared deviations over the row, as a LayerNorm written out computes it (xLSTM's
    multi-head norm calls var). A bf16/fp16 x stays opaque (var rounds once, its primitives would
    round at each step), as does an unbiased variance or any other dim."""
    names = ("input", "dim", "unbiased", "keepdim")
    bound = dict(zip(names, args)) if not (len(args) > 2 and not isinstance(args[2], bool)) else {}
    bound.update(kwargs)
    x, dim = bound.get("input", args[0] if args else None), bound.get("dim")
    meta = x.meta if isinstance(x, CNode) else None
    biased = bound.get("unbiased") is False or bound.get("correction") == 0
    last = isinstance(meta, torch.Tensor) and dim in (-1, (-1,), [-1], meta.dim() - 1, (meta.dim() - 1,))
    if not (last and biased and bound.get("keepdim") and meta.dtype == torch.float32):
        return b.new("opaque:var", tuple(args) + tuple(sorted(kwargs.items())), fx=n)
    d = _Decomposed(b, meta, n)
    deviation = d.unary("square", d.binary("sub", x, d.row_mean(x)))
    return b.new("mean", (deviation,), (("dims", (-1,)), ("keepdim", True)), fx=n)


def rms_norm(b, n: torch.fx.Node, args, kwargs) -> CNode:
    """F.rms_norm (nn.RMSNorm) over the last dim -> its primitives: x read in float32,
    x * rsqrt(mean(x^2) + eps), times the weight where there is one, one rounding to x's dtype (eps
    None: the epsilon of the dtype it computes in, float32 for bf16/fp16 input).
    With a weight PyTorch's rounding depends on the device where x or the weight is 2-byte (a
    fused kernel on CUDA multiplies in float32, the composite rounds first): left opaque there. A
    float32 x and weight (a model's `F.rms_norm(x.float(), shape, w.float(), eps)`, cast back
    afterwards) round nowhere but in float32 on either path: decomposed."""
    bound = dict(zip(("input", "normalized_shape", "weight", "eps"), args))
    bound.update(kwargs)
    x, w, eps = bound.get("input"), bound.get("weight"), bound.get("eps")
    meta = x.meta if isinstance(x, CNode) else None
    if eps is None and meta is not None and meta.dtype.is_floating_point:
        # PyTorch's default: the epsilon of the dtype it computes in (float32 for bf16/fp16 input)
        eps = torch.finfo(torch.promote_types(meta.dtype, torch.float32)).eps
    eps_ok = _is_number(eps) or (isinstance(eps, CNode) and eps.op == "input")
    wm = w.meta if isinstance(w, CNode) else None
    weight_ok = w is None or (
        isinstance(wm, torch.Tensor)
        and isinstance(meta, torch.Tensor)
        and wm.dtype == meta.dtype == torch.float32
        and wm.dim() == 1
        and wm.shape[0] == meta.shape[-1]
    )
    if (
        not isinstance(x, CNode)
        or not eps_ok
        or not weight_ok
        or not _over_last_dim(bound.get("normalized_shape"), x)
    ):
        return b.new("opaque:rms_norm", tuple(args) + tuple(sorted(kwargs.items())), fx=n)
    out = n.meta.get("example_value")
    out_dtype = out.dtype if isinstance(out, torch.Tensor) else DtypeOf(x)
    d = _Decomposed(b, meta, n)
    h = d.cast(x, torch.float32)
    y = d.binary("mul", h, d.unary("rsqrt", d.binary("add", d.row_mean(d.unary("square", h)), eps)))
    if w is not None:
        y = d.binary("mul", y, w)
    return b.new("cast", (y, out_dtype), fx=n)


def vector_norm(b, n: torch.fx.Node, args, kwargs) -> CNode:
    """The 2-norm of each row, `x.norm(p=2, dim=-1, keepdim=True)` (`torch.norm`,
    `torch.linalg.vector_norm(x, 2, -1, keepdim=True)`) -> sqrt of the row's sum of squares, x read
    in float32 and the norm rounded once to x's dtype (PyTorch accumulates a bf16/fp16 norm in
    float32). Another order, dim, a dtype, or no keepdim stays opaque."""
    vector = n.target is torch.linalg.vector_norm
    bound = dict(zip(("input", "ord" if vector else "p", "dim", "keepdim"), args))
    bound.update(kwargs)
    x = bound.get("input")
    p = bound.get("ord" if vector else "p", 2 if vector else "fro")
    dim = bound.get("dim")
    meta = x.meta if isinstance(x, CNode) else None
    rank = meta.dim() if isinstance(meta, torch.Tensor) else None
    last = dim in (-1, (-1,), [-1]) or (rank is not None and dim in (rank - 1, (rank - 1,), [rank - 1]))
    if (
        not (isinstance(x, CNode) and p in (2, 2.0, "fro") and last and bound.get("keepdim"))
        or bound.get("dtype") is not None
    ):
        return b.new("opaque:norm", tuple(args) + tuple(sorted(kwargs.items())), fx=n)
    out = n.meta.get("example_value")
    out_dtype = out.dtype if isinstance(out, torch.Tensor) else DtypeOf(x)
    d = _Decomposed(b, meta, n)
    root = d.unary("sqrt", d.row_sum(d.unary("square", d.cast(x, torch.float32))))
    return b.new("cast", (root, out_dtype), fx=n)
