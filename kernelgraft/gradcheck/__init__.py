"""gradcheck: is a kernel at least as accurate as the code it replaces? References (float64 truth,
eager, torch.compile) and the DESIGN.md comparison rule."""

from . import strategies
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
    "strategies",
]
