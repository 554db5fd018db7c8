"""The pattern registry: `@pattern("name")` on a plain PyTorch function registers one spelling.

A pattern is what a model computes, written the way models write it. Several spellings may share a
name (Llama and Gemma spell RMSNorm differently, and round at different points); each keeps its own
cast points, so its kernel rounds where it rounds.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._warnings import warn_once
from ..ir import CGraph, canonicalize_pattern


class Scalar(float):
    """Annotation for a pattern argument that is a Python number in the model (eps, a scale).

    The matcher captures it from the model graph instead of burning it into the pattern, so
    `eps=1e-5` and `eps=1e-6` both match.

    >>> import kernelgraft
    >>> sp = kernelgraft.patterns.REGISTRY.get("rms_norm", "llama")
    >>> sp.arg_names, sorted(sp.scalar_names)
    (('x', 'weight', 'eps'), ['eps'])
    """


@dataclass
class Site:
    """What `extra_check` sees of one match: the bound arguments' shapes, dtypes and devices."""

    pattern: str
    spelling: str
    tensors: dict[str, Any]  # name -> fake/meta tensor as dynamo recorded it
    scalars: dict[str, float]


class GuardedCheck:
    """A spelling's extra_check as the rewriter calls it: a check that raises refuses the site (it
    keeps its stock code, reported with the pattern, the spelling and the exception, warned once)
    instead of stopping the forward that is being captured."""

    def __init__(self, check: Callable[[Site], str | None], pattern: str, spelling: str) -> None:
        self.check, self.pattern, self.spelling = check, pattern, spelling
        self.__wrapped__ = check

    def __call__(self, site: Site) -> str | None:
        try:
            why = self.check(site)
        except Exception as e:  # noqa: BLE001 - a user's check that fails refuses the site, said once
            text = " ".join(str(e).split())[:300]
            why = (
                f"the extra_check of pattern {self.pattern!r}, spelling {self.spelling!r} raised "
                f"{type(e).__name__}: {text}"
            )
            warn_once(
                ("extra_check", self.pattern, self.spelling, type(e).__name__, text),
                f"kernelgraft: {why}. The sites it checks keep their stock PyTorch code "
                "(model.kernelgraft_report lists them as fell back); an extra_check returns a reason "
                "string to refuse a site, or None to serve it.",
            )
            return why
        if why is None or isinstance(why, str):
            return why
        return f"refused by the extra_check of {self.pattern}.{self.spelling} ({why!r})" if why else None

    def __repr__(self) -> str:
        return repr(self.check)


