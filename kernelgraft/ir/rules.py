"""The rewrite rules of canonicalization: a canonical node -> an equivalent canonical spelling, so that
every spelling of the same math reads the same to the matcher. Each rule is one line of RULES: the op
it applies to and a function of the node's arguments that returns (op, args[, attrs]) or None.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from .graph import CNode


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
    ("cast", lambda a, dt: ("cast", (a.args[0], dt)) if _recast(a, dt) else None),  # x.float().float() -> x.float()
    ("reciprocal", lambda a: ("rsqrt", a.args) if _is(a, "sqrt") else None),  # 1/sqrt(x) -> rsqrt
    (
        "div",
        lambda a, b: ("mul", (a, _fresh("rsqrt", b.args, b))) if _is(b, "sqrt") else None,
    ),  # a/sqrt(v) -> a*rsqrt(v)
    (
        "cat2",
        lambda a, b: ("rotate_half", (b.args[0],)) if _rotates(a, b) else None,
    ),  # cat(-x2, x1) -> rotate_half(x)
    (
        "interleave2",
        lambda a, b: ("rotate_pairs", (b.args[0],)) if _rotates(a, b, "pairs") else None,
    ),  # stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2) -> rotate_pairs(x)
    (
        "cat2",
        lambda a, b: ("neg", (_fresh("rotate_half", (a.args[0],), a),)) if _rotates(b, a, back=True) else None,
    ),  # cat(x2, -x1) -> -rotate_half(x): the rotation the other way
    (
        "interleave2",
        lambda a, b: ("neg", (_fresh("rotate_pairs", (a.args[0],), a),)) if _rotates(b, a, "pairs", True) else None,
    ),  # stack((x[..., 1::2], -x[..., ::2]), -1).flatten(-2) -> -rotate_pairs(x)
    ("row_slice", lambda z: _sliced_linear(z)),  # linear(h, W[, b])[rows] -> linear(h[rows], W[, b])
]


def _sliced_linear(z) -> tuple | None:
    """Rows of linear(h, W) (or of its cast) are linear of those rows of h: a loop that shifts its
    logits (logits[:, :-1]) then reads the LM head of h[:, :-1], which no fx node computes yet."""
    cast = None
    if _is(z, "cast") and _is(z.args[0], "linear"):
        cast, z = z, z.args[0]
    if not _is(z, "linear") or not isinstance(z.args[0], CNode):
        return None
    h, *params = z.args  # the weight, and the bias where there is one
    index = _pending_index[-1]
    rows = _made(h, index)
    if rows is None:
        return None
    if cast is None:
        return "linear", (rows, *params), ()
    lin = CNode("linear", (rows, *params), (), cast.fx, list(cast.cover), name=f"{cast.name}_rows")
    _pending.append(lin)
    return "cast", (lin, cast.args[1]), ()


def _made(h: CNode, index: tuple) -> CNode | None:
    """h[index] (index over the leading dims) as a canonical node no fx node computes yet."""
    meta = h.meta
    if not isinstance(meta, torch.Tensor) or meta.dim() != len(index) + 1:
        return None
    try:
        value = meta[index]
    except Exception:  # noqa: BLE001 - an example value that cannot be sliced: no rewrite
        return None

    def make(graph, fx_of):
        return graph.call_function(operator.getitem, (fx_of(h), index))

    n = CNode("row_slice", (h,), (("index", index),), None, [], name=f"{h.name}_rows", value=value, make=make)
    _pending.append(n)
    return n


def _recast(a, dt) -> bool:
    """a is a cast to dt already (a model's `logits.float()` that the loss function casts again),
    read by nothing else than this cast and the graph's output: merged into this cast, it leaves
    no value another site or the model reads (a norm's output, cast again by the next norm, stays
    its own node)."""
    if not (_is(a, "cast") and isinstance(dt, torch.dtype) and a.args[1] == dt) or a.fx is None:
        return False
    return sum(u.op != "output" for u in a.fx.users) <= 1


def _rotates(a, b, parts: str = "half", back: bool = False) -> bool:
    """Two parts of one tensor, the second negated and put first: cat((-x[..., D/2:], x[..., :D/2]))
    of its halves ("half"), or interleave(-x[..., 1::2], x[..., ::2]) of its (even, odd) pairs
    ("pairs"). back: the rotation the other way, read from its second part first (the caller
    passes cat((x[..., D/2:], -x[..., :D/2])) as (-x[..., :D/2], x[..., D/2:])): a the negated
    first part, b the second."""
    neg, plain = (0, 1) if back else (1, 0)
    return (
        _is(a, "neg")
        and _is(a.args[0], parts)
        and a.args[0].attr("part") == neg
        and _is(b, parts)
        and b.attr("part") == plain
        and a.args[0].args[0] is b.args[0]
        and a.args[0].attr("first") == b.attr("first")  # both of one split (an odd width's: one split point)
    )


_pending: list[CNode] = []
_pending_index: list = []  # the attr "index" of the node a rule is rewriting


def _fresh(op, args, covering: CNode) -> CNode:
    """A canonical node created by a rule, standing for the fx node(s) of `covering`."""
    n = CNode(op, tuple(args), (), covering.fx, list(covering.cover), name=f"{covering.name}_{op}")
    _pending.append(n)
    return n


def apply_rules(nodes: list, n: CNode) -> None:
    """Rewrite n in place by the first rule that fires, until none does; the nodes a rule creates go
    into `nodes` (the graph's, in order) before n."""
    changed = True
    while changed:
        changed = False
        for op, rule in RULES:
            if n.op != op:
                continue
            _pending_index.append(n.attr("index"))
            try:
                out = rule(*n.args)
            finally:
                _pending_index.pop()
            if out is not None:
                old = n.args
                n.op, n.args = out[:2]
                if len(out) > 2:  # a rule that changes the op's options too
                    n.attrs = out[2]
                _absorb(n, old)
                for p in _pending:  # nodes a rule created go before the node that uses them
                    nodes.insert(nodes.index(n), p)
                _pending.clear()
                changed = True
                break


def _absorb(n: CNode, old_args) -> None:
    """Nodes a rewrite made unreachable from n (the halves and the negation of a rotate_half) are
    now part of what n stands for: replacing n must remove them too. If anything else reads them,
    the matcher sees their fx nodes used outside the site and refuses the match."""
    still = _upstream(n.args)  # what n reads now is not absorbed (h, under a sliced LM head)
    seen, stack = set(), [a for a in old_args if isinstance(a, CNode)]
    while stack:
        d = stack.pop()
        if id(d) in seen or d.op == "input" or id(d) in still:
            continue
        seen.add(id(d))
        n.cover.extend(c for c in d.cover if c not in n.cover)
        stack.extend(d.inputs())


def _upstream(args) -> set:
    """ids of the canonical nodes `args` are computed from, themselves included."""
    seen, stack = set(), [a for a in args if isinstance(a, CNode)]
    while stack:
        d = stack.pop()
        if id(d) not in seen:
            seen.add(id(d))
            stack.extend(d.inputs())
    return seen
