"""Indexing and views as the canonicalizer reads them: the halves and the (even, odd) pairs of a row,
a slice of the leading dims, and the view algebra (a view to the same shape, or one that merges the
leading dims and keeps the last: the same rows).

A row split in two (x[..., :h] and x[..., h:], chunk(2, -1), split, tensor_split) is two `half`
nodes, part 0 and 1, wherever the parts are as wide or differ by one column (an odd width: 8 and 7
of 15 for chunk, 7 and 8 for slices at 15 // 2). At an odd width each half also records the first
part's width (`first`): no pattern's halves carry it, so only a rotation reading both halves of one
split (rewritten to rotate_half, which keeps no width) still matches, and the kernels then refuse
the odd width (kernels/spec.py, halves_refusal) instead of reading two equal halves that are not."""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .graph import CNode
from .primitives import PRIMITIVES


def half_of(b, n, x: CNode, index) -> CNode | None:
    """x[..., :D/2] or x[..., D/2:] -> half(x, part). D/2 is `x.shape[-1] // 2` in a pattern and a
    number in a model graph, checked against the recorded last dim."""
    if not (
        isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)
    ):
        return None
    s = index[1]
    if s.step not in (None, 1):
        return None
    bound, part = (s.stop, 0) if s.start in (None, 0) else (s.start, 1)
    if isinstance(bound, torch.fx.Node):
        bound = b.of_fx.get(bound)
    if part == 1 and s.stop is not None:
        return None
    attrs = (("part", part),)
    if isinstance(bound, CNode):
        ok = bound.op == "half_dim" and bound.args[0] is x
    else:
        meta = x.meta
        ok = isinstance(bound, int) and meta is not None and meta.shape[-1] == 2 * bound
        if not ok and isinstance(bound, int) and meta is not None and meta.dim():
            width = static_int(meta.shape[-1])
            if width is not None and abs(width - 2 * bound) == 1:  # an odd width, split at its middle
                ok, attrs = True, (*attrs, ("first", bound))
    return b.new("half", (x,), attrs, fx=n) if ok else None


def static_int(v) -> int | None:
    """v as an int where it is one (a size dynamo recorded, or a symbol fixed to a number), else None."""
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt) and is_concrete_int(v):
        return int(v)
    return None


_SPLITS = {"chunk": "chunk", torch.chunk: "chunk", "split": "split", torch.split: "split"}
_SPLITS |= {"tensor_split": "tensor_split", torch.tensor_split: "tensor_split"}


def split_in_two(b, n, target, args, kwargs) -> CNode | None:
    """x.chunk(2, -1), x.tensor_split(2, -1), x.split(h, -1) or x.split([h, D - h], -1) (methods or
    torch functions) -> chunk2(x), whose getitem 0 and 1 are half(x, part). In a model graph the parts
    dynamo recorded decide: two, as wide or one column apart (an odd width: `first`, the first
    part's width, on the node; see the module's docstring); with a symbolic width, chunk and
    tensor_split, whose parts are the two halves at every width. In a traced pattern: chunk and
    tensor_split into 2, or split at `x.shape[-1] // 2`."""
    kind = _SPLITS.get(target)
    if kind is None or not args or not isinstance(args[0], CNode):
        return None
    x = args[0]
    sections = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("split_size"))
    if kind != "split" and len(args) <= 1:
        sections = kwargs.get("chunks", kwargs.get("sections", kwargs.get("indices")))
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    meta = x.meta
    if not (dim == -1 or (meta is not None and isinstance(dim, int) and dim == meta.dim() - 1)):
        return None
    if isinstance(sections, list):
        sections = tuple(sections)
    halving = isinstance(sections, CNode) and sections.op == "half_dim" and sections.args[0] is x
    if meta is None:  # a traced pattern: the halves of any width it will meet
        ok = (kind != "split" and sections == 2) or (kind == "split" and halving)
        return b.new("chunk2", (x,), fx=n) if ok else None
    parts = n.meta.get("example_value")
    if not isinstance(parts, (tuple, list)) or len(parts) != 2:
        return None
    if not all(isinstance(p, torch.Tensor) for p in parts):
        return None
    w0, w1 = (static_int(p.shape[-1]) if p.dim() else None for p in parts)
    if w0 is None or w1 is None:  # a symbolic width: the parts are the halves only by their definition
        ok = (kind != "split" and sections == 2) or halving
        return b.new("chunk2", (x,), fx=n) if ok else None
    if w0 == w1:
        return b.new("chunk2", (x,), fx=n)
    if abs(w0 - w1) == 1:
        return b.new("chunk2", (x,), (("first", w0),), fx=n)
    return None


