"""The compiler: capture (dynamo) -> canonicalize -> match -> replace -> lower."""

from .api import explain, optimize
from .backend import Grafter, register
from .report import NearMiss, RewriteReport, SiteRecord

register()

__all__ = ["Grafter", "NearMiss", "RewriteReport", "SiteRecord", "explain", "optimize", "register"]
