"""kernelgraft: find the subgraphs every decoder repeats, graft in Triton kernels whose backward was
derived with sympy, and check they are no less accurate than the code they replace.

    import kernelgraft
    model = kernelgraft.optimize(model)          # same object, compiled in place
    report = kernelgraft.explain(model, **batch) # what would be replaced, and what nearly was
    audit = kernelgraft.audit(model, **batch)    # per site and parameter: as accurate as stock?
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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

# names and submodules are imported on first use, so that `import kernelgraft` (and the command
# line's --help) does not wait for torch
_FROM = {
    "audit": "gradcheck",
    "Options": "options",
    "Scalar": "patterns",
    "pattern": "patterns",
    "Grafter": "rewriter",
    "explain": "rewriter",
    "optimize": "rewriter",
}

if TYPE_CHECKING:
    from . import gradcheck, ir, kernels, patterns
    from .gradcheck import audit
    from .options import Options
    from .patterns import Scalar, pattern
    from .rewriter import Grafter, explain, optimize


def __getattr__(name: str):
    if name in _FROM:
        value = getattr(importlib.import_module(f".{_FROM[name]}", __name__), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
