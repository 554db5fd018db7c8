"""graft(): the passes over one dynamo graph, in the order they run. Read top to bottom:

    causal masks   SDPA masks proven causal -> is_causal=True (edits the fx graph: before the rest)
    canonicalize   fx graph -> canonical DAG (ir/canonicalize.py), the fx graph untouched
    match+replace  each spelling at each anchor (larger spellings first): a match is refused by its
                   family (kept as stock code, reported) or replaced by one custom-op call
    near misses    failed attempts that got far, the best per module and pattern
    pair          sites of one spelling that can share a launch -> one call (q and k of a layer)
    tile          token-wise regions of a training graph -> one op over tiles of the sequence
    projections   linear layers that read one input -> one matmul, where the host sets the pace
    finish         lint and recompile an edited graph
    regions        graphs under activation checkpointing, grafted the same way

The graph is then lowered by the backend (backend.py). Every pass adds to one RewriteReport.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..ir import CGraph, canonicalize
from ..kernels import served_kinds
from ..kernels.fallback import register_site, site_key
from ..options import Options
from . import projections as _projections
from . import tiling
from .attention import make_causal
from .match import Failure, Match, Matcher, describe, near_miss
from .replace import argument_nodes, insert_probe, pair_launches, plan_pairs, refusal, rewrite, site_record
from .report import RewriteReport, Unserved, own_modules, readable_path
from .runs import under_layers


@dataclass
class Graft:
    """One graph being grafted: what the passes read, and what they have found so far."""

    gm: torch.fx.GraphModule
    spellings: list
    options: Options
    dry_run: bool = False  # report only: the graph is left as captured (but for a probe)
    probe: Callable | None = None  # a dry run's hook: probe(record, spelling, values) per served site
    training: bool = True  # the sites run with gradients (the LM head is fused only then)
    runtime_masks: bool = True  # masks read from graph inputs may be checked at run time
    heads: tuple = ()  # the model's output embeddings (output_heads): where an LM head + loss is expected
    # where the model's code read logits an earlier capture withheld, after the graph (its line):
    # this graph then returns them ("": none read)
    logits_read: str = ""
    report: RewriteReport = field(default_factory=lambda: RewriteReport(graphs=1))
    canonical: CGraph | None = None
    taken: set = field(default_factory=set)  # fx nodes of the sites matched so far
    redirect: dict = field(default_factory=dict)  # replaced output -> the node standing for it
    failures: list = field(default_factory=list)  # (spelling, ops, anchor, Failure)
    entries: list = field(default_factory=list)  # served sites, for pairing


def causal_masks(g: Graft) -> None:
    if not g.options.causal_attention:
        return
    # masks that read graph inputs are checked at run time (the backend runs the checks) where the
    # graph's caller can be wrapped; elsewhere only masks proven on the graph are rewritten
    done, kept = make_causal(g.gm, edit=not g.dry_run, runtime=g.runtime_masks)
    g.report.sites += done
    g.report.masks_kept += kept


def canonicalize_graph(g: Graft) -> None:
    g.canonical = canonicalize(g.gm.graph)


def match_and_replace(g: Graft) -> None:
    # larger spellings first: Gemma's (1 + w) norm is also OLMo-2's norm with weight := 1 + w, and the
    # more specific match takes more of the graph into the kernel
    for sp in sorted(g.spellings, key=lambda s: -len(s.canonical().nodes)):
        pg = sp.canonical()
        matcher = Matcher(sp, pg, allow_withhold=not g.options.keep_logits and not g.logits_read, read_by=g.logits_read)
        out = pg.output
        for anchor in [n for n in g.canonical.nodes if n.op == out.op]:
            # a value no fx node computes (a primitive of a composite op such as F.layer_norm) is
            # not a site's output: the site would have no node to replace
            if anchor.fx is None or anchor.fx in g.taken:
                continue
            if anchor.attrs != out.attrs:  # other options of the op: reported as a near miss, not matched
                why = f"expected {describe(out)}, got {describe(anchor)}"
                g.failures.append((sp, matcher.n_ops, anchor, Failure(0, out, anchor, why)))
                continue
            res = matcher.attempt(anchor, g.taken)
            if not isinstance(res, Match):
                g.failures.append((sp, matcher.n_ops, anchor, res))
                continue
            _serve(g, res)


def _serve(g: Graft, m: Match) -> None:
    """A match: refused by its family (a fallback), or replaced (recorded for pairing)."""
    sp, rec = m.spelling, site_record(m)
    why = refusal(m, g.options, g.training)
    g.taken |= m.covered
    if why:
        rec.replaced, rec.reason = False, why
        g.report.fallbacks.append(rec)
        return
    rec.withheld = [w.name for w in m.withheld]
    g.report.sites.append(rec)
    if not g.dry_run:
        g.entries.append((rec, sp, rewrite(g.gm, m, g.redirect, g.options), None))
        if rec.device:  # named by the warning if its kernel fails at run time
            register_site(site_key(sp.qualname, rec.device, rec.dtype), under_layers(rec.module))
        return
    if g.probe is None:  # the graph stays as captured: values no fx node computes stay None
        nodes = {a: c.fx for a, c in m.tensors.items()}
    else:
        with g.gm.graph.inserting_before(m.output.fx):
            nodes = argument_nodes(g.gm, m, g.redirect)
    args = tuple(nodes[a] if a in m.tensors else m.scalars[a] for a in sp.arg_names)
    g.entries.append((rec, sp, m.output.fx, args))
    if g.probe is not None:
        insert_probe(g.gm, g.probe, rec, sp, m.output.fx, args)


def near_misses(g: Graft) -> None:
    best: dict = {}
    for sp, n_ops, anchor, f in g.failures:
        if anchor.fx in g.taken or not sp.near_misses:
            continue
        nm = near_miss(sp, n_ops, anchor, f, g.taken)
        if nm is None:
            continue
        key = (nm.module, sp.pattern)
        # the most ops lined up; of equals, one that lined up whole and was refused for a reason
        # (keep_logits, a dtype) over one that differs in an op
        if key not in best or _rank(nm) > _rank(best[key]):
            best[key] = nm
    g.report.near_misses = list(best.values())


def _rank(nm) -> tuple:
    return nm.matched, not nm.expected


# a module whose class name says what it is: the sites a decoder's norms and MLPs should have. A
# norm's name ends in "Norm", or in "Norm" and a qualifier (MambaRMSNormGated, NemotronLayerNorm1P,
# StableLmLayerNormPerHead); "Norm" followed by another module's word names a module that is not a
# norm (RobertaPreLayerNormSelfAttention, ...Layer, ...Output)
_NORM_NAME = re.compile(r"Norm(Gated|PerHead|Zero|[0-9][0-9A-Za-z]*)?$")


def _module_kind(name: str) -> str | None:
    if _NORM_NAME.search(name):
        return "norm"
    # an MoE block's experts held as stacked weights (MixtralExperts, GptOssExperts): an MLP per expert
    return "mlp" if "MLP" in name or "Mlp" in name or name.endswith("Experts") else None


# the matmuls of stacked experts: a loop's linear or mm, bmm over the selected experts' weights, a
# grouped mm (torch's, or transformers' fallback op)
_EXPERT_MATMUL = re.compile(r"^(linear|mm|bmm|matmul|einsum|.*grouped_mm.*)$")


def _between_matmuls(seq: list) -> list | None:
    """The ops (each once, in graph order) an experts module computes between its first matmul and
    its last: its gated product, beside the bias adds and index reads there. None with fewer than two."""
    at = [i for i, op in enumerate(seq) if _EXPERT_MATMUL.match(op)]
    if len(at) < 2:
        return None
    out = []
    for op in seq[at[0] + 1 : at[-1]]:
        if not _EXPERT_MATMUL.match(op) and op not in out:
            out.append(op)
    return out


# the patterns that serve a module of each kind: a norm module whose gated product alone was
# grafted (gated_mlp inside Mamba-2's gated norm over several groups) still leaves its norm stock

# a function whose name says it rotates by position (apply_rotary_pos_emb, apply_rotary_emb,
# apply_rope...): a rotary helper, called inside the attention module, not a module of its own. The
# module that makes cos and sin is a module (its code runs in `forward`), not such a function.
_ROTARY_NAME = re.compile(r"rotary|rope", re.IGNORECASE)
_FRAME = re.compile(r'File "[^"]*", line \d+, in (\w+)')


def _rotary_helper(fx) -> str | None:
    """The outermost function of fx's source stack whose name says it is a rotary helper, or None."""
    trace = fx.meta.get("stack_trace") if fx is not None else None
    for fn in _FRAME.findall(trace or ""):
        if _ROTARY_NAME.search(fn):
            return fn
    return None


