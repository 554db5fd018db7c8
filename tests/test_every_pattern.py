"""Every registered pattern spelling, built-in or a contributor's, through one property-based check:
drawn shapes, dtypes and values (outliers, constant rows) against float64 truth and eager by the
DESIGN.md rule. Declaring a pattern (with its `example`) is all it takes to be checked here."""

import pytest
from hypothesis import given

from kernelgraft.gradcheck import check_spelling, strategies
from kernelgraft.patterns import REGISTRY

SPELLINGS = REGISTRY.spellings()


@pytest.mark.parametrize("sp", SPELLINGS, ids=[s.qualname for s in SPELLINGS])
def test_every_spelling(sp):
    # at least 4 rows of 8: smaller gradients are sums of a handful of numbers, where two equally
    # rounded results differ by luck (tests/test_lm_head.py checks tiny shapes directly)
    @given(strategies.cases(sp, min_rows=4, min_width=8, max_width=1024))
    def check(case):
        verdicts = check_spelling(sp, case.args, compile_ref=False)
        bad = [str(v) for v in verdicts if not v.ok]
        assert not bad, "\n".join(bad)

    check()
