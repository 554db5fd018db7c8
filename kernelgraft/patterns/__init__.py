"""Pattern library: one file per pattern family. Importing this package registers the built-ins."""

# the registry first: registering a spelling imports the kernels, which import REGISTRY from here
from .registry import REGISTRY, Registry, Scalar, Site, Spelling, dtype_check, pattern

# isort: split
from . import gated_mlp, layer_norm, lm_head_ce, lora, rms_norm, rope  # noqa: F401  (registers the built-in spellings)

__all__ = ["REGISTRY", "Registry", "Scalar", "Site", "Spelling", "dtype_check", "pattern"]
