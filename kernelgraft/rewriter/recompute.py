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

Then residual.py joins the residual stream's adds to the norms' calls, the backward's among them.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..kernels import FAMILIES


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
