"""Capture per layer class (Options.capture="layers"): one compiled graph serves every decoder layer.

A model's decoder layers are its layer stack: the `nn.ModuleList` or `nn.Sequential` of one class
with the most parameters, of the length its config gives where it gives one (every Hugging Face
decoder keeps them so: `model.layers`, `transformer.h`...), whose first training call returns its
hidden states in their shape; a stack that does not is passed over for the next (api.py), and the
report says so. Each layer's `forward` is replaced, on the instance, by a call that the model's
captured graph does not trace into (a graph break at each layer, as FSDP2's per-layer hooks make):
the layers are compiled by the model's own backend through one entry whose parameters are graph
inputs, so dynamo, the rewriter and inductor run once for the class, whatever the depth. The rest of
the model (embeddings, the final norm, the LM head and its loss) is captured around the breaks.

A layer reads its own slot of the KV cache through `LayerCache`, a view that hides the layer's index
(the cache would otherwise be indexed by each layer's `layer_idx`, a different constant per layer:
one graph per layer). With Options.offload a training call runs through offload.py's checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from collections import Counter

import torch
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from .._dynamo import flat_graph_breaks, fresh_entry
from .frames import OwnFrames
from .layer_cache import with_layer_cache
from .offload import Offloader, checkpointed
from .runs import LAYERS


def layer_stacks(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module]], str]:
    """The containers that may be the model's decoder layer stack, best first, and where there is
    none, why. A candidate is an `nn.ModuleList` or `nn.Sequential` of two or more modules of one
    class; where the model's config gives its number of layers, only a candidate that long (a vision
    tower's layers, a layer's experts or a model's output heads are other lists); the most
    parameters first. What its first training call returns decides (`_not_a_layer`)."""
    count, found, other = layer_count(model), [], []
    for path, m in model.named_modules():
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) or len(m) < 2:
            continue
        kinds = {type(c) for c in m}
        if len(kinds) != 1 or issubclass(type(m[0]), (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue  # modules of several classes, or lists that no call runs
        size = sum(p.numel() for p in m.parameters())
        (found if count is None or len(m) == count else other).append((-size, path or "<top>", m))
    found.sort(key=lambda f: f[0])  # stable: of equal sizes, the first in the model
    if found:
        return [(path, m) for _, path, m in found], ""
    if other:
        lists = ", ".join(f"{path} ({len(m)} {type(m[0]).__name__})" for _, path, m in other)
        return [], f"{lists}: not the {count} layers its config gives"
    return [], "no nn.ModuleList or nn.Sequential holds modules of one class"


def layer_count(model: torch.nn.Module) -> int | None:
    """The number of decoder layers the model's (text) config gives; None where it gives none."""
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "get_text_config", None)
    cfg = text() if callable(text) else cfg
    for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        try:
            value = getattr(cfg, name, None)
        except (AttributeError, RuntimeError):  # a per-layer attribute a heterogeneous config refuses
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """(path, container) of the model's decoder layers, as `layer_stacks` ranks them first; None
    where the model has none."""
    stacks, _ = layer_stacks(model)
    return stacks[0] if stacks else None


