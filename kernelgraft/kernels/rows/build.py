"""A generated row kernel pair, built once per (spelling, dtypes, kinds, rounding): the spec, its
derived backward, the Triton module source (written to the cache), and the compiled kernels per
device: compiled by Triton on CUDA, run by Triton's interpreter on the CPU, from the same source.
Where CUDA's eager kernels round differently from the CPU's in a spelling's backward (tanh and
sigmoid held in bf16/fp16: ir/primitives.py), the kernel for CUDA tensors is derived to round as
CUDA's do: a second source, named `<spec>__cuda`; the CPU tests run it through the interpreter too.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import emit
from ..cache import load_module
from ..derive import Backward, derive
from ..family import Unsupported
from ..launching import launch_options, register_kernels
from ..spec import Spec, build_spec
from .codegen import module_source

MAX_N = 65536  # the whole row sits in registers; wider rows fall back (reported)
MAX_ROWS = 2**31 - 2**16  # rows of one tensor: the kernels split a row index in int32 (codegen._row_index)


@dataclass
class RowKernel:
    spec: Spec
    backward: Backward
    source: str
    path: Path
    _compiled: dict = field(default_factory=dict)

    @functools.cached_property
    def elementwise(self) -> bool:
        """No row reduction, no per-column argument, no permutation or column map within the row:
        the row boundaries mean nothing, and the launcher may re-cut the tensors into any rows."""
        b = self.backward
        needed = emit.needed(self.spec.output, *b.grads.values(), *(e for _, e in b.adjoints))
        return (
            not self.spec.reductions
            and all(v == "elem" for v in self.spec.kinds.values())
            and not any(n.endswith("__p") or n == "sgn" for n in needed)
            and not self.spec.out_map
            and not self.spec.half_inputs
        )

    def options(self, device: torch.device) -> dict:
        """launch_options for this kernel on `device` (decided once per device type)."""
        key = ("options", device.type)
        if key not in self._compiled:
            self._compiled[key] = launch_options(self.spec.rounding, self.spec.dtypes.values(), device.type)
        return self._compiled[key]

    def fn(self, which: str, device: torch.device):
        """The kernel for `device`: Triton-compiled on cuda, interpreted on cpu, from one source file."""
        key = (which, device.type)
        if key not in self._compiled:
            if device.type not in ("cuda", "cpu"):
                raise Unsupported(
                    f"device {device.type}: kernels run on cuda, or on cpu through Triton's interpreter"
                )
            mod, _ = load_module(self.spec.name, self.source, interpret=device.type == "cpu")
            # a JITFunction in the compiled instance, an InterpretedFunction in the interpreter's
            self._compiled[key] = getattr(mod, f"{self.spec.name}_{which}")
        return self._compiled[key]


@functools.cache
def _row_kernel(spelling, dtypes: tuple, kinds: tuple, rounding: str, rounds: str = "cpu") -> RowKernel:
    spec = build_spec(spelling, dict(dtypes), dict(kinds), rounding)
    bwd = derive(spec, rounds)
    if rounds != "cpu":
        cpu = _row_kernel(spelling, dtypes, kinds, rounding, "cpu")
        if bwd.grads == cpu.backward.grads and bwd.adjoints == cpu.backward.adjoints:
            return cpu  # the devices' eager kernels round alike here: one kernel
        spec = dataclasses.replace(spec, name=f"{spec.name}__{rounds}")
    src = module_source(spec, bwd, spelling.qualname)
    _, path = load_module(spec.name, src)
    register_kernels(spec.name)
    return RowKernel(spec, bwd, src, path)


def row_kernel(spelling, dtypes: dict, kinds: dict, rounding: str = "autograd", rounds: str = "cpu") -> RowKernel:
    """The generated kernel pair of `spelling` for these argument dtypes and kinds ("elem": one
    value per element, "col": one per column, a weight), built once: spec, derived backward, source.
    rounds: whose eager kernels' rounding the backward reproduces where the devices differ ("cpu",
    "cuda": rounds_for(device)).

    >>> import torch, kernelgraft
    >>> sp = kernelgraft.patterns.REGISTRY.get("rms_norm", "llama")
    >>> k = kernelgraft.kernels.row_kernel(sp, {"x": torch.bfloat16, "weight": torch.bfloat16},
    ...                                    {"x": "elem", "weight": "col"})
    >>> k.spec.out_dtype, k.elementwise, len(k.spec.reductions)
    (torch.bfloat16, False, 1)
    """
    names = spelling.tensor_names
    dt = tuple((n, dtypes[n]) for n in names)
    return _row_kernel(spelling, dt, tuple((n, kinds[n]) for n in names), rounding, rounds)


def rounds_for(device) -> str:
    """Whose eager rounding a kernel for tensors on `device` reproduces: CUDA's on a CUDA device,
    the CPU's elsewhere (the CPU, and meta tensors that only ask what would be served)."""
    return "cuda" if torch.device(device).type == "cuda" else "cpu"




def kernel_for(spelling, group, rounding: str) -> RowKernel:
    """The kernel of a launch group (layout.Group): its tensors' dtypes and kinds."""
    first = next(iter(group.tensors.values()))
    dtypes = {n: t.dtype for n, t in group.tensors.items()}
    return row_kernel(spelling, dtypes, group.lay.kinds, rounding, rounds_for(first.device))
