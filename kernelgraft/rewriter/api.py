"""optimize() and explain(): the user-facing entry points of the rewriter."""

from __future__ import annotations

import contextlib

import torch

from .backend import BACKENDS, Grafter
from .report import RewriteReport


def optimize(model: torch.nn.Module, backend: str = "inductor", patterns=None, *, dynamic: bool | None = None):
    """Compile `model` in place with the kernelgraft backend and return the same object.

    State-dict keys, `save_pretrained`/`from_pretrained`, peft and Trainer keep working; other
    models in the process are untouched. The report of what each capture replaced accumulates in
    `model.kernelgraft_report`.

    >>> import torch, kernelgraft
    >>> m = torch.nn.Linear(4, 4)
    >>> kernelgraft.optimize(m, backend="eager") is m
    True
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"kernelgraft.optimize: expected a torch.nn.Module, got {type(model).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"kernelgraft.optimize: backend must be one of {BACKENDS}, got {backend!r}")
    grafter = Grafter(backend, patterns)
    model.compile(backend=grafter, dynamic=dynamic)
    model.kernelgraft_report = grafter.report
    return model


@contextlib.contextmanager
def _room_for_recompiles():
    # Each explain() is a fresh capture of Module._call_impl; keep dynamo's per-code recompile limit
    # from silently turning later captures into eager runs.
    cfg = torch._dynamo.config
    keys = [k for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit") if hasattr(cfg, k)]
    with cfg.patch(**{k: 1 << 20 for k in keys}):
        yield


def explain(model: torch.nn.Module, *args, patterns=None, **kwargs) -> RewriteReport:
    """Capture `model(*args, **kwargs)` once, without changing the model, and report what
    kernelgraft would replace (`.counts()`, `.sites`), what it would not serve (`.fallbacks`)
    and what nearly matched (`.near_misses`).

    >>> import torch, kernelgraft
    >>> class Norm(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = torch.nn.Parameter(torch.ones(8))
    ...     def forward(self, x):
    ...         h = x.float()
    ...         h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    ...         return self.weight * h.to(x.dtype)
    >>> kernelgraft.explain(Norm(), torch.randn(2, 8)).counts()
    {'rms_norm': 1}
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"kernelgraft.explain: expected a torch.nn.Module, got {type(model).__name__}")
    grafter = Grafter("eager", patterns, dry_run=True)
    with _room_for_recompiles(), torch.no_grad():
        torch.compile(model._call_impl, backend=grafter)(*args, **kwargs)
    if grafter.report.graphs == 0:
        raise RuntimeError(
            "kernelgraft.explain: dynamo captured no graph of this model (see TORCH_LOGS=graph_breaks); "
            "nothing would be replaced"
        )
    return grafter.report
