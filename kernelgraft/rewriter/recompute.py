"""A recomputed output made by its site's backward kernel (lower stage, inductor's post-grad graphs).

With recompute on (replace.rewrite tags the sites), AOT autograd's partitioner puts the forward
kernel call again into the backward graph, for the matmuls that read its output (their weight
gradients), next to the site's backward kernel, which reads the same arguments:

    y, stats = <site>(x, w)                  # the forward kernel, run again: reads x, writes y
    dW = mm(dq^T, y)                         # the readers of y
    dx, dw = <site>_bwd(dy, x, w, stats)     # reads dy and x again

Here both become one pass over the rows, `<site>_bwdo(dy, x, w) -> (dx, dw, y)`, which makes the
statistics and y from the row it loads anyway. y's readers move after it (they only wait for the
gradient they multiply y by). Per site one read of x and one launch fewer: at the Llama-3.2-1B
step, the gated MLP's forward read its two 16384 x 8192 inputs again.

A site is left as it is where a reader of y is also needed to make dy (the final norm's output
feeds the LM head's backward, which makes that norm's dy): the pass never makes a cycle.

Then (accumulate_into_gradients) a norm's input gradient that is only added to another gradient
made before the call (a decoder's residual stream) is stored with it added, by `_bwdoa`: the
add's launch, and its read and write of the rows, go.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..kernels import FAMILIES
from ..kernels.rows.ops import accumulating_input


def _sites() -> tuple[dict, dict]:
    """The recomputed ops defined so far: {forward overload: op}, {backward overload: op}."""
    fwd, bwd = {}, {}
    for family in FAMILIES.values():
        for op in family.recomputed_ops():
            fwd[op.fwd] = op
            bwd[op.bwd] = op
    return fwd, bwd


def _getitems(n: fx.Node, index: int) -> list[fx.Node]:
    return [
        u for u in n.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == index
    ]


def _pure(n: fx.Node) -> bool:
    """A node that may move later: it mutates nothing (moving a mutation could reorder it with the
    nodes that read what it writes)."""
    if n.op != "call_function":
        return False
    if isinstance(n.target, torch._ops.OpOverload):
        return not n.target._schema.is_mutable
    return n.target is operator.getitem


def _feeds(nodes: set, roots, order: dict) -> bool:
    """Whether any of `nodes` is an input, direct or not, of the `roots`. The walk up stops at the
    first of `nodes` in graph order: nothing earlier can be one of them."""
    floor = min(order[n] for n in nodes)
    seen, todo = set(), [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen or order[n] < floor:
            continue
        if n in nodes:
            return True
        seen.add(n)
        todo += n.all_input_nodes
    return False


def fuse_recomputed_outputs(graph: fx.Graph) -> int:
    """Rewrite every (recomputed forward, backward) pair of a site as one `_bwdo` call; -> how many."""
    fwd_ops, bwd_ops = _sites()
    if not bwd_ops:
        return 0
    done = 0
    for b in [n for n in graph.nodes if n.op == "call_function" and n.target in bwd_ops]:
        op = bwd_ops[b.target]
        grad, *args, stats, needs = b.args
        if not (
            isinstance(stats, fx.Node)
            and stats.target is operator.getitem
            and stats.args[1] == 1
            and isinstance(stats.args[0], fx.Node)
            and fwd_ops.get(stats.args[0].target) is op
        ):
            continue
        f = stats.args[0]
        if list(f.args) != list(args) or f.kwargs or b.kwargs:
            continue
        if any(u.target is not operator.getitem for u in f.users):
            continue
        ys = _getitems(f, 0)
        order = {n: i for i, n in enumerate(graph.nodes)}
        # y's readers (and theirs) that come before the backward call move after it: none may be
        # needed to make the backward's own inputs
        readers, todo = set(), [u for y in ys for u in y.users]
        while todo:
            n = todo.pop()
            if n in readers or order[n] > order[b]:
                continue
            readers.add(n)
            todo += list(n.users)
        if readers and (not all(map(_pure, readers)) or _feeds(readers, [grad, *args], order)):
            continue
        with graph.inserting_before(b):
            fused = graph.call_function(op.bwd_out, (grad, *args, needs))
            # the output follows one gradient per tensor argument
            y_new = graph.call_function(operator.getitem, (fused, len(op.spelling.tensor_names)))
        if "val" in b.meta and "val" in f.meta:
            fused.meta["val"] = [*b.meta["val"], f.meta["val"][0]]
            y_new.meta["val"] = f.meta["val"][0]
        for key in ("stack_trace", "seq_nr"):
            if key in b.meta:
                fused.meta[key] = b.meta[key]
        for y in ys:
            y.replace_all_uses_with(y_new)
        b.replace_all_uses_with(fused)
        at = y_new
        for n in sorted(readers, key=order.__getitem__):
            at.append(n)
            at = n
        graph.erase_node(b)
        for n in [*ys, *_getitems(f, 1)]:
            if not n.users:
                graph.erase_node(n)
        if not f.users:
            graph.erase_node(f)
        done += 1
    return done


def _accumulating_ops() -> dict:
    """{_bwdo overload: op} of the recomputed ops defined so far that have an accumulating variant."""
    return {
        op.bwd_out: op
        for family in FAMILIES.values()
        for op in family.recomputed_ops()
        if getattr(op, "bwd_out_acc", None) is not None
    }


def _norm_input(op, args: list) -> torch.Tensor | None:
    """The first argument's fake value where the call's kernels accumulate (a norm), else None."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    if any(isinstance(a, fx.Node) and not isinstance(v, torch.Tensor) for a, v in zip(args, vals)):
        return None
    return accumulating_input(op.spelling, vals)


def accumulate_into_gradients(graph: fx.Graph) -> int:
    """Each `add(dx, r)` of a norm's input gradient dx (from its `_bwdo` call, read by nothing else)
    and another gradient r of the same shape and dtype, made before that call (the residual
    stream's, in a decoder) -> the `_bwdoa` call, which stores dx + r where it stored dx: rounded
    as eager rounds dx, then the sum. One launch and one pass over the rows fewer per norm;
    -> how many."""
    ops = _accumulating_ops()
    if not ops:
        return 0
    done = 0
    for f in [n for n in graph.nodes if n.op == "call_function" and n.target in ops]:
        op = ops[f.target]
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
        vo, vu = other.meta.get("val"), u.meta.get("val")
        if x is None or not isinstance(vo, torch.Tensor) or not isinstance(vu, torch.Tensor):
            continue
        if tuple(vo.shape) != tuple(x.shape) or vo.dtype != x.dtype or vu.dtype != x.dtype:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
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
    return done
