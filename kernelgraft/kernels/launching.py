"""What every family's launcher shares: the Triton options that keep the reference's roundings,
and the integer helpers of launch grids (host-side: cheap on every call)."""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

# Triton's interpreter runs a kernel by patching triton.language for it and by keeping the program's
# grid index in one process-wide builder: two threads inside it break each other's kernels. Every
# interpreted launch holds this lock (kernels/cache.py's interpreted kernels), so the threads of a
# process take turns; reentrant, for a launch that launches.
INTERPRETER = threading.RLock()


def pow2(n: int) -> int:
    """The next power of two (triton.next_power_of_2 is a constexpr function: slow on the host)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def sm_count(index) -> int:
    """The streaming multiprocessors of CUDA device `index` (None: the current one): a grid that
    fills the device takes a multiple of them."""
    return torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()
    ).multi_processor_count


def launch_options(rounding: str, dtypes, device_type: str) -> dict:
    """Triton options for a kernel that must round where the reference rounds. On the GPU Triton
    contracts a multiply and an add into one FMA by default, and LLVM first narrows float ops on
    values rounded to fp16/bf16 into half-precision ops: the LM head's `1 - round(y*y)` became
    fma(-y, y, 1), one rounding where CUDA eager's tanh_backward has two, and many fp16 results
    differed from aten's (benchmarks/diag_softcap.py shows the case). Without contraction every
    rounding written in the generated source is kept, as eager keeps each op's. Under inductor's
    rounding ("fused") contraction stays on, as inductor's own."""
    low = any(d in (torch.bfloat16, torch.float16) for d in dtypes)
    if device_type == "cuda" and rounding == "autograd" and low:
        return {"enable_fp_fusion": False}
    return {}


# ---- launched by inductor: the launcher traced into the compiled graph --------------------------

# per thread: one thread's lowering pass tracing its launches leaves another thread's launches to run
_TRACING = threading.local()
# what the names of the Triton kernels inductor may launch for kernelgraft begin with, one per
# generated module (each of its kernels is named "<module name>_<entry>"): registered when the module
# is built, which a capture does before inductor compiles the graph or loads it from its cache
KERNEL_PREFIXES: set[str] = set()
# the names of single generated kernels (the LM head's: one kernel, named as its module)
KERNEL_NAMES: set[str] = set()


def register_kernels(module_name: str, single: bool = False) -> None:
    """Register a generated module's kernels: each named "<module name>_<entry>", or with
    `single`, the one kernel named as the module."""
    if single:
        KERNEL_NAMES.add(module_name)
    else:
        KERNEL_PREFIXES.add(f"{module_name}_")


def is_kernelgraft_kernel(name: str | None) -> bool:
    """Whether a Triton kernel of this name is one of kernelgraft's generated kernels."""
    return bool(name) and (name in KERNEL_NAMES or any(name.startswith(p) for p in KERNEL_PREFIXES))


@contextlib.contextmanager
def traced_launches():
    """Inside the block the launchers are traced, not run (the rewriter's lowering pass makes an fx
    graph of them for inductor): each Triton launch is recorded as torch's user-defined-kernel
    call (torch.library.wrap_triton), which inductor's generated code then makes itself, with the
    grid, block sizes and strides the launcher decided for these shapes. No kernel runs and none
    is marked failed while tracing: an error leaves the op to launch from the host."""
    _TRACING.depth = getattr(_TRACING, "depth", 0) + 1
    try:
        yield
    finally:
        _TRACING.depth -= 1


def tracing() -> bool:
    """Whether this thread is inside traced_launches (its launches recorded, not run)."""
    return getattr(_TRACING, "depth", 0) > 0


def launcher(fn):
    """`fn` (a Triton kernel) as the launcher calls it: itself, or while tracing, wrapped for it."""
    if tracing():
        return torch.library.wrap_triton(fn)
    return fn


class NotTraceable(Exception):
    """A launch that cannot be recorded for inductor (a failed kernel's fallback, say): the op is
    left to launch from the host."""