class LayerStack:
    """The model's decoder layers, each called through `_call` (installed by `install`, undone by
    `remove`), compiled by `grafter` (the model's backend; `dynamic` as the model's compile) through
    one entry. `offload`: training calls keep their
    inputs on the host (Options.offload; may be turned on later, by Options.memory). `rejected`: the
    paths of candidates whose first training call showed they are not the stack (path -> why),
    passed over."""

    def __init__(self, model: torch.nn.Module, grafter, dynamic, offload: bool, rejected: dict | None = None):
        self.grafter, self.dynamic = grafter, dynamic
        self.rejected = dict(rejected or {})
        stacks, why = layer_stacks(model)
        stacks = [s for s in stacks if s[0] not in self.rejected]
        if not stacks:
            shown = [f"{path}: its first training call {reason}" for path, reason in self.rejected.items()]
            raise ValueError("; ".join(shown) or why)
        self.path, self.layers = stacks[0]
        self.offload = offload
        self.offloader = Offloader()
        # why the stack is not the model's layers, from its first training call ("": it is; None: no call yet)
        self.not_a_stack: str | None = None
        self.cache_views = [0, 0]  # layer calls with a KV cache: [through LayerCache, with the cache itself]
        self.calls: list = []  # each layer's call, made once (each holds the compiled entry)
        # hooks on a layer's submodules: dynamo does not guard on them, so such a layer runs an entry
        # of its own, made for its hooks (index -> (their ids, the entry's run))
        self.handles = -1  # torch's count of hook handles when the layers' hooks were last read
        self.hooks: list = []  # each layer's submodules' hook ids, as last read
        self.hooked: dict = {}
        self.graphs: Counter = Counter()  # graphs compiled for the layers, by kind (report.CAPTURES)
        # torch's own norm modules outside the layers (a final nn.LayerNorm): the model's frame around
        # the layers' calls may run as Python, and dynamo traces no frame of torch.nn, so each runs a
        # compiled entry of its own ((path, module, call) each)
        inside = {id(m) for m in self.layers.modules()}
        self.edges = [
            (path, m, None) for path, m in model.named_modules() if type(m) in _TORCH_NORMS and id(m) not in inside
        ]
        # the frames around the layers made the model's own; the parent's modules outside the layers
        # then run compiled entries of their own too
        self.frames = OwnFrames(model, self.path)
        prefix = self.path.rpartition(".")[0]
        self.edges += [(f"{prefix}.{name}" if prefix else name, m, None) for name, m in self.frames.edges(inside)]
        self.installed = False

    def describe(self) -> str:
        return f"{self.path} ({len(self.layers)} {type(self.layers[0]).__name__})"

    def report_lines(self) -> list[str]:
        """What the model's report says of its layers: how they are captured, offloaded, their
        and their KV cache."""
        n = len(self.layers)
        kinds = ", ".join(f"{k} {v}" for k, v in self.graphs.items())
        out = [
            f"captured per layer class: the {n} layers of {self.describe()} share "
            f"{sum(self.graphs.values())} compiled graph(s){f' ({kinds})' if kinds else ''}"
        ]
        if self.offload:
            out.append(
                f"offloaded: the {n} layers of {self.path} keep their inputs on the host (at most "
                f"{self.offloader.peak_bytes / 2**30:.2f} GiB so far) and run again in the backward"
            )
        hooked = sorted(i for i, ids in enumerate(self.hooks) if ids)
        if hooked:
            out.append(
                f"layers with hooks on their modules, each run through a graph of its own: {', '.join(map(str, hooked))}"
            )
        viewed, whole = self.cache_views
        if whole:
            out.append(
                f"the layers' KV cache: {whole} of {viewed + whole} calls read the whole cache (a cache "
                "class or layer index that LayerCache does not serve): a graph per layer there"
            )
        return out

    def install(self) -> None:
        if self.installed:
            return
        if not self.calls:
            # one entry of the model's own for its layers' forward: one graph serves every layer, and
            # no other model shares its cache
            entry = self._entry()
            for i, layer in enumerate(self.layers):
                run = functools.partial(_in_layers, self, entry, layer)
                # the model's graph breaks here: the layer runs the class's compiled graph
                call = functools.partial(_call, self, layer, run, i)
                self.calls.append(_LayerForward(torch._dynamo.disable(call), layer))
        for layer, call in zip(self.layers, self.calls):
            layer.forward = call
        for i, (path, m, call) in enumerate(self.edges):
            if call is None:
                entry = self._entry(module=m, name=f"{type(m).__name__} at {path.replace('.', ':')}")
                call = _EdgeForward(functools.partial(_at, path, entry, m), m)
                self.edges[i] = (path, m, call)
            m.forward = call
        self.frames.install()
        self.installed = True

    def _entry(self, hooked: int | None = None, module=None, name: str = ""):
        """A compiled entry of the layers' class forward (the class's, not the call put on each
        instance); `hooked`: for that layer alone, made for its submodules' hooks; `module`: for that
        module's class instead (`name` says which)."""
        cls = type(self.layers[0] if module is None else module)
        name = name or (f"{cls.__name__} layers" if hooked is None else f"{cls.__name__} layer {hooked} (hooked)")
        # a module of torch's own: its class's forward read from the module, which dynamo traces (a
        # global holding a torch.nn function is imported by the entry's name, which is no module)
        call = "type(module).forward(module, *args, **kwargs)" if module is not None else "layer_forward(module, *args, **kwargs)"
        # the grafter itself as the backend (DDP's graph split knows it by its type); the graphs it
        # captures are counted by _in_layers
        entry = fresh_entry(name, call, {"layer_forward": cls.forward})
        return torch.compile(entry, backend=self.grafter, dynamic=self.dynamic)

    def run_for(self, index: int, run):
        """The run of layer `index`: `run` (the shared entry's), or where hooks sit on the layer's
        submodules an entry of its own for those hooks (re-read when torch made a hook handle)."""
        if RemovableHandle.next_id != self.handles:
            self.handles = RemovableHandle.next_id
            self.hooks = [_inner_hooks(layer) for layer in self.layers]
        ids = self.hooks[index]
        if not ids:
            return run
        made = self.hooked.get(index)
        if made is None or made[0] != ids:
            entry = self._entry(hooked=index)
            made = self.hooked[index] = (ids, functools.partial(_in_layers, self, entry, self.layers[index]))
        return made[1]

    def remove(self) -> None:
        for m in [*self.layers, *(m for _, m, _ in self.edges)]:
            m.__dict__.pop("forward", None)
        self.frames.remove()
        self.installed = False