def unserved(g: Graft) -> None:
    """Norm and MLP modules the graph calls (by their class names), and rotary helper functions (by
    their names), in which no site of their kind was served, refused or came close: reported with
    the ops they compute (and the sites of other patterns served inside them); stacked experts with
    what they compute between their matmuls, where a gated MLP's spelling would match, and in place
    of the MLP module around them (its first ops are the router's)."""
    records = [(r.module, r.pattern) for r in g.report.sites + g.report.fallbacks] + [
        (m.module, m.pattern) for m in g.report.near_misses
    ]
    ops: dict = {}  # (path, class or function name, kind) -> canonical ops computed inside, in graph order
    modules: dict = {}  # (dynamo's path, class) -> (path, class name, kind), or None: not a norm or MLP

    def computes(key, c) -> None:
        if c.op != "input":
            ops.setdefault(key, []).append(c.op.removeprefix("opaque:"))

    for c in g.canonical.nodes:
        at = c.fx if c.fx is not None else c.origin  # a composite's primitive: where it was called
        stack = own_modules(at.meta.get("nn_module_stack") if at is not None else None)
        for path, cls in stack:
            if (path, cls) not in modules:
                name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
                kind = _module_kind(name)
                modules[path, cls] = None if kind is None else (readable_path(path), name, kind)
            key = modules[path, cls]
            if key is not None:
                computes(key, c)
        helper = _rotary_helper(c.fx)
        if helper is not None:  # under the innermost module that calls it
            inner = stack[-1][0] if stack else ""
            computes((readable_path(inner), helper, "rope"), c)
    unserved_experts = []
    for (path, name, kind), seq in ops.items():
        inside = list(dict.fromkeys(seq))
        within = [(m, p) for m, p in records if m == path or m.startswith(path + ".")]
        if any(p in served_kinds().get(kind, ()) for _, p in within) or not inside:
            continue
        experts = kind == "mlp" and name.endswith("Experts")
        between = _between_matmuls(seq) if experts else None
        if experts:
            unserved_experts.append(path)
        what = ", ".join(inside[:10]) + (", ..." if len(inside) > 10 else "")
        if between:
            what = "between its expert matmuls " + ", ".join(between)
        others = sorted(  # a helper's sites are its calling module's: none are inside it alone
            {f"{r.pattern}.{r.spelling}" for r in g.report.sites if (r.module, r.pattern) in within}
            if kind != "rope"
            else ()
        )
        served = f" (served inside it: {', '.join(others)})" if others else ""
        why = f"no {kind} pattern matched or came close{served}; it computes {what}"
        g.report.unserved.append(Unserved(path, kind, name, why))
    g.report.unserved = [
        u
        for u in g.report.unserved
        if not (u.kind == "mlp" and any(e.startswith(u.module + ".") for e in unserved_experts))
    ]
    if g.training and g.heads and not any(p == "lm_head_ce" for _, p in records):
        g.report.unserved += _unserved_heads(g)
    g.report.unserved += _logits_read(g)
    g.report.unserved += _unserved_adapters(g)


