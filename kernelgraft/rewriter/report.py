"""RewriteReport: what each capture replaced, what fell back and why, and what nearly matched."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch.fx

from ..kernels.fallback import failure_of, site_key

_PREFIX = re.compile(r"^L\[[^\]]*\](\[\d+\])*\.?")


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
    return path.strip(".") or "<top>"


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
    kind: str  # "norm" | "mlp" | "rope" | "lm_head"
    cls: str  # the module's class name; a rotary helper's function name
    reason: str
    graph: object = 0

    def __str__(self) -> str:
        what = {"mlp": "an MLP", "norm": "a norm", "rope": "a rotary helper", "lm_head": "the LM head"}[self.kind]
        return f"{self.module} ({self.cls}, {what}): {self.reason}"


@dataclass
class RewriteReport:
    """Per capture: `.sites` (replaced by the rewrite), `.fallbacks` (refused at capture),
    `.near_misses`, `.counts()`; `str()` is a table. A site whose kernel failed later, at run time,
    stays in `.sites` but is no longer `replaced`, nor counted: `fell_back_at_run_time()` lists them."""

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
    graphs: int = 0  # captures seen, recompiles included
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

    def counts(self) -> dict[str, int]:
        """Pattern name -> number of sites replaced (whose kernels run now)."""
        return dict(Counter(s.pattern for s in self.sites if s.replaced))

    def fell_back_at_run_time(self) -> list[SiteRecord]:
        """Sites the rewrite replaced whose kernel then failed at run time: they run stock code."""
        return [s for s in self.sites if not s.replaced]

    def launches(self) -> int:
        """Kernel launches per forward: one per site, one per pair of paired sites."""
        live = [s for s in self.sites if s.replaced]
        return len(live) - sum(s.paired for s in live) // 2

    def extend(self, other: RewriteReport, frame=None) -> None:
        """Add one capture's records. frame: (dynamo's frame id, its compile number). A recapture of
        the same frame (a recompile: new shapes, new guards) replaces that frame's records, so
        counts() describe the code that runs now; graphs of one compile (DDP's graph split at its
        buckets, each piece handed to the backend) add up."""
        if frame is not None:
            stale = lambda r: isinstance(r.graph, tuple) and r.graph[0] == frame[0] and r.graph != frame
            self.sites = [r for r in self.sites if not stale(r)]
            self.fallbacks = [r for r in self.fallbacks if not stale(r)]
            self.near_misses = [r for r in self.near_misses if not stale(r)]
            self.unserved = [r for r in self.unserved if not stale(r)]
            self.masks_kept = [r for r in self.masks_kept if not stale(r)]
            self.projections = [r for r in self.projections if not stale(r)]
        key = frame if frame is not None else self.graphs
        for r in (
            other.sites
            + other.fallbacks
            + other.near_misses
            + other.unserved
            + other.masks_kept
            + other.projections
        ):
            r.graph = key
        self.add(other)
        self.graphs += other.graphs

    def forget_captures(self) -> None:
        """Drop every capture's records (the model compiles afresh: its earlier graphs no longer run);
        the count of captures stays."""
        self.sites, self.fallbacks, self.near_misses, self.unserved = [], [], [], []
        self.masks_kept, self.projections = [], []

    def add(self, other: RewriteReport) -> None:
        """other's records into this capture's (a region of it grafted on its own)."""
        self.sites += other.sites
        self.fallbacks += other.fallbacks
        self.near_misses += other.near_misses
        self.unserved += other.unserved
        self.masks_kept += other.masks_kept
        self.projections += other.projections

    def __str__(self) -> str:
        head = ["pattern", "module", "shapes", "dtypes", "scalars", "status"]
        rows = [s.row() for s in self.sites + self.fallbacks]
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts().items())) or "none"
        lost = self.fell_back_at_run_time()
        out = [
            f"kernelgraft: {len(self.sites) - len(lost)} site(s) replaced in {self.graphs} graph(s) ({counts})"
            + (f"; {len(lost)} fell back at run time (their kernels failed: stock code runs)" if lost else "")
        ]
        if rows:
            out.append(_table(head, rows))
        if self.near_misses:
            out.append(f"near misses ({len(self.near_misses)}):")
            out += [f"  - {m}" for m in self.near_misses]
        if self.unserved:
            out.append(f"not served, nothing close ({len(self.unserved)}):")
            out += [f"  - {u}" for u in self.unserved]
        if self.graph_breaks:
            out.append(
                f"graph breaks ({sum(self.graph_breaks.values())}): the model was captured in pieces, each "
                "served on its own; a site a break cuts is not seen whole (TORCH_LOGS=graph_breaks shows where)"
            )
            out += [f"  - {why} (x{n})" for why, n in self.graph_breaks.most_common()]
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
        if self.projections:
            fused = [r for r in self.projections if r.served]
            out.append(
                f"linear layers reading one input: {len(fused)} of {len(self.projections)} group(s) "
                "fused into one matmul each"
            )
            out += [
                f"  - {r.module} ({', '.join(r.shapes)}): {r.reason}"
                for r in self.projections
                if not r.served
            ]
        if self.masks_kept:
            out.append(f"attention masks kept as written ({len(self.masks_kept)}):")
            out += [f"  - {r.module}: {r.reason}" for r in self.masks_kept]
        return "\n".join(out)

    __repr__ = __str__


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


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
