"""Hypothesis strategies for checking a pattern: shapes (one row, odd widths, model widths), dtypes,
and values (gaussian, outliers scaled to +-100, constant rows). `cases(spelling)` draws complete
argument tuples from the pattern's own `example`, so a contributor's pattern is checked like the
built-ins as soon as it is declared.

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
from hypothesis import strategies as st

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VALUES = ("gaussian", "outliers", "constant_rows")


@dataclass
class Case:
    rows: int
    n: int
    dtype: torch.dtype
    values: str
    seed: int
    args: tuple

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        return f"Case(rows={self.rows}, n={self.n}, dtype={self.dtype}, values={self.values!r}, seed={self.seed})"


def rows() -> st.SearchStrategy[int]:
    return st.one_of(st.just(1), st.integers(2, 48))


def widths(max_width: int = 4096) -> st.SearchStrategy[int]:
    """Odd and prime widths, powers of two, and the model widths in between."""
    return st.one_of(
        st.integers(8, 200), st.sampled_from([127, 256, 1000, 2048, 4096]).filter(lambda w: w <= max_width)
    )


def dtypes(choices=DTYPES) -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(list(choices))


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
    draw, spelling, *, min_rows: int = 1, min_width: int = 8, max_width: int = 4096, dtype_choices=DTYPES
):
    """Complete arguments for `spelling`: its example at a drawn shape and dtype, with drawn values."""
    r = max(min_rows, draw(rows()))
    n = max(min_width, draw(widths(max_width)))
    dtype = draw(dtypes(dtype_choices))
    kind = draw(st.sampled_from(VALUES))
    seed = draw(st.integers(0, 2**16))
    args = _values(spelling.example_args(r, n, dtype, seed), kind)
    return Case(r, n, dtype, kind, seed, args)
