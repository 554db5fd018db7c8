"""Reference runners: float64 truth, eager in the working dtype, torch.compile of the reference.

Truth runs the same PyTorch code with every floating dtype it names promoted to float64: a spelling
that casts to float32 on purpose (RMSNorm's upcast) must not pull the truth back to float32.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_NARROW = (torch.float32, torch.bfloat16, torch.float16)
_METHODS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


def _widen(a):
    if isinstance(a, torch.dtype) and a in _NARROW:
        return torch.float64
    return a


class Float64Everywhere(TorchFunctionMode):
    """Within this mode, `.float()`, `.to(torch.bfloat16)`, `dtype=torch.float32` ... mean float64.

    >>> import torch
    >>> from kernelgraft.gradcheck import Float64Everywhere
    >>> x = torch.ones(2, dtype=torch.float64)
    >>> with Float64Everywhere():
    ...     (x.float().dtype, x.to(torch.bfloat16).dtype, torch.zeros(1, dtype=torch.float32).dtype)
    (torch.float64, torch.float64, torch.float64)
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METHODS:
            return args[0].double()
        args = tuple(_widen(a) for a in args)
        kwargs = {k: _widen(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def run_with_grads(fn, args, grad_out, *, truth: bool = False):
    """Run fn(*args) and backpropagate grad_out -> (output, [grad of each tensor argument]).
    truth=True runs on float64 copies under Float64Everywhere.

    >>> import torch
    >>> from kernelgraft.gradcheck import run_with_grads
    >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
    >>> out, (gx,) = run_with_grads(lambda t: t * t, (x,), torch.ones(2), truth=True)
    >>> out.dtype, gx.tolist()
    (torch.float64, [2.0, 4.0])
    """
    leaves = []
    call = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            t = a.detach().double() if truth else a.detach().clone()
            t.requires_grad_(a.requires_grad)
            leaves.append(t)
            call.append(t)
        else:
            call.append(a)
    if truth:
        with Float64Everywhere():
            out = fn(*call)
    else:
        out = fn(*call)
    need = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(out, need, grad_out.to(out.dtype), allow_unused=True) if need else []
    it = iter(grads)
    return out.detach(), [next(it) if t.requires_grad else None for t in leaves]
