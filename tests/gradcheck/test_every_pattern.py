"""Every registered pattern spelling, built-in or a contributor's, through one property-based check:
drawn shapes, dtypes and values (outliers, constant rows) against float64 truth and eager by the
accuracy rule. Declaring a pattern (with its `example`) is all it takes to be checked here."""

import pytest
import torch
from checks import dtypes_for, served_dtypes
from hypothesis import given

from kernelgraft.gradcheck import check_spelling, strategies
from kernelgraft.patterns import REGISTRY

SPELLINGS = REGISTRY.spellings()


@pytest.mark.parametrize("sp", SPELLINGS, ids=[s.qualname for s in SPELLINGS])
def test_every_spelling(sp):
    # at least 4 rows of 8: smaller gradients are sums of a handful of numbers, where two equally
    # rounded results differ by luck (tests/kernels/test_lm_head.py checks tiny shapes directly)
    @given(strategies.cases(sp, min_rows=4, min_width=8, max_width=1024, dtype_choices=dtypes_for(sp)))
    def check(case):
        verdicts = check_spelling(sp, case.args, compile_ref=False)
        bad = [str(v) for v in verdicts if not v.ok]
        assert not bad, "\n".join(bad)

    check()


# the upcast path is a question for the spellings served in bf16 and fp16
ROW_SPELLINGS = [s for s in SPELLINGS if s.kernel == "row" and torch.bfloat16 in served_dtypes(s)]


def test_a_spelling_that_refuses_a_dtype_is_not_drawn_in_it():
    no_cast = REGISTRY.get("rms_norm", "no_cast")
    assert served_dtypes(no_cast) == (torch.float32,)
    assert no_cast not in ROW_SPELLINGS and REGISTRY.get("rms_norm", "llama") in ROW_SPELLINGS


@pytest.mark.parametrize("sp", ROW_SPELLINGS, ids=[s.qualname for s in ROW_SPELLINGS])
def test_every_spelling_rounds_where_its_reference_rounds(sp):
    """The upcast path: in bf16 and fp16, the kernel built for the eager backend reproduces eager's
    rounding bit for bit, and the one built for inductor reproduces inductor's (or both, where the
    spelling rounds the same way either way). audit_kernel's inputs make the rounding points
    visible: a cast before instead of after a multiply is flagged (tests/gradcheck/test_audit_kernel.py)."""
    from kernelgraft.gradcheck import audit_kernel
    from kernelgraft.kernels import op_for

    shapes = [(4, 64), (3, 200)]
    for rounding, want in (("autograd", "eager"), ("fused", "inductor")):
        rep = audit_kernel(op_for(sp, rounding), sp.pattern, sp.name, shapes=shapes, outliers=0)
        assert rep.ok, str(rep)
        assert set(rep.rounding) == {"bfloat16", "float16"}
        for dtype, got in rep.rounding.items():
            assert got in (want, "eager = inductor"), f"{rounding} kernel, {dtype}: reproduces {got}\n{rep}"
