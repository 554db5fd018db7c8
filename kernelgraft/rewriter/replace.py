"""Replace: each match -> a single custom-op call from its family; the matched nodes that are then dead
are erased. Sites the kernel cannot serve (extra_check, dtype, shape) keep the stock subgraph and
are reported as fallbacks. Sites of one spelling that can share a launch (q and k of a layer) are
paired into one call.
"""

from __future__ import annotations

import operator

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ..ir.indexing import VIEWS
from ..kernels import family_of
from ..patterns import Site
from .match import Match, leaves_graph
from .report import SiteRecord, module_path

# node meta key: a kernel call whose outputs kernelgraft tagged for recompute (backend keeps it with
# the readers of its outputs when DDP cuts the graph)
RECOMPUTE_META = "kernelgraft_recompute"


def site_record(m: Match) -> SiteRecord:
    """What the report says of a matched site: module, argument shapes and dtypes, scalars."""
    sp = m.spelling
    shapes, dtypes = {}, {}
    for name, node in m.tensors.items():
        meta = node.meta
        if meta is not None:
            shapes[name] = tuple(int(s) if isinstance(s, int) else s for s in meta.shape)
            dtypes[name] = str(meta.dtype).replace("torch.", "")
    rec = SiteRecord(sp.pattern, sp.name, module_path(m.output.fx), shapes, dtypes, dict(m.scalars))
    first = m.tensors.get(sp.tensor_names[0]) if sp.tensor_names else None
    if first is not None and first.meta is not None:
        rec.device, rec.dtype = first.meta.device.type, dtypes.get(sp.tensor_names[0], "")
    return rec


def refusal(m: Match, options, training: bool) -> str | None:
    """Why the kernel cannot serve this site (None: it can)."""
    sp = m.spelling
    metas = {n: c.meta for n, c in m.tensors.items()}
    missing = [n for n, t in metas.items() if t is None]
    if missing:
        return f"no shape/dtype recorded for {missing}"
    if sp.extra_check is not None:
        why = sp.extra_check(Site(sp.pattern, sp.name, metas, dict(m.scalars)))
        if why:
            return why
    return family_of(sp).refusal(sp, metas, options.rounding, options, training)


def argument_nodes(gm: torch.fx.GraphModule, m: Match, redirect: dict) -> dict:
    """The fx node holding each tensor argument of the match: the node bound (or the one now
    standing for it), or, for a value a rewrite rule made (h[:, :-1] under a sliced LM head), a
    new node computing it, inserted where the graph inserts now."""
    made: dict = {}

    def fx_of(c):
        if c.fx is not None:
            return redirect.get(c.fx, c.fx)
        if id(c) not in made:
            made[id(c)] = c.make(gm.graph, fx_of)
            made[id(c)].meta["example_value"] = c.value
        return made[id(c)]

    return {name: fx_of(c) for name, c in m.tensors.items()}


def _made_shape(m: Match, named: dict) -> tuple | None:
    """The shape of what the op makes, where the site's output may have another: a match through a
    view that only adds or drops size-1 dims (a norm over one group, `x.view(*lead, 1, n)`) can
    end at a node of the viewed shape. The spelling run on meta tensors of the arguments' shapes;
    None where no view was covered or the run fails."""
    if not any(n.target in VIEWS for n in m.covered if n.op in ("call_function", "call_method")):
        return None
    sp = m.spelling
    try:
        args = [
            torch.empty_strided(c.meta.shape, c.meta.stride(), dtype=c.meta.dtype, device="meta")
            if a in sp.tensor_names
            else named[a]
            for a, c in ((a, m.tensors.get(a)) for a in sp.arg_names)
        ]
        with torch.no_grad():
            out = sp.fn(*args)
    except Exception:  # noqa: BLE001 - no shape to compare: the output is taken as made
        return None
    return tuple(out.shape) if isinstance(out, torch.Tensor) else None


def _shaped_as(g, new: torch.fx.Node, out_fx: torch.fx.Node, made: tuple | None) -> torch.fx.Node:
    """new reshaped to the site output's shape where the op makes the same values in another."""
    want = out_fx.meta.get("example_value")
    if made is None or not isinstance(want, torch.Tensor) or tuple(want.shape) == made:
        return new
    with g.inserting_after(new):
        return g.call_method("reshape", (new, tuple(want.shape)))


def copy_source_meta(nodes, like: torch.fx.Node) -> None:
    """Where the nodes standing for `like` came from: its module stack and source, for the report
    and for torch's own passes."""
    for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if k in like.meta:
            for n in nodes:
                n.meta[k] = like.meta[k]


def tag_recompute(node: torch.fx.Node, like: torch.fx.Node, policy) -> bool:
    """Selective activation checkpointing's tags, read by AOT autograd's partitioner (copied to the
    traced ops): recompute `node`'s output in the backward. Inside the user's activation
    checkpointing (`like` tagged already) its tags stand. -> whether kernelgraft's tag was set."""
    if "recompute" in like.meta:
        for k in ("recompute", "ac_graph_id"):
            if k in like.meta:
                node.meta[k] = like.meta[k]
        return False
    node.meta["recompute"] = policy
    node.meta["ac_graph_id"] = 1
    return True


