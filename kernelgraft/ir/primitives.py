"""The table of primitives: every math op kernelgraft understands, in one place.

An entry says how PyTorch spells the op (functions and method names the canonicalizer maps to it),
what it computes on one element (a sympy expression of its inputs), how its derivative is taken
where autograd does not simply differentiate that expression, and how it prints in Triton. Adding a
primitive is one entry:

    PRIMITIVES.add(Primitive("softplus", (F.softplus,),
                             forward=function("Softplus", diff=Sigmoid, triton="...", value=...)))

canonicalize (spellings, kinds), the matcher (commutativity), the near-miss report (`generic`), the
row kernels' spec and backward (forward, derivative) and the Triton printer (`triton`) all read it.
Structural ops (casts, views, halves, concatenation, linear, cross_entropy) are lowered by
canonicalize.py itself: they carry layout, not arithmetic.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import sympy
import torch
import torch.nn.functional as F

from .sym import TRITON, Rsqrt, Sech2, Sigmoid, function, round_to

__all__ = ["PRIMITIVES", "Local", "Primitive", "Table", "function"]


@dataclass(frozen=True)
class Local:
    """What a derivative rule sees of one value: its inputs' sympy values, its own value y, the
    narrow dtype it is held in ('bfloat16' | 'float16', None for float32), and whose eager kernels'
    rounding to reproduce ('cpu' | 'cuda')."""

    inputs: tuple
    y: object
    low: str | None
    device: str
    grad: object = None  # the incoming gradient (held in the value's dtype), for `gradient` rules


@dataclass(frozen=True, eq=False)
class Primitive:
    name: str  # the canonical op
    spellings: tuple = ()  # torch functions and Tensor method names that spell it
    kind: str = "unary"  # "unary" | "binary" | "reduction"
    # one element's value from its inputs' sympy values (keyword arguments: `attrs`); None: the
    # op has no element-wise kernel form (the generator refuses it, reported)
    forward: Callable | None = None
    # Local -> [d y / d input_i] where autograd's rule is not sympy.diff of `forward` (PyTorch
    # differentiates tanh and sigmoid from their saved output); None: sympy.diff
    derivative: Callable | None = None
    # Local -> [the gradient each input receives] where autograd's kernel rounds between the
    # incoming gradient and the derivative (CUDA's sigmoid_backward in bf16/fp16); None, or None
    # returned: the incoming gradient times `derivative`, rounded once
    gradient: Callable | None = None
    triton: str = ""  # Triton template of `forward`'s sympy function, where sympy has it ({0}: argument)
    commutative: bool = False  # operands match in either order
    generic: bool = False  # common arithmetic: a near miss that differs only here says nothing
    attrs: tuple = ()  # (keyword, default) options of the call that are part of the math (gelu's approximate)
    # keyword arguments the canonical form assumes: (keyword, value, opaque name if it differs)
    requires: tuple = ()
    mean: bool = False  # a reduction that divides by the row length

    def __post_init__(self):
        if self.triton:
            fn = getattr(self.forward, "__name__", None)
            if fn is None:
                raise TypeError(f"primitive {self.name}: `triton` needs a sympy function as `forward`")
            TRITON[fn] = self.triton


@dataclass
class Table:
    """Primitives by canonical op, and the torch spellings that reach them."""

    by_name: dict[str, Primitive] = field(default_factory=dict)
    by_target: dict = field(default_factory=dict)

    def add(self, p: Primitive) -> Primitive:
        self.by_name[p.name] = p
        for t in p.spellings:
            self.by_target[t] = p
        return p

    def remove(self, name: str) -> None:
        p = self.by_name.pop(name)
        for t in p.spellings:
            if self.by_target.get(t) is p:
                del self.by_target[t]

    def __getitem__(self, name: str) -> Primitive:
        return self.by_name[name]

    def get(self, name: str) -> Primitive | None:
        return self.by_name.get(name)

    def of_target(self, target) -> Primitive | None:
        """The primitive a torch function or method name spells (None: not a primitive)."""
        try:
            return self.by_target.get(target)
        except TypeError:  # an unhashable target
            return None

    def names(self, kind: str | None = None) -> frozenset:
        return frozenset(n for n, p in self.by_name.items() if kind is None or p.kind == kind)


# ---- derivative rules that follow autograd rather than the math ----------------------------------


def _tanh_derivative(n: Local) -> list:
    """From the saved output where it is held in bf16/fp16, as PyTorch does; in float32 without the
    1 - y^2 cancellation (more accurate where tanh saturates)."""
    (x,) = n.inputs
    if n.low is None:
        return [Sech2(x)]
    if n.device == "cuda":
        # CUDA's tanh_backward for bf16/fp16 is `a * (scalar_t{1.} - b * b)` in c10's 2-byte
        # arithmetic: y*y and 1 - y*y are each rounded to the dtype (the CPU's vectorized kernel
        # computes in float32 and rounds once): a softcap's gradient differs from eager's otherwise.
        return [round_to(1 - round_to(n.y**2, n.low), n.low)]
    return [1 - n.y**2]


def _sigmoid_gradient(n: Local) -> list | None:
    """sigmoid_backward(a, y) = a * (1 - y) * y as PyTorch's kernels round it: CUDA's, for bf16 and
    fp16, in c10's 2-byte arithmetic (`a * (scalar_t(1.) - b) * b`: 1 - y, its product with the
    incoming gradient a, and that times y each rounded to the dtype); the CPU's the same way for
    fp16, and in float32, rounded once, for bf16 (torch 2.13, element by element): GPT-OSS's clamped
    SwiGLU in bf16 differs from eager's otherwise."""
    if n.low is None or (n.device != "cuda" and n.low != "float16"):
        return None
    return [round_to(round_to(n.grad * round_to(1 - n.y, n.low), n.low) * n.y, n.low)]


