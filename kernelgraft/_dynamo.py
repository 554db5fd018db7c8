"""Small helpers around torch._dynamo shared by the rewriter and gradcheck."""

from __future__ import annotations

import contextlib
import itertools

import torch


@contextlib.contextmanager
def room_for_recompiles():
    """Lift dynamo's per-code recompile limit inside this block: explain() and the torch.compile
    references capture the same code again and again (new dtypes, shapes, backends), and hitting
    the limit would silently turn a capture into an eager run."""
    cfg = torch._dynamo.config
    keys = [
        k for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit") if hasattr(cfg, k)
    ]
    with cfg.patch(**{k: 1 << 20 for k in keys}):
        yield


_ENTRIES = itertools.count()


def fresh_entry(tag: str):
    """A new function calling `module._call_impl`, with a code object of its own.

    Dynamo keeps compiled graphs, and its recompile limit, per code object. `Module.compile` compiles
    `Module._call_impl`, one code object for every module in the process, so the ninth model compiled
    with another backend or dtype silently runs uncompiled. One entry per model avoids that."""
    # a name of its own too: dynamo's automatic-dynamic state is keyed by (file, line, name), and a
    # shared key makes one model's shapes turn another model's first compile dynamic (a recompile)
    name = f"kernelgraft_entry_{next(_ENTRIES)}"
    src = f"def {name}(module, /, *args, **kwargs):\n    return module._call_impl(*args, **kwargs)\n"
    ns: dict = {}
    # named after this file: torch < 2.13 routes functions without a source file through one shared
    # wrapper frame (external_utils.inner), which would share the cache again
    ns["__name__"] = f"kernelgraft entry {tag}"
    exec(compile(src, __file__, "exec"), ns)
    return ns[name]
