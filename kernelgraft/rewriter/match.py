"""Match: each spelling's canonical graph against the model's canonical graph.

Commutative ops (add, mul) match in either operand order; `Scalar` arguments bind to the number the
model graph holds (so eps is captured, never burned in); dtype casts must agree, `x.dtype` in the
pattern binding to the dtype dynamo recorded for the tensor matched as `x`. A failed attempt keeps the
point where it got furthest: that is what a near-miss reports.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..ir import PRIMITIVES, CGraph, CNode, DtypeOf
from .report import NearMiss, module_path

COMMUTATIVE = frozenset(n for n, p in PRIMITIVES.by_name.items() if p.commutative)


@dataclass
class _State:
    pmap: dict  # pattern CNode -> model CNode
    tensors: dict  # pattern arg name -> model CNode
    scalars: dict  # pattern arg name -> number
    dtypes: tuple = ()  # deferred (pattern arg name, dtype) checks
    twins: tuple = ()  # model nodes that compute again a value the pattern computes once

    def bind(self, **kw) -> _State:
        st = _State(dict(self.pmap), dict(self.tensors), dict(self.scalars), self.dtypes, self.twins)
        for k, v in kw.items():
            if k == "node":
                st.pmap[v[0]] = v[1]
            elif k == "tensor":
                st.tensors[v[0]] = v[1]
            elif k == "scalar":
                st.scalars[v[0]] = v[1]
            elif k == "dtype":
                st.dtypes = st.dtypes + (v,)
            elif k == "twins":
                st.twins = st.twins + tuple(v)
        return st

    def covered(self) -> set:
        """The fx nodes the matched model nodes (and their twins) stand for."""
        out = set()
        for mn in (*self.pmap.values(), *self.twins):
            out.update(mn.cover)
        return out


def twins(a, b) -> list | None:
    """The nodes of b's computation that repeat a's (the same op, options and arguments, down to
    shared nodes): a model that writes `h - mean` twice computes one value twice, or writes it once
    and again inside a composite it calls (xLSTM's `x - x.mean()` beside `x.var()`, whose primitives
    no fx node computes). None where the two differ. Opaque ops and inputs are never twins (an
    opaque op may not be pure)."""
    if a is b:
        return []
    if not (isinstance(a, CNode) and isinstance(b, CNode)):  # numbers, dtypes
        return [] if type(a) is type(b) and a == b else None
    if a.op != b.op or a.attrs != b.attrs or len(a.args) != len(b.args):
        return None
    if a.op == "input" or a.op.startswith("opaque"):
        return None
    out = [b]
    for x, y in zip(a.args, b.args):
        sub = twins(x, y)
        if sub is None:
            return None
        out += sub
    return out


@dataclass
class Failure:
    """The furthest a failed attempt got: `matched` pattern ops, then `pnode` met `mnode`."""

    matched: int = -1
    pnode: object = None
    mnode: object = None
    reason: str = ""
    tensors: dict = field(default_factory=dict)  # pattern argument -> model node bound by then


@dataclass
class Match:
    spelling: object
    pmap: dict
    tensors: dict
    scalars: dict
    output: CNode
    covered: set = field(default_factory=set)  # fx nodes the replacement removes
    withheld: list = field(default_factory=list)  # covered fx nodes the graph returns (may_withhold)


# conversions that change a value's dtype, layout or device but not what it holds: a returned value
# reached only through them (accelerate's `.float()` of a bf16 model's outputs) still only leaves
_CONVERSIONS = frozenset({"float", "half", "bfloat16", "double", "to", "type", "contiguous", "detach"})


def leaves_graph(u: torch.fx.Node) -> bool:
    """u, a user of a value, only hands it out of the graph: the graph's output, or a conversion
    (by constant arguments) whose users all only hand it out."""
    if u.op == "output":
        return True
    conversion = (
        u.op == "call_method"
        and u.target in _CONVERSIONS
        and not any(isinstance(a, torch.fx.Node) for a in (*u.args[1:], *u.kwargs.values()))
    )
    return conversion and bool(u.users) and all(leaves_graph(v) for v in u.users)


def _cast_to(m, dt) -> bool:
    """m is a model's cast to the literal dtype dt."""
    return isinstance(dt, torch.dtype) and isinstance(m, CNode) and m.op == "cast" and m.args[1] == dt