@dataclass(eq=False)
class Spelling:
    """One PyTorch spelling of a pattern, with the conditions under which its kernel serves it."""

    pattern: str
    name: str
    fn: Callable
    arg_names: tuple[str, ...]
    scalar_names: frozenset[str]
    extra_check: Callable[[Site], str | None] | None = None
    kernel: str = "row"  # the kernel family in kernels/ that serves it: "row" (generated) or a template
    may_withhold: bool = False  # intermediates the graph returns may be withheld (the LM head's logits)
    example: Callable | None = None  # (rows, n, dtype, generator) -> {argument: value}, for audits
    # the output is recomputed in the backward (from the inputs the kernel's backward keeps anyway)
    # rather than saved for the ops that read it, where the compiler partitions (inductor backend)
    recompute: bool = False
    # a failed match is reported as a near miss; off for a spelling so plain that unrelated code
    # resembles it (an add of a scaled matmul: every scaled residual)
    near_misses: bool = True
    _canonical: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check = self.extra_check
        if check is not None:  # guarded anew: a copy under another name reports that name
            check = check.check if isinstance(check, GuardedCheck) else check
            self.extra_check = GuardedCheck(check, self.pattern, self.name)

    @property
    def qualname(self) -> str:
        return f"{self.pattern}.{self.name}"

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(a for a in self.arg_names if a not in self.scalar_names)

    @property
    def source(self) -> str:
        return inspect.getsource(self.fn)

    @property
    def key(self) -> str:
        """A short hash of the spelling's canonical graph: names kernels and custom ops."""
        return hashlib.sha256(self.canonical().text().encode()).hexdigest()[:10]

    def canonical(self) -> CGraph:
        """The spelling traced with torch.fx and canonicalized, the same way model graphs are."""
        if self._canonical is None:
            self._canonical = canonicalize_pattern(self)
        return self._canonical

    def example_args(self, rows: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple:
        """Arguments as models pass them, for audits and checks: the pattern's own `example`, else
        every tensor (rows, n) of `dtype` and every Scalar 1e-6."""
        g = torch.Generator().manual_seed(seed)
        if self.example is not None:
            named = self.example(rows, n, dtype, g)
            return tuple(named[a] for a in self.arg_names)
        return tuple(
            1e-6 if a in self.scalar_names else torch.randn(rows, n, generator=g).to(dtype).requires_grad_()
            for a in self.arg_names
        )

    def reference(self, *args, **kwargs):
        """Run the spelling as plain PyTorch (the eager reference)."""
        return self.fn(*args, **kwargs)


class Registry:
    """Pattern name -> its spellings, in registration order."""

    def __init__(self) -> None:
        self._patterns: dict[str, list[Spelling]] = {}

    def add(self, sp: Spelling) -> Spelling:
        spellings = self._patterns.setdefault(sp.pattern, [])
        spellings[:] = [s for s in spellings if s.name != sp.name]  # re-registration replaces
        spellings.append(sp)
        return sp

    def names(self) -> list[str]:
        return list(self._patterns)

    def spellings(self, names: list[str] | tuple[str, ...] | None = None) -> list[Spelling]:
        if names is None:
            names = self.names()
        out = []
        for n in names:
            if n not in self._patterns:
                raise KeyError(
                    f"kernelgraft: no pattern named {n!r}; registered patterns are {self.names()}. "
                    "Register one with @kernelgraft.pattern(name)."
                )
            out.extend(self._patterns[n])
        return out

    def get(self, name: str, spelling: str | None = None) -> Spelling:
        sps = self.spellings([name])
        if spelling is None:
            return sps[0]
        for s in sps:
            if s.name == spelling:
                return s
        raise KeyError(
            f"kernelgraft: pattern {name!r} has no spelling {spelling!r}; it has {[s.name for s in sps]}"
        )


REGISTRY = Registry()


def pattern(
    name: str,
    *,
    spelling: str | None = None,
    extra_check: Callable[[Site], str | None] | None = None,
    registry: Registry | None = None,
    kernel: str = "row",
    may_withhold: bool = False,
    example: Callable | None = None,
    recompute: bool = False,
    near_misses: bool = True,
):
    """Register a plain PyTorch function as a spelling of pattern `name`.

    Arguments annotated `Scalar` are captured from the model graph (eps, scales); every other
    argument is a tensor. `extra_check(site)` may return a reason string to refuse a match that
    the kernel cannot serve (the site then keeps the stock code and the refusal is reported).
    `kernel` names the kernel family that serves it: "row" (the generator: element-wise math and
    row reductions) or "lm_head_ce" (linear + cross-entropy, chunked). `may_withhold=True` lets
    the match take an intermediate that the graph also returns (the LM head's logits): the graph
    then returns an empty tensor there, and optimize() turns it into an explicit error on use.
    `example(rows, n, dtype, generator)` returns {argument name: value} as a model passes them.
    `recompute=True` (row kernels): the output is cheap to make again from the inputs, which the
    kernel's backward keeps anyway; with the inductor backend it is then recomputed in the backward
    instead of being saved for the ops that read it (a gated MLP's output, which the down
    projection would save for its weight gradient). Only where the graph reads the output on.

    >>> import torch, kernelgraft
    >>> from kernelgraft import Scalar
    >>> @kernelgraft.pattern("doc_scaled_norm", registry=kernelgraft.patterns.Registry())
    ... def doc_scaled_norm(x, eps: Scalar):
    ...     return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    >>> doc_scaled_norm.qualname
    'doc_scaled_norm.doc_scaled_norm'
    """

    def deco(fn: Callable) -> Spelling:
        sig = inspect.signature(fn)
        arg_names, scalars = [], set()
        for p in sig.parameters.values():
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                raise TypeError(
                    f"kernelgraft.pattern({name!r}): argument {p.name!r} of {fn.__name__} must be positional; "
                    "patterns take tensors and Scalar-annotated numbers only"
                )
            arg_names.append(p.name)
            if p.annotation in (Scalar, "Scalar", float, "float"):
                scalars.add(p.name)
        if not set(arg_names) - scalars:
            raise TypeError(f"kernelgraft.pattern({name!r}): {fn.__name__} takes no tensor argument")
        sp = Spelling(
            name,
            spelling or fn.__name__,
            fn,
            tuple(arg_names),
            frozenset(scalars),
            extra_check,
            kernel,
            may_withhold,
            example,
            recompute,
            near_misses=near_misses,
        )
        g = sp.canonical()  # trace now: a pattern that cannot be traced fails where it is written
        opaque = sorted({n.op.removeprefix("opaque:") for n in g.nodes if n.op.startswith("opaque")})
        if opaque:
            raise TypeError(
                f"kernelgraft.pattern({name!r}): {fn.__name__} calls {', '.join(opaque)}, which canonicalization "
                "does not read as math: no kernel can be derived from it and no model would be served. Write "
                "it with the element-wise primitives and row reductions (kernelgraft.ir.PRIMITIVES), casts, "
                "x[..., :h] / x[..., h:] / x[..., ::2] / x[..., 1::2], torch.cat, torch.stack(...).flatten(-2), "
                "F.layer_norm, F.linear and F.cross_entropy."
            )
        never = _never_served(sp, g)
        if never:
            raise TypeError(
                f"kernelgraft.pattern({name!r}): {fn.__name__} {never}: no site could ever be served by it"
            )
        (registry or REGISTRY).add(sp)
        return sp

    return deco


def _never_served(sp: Spelling, g) -> str | None:
    """Why no site could ever be served by `sp` (its canonical graph `g`), or None: an argument the
    result does not read (the matcher has nothing to bind it to), a result that is an argument
    itself, an unknown kernel family, or (row kernels) math the generator cannot emit whatever the
    arguments' shapes (tried with every tensor varying per element, which serves the most)."""
    read, stack = set(), [g.output]
    while stack:
        n = stack.pop()
        if n not in read:
            read.add(n)
            stack.extend(n.inputs())
    unread = [n.attr("name") for n in g.inputs if n not in read]
    if unread:
        return f"does not read {', '.join(unread)} in computing its result"
    if g.output.op == "input":
        return f"computes nothing: its result is its argument {g.output.attr('name')!r}"
    for check in SERVABLE:
        why = check(sp)
        if why:
            return why
    return None


# checks the kernel families add when they load (kernels/__init__.py): why no site of a spelling
# could be served by any family's kernels, or None; patterns sit below the kernels, so they are told
SERVABLE: list = []


def dtype_check(site: Site, allowed=(torch.float32, torch.bfloat16, torch.float16)) -> str | None:
    """The common extra_check: floating tensors the kernels compute in, on one device.

    >>> import torch
    >>> from kernelgraft.patterns import Site, dtype_check
    >>> dtype_check(Site("p", "s", {"x": torch.empty(2, dtype=torch.float64)}, {}))
    'x is torch.float64; kernels serve torch.float32, torch.bfloat16, torch.float16'
    """
    devices = {t.device.type for t in site.tensors.values()}
    if len(devices) > 1:
        return f"arguments on several devices {sorted(devices)}"
    for n, t in site.tensors.items():
        if t.dtype not in allowed:
            return f"{n} is {t.dtype}; kernels serve {', '.join(str(a) for a in allowed)}"
    return None
