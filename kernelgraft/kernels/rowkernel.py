"""A generated row kernel pair and its launcher: compiled by Triton on CUDA, run by Triton's
interpreter on the CPU: the same generated source, in one process.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cache import load_module
from .codegen import GROUPS, module_source
from .derive import Backward, derive
from .spec import Spec, Unsupported, build_spec

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
        """No row reduction, no per-column argument, no permutation within the row: the row
        boundaries mean nothing, and the launcher may re-cut the tensors into any rows."""
        from .codegen import _needed

        b = self.backward
        needed = _needed(self.spec.output, *b.grads.values(), *(e for _, e in b.adjoints))
        return (
            not self.spec.reductions
            and all(v == "elem" for v in self.spec.kinds.values())
            and not any(n.endswith("__p") or n == "sgn" for n in needed)
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
def _row_kernel(spelling, dtypes: tuple, kinds: tuple, rounding: str) -> RowKernel:
    spec = build_spec(spelling, dict(dtypes), dict(kinds), rounding)
    bwd = derive(spec)
    src = module_source(spec, bwd, spelling.qualname)
    _, path = load_module(spec.name, src)
    return RowKernel(spec, bwd, src, path)


def row_kernel(spelling, dtypes: dict, kinds: dict, rounding: str = "autograd") -> RowKernel:
    """The generated kernel pair of `spelling` for these argument dtypes and kinds ("elem": one
    value per element, "col": one per column, a weight), built once: spec, derived backward, source.

    >>> import torch, kernelgraft
    >>> sp = kernelgraft.patterns.REGISTRY.get("rms_norm", "llama")
    >>> k = kernelgraft.kernels.row_kernel(sp, {"x": torch.bfloat16, "weight": torch.bfloat16},
    ...                                    {"x": "elem", "weight": "col"})
    >>> k.spec.out_dtype, k.elementwise, len(k.spec.reductions)
    (torch.bfloat16, False, 1)
    """
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
    shapes = tuple((n, tuple(t.shape)) for n, t in tensors.items())
    if all(type(d) is int for _, s in shapes for d in s):
        return _layout_cached(spelling, shapes)
    return _layout(spelling, shapes)  # symbolic sizes (dynamic shapes, at capture): not hashable


def _layout(spelling, shapes: tuple) -> Layout:
    try:
        shape = torch.broadcast_shapes(*(s for _, s in shapes))
    except RuntimeError:
        desc = ", ".join(f"{n} {s}" for n, s in shapes)
        raise ValueError(
            f"{spelling.qualname}: argument shapes do not broadcast ({desc}); every argument must have the "
            "row length of the first as its last dim"
        ) from None
    if len(shape) == 0:
        raise ValueError(f"{spelling.qualname}: needs at least one dimension (got scalars)")
    N = shape[-1]
    M = math.prod(shape[:-1])
    kinds, main_seen = {}, False
    for n, s in shapes:
        full = s == tuple(shape)
        if full and not main_seen:
            kinds[n], main_seen = "elem", True
        elif len(s) >= 1 and s[-1] == N and math.prod(s[:-1]) == 1:
            kinds[n] = "col"
        else:
            kinds[n] = "elem"
    return Layout(shape, M, N, kinds)


# cached per argument shapes: the launcher runs on every call, and its host time counts (issue 6)
_layout_cached = functools.lru_cache(maxsize=4096)(_layout)


def _pow2(n: int) -> int:
    """The next power of two (triton.next_power_of_2 is a constexpr function: slow on the host)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_options(rounding: str, dtypes, device_type: str) -> dict:
    """Triton options for a kernel that must round where the reference rounds. On the GPU Triton
    contracts a multiply and an add into one FMA by default, and LLVM first narrows float ops on
    values rounded to fp16/bf16 into half-precision ops: the LM head's `1 - round(y*y)` became
    fma(-y, y, 1), one rounding where CUDA eager's tanh_backward has two (measured on the H200,
    2026-11-30: 53232 of 200000 fp16 results differed from aten's; benchmarks/diag_softcap.py found
    the case). Without contraction every rounding written in the generated source is kept, as eager
    keeps each op's. Under inductor's rounding ("fused") contraction stays on, as inductor's own."""
    low = any(d in (torch.bfloat16, torch.float16) for d in dtypes)
    if device_type == "cuda" and rounding == "autograd" and low:
        return {"enable_fp_fusion": False}
    return {}


