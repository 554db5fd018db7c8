"""The comparison rule, in one place.

error(candidate) = ||candidate - truth|| / ||truth||, per output and per gradient, truth being the
reference computed in float64. kernelgraft passes when its error <= 1.1 * max(eager, compile) +
4 * float32 epsilon, with NaN/inf only where truth has them. No fixed atol anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPS32 = torch.finfo(torch.float32).eps
SLACK = 1.1
FLOOR = 4 * EPS32


def rel_error(candidate: torch.Tensor | None, truth: torch.Tensor | None) -> float:
    """||candidate - truth|| / ||truth|| over the finite entries of truth (inf if non-finite
    entries disagree, or the candidate is missing where truth is not).

    >>> import torch
    >>> from kernelgraft.gradcheck import rel_error
    >>> round(rel_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5]).double()), 4)  # 0.5 / 5.41
    0.0925
    >>> rel_error(None, torch.ones(2)), rel_error(torch.tensor([float("nan")]), torch.ones(1))
    (inf, inf)
    """
    if truth is None:
        return 0.0 if candidate is None else math.inf
    if candidate is None:
        return math.inf
    c, t = candidate.detach().double().cpu(), truth.detach().double().cpu()
    if c.shape != t.shape:
        return math.inf
    finite = torch.isfinite(t)
    if not torch.equal(torch.isfinite(c), finite) or not torch.equal(
        c[~finite].nan_to_num(), t[~finite].nan_to_num()
    ):
        return math.inf
    diff = (c[finite] - t[finite]).norm().item()
    norm = t[finite].norm().item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def bound(eager: float, compile: float | None = None) -> float:
    """The most error a candidate may have: SLACK x the worse reference's, plus FLOOR."""
    return SLACK * max(e for e in (eager, compile) if e is not None) + FLOOR


@dataclass
class Verdict:
    what: str  # 'out', 'grad x', ...
    kernelgraft: float
    eager: float
    compile: float | None = None

    @property
    def bound(self) -> float:
        return bound(self.eager, self.compile)

    @property
    def ok(self) -> bool:
        return self.kernelgraft <= self.bound

    def __str__(self) -> str:
        c = "-" if self.compile is None else f"{self.compile:.3g}"
        mark = "ok" if self.ok else "FAIL"
        return f"{self.what}: kernelgraft {self.kernelgraft:.3g}  eager {self.eager:.3g}  compile {c}  bound {self.bound:.3g}  {mark}"


def judge(what: str, truth, kernelgraft, eager, compiled=None) -> Verdict:
    """The rule applied to one quantity: each candidate's error vs `truth`, and the verdict.

    >>> import torch
    >>> from kernelgraft.gradcheck import judge
    >>> truth = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    >>> v = judge("out", truth, truth.float(), truth.bfloat16())
    >>> v.ok, v.kernelgraft < v.eager
    (True, True)
    >>> judge("out", truth, truth.bfloat16() * 1.01, truth.float()).ok  # less accurate than eager
    False
    """
    return Verdict(
        what,
        rel_error(kernelgraft, truth),
        rel_error(eager, truth),
        None if compiled is None else rel_error(compiled, truth),
    )
