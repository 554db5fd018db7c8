"""The sympy side of the IR: functions with their derivative and their Triton spelling side by side,
stabilizing rewrites, and the printer that turns an expression into Triton.

Primitives are sympy Functions rather than sympy's own spellings so that the derivative keeps the
stable form: rsqrt' stays a power of rsqrt, sigmoid' stays s*(1-s) (sympy's naive silu' overflows to
NaN at x=-100 in float32), and a cast's derivative is the identity (autograd passes the gradient
through `.to()`). Each function carries `triton` (a template of its arguments, `{0}`...) and `value`
(the same function in sympy's own terms, for exact constant folding); `function()` makes a new one
from those, which is how a primitive of the table (ir/primitives.py) brings its own.
"""

from __future__ import annotations

import sympy
from sympy.printing.str import StrPrinter

# sympy function name -> Triton template of its printed arguments ({0}, {1}...): filled by the
# functions below, and by the primitives of the table for sympy's own functions (exp, tanh...)
TRITON: dict[str, str] = {}


class KFunction(sympy.Function):
    """A sympy function kernelgraft prints and differentiates itself (see the subclasses)."""

    triton = ""  # Triton template, {0} the printed argument

    @classmethod
    def value(cls, x):
        """The function in sympy's own terms, for evaluating constants exactly."""
        raise NotImplementedError


def function(name: str, *, diff, triton: str, value) -> type[KFunction]:
    """A new one-argument sympy function: `diff(x)` its derivative, `triton` its Triton template,
    `value(x)` its definition in sympy's terms.

    >>> import sympy
    >>> Softplus = function("Softplus", diff=lambda x: 1 / (1 + sympy.exp(-x)),
    ...                     triton="tl.log(1.0 + tl.exp({0}))", value=lambda x: sympy.log(1 + sympy.exp(x)))
    >>> x = sympy.Symbol("x")
    >>> sympy.diff(Softplus(x), x), to_triton(Softplus(x))
    (1/(1 + exp(-x)), 'tl.log(1.0 + tl.exp(x))')
    """

    def fdiff(self, argindex=1):
        return diff(self.args[0])

    cls = type(name, (KFunction,), {"fdiff": fdiff, "triton": triton, "value": classmethod(lambda c, x: value(x))})
    TRITON[name] = triton
    return cls


# 1/sqrt(x) correctly rounded at each step (the generated module's _rsqrt): CUDA's rsqrt instruction
# (tl.rsqrt) is approximate, and a norm's x gradient cancels its terms where the incoming gradient
# is nearly parallel to x: LayerNorm's 1 - rstd^2 var is then about eps / var, so rstd's relative
# error comes back amplified by var / eps, past eager's. It is a row's statistic, computed once per
# row: its cost is not seen beside the row's loads.
RSQRT = "_rsqrt({0})"


class Rsqrt(KFunction):
    """1/sqrt(x).   d/dx = -rsqrt(x)^3 / 2"""

    triton = RSQRT

    def fdiff(self, argindex=1):
        return -(Rsqrt(self.args[0]) ** 3) / 2

    @classmethod
    def value(cls, x):
        return 1 / sympy.sqrt(x)


class Sigmoid(KFunction):
    """1/(1+exp(-x)).   d/dx = s(x) s(-x): finite for every x, and no 1 - s cancellation"""

    triton = "(1.0 / (1.0 + _exp(-({0}))))"  # 1/(1+inf) = 0: finite; _exp: the generated module's

    def fdiff(self, argindex=1):
        return Sigmoid(self.args[0]) * Sigmoid(-self.args[0])

    @classmethod
    def value(cls, x):
        return 1 / (1 + sympy.exp(-x))


class Sech2(KFunction):
    """1 - tanh(x)^2 = 4w / (1 + w)^2 with w = exp(-2|x|): no cancellation where tanh saturates."""

    triton = "_sech2({0})"  # the generated module's helper

    def fdiff(self, argindex=1):
        return -2 * sympy.tanh(self.args[0]) * Sech2(self.args[0])

    @classmethod
    def value(cls, x):
        return 1 - sympy.tanh(x) ** 2


for _f in (Rsqrt, Sigmoid, Sech2):
    TRITON[_f.__name__] = _f.triton


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
    (_a ** sympy.Rational(-1, 2), lambda a: Rsqrt(a), "x^-1/2 -> rsqrt (one function)"),
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
    """sympy -> Triton expressions on float32 blocks. No tensor __pow__: integer powers multiply.
    Functions print from their TRITON template; numbers, powers and the structural pieces here."""

    def _print(self, expr, **kwargs):
        template = TRITON.get(type(expr).__name__) if isinstance(expr, sympy.Function) else None
        if template is not None:
            return template.format(*(self._print(a) for a in expr.args))
        return super()._print(expr, **kwargs)

    def _print_Function(self, f):
        raise NotImplementedError(f"kernelgraft: no Triton spelling for the function {type(f).__name__}")

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
            return RSQRT.format(self._print(b))
        raise NotImplementedError(f"kernelgraft: no Triton spelling for the power {p}")

    def _print_Max(self, f):
        a, b = f.args[0], sympy.Max(*f.args[1:]) if len(f.args) > 2 else f.args[1]
        return f"tl.maximum({self._print(a)}, {self._print(b)})"

    def _print_Min(self, f):
        a, b = f.args[0], sympy.Min(*f.args[1:]) if len(f.args) > 2 else f.args[1]
        return f"tl.minimum({self._print(a)}, {self._print(b)})"

    def _print_Heaviside(self, f):
        at_zero = f.args[1] if len(f.args) > 1 else 0  # H(0): 1 where a tie passes (clamp_min's x >= min)
        return f"tl.where({self._print(f.args[0])} {'>=' if at_zero == 1 else '>'} 0.0, 1.0, 0.0)"

    def _print_RoundBF16(self, f):
        return f"_round_bf16({self._print(f.args[0])})"

    def _print_RoundF16(self, f):
        return f"({self._print(f.args[0])}).to(tl.float16).to(tl.float32)"


def _value(e) -> float | None:
    """A constant expression's value, computed in 40 digits (None if it is not a real number)."""
    if e.has(_Round):
        return None
    for f in {type(a) for a in sympy.preorder_traversal(e) if isinstance(a, KFunction)}:
        e = e.replace(f, f.value)
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
