"""Offloaded activations: each decoder layer of a training step keeps only its input for the
backward, in pinned host memory, and runs again in the backward (Options.offload).

The layers are those layers.py captures per class (a layer's call is a graph break of the model's
capture, its graph one for every layer). In a training call the layer runs through `_Checkpoint`:

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
import weakref

import torch
from torch.utils import _pytree as pytree

from .backend import CHECKPOINTED


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


_TENSOR = object()  # where an output leaf is one of the checkpoint's tensors


def checkpointed(run, offloader: Offloader, first: bool, args: tuple, kwargs: dict):
    """`run(*args, **kwargs)` for a training call, through `_Checkpoint`: its input offloaded, the
    layer run again in the backward. `first`: the stack's first layer, whose call starts a forward."""
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
    return pytree.tree_unflatten([next(outs) if v is _TENSOR else v for v in shape["leaves"]], shape["spec"])