def _is_number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def describe(a) -> str:
    """A short human name for a canonical node or literal, as reports print it."""
    if isinstance(a, CNode):
        if a.op == "input":
            return f"`{a.attr('name')}`"
        args = ", ".join(describe_arg(x) for x in a.args)
        extra = "".join(f", {k}={v}" for k, v in a.attrs if k != "name")
        src = f" (`{a.fx.name}`)" if a.fx is not None and a.fx.op != "placeholder" else ""
        return f"{a.op}({args}{extra}){src}"
    return describe_arg(a)


def describe_arg(a) -> str:
    if isinstance(a, CNode):
        return a.attr("name") if a.op == "input" else (a.fx.name if a.fx is not None else a.op)
    if isinstance(a, DtypeOf):
        return f"{describe_arg(a.node)}.dtype"
    return repr(a)


class Matcher:
    def __init__(self, spelling, pattern: CGraph, allow_withhold: bool = True, read_by: str = ""):
        self.sp = spelling
        self.pg = pattern
        # an intermediate the graph returns may be withheld when the spelling says so (logits)
        self.withhold = allow_withhold and getattr(spelling, "may_withhold", False)
        self.read_by = read_by  # how the model's code read such an intermediate after the graph
        self.n_ops = sum(1 for n in pattern.nodes if n.op != "input")
        self.best = Failure()

    def _fail(self, st: _State, p, m, reason: str) -> None:
        if len(st.pmap) > self.best.matched:
            self.best = Failure(len(st.pmap), p, m, reason, dict(st.tensors))

    def unify(self, p, m, st: _State) -> Iterator[_State]:
        if isinstance(p, CNode) and p.op == "input":
            name = p.attr("name")
            if p.attr("kind") == "scalar":
                if not _is_number(m):
                    self._fail(
                        st, p, m, f"`{name}` is a Scalar in the pattern but the model has {describe(m)}"
                    )
                elif name in st.scalars and st.scalars[name] != m:
                    self._fail(st, p, m, f"`{name}` is {st.scalars[name]} in one place and {m} in another")
                else:
                    yield st.bind(scalar=(name, m))
                return
            if not isinstance(m, CNode):
                self._fail(
                    st, p, m, f"`{name}` is a tensor in the pattern but the model has the constant {m!r}"
                )
            elif name in st.tensors and st.tensors[name] is not m:
                self._fail(
                    st,
                    p,
                    m,
                    f"`{name}` must be one tensor, but the model uses {describe(st.tensors[name])} and {describe(m)}",
                )
            else:
                yield st.bind(tensor=(name, m))
            return
        if isinstance(p, DtypeOf):
            if isinstance(m, torch.dtype):
                yield st.bind(dtype=(p.node.attr("name"), m))
            else:
                self._fail(st, p, m, f"expected the dtype of `{p.node.attr('name')}`, got {describe(m)}")
            return
        if not isinstance(p, CNode):
            if isinstance(p, tuple) and isinstance(m, tuple) and len(p) == len(m):
                yield from self.unify_seq(p, m, st)
            elif (_is_number(p) and _is_number(m) and p == m) or (not _is_number(p) and p == m):
                yield st
            else:
                self._fail(st, p, m, f"expected {describe_arg(p)}, got {describe(m)}")
            return
        if p.op == "flatten_rows" and not (isinstance(m, CNode) and m.op == "flatten_rows"):
            # taking rows is optional: the model's value may be rows already (2-D logits)
            yield from self.unify(p.args[0], m, st)
            return
        if p.op == "cast" and _cast_to(m, p.args[1]):
            # a cast of a cast to the same dtype is that cast (x.float().float() is x.float()): the
            # pattern's `x.float()` meets the model's own cast to float32 as that cast, its input x,
            # or as x itself, the model's float32 value (a bf16 model that made the value float32
            # before the norm, whose own .float() then changes nothing), tried second. Only a model
            # cast: a float32 value the model computed otherwise stays x (a float32 model keeps the
            # spellings without casts)
            yield from self._unify_op(p, m, st)
            yield from self.unify(p.args[0], m, st)
            return
        yield from self._unify_op(p, m, st)

    def _unify_op(self, p, m, st: _State) -> Iterator[_State]:
        if not isinstance(m, CNode) or m.op != p.op or m.attrs != p.attrs:
            self._fail(st, p, m, f"expected {describe(p)}, got {describe(m)}")
            return
        if p in st.pmap:
            again = twins(st.pmap[p], m)
            if again is not None:
                yield st.bind(twins=again) if again else st
            else:
                self._fail(
                    st,
                    p,
                    m,
                    f"the pattern reuses one value here, the model computes it twice ({describe(m)})",
                )
            return
        if any(v is m for v in st.pmap.values()):
            self._fail(st, p, m, f"two pattern ops would be the same model node {describe(m)}")
            return
        st = st.bind(node=(p, m))
        orders = [m.args]
        if p.op in COMMUTATIVE and len(m.args) == 2:
            orders.append(m.args[::-1])
        for margs in orders:
            if len(margs) == len(p.args):
                yield from self.unify_seq(p.args, margs, st)

    def unify_seq(self, ps, ms, st: _State) -> Iterator[_State]:
        if not ps:
            yield st
            return
        for st1 in self.unify(ps[0], ms[0], st):
            yield from self.unify_seq(ps[1:], ms[1:], st1)

    def attempt(self, anchor: CNode, taken: set) -> Match | Failure:
        """Match the pattern with its output at `anchor`; the first consistent binding wins."""
        self.best = Failure()
        for st in self.unify(self.pg.output, anchor, _State({}, {}, {})):
            why = self._check(st, anchor, taken)
            if why is None:
                covered = st.covered()
                withheld = [
                    f
                    for f in covered
                    if f is not anchor.fx and any(u not in covered and leaves_graph(u) for u in f.users)
                ]
                return Match(self.sp, st.pmap, st.tensors, st.scalars, anchor, covered, withheld)
            self._fail(st, None, anchor, why)
        return self.best

    def _check(self, st: _State, anchor: CNode, taken: set) -> str | None:
        for name, dt in st.dtypes:
            meta = st.tensors[name].meta
            if meta is None or meta.dtype != dt:
                got = "unknown" if meta is None else meta.dtype
                return f"the pattern casts to the dtype of `{name}` ({got}) but the model casts to {dt}"
        covered = st.covered()
        if covered & taken:
            return "overlaps a site already replaced"
        for mn in (*st.pmap.values(), *st.twins):
            if mn is anchor:
                continue
            for fxn in mn.cover:
                outside = [u for u in fxn.users if u not in covered]
                if self.withhold:
                    outside = [u for u in outside if not leaves_graph(u)]
                elif self.read_by and getattr(self.sp, "may_withhold", False) and any(leaves_graph(u) for u in outside):
                    return (
                        f"intermediate `{fxn.name}` is also used by {self.read_by} outside the pattern (the "
                        "model's code reads it after this graph); the fused kernel would not make it"
                    )
                elif getattr(self.sp, "may_withhold", False) and any(leaves_graph(u) for u in outside):
                    return (
                        f"`{fxn.name}` is returned by the model and keep_logits=True: the fused kernel "
                        "would not make it"
                    )
                if outside:
                    return (
                        f"intermediate `{fxn.name}` is also used by `{outside[0].name}` outside the pattern; "
                        "replacing the site would compute it twice"
                    )
        return None


