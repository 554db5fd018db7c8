"""What an optimized model's call ran: its own compiled graphs, another model's, or stock code.

Dynamo keeps compiled code per code object and backend, but a frame that hits its recompile limit
runs whichever compiled entry's guards pass, another model's included, or else the frame as written.
Each graph a Grafter compiles is wrapped to count its runs and to see whose call runs it, and
dynamo's warning of a hit limit is caught for the model whose call hit it: a call that ran stock
code or another model's graphs is said in a warning and in the model's report.
"""

from __future__ import annotations

import contextvars
import logging
import weakref

import torch

from ..kernels.fallback import warn_once

# the path of the module whose own graph is being captured (layers.py: "model.layers.*", or a norm's
# path outside them): the records' module paths, relative to that module, read from the model's root
LAYERS: contextvars.ContextVar[str] = contextvars.ContextVar("kernelgraft_layers", default="")


def under_layers(module: str, path: str | None = None) -> str:
    """`module`, relative to `path` (LAYERS' by default; none: unchanged), from the model's root."""
    path = LAYERS.get() if path is None else path
    return module if not path else path if module in ("", "<top>") else f"{path}.{module}"


# the Grafter of the optimized model whose call is running
CALLER = contextvars.ContextVar("kernelgraft_caller", default=None)
# the Grafters of the optimized models alive in the process
LIVE: weakref.WeakSet = weakref.WeakSet()


def counted(grafter, compiled, key):
    """`compiled` (a graph `grafter` compiled for the capture `key`, as the report's records name
    it), counting its runs on the grafter and, where it runs inside another model's call, on that
    model's grafter as a run of foreign code."""
    index = len(grafter.graph_runs)
    grafter.graph_runs.append(0)
    grafter.graph_keys.append(key)

    def run(*args):
        grafter.runs += 1
        grafter.graph_runs[index] += 1
        caller = CALLER.get()
        if caller is not None and caller is not grafter:
            caller.foreign_runs += 1
        return compiled(*args)

    if getattr(compiled, "_boxed_call", False):  # dynamo calls such a function with one list
        run._boxed_call = True
    return run


class _LimitHits(logging.Handler):
    """Dynamo's "hit config.recompile_limit" warning, kept for the model whose call raised it."""

    def emit(self, record: logging.LogRecord) -> None:
        caller = CALLER.get()
        if caller is not None and "hit config." in str(record.msg):
            args = record.args if isinstance(record.args, tuple) else ()
            limit, value, function = (list(args) + ["?", "?", "?"])[:3]
            caller.limit_hits.append(f"{limit} ({value}) reached for {function}")


_HANDLER = _LimitHits(level=logging.WARNING)


def watch() -> None:
    """Catch dynamo's recompile-limit warnings from now on (once per process)."""
    log = logging.getLogger("torch._dynamo.convert_frame")
    if _HANDLER not in log.handlers:
        log.addHandler(_HANDLER)


def shapes_of(args, kwargs) -> str:
    """A call's tensor arguments and their shapes, as a report names the call."""
    named = [(f"arg {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    return ", ".join(f"{k} {list(v.shape)}" for k, v in named if isinstance(v, torch.Tensor)) or "no tensors"


def check(grafter, model, before: tuple, args, kwargs) -> None:
    """After one of `model`'s calls: what it ran, against `before` (runs(grafter) taken before the
    call). Stock code or another model's graphs: said once in a warning, and in the report."""
    ran, foreign, hits, _ = before
    new_hits = grafter.limit_hits[hits:]
    what = []
    if new_hits:
        what += new_hits
    if grafter.runs == ran and grafter.report.graphs:
        what.append("none of the model's compiled graphs ran: the call ran stock code")
    if grafter.foreign_runs > foreign:
        what.append(
            f"{grafter.foreign_runs - foreign} graph run(s) compiled for another model ran in this call "
            "(dynamo's recompile limit: it runs whichever compiled entry's guards pass)"
        )
    if not what:
        return
    line = f"{shapes_of(args, kwargs)}: " + "; ".join(what)
    rep = grafter.report
    if line not in rep.stock_runs:
        rep.stock_runs.append(line)
    warn_once(
        ("stock run", id(grafter), tuple(what)),
        f"kernelgraft: a call of {type(model).__name__} did not run what kernelgraft compiled for it ({line}). "
        "Raise torch._dynamo.config.recompile_limit, or pass dynamic=True (one graph for every length), "
        "and see model.kernelgraft_report.stock_runs.",
    )


def runs(grafter) -> tuple:
    """What check() and times() compare a call's end with."""
    return grafter.runs, grafter.foreign_runs, len(grafter.limit_hits), list(grafter.graph_runs)


def times(grafter, before: tuple, kind: str) -> None:
    """How many times each capture's graph ran in the call that just ended (a frame dynamo resumes
    after a graph break runs once per decoder layer, say), kept in the report for the call's kind
    of graph: counts() are per call. The pieces of one capture (DDP's) count as one run each."""
    ran = before[3]
    per: dict = {}
    for i, now in enumerate(grafter.graph_runs):
        n = now - (ran[i] if i < len(ran) else 0)
        if n:
            key = grafter.graph_keys[i]
            per[key] = max(per.get(key, 0), n)
    if per:
        grafter.report.per_call[kind] = per
