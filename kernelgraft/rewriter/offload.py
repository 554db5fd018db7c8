"""Offloaded activations: each decoder layer of a training step keeps only its input for the
backward, in pinned host memory, and runs again in the backward (Options.offload).

A model's decoder layers are the largest `nn.ModuleList` of one class (every Hugging Face decoder
keeps them so: `model.layers`, `transformer.h`...). Each layer's `forward` is replaced, on the
instance, by a call that the model's captured graph does not trace into (a graph break at each
layer, as FSDP2's per-layer hooks make): the layer itself is compiled by the model's own backend,
one graph for every layer. In a training call the layer runs through `_Checkpoint`:

    forward   the layer under no_grad (its graph grafted as a training one); its input copied to
              a pinned host buffer on a stream of its own (the next layers run meanwhile); the
              other inputs (position embeddings, masks), which every layer shares, kept as they are
    backward  the input fetched back (the previous layer's fetch started now: one layer ahead), the
              layer run again with gradients, its backward run; parameters' gradients accumulate as
              in any backward

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


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """(path, list) of the model's decoder layers: the `nn.ModuleList` of two or more modules of one
    class holding the most parameters; None where the model has none."""
    best, size = None, 0
    for path, m in model.named_modules():
        if not isinstance(m, torch.nn.ModuleList) or len(m) < 2 or len({type(c) for c in m}) != 1:
            continue
        n = sum(p.numel() for p in m.parameters())
        if n > size:
            best, size = (path, m), n
    return best


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
        self.calls: list[list[_Saved]] = []  # this step's layer calls, in forward order
        self.bytes = 0  # host bytes in use now
        self.causal = True  # causal masks dropped from the layers' calls (Options.causal_attention)
        self.mask_verdict: tuple = (None, lambda: None, False)  # (key, weak ref, causal) of the last mask
        self.masks = [0, 0]  # masks checked: [causal, not causal]
        self.peak_bytes = 0

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

    def done(self, call: list[_Saved]) -> list[_Saved] | None:
        """Forget `call` (its backward has its inputs) and return the layer call made before it in
        this step's forward, whose backward runs next. Backwards run in reverse: searched from the end."""
        for i in range(len(self.calls) - 1, -1, -1):
            if self.calls[i] is call:
                del self.calls[i]
                return self.calls[i - 1] if i > 0 else None
        return None


def _offloaded(t: torch.Tensor, first: bool) -> bool:
    """Whether a layer's tensor input goes to the host: its hidden states (the first positional
    input, or any input that needs a gradient). Position embeddings and masks are shared by every
    layer: kept as they are."""
    return t.is_floating_point() and (first or t.requires_grad)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, offloader, spec, n_args, anchor, *flat):
        ctx.run, ctx.offloader, ctx.spec = run, offloader, spec
        args, kwargs = pytree.tree_unflatten(list(flat), spec)
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
        ctx.saved = saved
        offloader.calls.append(saved)
        flat_out = pytree.tree_leaves(out)
        ctx.flat_values = [None if isinstance(x, torch.Tensor) else x for x in flat]
        return tuple(o for o in flat_out if isinstance(o, torch.Tensor))

    @staticmethod
    def backward(ctx, *grads):
        off, saved = ctx.offloader, ctx.saved
        inputs = []
        for s, value in zip(saved, ctx.flat_values):
            if s is None:
                inputs.append(value)
                continue
            t = off.fetch(s).detach()
            inputs.append(t.requires_grad_(s.requires_grad))
        before = off.done(saved)  # every input of this call was fetched above: its buffers are free
        if before is not None:  # the next backward's input comes back while this layer runs again
            for s in before:
                if s is not None:
                    off.prefetch(s)
        args, kwargs = pytree.tree_unflatten(inputs, ctx.spec)
        with torch.enable_grad():
            out = ctx.run(*args, **kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads_in = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs]
        return (None, None, None, None, None, *grads_in)


class OffloadedLayers:
    """The model's decoder layers, each called through `_layer_call` (installed by `install`,
    undone by `remove`)."""

    def __init__(self, model: torch.nn.Module, compile_layer):
        found = decoder_layers(model)
        if found is None:
            raise ValueError(
                f"kernelgraft: offload=True needs decoder layers (an nn.ModuleList of one class) in "
                f"{type(model).__name__}, and found none: leave offload at None or False for this model"
            )
        self.path, self.layers = found
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
                self.calls.append(torch._dynamo.disable(functools.partial(_call, layer, run, self.offloader)))
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


def _call(layer, run, offloader, *args, **kwargs):
    """A decoder layer's call in place of its forward: checkpointed with its input offloaded in a
    training call, else the compiled layer as it is."""
    kwargs = _causal_mask_dropped(offloader, kwargs)
    if not (torch.is_grad_enabled() and layer.training):
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
    outs = iter(_Checkpoint.apply(traced, offloader, spec, len(args), anchor, *flat))
    return pytree.tree_unflatten([next(outs) if v is _TENSOR else v for v in shape["leaves"]], shape["spec"])


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