def resemble(p, m, memo: dict) -> tuple[int, tuple | None]:
    """How many pattern ops line up with the model graph below (p, m), bindings ignored, every
    operand explored (the matcher stops at the first failing one): (ops aligned, first difference)."""
    if not isinstance(p, CNode) or p.op == "input":
        return 0, None
    key = (id(p), id(m))
    if key not in memo:
        memo[key] = (0, (p, m))
        if isinstance(m, CNode) and m.op == p.op and m.attrs != p.attrs:
            # the same op with other options (cross_entropy with label smoothing): this node is the
            # first difference, and what lines up below it still counts
            below = (
                sum(resemble(pa, ma, memo)[0] for pa, ma in zip(p.args, m.args))
                if len(p.args) == len(m.args)
                else 0
            )
            memo[key] = (below, (p, m))
        elif isinstance(m, CNode) and m.op == p.op:
            orders = [m.args] + ([m.args[::-1]] if p.op in COMMUTATIVE and len(m.args) == 2 else [])
            best = None
            for margs in orders:
                if len(margs) != len(p.args):
                    continue
                score, first = 1, None
                for pa, ma in zip(p.args, margs):
                    s, f = resemble(pa, ma, memo)
                    score += s
                    first = first or f
                if best is None or score > best[0]:
                    best = (score, first)
            memo[key] = best or (1, (p, m))
    return memo[key]


