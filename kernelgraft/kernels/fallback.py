"""What every family does when its kernel fails at run time (compile error, out of resources): the
failure is recorded once per (kernel, device type), a warning says so, and the sites run the
spelling's own PyTorch code from then on: the same numbers as without kernelgraft.
"""

from __future__ import annotations

import warnings

import torch

FAILED: dict = {}  # (kernel name, device type) -> why; see kernelgraft.kernels.failed_kernels()


def has_failed(name: str, device_type: str) -> bool:
    return bool(FAILED) and (name, device_type) in FAILED


def record_failure(name: str, dev: torch.device, e: Exception, consequence: str) -> None:
    """Record a generated kernel that failed to load, compile or launch (FAILED), and warn once."""
    key = (name, dev.type)
    if key not in FAILED:
        FAILED[key] = f"{type(e).__name__}: {e}"[:500]
        warnings.warn(
            f"kernelgraft: the generated kernel {name} failed on {dev.type} ({FAILED[key][:200]}). "
            f"{consequence}",
            RuntimeWarning,
            stacklevel=4,
        )


def spelling_vjp(spelling, named: dict, diff: list[str], cotangent) -> tuple[torch.Tensor, dict]:
    """The spelling's output on the named arguments and its gradients for those named in `diff`,
    for the incoming gradient `cotangent(output)`. torch.func.vjp, not autograd: inside a custom
    op's implementation autograd does not record."""

    def f(*ts):
        call = dict(named, **dict(zip(diff, ts)))
        return spelling.fn(*(call[a] for a in spelling.arg_names))

    y, vjp = torch.func.vjp(f, *(named[n].detach() for n in diff))
    return y, dict(zip(diff, vjp(cotangent(y))))


def reference_gradients(spelling, grad: torch.Tensor, args: tuple, needs: list[bool]) -> list[torch.Tensor]:
    """The spelling's own gradients of its tensor arguments (an empty tensor where not needed)."""
    names = [n for n in spelling.arg_names if n in spelling.tensor_names]
    named = dict(zip(spelling.arg_names, args))
    diff = [n for n, need in zip(names, needs) if need and named[n].is_floating_point()]
    got = spelling_vjp(spelling, named, diff, lambda y: grad.to(y.dtype))[1] if diff else {}
    out = []
    for n, need in zip(names, needs):
        t = named[n]
        out.append(got.get(n, torch.zeros_like(t)) if need else t.new_empty(0))
    return out
