"""The IR every layer above reads: the canonical graph (graph.py), the table of primitives
(primitives.py) with the sympy functions and Triton printing behind it (sym.py), and
canonicalization of fx graphs into it (canonicalize.py). It imports nothing else of kernelgraft."""

from .canonicalize import canonicalize, canonicalize_pattern
from .graph import CGraph, CNode, DtypeOf
from .primitives import PRIMITIVES, Local, Primitive, function

__all__ = ["PRIMITIVES", "CGraph", "CNode", "DtypeOf", "Local", "Primitive", "canonicalize", "canonicalize_pattern", "function"]