# a peft adapter's first projection, as named_modules names it: "<layer>.lora_A.<adapter>"
_ADAPTER = re.compile(r"^(?P<layer>.+)\.lora_A\.(?P<name>[^.]+)$")


def _unserved_adapters(g: Graft) -> list[Unserved]:
    """peft adapters the graph runs (their lora_A projections) that no site served, refused or came
    close to: a layer with several active adapters has one served (the last one, whose sum the layer
    casts back) and the others running stock code, each said here."""
    out, seen = [], set()
    for c in g.canonical.nodes:
        if c.op != "linear" or c.fx is None or c.fx in g.taken:
            continue
        stack = own_modules(c.fx.meta.get("nn_module_stack"))
        found = _ADAPTER.match(readable_path(stack[-1][0])) if stack else None
        if found is None or (found["layer"], found["name"]) in seen:
            continue
        seen.add((found["layer"], found["name"]))
        layer = found["layer"]
        served = [r for r in g.report.sites if r.module == layer and r.pattern == "lora"]
        if not served and any(r.module == layer and r.pattern == "lora" for r in g.report.fallbacks + g.report.near_misses):
            continue  # refused, or a near miss: reported there, with why
        kind = next((c for p, c in stack if readable_path(p) == layer), None)
        kind = f"{kind.__module__}.{kind.__qualname__}" if isinstance(kind, type) else str(kind or "a layer")
        why = (
            "another active adapter of this layer is served; a layer's further active adapters run stock code"
            if served
            else f"no lora pattern matched or came close: the adapted layer is {kind}, whose adapter path "
            "none of the lora spellings writes"
        )
        out.append(Unserved(layer, "lora", f"adapter {found['name']!r}", why))
    return out


def _logits_read(g: Graft) -> list[Unserved]:
    """An LM head + loss that matched whole but whose logits the captured forward also reads (a
    wrapper's metric, a second loss): said in one line, beside the near miss that holds the detail."""
    if g.report.sites and any(r.pattern == "lm_head_ce" for r in g.report.sites):
        return []
    out = []
    for m in g.report.near_misses:
        if m.pattern == "lm_head_ce" and m.matched == m.total and "outside the pattern" in m.reason:
            reader = m.reason.split("used by ", 1)[-1].split(" outside", 1)[0]
            out.append(Unserved(
                g.heads[0] if g.heads else m.module, "lm_head", "its logits read",
                f"not fused: the captured forward reads its logits besides the loss ({reader}), so the stock "
                "head runs at its full memory; read them from the model's output instead, to have it fused",
            ))  # fmt: skip
            break
    return out


