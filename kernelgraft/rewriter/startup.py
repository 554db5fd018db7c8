"""What a model's first call of each kind of graph spent its time on: dynamo's capture, kernelgraft's
rewriting, inductor (with the Triton builds it waited for), and the rest of the call (running it,
guards); for a training call, the backward's compile too, which AOTAutograd runs at the first
backward, after the call. Read from torch's compile-time metrics (process-wide sums, taken as the
difference around the call) and the grafter's own rewriting time, so that a slow start explains
itself in the report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# torch._dynamo.utils.compilation_time_metrics keys: seconds, summed over their entries
_DYNAMO = "_compile.compile_inner"  # a frame's whole compile: tracing, the backend, guards
_BACKEND = "OutputGraph.call_user_compiler"  # the backend's share (kernelgraft, then inductor)
_INDUCTOR = "compile_fx_inner"  # inductor compiling one graph (a backward's at its first backward)
_TRITON = "async_compile.wait"  # waiting for the Triton kernels inductor builds in worker processes
_KEYS = (_DYNAMO, _BACKEND, _INDUCTOR, _TRITON)


def _table() -> dict | None:
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without them: the report gives the wall time alone
        return None
    return compilation_time_metrics


def _marks() -> dict:
    """Where each metric's list of entries ends now: taken around every call, so only lengths."""
    table = _table()
    return {} if table is None else {k: len(table.get(k, ())) for k in _KEYS}


def _since(marks: dict) -> dict:
    """Seconds each metric gained since `marks` (its entries added since, summed)."""
    table = _table() or {}
    return {k: sum(table.get(k, ())[n:]) for k, n in marks.items()}


@dataclass
class Startup:
    """One kind of graph's first call that compiled: its wall time and what it spent, in seconds."""

    kind: str  # "training", "evaluation" or "decoding"
    wall: float
    parts: dict = field(default_factory=dict)  # what the call spent, by name, in its order
    backward: dict = field(default_factory=dict)  # a training call's backward compile, once seen

    def __str__(self) -> str:
        def said(parts):
            return ", ".join(f"{k} {v:.1f} s" for k, v in parts.items() if v >= 0.05) or "nothing to speak of"

        line = f"first {self.kind} call: {self.wall:.1f} s ({said(self.parts)})"
        if self.backward:
            line += f"; its backward's compile: {said(self.backward)}"
        return line


class Clock:
    """Taken around each of a model's calls (`before`, `after`): the first call of each kind that
    compiled a graph is kept in `report.startup`; the compile work done between a training call and
    the model's next call (its backward's) is added to that training call's record."""

    def __init__(self):
        self.pending: Startup | None = None  # a training call whose backward has not been read yet
        self.since: dict = {}  # the metrics' marks when that call ended

    def before(self, grafter) -> tuple:
        if self.pending is not None:
            self.pending.backward = _backward(_since(self.since))
            self.pending = None
        return time.perf_counter(), _marks(), grafter.rewrite_seconds, grafter.report.graphs

    def after(self, grafter, taken: tuple, kind: str) -> None:
        start, marks, rewriting, graphs = taken
        rep = grafter.report
        if rep.graphs == graphs or kind in rep.startup:
            return
        wall = time.perf_counter() - start
        d = _since(marks)
        rewrite = grafter.rewrite_seconds - rewriting
        parts = {}
        if d:
            backend = d[_BACKEND]
            parts["dynamo's capture"] = max(d[_DYNAMO] - backend, 0.0)
            parts["kernelgraft's rewriting"] = rewrite
            parts["inductor"] = max(backend - rewrite, 0.0)
            parts["of which Triton builds"] = d[_TRITON]
            parts["running and the rest"] = max(wall - d[_DYNAMO], 0.0)
        else:
            parts["kernelgraft's rewriting"] = rewrite
        record = Startup(kind, wall, parts)
        rep.startup[kind] = record
        if kind == "training" and d:
            self.pending, self.since = record, _marks()


def _backward(d: dict) -> dict:
    """What a training call's backward compiled, from the metrics it gained (`d`)."""
    return {"inductor": d[_INDUCTOR], "of which Triton builds": d[_TRITON]} if d else {}
