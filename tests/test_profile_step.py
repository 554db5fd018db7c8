"""benchmarks/profile_step.py's host breakdowns, on the CPU: ops by host time per step and per call
(torch.profiler), Python functions by their own time (cProfile). The GPU figures are RESULTS.md's."""

import cProfile
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from profile_step import cprofile_top, host_by_op  # noqa: E402


def _work(a, b, n):
    for _ in range(n):
        a = torch.mm(a, b)
    return a


def test_host_by_op_counts_calls_per_step_and_splits_their_time():
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(64, 64), torch.randn(64, 64) / 8
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):  # three steps of 7 matmuls each
            _work(a, b, 7)
    rows = {r["name"]: r for r in host_by_op(prof, steps=3)}
    mm = rows["aten::mm"]
    assert mm["calls"] == 7
    assert mm["us_per_call"] > 0
    assert abs(mm["self_us"] - mm["calls"] * mm["us_per_call"]) < 1e-6 * mm["self_us"] + 1e-9
    assert list(rows.values()) == sorted(rows.values(), key=lambda r: -r["self_us"])


def test_cprofile_top_names_functions_with_their_calls():
    a, b = torch.randn(32, 32), torch.randn(32, 32) / 8
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        _work(a, b, 2)
    pr.disable()
    rows = cprofile_top(pr, top=50)
    work = [r for r in rows if r["function"].endswith("(_work)")]
    assert len(work) == 1 and work[0]["calls"] == 5
    assert work[0]["cumtime_ms"] >= work[0]["tottime_ms"] >= 0
    mm = [r for r in rows if "mm" in r["function"] and "method" in r["function"]]
    assert mm and mm[0]["calls"] == 10
    assert [r["tottime_ms"] for r in rows] == sorted((r["tottime_ms"] for r in rows), reverse=True)
