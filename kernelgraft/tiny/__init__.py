"""Tiny random Hugging Face causal LMs (hidden 64, 2 layers, vocabulary 128; nothing downloaded): the
models `kernelgraft explain --arch` and `kernelgraft audit --arch` build, and the tests and the
README's coverage table build.

tiny_model(arch) makes one from tiny_config(arch): the architecture's config with a fixed set of
tiny sizes. Where that does not build or run, repaired_model(arch) makes one from
repaired_config(arch): the architecture's default config made tiny by attribute names and values
alone. first_that_runs takes the first of those that runs (tiny_ways), and says whose failure it
is where none does.
"""

from .configs import TOKENS, VOCAB, deterministic, tiny_config, tiny_model
from .repaired import repaired_config, repaired_model
from .runs import (
    BUILD,
    GRAFTED,
    MAX_PARAMETERS,
    STOCK,
    NoneRan,
    NotTiny,
    causal_lm_types,
    first_line,
    first_that_runs,
    model_types,
    parameters_of,
    quiet,
    random_inputs,
    tiny_enough,
    tiny_ways,
)

__all__ = [
    "BUILD",
    "GRAFTED",
    "MAX_PARAMETERS",
    "STOCK",
    "TOKENS",
    "VOCAB",
    "NoneRan",
    "NotTiny",
    "causal_lm_types",
    "deterministic",
    "first_line",
    "first_that_runs",
    "model_types",
    "parameters_of",
    "quiet",
    "random_inputs",
    "repaired_config",
    "repaired_model",
    "tiny_config",
    "tiny_enough",
    "tiny_model",
    "tiny_ways",
]