def pairs_of(b, n, x: CNode, index) -> CNode | None:
    """x[..., ::2] or x[..., 1::2] (also spelled with a full slice per leading dim:
    x[:, :, :, ::2]) -> pairs(x, part): the even or the odd columns of each row."""
    if not isinstance(x, CNode) or not isinstance(index, tuple) or not index:
        return None
    last = index[-1]
    lead = index[:-1]
    if (
        not isinstance(last, slice)
        or last.step != 2
        or last.stop is not None
        or last.start not in (None, 0, 1)
    ):
        return None
    if lead == (Ellipsis,):
        ok = True
    else:
        meta = x.meta
        ok = (
            meta is not None
            and len(index) == meta.dim()
            and all(isinstance(s, slice) and s == slice(None) for s in lead)
        )
    if not ok:
        return None
    return b.new("pairs", (x,), (("part", 1 if last.start == 1 else 0),), fx=n)


def row_index(x: CNode, index) -> tuple | None:
    """x[index] where the index takes a slice of the leading dims and the whole last dim (a training
    loop's shift, logits[:, :-1]): the index with the Ellipsis spelled out, as a tuple of slices over
    all but the last dim; None for any other index."""
    meta = x.meta
    if not isinstance(meta, torch.Tensor) or meta.dim() < 2:
        return None
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) > 1 or not all(isinstance(i, slice) or i is Ellipsis for i in index):
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (meta.dim() - len(index) + 1) + index[at + 1 :]
    index = index + (slice(None),) * (meta.dim() - len(index))
    bounds_ok = all(isinstance(v, int) or v is None for s in index for v in (s.start, s.stop, s.step))
    if len(index) != meta.dim() or index[-1] != slice(None) or not bounds_ok:
        return None
    lead = index[:-1]
    return None if all(s == slice(None) for s in lead) else lead


VIEWS = frozenset({"view", "reshape", torch.reshape, "flatten", torch.flatten})


def view_kind(n: torch.fx.Node, args, kwargs) -> str | None:
    """The view algebra: "identity" (the same shape), "rows" (the leading dims merged into one, the
    last dim kept: a row-wise op sees the same rows), "units" (size-1 dims before the last added or
    taken away: a norm over one group of a row, `x.view(*lead, 1, n)`; the same rows, for the ops
    that read only the last dim), or None (any other view, kept as it is).
    x.view(-1, x.shape[-1]) in a traced pattern is rows; in a model graph the shapes dynamo
    recorded decide, however the view is spelled (view, reshape, flatten, -1 or sizes)."""
    x = args[0]
    if n.target in ("flatten", torch.flatten):
        if len(args) > 1 and isinstance(args[1], CNode) or any(isinstance(v, CNode) for v in kwargs.values()):
            return None
    else:
        shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        if len(shape) == 2 and shape[0] == -1 and isinstance(shape[1], CNode):  # a traced pattern
            return "rows" if shape[1].op == "last_dim" and shape[1].args[0] is x else None
        if any(isinstance(d, CNode) for d in shape):
            return None
    src, out = x.meta, n.meta.get("example_value")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    if tuple(out.shape) == tuple(src.shape):
        return "identity"
    if src.dim() >= 2 and out.dim() == 2 and out.shape[-1] == src.shape[-1]:
        return "rows"
    if out.shape[-1] == src.shape[-1] and _without_units(src.shape) == _without_units(out.shape):
        return "units"  # size-1 dims before the last added or taken away: the same rows
    return None


def _without_units(shape) -> tuple:
    return tuple(d for d in shape[:-1] if d != 1) + (shape[-1],)


_CASTS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16", "double"})


def _shape(a):
    v = a.meta.get("example_value") if isinstance(a, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def units_read_by_rows(n: torch.fx.Node, limit: int = 64) -> bool:
    """Whether a "units" view (view_kind) may stand for its input: every op that reads it, and
    theirs, up to the next view, reads only along the last dim - element-wise ops and casts, whose
    other tensors broadcast along the rows or have the same leading dims, and reductions over the
    last dim only. Where one does more (a reduction or transpose over another dim, a matmul, an
    output), the view stays as it is: the ranks differ, and another dim would name another axis."""
    seen, todo = set(), [n]
    while todo:
        m = todo.pop()
        shape = _shape(m)
        if shape is None:
            return False
        for u in m.users:
            if u in seen:
                continue
            seen.add(u)
            if len(seen) > limit or u.op != "call_function" and u.op != "call_method":
                return False
            if u.target in VIEWS:
                continue  # its own kind decides
            if u.op == "call_method" and u.target in _CASTS:
                todo.append(u)
                continue
            prim = PRIMITIVES.of_target(u.target)  # the table's ops: element-wise, or a reduction
            if prim is None:
                return False
            if prim.kind == "reduction":
                dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
                dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
                if len(dims) != 1 or dims[0] not in (-1, len(shape) - 1):
                    return False
            for other in [*u.args, *u.kwargs.values()]:
                o = _shape(other) if other is not m else None
                if o is not None and not (
                    all(d == 1 for d in o[:-1]) or (len(o) == len(shape) and o[:-1] == shape[:-1])
                ):
                    return False
            todo.append(u)
    return True
