"""Audit any kernel against a pattern's own PyTorch spelling: kernelgraft's, Liger's or Unsloth's where
installed, or a user's. The same references and rule as every kernelgraft check (float64 truth,
eager in the working dtype, error <= 1.1 x eager's + 4 float32 eps), over the pattern's example
arguments in several dtypes and shapes, plus outliers (inputs scaled to +-100).

Flagged: a gradient that is missing (None) or zero where the truth's is not; NaN/inf where the truth
is finite; an output or gradient less accurate than eager; an exception; and, for bf16/fp16, which
rounding the output reproduces: eager's (the spelling run op by op), inductor's (the spelling fused,
rounded at explicit casts and stores), or neither (it rounds somewhere the spelling does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..kernels import op_for
from ..patterns import REGISTRY
from .references import run_with_grads
from .rule import judge

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((1, 7), (33, 64), (5, 4096))  # (rows, row length): one row, an odd width, a model width
CORRECTNESS = ("error", "missing gradient", "zero gradient", "nan", "inaccurate")


@dataclass
class Finding:
    case: str  # "bfloat16 33x64", "bfloat16 33x64 x100" (outliers)
    what: str  # "out", "grad weight", "rounding"
    kind: str  # one of CORRECTNESS, or "rounding"
    detail: str

    def __str__(self) -> str:
        return f"{self.case}: {self.what}: {self.kind} ({self.detail})"


@dataclass
class KernelAudit:
    pattern: str
    spelling: str
    kernel: str
    cases: int = 0
    findings: list[Finding] = field(default_factory=list)
    rounding: dict = field(
        default_factory=dict
    )  # dtype -> "eager" | "inductor" | "eager = inductor" | "neither"

    @property
    def ok(self) -> bool:
        """No wrong, missing, NaN or less accurate result (the rounding is reported, not judged)."""
        return not any(f.kind in CORRECTNESS for f in self.findings)

    @property
    def flagged(self) -> list[Finding]:
        """Everything worth a look, the rounding included."""
        return list(self.findings)

    def to_markdown(self) -> str:
        lines = [
            f"### {self.kernel} as {self.pattern}.{self.spelling}: {'ok' if self.ok else 'FLAGGED'} ({self.cases} cases)",
            "",
            "rounding reproduced: " + (", ".join(f"{k}: {v}" for k, v in self.rounding.items()) or "-"),
        ]
        if self.findings:
            lines += ["", "| case | what | finding | detail |", "|---|---|---|---|"]
            lines += [f"| {f.case} | {f.what} | {f.kind} | {f.detail} |" for f in self.findings]
        return "\n".join(lines) + "\n"

    __str__ = to_markdown


def _match(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of elements equal bit for bit."""
    if a.shape != b.shape:
        return 0.0
    return (a == b).float().mean().item() if a.numel() else 1.0


