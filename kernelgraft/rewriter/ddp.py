"""DistributedDataParallel: dynamo's DDPOptimizer cuts a DDP-wrapped model's graph into pieces where
DDP's gradient buckets fill, and hands each piece to the backend. kernelgraft grafts the graph whole
before the cut (install), cuts it into fewer, larger pieces (ddp_piece_mb), and keeps each kernel
call whose output is recomputed in the backward in one piece with the ops that read that output.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx.passes.split_module as sm

from .replace import RECOMPUTE_META


def install() -> None:
    """Graft DDP's graph whole, before dynamo's DDPOptimizer cuts it into pieces at the gradient
    buckets (each piece handed to the backend): a cut between a pattern's ops (between the gate and
    up projections of a 1B model's MLP, whose weights are 32 MB against 25 MB buckets) would leave it
    unmatched in both pieces, and the causal mask, made in the first piece, would reach the others as
    an input. The pieces are then only lowered.

    This replaces `DDPOptimizer.compile_fn` for the whole process, once (the README says so): for a
    graph whose backend is not a kernelgraft one (a `grafts_whole` method among dynamo's wrappers),
    the replacement calls the original, unchanged."""
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except Exception:  # noqa: BLE001 - a torch without it has no DDP graph splitting either
        return
    original = DDPOptimizer.compile_fn
    if getattr(original, "_kernelgraft", False):
        return

    def compile_fn(self, gm, example_inputs, **configs):
        g = _grafter(self.backend_compile_fn)
        if g is None or not g.grafts_whole():
            return original(self, gm, example_inputs, **configs)
        with (
            g.grafted_whole(gm),
            _pieces_of_at_least(self, g.options.ddp_piece_mb),
            _recomputed_outputs_kept_with_their_readers(g.report.ddp_cuts),
        ):
            return original(self, gm, example_inputs, **configs)

    compile_fn._kernelgraft = True
    DDPOptimizer.compile_fn = compile_fn


def _grafter(backend):
    """The kernelgraft backend inside dynamo's wrappers (WrapBackendDebug, then
    torch._TorchCompileWrapper), or None."""
    g = backend
    for _ in range(8):
        if hasattr(g, "grafts_whole") and hasattr(g, "grafted_whole"):
            return g
        g = getattr(g, "_torchdynamo_orig_backend", None) or getattr(g, "compiler_fn", None)
    return None


@contextlib.contextmanager
def _pieces_of_at_least(ddp_optimizer, mb: float | None):
    """While DDPOptimizer cuts a grafted graph: pieces of at least `mb` MiB of parameters (DDP's own
    bucket size where larger; None: DDP's). DDPOptimizer cuts where DDP's reducer fills a bucket
    (25 MB by default), so that a bucket's all-reduce can start while the backward goes on; but
    each piece is a compiled function of its own, with its own forward and backward calls on the
    host: fewer, larger pieces spend less host time per step (the default's figures are in
    benchmarks/RESULTS.md). DDP's reducer keeps its own buckets: a piece's gradients are all-reduced bucket by
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
    recompute (replace.rewrite) in one piece with the ops that read those outputs (_move_groups). An
    output read across a cut is an input of the later piece, which saves it, so its recompute would
    be lost: with 25 MB buckets the cut falls between a 1B model's gated MLP and its down projection
    (32 MB of weight fill a bucket), and between its gate and up projections, which read the same
    norm output, in every layer. Each cut appends what it did to `log` (the report's ddp_cuts)."""
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
    """One {node: piece it moves to} per recomputed kernel site that moves: the site (with its
    getitems, and slices of its outputs) into the first piece that reads its outputs, and the
    readers in later pieces back into that one, where all their other inputs are already made by then (graph inputs, or nodes
    of that piece or earlier ones) and they are pure (_movable). Moving a node later past none of
    its readers, or earlier past none of its inputs, keeps the pieces in order. A site whose
    readers cannot all join one piece stays where it is, with its readers (a copy per piece would
    sum its gradient in another order than the model does)."""
    out: dict = {}  # every node moved so far
    groups: list[dict] = []

    def at(n):
        return out.get(n, piece_of(n))

    for site in graph.nodes:
        if site.op != "call_function" or not site.meta.get(RECOMPUTE_META):
            continue
        items = list(site.users)
        if not items or any(u.op != "call_function" or u.target is not operator.getitem for u in items):
            continue
        # indexing an output (Hugging Face slices the final norm's output for the LM head) passes
        # it on: the slice moves with the site, and what reads the slice counts as a reader
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
        here = at(site)
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
        group = dict.fromkeys((site, *made, *late), to)
        groups.append(group)
        out.update(group)
    return groups


def global_state_switch(n: torch.fx.Node) -> bool:
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
    (Hugging Face's rotary embedding computes under autocast(enabled=False) in transformers 5.17).
    A node moved past such a switch would change the mode it runs
    in: its whole group (a call, its getitems, its moved readers) stays where DDP put it. Raises
    when the order found is not a valid graph (the caller then keeps DDPOptimizer's cut)."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    idx = {n: i for i, n in enumerate(nodes)}
    states = [n for n in nodes if global_state_switch(n)]
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


