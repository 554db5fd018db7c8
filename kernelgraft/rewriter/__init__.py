"""The compiler: capture (dynamo) -> canonicalize (ir/) -> match -> replace -> lower.

pipeline.py lists the passes over one graph; backend.py is the torch.compile backend that runs them
and lowers; api.py holds optimize() and explain(); ddp.py the DistributedDataParallel graph cuts.
"""

from . import attention, projections
from .api import explain, optimize
from .backend import Grafter, register
from .report import NearMiss, RewriteReport, SiteRecord

register()

# graph rewrites without a kernel of their own, which reports name as they name patterns
REWRITES = {**attention.REWRITES, **projections.REWRITES}

__all__ = ["REWRITES", "Grafter", "NearMiss", "RewriteReport", "SiteRecord", "explain", "optimize", "register"]