class _LayerForward:
    """The call put on a layer in place of its forward. A copy of the model (pickle, torch.save)
    gets the class's forward back: a copy is optimized anew, and its own calls are installed then."""

    def __init__(self, call, layer):
        self.call, self.layer = call, weakref.ref(layer)

    @torch._dynamo.disable
    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    def __reduce__(self):
        return (_class_forward, (self.layer(),))


class _EdgeForward(_LayerForward):
    """The call put on a norm module outside the layers: traced where the model's frame is (as the
    module's own forward), its compiled entry where the frame runs as Python."""

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return type(self.layer()).forward(self.layer(), *args, **kwargs)
        return self.call(*args, **kwargs)


# called as Python (the model's frame around the layers runs so), the call's own frame is not
# compiled, its entry is; traced inside a frame, it is inlined (where disable would break the graph)
_skip = getattr(torch._dynamo.eval_frame, "skip_code", None)
if _skip is not None:
    _skip(_EdgeForward.__call__.__code__)


def _class_forward(layer):
    return types.MethodType(type(layer).forward, layer)


def capture_layers(compiled, model, rejected: dict | None = None, offload: bool | None = None) -> None:
    """The model's layer stack captured per class, compiled by the model's own backend
    (Options.capture="layers"), offloaded where Options.offload asks; the candidates in `rejected`
    passed over; `offload`: Options.memory's choice where it made one. Without a stack the model is
    captured whole (an error where offload=True asks). `compiled`: api's compiled call."""
    options, rep = compiled.grafter.options, compiled.grafter.report
    offload = bool(options.offload if offload is None else offload)
    try:
        layers = LayerStack(model, compiled.grafter, compiled.dynamic, offload, rejected)
    except ValueError as e:
        rep.captured_as = dict(kind="whole", why=f"no layer stack to capture per class ({e})")
        if options.offload:
            raise ValueError(
                f"kernelgraft: offload=True needs decoder layers (an nn.ModuleList or nn.Sequential of one "
                f"class, each layer's output the shape of its input) in {type(model).__name__}, and found "
                f"none: {e}. Leave offload at None or False for this model"
            ) from None
        return
    layers.install()
    compiled.layers = layers
    rep.captured_as = dict(kind="layers", stack=layers)


def pass_over(compiled, model) -> None:
    """The stack's first training call showed it is not the model's layers: the next candidate is
    captured per class from the next call on, or where there is none the model is captured whole
    (an error where offload=True was asked for); the model is captured anew either way, and the
    report says what was passed over and why."""
    layers, rep = compiled.layers, compiled.grafter.report
    layers.remove()
    rejected = {**layers.rejected, layers.path: layers.not_a_stack}
    compiled.layers = None
    compiled.fn = compiled._entry()  # the layers' calls were graph breaks of the model's capture
    rep.forget_captures()
    note = f"layers: {layers.describe()} is not the model's layer stack: its first training call {layers.not_a_stack}"
    capture_layers(compiled, model, rejected, offload=layers.offload)
    if compiled.layers is None:
        note += "; no other stack: the model is captured whole"
        if rep.memory is not None and rep.memory.offload:
            rep.memory.offload = False
            rep.memory.why.append("Not offloaded after all: the model has no layer stack (see the notes).")
    else:
        note += f"; {compiled.layers.path} is captured per class instead"
    rep.notes.append(note)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _inner_hooks(layer) -> tuple:
    """The ids of the hooks on a layer's submodules (its own run around the call, outside it)."""
    return tuple(
        (name, kind, tuple(d))
        for name, m in layer.named_modules()
        if m is not layer
        for kind in _HOOK_DICTS
        if (d := getattr(m, kind, None))
    )


def _in_layers(stack: LayerStack, entry, layer, *args, **kwargs):
    """The layer's compiled entry, its captures' records read as paths under the stack's, and the
    graphs it captured counted for the report."""
    mark = LAYERS.set(f"{stack.path}.*")
    rep = stack.grafter.report
    before = rep.graphs
    revert = flat_graph_breaks()
    try:
        return entry(layer, *args, **kwargs)
    finally:
        if revert is not None:
            revert()
        LAYERS.reset(mark)
        if rep.graphs != before:
            stack.graphs[stack.grafter.capture_kind()] += rep.graphs - before


# norm modules of torch's own: where the model's code runs as Python (its frame around the layers'
# calls), dynamo does not trace their forward
_TORCH_NORMS = (torch.nn.LayerNorm, *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()))


