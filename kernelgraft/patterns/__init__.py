"""Pattern library: one file per pattern family. Importing this package registers the built-ins."""

from . import gated_mlp, layer_norm, lm_head_ce, lora, rms_norm, rope  # noqa: F401  (registers the built-in spellings)
from .registry import REGISTRY, Registry, Scalar, Site, Spelling, dtype_check, pattern

__all__ = ["REGISTRY", "Registry", "Scalar", "Site", "Spelling", "dtype_check", "pattern"]
