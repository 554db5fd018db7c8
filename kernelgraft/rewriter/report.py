"""RewriteReport: what each capture replaced, what fell back and why, and what nearly matched."""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from dataclasses import dataclass, field

import torch.fx

from ..kernels.fallback import failure_of, site_key

_PREFIX = re.compile(r"^L\[[^\]]*\](\[\d+\])*\.?")
_BOUND_SELF = re.compile(r"\.forward\.__self__(?=\.)")
_REACHED = frozenset({"__dict__", "_modules"})


def module_path(fx_node) -> str:
    """'model.layers.0.input_layernorm' for a node dynamo traced inside that module."""
    stack = own_modules(fx_node.meta.get("nn_module_stack") if fx_node is not None else None)
    if not stack:
        return "<top>"
    return readable_path(stack[-1][0])


def own_modules(stack) -> list[tuple]:
    """The (dynamo's path, class) entries of an nn_module_stack, outermost first, that the traced
    frame reached from its locals (the model and its submodules: "L['self'].model.layers[0]"): a
    module reached through a global is left out, as transformers' kernel-hub wrapper of a function
    (`apply_rotary_pos_emb` made a module) is, so a site stays its calling layer's. All entries
    where none is a local's."""
    entries = list((stack or {}).values())
    own = [e for e in entries if str(e[0]).startswith("L[")]
    return own or entries


def example_value(n):
    """The value an fx node held when it was traced (dynamo's example_value, AOT's val); a non-node
    argument as it is."""
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, torch.fx.Node) else n


def readable_path(path: str) -> str:
    """A module path as dynamo records it ("L['self'].model.layers[0].mlp") as the model names it."""
    path = _PREFIX.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("['", ".").replace("']", "")
    # how dynamo reached a submodule, not its name: through a bound method's self (a forward a
    # wrapper replaced, as accelerate's mixed precision does) or a module's own dicts (peft)
    parts = [p for p in _BOUND_SELF.sub(".", "." + path + ".").split(".") if p and p not in _REACHED]
    return ".".join(parts) or "<top>"


@dataclass
class SiteRecord:
    pattern: str
    spelling: str
    module: str  # module path, e.g. model.layers.0.input_layernorm
    shapes: dict  # argument name -> shape tuple
    dtypes: dict  # argument name -> dtype name
    scalars: dict  # captured Scalar arguments, e.g. {'eps': 1e-06}
    served: bool = True  # the rewrite put a kernel there (see `replaced` for what runs now)
    reason: str = ""  # why it fell back, when it did
    graph: object = 0  # the capture: (dynamo frame id, compile number) where dynamo tells
    capture: str = ""  # the kind of graph: "training", "evaluation" or "decoding" (CAPTURES)
    paired: bool = False  # served by one launch together with a sibling site (q and k of a layer)
    withheld: list = field(default_factory=list)  # values the graph returned that the kernel never made
    device: str = ""  # device type of the site's first tensor argument
    dtype: str = ""  # and its dtype: with the spelling, which kernel serves the site

    def failure(self) -> str | None:
        """Why the kernel serving this site failed at run time in this process (None: it did not):
        the site then runs its stock code."""
        if not self.served or not self.device:
            return None
        return failure_of(site_key(f"{self.pattern}.{self.spelling}", self.device, self.dtype))

    @property
    def replaced(self) -> bool:
        """A kernel serves the site now: the rewrite put it there and it has not failed since."""
        return self.served and self.failure() is None

    @replaced.setter
    def replaced(self, value: bool) -> None:
        self.served = value

    def status(self) -> str:
        if not self.served:
            return f"fell back: {self.reason}"
        why = self.failure()
        if why:
            return f"fell back at run time: {why}"
        return "replaced, paired launch" if self.paired else "replaced"

    def row(self) -> list[str]:
        shapes = ", ".join(f"{k}{list(v)}" for k, v in self.shapes.items())
        dtypes = ",".join(sorted(set(self.dtypes.values())))
        scal = ", ".join(f"{k}={v:g}" for k, v in self.scalars.items())
        return [f"{self.pattern}.{self.spelling}", self.module, shapes, dtypes, scal, self.status()]


@dataclass
class NearMiss:
    pattern: str
    spelling: str
    module: str
    matched: int  # pattern ops that matched before the first difference
    total: int
    expected: str  # the pattern node where it differed
    found: str  # the model node there
    reason: str
    graph: object = 0  # the capture: (dynamo frame id, compile number) where dynamo tells
    capture: str = ""

    def __str__(self) -> str:
        return (
            f"{self.module}: resembled {self.pattern}.{self.spelling} ({self.matched}/{self.total} ops matched); "
            f"first difference: {self.reason}"
        )