# A row-reducing kernel's backward that sums columns (RMSNorm's weight gradient): (BLOCK_M, programs
# per SM) by row width, swept on an H200 (benchmarks/tune_rows.py, 2026-11-30) among configs whose
# numbers are bitwise the default's (the same num_warps): 4096 wide 0.168 -> 0.132 ms, 2048 wide (the
# Llama-3.2-1B's) 0.108 -> 0.082 ms. Other widths keep the general rule.
TUNED_COLUMN_SUMS = {4096: (2, 2), 2048: (1, 4)}


def _tuned_column_sums(N: int, reduces: bool) -> tuple[int, int] | None:
    """(BLOCK_M, programs per SM) from TUNED_COLUMN_SUMS for a row-reducing kernel's
    column-summing backward of rows of N; None where the general rule holds."""
    return TUNED_COLUMN_SUMS.get(_pow2(max(N, 1))) if reduces else None


def _config(M: int, N: int, device: torch.device, sums_columns: bool = True, reduces: bool = False) -> dict:
    """Launch config of a row kernel: BLOCK_M rows of BLOCK_N per program. sums_columns: the
    program sums its rows into per-column gradients (a backward with weight-like arguments);
    reduces: the kernel reduces along each row (a norm)."""
    BN = _pow2(max(N, 1))
    if device.type == "cuda":
        warps = 4 if BN <= 2048 else (8 if BN <= 8192 else 16)
        tuned = _tuned_column_sums(N, reduces) if sums_columns else None
        if tuned:
            BM = tuned[0]
        elif reduces:
            # 8192 elements per program (same sweep): RMSNorm forward 4096 wide 0.084 -> 0.078 ms
            # with 2 rows, 2048 wide 0.043 -> 0.040 ms with 4; num_warps unchanged (same numbers)
            BM = max(1, min(16, 8192 // BN))
        else:
            BM = max(1, min(16, 4096 // BN))
            if BN <= 128:  # RoPE's rows (head dims), no reduction: 2 warps (64 wide: forward 0.066
                warps = 2  # -> 0.056 ms, backward 0.079 -> 0.063; 128 wide: 0.110 -> 0.107, 0.120 -> 0.116)
        return dict(BLOCK_M=BM, BLOCK_N=BN, num_warps=warps)
    # interpreter: numpy does the work of a program in one go, and the Python around it costs per
    # program, so blocks are large (32768 elements: RoPE's 32-wide rows 1024 at a time). But numpy
    # sums a column of a block one row after another: where a program sums columns, 8 rows at most
    # keep the per-column gradients as accurate as torch's. Rows are independent otherwise.
    if not sums_columns:
        return dict(BLOCK_M=max(1, 32768 // BN), BLOCK_N=BN)
    BM = max(1, min(_pow2(max(M, 1)), 32768 // BN, 8))
    return dict(BLOCK_M=BM, BLOCK_N=BN)


MAX_PROGRAMS_CPU = 4096


def _programs(n_blocks: int, device: torch.device, N: int = 0, reduces: bool = False) -> int:
    """Backward programs. Each writes one partial row of every per-column gradient; torch adds the
    partial rows (a tree sum), so more programs also means shorter sequential sums."""
    if device.type == "cuda":
        per_sm = (_tuned_column_sums(N, reduces) or (0, 4))[1]
        return max(1, min(n_blocks, per_sm * _sm_count(device.index)))
    return max(1, min(n_blocks, MAX_PROGRAMS_CPU))


@functools.cache
def _sm_count(index) -> int:
    return torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()
    ).multi_processor_count


def _rows(
    shape: torch.Size, tensors: list[torch.Tensor], main: int | None = None
) -> tuple[list[int], list[list[int]], list[torch.Tensor]]:
    """The leading dims of `shape` collapsed to three (D0, D1, D2), with each tensor's strides over
    them (0 where it broadcasts): the kernel reads transposed and broadcast arguments in place. With
    `main`, the rows are walked in the memory order of tensors[main] (the spelling's first full-size
    argument): Hugging Face's q and k are (batch, head, position) views of (batch, position, head)
    memory, so a block of rows is one position's heads, which read one row of cos and sin. Only for
    kernels without row statistics: those are stored by the row's place in the walk, which the
    forward and the backward must then agree on whatever their tensors' strides. Dims merge where every
    tensor is contiguous across them; where more than three remain, the tensors are copied to
    contiguous (correct, slower) -> (sizes, strides, the tensors as passed)."""
    key = (tuple(shape), tuple((tuple(t.shape), t.stride()) for t in tensors), main)
    sizes, strides, copy = _row_plan(key)
    if not copy:
        return sizes, [list(st) for st in strides], tensors
    views = [t.expand(shape).contiguous() for t in tensors]
    return sizes, [list(st) for st in strides], views


@functools.lru_cache(maxsize=8192)
def _row_plan(key) -> tuple[list[int], tuple, bool]:
    """(sizes, per-tensor strides, whether the tensors must be copied to contiguous first), from
    the shape and each tensor's (shape, strides): cached, the launcher runs it on every call."""
    shape, metas, main = key
    n = len(shape) - 1
    for copy in (False, True):
        if copy:
            full = [1] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                full[i] = full[i + 1] * shape[i + 1]
            given = [full for _ in metas]
        else:
            given = [_expanded_strides(shape, s, st) for s, st in metas]
        # the leading dims in the main tensor's memory order, outermost first (stable: ties and
        # contiguous tensors keep their order); if that leaves more than three, the order as given
        memory = range(n) if main is None else sorted(range(n), key=lambda i: -given[main][i])
        for order in dict.fromkeys((tuple(memory), tuple(range(n)))):
            plan = _collapse([shape[i] for i in order], [[st[i] for i in order] + [st[-1]] for st in given])
            if plan is not None:
                return (*plan, copy)
    raise AssertionError("contiguous tensors always collapse")  # pragma: no cover


def _collapse(lead: list[int], expanded: list[list[int]]):
    """Unit dims dropped and dims merged where every tensor is contiguous across them -> (sizes
    padded to three, per-tensor strides over them and the column) or None if more than three remain."""
    keep = [i for i, n in enumerate(lead) if n != 1]
    sizes = [lead[i] for i in keep]
    strides = [[st[i] for i in keep] for st in expanded]
    k = len(sizes) - 1
    while k > 0:
        if all(st[k - 1] == st[k] * sizes[k] for st in strides):
            sizes[k - 1 : k + 1] = [sizes[k - 1] * sizes[k]]
            for st in strides:
                st[k - 1 : k + 1] = [st[k]]
        k -= 1
    if len(sizes) > 3:
        return None
    pad = 3 - len(sizes)
    # each tensor: strides over (D0, D1, D2), then its column stride (0 if it broadcasts there)
    cols = [st[-1] for st in expanded]
    return [1] * pad + sizes, tuple(tuple([0] * pad + st + [c]) for st, c in zip(strides, cols))


def _expanded_strides(shape, tshape, tstride) -> list[int]:
    """The strides of tensor (tshape, tstride) expanded to `shape` (0 on broadcast dims)."""
    off = len(shape) - len(tshape)
    out = []
    for i in range(len(shape)):
        j = i - off
        out.append(0 if j < 0 or (tshape[j] == 1 and shape[i] != 1) else tstride[j])
    return out


def _strided(v: torch.Tensor, st: list[int]) -> list:
    """A tensor's kernel arguments: pointer, strides over (D0, D1, D2), column stride."""
    return [v, *st]


@dataclass
class _Group:
    """One set of per-element tensors in a launch (q, or k), with its own shape."""

    tensors: dict
    lay: Layout


def _groups(spelling, arg_sets: list[tuple]) -> tuple[list[_Group], list[float]]:
    groups, scalars = [], None
    for args in arg_sets:
        tensors, sc = split_args(spelling, args)
        groups.append(_Group(tensors, layout(spelling, tensors)))
        scalars = sc if scalars is None else scalars
    return groups, scalars


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _shareable(groups: list[_Group]) -> bool:
    """One launch serves the groups: the same row length, argument kinds and dtypes, and the very
    same per-column tensors (a launch reads those once)."""
    first = groups[0]
    for g in groups[1:]:
        if g.lay.kinds != first.lay.kinds or g.lay.N != first.lay.N:
            return False
        for n, t in g.tensors.items():
            if t.dtype != first.tensors[n].dtype:
                return False
            if first.lay.kinds[n] == "col" and not _same(t, first.tensors[n]):
                return False
    return True


def _main(reduces: bool, elems: list[torch.Tensor], shape) -> int | None:
    """The index in `elems` of the first full-size one, whose memory order the rows follow; None
    (the order as given) for a kernel with row statistics (see _rows), or where none is full-size."""
    if reduces:
        return None
    return next((i for i, t in enumerate(elems) if tuple(t.shape) == tuple(shape)), None)


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its memory without gaps or overlap, in some order of its dims."""
    expect = 1
    for st, sz in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if st != expect:
            return False
        expect *= sz
    return True


def rows_like(reduces: bool, elems: list[torch.Tensor], shape, dtype: torch.dtype) -> torch.Tensor:
    """An empty output of `shape` (a result, or an element-wise gradient) for a launch whose
    per-element arguments are `elems`: laid out as the one whose memory order the rows are walked
    in (_main) where that tensor is dense (no gaps, no overlap), contiguous otherwise (and for a
    kernel with row statistics). The stores then follow the walk too: Hugging
    Face's q and k are (batch, head, position) views of (batch, position, head) memory, and a
    contiguous output scattered each row of a block to another place (one position's heads are
    `position x head_dim` apart there). Eager PyTorch's element-wise ops keep their input's
    layout the same way. The rule reads only shapes and strides: the fake implementations
    (kernels/ops.py) follow it on fake tensors and give inductor the very strides the launch makes."""
    i = _main(reduces, elems, shape)
    ref = None if i is None else elems[i]
    dev = elems[0].device
    if ref is not None and ref.numel() and _dense(ref):
        return torch.empty_strided(tuple(shape), ref.stride(), dtype=dtype, device=dev)
    return torch.empty(shape, dtype=dtype, device=dev)


def _kernel(spelling, g: _Group, rounding: str) -> RowKernel:
    return row_kernel(spelling, {n: t.dtype for n, t in g.tensors.items()}, g.lay.kinds, rounding)


FLAT_ROWS = (4096, 2048, 1024, 512, 256)


def _flat_rows(k: RowKernel, groups: list[_Group], extra=()) -> int:
    """Row length to re-cut an element-wise op into (0: keep the rows). Done when every tensor is
    contiguous with the full shape and the rows are wider than 4096 or not a power of two (a row of
    14336 padded to 16384 in registers wastes an eighth of the lanes; rows of 4096 waste none)."""
    if len(groups) != 1 or not k.elementwise:
        return 0
    lay = groups[0].lay
    N = lay.N
    if N <= 4096 and N & (N - 1) == 0:
        return 0
    shape = tuple(lay.shape)
    if any(tuple(t.shape) != shape or not t.is_contiguous() for t in [*groups[0].tensors.values(), *extra]):
        return 0
    n = lay.M * N
    return next((c for c in FLAT_ROWS if n % c == 0 and n >= c), 0)


def _recut(spelling, args: tuple, C: int) -> tuple:
    return tuple(a.view(-1, C) if isinstance(a, torch.Tensor) and n in spelling.tensor_names else a
                 for n, a in zip(spelling.arg_names, args))  # fmt: skip


def forward(spelling, args: tuple, rounding: str = "autograd") -> tuple[torch.Tensor, torch.Tensor]:
    """Run the generated forward on `args` (the spelling's arguments in order) -> (out, row stats)."""
    return forward_group(spelling, [args], rounding)[0]


def forward_group(
    spelling, arg_sets: list[tuple], rounding: str = "autograd"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One launch for several argument sets that differ only in their per-element tensors (q and k
    with shared cos, sin) -> [(out, row stats)] per set. Sets that cannot share a launch (other
    shapes, dtypes or per-column tensors) get one launch each: the same numbers."""
    groups, scalars = _groups(spelling, arg_sets)
    if len(groups) > 1 and not _shareable(groups):
        return [forward_group(spelling, [a], rounding)[0] for a in arg_sets]
    if len(groups) not in GROUPS:
        raise ValueError(
            f"{spelling.qualname}: {len(groups)} groups in one launch; generated entries serve {GROUPS}"
        )
    k = _kernel(spelling, groups[0], rounding)
    if (k.spec.name, dev_type(groups)) in FAILED:
        return [_reference_forward(spelling, a, k) for a in arg_sets]
    C = _flat_rows(k, groups)
    if C:
        out, _ = forward_group(spelling, [_recut(spelling, arg_sets[0], C)], rounding)[0]
        shape = groups[0].lay.shape  # no row statistics (no reduction), but their usual shape
        return [(out.view(shape), out.new_empty((*shape[:-1], 1), dtype=torch.float32))]
    first = next(iter(groups[0].tensors.values()))
    dev = first.device
    K = max(len(k.spec.reductions), 1)
    N = groups[0].lay.N
    results, gargs, total_rows = [], [], 0
    for g in groups:
        elems = [g.tensors[n] for n in g.tensors if g.lay.kinds[n] == "elem"]
        out = rows_like(bool(k.spec.reductions), elems, g.lay.shape, k.spec.out_dtype)
        stats = torch.empty((*g.lay.shape[:-1], K), dtype=torch.float32, device=dev)
        results.append((out, stats))
        sizes, strides, views = _rows(
            g.lay.shape, [*elems, out], main=_main(bool(k.spec.reductions), elems, g.lay.shape)
        )
        for v, st in zip(views, strides):
            gargs += _strided(v, st)
        gargs += [stats, g.lay.M if N else 0, sizes[1], sizes[2]]
        total_rows += g.lay.M
    if total_rows == 0 or N == 0:
        return results
    if N > MAX_N:
        raise Unsupported(
            f"rows of {N} elements; generated kernels hold a row of at most {MAX_N} in registers"
        )
    _check_rows(groups)
    shared = []
    for n, t in groups[0].tensors.items():
        if groups[0].lay.kinds[n] == "col":
            v = t.reshape(N)
            shared += [v, v.stride(0)]
    cfg = _config(max(g.lay.M for g in groups), N, dev, sums_columns=False, reduces=bool(k.spec.reductions))
    grid = (sum(_cdiv(g.lay.M, cfg["BLOCK_M"]) for g in groups),)
    try:
        k.fn(_entry("fwd", len(groups)), dev)[grid](
            *shared, *scalars, *gargs, N, float(N), **cfg, **k.options(dev)
        )
    except Unsupported:
        raise
    except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or launch: the stock code runs
        _failed(k, dev, e)
        return [_reference_forward(spelling, a, k) for a in arg_sets]
    return results


def _check_rows(groups: list[_Group]) -> None:
    big = max(g.lay.M for g in groups)
    if big > MAX_ROWS:
        raise Unsupported(f"{big} rows; generated kernels index at most {MAX_ROWS} rows in one tensor")


def _entry(which: str, G: int) -> str:
    return which if G == 1 else f"{which}{G}"


def backward(
    spelling,
    grad: torch.Tensor,
    args: tuple,
    stats: torch.Tensor,
    needs: list[bool],
    rounding: str = "autograd",
) -> list[torch.Tensor]:
    """Gradients of every tensor argument (an empty tensor where `needs` is False)."""
    return backward_group(spelling, [grad], [args], [stats], [needs], rounding)[0]


def backward_with_out(
    spelling, grad: torch.Tensor, args: tuple, needs: list[bool], rounding: str = "autograd"
) -> list[torch.Tensor]:
    """The gradients as `backward` gives them, then the forward's output, made in the same pass over
    the rows (the row statistics too, so none are read): for an output recomputed in the backward."""
    return backward_group(spelling, [grad], [args], [None], [needs], rounding, with_out=True)[0]


def backward_group(
    spelling,
    grads: list[torch.Tensor],
    arg_sets: list[tuple],
    stats: list[torch.Tensor | None],
    needs_per_set: list[list[bool]],
    rounding: str = "autograd",
    with_out: bool = False,
) -> list[list[torch.Tensor]]:
    """Gradients of every tensor argument of each argument set (empty where that set's `needs` is
    False), in one launch when the sets can share one. A per-column argument is then the same
    tensor in every set: its gradient, the sum over all sets, is returned once (in the first set
    that needs it; zeros in the others, so that autograd's sum counts it once). with_out: each
    set's forward output follows its gradients, and `stats` are not read (None)."""
    groups, scalars = _groups(spelling, arg_sets)
    if len(groups) > 1 and not _shareable(groups):
        return [
            backward_group(spelling, [g], [a], [st], [nd], rounding, with_out)[0]
            for g, a, st, nd in zip(grads, arg_sets, stats, needs_per_set)
        ]
    needs = [any(col) for col in zip(*needs_per_set)]
    k = _kernel(spelling, groups[0], rounding)

    def reference():
        res = [
            [
                _laid_out(spelling, a, k, r) if r.numel() and r.shape == gr.lay.shape else r.contiguous()
                for r in _reference_backward(spelling, g, a, nd)
            ]
            for g, a, nd, gr in zip(grads, arg_sets, needs_per_set, groups)
        ]
        if with_out:
            res = [r + [_reference_forward(spelling, a, k)[0]] for r, a in zip(res, arg_sets)]
        return res

    if (k.spec.name, dev_type(groups)) in FAILED:
        return reference()
    C = _flat_rows(k, groups, extra=grads)
    if C:
        res = backward_group(
            spelling,
            [grads[0].view(-1, C)],
            [_recut(spelling, arg_sets[0], C)],
            stats,
            needs_per_set,
            rounding,
            with_out,
        )[0]
        shapes = [t.shape for t in groups[0].tensors.values()] + ([groups[0].lay.shape] if with_out else [])
        return [[r.view(shape) if r.numel() else r for r, shape in zip(res, shapes)]]
    kinds = groups[0].lay.kinds
    names = list(groups[0].tensors)
    N = groups[0].lay.N
    dev = grads[0].device
    # per-column gradients: a bounded number of programs, each summing its rows; none: one per block
    has_cols = any(k == "col" for k in groups[0].lay.kinds.values())
    reduces = bool(k.spec.reductions)
    cfg = _config(max(g.lay.M for g in groups), N, dev, sums_columns=has_cols, reduces=reduces)
    n_blocks = max(1, sum(_cdiv(g.lay.M, cfg["BLOCK_M"]) for g in groups))
    nprog = _programs(n_blocks, dev, N, reduces) if has_cols else n_blocks
    dummy = torch.empty((1, 1), dtype=torch.float32, device=dev)
    col_bufs = {
        n: torch.zeros((nprog, N), dtype=torch.float32, device=dev) if need else dummy
        for n, need in zip(names, needs)
        if kinds[n] == "col"
    }
    elem_bufs, gargs, fwd_outs = [], [], []
    for g, grad, st in zip(groups, grads, stats):
        elems = [g.tensors[n] for n in names if kinds[n] == "elem"]
        bufs = {
            n: rows_like(reduces, elems, g.lay.shape, g.tensors[n].dtype) if need else None
            for n, need in zip(names, needs)
            if kinds[n] == "elem"
        }
        elem_bufs.append(bufs)
        outs = [b for b in bufs.values() if b is not None]
        if with_out:
            fwd_outs.append(rows_like(reduces, elems, g.lay.shape, k.spec.out_dtype))
            outs.append(fwd_outs[-1])
        main = _main(reduces, elems, g.lay.shape)
        sizes, strides, views = _rows(
            g.lay.shape, [grad, *elems, *outs], main=None if main is None else 1 + main
        )
        flat = [_strided(v, s) for v, s in zip(views, strides)]
        gargs += [a for f in flat[: 1 + len(elems)] for a in f] + ([] if with_out else [st])
        done = iter(flat[1 + len(elems) :])
        for b in bufs.values():  # a gradient not needed: a dummy pointer the kernel never writes
            gargs += next(done) if b is not None else [dummy, 0, 0, 0, 0]
        if with_out:
            gargs += next(done)
        gargs += [g.lay.M if N else 0, sizes[1], sizes[2]]
    total_rows = sum(g.lay.M for g in groups)
    if total_rows > 0 and N > 0:
        if N > MAX_N:
            raise Unsupported(f"rows of {N} elements (max {MAX_N})")
        _check_rows(groups)
        shared = []
        for n in names:
            if kinds[n] == "col":
                v = groups[0].tensors[n].reshape(N)
                shared += [v, v.stride(0)]
        shared += scalars
        for n in names:
            if kinds[n] == "col":
                shared += [col_bufs[n], col_bufs[n].stride(0)]
        flags = {f"NEED_{name}": bool(need) for name, need in zip(k.spec.tensors, needs)}
        try:
            k.fn(_entry("bwdo" if with_out else "bwd", len(groups)), dev)[(nprog,)](
                *shared, *gargs, N, float(N), **cfg, **flags, **k.options(dev)
            )
        except Exception as e:  # noqa: BLE001 - as in the forward: the stock code's gradients
            _failed(k, dev, e)
            return reference()
    out = []
    col_grads = {
        n: col_bufs[n].sum(0).to(groups[0].tensors[n].dtype).view(groups[0].tensors[n].shape)
        for n, need in zip(names, needs)
        if kinds[n] == "col" and need
    }
    for g, bufs, own in zip(groups, elem_bufs, needs_per_set):
        res = []
        for n, need in zip(names, own):
            t = g.tensors[n]
            if not need:
                res.append(torch.empty(0, dtype=t.dtype, device=dev))
            elif kinds[n] == "col":
                res.append(col_grads.pop(n) if n in col_grads else torch.zeros_like(t))
            elif tuple(t.shape) == tuple(g.lay.shape):
                res.append(bufs[n])
            else:  # a broadcast argument: its full gradient, summed back to its shape (contiguous, as faked)
                res.append(bufs[n].float().sum_to_size(t.shape).to(t.dtype).contiguous())
        out.append(res)
    if with_out:
        out = [r + [y] for r, y in zip(out, fwd_outs)]
    return out


# ---- a kernel that fails at run time (compile error, out of resources): the stock code instead -----

FAILED: dict = {}  # (kernel name, device type) -> why; see kernelgraft.kernels.failed_kernels()


def dev_type(groups: list[_Group]) -> str:
    return next(iter(groups[0].tensors.values())).device.type


def record_failure(name: str, dev: torch.device, e: Exception, consequence: str) -> None:
    """Record a generated kernel that failed to load, compile or launch (FAILED), and warn once."""
    import warnings

    key = (name, dev.type)
    if key not in FAILED:
        FAILED[key] = f"{type(e).__name__}: {e}"[:500]
        warnings.warn(
            f"kernelgraft: the generated kernel {name} failed on {dev.type} ({FAILED[key][:200]}). "
            f"{consequence}",
            RuntimeWarning,
            stacklevel=4,
        )


def _failed(k: RowKernel, dev: torch.device, e: Exception) -> None:
    record_failure(
        k.spec.name,
        dev,
        e,
        "Its sites run their stock PyTorch code from now on: same numbers as without kernelgraft, "
        f"without the speed-up. Generated source: {k.path}",
    )


def _laid_out(spelling, args: tuple, k: RowKernel, t: torch.Tensor) -> torch.Tensor:
    """t (a full-size output or gradient of the stock code) in the layout the launch would have
    given it (rows_like), which the op's fake implementation declared to inductor."""
    tensors, _ = split_args(spelling, args)
    kinds = layout(spelling, tensors).kinds
    elems = [x for n, x in tensors.items() if kinds[n] == "elem"]
    want = rows_like(bool(k.spec.reductions), elems, t.shape, t.dtype)
    return t if t.stride() == want.stride() else want.copy_(t)


def _reference_forward(spelling, args: tuple, k: RowKernel) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, row stats) from the spelling itself; the stats are unused on this path."""
    with torch.no_grad():
        out = _laid_out(spelling, args, k, spelling.fn(*args))
    K = max(len(k.spec.reductions), 1)
    return out, torch.empty((*out.shape[:-1], K), dtype=torch.float32, device=out.device)


def spelling_vjp(spelling, named: dict, diff: list[str], cotangent) -> tuple[torch.Tensor, dict]:
    """The spelling's output on the named arguments and its gradients for those named in `diff`,
    for the incoming gradient `cotangent(output)`. torch.func.vjp, not autograd: inside a custom
    op's implementation autograd does not record."""

    def f(*ts):
        call = dict(named, **dict(zip(diff, ts)))
        return spelling.fn(*(call[a] for a in spelling.arg_names))

    y, vjp = torch.func.vjp(f, *(named[n].detach() for n in diff))
    return y, dict(zip(diff, vjp(cotangent(y))))


def _reference_backward(spelling, grad: torch.Tensor, args: tuple, needs: list[bool]) -> list[torch.Tensor]:
    """The spelling's own gradients, in the launcher's return layout."""
    names = [n for n in spelling.arg_names if n in spelling.tensor_names]
    named = dict(zip(spelling.arg_names, args))
    diff = [n for n, need in zip(names, needs) if need and named[n].is_floating_point()]
    got = spelling_vjp(spelling, named, diff, lambda y: grad.to(y.dtype))[1] if diff else {}
    out = []
    for n, need in zip(names, needs):
        t = named[n]
        out.append(got.get(n, torch.zeros_like(t)) if need else t.new_empty(0))
    return out


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
