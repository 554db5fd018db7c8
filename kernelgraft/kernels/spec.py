"""A traced pattern, specialized to dtypes and layouts, as sympy: the forward of one element j of a
row, with each row reduction an explicit symbol r_k defined by its summand.

Every value carries the dtype PyTorch would give it (type promotion, python numbers weak), and a
value whose dtype is narrower than float32 is wrapped in a rounding: the kernel then rounds exactly
where the spelling rounds (its upcast path), while computing everything else in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from ..ir import PRIMITIVES, CNode, DtypeOf
from ..ir.sym import RoundBF16, RoundF16, round_to
from .family import Unsupported

LOW = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
SERVED = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Reduction:
    symbol: sympy.Symbol  # r_k: the row value
    summand: sympy.Expr  # what is summed over j
    mean: bool  # divide by N


@dataclass(eq=False)
class SNode:
    """One value of the spelling: its sympy value (composed from the inputs), its dtype, its level
    ('elem' varies per element, 'row' per row, 'col' per column, 'scalar' not at all) and how it
    was computed from its inputs (`local(*input_values)`, with the rounding left out)."""

    value: sympy.Expr
    dtype: torch.dtype | None
    level: str
    inputs: tuple = ()
    local: object = None  # callable on the inputs' sympy values
    reduce: str | None = None  # 'mean' | 'sum' for row reductions
    name: str = ""
    permuted: bool = False  # rotate_half: the input read at column (j + N/2) mod N, sign -1 below N/2
    op: str = ""  # the canonical op that computed it


@dataclass
class Spec:
    name: str  # op-safe identifier of the spelling
    tensors: list[str]  # kernel names (v_<argument>) of the tensor arguments, in signature order
    scalars: list[str]  # kernel names of the Scalar arguments
    kinds: dict[str, str]  # tensor name -> 'elem' (one value per element) | 'col' (one per column)
    dtypes: dict[str, torch.dtype]
    reductions: list[Reduction]
    output: sympy.Expr
    out_dtype: torch.dtype
    symbols: dict[str, sympy.Symbol] = field(default_factory=dict)
    nodes: list[SNode] = field(default_factory=list)  # topological order, output last
    rounding: str = "autograd"
    rotation: str = "half"  # the permutation `permuted` symbols are read at: "half" or "pairs"
    # a row written as two halves of the pairs' rotation (halves_of_pairs): the element at column k
    # of the pairs' order is stored at (k // 2) + (k % 2) * N/2 ("deinterleave"), and these tensor
    # arguments, half a row wide, are read at k // 2
    out_map: str = ""
    half_inputs: frozenset = frozenset()
    # where those are read for the element at column k: "pairs" at k // 2 (one angle per pair),
    # "halves" at k mod N/2 (one angle per column of a half: GPT-OSS's rotation of the halves)
    half_at: str = "pairs"
    # the output is a new row written whole (a cat or an interleave of two halves, maybe cast):
    # eager PyTorch makes it contiguous whatever its inputs' layout, and so does the launch
    # (layout.rows_like); an element-wise result keeps its input's layout
    fresh_out: bool = False

    N = sympy.Symbol("Nf", positive=True)  # row length as a float, for means


# the sign of a rotated read: rotate_half's (-1 in the first half of a row, +1 in the second) or
# rotate_pairs' (-1 at even columns, +1 at odd); either way the column read is read back, with the
# opposite sign, from the column it was read at
SGN = sympy.Symbol("sgn")
ROTATIONS = {"rotate_half": "half", "rotate_pairs": "pairs"}


def permuted(sym: sympy.Symbol) -> sympy.Symbol:
    """x -> x read at the rotated column (and back: the half-rotation is an involution)."""
    n = sym.name
    return sympy.Symbol(n[:-3] if n.endswith("__p") else n + "__p")


def paired_output(g):
    """The node that writes a spelling's row as the pairs' rotation (see halves_of_pairs): its
    output, or the argument of the cast that ends it; None if that is no cat2 or interleave2."""
    out = g.output
    if out.op == "cast" and isinstance(out.args[0], CNode):
        out = out.args[0]
    return out if out.op in ("cat2", "interleave2") else None


def read_in_halves(g) -> str | None:
    """How a spelling that halves_of_pairs recognizes splits its rows: "pairs" (x[..., 0::2],
    x[..., 1::2]) or "halves" (x[..., :D/2], x[..., D/2:], or chunk(x, 2, -1)); None for others."""
    out = paired_output(g)
    if out is None:
        return None
    ops = {n.op for n in g.nodes} & {"pairs", "half"}
    if ops == {"pairs"}:
        return "pairs"
    return "halves" if ops == {"half"} and out.op == "cat2" else None


def halves_of_pairs(g) -> tuple[set, set] | None:
    """A spelling whose output is cat(E0, E1) or interleave2(E0, E1) (maybe cast) over the even and
    odd columns of its inputs (x[..., 0::2], x[..., 1::2]) with angles half a row wide: DeepSeek's
    MLA rotation, cat(x1*c - x2*s, x2*c + x1*s), which writes the pairs' rotation with its results
    de-interleaved, or the complex product of Llama 4 and DeepSeek-V2 (ir/complex.py), which
    writes them in place; or cat(E0, E1) over the two halves of its rows (GPT-OSS's rotation,
    cat(x1*c - x2*s, x2*c + x1*s) over chunk(x, 2, -1)): rotate_half with angles half a row wide.
    -> (the input names read in pairs or halves, the other tensor inputs: half a row wide), or None."""
    split = read_in_halves(g)
    if split is None:
        return None
    pairs = [n for n in g.nodes if n.op == ("pairs" if split == "pairs" else "half")]
    read = {n.args[0] for n in pairs}
    read = {c.args[0] if c.op == "cast" else c for c in read}
    names = {c.attr("name") for c in read if isinstance(c, CNode) and c.op == "input"}
    others = {
        n.attr("name")
        for n in g.nodes
        if n.op == "input" and n.attr("kind") != "scalar" and n.attr("name") not in names
    }
    return names, others


# the ops that read a row as two equal parts: its halves, or its even and odd columns
_HALVES = {"half": "halves", "rotate_half": "halves", "pairs": "pairs", "rotate_pairs": "pairs"}
_PARTS = {"halves": "two halves", "pairs": "its even and odd columns"}


def halves_refusal(spelling, metas: dict) -> str | None:
    """Why the kernel of a spelling that reads a tensor's rows in two parts (x[..., :D/2], chunk(x, 2,
    -1), rotate_half, x[..., ::2]) cannot serve tensors of these widths (metas: argument -> value as
    dynamo recorded it), or None. The kernel reads two equal parts, the column read at (k + N/2) mod
    N or at its pair's; an odd width splits in two unequal ones (chunk: 8 and 7 of 15), and a
    symbolic width may be odd at run time.

    >>> import torch, kernelgraft
    >>> sp = kernelgraft.patterns.REGISTRY.get("rope", "rotate_half")
    >>> halves_refusal(sp, {"x": torch.empty(2, 16), "cos": torch.empty(16), "sin": torch.empty(16)}) is None
    True
    >>> halves_refusal(sp, {"x": torch.empty(2, 15), "cos": torch.empty(15), "sin": torch.empty(15)}).split(":")[0]
    '`x` is 15 wide'
    """
    for n in spelling.canonical().nodes:
        parts = _HALVES.get(n.op)
        x = n.args[0] if parts else None
        if isinstance(x, CNode) and x.op == "cast":
            x = x.args[0]
        if not (isinstance(x, CNode) and x.op == "input"):
            continue  # halves of a computed value: build_spec refuses those
        name = x.attr("name")
        t = metas.get(name)
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        N = t.shape[-1]
        width = N if isinstance(N, int) else (int(N) if is_concrete_int(N) else None)
        if width is None and not statically_known_true(N % 2 == 0):
            return (
                f"`{name}` has a symbolic width {N} (dynamic shapes): the kernel reads its rows as {_PARTS[parts]} "
                "of equal width, which an odd width is not, and the width is not known when the graph is "
                "captured; the site runs the stock code (torch._dynamo.mark_static on its last dim serves it)"
            )
        if width is not None and width % 2:
            return (
                f"`{name}` is {width} wide: the kernel reads its rows as {_PARTS[parts]} of equal width, and "
                f"an odd width has them {width // 2 + 1} and {width // 2} wide; the site runs the stock code"
            )
    return None


def _odd_rounding(e):
    """e with each rounding of a negated value written as the negated rounding (round to nearest
    even is odd: RNE(-a) = -RNE(a)), then expanded: two spellings of one value meet."""
    def negated(f):
        return isinstance(f, (RoundBF16, RoundF16)) and f.args[0].could_extract_minus_sign()

    before = None
    while before != e:
        before, e = e, e.replace(negated, lambda f: -type(f)(-f.args[0]))
    return sympy.expand(e)


def _loaded(c) -> bool:
    """c is a tensor argument, or a cast of one (ModernBERT rotates q.float()): a value the kernel
    has as it loads it, at any column."""
    if isinstance(c, CNode) and c.op == "cast":
        c = c.args[0]
    return isinstance(c, CNode) and c.op == "input" and c.attr("kind") != "scalar"


def _promote(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
    if a is None:
        return b
    if b is None:
        return a
    return torch.promote_types(a, b)


ROUNDINGS = ("autograd", "fused")


def _local(prim, attrs: dict):
    """The primitive's forward with the node's options bound (gelu's approximate)."""
    if not attrs:
        return prim.forward
    return lambda *xs: prim.forward(*xs, **attrs)


def build_spec(
    spelling, dtypes: dict[str, torch.dtype], kinds: dict[str, str], rounding: str = "autograd"
) -> Spec:
    """Specialize `spelling` to argument dtypes and kinds ('elem' | 'col') as a sympy Spec.

    rounding="autograd" rounds every bf16/fp16 value, as eager PyTorch stores each op's result;
    rounding="fused" rounds only at explicit casts, as inductor's fused kernels do (they compute
    in float32 between loads and stores). The output is stored in its dtype either way."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    g = spelling.canonical()
    for n, dt in dtypes.items():
        if dt not in SERVED:
            raise Unsupported(f"{n} is {dt}; kernels serve {', '.join(map(str, SERVED))}")
    val: dict = {}  # CNode -> SNode
    rotation = None
    halves = halves_of_pairs(g)  # (paired inputs, half-width inputs) or None
    paired = paired_output(g)  # a cat or interleave that writes the row whole, or None
    writer = paired if halves is not None else None  # the node that writes the pairs' rotation
    split = read_in_halves(g) or "pairs"
    reductions: list[Reduction] = []
    symbols: dict[str, sympy.Symbol] = {}
    nodes: list[SNode] = []

    def node(v, dt, level, inputs=(), local=None, reduce=None, name=""):
        sn = SNode(v, dt, level, tuple(inputs), local, reduce, name)
        nodes.append(sn)
        return sn

    def arg(a) -> SNode:
        if isinstance(a, CNode):
            return val[a]
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            c = sympy.nsimplify(a) if float(a).is_integer() else sympy.Float(a)
            return SNode(c, None, "scalar", name=repr(a))
        raise Unsupported(f"argument {a!r} has no element-wise meaning")

    def level_of(ins) -> str:
        levels = {i.level for i in ins}
        if "elem" in levels or {"row", "col"} <= levels:
            return "elem"
        return "row" if "row" in levels else ("col" if "col" in levels else "scalar")

    def cast_target(t):
        if isinstance(t, DtypeOf):
            return dtypes[t.node.attr("name")]
        if isinstance(t, torch.dtype):
            return t
        raise Unsupported(f"cast to {t!r}")

    def rounded(e, dt, explicit=False):
        if rounding == "fused" and not explicit:
            return e
        return round_to(e, LOW.get(dt, "float32"))

    for n in g.nodes:
        if n.op == "input":
            name = n.attr("name")
            s_ = sympy.Symbol(f"v_{name}")  # prefixed: no clash with the kernel's own names
            symbols[f"v_{name}"] = s_
            if n.attr("kind") == "scalar":
                val[n] = node(s_, None, "scalar", name=name)
            else:
                val[n] = node(s_, dtypes[name], "elem" if kinds[name] == "elem" else "col", name=name)
            continue
        if n.op == "cast":
            x, target = arg(n.args[0]), cast_target(n.args[1])
            if target not in SERVED:
                raise Unsupported(f"the pattern casts to {target}")
            val[n] = node(
                rounded(x.value, target, explicit=True), target, x.level, (x,), lambda a: a, name=n.name
            )
            continue
        if n.op in ROTATIONS:  # exact (a sign and a permutation): no rounding
            x = arg(n.args[0])
            if not _loaded(n.args[0]) or x.level not in ("elem", "col"):
                raise Unsupported(f"{n.op} of a computed value: kernels permute tensors as they load them")
            if rotation not in (None, ROTATIONS[n.op]):
                raise Unsupported("the pattern rotates both halves and pairs: kernels read one permutation")
            rotation = ROTATIONS[n.op]
            # the argument read at the rotated column (a cast of it: the cast of what is read there)
            at = x.value.xreplace({s: permuted(s) for s in x.value.free_symbols if s in symbols.values()})
            val[n] = SNode(SGN * at, x.dtype, x.level, (x,), None, name=n.name, permuted=True)
            nodes.append(val[n])
            continue
        if n.op in ("pairs", "half") and halves is not None:
            # computed in the pairs' order: the element at column k holds the odd half's value at
            # odd k (x[..., 1::2] is the column read there, x[..., 0::2] its partner, sign +1) and
            # the even half's at even k (checked at the cat below); for halves alike, the second
            # half (x[..., D/2:]) read at k and the first its partner across the row
            x = arg(n.args[0])
            if not _loaded(n.args[0]) or x.level != "elem":
                raise Unsupported("pairs of a computed value: kernels permute tensors as they load them")
            rotation = "pairs" if n.op == "pairs" else "half"
            if n.attr("part") == 1:
                val[n] = x
            else:
                at = x.value.xreplace({s: permuted(s) for s in x.value.free_symbols if s in symbols.values()})
                val[n] = SNode(SGN * at, x.dtype, x.level, (x,), None, name=n.name, permuted=True)
                nodes.append(val[n])
            continue
        if writer is not None and n is writer:
            even, odd = arg(n.args[0]), arg(n.args[1])
            # the even half as written (x[..., 0::2] read where the element is, x[..., 1::2] its
            # partner) must be the odd half's value with the partner's sign -1: one expression
            paired = {symbols[f"v_{a}"] for a in halves[0]}
            swap = {v: permuted(v) for v in paired} | {permuted(v): v for v in paired} | {SGN: 1}
            if _odd_rounding(even.value.xreplace(swap)) != _odd_rounding(odd.value.xreplace({SGN: -1})):
                raise Unsupported(
                    "the row's two halves are not one rotation of its pairs (the even half must be the odd "
                    "half with the partner column's sign flipped)"
                )
            val[n] = odd
            continue
        prim = PRIMITIVES.get(n.op)
        if prim is not None and prim.kind == "reduction":
            if n.attr("dims") != (-1,) or not n.attr("keepdim"):
                raise Unsupported(
                    f"{n.op} over dims {n.attr('dims')} keepdim={n.attr('keepdim')}: only row reductions (dim=-1, keepdim=True)"
                )
            x = arg(n.args[0])
            if x.level != "elem":
                raise Unsupported(f"{n.op} of a value that does not vary along the row")
            r = sympy.Symbol(f"r{len(reductions)}")
            reductions.append(Reduction(r, x.value, prim.mean))
            val[n] = node(rounded(r, x.dtype), x.dtype, "row", (x,), None, n.op, n.name)
            continue
        if prim is None or prim.forward is None:
            raise Unsupported(f"op {n.op} has no element-wise kernel form")
        ins = tuple(arg(a) for a in n.args)
        dt = ins[0].dtype if prim.kind == "unary" else _promote(ins[0].dtype, ins[1].dtype)
        fn = _local(prim, dict(n.attrs))
        value = fn(*(i.value for i in ins))
        if value is None:
            raise Unsupported(f"{n.op}({', '.join(f'{k}={v!r}' for k, v in n.attrs)})")
        val[n] = node(rounded(value, dt), dt, level_of(ins), ins, fn, name=n.name)
        val[n].op = n.op

    out_node = val[g.output]
    out, out_dt = out_node.value, out_node.dtype
    if out_node.level != "elem":
        raise Unsupported("the pattern's output does not vary per element")
    if out_dt is None:
        raise Unsupported("the pattern's output is a python number")
    if not any(k == "elem" for k in kinds.values()):
        raise Unsupported("no argument varies per element")
    safe = f"{spelling.pattern}__{spelling.name}".replace(".", "_") + (
        "__fused" if rounding == "fused" else ""
    )
    scalars = [f"v_{a}" for a in spelling.arg_names if a in spelling.scalar_names]
    tensors = [f"v_{a}" for a in spelling.tensor_names]
    return Spec(
        safe,
        tensors,
        scalars,
        {f"v_{k}": v for k, v in kinds.items()},
        {f"v_{k}": v for k, v in dtypes.items()},
        reductions,
        out,
        out_dt,
        symbols,
        nodes,
        rounding,
        rotation or "half",
        "deinterleave" if writer is not None and writer.op == "cat2" and split == "pairs" else "",
        frozenset(f"v_{a}" for a in halves[1]) if halves is not None else frozenset(),
        split,
        fresh_out=paired is not None,
    )