def _scaled(args, factor: float):
    """The floating tensors of `args` times `factor` (outliers), as new leaves."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            out.append((a.detach().float() * factor).to(a.dtype).requires_grad_(a.requires_grad))
        else:
            out.append(a)
    return tuple(out)


def audit_kernel(
    fn,
    pattern: str,
    spelling: str | None = None,
    *,
    dtypes=DTYPES,
    shapes=SHAPES,
    outliers: float | None = 100.0,
    name: str | None = None,
    same_rounding: float = 0.99,
) -> KernelAudit:
    """Check `fn` (called with the spelling's arguments, in order) like kernelgraft checks its own
    kernels, and report what is wrong, missing or rounded elsewhere.

    >>> import torch, kernelgraft
    >>> from kernelgraft.gradcheck import audit_kernel
    >>> def no_weight_grad(x, w, eps):  # a bug that shipped: the weight gets no gradient
    ...     h = x.float()
    ...     h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    ...     return w.detach() * h.to(x.dtype)
    >>> rep = audit_kernel(no_weight_grad, "rms_norm", "llama", dtypes=[torch.float32], shapes=[(4, 16)])
    >>> rep.ok, sorted({f.kind for f in rep.findings})
    (False, ['missing gradient'])
    """
    sp = REGISTRY.get(pattern, spelling)
    label = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    rep = KernelAudit(sp.pattern, sp.name, label)
    fused = None
    if sp.kernel == "row":
        fused = op_for(sp, "fused")  # the spelling rounded as inductor rounds it
    for dtype in dtypes:
        dname = str(dtype).replace("torch.", "")
        votes = {"eager": [], "inductor": []}
        for rows, n in shapes:
            base = sp.example_args(rows, n, dtype, seed=rows * 7919 + n)
            variants = [(f"{dname} {rows}x{n}", base)]
            if outliers:
                variants.append((f"{dname} {rows}x{n} x{outliers:g}", _scaled(base, outliers)))
            for case, args in variants:
                rep.cases += 1
                _check_case(rep, sp, fn, case, args)
                if dtype != torch.float32 and not case.endswith(f"x{outliers:g}"):
                    with torch.no_grad():
                        got = _call(fn, args)
                        if got is not None:
                            votes["eager"].append(_match(got, sp.fn(*args)))
                            if fused is not None:
                                votes["inductor"].append(_match(got, fused(*args)))
        if dtype != torch.float32 and votes["eager"]:
            e = min(votes["eager"])
            i = min(votes["inductor"]) if votes["inductor"] else 0.0
            if e >= same_rounding and i >= same_rounding:
                rep.rounding[dname] = "eager = inductor"  # the spelling rounds the same both ways
            elif e >= same_rounding:
                rep.rounding[dname] = "eager"
            elif i >= same_rounding:
                rep.rounding[dname] = "inductor"
            else:
                rep.rounding[dname] = "neither"
                rep.findings.append(
                    Finding(
                        dname,
                        "rounding",
                        "rounding",
                        f"the output equals eager's in {e:.0%} and inductor's in {i:.0%} of elements: "
                        "it rounds where the spelling does not",
                    )
                )
    return rep


def _call(fn, args):
    try:
        out = fn(*args)
    except Exception:  # noqa: BLE001 - reported by _check_case
        return None
    return out.detach() if isinstance(out, torch.Tensor) else None


def _check_case(rep: KernelAudit, sp, fn, case: str, args) -> None:
    with torch.no_grad():
        out0 = sp.fn(*args)
    gen = torch.Generator().manual_seed(len(case))
    g = torch.randn(out0.shape, generator=gen).to(out0.dtype)
    names = [n for n, a in zip(sp.arg_names, args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    truth, tgrads = run_with_grads(sp.fn, args, g, truth=True)
    eager, egrads = run_with_grads(sp.fn, args, g)
    try:
        got, kgrads = run_with_grads(fn, args, g)
    except Exception as e:  # noqa: BLE001 - a crash is a finding, not the end of the audit
        if "does not require grad" in str(e) or "does not have a grad_fn" in str(e):
            rep.findings.append(
                Finding(case, "grads", "missing gradient", "the output is not differentiable")
            )
        else:
            rep.findings.append(Finding(case, "call", "error", f"{type(e).__name__}: {e}"[:200]))
        return
    _compare(rep, case, "out", truth, got, eager)
    for n, t, k, e in zip(names, tgrads, kgrads, egrads):
        if t is None:
            continue
        if k is None:
            rep.findings.append(
                Finding(case, f"grad {n}", "missing gradient", "None where the spelling has one")
            )
            continue
        if torch.count_nonzero(k) == 0 and torch.count_nonzero(t) > 0:
            rep.findings.append(
                Finding(case, f"grad {n}", "zero gradient", "all zero where the truth is not")
            )
            continue
        _compare(rep, case, f"grad {n}", t, k, e)


def _compare(rep: KernelAudit, case: str, what: str, truth, got, eager) -> None:
    # where eager overflows too, the dtype cannot hold the value (fp16 past 65504): not the kernel's fault
    finite = torch.isfinite(truth) & torch.isfinite(eager.to(truth.dtype))
    if not torch.isfinite(got[finite]).all():
        bad = (~torch.isfinite(got) & finite).sum().item()
        rep.findings.append(
            Finding(case, what, "nan", f"{bad} non-finite values where the truth and eager are finite")
        )
        return
    v = judge(what, truth, got, eager)
    if not v.ok:
        ratio = v.kernelgraft / v.eager if v.eager else math.inf
        rep.findings.append(
            Finding(
                case, what, "inaccurate", f"error {v.kernelgraft:.3g} vs eager's {v.eager:.3g} ({ratio:.2f}x)"
            )
        )
