"""Step 4 of 4: lower. The torch.compile backend that runs the whole pipeline on each dynamo graph,
then hands the rewritten graph to inductor (default) or runs it as is ("eager").
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator

import torch
from torch._subclasses.fake_tensor import is_fake

from . import attention, recompute
from .replace import RECOMPUTE_META, graft
from .report import RewriteReport

BACKENDS = ("inductor", "eager")


def resolve_patterns(patterns) -> list:
    """None -> every registered spelling; names and Spelling objects -> those."""
    from ..patterns import REGISTRY
    from ..patterns.registry import Spelling

    if patterns is None:
        return REGISTRY.spellings()
    if isinstance(patterns, (str, Spelling)):
        patterns = [patterns]
    out = []
    for p in patterns:
        out.extend([p] if isinstance(p, Spelling) else REGISTRY.spellings([p]))
    return out


class Grafter:
    """A torch.compile backend: canonicalize -> match -> replace -> lower, on every captured graph.

    >>> import torch, kernelgraft
    >>> f = torch.compile(lambda x: x * 2, backend=kernelgraft.Grafter("eager"))
    >>> f(torch.ones(2)).tolist()
    [2.0, 2.0]
    """

    def __init__(self, backend: str = "inductor", patterns=None, *, dry_run: bool = False, options=None):
        if backend not in BACKENDS:
            raise ValueError(f"kernelgraft: backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.spellings = resolve_patterns(patterns)
        self.dry_run = dry_run
        self.options = dict(options or {})
        self.report = RewriteReport()
        self._grafted_whole = False  # set while DDP's pieces of an already grafted graph come in
        _graft_before_ddp_splits()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if self._grafted_whole:
            return self._lower(gm, example_inputs)
        # a copy of the graph as captured, for the calls whose masks fail their run-time check
        checking = not self.dry_run and self.options.get("causal_attention", True) is True
        stock = _graph_copy(gm) if checking and attention.has_input_masks(gm) else None
        rep = graft(gm, self.spellings, dry_run=self.dry_run, rounding=self._rounding(), options=self.options)
        self.report.extend(rep, frame=_frame_id())
        compiled = self._lower(gm, example_inputs)
        checks = gm.meta.pop(attention.META, None)
        if not checks:
            return compiled
        self.report.mask_checks += checks
        return MaskChecked(checks, compiled, functools.partial(self._fallback, stock))

    def _rounding(self) -> str:
        # the kernels round as the code around them will: eager's per-op rounding, or inductor's fused one
        return "fused" if self.backend == "inductor" else "autograd"

    def _lower(self, gm, example_inputs):
        if self.backend == "inductor" and not self.dry_run:
            from torch._inductor import config
            from torch._inductor.compile_fx import compile_fx

            patches = {}
            if self.options.get("recompute", True) is True:  # not "separate": made by the backward kernels
                key = "post_grad_custom_post_pass"
                patches[key] = recompute.RecomputePass(chained=getattr(config, key))
            return compile_fx(gm, example_inputs, config_patches=patches or None)
        return gm.forward

    def _fallback(self, stock: torch.fx.GraphModule, args):
        """The graph with its masks as written (those proven on the graph still rewritten), lowered
        with the arguments of the call that needs it (the graph's sizes are static)."""
        graft(stock, self.spellings, rounding=self._rounding(), options=attention.static_only(self.options))
        return self._lower(stock, list(args))


class MaskChecked:
    """A compiled graph whose attention calls run with is_causal=True on the condition that their
    masks, read from the graph's inputs, are causal (attention.MaskCheck): each call checks them and
    runs the compiled graph, or else the graph with its masks as written (compiled on first need)."""

    def __init__(self, checks, compiled, make_fallback):
        self.checks, self.compiled, self.make_fallback = checks, compiled, make_fallback
        self.fallback = None

    def __call__(self, *args):
        if any(is_fake(a) for a in args):
            # a trace, not a run (DDP's graph splitter runs each compiled piece on fake tensors to
            # propagate shapes): no values to check, and either graph gives the same shapes
            return self.compiled(*args)
        if all(c.holds(args) for c in self.checks):
            return self.compiled(*args)
        if self.fallback is None:
            self.fallback = self.make_fallback(args)
        return self.fallback(*args)


def _graft_before_ddp_splits() -> None:
    """Graft DDP's graph whole, before dynamo's DDPOptimizer cuts it into pieces at the gradient
    buckets (each piece handed to the backend): a cut between a pattern's ops (between the gate and
    up projections of a 1B model's MLP, whose weights are 32 MB against 25 MB buckets) would leave it
    unmatched in both pieces, and the causal mask, made in the first piece, would reach the others as
    an input. The pieces are then only lowered. Installed once; other backends pass through."""
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except Exception:  # noqa: BLE001 - a torch without it has no DDP graph splitting either
        return
    original = DDPOptimizer.compile_fn
    if getattr(original, "_kernelgraft", False):
        return

    def compile_fn(self, gm, example_inputs, **configs):
        g = self.backend_compile_fn
        for _ in range(8):  # dynamo's wrappers: WrapBackendDebug, then torch._TorchCompileWrapper
            if isinstance(g, Grafter):
                break
            g = getattr(g, "_torchdynamo_orig_backend", None) or getattr(g, "compiler_fn", None)
        if not isinstance(g, Grafter) or g.dry_run or g._grafted_whole:
            return original(self, gm, example_inputs, **configs)
        # masks that read graph inputs are kept here: checks by position would not survive the cut
        rep = graft(gm, g.spellings, rounding=g._rounding(), options=attention.static_only(g.options))
        g.report.extend(rep, frame=_frame_id())
        g._grafted_whole = True
        try:
            with (
                _pieces_of_at_least(self, g.options.get("ddp_piece_mb", DDP_PIECE_MB)),
                _recomputed_outputs_kept_with_their_readers(g.report.ddp_cuts),
            ):
                return original(self, gm, example_inputs, **configs)
        finally:
            g._grafted_whole = False

    compile_fn._kernelgraft = True
    DDPOptimizer.compile_fn = compile_fn


# the least parameter size of a piece of a DDP-wrapped graph (MiB; optimize's ddp_piece_mb)
DDP_PIECE_MB = 100.0


@contextlib.contextmanager
def _pieces_of_at_least(ddp_optimizer, mb: float | None):
    """While DDPOptimizer cuts a grafted graph: pieces of at least `mb` MiB of parameters (DDP's own
    bucket size where larger; None: DDP's). DDPOptimizer cuts where DDP's reducer fills a bucket
    (25 MB by default), so that a bucket's all-reduce can start while the backward goes on; but
    each piece is a compiled function of its own, with its own forward and backward call on the
    host. At the Llama-3.2-1B step on two H200s, 100 MiB pieces (about a decoder layer: 18, not 50)
    ran 0.35 % faster than DDP's cut, every run ahead (2026-11-30; 1.5 % where DDP's buckets grew
    to 100 MB as well, which changed nothing for eager Liger; benchmarks/RESULTS.md, ninth
    session). DDP's reducer keeps its own buckets: a piece's gradients are all-reduced bucket by
    bucket as they come, while the next piece's backward runs."""
    cap = getattr(ddp_optimizer, "bucket_bytes_cap", None)
    if mb is None or cap is None:
        yield
        return
    ddp_optimizer.bucket_bytes_cap = max(cap, int(mb * 2**20))
    try:
        yield
    finally:
        ddp_optimizer.bucket_bytes_cap = cap


@contextlib.contextmanager
def _recomputed_outputs_kept_with_their_readers(log: list):
    """While DDPOptimizer cuts a grafted graph: keep each kernel call whose outputs are tagged for
    recompute (replace._rewrite) in one piece with the ops that read those outputs (_move_groups). An
    output read across a cut is an input of the later piece, which saves it, so its recompute would
    be lost: with 25 MB buckets the cut falls between a 1B model's gated MLP and its down projection
    (32 MB of weight fill a bucket), and between its gate and up projections, which read the same
    norm output, in every layer. Each cut appends what it did to `log` (the report's ddp_cuts)."""
    import torch.fx.passes.split_module as sm

    original = sm.split_module

    def split_module(m, root_m, split_callback, *args, **kwargs):
        entry = dict(recomputed=sum(1 for n in m.graph.nodes if n.meta.get(RECOMPUTE_META)), moved=0)
        with contextlib.suppress(Exception):  # a count for the report only
            entry["pieces"] = len(
                {split_callback(n) for n in m.graph.nodes if n.op not in ("placeholder", "output")}
            )
        log.append(entry)
        try:
            groups = _move_groups(m.graph, split_callback)
        except Exception as e:  # noqa: BLE001 - a graph or numbering it does not know: the cut as DDP made it
            groups, entry["kept_ddp_cut"] = [], f"plan failed: {type(e).__name__}: {e}"[:200]
        if groups:
            before = list(m.graph.nodes)
            try:
                moved = _in_piece_order(m.graph, split_callback, groups)
                out = original(m, root_m, lambda n: moved.get(n, split_callback(n)), *args, **kwargs)
                entry["moved"] = len(moved)
                return out
            except Exception as e:  # noqa: BLE001 - pieces it would not build: DDPOptimizer's own cut, as is
                entry["kept_ddp_cut"] = f"split failed: {type(e).__name__}: {e}"[:200]
                _relink(before)
        return original(m, root_m, split_callback, *args, **kwargs)

    # DDPOptimizer reaches the function as torch.fx.passes.split_module.split_module (torch 2.13) or
    # by a name imported into its own module (other releases): both are replaced while it cuts
    import torch._dynamo.backends.distributed as ddp_mod

    holders = [h for h in (sm, ddp_mod) if getattr(h, "split_module", None) is original]
    for h in holders:
        h.split_module = split_module
    try:
        yield
    finally:
        for h in holders:
            h.split_module = original


# readers that may move to an earlier piece: pure functions of their inputs (a projection, an
# operator overload that mutates nothing), never an in-place op or one with a state
_MOVABLE = frozenset({"linear", "matmul", "mm", "bmm", "addmm"})


def _movable(n: torch.fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if isinstance(n.target, torch._ops.OpOverload):
        return not n.target._schema.is_mutable
    return getattr(n.target, "__name__", None) in _MOVABLE


def _move_groups(graph: torch.fx.Graph, piece_of) -> list[dict]:
    """One {node: piece it moves to} per recomputed kernel call that moves: the call (with its
    getitems, and slices of its outputs) into the first piece that reads its outputs, and the
    readers in later pieces back into that one, where all their other inputs are already made by then (graph inputs, or nodes
    of that piece or earlier ones) and they are pure (_movable). Moving a node later past none of
    its readers, or earlier past none of its inputs, keeps the pieces in order. A call whose
    readers cannot all join one piece stays where it is, with its readers (a copy per piece would
    sum its gradient in another order than the model does)."""
    out: dict = {}  # every node moved so far
    groups: list[dict] = []

    def at(n):
        return out.get(n, piece_of(n))

    for call in graph.nodes:
        if call.op != "call_function" or not call.meta.get(RECOMPUTE_META):
            continue
        items = list(call.users)
        if not items or any(u.op != "call_function" or u.target is not operator.getitem for u in items):
            continue
        # indexing an output (Hugging Face slices the final norm's output for the LM head) passes
        # it on: the slice moves with the call, and what reads the slice counts as a reader
        made, readers = set(items), []
        todo = [r for i in items for r in i.users]
        while todo:
            r = todo.pop(0)
            if r.op == "call_function" and r.target is operator.getitem and r.args[0] in made and r.users:
                made.add(r)
                todo.extend(r.users)
            elif r not in readers:
                readers.append(r)
        if not readers or any(r.op in ("output", "placeholder") for r in readers):
            continue
        here = at(call)
        pieces = {at(r) for r in readers}
        if not all(isinstance(q, int) for q in pieces) or not isinstance(here, int):
            return []  # not DDPOptimizer's numbering: leave the cut as it is
        to = min(pieces)
        late = [r for r in readers if at(r) > to]

        passed = [n for n in made if n not in items]
        ready = all(
            a in made or a.op == "placeholder" or (isinstance(at(a), int) and at(a) <= to)
            for r in (*passed, *late)
            for a in r.all_input_nodes
        )
        if (to <= here and not late) or not ready or not all(_movable(r) for r in late):
            continue
        group = dict.fromkeys((call, *made, *late), to)
        groups.append(group)
        out.update(group)
    return groups


def _global_state(n: torch.fx.Node) -> bool:
    """An autocast or grad-mode switch: split_module keeps its effect per piece only when the pieces
    come in graph order, and the ops around it must stay on their side of it."""
    return n.op == "call_function" and n.target in (
        torch.amp._enter_autocast,
        torch.amp._exit_autocast,
        torch._C._set_grad_enabled,
    )


def _in_piece_order(graph: torch.fx.Graph, piece_of, groups: list[dict]) -> dict:
    """The moves (node -> piece) of the groups kept, and the graph's nodes reordered so that pieces
    come in graph order, as split_module requires of a graph with autocast or grad-mode switches
    (Hugging Face's rotary embedding computes under autocast(enabled=False) in transformers 5.17;
    the two-H200 run failed its check, 2026-11-30). A node moved past such a switch would change the mode it runs
    in: its whole group (a call, its getitems, its moved readers) stays where DDP put it. Raises
    when the order found is not a valid graph (the caller then keeps DDPOptimizer's cut)."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    idx = {n: i for i, n in enumerate(nodes)}
    states = [n for n in nodes if _global_state(n)]
    kept = {}
    for group in groups:  # a group: the nodes moved to one piece for one call
        if all(
            (idx[n] < idx[s]) == ((to, idx[n]) < (piece_of(s), idx[s]))
            for n, to in group.items()
            for s in states
        ):
            kept.update(group)
    order = sorted(nodes, key=lambda n: (kept.get(n, piece_of(n)), idx[n]))
    head = [n for n in graph.nodes if n.op == "placeholder"] + [n for n in graph.nodes if n.op == "get_attr"]
    tail = [n for n in graph.nodes if n.op == "output"]
    _relink(head + order + tail)
    graph.lint()  # every input made before it is read
    return kept


def _relink(order: list) -> None:
    """The graph's nodes in this order."""
    for a, b in zip(order, order[1:]):
        if a.next is not b:
            a.append(b)


def _graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """gm's graph copied (nodes and their meta), sharing gm's attributes."""
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out.meta.update(gm.meta)
    return out


def _frame_id():
    """(dynamo's id of the frame being compiled, the number of this compile of it), if it tells."""
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        if getattr(cid, "frame_id", None) is None:
            return None
        return (cid.frame_id, getattr(cid, "frame_compile_id", None))
    except Exception:  # noqa: BLE001 - older/newer torch without it: every capture counts
        return None


def _named_backend(gm, example_inputs):
    return Grafter("inductor")(gm, example_inputs)


def register() -> None:
    """Make `torch.compile(model, backend="kernelgraft")` work (idempotent)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "kernelgraft" not in _BACKENDS:
        register_backend(name="kernelgraft")(_named_backend)