# ops a model's logits pass through on their way to a loss: what the report names is the rest
_LOGIT_PLUMBING = {
    "cast", "view", "reshape", "flatten_rows", "contiguous", "clone", "transpose", "permute", "getitem", "slice"
}


def _unserved_heads(g: Graft) -> list[Unserved]:
    """The model's LM head (its output embeddings) called in a training graph where no LM head +
    loss site was served, refused or came close: the ops its logits go to, or that they leave the
    graph with no loss computed on them (labels not passed, or a graph break before the loss)."""
    out = []
    for c in g.canonical.nodes:
        if c.op != "linear" or c.fx is None:
            continue
        stack = own_modules(c.fx.meta.get("nn_module_stack"))
        if not stack or readable_path(stack[-1][0]) not in g.heads:
            continue
        path, cls = readable_path(stack[-1][0]), stack[-1][1]
        name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
        ops, seen, todo = [], {c.fx}, list(c.fx.users)
        while todo and len(ops) < 10:
            n = todo.pop(0)
            if n in seen or n.op == "output":
                continue
            seen.add(n)
            at = g.canonical.of_fx.get(n)
            op = at.op.removeprefix("opaque:") if at is not None else getattr(n.target, "__name__", str(n.target))
            if op not in ops:
                ops.append(op)
            todo += list(n.users)
        loss = [op for op in ops if op not in _LOGIT_PLUMBING]
        goes = (
            f"its logits go to {', '.join(ops)}"
            if loss
            else "its logits leave the graph with no loss computed on them in it (labels not passed, or a graph "
            "break before the loss: the LM head is fused with a cross-entropy in the same graph)"
        )
        out.append(Unserved(path, "lm_head", name, f"no lm_head_ce pattern matched or came close; {goes}"))
    return out


def pair(g: Graft) -> None:
    pairs = plan_pairs(g.entries, g.dry_run)
    if g.dry_run:
        for (r0, *_), (r1, *_), _ in pairs:
            r0.paired = r1.paired = True
    else:
        pair_launches(g.gm, pairs, g.options.rounding)


def tile(g: Graft) -> None:
    tile = g.options.tile_tokens
    if tile is not None and g.training:
        g.report.tiles += tiling.tile_graph(g.gm, tile, g.spellings, edit=not g.dry_run)


def projections(g: Graft) -> None:
    o = g.options
    if o.fuse_projections and g.training and o.backend == "inductor":
        g.report.projections += _projections.fuse(g.gm, edit=not g.dry_run)


def finish(g: Graft) -> None:
    fused = any(r.served for r in g.report.projections) or any(t.tiled for t in g.report.tiles)
    if (g.report.sites or fused) and (not g.dry_run or g.probe is not None):
        g.gm.graph.lint()
        g.gm.recompile()


def regions(g: Graft) -> None:
    # a region under torch.utils.checkpoint (Hugging Face's gradient checkpointing: one per decoder
    # layer) is a graph of its own, called through a higher-order op: graft it too. Its mask arrives
    # as an input there, and run-time checks wrap only the outer graph: static proofs only
    for body in _checkpointed_bodies(g.gm):
        sub = Graft(body, g.spellings, g.options, g.dry_run, g.probe, g.training, runtime_masks=False, heads=g.heads)
        g.report.add(run(sub))


PASSES = (
    causal_masks,
    canonicalize_graph,
    match_and_replace,
    near_misses,
    unserved,
    pair,
    # after the sites are served and paired (a region holds their ops), before projections: a
    # region's linears run tile by tile, where a stacked weight would be stacked again per tile
    tile,
    projections,
    finish,
    regions,
)


def run(g: Graft) -> RewriteReport:
    for p in PASSES:
        p(g)
    return g.report


def graft(
    gm: torch.fx.GraphModule,
    spellings,
    options: Options | None = None,
    *,
    dry_run: bool = False,
    probe: Callable | None = None,
    training: bool | None = None,
    runtime_masks: bool = True,
    heads: tuple = (),
    logits_read: str = "",
) -> RewriteReport:
    """Run the passes over one dynamo graph; edit it unless dry_run. training: None, whether
    gradients are on now (a capture's own state). heads: the model's output embeddings' paths
    (output_heads), where an LM head that is not served is reported. logits_read: how the model's
    code read logits an earlier capture withheld (Graft.logits_read)."""
    training = torch.is_grad_enabled() if training is None else training
    g = Graft(
        gm, list(spellings), options or Options(), dry_run, probe, training, runtime_masks, heads=heads,
        logits_read=logits_read,
    )
    return run(g)


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