@dataclass
class Unserved:
    """A norm or MLP module, or a rotary helper function, the model calls where no site was served,
    refused or came close: what it computes (its canonical ops), so a user sees what was skipped
    and a contributor what to write a pattern for. The model's LM head (its output embeddings) in a
    training graph where no LM head + loss site was: the ops its logits go to."""

    module: str  # the module's path; a rotary helper's: the module that calls it
    kind: str  # "norm" | "mlp" | "rope" | "lm_head" | "lora"
    cls: str  # the module's class name; a rotary helper's function name
    reason: str
    graph: object = 0
    capture: str = ""

    def __str__(self) -> str:
        what = {
            "mlp": "an MLP", "norm": "a norm", "rope": "a rotary helper", "lm_head": "the LM head", "lora": "LoRA"
        }[self.kind]  # fmt: skip
        return f"{self.module} ({self.cls}, {what}): {self.reason}"


@dataclass
class TileRecord:
    """A token-wise region of a training graph (rewriter/tiling.py): the ops it holds, its tokens
    along the sequence, the bytes of its intermediates untiled and in one tile, and whether it runs
    over tiles of `tile` tokens (with why not)."""

    module: str  # the modules its ops are in: their common path
    ops: list  # its ops, in graph order (views left out)
    tokens: int  # positions of the sequence
    tile: int  # positions per tile (Options.tile_tokens)
    bytes_untiled: int  # its intermediates (values made inside it and not its outputs)
    bytes_tile: int  # the same for one tile
    tiled: bool = False
    reason: str = ""  # why it is not tiled
    modules: list = field(default_factory=list)  # every module its ops are in, in graph order
    graph: object = 0
    capture: str = ""

    def __str__(self) -> str:
        what = f"{self.module} ({', '.join(dict.fromkeys(self.ops))}; {self.tokens} tokens)"
        if not self.tiled:
            return f"{what}: not tiled: {self.reason}"
        return f"{what}: tiled by {self.tile}, intermediates {self.bytes_untiled} -> {self.bytes_tile} bytes"


# the kinds of graph a model is captured as, each reported on its own: a training step (gradients
# on), an evaluation forward (no gradients), generate()'s decoding (no gradients, a KV cache passed in)
CAPTURES = ("training", "evaluation", "decoding")

_RECORDS = ("sites", "fallbacks", "near_misses", "unserved", "masks_kept", "projections", "tiles")


