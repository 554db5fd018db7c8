"""How a launch lays out its tensors: which argument is a full tensor and which a per-column parameter
(Layout), the leading dims collapsed to the three the kernels index (D0, D1, D2) with each tensor's
strides over them, the layout of the outputs (rows_like), and which argument sets may share a launch.
Everything here reads shapes and strides only, and is cached: the launcher runs it on every call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from ..spec import halves_of_pairs
from .tuning import flat_rows


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


@functools.cache
def half_width(spelling) -> frozenset:
    """The arguments of a row written as two halves of the pairs' rotation that are half a row wide
    (the angles of DeepSeek's MLA rotation: spec.halves_of_pairs); none for any other spelling."""
    halves = halves_of_pairs(spelling.canonical())
    return frozenset(halves[1]) if halves is not None else frozenset()


def _layout(spelling, shapes: tuple) -> Layout:
    half = half_width(spelling)
    if half:  # read at column // 2: as wide as the row for the broadcast and the kinds
        shapes = tuple((n, (*s[:-1], 2 * s[-1]) if n in half and s else s) for n, s in shapes)
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


# cached per argument shapes: the launcher runs on every call, and its host time counts
_layout_cached = functools.lru_cache(maxsize=4096)(_layout)


def row_plan(
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
    sizes, strides, copy = _plan(key)
    if not copy:
        return sizes, [list(st) for st in strides], tensors
    views = [t.expand(shape).contiguous() for t in tensors]
    return sizes, [list(st) for st in strides], views


@functools.lru_cache(maxsize=8192)
def _plan(key) -> tuple[list[int], tuple, bool]:
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


def strided(v: torch.Tensor, st: list[int]) -> list:
    """A tensor's kernel arguments: pointer, strides over (D0, D1, D2), column stride."""
    return [v, *st]


@dataclass
class Group:
    """One set of per-element tensors in a launch (q, or k), with its own shape."""

    tensors: dict
    lay: Layout


def groups_of(spelling, arg_sets: list[tuple]) -> tuple[list[Group], list[float]]:
    groups, scalars = [], None
    for args in arg_sets:
        tensors, sc = split_args(spelling, args)
        groups.append(Group(tensors, layout(spelling, tensors)))
        scalars = sc if scalars is None else scalars
    return groups, scalars


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The very same values: one object, or (run, not traced) one memory, shape and strides. A
    launch traced for inductor sees fake tensors, where one graph value is one object."""
    if a is b:
        return True
    if is_fake(a) or is_fake(b) or isinstance(a, FunctionalTensor) or isinstance(b, FunctionalTensor):
        return False
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def shareable(groups: list[Group]) -> bool:
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


def main_order(reduces: bool, elems: list[torch.Tensor], shape) -> int | None:
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


def rows_like(
    reduces: bool, elems: list[torch.Tensor], shape, dtype: torch.dtype, fresh: bool = False
) -> torch.Tensor:
    """An empty output of `shape` (a result, or an element-wise gradient) for a launch whose
    per-element arguments are `elems`: laid out as the one whose memory order the rows are walked
    in (main_order) where that tensor is dense (no gaps, no overlap), contiguous otherwise (and for a
    kernel with row statistics, and for a result eager makes contiguous: `fresh`, Spec.fresh_out;
    a graph's output laid out otherwise than eager's costs a copy of its incoming gradient, which
    AOT autograd makes contiguous). The stores then follow the walk too: Hugging
    Face's q and k are (batch, head, position) views of (batch, position, head) memory, and a
    contiguous output scattered each row of a block to another place (one position's heads are
    `position x head_dim` apart there). Eager PyTorch's element-wise ops keep their input's
    layout the same way. The rule reads only shapes and strides: the fake implementations
    (ops.py) follow it on fake tensors and give inductor the very strides the launch makes."""
    i = None if fresh else main_order(reduces, elems, shape)
    ref = None if i is None else elems[i]
    dev = elems[0].device
    if ref is not None and ref.numel() and _dense(ref):
        return torch.empty_strided(tuple(shape), ref.stride(), dtype=dtype, device=dev)
    return torch.empty(shape, dtype=dtype, device=dev)


def flat_cut(elementwise: bool, groups: list[Group], extra=()) -> int:
    """Row length to re-cut an element-wise op into (0: keep the rows). Done when every tensor is
    contiguous with the full shape and the rows are wider than 4096 or not a power of two (a row of
    14336 padded to 16384 in registers wastes an eighth of the lanes; rows of 4096 waste none)."""
    if len(groups) != 1 or not elementwise:
        return 0
    lay = groups[0].lay
    N = lay.N
    if N <= 4096 and N & (N - 1) == 0:
        return 0
    shape = tuple(lay.shape)
    if any(tuple(t.shape) != shape or not t.is_contiguous() for t in [*groups[0].tensors.values(), *extra]):
        return 0
    n = lay.M * N
    return next((c for c in flat_rows() if n % c == 0 and n >= c), 0)


def recut(spelling, args: tuple, C: int) -> tuple:
    return tuple(a.view(-1, C) if isinstance(a, torch.Tensor) and n in spelling.tensor_names else a
                 for n, a in zip(spelling.arg_names, args))  # fmt: skip


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
