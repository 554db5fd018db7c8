"""kernelgraft: find the subgraphs every decoder repeats, graft in Triton kernels whose backward was
derived with sympy, and check they are no less accurate than the code they replace.

    import kernelgraft
    model = kernelgraft.optimize(model)          # same object, compiled in place
    report = kernelgraft.explain(model, **batch) # what would be replaced, and what nearly was
    audit = kernelgraft.audit(model, **batch)    # per site and parameter: as accurate as stock?
"""

from . import gradcheck, ir, kernels, patterns
from .gradcheck import audit
from .options import Options
from .patterns import Scalar, pattern
from .rewriter import Grafter, explain, optimize

__version__ = "0.1.0"
__all__ = [
    "Grafter",
    "Options",
    "Scalar",
    "audit",
    "explain",
    "gradcheck",
    "ir",
    "kernels",
    "optimize",
    "pattern",
    "patterns",
]