@dataclass
class RewriteReport:
    """What each capture replaced: `.sites` (replaced by the rewrite), `.fallbacks` (refused at
    capture), `.near_misses`, `.counts()`; `str()` is a table. A site whose kernel failed later, at
    run time, stays in `.sites` but is no longer `replaced`, nor counted: `fell_back_at_run_time()`
    lists them. Each record says which kind of graph it is from (`capture`: training, evaluation,
    decoding); `by_graph()` splits the report by kind, and a capture of one kind never changes what
    another kind's records say."""

    sites: list[SiteRecord] = field(default_factory=list)
    fallbacks: list[SiteRecord] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    # norm and MLP modules the model calls where nothing was served, refused or came close
    unserved: list[Unserved] = field(default_factory=list)
    # attention calls whose mask was not proven causal (sliding windows, padding, symbolic sizes...):
    # they run as written; the reason says why (rewriter/attention.py)
    masks_kept: list[SiteRecord] = field(default_factory=list)
    # groups of linear layers that read one input, each fused into one matmul or not, with why
    # (rewriter/projections.py)
    projections: list[SiteRecord] = field(default_factory=list)
    # token-wise regions of training graphs, each run over tiles of the sequence or not, with why
    # (rewriter/tiling.py; Options.tile_tokens)
    tiles: list[TileRecord] = field(default_factory=list)
    graphs: int = 0  # captures seen, recompiles included
    # captures seen by kind of graph (CAPTURES), recompiles included
    graphs_by: Counter = field(default_factory=Counter, repr=False, compare=False)
    # masks read from graph inputs, checked at run time (attention.MaskCheck: counts of its verdicts)
    mask_checks: list = field(default_factory=list, repr=False, compare=False)
    # DDP's graph cuts at its gradient buckets (rewriter/ddp.py): per cut, the recomputed kernel
    # calls, how many nodes moved to keep them with their readers, and why a plan was dropped if one was
    ddp_cuts: list = field(default_factory=list, repr=False, compare=False)
    # kernel op calls in inductor's compiled graphs (rewriter/lowering.py): "inductor" for those its
    # generated code launches, "host: <why>" for those left to the Python launcher
    launched_by: Counter = field(default_factory=Counter, repr=False, compare=False)
    # graphs inductor compiled, by the language of the wrapper that launches their kernels
    # (Options.cpp_wrapper): "C++", "Python", or Python after the C++ wrapper failed to compile
    wrappers: Counter = field(default_factory=Counter, repr=False, compare=False)
    hooks_seen_at: int = field(default=-1, repr=False, compare=False)  # graphs when hooks were last looked at
    # dynamo's graph breaks during explain's capture, by reason (graph_break_reasons): each piece
    # is captured and served on its own, and a site cut by a break is not seen whole
    graph_breaks: Counter = field(default_factory=Counter, repr=False, compare=False)
    # what the report says of the model as a whole (another library's fused LM head on it)
    notes: list = field(default_factory=list, repr=False, compare=False)
    # per kind of graph: how many times each capture's graph ran in the latest call (runs.times);
    # a capture not listed ran once
    per_call: dict = field(default_factory=dict, repr=False, compare=False)
    # calls that ran stock code or another model's graphs, by their tensors' shapes, with why (runs.py)
    stock_runs: list = field(default_factory=list, repr=False, compare=False)
    # what Options.memory chose at the first training call (memory.MemoryChoice)
    memory: object = field(default=None, repr=False, compare=False)
    # how the model is captured (Options.capture): {"kind": "layers", "stack": layers.LayerStack}, or
    # {"kind": "whole", "why": ...} where layers were asked for and the model has no layer stack
    captured_as: dict = field(default_factory=dict, repr=False, compare=False)
    # the first call of each kind of graph that compiled: what it spent its time on (startup.Startup)
    startup: dict = field(default_factory=dict, repr=False, compare=False)
    dry_run: bool = field(default=False, repr=False, compare=False)  # explain's: nothing was replaced

    def captures(self) -> list[str]:
        """The kinds of graph captured so far (CAPTURES' order), each with records or graphs."""
        seen = {r.capture for name in _RECORDS for r in getattr(self, name)} | set(self.graphs_by)
        return [k for k in (*CAPTURES, "") if k in seen]

    def by_graph(self) -> dict[str, RewriteReport]:
        """The report split by kind of graph: {"training": ..., "evaluation": ..., "decoding": ...},
        the kinds captured so far, each a report of the records of the graphs that run now."""
        return {k: self.of(k) for k in self.captures()}

    def of(self, capture: str) -> RewriteReport:
        """The records of one kind of graph ("training", "evaluation" or "decoding"), as a report:
        those of the graphs the latest call of that kind ran (all of them before any such call)."""
        if capture not in CAPTURES and capture != "":
            raise ValueError(
                f"kernelgraft: no kind of graph {capture!r}; the kinds are {', '.join(CAPTURES)}"
            )
        part = RewriteReport(graphs=self.graphs_by[capture] if self.graphs_by else self.graphs, dry_run=self.dry_run)
        ran = self.per_call.get(capture)
        for name in _RECORDS:
            kept = [r for r in getattr(self, name) if r.capture == capture and (not ran or r.graph in ran)]
            setattr(part, name, kept)
        part.graphs_by = Counter({capture: part.graphs})
        part.per_call = {capture: ran} if ran else {}
        return part

    def current(self) -> RewriteReport:
        """The records of the graphs that run now: for each kind of graph, those its latest call
        ran (`of`), together. `.sites` and the other lists keep every capture's records."""
        part = RewriteReport(graphs=self.graphs, dry_run=self.dry_run)
        for k in self.captures():
            kind = self.of(k)
            part.add(kind)
            part.graphs_by[k] = kind.graphs
            part.per_call.update(kind.per_call)
        return part

    def times(self, record) -> int:
        """How many times the graph holding `record` ran in the latest call of its kind (a frame
        dynamo resumes after a graph break runs once per layer): its kernels launch that often."""
        return self.per_call.get(record.capture, {}).get(record.graph, 1)

    def counts(self, graph: str | None = None) -> dict[str, int]:
        """Pattern name -> number of sites whose kernels run (replaced, and not failed since) in one
        call of the model: of the kind of graph `graph` names ("training", "evaluation",
        "decoding"), or, by default, of whichever kind serves that pattern most (a training
        step's, once the model has trained). A call is the latest of its kind: the graphs it ran,
        each as many times as it ran (the graph of a frame resumed after a graph break once per
        layer); before any call, every graph captured, once."""
        if graph is not None:
            part = self.of(graph)
            counted: Counter = Counter()
            for s in part.sites:
                if s.replaced:
                    counted[s.pattern] += part.times(s)
            return dict(counted)
        best: Counter = Counter()
        for k in self.captures():
            for pattern, n in self.counts(graph=k).items():
                best[pattern] = max(best[pattern], n)
        return dict(best)

    def fell_back_at_run_time(self) -> list[SiteRecord]:
        """Sites the rewrite replaced whose kernel then failed at run time: they run stock code."""
        return [s for s in self.sites if not s.replaced]

    def launches(self) -> int:
        """Kernel launches per call (of the kind of graph with the most): one per site, one per pair
        of paired sites, each as often as its graph runs."""
        most = 0
        for k in self.captures():
            part = self.of(k)
            live = [s for s in part.sites if s.replaced]
            n = sum(part.times(s) for s in live) - sum(part.times(s) for s in live if s.paired) // 2
            most = max(most, n)
        return most

    def extend(self, other: RewriteReport, frame=None, capture: str = "") -> None:
        """Add one capture's records. frame: (dynamo's frame id, its compile number); capture: the
        kind of graph (CAPTURES). Every capture's records are kept (a recompile for new shapes or
        another layer adds an entry dynamo keeps too); what the model's latest call of a kind ran
        picks the ones its views and counts() describe. Graphs of one compile (DDP's graph split
        at its buckets, each piece handed to the backend) share their key."""
        key = frame if frame is not None else self.graphs
        for name in _RECORDS:
            for r in getattr(other, name):
                r.graph, r.capture = key, capture
        self.add(other)
        self.graphs += other.graphs
        self.graphs_by[capture] += other.graphs

    def forget_captures(self) -> None:
        """Drop every capture's records (the model compiles afresh: its earlier graphs no longer run);
        the count of captures stays."""
        for name in _RECORDS:
            setattr(self, name, [])
        self.per_call = {}

    def add(self, other: RewriteReport) -> None:
        """other's records into this capture's (a region of it grafted on its own)."""
        for name in _RECORDS:
            getattr(self, name).extend(getattr(other, name))

    def __str__(self) -> str:
        kinds = self.captures()
        if len(kinds) <= 1:
            part = self.of(kinds[0]) if kinds else self
            return "\n".join(part._lines(part._headline()) + self._extras())
        out = [
            f"kernelgraft: {self.graphs} graph(s), by kind: "
            + ", ".join(f"{k} {self.graphs_by[k]}" for k in kinds)
        ]
        for k in kinds:
            part = self.of(k)
            out += part._lines(f"{k or 'other'} graphs: " + part._headline().removeprefix("kernelgraft: "))
        out += self._extras()
        return "\n".join(out)

    def _headline(self) -> str:
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts().items())) or "none"
        lost = self.fell_back_at_run_time()
        return (
            f"kernelgraft: {sum(self.times(s) for s in self.sites if s.replaced)} site(s) {self._replaced}"
            f" in {self.graphs} graph(s) ({counts})"
            + (f"; {len(lost)} fell back at run time (their kernels failed: stock code runs)" if lost else "")
        )

    @property
    def _replaced(self) -> str:
        return "would be replaced" if self.dry_run else "replaced"

    def _lines(self, headline: str) -> list[str]:
        """This report's records as text under `headline` (each kind's section of a split report)."""
        out = [headline]
        rows = [s.row() for s in self.sites + self.fallbacks]
        for row in rows if self.dry_run else ():  # a dry run's sites are what a real run would replace
            row[-1] = "would be " + row[-1] if row[-1].startswith("replaced") else row[-1]
        for row, s in zip(rows, self.sites):
            if self.times(s) > 1:
                row[-1] += f" (x{self.times(s)}: its graph runs {self.times(s)} times a call)"
        if rows:
            out.append(_table(["pattern", "module", "shapes", "dtypes", "scalars", "status"], rows))
        if self.near_misses:
            out.append(f"near misses ({len(self.near_misses)}):")
            out += _items(self.near_misses)
        if self.unserved:
            out.append(f"not served ({len(self.unserved)}):")
            out += _items(self.unserved)
        if self.projections:
            fused = [r for r in self.projections if r.served]
            out.append(
                f"linear layers reading one input: {len(fused)} of {len(self.projections)} group(s) "
                "fused into one matmul each"
            )
            out += _items(
                f"{r.module} ({', '.join(r.shapes)}): {r.reason}" for r in self.projections if not r.served
            )
        if self.tiles:
            done = [t for t in self.tiles if t.tiled]
            out.append(
                f"token-wise regions: {len(done)} of {len(self.tiles)} run over tiles of the sequence "
                "(report.tiles: each region, and why the others are not)"
            )
        if self.masks_kept:
            out.append(f"attention masks kept as written ({len(self.masks_kept)}):")
            out += _items(f"{r.module}: {r.reason}" for r in self.masks_kept)
        return out

    def _extras(self) -> list[str]:
        """What the report says of the whole model, not of one kind of graph."""
        out = list(self.notes)
        if self.memory is not None:
            out.append(str(self.memory))
        how = self.captured_as
        if how.get("kind") == "whole":
            out.append(f"captured whole: {how['why']}")
        elif how:
            out += how["stack"].report_lines()
        out += [str(first) for first in self.startup.values()]
        if self.stock_runs:
            out.append(f"calls that did not run what kernelgraft compiled ({len(self.stock_runs)}):")
            out += _items(self.stock_runs)
        if self.graph_breaks:
            out.append(
                f"graph breaks ({sum(self.graph_breaks.values())}): the model was captured in pieces, each "
                "served on its own; a site a break cuts is not seen whole (TORCH_LOGS=graph_breaks shows where)"
            )
            out += _items(f"{why} (x{n})" for why, n in self.graph_breaks.most_common())
        if self.mask_checks:
            yes, no = (sum(c.runs[i] for c in self.mask_checks) for i in (0, 1))
            out.append(
                f"attention masks read from graph inputs, checked at run time: {len(self.mask_checks)} "
                f"(causal in {yes} of {yes + no} checks; a mask that is not runs as written)"
            )
        if self.launched_by:
            out.append(
                "kernel calls in compiled graphs: "
                + ", ".join(f"{v} launched by {k}" for k, v in sorted(self.launched_by.items()))
            )
        if self.wrappers:
            out.append(
                "graphs compiled by inductor, by the wrapper that launches their kernels: "
                + ", ".join(f"{v} {k}" for k, v in sorted(self.wrappers.items()))
            )
        return [w for line in out for w in (textwrap.wrap(line, WIDTH, subsequent_indent="    ") or [line])]

    __repr__ = __str__


