"""The sympy side: primitives with their derivatives beside them, stabilizing rewrites, and the
printer that turns an expression into Triton.

Primitives are sympy Functions rather than sympy's own spellings so that the derivative keeps the
stable form: rsqrt' stays a power of rsqrt, sigmoid' stays s*(1-s) (sympy's naive silu' overflows to
NaN at x=-100 in float32), and a cast's derivative is the identity (autograd passes the gradient
through `.to()`).
"""

from __future__ import annotations

import sympy
from sympy.printing.str import StrPrinter


class Rsqrt(sympy.Function):
    """1/sqrt(x).   d/dx = -rsqrt(x)^3 / 2"""

    def fdiff(self, argindex=1):
        return -(Rsqrt(self.args[0]) ** 3) / 2


class Sigmoid(sympy.Function):
    """1/(1+exp(-x)).   d/dx = s(x) s(-x): finite for every x, and no 1 - s cancellation"""

    def fdiff(self, argindex=1):
        return Sigmoid(self.args[0]) * Sigmoid(-self.args[0])


class Sech2(sympy.Function):
    """1 - tanh(x)^2 = 4w / (1 + w)^2 with w = exp(-2|x|): no cancellation where tanh saturates."""

    def fdiff(self, argindex=1):
        return -2 * sympy.tanh(self.args[0]) * Sech2(self.args[0])


class _Round(sympy.Function):
    """Round to a narrower float and back: where the reference stores an intermediate in that dtype.
    d/dx = 1: autograd passes the gradient through the cast."""

    triton_dtype = ""

    def fdiff(self, argindex=1):
        return sympy.S.One

    @classmethod
    def eval(cls, x):
        if isinstance(x, cls):  # rounding twice to one dtype is rounding once
            return x
        return None


class RoundBF16(_Round):
    triton_dtype = "tl.bfloat16"


class RoundF16(_Round):
    triton_dtype = "tl.float16"


def round_to(expr, dtype_name: str):
    """The value of `expr` after a store in dtype `dtype_name` ('bfloat16', 'float16', 'float32')."""
    if dtype_name == "bfloat16":
        return RoundBF16(expr)
    if dtype_name == "float16":
        return RoundF16(expr)
    return expr


# ---- stabilizing rewrites: (what, into, why). Applied to forward and derived expressions. ------
_a = sympy.Wild("a")
STABILIZE = [
    (1 / (1 + sympy.exp(-_a)), lambda a: Sigmoid(a), "1/(1+e^-x) overflows for x << 0; sigmoid does not"),
    (sympy.exp(-_a) / (1 + sympy.exp(-_a)) ** 2, lambda a: Sigmoid(a) * (1 - Sigmoid(a)), "sympy's sigmoid'"),
    (_a ** sympy.Rational(-1, 2), lambda a: Rsqrt(a), "x^-1/2 -> rsqrt (one instruction)"),
    (
        _a ** sympy.Rational(-3, 2),
        lambda a: Rsqrt(a) ** 3,
        "x^-3/2 -> rsqrt^3, shares rsqrt with the forward",
    ),
]


def stabilize(expr):
    for what, into, _why in STABILIZE:
        expr = expr.replace(what, into)
    return expr


