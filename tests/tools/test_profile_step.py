"""benchmarks/profile_step.py's host breakdowns, on the CPU: ops by host time per step and per call
(torch.profiler), Python functions by their own time (cProfile). The GPU figures are RESULTS.md's."""

import cProfile
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
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


def test_inductors_graph_records_are_named_as_compiled_graphs():
    from profile_step import event_name

    record = " ".join(("## Call", "CompiledFxGraph", "f67dvio3umky", "##"))  # as torch.profiler names it
    assert event_name(record) == "compiled graph f67dvio3umky"
    assert event_name("aten::mm") == "aten::mm"


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


WRAPPER = """
class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        buf0 = empty_strided_cuda((8, 576), (576, 1), torch.bfloat16)
        triton_poi_fused_embedding_0.run(primals_1, primals_2, buf0, 4608, stream=stream0)
        buf1 = empty_strided_cuda((8, 576), (576, 1), torch.bfloat16)
        rms_norm__llama__fused_fwd_0.run(primals_2, 1, 1e-06, buf0, 0, 0, 576, 1, buf1, 8, 576, 576.0, 8, 1, 1, stream=stream0)
        extern_kernels.mm(reinterpret_tensor(buf1, (8, 576), (576, 1), 0), reinterpret_tensor(primals_2, (576, 576), (1, 576), 0), out=buf0)
        buf2 = torch.ops.aten._scaled_dot_product_cudnn_attention.default(buf0, buf0, buf0, None, True)
        assert_size_stride(buf2, (8, 576), (576, 1), 'torch.ops.aten._scaled_dot_product_cudnn_attention.default')
        return (buf1, )
"""


def test_wrapper_launches_splits_kernelgrafts_launches_and_counts_their_arguments():
    from profile_step import wrapper_launches

    got = wrapper_launches("def call(self, args):" + WRAPPER.split("def call(self, args):")[1], lambda n: n.startswith("rms_norm"))
    assert got == dict(
        ours_launches=1,
        ours_args=15,
        inductor_launches=1,
        inductor_args=4,
        extern=2,  # the matmul and the attention; not the assertion naming the op
        reinterpret_tensor=2,
        buffers=2,
    )


def test_wrappers_since_totals_the_wrappers_written_after_a_mark(tmp_path):
    from profile_step import _py_files, wrappers_since

    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "old.py").write_text(WRAPPER)
    before = _py_files(str(tmp_path))
    (tmp_path / "cd").mkdir()
    (tmp_path / "cd" / "new.py").write_text(WRAPPER)
    (tmp_path / "cd" / "kernel.py").write_text("import triton\n")  # a kernel's module: no call()
    got = wrappers_since(str(tmp_path), before, lambda n: n.startswith("rms_norm"))
    assert got["graphs"] == 1 and got["ours_launches"] == 1 and got["ours_args"] == 15
