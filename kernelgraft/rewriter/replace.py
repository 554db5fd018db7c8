"""Step 3 of 4: replace. Each match -> one call of the spelling's custom op; the matched nodes that
are then dead are erased. Sites the kernel cannot serve (extra_check, dtype, shape) keep the stock
subgraph and are reported as fallbacks; failed attempts that got far become near-misses.
"""

from __future__ import annotations

import math
import operator

import torch

from ..ir import CGraph, CNode
from ..kernels import op_for, refusal
from ..kernels.ops import pair_op_for
from ..patterns.registry import Site
from .attention import make_causal, static_only
from .canonicalize import canonicalize
from .match import Failure, Match, Matcher, describe, module_path, resemble
from .report import NearMiss, RewriteReport, SiteRecord

# node meta key: a kernel call whose outputs kernelgraft tagged for recompute (backend keeps it with
# the readers of its outputs when DDP cuts the graph)
RECOMPUTE_META = "kernelgraft_recompute"


def _site_record(m: Match) -> SiteRecord:
    sp = m.spelling
    shapes, dtypes = {}, {}
    for name, node in m.tensors.items():
        meta = node.meta
        if meta is not None:
            shapes[name] = tuple(int(s) if isinstance(s, int) else s for s in meta.shape)
            dtypes[name] = str(meta.dtype).replace("torch.", "")
    return SiteRecord(sp.pattern, sp.name, module_path(m.output.fx), shapes, dtypes, dict(m.scalars))


def _refusal(m: Match, rounding: str, options: dict) -> str | None:
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
    return refusal(sp, metas, rounding, options)


def _rewrite(
    gm: torch.fx.GraphModule, m: Match, redirect: dict, rounding: str, options: dict
) -> torch.fx.Node:
    sp = m.spelling
    # recompute only an output the graph reads on: one that only leaves the graph is never saved for
    # the backward, and the tag would make the partitioner run the forward again just for the row
    # statistics its backward keeps (seen on an H200: RMSNorm and SwiGLU alone ran their forward
    # twice per fwd+bwd)
    read_on = any(u.op != "output" for u in m.output.fx.users)
    recompute = bool(sp.recompute and options.get("recompute", True) and read_on)
    op = op_for(sp, rounding, recompute=recompute)
    named = {
        a: m.scalars[a] if a in sp.scalar_names else redirect.get(m.tensors[a].fx, m.tensors[a].fx)
        for a in sp.arg_names
    }
    args = op.bind(named, {n: c.meta for n, c in m.tensors.items()}, options)
    out_fx = m.output.fx
    g = gm.graph
    with g.inserting_before(out_fx):
        call = g.call_function(op.fwd, tuple(args))
        new = g.call_function(operator.getitem, (call, 0))
    for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if k in out_fx.meta:
            call.meta[k] = new.meta[k] = out_fx.meta[k]
    if "recompute" in out_fx.meta:  # inside the user's activation checkpointing: its tags stand
        for k in ("recompute", "ac_graph_id"):
            if k in out_fx.meta:
                call.meta[k] = out_fx.meta[k]
    elif recompute:
        # selective activation checkpointing's tags, read by AOT autograd's partitioner (copied to
        # the traced op): recompute this output in the backward; its inputs are saved anyway
        from torch.utils.checkpoint import CheckpointPolicy

        call.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        call.meta["ac_graph_id"] = 1
        call.meta[RECOMPUTE_META] = True  # ours (not the user's checkpointing): backend keeps it whole
    if "example_value" in out_fx.meta:
        new.meta["example_value"] = out_fx.meta["example_value"]
    out_fx.replace_all_uses_with(new)
    redirect[out_fx] = new
    if m.withheld:  # what the graph returned there, the kernel never made: an empty marker instead
        from ..kernels.lm_head import withheld_logits_op

        like = args[0]
        for w in m.withheld:
            with g.inserting_before(out_fx):
                marker = g.call_function(withheld_logits_op(), (like,))
            for u in list(w.users):
                if u.op == "output":
                    u.replace_input_with(w, marker)
    for n in reversed(list(g.nodes)):  # erase what the op now computes, if nothing else reads it
        if n in m.covered and not n.users and n.op != "placeholder":
            g.erase_node(n)
    return call


def _plan_pairs(entries: list, dry_run: bool) -> list[tuple]:
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


def _pair_launches(gm: torch.fx.GraphModule, pairs: list, rounding: str) -> None:
    """One paired custom-op call in place of each pair of single calls."""
    g = gm.graph
    for (r0, sp, c0, _), (r1, _, c1, _), (_, _, at, _) in pairs:
        pair = pair_op_for(sp, rounding)
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

_GENERIC = frozenset({"add", "sub", "mul", "div", "neg", "cast", "input"})


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


def _near_miss(sp, n_ops: int, anchor, f) -> NearMiss | None:
    """A failed attempt worth reporting: at least half the pattern lines up, and what lines up, or
    where it differs, is an op that says something (a reduction, rsqrt, rotate_half, an activation),
    not only multiplies and casts that any code has."""
    pg = sp.canonical()
    score, first = resemble(pg.output, anchor, {})
    if f.matched >= score:  # the matcher got as far: its reason is the more precise one
        score, first, reason = f.matched, (f.pnode, f.mnode), f.reason
    else:
        reason = f"expected {describe(first[0])}, got {describe(first[1])}" if first else f.reason
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


