"""The frames around a model's layers, made the model's own (Options.capture="layers").

Each decoder layer's call is a graph break of the model's capture (layers.py). Dynamo then compiles
the frames around the breaks one by one, as frames of their own: the forwards of the modules above
the layers (the causal LM's, peft's), their decorators' wrappers, and every function the layers'
parent calls. Dynamo keeps compiled frames, and its recompile limits, per code object and backend, so
compiled as they are written those frames would be shared by every model in the process and by the
user's own `torch.compile`: each optimized model would add entries to transformers' code, and after
a few models a frame hits its recompile limit and runs, with every frame below it, uncompiled.

So the frames become the model's own:
- the modules above the layers' container run copies of their class's forward (its decorators'
  wrappers copied with it) with code objects of their own: dynamo compiles those copies, and the
  graphs after a layer call (the LM head and its loss) resume in code only this model runs;
- the layers' container (the parent, `model.model`) runs as Python, uncompiled: it holds the layers'
  loop, which dynamo would not compile anyway, and what it computes besides (embeddings, the rotary
  tables, the attention mask) has no pattern to serve;
- the modules of the model's own classes it calls outside the layers (the final norm) run compiled
  entries of their own (layers.py's edges), so their sites are served as before.
"""

from __future__ import annotations

import inspect
import types
import weakref

import torch


def own_function(fn, depth: int = 0):
    """A copy of the Python function `fn` with a code object of its own; the functions its closure
    holds (a decorator's wrapped function) copied the same way, so that the whole chain runs code
    this copy alone runs. Globals, defaults and attributes are shared with `fn`."""
    cells = fn.__closure__
    if cells is not None and depth < 8:
        cells = tuple(_own_cell(c, depth) for c in cells)
    # a code object of its own (replace() makes a new one): equal in value, so it behaves the same,
    # distinct for dynamo, which keeps its compiled entries on the object itself
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, cells)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


def _own_cell(cell, depth: int):
    try:
        value = cell.cell_contents
    except ValueError:  # an empty cell
        return cell
    if isinstance(value, types.FunctionType) and not _of_torch(value.__module__):
        return types.CellType(own_function(value, depth + 1))
    return cell


class OwnForward:
    """The forward put on a module above the layers: its class's forward, copied (`own_function`).
    A copy of the model (pickle, torch.save) gets the class's forward back."""

    def __init__(self, module: torch.nn.Module):
        self.fn = own_function(type(module).forward)
        self.module = weakref.ref(module)

    def __call__(self, *args, **kwargs):
        return self.fn(self.module(), *args, **kwargs)

    # read as a bound method is: Trainer keeps the batch's columns the forward's signature names,
    # accelerate's mixed precision wraps `forward.__func__` and binds it to the module again
    @property
    def __func__(self):
        return self.fn

    @property
    def __self__(self):
        return self.module()

    @property
    def __signature__(self):
        return inspect.signature(types.MethodType(self.fn, self.module()))

    def __reduce__(self):
        return (_class_forward, (self.module(),))


class AsPython(OwnForward):
    """The forward put on the layers' parent: its class's forward, run as Python (compiled entries
    called inside it, the layers' and the edges', compile as their own)."""

    def __init__(self, module: torch.nn.Module):
        self.fn = type(module).forward
        self.module = weakref.ref(module)

    @torch._dynamo.disable
    def __call__(self, *args, **kwargs):
        return self.fn(self.module(), *args, **kwargs)


# called as Python (where dynamo resumes after a break), the copy's frame is compiled, not this one;
# traced inside a frame it is inlined
_skip = getattr(torch._dynamo.eval_frame, "skip_code", None)
if _skip is not None:
    _skip(OwnForward.__call__.__code__)


def _free(m: torch.nn.Module) -> bool:
    """Whether the module runs its class's forward: none on the instance, or the class's own bound
    to it (what a copy of an optimized model holds, `OwnForward.__reduce__`)."""
    f = m.__dict__.get("forward")
    return f is None or (getattr(f, "__func__", None) is type(m).forward and getattr(f, "__self__", None) is m)


def _class_forward(module):
    return types.MethodType(type(module).forward, module)


def _of_torch(module_name: str | None) -> bool:
    return (module_name or "").split(".")[0] == "torch"


def _torch_module(m: torch.nn.Module) -> bool:
    return _of_torch(type(m).__module__)


class OwnFrames:
    """The frames around the stack at `path` in `model` made its own (`install`, undone by `remove`):
    the modules above it run `OwnForward`s, its parent runs as Python (`AsPython`). A module whose
    instance already holds a forward of its own (accelerate's hooks put one there) keeps it.
    `edges(inside)`: the modules the parent runs outside the layers (ids in `inside`) that take a
    compiled entry of their own: the outermost of the model's own classes (a final norm, with
    weights or without, as OLMo's; the rotary tables), torch's own modules aside (an embedding has
    no pattern to serve; torch's norms are layers.py's edges wherever they are)."""

    def __init__(self, model: torch.nn.Module, path: str):
        names = path.split(".") if path not in ("", "<top>") else []
        chain = [model]
        for name in names:
            chain.append(chain[-1].get_submodule(name))
        # chain: model, ..., parent, stack (a stack at the top has no parent to run as Python)
        self.parent = chain[-2] if len(chain) >= 2 else None
        self.above = chain[:-2]
        self.installed: list = []

    def edges(self, inside: set) -> list:
        if self.parent is None:
            return []
        found, seen = [], set(inside)
        for name, m in self.parent.named_modules():
            if id(m) in seen or m is self.parent or _torch_module(m):
                continue
            found.append((name, m))
            seen.update(id(s) for s in m.modules())
        return found

    def install(self) -> None:
        if self.installed:
            return
        for m in self.above:
            if _free(m):
                m.forward = OwnForward(m)
                self.installed.append(m)
        p = self.parent
        if p is not None and _free(p):
            p.forward = AsPython(p)
            self.installed.append(p)

    def remove(self) -> None:
        for m in self.installed:
            if isinstance(m.__dict__.get("forward"), OwnForward):  # one put there since stays (accelerate's)
                del m.__dict__["forward"]
        self.installed = []
