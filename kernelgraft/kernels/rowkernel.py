"""A generated row kernel pair and its launcher: compiled by Triton on CUDA, run by Triton's
interpreter on the CPU: the same generated source, in one process.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from .cache import load_module
from .codegen import module_source
from .derive import Backward, derive
from .spec import Spec, Unsupported, build_spec

MAX_N = 65536  # the whole row sits in registers; wider rows fall back (reported)


@dataclass
class RowKernel:
    spec: Spec
    backward: Backward
    source: str
    path: Path
    _compiled: dict = field(default_factory=dict)

    def fn(self, which: str, device: torch.device):
        """The kernel for `device`: Triton-compiled on cuda, interpreted on cpu, from one source file."""
        key = (which, device.type)
        if key not in self._compiled:
            if device.type not in ("cuda", "cpu"):
                raise Unsupported(
                    f"device {device.type}: kernels run on cuda, or on cpu through Triton's interpreter"
                )
            mod, _ = load_module(self.spec.name, self.source, interpret=device.type == "cpu")
            py = getattr(mod, f"{self.spec.name}_{which}")
            if device.type == "cuda":
                self._compiled[key] = triton.jit(py)
            else:
                from triton.runtime.interpreter import InterpretedFunction

                self._compiled[key] = InterpretedFunction(py)
        return self._compiled[key]


@functools.cache
def _row_kernel(spelling, dtypes: tuple, kinds: tuple, rounding: str) -> RowKernel:
    spec = build_spec(spelling, dict(dtypes), dict(kinds), rounding)
    bwd = derive(spec)
    src = module_source(spec, bwd, spelling.qualname)
    _, path = load_module(spec.name, src)
    return RowKernel(spec, bwd, src, path)


def row_kernel(spelling, dtypes: dict, kinds: dict, rounding: str = "autograd") -> RowKernel:
    names = spelling.tensor_names
    dt = tuple((n, dtypes[n]) for n in names)
    return _row_kernel(spelling, dt, tuple((n, kinds[n]) for n in names), rounding)


# ---- layout: which argument is a full tensor and which a per-column parameter ------------------


@dataclass
class Layout:
    shape: torch.Size  # output shape
    M: int  # rows
    N: int  # columns (last dim)
    kinds: dict  # tensor name -> 'elem' | 'col'


def layout(spelling, tensors: dict[str, torch.Tensor]) -> Layout:
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors.values()))
    except RuntimeError:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors.items())
        raise ValueError(
            f"{spelling.qualname}: argument shapes do not broadcast ({shapes}); every argument must have the "
            "row length of the first as its last dim"
        ) from None
    if len(shape) == 0:
        raise ValueError(f"{spelling.qualname}: needs at least one dimension (got scalars)")
    N = shape[-1]
    M = math.prod(shape[:-1])
    kinds, main_seen = {}, False
    for n, t in tensors.items():
        full = tuple(t.shape) == tuple(shape)
        if full and not main_seen:
            kinds[n], main_seen = "elem", True
        elif t.dim() >= 1 and t.shape[-1] == N and math.prod(t.shape[:-1]) == 1:
            kinds[n] = "col"
        else:
            kinds[n] = "elem"
    return Layout(shape, M, N, kinds)


def _config(M: int, N: int, device: torch.device) -> dict:
    BN = triton.next_power_of_2(max(N, 1))
    if device.type == "cuda":
        BM = max(1, min(16, 4096 // BN))
        warps = 4 if BN <= 2048 else (8 if BN <= 8192 else 16)
        return dict(BLOCK_M=BM, BLOCK_N=BN, num_warps=warps)
    # interpreter: numpy does the work per program, so blocks are large; but numpy sums a column of a
    # block one row after another, so 8 rows at most keep per-column gradients as accurate as torch's
    BM = max(1, min(triton.next_power_of_2(max(M, 1)), 32768 // BN, 8))
    return dict(BLOCK_M=BM, BLOCK_N=BN)


MAX_PROGRAMS_CPU = 4096


def _programs(n_blocks: int, device: torch.device) -> int:
    """Backward programs. Each writes one partial row of every per-column gradient; torch adds the
    partial rows (a tree sum), so more programs also means shorter sequential sums."""
    if device.type == "cuda":
        return max(1, min(n_blocks, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(n_blocks, MAX_PROGRAMS_CPU))


def _flat(t: torch.Tensor, lay: Layout, kind: str) -> torch.Tensor:
    if kind == "col":
        return t.reshape(lay.N)
    return t.expand(lay.shape).reshape(lay.M, lay.N)


def _ptr_args(spec: Spec, flats: list[torch.Tensor]) -> list:
    a = []
    for name, t in zip(spec.tensors, flats):
        a += [t, t.stride(0)] + ([t.stride(1)] if spec.kinds[name] == "elem" else [])
    return a


def forward(spelling, args: tuple, rounding: str = "autograd") -> tuple[torch.Tensor, torch.Tensor]:
    """Run the generated forward on `args` (the spelling's arguments in order) -> (out, row stats)."""
    tensors, scalars = split_args(spelling, args)
    lay = layout(spelling, tensors)
    k = row_kernel(spelling, {n: t.dtype for n, t in tensors.items()}, lay.kinds, rounding)
    dev = next(iter(tensors.values())).device
    K = max(len(k.spec.reductions), 1)
    out = torch.empty(lay.shape, dtype=k.spec.out_dtype, device=dev)
    stats = torch.empty((*lay.shape[:-1], K), dtype=torch.float32, device=dev)
    if lay.M == 0 or lay.N == 0:
        return out, stats
    if lay.N > MAX_N:
        raise Unsupported(
            f"rows of {lay.N} elements; generated kernels hold a row of at most {MAX_N} in registers"
        )
    flats = [_flat(t, lay, lay.kinds[n]) for n, t in tensors.items()]
    o = out.view(lay.M, lay.N)
    cfg = _config(lay.M, lay.N, dev)
    grid = (triton.cdiv(lay.M, cfg["BLOCK_M"]),)
    k.fn("fwd", dev)[grid](
        *_ptr_args(k.spec, flats),
        *scalars,
        o,
        o.stride(0),
        o.stride(1),
        stats,
        lay.M,
        lay.N,
        float(lay.N),
        **cfg,
    )
    return out, stats


def backward(
    spelling,
    grad: torch.Tensor,
    args: tuple,
    stats: torch.Tensor,
    needs: list[bool],
    rounding: str = "autograd",
) -> list[torch.Tensor]:
    """Gradients of every tensor argument (an empty tensor where `needs` is False)."""
    tensors, scalars = split_args(spelling, args)
    lay = layout(spelling, tensors)
    k = row_kernel(spelling, {n: t.dtype for n, t in tensors.items()}, lay.kinds, rounding)
    dev = grad.device
    cfg = _config(lay.M, lay.N, dev)
    nprog = _programs(triton.cdiv(max(lay.M, 1), cfg["BLOCK_M"]), dev)
    grads, outs = [], []
    for (n, t), need in zip(tensors.items(), needs):
        kind = lay.kinds[n]
        if not need:
            buf = torch.empty((1, 1), dtype=torch.float32, device=dev)
        elif kind == "col":
            buf = torch.zeros((nprog, lay.N), dtype=torch.float32, device=dev)
        else:  # a broadcast argument gets its full gradient, summed back to its shape below
            buf = torch.empty((lay.M, lay.N), dtype=t.dtype, device=dev)
        outs.append(buf)
    if lay.M > 0 and lay.N > 0:
        if lay.N > MAX_N:
            raise Unsupported(f"rows of {lay.N} elements (max {MAX_N})")
        flats = [_flat(t, lay, lay.kinds[n]) for n, t in tensors.items()]
        g = grad.expand(lay.shape).reshape(lay.M, lay.N)
        gargs = []
        for n, buf in zip(tensors, outs):
            gargs += [buf, buf.stride(0)] + ([buf.stride(1)] if lay.kinds[n] == "elem" else [])
        flags = {f"NEED_{name}": bool(need) for name, need in zip(k.spec.tensors, needs)}
        k.fn("bwd", dev)[(nprog,)](
            g,
            g.stride(0),
            g.stride(1),
            *_ptr_args(k.spec, flats),
            *scalars,
            stats,
            *gargs,
            lay.M,
            lay.N,
            float(lay.N),
            **cfg,
            **flags,
        )
    for (n, t), need, buf in zip(tensors.items(), needs, outs):
        if not need:
            grads.append(torch.empty(0, dtype=t.dtype, device=dev))
        elif lay.kinds[n] == "col":
            grads.append(buf.sum(0).to(t.dtype).view(t.shape))
        elif tuple(t.shape) == tuple(lay.shape):
            grads.append(buf.view(t.shape))
        else:
            grads.append(buf.view(lay.shape).float().sum_to_size(t.shape).to(t.dtype))
    return grads


def split_args(spelling, args: tuple) -> tuple[dict, list]:
    tensors, scalars = {}, []
    for name, a in zip(spelling.arg_names, args):
        if name in spelling.scalar_names:
            scalars.append(float(a))
        else:
            if not isinstance(a, torch.Tensor):
                raise TypeError(
                    f"{spelling.qualname}: argument {name!r} must be a tensor, got {type(a).__name__}"
                )
            tensors[name] = a
    return tensors, scalars