def _at(path: str, entry, module, *args, **kwargs):
    """A norm module's call outside the layers: its compiled entry, its records read at its path."""
    mark = LAYERS.set(path)
    try:
        return entry(module, *args, **kwargs)
    finally:
        LAYERS.reset(mark)


def _call(stack: LayerStack, layer, run, index: int, *args, **kwargs):
    """A decoder layer's call in place of its forward: the class's compiled graph, checkpointed
    with its input offloaded in an offloaded training call. `index`: the layer's place in the stack
    (the first starts a forward)."""
    kwargs = with_layer_cache(stack, layer, index, kwargs)
    args, kwargs = _hidden_with_grad(layer, args, kwargs)
    run = stack.run_for(index, run)
    # a stack its first training call showed is none runs as it is, until the model's call is done
    training = torch.is_grad_enabled() and layer.training
    if not training or stack.not_a_stack:
        return run(*args, **kwargs)
    out = (
        checkpointed(run, stack.offloader, index == 0, args, kwargs)
        if stack.offload
        else run(*args, **kwargs)
    )
    if stack.not_a_stack is None:
        stack.not_a_stack = _not_a_layer(args, kwargs, out)
    return out


def _hidden(args: tuple, kwargs: dict):
    """A layer call's hidden states: the first positional argument or `hidden_states`, a floating
    point tensor; None where the call has none."""
    given = [*args[:1], kwargs.get("hidden_states")]
    return next((t for t in given if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def _hidden_with_grad(layer, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with its hidden states asking for a gradient where a gradient is being recorded and
    the layer has parameters that take one: a LoRA model's first layer reads frozen embeddings, and
    without this its input differs from every other layer's by `requires_grad` alone, which dynamo
    guards on (a second graph, compiled forward and backward, for one layer). Its gradient, one
    more pass through the first layer's input projections, is dropped."""
    if not torch.is_grad_enabled():
        return args, kwargs
    hidden = _hidden(args, kwargs)
    if hidden is None or hidden.requires_grad or not any(p.requires_grad for p in layer.parameters()):
        return args, kwargs
    hidden = hidden.detach().requires_grad_()
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _not_a_layer(args, kwargs, out) -> str:
    """Why a call's module is not a decoder layer (its hidden states, the first positional tensor or
    `hidden_states`, come out in another shape, as an output head's logits do); "" where it is."""
    hidden = _hidden(args, kwargs)
    made = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    if hidden is None or made is None:
        return "takes or returns no hidden states (a floating point tensor, first or as hidden_states)"
    if made.shape != hidden.shape:
        return f"returns {list(made.shape)} for hidden states of {list(hidden.shape)}"
    return ""


def no_cache_in_training(model, kwargs: dict, layered: bool) -> dict:
    """A training forward of a Hugging Face model whose layers are graphs of their own (`layered`:
    layers captured per class, FSDP2's sharded ones) gets `use_cache=False` unless the call says
    otherwise, as under gradient checkpointing: the cache a training step would fill is never read.
    An explicit `use_cache` or a cache passed in is kept."""
    if (
        not layered
        or "use_cache" in kwargs
        or decodes(kwargs)
        or not (model.training and torch.is_grad_enabled())
    ):
        return kwargs
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False) or not hasattr(config, "to_dict"):  # not a transformers config
        return kwargs
    return {**kwargs, "use_cache": False} if _takes_use_cache(type(model).forward) else kwargs


@functools.cache
def _takes_use_cache(forward) -> bool:
    """Whether a forward takes `use_cache` (a wrapper of a model may not)."""
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def sharded(model) -> bool:
    """Whether FSDP2's fully_shard wrapped a module of `model` (its class is then FSDP<name>): each
    such module's forward is a graph of its own."""
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())


@contextlib.contextmanager
def own_checkpointing(stack: LayerStack):
    """Offloaded layers checkpoint themselves: Hugging Face's gradient checkpointing (which Trainer
    turns on) is off for the call, so that each layer runs once in the forward and once again in the
    backward, not twice. Layers not offloaded keep it (checkpointed inside their graph)."""
    flags = [
        (m, m.gradient_checkpointing)
        for m in stack.layers
        if stack.offload and getattr(m, "gradient_checkpointing", False)
    ]
    for m, _ in flags:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m, on in flags:
            m.gradient_checkpointing = on


def decodes(kwargs) -> bool:
    """A call that passes a KV cache (`past_key_values`, named `cache` in newer transformers): a
    step of generate()'s decoding, its prompt included."""
    return any(
        v is not None and (k in ("past_key_values", "cache") or hasattr(v, "get_seq_length"))
        for k, v in kwargs.items()
    )
