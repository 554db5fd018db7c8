"""What the benchmark scripts share (imported as a sibling module: they run from this folder)."""

from __future__ import annotations

import re

import torch


def names(spec: str) -> list[str]:
    """A comma-separated list of names; a comma inside parentheses does not split
    ("kernelgraft (inductor, no recompute),liger" is two modes)."""
    return [m.strip() for m in re.split(r",(?![^()]*\))", spec or "") if m.strip()]


def cuda_kernels(prof, calls: int) -> list[tuple[float, int, str]]:
    """(ms per call, launches per call, name) of each CUDA kernel in a torch.profiler run of `calls`
    calls, largest first. Only the kernels themselves: host ops also carry their kernels' device
    time, and would count it twice."""
    from torch.autograd import DeviceType

    rows = [
        (e.device_time_total / 1e3 / calls, e.count // calls, e.key)
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA
    ]
    return sorted(rows, reverse=True)


def profile_kernels(fn, calls: int = 20) -> list[tuple[float, int, str]]:
    """cuda_kernels of `calls` calls of fn (after one unprofiled call): where its device time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return cuda_kernels(prof, calls)


def peak_above(fn) -> int:
    """Bytes the CUDA allocator held at its peak while `fn()` ran, above what was allocated before
    (the inputs): a call's own memory, outputs and gradients included."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def saved_for_backward(model: torch.nn.Module, loss_fn) -> dict:
    """What `loss_fn()` (a forward of `model`) saves for the backward: storage address -> (bytes,
    shape of a tensor saved on it), `model`'s parameters aside (saved_tensors_hooks); then runs that
    backward and clears the gradients. Summed with the peak and the parameters' bytes it splits a
    step's memory into weights, gradients, saved activations and the rest (transient buffers)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = (st.nbytes(), tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return seen


def saved_bytes(model: torch.nn.Module, loss_fn) -> int:
    """The bytes of saved_for_backward(model, loss_fn)."""
    return sum(b for b, _ in saved_for_backward(model, loss_fn).values())
