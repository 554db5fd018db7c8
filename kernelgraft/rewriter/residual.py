"""A decoder's residual stream joined to its norms' kernels (lower stage, inductor's post-grad graphs).

A decoder layer adds each sublayer's output to the residual stream and norms the sum at once; the
backward adds each norm's input gradient to the stream's gradient:

    h = add(r, o)                   # forward: the stream, read on by the next add
    y, stats = <norm>(h, w)
    ...
    dx, dw, y = <norm>_bwdo(dy, h, w)       # backward (recompute.py's one pass)
    dr = add(dx, dr_next)

inductor would fuse such an add into a norm it generated itself; a kernelgraft norm is an op it
cannot look into, so each add stays a launch of its own with a read and a write of the rows. Here
each joins the norm's pass: `<norm>_fwda(r, o, w) -> (y, stats, h)` makes h as it loads the rows and
stores it for the stream (add_into_norms); `<norm>_bwdoa(dy, h, w, dr_next)` stores dx + dr_next
where it stored dx (accumulate_into_gradients). Both round as eager does: the sum rounded to the
tensors' dtype, from the values eager's add would read. At the 135M Llama step: 61 adds of the
forward and 60 of the backward.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..kernels import FAMILIES, family_of
from ..kernels.family import defined_ops
from .recompute import _getitems


def _accumulating_ops() -> dict:
    """{_bwdo overload: op} of the recomputed ops defined so far that have an accumulating variant."""
    return {
        op.bwd_out: op
        for family in FAMILIES.values()
        for op in family.recomputed_ops()
        if getattr(op, "bwd_out_acc", None) is not None
    }


def _norm_input(op, args: list, check: str = "accumulating_input") -> torch.Tensor | None:
    """The first argument's fake value where the op's family's `check` (accumulating_input,
    adding_input) finds the call's kernels have the variant (a norm), else None."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    if any(isinstance(a, fx.Node) and not isinstance(v, torch.Tensor) for a, v in zip(args, vals)):
        return None
    return getattr(family_of(op.spelling), check)(op.spelling, vals)


def _calls(graph: fx.Graph, ops: dict) -> list:
    """(node, op) for each node of `graph` that runs an overload in `ops` ({overload: op}), in graph order."""
    if not ops:
        return []
    return [(n, ops[n.target]) for n in graph.nodes if n.op == "call_function" and n.target in ops]


def _same_value(n: fx.Node, like: torch.Tensor) -> bool:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(like.shape) and v.dtype == like.dtype


def accumulate_into_gradients(graph: fx.Graph) -> int:
    """Each `add(dx, r)` of a norm's input gradient dx (from its `_bwdo` call, read by nothing else)
    and another gradient r of the same shape and dtype, made before that call (the residual
    stream's, in a decoder) -> the `_bwdoa` call, which stores dx + r where it stored dx: rounded
    as eager rounds dx, then the sum. One launch and one pass over the rows fewer per norm;
    -> how many."""
    done = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for f, op in _calls(graph, _accumulating_ops()):
        grad, *args, needs = f.args
        if f.kwargs or not isinstance(needs, (list, tuple)) or not needs or not needs[0]:
            continue
        gx = _getitems(f, 0)
        if len(gx) != 1 or len(gx[0].users) != 1:
            continue
        gx = gx[0]
        (u,) = gx.users
        if u.op != "call_function" or u.target is not torch.ops.aten.add.Tensor or u.kwargs or len(u.args) != 2:
            continue
        other = u.args[1] if u.args[0] is gx else u.args[0]
        if not isinstance(other, fx.Node) or other is gx:
            continue
        x = _norm_input(op, args)
        if x is None or not (_same_value(other, x) and _same_value(u, x)):
            continue
        if order[other] > order[f]:  # r must exist where f runs
            continue
        with graph.inserting_before(f):
            n = graph.call_function(op.bwd_out_acc, (grad, *args, other, needs))
        n.meta.update(f.meta)
        f.replace_all_uses_with(n)
        u.replace_all_uses_with(gx)
        graph.erase_node(u)
        graph.erase_node(f)
        done += 1
        order = {n: i for i, n in enumerate(graph.nodes)}  # with the nodes just added
    return done


def _adding_ops() -> dict:
    """{forward overload: op} of the row ops defined so far that have the adding forward."""
    return {op.fwd: op for op in defined_ops() if getattr(op, "fwd_add", None) is not None}


def add_into_norms(graph: fx.Graph) -> int:
    """Each norm op whose first argument is `add(a, b)` of two tensors of its shape and dtype
    (the residual stream plus a sublayer's output) -> the `_fwda` call, which makes and stores the
    sum as it loads the rows; the add's other readers read the stored sum. -> how many."""
    done = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for f, op in _calls(graph, _adding_ops()):
        sp = op.spelling
        if f.kwargs:
            continue
        first = sp.arg_names.index(sp.tensor_names[0])
        args = list(f.args)
        u = args[first]
        if not (
            isinstance(u, fx.Node)
            and u.op == "call_function"
            and u.target is torch.ops.aten.add.Tensor
            and len(u.args) == 2
            and not u.kwargs
            and all(isinstance(t, fx.Node) for t in u.args)
        ):
            continue
        x = _norm_input(op, args, "adding_input")
        if x is None or not all(_same_value(t, x) for t in (*u.args, u)):
            continue
        # the fused op goes where the add was (its readers may come before the norm): its other inputs must be made by then
        if any(isinstance(a, fx.Node) and order[a] > order[u] for i, a in enumerate(args) if i != first):
            continue
        rest = [a for i, a in enumerate(args) if i != first]
        with graph.inserting_before(u):
            n = graph.call_function(op.fwd_add, (*u.args, *rest))
            h = graph.call_function(operator.getitem, (n, 2))
        for key in ("stack_trace", "seq_nr"):
            if key in f.meta:
                n.meta[key] = f.meta[key]
        if "val" in f.meta and "val" in u.meta:
            n.meta["val"] = (*f.meta["val"], u.meta["val"])
            h.meta["val"] = u.meta["val"]
        u.replace_all_uses_with(h)
        f.replace_all_uses_with(n)
        graph.erase_node(f)
        graph.erase_node(u)
        done += 1
        order = {n: i for i, n in enumerate(graph.nodes)}  # with the nodes just added
    return done
