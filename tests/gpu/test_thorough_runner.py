"""tests/gpu/thorough_gpu.py, the per-spelling runner of the thorough profile: what it reads from a log."""

from thorough_gpu import spellings, summarize


def test_a_log_says_passed_failed_or_cut_short():
    q = "rms_norm.l2"
    passed = f"{q}: 50 examples so far\n{q}: 200 examples\n.\n1 passed"
    assert summarize(q, passed, 0) == ("passed", "200")
    failed = f"{q}: 50 examples so far\n\n{q}: first failing case Case(rows=4, n=8): grad x: FAIL\n"
    result, cases = summarize(q, failed, 1)
    assert result.startswith("FAILED: Case(rows=4, n=8)") and cases == "50"
    assert summarize(q, f"{q}: 50 examples so far\n{q}: 100 examples so far\n", 124) == (
        "cut short by its time, no failure",
        ">= 100",
    )
    # another spelling's lines (rms_norm.l2_scaled) are not this one's
    assert summarize(q, "rms_norm.l2_scaled: 200 examples\n", 124)[1] == "< 50"


def test_only_picks_whole_spellings_and_kernels():
    assert spellings("rms_norm.l2") == ["rms_norm.l2"]
    lm = spellings("lm_head_ce")
    assert lm and all(n.startswith("lm_head_ce.") for n in lm)
    assert len(spellings("")) == len(set(spellings("")))
