"""Offloaded activations: each decoder layer of a training step keeps only its input for the
backward, in pinned host memory, and runs again in the backward (Options.offload).

A model's decoder layers are its layer stack: the `nn.ModuleList` or `nn.Sequential` of one class
with the most parameters, of the length its config gives where it gives one (every Hugging Face
decoder keeps them so: `model.layers`, `transformer.h`...), whose first training call returns its
hidden states in their shape; a stack that does not is passed over for the next (api.py), and the
report says so. Each layer's `forward` is replaced, on the instance, by a call that the model's
captured graph does not trace into (a graph break at each layer, as FSDP2's per-layer hooks make):
the layer itself is compiled by the model's own backend, one graph for every layer. In a training
call the layer runs through `_Checkpoint`:

    forward   the layer under no_grad (its graph grafted as a training one); its input copied to
              a pinned host buffer on a stream of its own (the next layers run meanwhile); the
              other inputs (position embeddings, masks), which every layer shares, kept as they are;
              the random generators' states and autocast's noted
    backward  the input fetched back (the previous layer's fetch started now: one layer ahead), the
              layer run again with gradients from the generators' states the forward noted, under its
              autocast, its backward run; parameters' gradients accumulate as in any backward

A call's host buffers belong to its autograd node: they go back to the pool when its backward has
fetched them, or when the graph is freed without one (a loss only logged, a forward that raised).
On a device without streams (the CPU) the copies are plain copies: the same path, run in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import torch
from torch.utils import _pytree as pytree

from .._dynamo import fresh_entry
from .attention import is_causal_mask
from .backend import CHECKPOINTED, LAYERS


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


@dataclasses.dataclass
class _Saved:
    """One layer call's input, kept for its backward: on the host (offloaded) or as it was."""

    host: torch.Tensor | None  # the pinned (CPU: plain) copy, or None where the tensor is kept
    kept: torch.Tensor | None
    device: torch.device
    requires_grad: bool
    fetched: torch.Tensor | None = None  # the copy back, started by the prefetch
    ready: object = None  # the event the copy back recorded (CUDA)