def rewrite(gm: torch.fx.GraphModule, m: Match, redirect: dict, options) -> torch.fx.Node:
    """The match's subgraph -> a single op call (returned); `redirect` maps each replaced output
    to the node that now stands for it, for later sites that read it."""
    sp = m.spelling
    # recompute only an output the graph reads on: one that only leaves the graph is never saved for
    # the backward, and the tag would make the partitioner run the forward again just for the row
    # statistics its backward keeps (an RMSNorm or SwiGLU alone would run its forward twice)
    read_on = any(u.op != "output" for u in m.output.fx.users)
    recompute = bool(sp.recompute and options.recompute and read_on)
    family = family_of(sp)
    metas = {n: c.meta for n, c in m.tensors.items()}
    op = family.op(sp, options.rounding, recompute=recompute, options=options, metas=metas)
    out_fx = m.output.fx
    g = gm.graph
    with g.inserting_before(out_fx):
        tensors = argument_nodes(gm, m, redirect)
        named = {a: m.scalars[a] if a in sp.scalar_names else tensors[a] for a in sp.arg_names}
        args = op.bind(named, metas, options)
        call = g.call_function(op.fwd, tuple(args))
        new = g.call_function(operator.getitem, (call, 0))
    copy_source_meta([call, new], out_fx)
    # the user's checkpointing tags stand; else, with recompute, ours (its inputs are saved anyway)
    if ("recompute" in out_fx.meta or recompute) and tag_recompute(call, out_fx, CheckpointPolicy.PREFER_RECOMPUTE):
        call.meta[RECOMPUTE_META] = True  # ours (not the user's checkpointing): ddp.py keeps it whole
    new = _shaped_as(g, new, out_fx, _made_shape(m, named))
    if "example_value" in out_fx.meta:
        new.meta["example_value"] = out_fx.meta["example_value"]
    out_fx.replace_all_uses_with(new)
    redirect[out_fx] = new
    if m.withheld:  # what the graph returned there, the kernel never made: an empty marker instead
        like = args[0]
        for w in m.withheld:
            with g.inserting_before(out_fx):
                marker = g.call_function(family.withheld_marker(), (like,))
            for u in list(w.users):
                if u not in m.covered and leaves_graph(u):
                    _hand_out(g, w, u, marker)
    for n in reversed(list(g.nodes)):  # erase what the op now computes, if nothing else reads it
        if n in m.covered and not n.users and n.op != "placeholder":
            g.erase_node(n)
    return call


def _hand_out(g: torch.fx.Graph, value: torch.fx.Node, user: torch.fx.Node, marker: torch.fx.Node) -> None:
    """The marker returned where `user` handed `value` out of the graph, through the conversions
    between them (leaves_graph); the conversions, then unread, are erased."""
    if user.op == "output":
        user.replace_input_with(value, marker)
        return
    for u in list(user.users):
        _hand_out(g, user, u, marker)
    if not user.users:
        g.erase_node(user)


def plan_pairs(entries: list, dry_run: bool) -> list[tuple]:
    """Which sites share a launch: sites of one spelling whose arguments are the same nodes but for
    the first tensor (q and k of a layer, with one cos and sin), when the graph order allows it: at
    the first site if the second's inputs exist there, else at the second if nothing read the first. entries: (record, spelling, node, args):
    the custom-op call and None, or in a dry run the matched output and the bound arguments -> [(entry, entry, entry where the launch goes)]."""
    if len(entries) < 2:
        return []
    order = {n: i for i, n in enumerate(entries[0][2].graph.nodes)}

    def args_of(e):
        return e[2].args if e[3] is None else e[3]

    def readers(node):
        return list(node.users) if dry_run else [u for gi in node.users for u in gi.users]

    by_key: dict = {}
    for e in sorted(entries, key=lambda e: order[e[2]]):
        args = args_of(e)
        first = next(i for i, a in enumerate(args) if isinstance(a, torch.fx.Node))
        key = (e[1], first, tuple(a for i, a in enumerate(args) if i != first))
        by_key.setdefault(key, []).append(e)

    def inputs_of(e):
        return [a for a in args_of(e) if isinstance(a, torch.fx.Node)]

    pairs = []
    for members in by_key.values():
        while len(members) >= 2:
            e0, e1 = members[0], members[1]
            if all(order[a] < order[e0[2]] for a in inputs_of(e1)):
                pairs.append((e0, e1, e0))  # launch where the first site was: the second's inputs exist
            elif all(order[u] > order[e1[2]] for u in readers(e0[2])):
                pairs.append((e0, e1, e1))  # launch where the second site was: nothing read the first yet
            else:
                members.pop(0)
                continue
            members[:2] = []
    return pairs


def pair_launches(gm: torch.fx.GraphModule, pairs: list, rounding: str) -> None:
    """A paired custom-op launch in place of each two single ones."""
    g = gm.graph
    for (r0, sp, c0, _), (r1, _, c1, _), (_, _, at, _) in pairs:
        pair = family_of(sp).pair_op(sp, rounding)
        tensor_args_1 = [a for a in c1.args if isinstance(a, torch.fx.Node)]
        with g.inserting_before(at):
            pc = g.call_function(pair.fwd, (*c0.args, *tensor_args_1))
            outs = [g.call_function(operator.getitem, (pc, i)) for i in (0, 1)]
        for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if k in c1.meta:
                pc.meta[k] = c1.meta[k]
        for new, old in zip(outs, (c0, c1)):
            (gi,) = old.users
            new.meta.update({k: v for k, v in gi.meta.items() if k in _META})
            gi.replace_all_uses_with(new)
            g.erase_node(gi)
            g.erase_node(old)
        r0.paired = r1.paired = True


_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "example_value")

def insert_probe(gm, probe, rec, sp, before, args) -> None:
    """A dry run's probe: the graph stays stock, but calls probe(rec, spelling, values)
    with the values the site's arguments take at run time (what kernelgraft.audit checks)."""

    def kernelgraft_probe(*values):
        probe(rec, sp, values)

    with gm.graph.inserting_before(before):
        gm.graph.call_function(kernelgraft_probe, tuple(args))