# ops any code has: a near miss must line up, or differ, at something more telling
_GENERIC = frozenset({p.name for p in PRIMITIVES.by_name.values() if p.generic} | {"cast", "input"})


def _fed_by_bound_input(first, tensors: dict, depth: int = 4) -> bool:
    """The model node where the pattern differs computes from the tensor the rest of the match bound
    to the same pattern argument (the other spelling of rotate_half(q) reads q): not unrelated code."""
    p, m = first
    names = set()
    stack = [p]
    while stack:
        n = stack.pop()
        if isinstance(n, CNode):
            if n.op == "input":
                names.add(n.attr("name"))
            stack.extend(n.inputs())
    bound = {tensors[n].fx for n in names if n in tensors and tensors[n].fx is not None}
    frontier = [m.fx] if isinstance(m, CNode) and m.fx is not None else []
    for _ in range(depth):
        if bound & set(frontier):
            return True
        frontier = [a for n in frontier for a in n.all_input_nodes]
    return bool(bound & set(frontier))


def near_miss(sp, n_ops: int, anchor, f: Failure, taken=frozenset()) -> NearMiss | None:
    """A failed attempt worth reporting: at least half the pattern lines up, and what lines up, or
    where it differs, is an op that says something (a reduction, rsqrt, rotate_half, an activation),
    not only multiplies and casts that any code has. Not where it differs at a node a served site
    replaced (`taken`: Cohere's float32 rotation, served, then cast back, resembles a float32
    spelling that differs only inside the served site)."""
    pg = sp.canonical()
    score, first = resemble(pg.output, anchor, {})
    if f.matched >= score:  # the matcher got as far: its reason is the more precise one
        score, first, reason = f.matched, (f.pnode, f.mnode), f.reason
    else:
        reason = f"expected {describe(first[0])}, got {describe(first[1])}" if first else f.reason
    if first is not None and isinstance(first[1], CNode) and any(x in taken for x in first[1].cover):
        return None
    generic = sum(1 for n in pg.nodes if n.op in _GENERIC and n.op != "input")
    differs_at_distinctive = (
        first is not None
        and isinstance(first[0], CNode)
        and first[0].op not in _GENERIC
        and _fed_by_bound_input(first, f.tensors)
    )
    if score < max(2, math.ceil(n_ops / 2)) or not (score > generic or differs_at_distinctive):
        return None
    expected = describe(first[0]) if first and first[0] is not None else ""
    found = describe(first[1]) if first else ""
    return NearMiss(sp.pattern, sp.name, module_path(anchor.fx), score, n_ops, expected, found, reason)
