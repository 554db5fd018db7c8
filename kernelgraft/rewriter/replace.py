"""Step 3 of 4: replace. Each match -> one call of the spelling's custom op; the matched nodes that
are then dead are erased. Sites the kernel cannot serve (extra_check, dtype, shape) keep the stock
subgraph and are reported as fallbacks; failed attempts that got far become near-misses.
"""

from __future__ import annotations

import math
import operator

import torch

from ..ir import CGraph, CNode
from ..kernels import Unsupported, op_for, row_kernel
from ..kernels.rowkernel import MAX_N, layout
from ..patterns.registry import Site
from .canonicalize import canonicalize
from .match import Match, Matcher, describe, module_path, resemble
from .report import NearMiss, RewriteReport, SiteRecord


def _site_record(m: Match) -> SiteRecord:
    sp = m.spelling
    shapes, dtypes = {}, {}
    for name, node in m.tensors.items():
        meta = node.meta
        if meta is not None:
            shapes[name] = tuple(int(s) if isinstance(s, int) else s for s in meta.shape)
            dtypes[name] = str(meta.dtype).replace("torch.", "")
    return SiteRecord(sp.pattern, sp.name, module_path(m.output.fx), shapes, dtypes, dict(m.scalars))


def _refusal(m: Match, rounding: str) -> str | None:
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
    first = metas[sp.tensor_names[0]]
    N = first.shape[-1] if first.dim() else 1
    if isinstance(N, int) and N > MAX_N:
        return f"rows of {N} elements; generated kernels serve at most {MAX_N}"
    try:
        lay = layout(sp, metas)
        row_kernel(sp, {n: t.dtype for n, t in metas.items()}, lay.kinds, rounding)
    except (Unsupported, ValueError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a generator failure falls back, reported, never wrong
        return f"kernel generation failed: {type(e).__name__}: {e}"
    return None


def _rewrite(gm: torch.fx.GraphModule, m: Match, redirect: dict, rounding: str) -> None:
    sp = m.spelling
    op = op_for(sp, rounding)
    args = []
    for a in sp.arg_names:
        if a in sp.scalar_names:
            args.append(float(m.scalars[a]))
        else:
            fx = m.tensors[a].fx
            args.append(redirect.get(fx, fx))
    out_fx = m.output.fx
    g = gm.graph
    with g.inserting_before(out_fx):
        call = g.call_function(op.fwd, tuple(args))
        new = g.call_function(operator.getitem, (call, 0))
    for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if k in out_fx.meta:
            call.meta[k] = new.meta[k] = out_fx.meta[k]
    if "example_value" in out_fx.meta:
        new.meta["example_value"] = out_fx.meta["example_value"]
    out_fx.replace_all_uses_with(new)
    redirect[out_fx] = new
    for n in reversed(list(g.nodes)):  # erase what the op now computes, if nothing else reads it
        if n in m.covered and not n.users and n.op != "placeholder":
            g.erase_node(n)


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
    gm: torch.fx.GraphModule, spellings, *, dry_run: bool = False, rounding: str = "autograd"
) -> RewriteReport:
    """Run canonicalize -> match -> replace over one dynamo graph; edit it unless dry_run.
    rounding: how the kernels round ('autograd' as eager PyTorch, 'fused' as inductor)."""
    rep = RewriteReport(graphs=1)
    cg: CGraph = canonicalize(gm.graph)
    taken: set = set()
    redirect: dict = {}
    failures = []
    # larger spellings first: Gemma's (1 + w) norm is also OLMo-2's norm with weight := 1 + w, and the
    # more specific match takes more of the graph into the kernel
    for sp in sorted(spellings, key=lambda s: -len(s.canonical().nodes)):
        pg = sp.canonical()
        matcher = Matcher(sp, pg)
        out = pg.output
        for anchor in [n for n in cg.nodes if n.op == out.op and n.attrs == out.attrs]:
            if anchor.fx in taken:
                continue
            res = matcher.attempt(anchor, taken)
            if not isinstance(res, Match):
                failures.append((sp, matcher.n_ops, anchor, res))
                continue
            rec = _site_record(res)
            why = _refusal(res, rounding)
            taken |= res.covered
            if why:
                rec.replaced, rec.reason = False, why
                rep.fallbacks.append(rec)
                continue
            rep.sites.append(rec)
            if not dry_run:
                _rewrite(gm, res, redirect, rounding)
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
    if not dry_run and rep.sites:
        gm.graph.lint()
        gm.recompile()
    return rep
