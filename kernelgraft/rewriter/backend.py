"""Step 4 of 4: lower. The torch.compile backend that runs the whole pipeline on each dynamo graph,
then hands the rewritten graph to inductor (default) or runs it as is ("eager").
"""

from __future__ import annotations

import torch

from .replace import graft
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

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        # the kernels round as the code around them will: eager's per-op rounding, or inductor's fused one
        rounding = "fused" if self.backend == "inductor" else "autograd"
        self.report.extend(
            graft(gm, self.spellings, dry_run=self.dry_run, rounding=rounding, options=self.options),
            frame=_frame_id(),
        )
        if self.backend == "inductor" and not self.dry_run:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return gm.forward


def _frame_id():
    """Dynamo's id of the frame being compiled (the same across its recompiles), if it tells."""
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        return getattr(cid, "frame_id", None)
    except Exception:  # noqa: BLE001 - older/newer torch without it: every capture counts
        return None


def _named_backend(gm, example_inputs):
    return Grafter("inductor")(gm, example_inputs)


def register() -> None:
    """Make `torch.compile(model, backend="kernelgraft")` work (idempotent)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "kernelgraft" not in _BACKENDS:
        register_backend(name="kernelgraft")(_named_backend)
