"""Indexing and views as the canonicalizer reads them: the halves and the (even, odd) pairs of a row,
a slice of the leading dims, and the view algebra (a view to the same shape, or one that merges the
leading dims and keeps the last: the same rows)."""

from __future__ import annotations

import torch

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
    if isinstance(bound, CNode):
        ok = bound.op == "half_dim" and bound.args[0] is x
    else:
        meta = x.meta
        ok = isinstance(bound, int) and meta is not None and meta.shape[-1] == 2 * bound
    return b.new("half", (x,), (("part", part),), fx=n) if ok else None


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