def graft(
    gm: torch.fx.GraphModule,
    spellings,
    *,
    dry_run: bool = False,
    rounding: str = "autograd",
    options: dict | None = None,
) -> RewriteReport:
    """Run canonicalize -> match -> replace over one dynamo graph; edit it unless dry_run.
    rounding: how the kernels round ('autograd' as eager PyTorch, 'fused' as inductor).
    options: keep_logits (bool), lm_head_chunk (tokens), lm_head_accumulate ('fp32' | 'weight'),
    assume_training (bool), probe (with dry_run: a callable given each served site's run-time values)."""
    options = options or {}
    rep = RewriteReport(graphs=1)
    if options.get("causal_attention", True):  # before canonicalize: it edits the fx graph itself
        # True: masks read from graph inputs too, checked at run time (the backend runs the checks);
        # "static": only masks proven on the graph (the graph a failed check falls back to)
        done, kept = make_causal(gm, edit=not dry_run, runtime=options.get("causal_attention", True) is True)
        rep.sites += done
        rep.masks_kept += kept
    cg: CGraph = canonicalize(gm.graph)
    taken: set = set()
    redirect: dict = {}
    failures = []
    entries: list = []  # replaced sites, for pairing
    # larger spellings first: Gemma's (1 + w) norm is also OLMo-2's norm with weight := 1 + w, and the
    # more specific match takes more of the graph into the kernel
    for sp in sorted(spellings, key=lambda s: -len(s.canonical().nodes)):
        pg = sp.canonical()
        matcher = Matcher(sp, pg, allow_withhold=not options.get("keep_logits", False))
        out = pg.output
        for anchor in [n for n in cg.nodes if n.op == out.op]:
            if anchor.fx in taken:
                continue
            if anchor.attrs != out.attrs:  # other options of the op: reported as a near miss, not matched
                failures.append(
                    (
                        sp,
                        matcher.n_ops,
                        anchor,
                        Failure(0, out, anchor, f"expected {describe(out)}, got {describe(anchor)}"),
                    )
                )
                continue
            res = matcher.attempt(anchor, taken)
            if not isinstance(res, Match):
                failures.append((sp, matcher.n_ops, anchor, res))
                continue
            rec = _site_record(res)
            why = _refusal(res, rounding, options)
            taken |= res.covered
            if why:
                rec.replaced, rec.reason = False, why
                rep.fallbacks.append(rec)
                continue
            rec.withheld = [w.name for w in res.withheld]
            rep.sites.append(rec)
            if not dry_run:
                call = _rewrite(gm, res, redirect, rounding, options)
                entries.append((rec, sp, call, None))
            else:
                args = tuple(res.tensors[a].fx if a in res.tensors else res.scalars[a] for a in sp.arg_names)
                entries.append((rec, sp, res.output.fx, args))
                if options.get("probe") is not None:
                    _insert_probe(gm, options["probe"], rec, sp, res.output.fx, args)
    best: dict = {}
    for sp, n_ops, anchor, f in failures:
        if anchor.fx in taken:
            continue
        nm = _near_miss(sp, n_ops, anchor, f)
        if nm is None:
            continue
        key = (nm.module, sp.pattern)
        if key not in best or nm.matched > best[key].matched:
            best[key] = nm
    rep.near_misses = list(best.values())
    pairs = _plan_pairs(entries, dry_run)
    if dry_run:
        for (r0, *_), (r1, *_), _ in pairs:
            r0.paired = r1.paired = True
    else:
        _pair_launches(gm, pairs, rounding)
    if rep.sites and (not dry_run or options.get("probe") is not None):
        gm.graph.lint()
        gm.recompile()
    for body in _checkpointed_bodies(gm):
        # a region under torch.utils.checkpoint (Hugging Face's gradient checkpointing: one per
        # decoder layer) is a graph of its own, called through a higher-order op: graft it too. Its
        # mask arrives as an input there, and run-time checks wrap only the outer graph: static proofs
        rep.add(graft(body, spellings, dry_run=dry_run, rounding=rounding, options=static_only(options)))
    return rep


def _checkpointed_bodies(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """The graphs of the activation-checkpointed regions gm calls (dynamo's
    tag_activation_checkpoint higher-order op, its body a get_attr of gm), each once."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    out: dict = {}
    for n in gm.graph.nodes:
        if hop is not None and n.op == "call_function" and n.target is hop and n.args:
            b = n.args[0]
            if isinstance(b, torch.fx.Node) and b.op == "get_attr":
                body = getattr(gm, b.target, None)
                if isinstance(body, torch.fx.GraphModule):
                    out[id(body)] = body
    return list(out.values())


def _insert_probe(gm, probe, rec, sp, before, args) -> None:
    """Dry run with options['probe']: the graph stays stock, but calls probe(rec, spelling, values)
    with the values the site's arguments take at run time (what kernelgraft.audit checks)."""

    def kernelgraft_probe(*values):
        probe(rec, sp, values)

    with gm.graph.inserting_before(before):
        gm.graph.call_function(kernelgraft_probe, tuple(args))