class Offloader:
    """The host copies of one model's layer inputs: a stream for the copies, pinned buffers reused
    from step to step, and the order of the layers' calls (the backward fetches the previous one's
    input while a layer runs)."""

    def __init__(self):
        self.stream = None
        self.pool: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype) -> free pinned buffers
        self.calls: list[weakref.ref] = []  # the live graphs' layer calls (_Call), in forward order
        self.bytes = 0  # host bytes in use now
        self.causal = True  # causal masks dropped from the layers' calls (Options.causal_attention)
        self.mask_verdict: tuple = (None, lambda: None, False)  # (key, weak ref, causal) of the last mask
        self.masks = [0, 0]  # masks checked: [causal, not causal]
        self.peak_bytes = 0
        # why the stack is not the model's layers, from its first training call ("": it is; None: no call yet)
        self.not_a_stack: str | None = None

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        free = self.pool.get((tuple(t.shape), t.dtype))
        if free:
            return free.pop()
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")

    def offload(self, t: torch.Tensor) -> _Saved:
        saved = _Saved(self._buffer(t), None, t.device, t.requires_grad)
        stream = self._stream(t.device)
        if stream is None:
            saved.host.copy_(t)
        else:
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                saved.host.copy_(t, non_blocking=True)  # the fetch back runs after it, on this stream
            t.record_stream(stream)  # t's memory is not reused before the copy has read it
        self.bytes += saved.host.numel() * saved.host.element_size()
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return saved

    def prefetch(self, saved: _Saved) -> None:
        """Start the copy of `saved` back to its device (on the copy stream where there is one)."""
        if saved.host is None or saved.fetched is not None:
            return
        stream = self._stream(saved.device)
        if stream is None:
            saved.fetched = saved.host.to(saved.device, copy=True)
            return
        with torch.cuda.stream(stream):
            saved.fetched = saved.host.to(saved.device, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(stream)

    def fetch(self, saved: _Saved) -> torch.Tensor:
        """`saved`'s tensor on its device, ready for the current stream; its host buffer freed."""
        if saved.host is None:
            return saved.kept
        self.prefetch(saved)
        t = saved.fetched
        if saved.ready is not None:
            current = torch.cuda.current_stream(saved.device)
            current.wait_event(saved.ready)
            t.record_stream(current)
        self.release(saved)
        return t

    def release(self, saved: _Saved | None) -> None:
        if saved is None or saved.host is None:
            return
        self.pool.setdefault((tuple(saved.host.shape), saved.host.dtype), []).append(saved.host)
        self.bytes -= saved.host.numel() * saved.host.element_size()
        saved.host = saved.fetched = None

    def track(self, saved: list, first: bool) -> _Call:
        """The owner of one layer call's saved inputs, for its autograd node to hold: when the graph
        that holds the node is freed (its backward ran, or it never will) the buffers come back."""
        call = _Call(saved, first)
        self.calls.append(weakref.ref(call, lambda ref: self._forget(ref, saved)))
        return call

    def _forget(self, ref, saved: list) -> None:
        self.calls[:] = [r for r in self.calls if r is not ref]
        for s in saved:
            self.release(s)

    def done(self, call: _Call) -> _Call | None:
        """Forget `call` (its backward has its inputs) and return the live layer call made before it
        in the same forward, whose backward runs next (None after the stack's first layer). Backwards
        run in reverse: searched from the end."""
        for i in range(len(self.calls) - 1, -1, -1):
            if self.calls[i]() is call:
                del self.calls[i]
                before = (r() for r in reversed(self.calls[:i]))
                return None if call.first else next((c for c in before if c is not None), None)
        return None


class _Call:
    """One layer call's saved inputs (a `_Saved` or None per flattened input), owned by its autograd
    node only: `Offloader.calls` holds it weakly."""

    __slots__ = ("saved", "first", "__weakref__")

    def __init__(self, saved: list, first: bool):
        self.saved, self.first = saved, first


def _offloaded(t: torch.Tensor, first: bool) -> bool:
    """Whether a layer's tensor input goes to the host: its hidden states (the first positional
    input, or any input that needs a gradient). Position embeddings and masks are shared by every
    layer: kept as they are."""
    return t.is_floating_point() and (first or t.requires_grad)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, offloader, spec, n_args, first, anchor, *flat):
        ctx.run, ctx.offloader, ctx.spec = run, offloader, spec
        args, kwargs = pytree.tree_unflatten(list(flat), spec)
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        # what the recompute must run under to redo this forward: its dropout's draws, its autocast
        ctx.rng, ctx.autocast = _rng_state(tensors), _autocast_state(tensors)
        mark = CHECKPOINTED.set(True)  # grafted as a training graph: the kernels the backward runs again
        try:
            with torch.no_grad():
                out = run(*args, **kwargs)
        finally:
            CHECKPOINTED.reset(mark)
        saved = []
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor) and _offloaded(x, first=i == 0 and n_args > 0):
                saved.append(offloader.offload(x))
            elif isinstance(x, torch.Tensor):
                saved.append(_Saved(None, x, x.device, x.requires_grad))
            else:
                saved.append(None)
        ctx.call = offloader.track(saved, first)
        flat_out = pytree.tree_leaves(out)
        ctx.flat_values = [None if isinstance(x, torch.Tensor) else x for x in flat]
        return tuple(o for o in flat_out if isinstance(o, torch.Tensor))

    @staticmethod
    def backward(ctx, *grads):
        off, call = ctx.offloader, ctx.call
        inputs = []
        for s, value in zip(call.saved, ctx.flat_values):
            if s is None:
                inputs.append(value)
                continue
            t = off.fetch(s).detach()
            inputs.append(t.requires_grad_(s.requires_grad))
        before = off.done(call)  # every input of this call was fetched above: its buffers are free
        if before is not None:  # the next backward's input comes back while this layer runs again
            for s in before.saved:
                if s is not None:
                    off.prefetch(s)
        args, kwargs = pytree.tree_unflatten(inputs, ctx.spec)
        devices, states = ctx.rng
        # the global generators go on after the backward as if the layer had not run again
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(states[0])
            for d, state in zip(devices, states[1:]):
                torch.cuda.set_rng_state(state, d)
            with contextlib.ExitStack() as casts, torch.enable_grad():
                for device_type, kw in ctx.autocast:
                    casts.enter_context(torch.autocast(device_type, **kw))
                out = ctx.run(*args, **kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads_in = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs]
        return (None, None, None, None, None, None, *grads_in)


