"""Check one pattern spelling's generated kernel against its own PyTorch spelling."""

from __future__ import annotations

import torch

from .._dynamo import room_for_recompiles
from ..kernels import fallback, op_for
from .references import run_with_grads
from .rule import Verdict, judge


def check_spelling(
    spelling,
    args: tuple,
    *,
    grad_out: torch.Tensor | None = None,
    compile_ref: bool = True,
    seed: int = 0,
    rounding: str = "autograd",
    op=None,
) -> list[Verdict]:
    """Output and every gradient of the kernel vs float64 truth, next to eager and torch.compile of
    the spelling in the working dtype. Returns one Verdict per compared quantity. `op`: the callable
    to check (default: the spelling's own kernel op).

    >>> import torch, kernelgraft
    >>> from kernelgraft.gradcheck import check_spelling
    >>> sp = kernelgraft.patterns.REGISTRY.get("rms_norm", "llama")
    >>> x, w = torch.randn(4, 33, requires_grad=True), torch.randn(33, requires_grad=True)
    >>> all(v.ok for v in check_spelling(sp, (x, w, 1e-6), compile_ref=False))
    True
    """
    op = op if op is not None else op_for(spelling, rounding)
    return [judge(what, *r) for what, *r in compare(spelling, args, op, grad_out, compile_ref, seed)]


def compare(spelling, args: tuple, op, grad_out=None, compile_ref: bool = True, seed: int = 0) -> list[tuple]:
    """The runs every check compares: float64 truth, `op`, eager and (compile_ref) torch.compile of
    the spelling on `args`, with one incoming gradient -> [(what, truth, op's, eager's, compile's)]
    for the output and each gradient the truth has. An exception from `op` propagates, and so does
    a kernel that fell back to the spelling's own code (KernelFellBack): its numbers would be
    eager's, and the check would pass without having run the kernel."""
    ref = spelling.fn
    g = _grad(ref, args, grad_out, seed)
    truth, tgrads = run_with_grads(ref, args, g, truth=True)
    before = dict(fallback.FAILED)
    kg, kgrads = run_with_grads(op, args, g)
    _did_not_fall_back(spelling, args, before)
    eager, egrads = run_with_grads(ref, args, g)
    comp, cgrads = (None, [None] * len(egrads))
    if compile_ref:
        with room_for_recompiles():
            comp, cgrads = run_with_grads(
                torch.compile(ref, backend="inductor", fullgraph=True, dynamic=False), args, g
            )
    names = [
        n for n, a in zip(spelling.arg_names, args) if isinstance(a, torch.Tensor) and a.is_floating_point()
    ]
    out = [("out", truth, kg, eager, comp)]
    for n, t, k, e, c in zip(names, tgrads, kgrads, egrads, cgrads):
        if t is not None:
            out.append((f"grad {n}", t, k, e, c))
    return out


class KernelFellBack(RuntimeError):
    """The kernel under check failed (compile, resources, launch) and its sites ran the spelling's
    own PyTorch code instead."""


def _did_not_fall_back(spelling, args: tuple, before: dict) -> None:
    """Raise KernelFellBack where running the op recorded a kernel failure, or where the sites of
    this spelling, device and dtype fell back earlier in the process."""
    new = {k: v for k, v in fallback.FAILED.items() if k not in before}
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    earlier = None
    if first is not None:
        earlier = fallback.failure_of(fallback.site_key(spelling.qualname, first.device.type, first.dtype))
    if new or earlier:
        why = "; ".join(f"{name} on {dev}: {w}" for (name, dev), w in new.items()) or earlier
        raise KernelFellBack(
            f"{spelling.qualname}: the kernel fell back to the spelling's PyTorch code ({why}), so its "
            "numbers are eager's and the check cannot judge the kernel. Fix the kernel's failure "
            "(tile, resources) for these shapes and dtypes."
        )


# The incoming gradient's random stream, apart from the inputs'. Drawn from the seed of the inputs
# (examples and hypothesis cases draw x from `torch.Generator().manual_seed(seed)`), g would equal x
# wherever the shapes agree: for a norm, scale invariant, the gradient along g = x is ~0 (its terms
# cancel to a float32 rounding), its error relative to that ~0 is noise, and the rule would compare
# luck. A test of that cancellation passes g = x itself (`grad_out`). (The CPU generator keeps a
# seed's low 32 bits: the stream is the seed with its high bits flipped.)
GRAD_STREAM = 0x9E3779B9


def _grad(ref, args, grad_out, seed):
    if grad_out is not None:
        return grad_out
    with torch.no_grad():
        y = ref(*args)
    gen = torch.Generator(device="cpu").manual_seed(GRAD_STREAM ^ seed)
    return torch.randn(y.shape, generator=gen, dtype=torch.float32).to(device=y.device, dtype=y.dtype)
