"""gradcheck: is a kernel at least as accurate as the code it replaces? References (float64 truth,
eager, torch.compile) and the comparison rule (rule.py).

`kernelgraft.gradcheck.strategies` (hypothesis strategies that draw a pattern's test cases) needs the
`test` extra, `pip install 'kernelgraft[test]'`: it is imported on first use, not with the package.
"""

from importlib import import_module as _import_module

from .audit import Finding, KernelAudit, audit_kernel
from .model_audit import Lint, ModelAudit, Row, audit
from .references import Float64Everywhere, run_with_grads
from .rule import EPS32, Verdict, judge, rel_error
from .spelling import check_spelling

__all__ = [
    "EPS32",
    "Finding",
    "Float64Everywhere",
    "KernelAudit",
    "Lint",
    "ModelAudit",
    "Row",
    "audit",
    "Verdict",
    "audit_kernel",
    "check_spelling",
    "judge",
    "rel_error",
    "run_with_grads",
]


def __getattr__(name: str):
    """`kernelgraft.gradcheck.strategies` on first use: it imports hypothesis (the `test` extra), which
    `import kernelgraft` must not need. Without hypothesis it raises ImportError naming the extra."""
    if name == "strategies":
        return _import_module(f"{__name__}.strategies")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