class TritonPrinter(StrPrinter):
    """sympy -> Triton expressions on float32 blocks. No tensor __pow__: integer powers multiply."""

    def _print_Symbol(self, s):
        return s.name

    def _print_Integer(self, n):
        return f"{float(n)!r}"

    def _print_Rational(self, r):
        return f"{float(r)!r}"

    def _print_Float(self, f):
        return f"{float(f)!r}"

    def _print_Half(self, h):
        return "0.5"

    def _print_NegativeOne(self, n):
        return "-1.0"

    def _print_One(self, n):
        return "1.0"

    def _print_Zero(self, n):
        return "0.0"

    def _print_Pow(self, p, rational=False):
        b, e = p.args
        base = self.parenthesize(b, 1000)
        if e.is_Integer:
            k = int(e)
            prod = " * ".join([base] * abs(k))
            return f"({prod})" if k > 0 else f"(1.0 / ({prod}))"
        if e == sympy.S.Half:
            return f"tl.sqrt({self._print(b)})"
        if e == -sympy.S.Half:
            return f"tl.rsqrt({self._print(b)})"
        raise NotImplementedError(f"kernelgraft: no Triton spelling for the power {p}")

    def _print_Rsqrt(self, f):
        return f"tl.rsqrt({self._print(f.args[0])})"

    def _print_Sigmoid(self, f):
        return f"(1.0 / (1.0 + tl.exp(-({self._print(f.args[0])}))))"  # 1/(1+inf) = 0: finite

    def _print_exp(self, f):
        return f"tl.exp({self._print(f.args[0])})"

    def _print_log(self, f):
        return f"tl.log({self._print(f.args[0])})"

    def _print_tanh(self, f):  # the generated module's _tanh: accurate near 0, on CUDA and in the interpreter
        return f"_tanh({self._print(f.args[0])})"

    def _print_Sech2(self, f):
        return f"_sech2({self._print(f.args[0])})"

    def _print_erf(self, f):
        return f"tl.erf({self._print(f.args[0])})"

    def _print_Max(self, f):
        a, b = f.args[0], sympy.Max(*f.args[1:]) if len(f.args) > 2 else f.args[1]
        return f"tl.maximum({self._print(a)}, {self._print(b)})"

    def _print_Heaviside(self, f):
        return f"tl.where({self._print(f.args[0])} > 0.0, 1.0, 0.0)"

    def _print_RoundBF16(self, f):
        return f"_round_bf16({self._print(f.args[0])})"

    def _print_RoundF16(self, f):
        return f"({self._print(f.args[0])}).to(tl.float16).to(tl.float32)"


def _value(e) -> float | None:
    """A constant expression's value, computed in 40 digits (None if it is not a real number)."""
    if e.has(_Round):
        return None
    e = e.replace(Rsqrt, lambda a: 1 / sympy.sqrt(a)).replace(Sigmoid, lambda a: 1 / (1 + sympy.exp(-a)))
    e = e.replace(Sech2, lambda a: 1 - sympy.tanh(a) ** 2)
    v = e.evalf(40)
    return float(v) if v.is_real and v.is_Float else None


def fold_constants(e):
    """Every constant factor of a product as one float literal, from its exact value: 2*sqrt(2) *
    pi^(-1/2) becomes 1.5957691216057308, and Rsqrt(pi) the same float as pi^(-1/2). The forward
    and the backward then evaluate a value both hold (tanh-GELU's argument) with the same float32
    operations, so both round it the same way; three separately rounded constants would not."""
    if not isinstance(e, sympy.Expr) or e.is_Atom:
        return e
    if e.is_number and not e.is_Rational:
        v = _value(e)
        if v is not None:
            return sympy.Float(v)
    args = [fold_constants(a) for a in e.args]
    if isinstance(e, sympy.Mul):
        nums = [a for a in args if a.is_number]
        rest = [a for a in args if not a.is_number]
        if nums and rest and (len(nums) > 1 or not nums[0].is_Rational):
            v = _value(sympy.Mul(*nums))
            if v is not None:
                return sympy.Mul(sympy.Float(v), *rest, evaluate=False)
    return e.func(*args)


def to_triton(expr) -> str:
    # constants such as sqrt(2/pi) become float literals: Triton has no tl.sqrt of a Python float
    numbers = {
        a: sympy.Float(float(a))
        for a in sympy.preorder_traversal(expr)
        if isinstance(a, sympy.Expr) and a.is_number and a.is_real and not a.is_Rational and not a.is_Float
    }
    return TritonPrinter().doprint(expr.xreplace(numbers) if numbers else expr)