def _rng_state(tensors) -> tuple[list[int], list[torch.Tensor]]:
    """(CUDA devices, [the CPU generator's state, then each device's]): the generators a layer whose
    tensors are on those devices draws from (as torch.utils.checkpoint saves them)."""
    devices = sorted({t.device.index for t in tensors if t.device.type == "cuda"})
    return devices, [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]


def _autocast_state(tensors) -> list[tuple[str, dict]]:
    """Autocast as it is now on the CPU and on each device type of `tensors`: the arguments of
    torch.autocast that re-enter it."""
    return [
        (dt, dict(enabled=torch.is_autocast_enabled(dt), dtype=torch.get_autocast_dtype(dt),
                  cache_enabled=torch.is_autocast_cache_enabled()))
        for dt in sorted({"cpu", *(t.device.type for t in tensors)})
        if torch.amp.is_autocast_available(dt)
    ]  # fmt: skip


class OffloadedLayers:
    """The model's decoder layers, each called through `_call` (installed by `install`, undone by
    `remove`). `rejected`: the paths of candidates whose first training call showed they are not
    the stack (path -> why), passed over."""

    def __init__(self, model: torch.nn.Module, compile_layer, rejected: dict | None = None):
        self.rejected = dict(rejected or {})
        stacks, why = layer_stacks(model)
        stacks = [s for s in stacks if s[0] not in self.rejected]
        if not stacks:
            shown = [f"{path}: its first training call {reason}" for path, reason in self.rejected.items()]
            why = "; ".join(shown) or why
            raise ValueError(
                f"kernelgraft: offload=True needs decoder layers (an nn.ModuleList or nn.Sequential of one "
                f"class, each layer's output the shape of its input) in {type(model).__name__}, and found "
                f"none: {why}. Leave offload at None or False for this model"
            )
        self.path, self.layers = stacks[0]
        self.offloader = Offloader()
        self.compile_layer = compile_layer
        self.calls: list = []  # each layer's call, made once (each holds its compiled forward)
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        if not self.calls:
            # one entry of the model's own for its layers' forward (their class's, not the call put on
            # each instance): one graph serves every layer, and no other model shares its cache
            cls = type(self.layers[0])
            call = "layer_forward(module, *args, **kwargs)"
            entry = self.compile_layer(
                fresh_entry(f"{cls.__name__} layers", call, {"layer_forward": cls.forward})
            )
            for layer in self.layers:
                run = functools.partial(_in_layers, f"{self.path}.*", entry, layer)
                # the model's graph breaks here: the layer runs its own compiled graph, checkpointed
                call = functools.partial(_call, layer, run, self.offloader, layer is self.layers[0])
                self.calls.append(torch._dynamo.disable(call))
        for layer, call in zip(self.layers, self.calls):
            layer.forward = call
        self.installed = True

    def remove(self) -> None:
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
        self.installed = False


def _in_layers(path: str, entry, layer, *args, **kwargs):
    """The layer's compiled entry, its captures' records read as paths under `path`."""
    mark = LAYERS.set(path)
    try:
        return entry(layer, *args, **kwargs)
    finally:
        LAYERS.reset(mark)


_TENSOR = object()  # where an output leaf is one of the checkpoint's tensors


