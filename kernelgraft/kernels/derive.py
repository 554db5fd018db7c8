"""The backward, derived: reverse mode over the spelling's values, each local derivative from
sympy.diff, and the adjoints of reductions and broadcasts written next to the forward they invert:

    r = c * sum_j s_j   (c = 1/N for mean)      ->  ds_j += c * dr           (adjoint of a sum: broadcast)
    z_j = f(a, ...), a one value per row        ->  da  = sum_j dz_j df/da   (adjoint of a broadcast: sum)
    z_j = f(w_j, ...), w one value per column   ->  dw_j = sum over rows     (column sum, in the launcher)

With rounding="autograd" it rounds where autograd rounds: the gradient of a value held in bf16/fp16
is itself held in that dtype (each op's backward computes in its output dtype, and `.to()` casts the
gradient back), so the kernel's gradients follow the eager model's rounding path. With
rounding="fused" (under inductor, whose fused backward keeps float32 between loads and stores)
only the stored gradients are rounded.
Forward values are recomputed from the saved inputs and row statistics r_k, not stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir import PRIMITIVES, Local
from ..ir.sym import round_to, stabilize
from .spec import LOW, SGN, Spec, permuted


@dataclass
class Backward:
    grad: sympy.Symbol  # g_j, the incoming gradient of the output
    adjoints: list[tuple[sympy.Symbol, sympy.Expr]]  # (A_k, summand over j), in the order to compute them
    grads: dict[str, sympy.Expr]  # tensor name -> per-element gradient (column-summed for 'col' kinds)


def _round_any(e, dt):
    return round_to(e, LOW.get(dt, "float32")) if dt is not None else e


def _permute(e, spec: Spec):
    """e evaluated at the rotated column: every per-element/per-column symbol read there instead
    (row values and scalars stay), and the sign flips."""
    movable = set(spec.tensors) | {"g"}
    subs = {s: permuted(s) for s in e.free_symbols if s.name.removesuffix("__p") in movable}
    subs[SGN] = -SGN
    return e.xreplace(subs)


def _local_derivatives(n, device: str = "cpu") -> list:
    """d(n)/d(input_i), as expressions in the inputs' values (the rounding of n itself has d = 1):
    the primitive's own rule where it has one (ir/primitives.py: PyTorch differentiates tanh,
    sigmoid and exp from their saved output), else sympy.diff of its forward. device: whose eager
    kernels' rounding to reproduce where they differ (tanh's backward in bf16/fp16)."""
    if n.reduce is not None:
        return [None]  # handled as the adjoint of a sum
    prim = PRIMITIVES.get(n.op)  # None for a cast (identity)
    if prim is not None and prim.derivative is not None:
        return prim.derivative(_local(n, device))
    us = [sympy.Dummy(f"u{i}") for i in range(len(n.inputs))]
    f = n.local(*us)
    subs = {u: i.value for u, i in zip(us, n.inputs)}
    return [sympy.diff(f, u).subs(subs) for u in us]


def _local(n, device: str, grad=None) -> Local:
    return Local(tuple(i.value for i in n.inputs), n.value, LOW.get(n.dtype), device, grad)


def _received(n, G, device: str, fused: bool) -> list:
    """The gradient each of n's inputs receives from n's gradient G: G times the local derivative,
    or, where autograd's kernel on `device` rounds between G and the derivative (a primitive's
    `gradient` rule: sigmoid in bf16/fp16), that rounding. Fused rounding keeps neither."""
    prim = PRIMITIVES.get(n.op)
    if not fused and prim is not None and prim.gradient is not None:
        whole = prim.gradient(_local(n, device, G))
        if whole is not None:
            return whole
    return [G * d for d in _local_derivatives(n, device)]


def derive(spec: Spec, device: str = "cpu") -> Backward:
    """device: 'cuda' reproduces CUDA eager's rounding where it differs from the CPU's (the
    backward of tanh and of sigmoid in bf16/fp16); with rounding='fused' it changes nothing."""
    g = sympy.Symbol("g")
    fused = spec.rounding == "fused"

    def _round(e, dt):
        return e if fused else _round_any(e, dt)

    contrib: dict = {id(spec.nodes[-1]): [(g, "elem")]}
    adjoints: list = []
    grads: dict = {}
    n_adj = 0
    for n in reversed(spec.nodes):
        parts = contrib.pop(id(n), None)
        if not parts or n.level == "scalar":
            continue
        if n.level == "row":  # contributions from per-element users are summed along the row
            elem = [p for p, lvl in parts if lvl == "elem"]
            rest = [p for p, lvl in parts if lvl != "elem"]
            total = sympy.Add(*rest)
            if elem:
                A = sympy.Symbol(f"A{n_adj}")
                n_adj += 1
                adjoints.append((A, stabilize(sympy.Add(*elem))))
                total += A
            G = _round(total, n.dtype)
        elif n is spec.nodes[-1]:
            G = g
        else:
            total = sympy.Add(*(p for p, _ in parts))
            G = total if n.level == "col" else _round(total, n.dtype)  # col: rounded after the column sum
        if not n.inputs:  # a tensor argument
            grads[f"v_{n.name}"] = stabilize(G)
            continue
        if n.permuted:  # adjoint of the half-rotation: rotate the other way (by -theta)
            (x,) = n.inputs
            contrib.setdefault(id(x), []).append((-SGN * _permute(G, spec), n.level))
            continue
        if n.reduce is not None:
            (s,) = n.inputs
            c = G / spec.N if n.reduce == "mean" else G
            contrib.setdefault(id(s), []).append((_round(c, n.dtype), "row"))
            continue
        for inp, c in zip(n.inputs, _received(n, G, "cpu" if fused else device, fused)):
            if inp.level == "scalar" or c == 0:
                continue
            if n.level != "col":
                c = _round(c, n.dtype)
                if inp.level == n.level:
                    # then cast to the input's dtype: autograd hands an input of the op's shape a
                    # gradient of its own dtype (a cast's backward, a promoted op's) before summing
                    # it with the input's other gradients; a broadcast input's gradient is summed
                    # over the broadcast dims first, then cast (the row and column sums round it)
                    c = _round(c, inp.dtype)
            contrib.setdefault(id(inp), []).append((c, n.level))
    for name in spec.tensors:
        grads.setdefault(name, sympy.S.Zero)
    return Backward(g, adjoints, grads)
