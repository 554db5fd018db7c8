"""Hypothesis strategies for checking a pattern: shapes (one row, odd widths, model widths, widths over
65536 where allowed), dtypes, layouts (contiguous, or every tensor stored transposed: a column stride
other than 1; broadcast arguments come from the pattern's example, e.g. RoPE's cos/sin over heads),
and values (gaussian, outliers scaled to +-100, constant rows). `cases(spelling)` draws complete
argument tuples from the pattern's own `example`, so a contributor's pattern is checked like the
built-ins as soon as it is declared.

Needs hypothesis, from the `test` extra: `pip install 'kernelgraft[test]'`.

>>> from hypothesis import given, settings
>>> import kernelgraft
>>> from kernelgraft.gradcheck import strategies
>>> sp = kernelgraft.patterns.REGISTRY.get("rms_norm", "llama")
>>> @settings(max_examples=3, deadline=None)
... @given(strategies.cases(sp))
... def check(case):
...     assert all(v.ok for v in kernelgraft.gradcheck.check_spelling(sp, case.args, compile_ref=False))
>>> check()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from hypothesis import strategies as st
except ImportError as e:  # the one module of kernelgraft that needs it: imported on demand only
    raise ImportError(
        f"kernelgraft.gradcheck.strategies draws test cases with hypothesis, which is not installed "
        f"({e}): pip install 'kernelgraft[test]'"
    ) from e

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VALUES = ("gaussian", "outliers", "constant_rows")
LAYOUTS = ("contiguous", "transposed")


@dataclass
class Case:
    rows: int
    n: int
    dtype: torch.dtype
    values: str
    seed: int
    args: tuple
    layout: str = "contiguous"

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        return (
            f"Case(rows={self.rows}, n={self.n}, dtype={self.dtype}, values={self.values!r}, "
            f"layout={self.layout!r}, seed={self.seed})"
        )


def rows() -> st.SearchStrategy[int]:
    return st.one_of(st.just(1), st.integers(2, 48))


def widths(max_width: int = 4096) -> st.SearchStrategy[int]:
    """Odd and prime widths, powers of two, the model widths in between, and (when max_width allows)
    widths over 65536: the looped path of the row kernels, and odd ones."""
    fixed = [w for w in (127, 256, 1000, 2048, 4096, 14336, 65536, 65537, 131072) if w <= max_width]
    out = [st.integers(8, 200), st.sampled_from(fixed)]
    if max_width > 65536:
        out.append(st.integers(65537, max_width))
    return st.one_of(*out)


def dtypes(choices=DTYPES) -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(list(choices))


def _layout(args: tuple, layout: str) -> tuple:
    """The same values stored another way: "transposed" keeps every floating tensor of 2+ dims in
    memory with its last two dims swapped (read in place by the kernels, or copied by them)."""
    if layout == "contiguous":
        return args
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 2 and a.stride(-1) != 0:
            t = a.detach().transpose(-1, -2).contiguous().transpose(-1, -2)
            out.append(t.requires_grad_(a.requires_grad))
        else:
            out.append(a)
    return tuple(out)


def on_device(args: tuple, device) -> tuple:
    """A spelling's arguments moved to `device`: floating tensors as new leaves that keep whether
    they require a gradient, other tensors moved, numbers as they are."""
    return tuple(
        a.detach().to(device).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) and a.is_floating_point()
        else a.to(device) if isinstance(a, torch.Tensor) else a
        for a in args
    )  # fmt: skip


def _values(args: tuple, kind: str) -> tuple:
    out = []
    first = True
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            x = a.detach().float()
            if kind == "outliers":
                x = x * 100.0 if first else x
            elif kind == "constant_rows" and first and x.dim() >= 1:
                x = x[..., :1].expand_as(x).clone()
            out.append(x.to(a.dtype).requires_grad_(a.requires_grad))
            first = False
        else:
            out.append(a)
    return tuple(out)


@st.composite
def cases(
    draw,
    spelling,
    *,
    min_rows: int = 1,
    min_width: int = 8,
    max_width: int = 4096,
    dtype_choices=DTYPES,
    layouts=LAYOUTS,
    device=None,
):
    """Complete arguments for `spelling`: its example at a drawn shape and dtype, with drawn values
    and layout, on `device` (default: where the example puts them, the CPU)."""
    r = max(min_rows, draw(rows()))
    n = max(min_width, draw(widths(max_width)))
    if n > 65536:  # keep wide cases to a few rows
        r = min(r, 4)
    dtype = draw(dtypes(dtype_choices))
    kind = draw(st.sampled_from(VALUES))
    layout = draw(st.sampled_from(list(layouts)))
    seed = draw(st.integers(0, 2**16))
    args = _values(spelling.example_args(r, n, dtype, seed), kind)
    if device is not None:
        args = on_device(args, device)
    return Case(r, n, dtype, kind, seed, _layout(args, layout), layout)