_SQRT_2_OVER_PI = sympy.sqrt(2 / sympy.pi)


def _gelu(a, approximate="none"):
    """As torch defines it (torch.nn.functional.gelu); None for an approximation it does not have."""
    if approximate == "none":
        return a / 2 * (1 + sympy.erf(a / sympy.sqrt(2)))
    if approximate == "tanh":
        # x/2 (1 + tanh z) == x sigmoid(2z): the same function without the 1 + tanh cancellation at x << 0
        return a * Sigmoid(2 * _SQRT_2_OVER_PI * (a + sympy.Rational(44715, 1000000) * a**3))
    return None


PRIMITIVES = Table()
for _p in (
    # arithmetic
    Primitive("add", (operator.add, torch.add, "add", "__add__", "__radd__"), "binary", lambda a, b: a + b,
              commutative=True, generic=True, requires=(("alpha", 1, "add_alpha"),)),
    Primitive("sub", (operator.sub, torch.sub, "sub", "__sub__"), "binary", lambda a, b: a - b,
              generic=True, requires=(("alpha", 1, "sub_alpha"),)),
    Primitive("mul", (operator.mul, torch.mul, "mul", "__mul__", "__rmul__"), "binary", lambda a, b: a * b,
              commutative=True, generic=True),
    Primitive("div", (operator.truediv, torch.div, torch.true_divide, "div", "true_divide", "__truediv__"),
              "binary", lambda a, b: a / b, generic=True, requires=(("rounding_mode", None, "div_rounding"),)),
    Primitive("neg", (operator.neg, torch.neg, "neg", "__neg__"), forward=lambda a: -a, generic=True),
    Primitive("pow", (operator.pow, torch.pow, "pow", "__pow__"), "binary"),  # x^2, x^0.5...: rewrite rules
    Primitive("square", (torch.square, "square"), forward=lambda a: a**2),
    Primitive("sqrt", (torch.sqrt, "sqrt"), forward=sympy.sqrt),
    Primitive("rsqrt", (torch.rsqrt, "rsqrt"), forward=Rsqrt),
    Primitive("reciprocal", (torch.reciprocal, "reciprocal"), forward=lambda a: 1 / a),
    # transcendental: PyTorch's backward of exp, sigmoid and tanh reads the saved output y
    Primitive("exp", (torch.exp, "exp"), forward=sympy.exp, derivative=lambda n: [n.y], triton="tl.exp({0})"),
    Primitive("log", (torch.log, "log"), forward=sympy.log, triton="tl.log({0})"),
    # the generated module's _tanh: accurate near 0, on CUDA and in the interpreter
    Primitive("tanh", (torch.tanh, F.tanh, "tanh"), forward=sympy.tanh, derivative=_tanh_derivative,
              triton="_tanh({0})"),
    Primitive("sigmoid", (torch.sigmoid, F.sigmoid, "sigmoid"), forward=Sigmoid,
              derivative=lambda n: [n.y * (1 - n.y)], gradient=_sigmoid_gradient),
    Primitive("erf", (torch.erf, torch.special.erf, "erf"), forward=sympy.erf, triton="tl.erf({0})"),
    # activations
    Primitive("silu", (F.silu,), forward=lambda a: a * Sigmoid(a)),
    Primitive("relu", (torch.relu, F.relu, "relu"), forward=lambda a: sympy.Max(a, 0)),
    # autograd's clamp_min passes the gradient where x >= min (a tie included)
    Primitive("clamp_min", (torch.clamp_min, "clamp_min"), "binary", lambda a, b: sympy.Max(a, b),
              derivative=lambda n: [sympy.Heaviside(n.inputs[0] - n.inputs[1], 1),
                                    sympy.Heaviside(n.inputs[1] - n.inputs[0], 0)]),
    # and clamp_max where x <= max (x.clamp(min, max) reads as clamp_min, then clamp_max: decompose.py)
    Primitive("clamp_max", (torch.clamp_max, "clamp_max"), "binary", lambda a, b: sympy.Min(a, b),
              derivative=lambda n: [sympy.Heaviside(n.inputs[1] - n.inputs[0], 1),
                                    sympy.Heaviside(n.inputs[0] - n.inputs[1], 0)]),
    Primitive("gelu", (F.gelu, torch._C._nn.gelu), forward=_gelu, attrs=(("approximate", "none"),)),
    # row reductions (dim=-1, keepdim=True in a kernel; the adjoint of a sum is a broadcast)
    Primitive("mean", (torch.mean, "mean"), "reduction", mean=True),
    Primitive("sum", (torch.sum, "sum"), "reduction"),
):  # fmt: skip
    PRIMITIVES.add(_p)
