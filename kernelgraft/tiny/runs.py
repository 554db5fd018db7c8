"""A model of the first way that builds it and runs it (the tiny config, else the repaired one, as
the README's coverage table picks), and where none does, whose failure it is: transformers' (it does
not build), the stock model's (it fails without kernelgraft) or kernelgraft's."""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch

from .configs import tiny_config, tiny_model
from .repaired import repaired_model

BUILD, STOCK, GRAFTED = "build", "stock", "kernelgraft"  # where a way failed
# the most parameters a model of the tiny config may have (8 GB of float32 weights): the coverage
# table's survey, under a 12 GiB memory limit, fails to build a larger one and builds the repaired
# config instead (gemma3's tiny config keeps its full-size vision tower: 2.7e9 parameters; the
# largest model the table builds from the tiny config, phi4_multimodal's, has 0.87e9)
MAX_PARAMETERS = 2 * 10**9


class NotTiny(ValueError):
    """The tiny config's model has more than MAX_PARAMETERS parameters: the architecture keeps a
    sub-config (a vision tower, a hash embedding) at its default size."""


def first_line(e: BaseException, n: int = 140) -> str:
    """The exception's name and first line (and the next one where the first ends with a colon: a
    config validator's "Class validation error for validator ...:" says its cause there)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
    first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return f"{type(e).__name__}: {first[:n]}"


class NoneRan(Exception):
    """No way built a model that ran. `.failures`: (where, how, exception) of each way in the order
    tried; `.telling`: the one that says most, the last of kernelgraft's failures on a model that
    runs without it where there is one, else the last of the stock model's, else the last build's."""

    def __init__(self, failures: list[tuple[str, str, BaseException]]):
        self.failures = failures
        where = next(w for w in (GRAFTED, STOCK, BUILD) if any(f[0] == w for f in failures))
        self.telling = [f for f in failures if f[0] == where][-1]
        where, how, e = self.telling
        super().__init__(f"{how}: {where}: {first_line(e)}")


def model_types() -> list[str]:
    """transformers' model types (the `model_type` of a config.json), registered ones included."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    return list(dict.fromkeys([*CONFIG_MAPPING_NAMES, *CONFIG_MAPPING.keys()]))


def causal_lm_types() -> set[str]:
    """The model types transformers has a causal LM of, registered ones included."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    registered = getattr(AutoModelForCausalLM._model_mapping, "_extra_content", {})
    return {*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *(getattr(c, "model_type", None) for c in registered)}


def parameters_of(cfg) -> int | None:
    """How many parameters the causal LM of cfg has, counted on the meta device (nothing allocated);
    None where it does not build there."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(cfg)
    cfg._attn_implementation = "eager"  # every architecture has it
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception:  # noqa: BLE001 - the real build says why
        return None
    return sum(p.numel() for p in model.parameters())


def tiny_enough(arch: str, layers: int = 2) -> None:
    """NotTiny where the model of tiny_config(arch, layers) has more than MAX_PARAMETERS parameters."""
    n = parameters_of(tiny_config(arch, layers))
    if n is not None and n > MAX_PARAMETERS:
        raise NotTiny(f"{n:,} parameters, a sub-config of full size among them")


def tiny_ways(arch: str, dtype=torch.float32, layers: int = 2, seed: int = 0) -> list:
    """[(what it is built from, build() -> model)] of a tiny random causal LM of `arch`: the tiny
    config (where its model is tiny: tiny_enough), then the repaired one."""

    def tiny():
        tiny_enough(arch, layers)
        return tiny_model(arch, dtype, seed=seed, layers=layers)

    return [
        ("the tiny config", tiny),
        ("the repaired tiny config", lambda: repaired_model(arch, dtype, layers=layers, seed=seed)),
    ]


def random_inputs(batch: int, seq: int, device="cpu", seed: int = 0, prompt: bool = False, vocab=None):
    """inputs(model): a seeded random batch of token ids below `vocab`, with labels; `prompt`: the
    first quarter of each sequence without labels, as in fine-tuning. vocab None: the model's, the
    least of its config's and its input embeddings' (musicgen embeds several codebooks; cpmant's
    embedding holds prompt tokens past the vocabulary its head predicts)."""

    def inputs(model) -> dict:
        n = vocab
        if n is None:
            embedded = model.get_input_embeddings()
            sizes = [m.num_embeddings for m in embedded.modules() if isinstance(m, torch.nn.Embedding)]
            n = min([*sizes, getattr(model.config.get_text_config(), "vocab_size", None) or sizes[0]])
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, n, (batch, seq), generator=g).to(device)
        labels = ids.clone()
        if prompt:
            labels[:, : seq // 4] = -100
        return dict(input_ids=ids, labels=labels)

    return inputs


@contextlib.contextmanager
def quiet():
    """Warnings, transformers' log lines and dynamo's warnings kept off stderr while inside: a tiny
    config's token ids and sizes are not what the architecture expects, which is no news to its
    user, and a graph break dynamo warns of is in kernelgraft's report."""
    import logging

    from transformers.utils import logging as hf_logging

    level, dynamo = hf_logging.get_verbosity(), logging.getLogger("torch._dynamo")
    dynamo_level = dynamo.level
    hf_logging.set_verbosity_error()
    dynamo.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        dynamo.setLevel(dynamo_level)


def first_that_runs(ways: list, inputs, run, quietly: bool = True):
    """(run(model, **inputs(model)), the failures of the ways before it) for the model of the first
    of `ways` that builds, runs on its inputs without kernelgraft (no gradients) and runs under
    `run`; NoneRan where none does. `quietly`: inside quiet()."""
    failures = []
    for how, build in ways:
        with quiet() if quietly else contextlib.nullcontext():
            try:
                model = build()
            except Exception as e:  # noqa: BLE001 - any failure to build is this way's finding
                failures.append((BUILD, how, e))
                continue
            try:
                kw = inputs(model)
                with torch.no_grad():
                    model(**kw)
            except Exception as e:  # noqa: BLE001 - the stock model's own failure, told apart from ours
                failures.append((STOCK, how, e))
                continue
            try:
                return run(model, **kw), failures
            except Exception as e:  # noqa: BLE001 - kernelgraft's failure on a model that runs without it
                failures.append((GRAFTED, how, e))
    raise NoneRan(failures)
