"""Small helpers around torch._dynamo shared by the rewriter and gradcheck."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import re

import torch

# the Logger methods a model may call (and any `*_once` variant a library adds to Logger, as
# transformers does): under capture each is dropped instead of breaking the graph
_LOGGING = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log")


class _Method(str):
    """A Logger method as dynamo's ignore set holds it: equal to (and hashed as) the function, and
    otherwise its name (a string), since some torch releases sort that set and write it as JSON
    when they log their settings."""

    def __new__(cls, fn):
        self = super().__new__(cls, getattr(fn, "__qualname__", repr(fn)))
        self.fn = fn
        return self

    def __eq__(self, other):
        return other is self.fn or (isinstance(other, _Method) and other.fn is self.fn)

    def __hash__(self):
        return hash(self.fn)


def logging_functions() -> frozenset:
    """logging.Logger's methods, plain and any a library added (`warning_once`, `info_once`...):
    made once per set of Logger's attributes (every run of a captured model enters capture_settings)."""
    return _logging_functions(tuple(vars(logging.Logger)))


@functools.cache
def _logging_functions(attributes: tuple) -> frozenset:
    names = {*_LOGGING, *(n for n in attributes if n.endswith(("_once", "_advice")))}
    return frozenset(_Method(f) for n in names if callable(f := getattr(logging.Logger, n, None)))


# dynamo's set of logging functions it drops while tracing (renamed between torch releases)
_LOGGING_KEY = next(
    (k for k in ("ignore_logging_functions", "ignore_logger_methods") if hasattr(torch._dynamo.config, k)),
    None,
)


# whether this torch resumes a graph break inside the frames that called it (older releases that
# have the setting are not relied on)
_NESTED = hasattr(torch._dynamo.config, "nested_graph_breaks") and tuple(
    map(int, re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
) >= (2, 13)


# dynamo's recompile limits, per code object (their names differ between torch releases)
_LIMITS = tuple(
    k
    for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit")
    if hasattr(torch._dynamo.config, k)
)


@contextlib.contextmanager
def capture_settings(models: int = 1, nested: bool = False):
    """Dynamo's settings while kernelgraft captures a model:
    - floats the model reads (a norm's eps, a logit scale) stay numbers in the graph: with
      dynamic shapes dynamo would make them inputs, and the patterns that take them as a Scalar
      (RMSNorm's eps) would no longer match; a float that changes between calls recompiles;
    - a logging statement in the model (transformers' `logger.warning_once` in `loss_function`, which
      splits GPT-2's graph between its LM head and its loss) is dropped, not a graph break:
      the message is not printed while the model runs compiled;
    - a Python side effect inside a checkpointed region (transformers' kernel-hub context variable,
      set and reset again within one attention forward) runs once, in the forward, and is not
      replayed by the backward's recompute: otherwise dynamo leaves every checkpointed decoder layer
      out of the graph and none of its sites is served. Tensors are recomputed as before.
    - dynamo's recompile limits are `models` times the user's: frames dynamo resumes after a graph
      break are shared by every model in the process, and once one hits its limit dynamo runs
      whichever compiled entry's guards pass, another model's too;
    - `nested` (a model captured per layer class, whose layers' calls are graph breaks inside the
      model's nested forwards): where torch resumes such a break inside the frames that called it
      (`nested_graph_breaks`, relied on from torch 2.13), dynamo does so, and what follows the
      layers (the LM head, and a loss that a module around the model computes from its logits) is
      one graph, the head and loss fused; elsewhere each frame resumes on its own;
    Every forward of an optimized model runs inside it (any forward may capture): set with
    the config's closure patcher where torch has it, which costs a forward far less than `config.patch`."""
    cfg = torch._dynamo.config
    key = _LOGGING_KEY
    limits = tuple((k, getattr(cfg, k) * models) for k in _LIMITS) if models > 1 else ()
    change, patch = _patcher(
        frozenset(getattr(cfg, key)) if key else frozenset(), logging_functions(), limits, nested and _NESTED
    )
    if change is None:
        with cfg.patch(**patch):
            yield
        return
    revert = change()
    try:
        yield
    finally:
        revert()


@functools.cache
def _patcher(base: frozenset, logging_fns: frozenset, limits: tuple = (), nested: bool = False):
    """(the closure patcher of capture_settings' changes or None, the changes) for the config's
    current set of ignored logging functions `base`, the recompile limits to set and whether graph
    breaks resume in the frames that called them."""
    cfg = torch._dynamo.config
    patch = dict(specialize_float=True, **dict(limits))
    if nested:
        patch["nested_graph_breaks"] = True
    if hasattr(cfg, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        patch["skip_fwd_side_effects_in_bwd_under_checkpoint"] = True
    if _LOGGING_KEY is not None:
        patch[_LOGGING_KEY] = set(base) | logging_fns
    make = getattr(cfg, "_make_closure_patcher", None)
    try:
        return (make(**patch) if make is not None else None), patch
    except Exception:  # noqa: BLE001 - a torch whose closure patcher differs: config.patch
        return None, patch


def flat_graph_breaks():
    """Where capture_settings resumes graph breaks in the frames that called them, turn that off
    until the returned function is called (None where it is off already): a decoder layer's own
    entry is no frame around the layers, and torch 2.13 fails to resume a break inside a nested
    frame's comprehension (a full backward hook's setup: UnboundLocalError '.0')."""
    if not _NESTED or not torch._dynamo.config.nested_graph_breaks:
        return None
    return _flat_patcher()()


@functools.cache
def _flat_patcher():
    return torch._dynamo.config._make_closure_patcher(nested_graph_breaks=False)


@contextlib.contextmanager
def room_for_recompiles():
    """Lift dynamo's per-code recompile limit inside this block: explain() and the torch.compile
    references capture the same code again and again (new dtypes, shapes, backends), and hitting
    the limit would silently turn a capture into an eager run."""
    cfg = torch._dynamo.config
    with cfg.patch(**{k: 1 << 20 for k in _LIMITS}):
        yield


_ENTRIES = itertools.count()


def fresh_entry(tag: str, call: str = "module._call_impl(*args, **kwargs)", names: dict | None = None):
    """A new function `(module, *args, **kwargs)` returning `module._call_impl(*args, **kwargs)` (or
    `call`, an expression of those and of the globals `names`), with a code object of its own.

    Dynamo keeps compiled graphs, and its recompile limit, per code object. `Module.compile` compiles
    `Module._call_impl`, one code object for every module in the process, so the ninth model compiled
    with another backend or dtype silently runs uncompiled. One entry per model avoids that."""
    # a name of its own too: dynamo's automatic-dynamic state is keyed by (file, line, name), and a
    # shared key makes one model's shapes turn another model's first compile dynamic (a recompile)
    name = f"kernelgraft_entry_{next(_ENTRIES)}"
    src = f"def {name}(module, /, *args, **kwargs):\n    return {call}\n"
    ns: dict = dict(names or {})
    # named after this file: torch < 2.13 routes functions without a source file through one shared
    # wrapper frame (external_utils.inner), which would share the cache again
    ns["__name__"] = f"kernelgraft entry {tag}"
    exec(compile(src, __file__, "exec"), ns)
    return ns[name]