def _items(things) -> list[str]:
    """A bulleted list, each item wrapped at WIDTH."""
    return [
        line
        for t in things
        for line in textwrap.wrap(str(t), WIDTH, initial_indent="  - ", subsequent_indent="    ")
    ]


WIDTH = 120  # the widest a printed table gets: wider rows put their details on a line of their own


def _table(head: list[str], rows: list[list[str]], details: tuple[int, ...] = (2, 3, 4)) -> str:
    """rows under head, columns aligned. Where that is wider than WIDTH, the `details` columns
    leave the table: each row's details follow it on an indented line, wrapped at WIDTH."""

    def aligned(head, rows):
        widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
        fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
        return [fmt(head), fmt(["-" * w for w in widths])], fmt

    lines, fmt = aligned(head, rows)
    if max(len(x) for x in lines) <= WIDTH:
        return "\n".join(lines + [fmt(r) for r in rows])
    keep = [i for i in range(len(head)) if i not in details]
    # the last column's text past its first ": " (a fallback's reason) goes to the details too
    last = keep[-1]
    cut = lambda c: str(c).split(": ", 1)
    short = lambda r: [cut(r[i])[0] if i == last else r[i] for i in keep]
    lines, fmt = aligned(short(head), [short(r) for r in rows])
    for r in rows:
        lines.append(fmt(short(r)))
        more = [f"{head[i]}: {r[i]}" for i in details if r[i]]
        if len(cut(r[last])) > 1:
            more.append(f"why: {cut(r[last])[1]}")
        if more:
            lines += textwrap.wrap("; ".join(more), WIDTH, initial_indent="    ", subsequent_indent="      ")
    return "\n".join(lines)


def graph_break_reasons(counted: Counter) -> Counter:
    """dynamo's graph-break counter (reason text -> breaks) with each reason cut to its first two
    lines, the kind of break and its explanation (the rest is hints and debugging context, which
    differs between breaks of one cause), and merged."""
    out: Counter = Counter()
    for text, n in counted.items():
        lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()][:2]
        why = ": ".join(ln.removeprefix("Explanation: ") for ln in lines)
        out[why] += n
    return out
