"""optimize() and explain(): the user-facing entry points of the rewriter."""

from __future__ import annotations

import functools

import torch

from .._dynamo import fresh_entry
from .backend import BACKENDS, Grafter
from .report import RewriteReport


def optimize(
    model: torch.nn.Module, backend: str = "inductor", patterns=None, *, dynamic: bool | None = None
):
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
    # what Module.compile does, through an entry function of this model's own (see fresh_entry)
    compiled = torch.compile(
        fresh_entry(f"{type(model).__name__}@{id(model):x}"), backend=grafter, dynamic=dynamic
    )
    model._compiled_call_impl = functools.partial(compiled, model)
    model.kernelgraft_report = grafter.report
    return model


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
    with torch.no_grad():
        torch.compile(fresh_entry("explain"), backend=grafter)(model, *args, **kwargs)
    if grafter.report.graphs == 0:
        raise RuntimeError(
            "kernelgraft.explain: dynamo captured no graph of this model (see TORCH_LOGS=graph_breaks); "
            "nothing would be replaced"
        )
    return grafter.report
