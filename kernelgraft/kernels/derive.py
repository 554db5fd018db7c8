"""The backward, derived: reverse-mode over one row, sympy.diff for the pointwise parts and two hand
rules for the reductions, written next to each other:

    y_j = f(x_j, w_j, r_0..r_K)          r_k = c_k * sum_j s_k(x_j, w_j, r_0..r_{k-1}),  c_k = 1/N (mean) or 1
    A_k = dL/dr_k = sum_j [ g_j * df/dr_k + sum_{m>k} A_m * c_m * ds_m/dr_k ]     (adjoint of a sum: a sum)
    dL/dx_j = g_j * df/dx_j + sum_k A_k * c_k * ds_k/dx_j                         (adjoint of a sum: broadcast)
    dL/dw_j = sum over rows of the same expression for w                         (per-column parameter: column sum)

Forward intermediates are recomputed from the saved inputs and row statistics r_k, not stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from .spec import Spec
from .sym import stabilize


@dataclass
class Backward:
    grad: sympy.Symbol  # g_j, the incoming gradient of the output
    adjoints: list[tuple[sympy.Symbol, sympy.Expr]]  # (A_k, summand over j), in the order to compute them
    grads: dict[str, sympy.Expr]  # tensor name -> per-element gradient (column-summed for 'col' kinds)


def derive(spec: Spec) -> Backward:
    g = sympy.Symbol("g")
    f = spec.output
    A = {}
    for k in reversed(range(len(spec.reductions))):
        r = spec.reductions[k].symbol
        summand = g * sympy.diff(f, r)
        for m in range(k + 1, len(spec.reductions)):
            red = spec.reductions[m]
            c = 1 / spec.N if red.mean else 1
            summand += A[m] * c * sympy.diff(red.summand, r)
        A[k] = (sympy.Symbol(f"A{k}"), stabilize(summand))
    grads = {}
    for name in spec.tensors:
        x = spec.symbols[name]
        e = g * sympy.diff(f, x)
        for k, red in enumerate(spec.reductions):
            c = 1 / spec.N if red.mean else 1
            e += A[k][0] * c * sympy.diff(red.summand, x)
        grads[name] = stabilize(e)
    adj = [A[k] for k in reversed(range(len(spec.reductions)))]
    return Backward(g, adj, grads)