def _causal_mask_dropped(offloader, kwargs: dict) -> dict:
    """The layer's call without its attention mask where that mask is the causal one (attention then
    runs causal without reading it: transformers' SDPA path sets is_causal for a missing mask). The
    mask reaches each layer's own graph as an input, where it cannot be proven causal; checked here
    once per mask (one synchronization a step: every layer shares it)."""
    mask = kwargs.get("attention_mask")
    if not offloader.causal or not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return kwargs
    key = (id(mask), mask._version)
    if offloader.mask_verdict[0] != key or offloader.mask_verdict[1]() is not mask:
        with torch.no_grad():
            ok = is_causal_mask(mask, mask.shape[-2], mask.shape[-1])
        offloader.mask_verdict = (key, weakref.ref(mask), ok)
        offloader.masks[0 if ok else 1] += 1
    return {**kwargs, "attention_mask": None} if offloader.mask_verdict[2] else kwargs


def _call(layer, run, offloader, first, *args, **kwargs):
    """A decoder layer's call in place of its forward: checkpointed with its input offloaded in a
    training call, else the compiled layer as it is. `first`: the stack's first layer, whose call
    starts a forward."""
    kwargs = _causal_mask_dropped(offloader, kwargs)
    # a stack its first training call showed is none runs as it is, until the model's call is done
    if not (torch.is_grad_enabled() and layer.training) or offloader.not_a_stack:
        return run(*args, **kwargs)
    flat, spec = pytree.tree_flatten((args, kwargs))
    shape = {}

    def traced(*a, **k):  # the first run notes the output's structure, which apply flattens
        out = run(*a, **k)
        leaves, shape["spec"] = pytree.tree_flatten(out)
        shape["leaves"] = [_TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]
        return out

    # the anchor needs a gradient, so the outputs do where the layer's input does not (a LoRA model's
    # first layer reads frozen embeddings): its parameters' gradients come from the backward's run
    anchor = torch.empty(0, requires_grad=True)
    outs = iter(_Checkpoint.apply(traced, offloader, spec, len(args), first, anchor, *flat))
    out = pytree.tree_unflatten([next(outs) if v is _TENSOR else v for v in shape["leaves"]], shape["spec"])
    if offloader.not_a_stack is None:
        offloader.not_a_stack = _not_a_layer(args, kwargs, out)
    return out


def _not_a_layer(args, kwargs, out) -> str:
    """Why a call's module is not a decoder layer (its hidden states, the first positional tensor or
    `hidden_states`, come out in another shape, as an output head's logits do); "" where it is."""
    given = [*args[:1], kwargs.get("hidden_states")]
    hidden = next((t for t in given if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    made = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    if hidden is None or made is None:
        return "takes or returns no hidden states (a floating point tensor, first or as hidden_states)"
    if made.shape != hidden.shape:
        return f"returns {list(made.shape)} for hidden states of {list(hidden.shape)}"
    return ""


def no_cache_in_training(model, kwargs: dict, layered: bool) -> dict:
    """A training forward of a Hugging Face model whose layers are graphs of their own (`layered`:
    offloaded layers, FSDP2's sharded ones) gets `use_cache=False` unless the call says otherwise, as
    under gradient checkpointing: the cache a training step would fill is never read, and its update
    makes each layer's code depend on the layer's index, so one graph per layer would be compiled
    until dynamo's limit, and the rest run uncompiled. An explicit `use_cache` or a cache passed in
    is kept."""
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
    return {**kwargs, "use_cache": False}


def sharded(model) -> bool:
    """Whether FSDP2's fully_shard wrapped a module of `model` (its class is then FSDP<name>): each
    such module's forward is a graph of its own."""
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())


@contextlib.contextmanager
def own_checkpointing(layers):
    """Offloaded layers checkpoint themselves: Hugging Face's gradient checkpointing (which Trainer
    turns on) is off for the call, so that each layer runs once in the forward and once again in the
    backward, not twice."""
    flags = [
        (m, m.gradient_checkpointing) for m in layers.layers if getattr(m, "gradient_checkpointing", False)
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
