"""benchmarks/benchlib.py's helpers that run without a GPU."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchlib  # noqa: E402


def test_saved_for_backward_counts_activations_not_parameters():
    # a linear layer saves its input for the weight gradient (5 x 4 float32: 80 bytes), and its
    # weight for the input gradient (a parameter: not counted); tanh saves its output (5 x 3: 60)
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    got = benchlib.saved_for_backward(lin, lambda: torch.tanh(lin(x)).sum())
    assert sorted(got.values()) == [(60, (5, 3)), (80, (5, 4))], got
    assert lin.weight.grad is None and x.grad is not None  # the backward ran; the model's grads cleared
    assert benchlib.saved_bytes(lin, lambda: torch.tanh(lin(x)).sum()) == 140


def test_cuda_kernels_counts_each_kernel_once_per_call():
    # a profile's host ops carry the device time of the kernels they launch: only the kernels count
    # (the LM-head profile once summed both), per call, largest first
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, us, count, dev):
        return SimpleNamespace(key=key, device_time_total=us, count=count, device_type=dev)

    prof = SimpleNamespace(
        key_averages=lambda: [
            event("aten::mm", 3000.0, 6, DeviceType.CPU),  # the host op of the gemm below
            event("gemm_kernel", 3000.0, 6, DeviceType.CUDA),
            event("ce_kernel", 750.0, 3, DeviceType.CUDA),
        ]
    )
    assert benchlib.cuda_kernels(prof, 3) == [(1.0, 2, "gemm_kernel"), (0.25, 1, "ce_kernel")]


def test_idle_by_launcher_charges_each_gap_to_the_op_that_launched_the_next_kernel():
    def x(cat, name, ts, dur, corr=None):
        e = dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=1)
        if corr is not None:
            e["args"] = dict(correlation=corr)
        return e

    trace = dict(
        traceEvents=[
            x("cpu_op", "step", 0, 1000),
            x("cpu_op", "kernelgraft::rms_norm", 100, 200),
            x("cpu_op", "aten::empty", 240, 20),  # inside ours: the gap is still ours
            x("cpu_op", "aten::mm", 400, 50),
            x("cuda_runtime", "cudaLaunchKernel", 30, 5, corr=1),
            x("cuda_runtime", "cudaLaunchKernel", 250, 5, corr=2),
            x("cuda_runtime", "cudaLaunchKernel", 440, 5, corr=3),
            x("cuda_runtime", "cudaLaunchKernel", 460, 5, corr=4),
            dict(x("cpu_op", "autograd thread's op", 430, 100), tid=2),  # another thread: not around 440
            x("kernel", "first", 50, 10, corr=1),
            x("kernel", "norm", 260, 100, corr=2),  # 200 us after `first` ended
            x("gpu_memcpy", "copy", 300, 100, corr=9),  # overlaps: busy until 400
            x("kernel", "gemm", 445, 20, corr=3),  # 45 us after the copy
            x("kernel", "tail", 466, 5, corr=4),  # 1 us: under the threshold
            dict(ph="i", cat="instant", name="ignored", ts=0),
        ]
    )
    got = benchlib.idle_by_launcher(trace)
    assert got["gaps"] == 2
    assert got["by_op"] == [(0.2, 1, "kernelgraft::rms_norm"), (0.045, 1, "aten::mm")]
    assert abs(got["idle_ms"] - 0.245) < 1e-12
    # busy: [50, 60] + [260, 400] (a kernel and an overlapping copy) + [445, 465] + [466, 471]
    assert abs(got["busy_ms"] - 0.175) < 1e-12 and abs(got["span_ms"] - 0.421) < 1e-12


def test_suite_modes_pass_their_options_to_optimize(monkeypatch):
    # a mode's words become optimize's arguments: what a benchmark row says it ran is what ran
    import suite

    import kernelgraft

    got = []
    monkeypatch.setattr(kernelgraft, "optimize", lambda model, **kw: got.append(kw) or model)
    m = torch.nn.Linear(2, 2)
    for mode in (
        "kernelgraft (inductor)",
        "kernelgraft (inductor, ddp pieces 200 MB)",
        "kernelgraft (inductor, ddp pieces 12.5 MB)",
        "kernelgraft (inductor, ddp pieces at buckets)",
        "kernelgraft (eager, separate recompute)",
        "kernelgraft (inductor, bf16 dW, no recompute)",
        "kernelgraft (inductor) python wrapper",
    ):
        assert suite.apply_mode(m, mode) is m
    assert [k.get("ddp_piece_mb", "default") for k in got] == [
        "default",
        200.0,
        12.5,
        None,
        "default",
        "default",
        "default",
    ]
    assert [k["recompute"] for k in got] == [True, True, True, True, "separate", False, True]
    assert [k["backend"] for k in got] == ["inductor"] * 4 + ["eager", "inductor", "inductor"]
    assert [k["lm_head_accumulate"] for k in got] == ["auto"] * 5 + ["weight", "auto"]
    assert [k["wrapper"] for k in got] == ["auto"] * 6 + ["python"]
    compiled = []
    monkeypatch.setattr(torch.nn.Linear, "compile", lambda self, **kw: compiled.append(kw))
    suite.apply_mode(m, "torch.compile (cpp wrapper)")
    assert compiled == [{"options": {"cpp_wrapper": True}}]


def test_suite_step_table_says_when_the_kv_cache_was_off():
    # --no-cache (use_cache=False, bench_distributed's step) and the model's default (a KV cache
    # filled in the training forward) are different steps: the table says which one it measured
    import suite

    row = dict(tok_s=1000.0, peak_gib=1.0, peak_above_start_gib=0.5, first_step_s=1.0, loss=1.0)
    doc = dict(date="d", gpu="g", versions="v", steps={"llama-1b 8x2048": {"eager": row}})
    assert "** (fwd + bwd, no optimizer)\n" in suite.markdown(doc)
    assert "** (fwd + bwd, no optimizer, use_cache=False)\n" in suite.markdown(dict(doc, use_cache=False))
    assert "| eager | 1,000 | 1.00x |" in suite.markdown(doc)


def test_modes_take_turns_each_with_the_globals_it_was_built_with():
    # suite.py --turns: every mode's model in one process, one step each per round. Liger reassigns
    # transformers' apply_rotary_pos_emb at module level; here a stand-in named "liger" does the
    # same with a wrapper that counts its calls. Each step must run with its own mode's globals: the
    # eager model never calls the wrapper, and kernelgraft's graph (which guards on the global) is
    # not recompiled.
    import suite
    from tiny import VOCAB, tiny_model
    from transformers.models.llama import modeling_llama

    import kernelgraft

    stock = modeling_llama.apply_rotary_pos_emb
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return stock(*a, **k)

    def build(shape, mode):
        model = tiny_model("llama")
        if mode == "kernelgraft (eager)":
            kernelgraft.optimize(model, backend="eager")
        elif mode == "liger":
            modeling_llama.apply_rotary_pos_emb = counted
        return model

    spec = dict(B=2, S=16, cfg=dict(vocab_size=VOCAB))
    rounds = 3
    torch.manual_seed(0)
    try:
        got = suite.measure_steps_in_turns(
            "tiny", ["eager", "kernelgraft (eager)", "liger"], rounds, device="cpu", build_fn=build, spec=spec
        )
        assert modeling_llama.apply_rotary_pos_emb is counted  # left as the last build left it
    finally:
        modeling_llama.apply_rotary_pos_emb = stock
    # 2 layers, a call per layer per step: the stand-in's first step, warm-up and its 3 turns only
    assert len(calls) == 2 * (2 + rounds), len(calls)
    assert got["kernelgraft (eager)"]["sites"] and got["kernelgraft (eager)"]["sites"]["rms_norm"] == 5, got["kernelgraft (eager)"]["sites"]
    for m, v in got.items():
        assert len(v["times_ms"]) == rounds and v["tok_s"] > 0 and v["peak_gib"] is None, m
        assert (
            v["paired"]["ref"] == "liger"
            and v["paired"]["low"] <= v["paired"]["median"] <= v["paired"]["high"]
        )
    assert got["liger"]["paired"]["median"] == 1.0
    # the same weights and batch in every mode: the same loss
    losses = [v["loss"] for v in got.values()]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), losses
    md = suite.markdown(dict(date="d", gpu="g", versions="v", steps={"tiny": got}))
    assert "**Modes taking turns step by step, tiny** (3 rounds in one process" in md
    assert "| liger | 1.0000 | 1.0000 | 1.0000 |" in md


def test_taking_turns_rotates_the_order_and_pairs_the_rounds():
    import benchlib

    seen = []
    steps = {m: (lambda m=m: seen.append(m)) for m in "abc"}
    times = benchlib.take_turns(steps, 4, enter=lambda m: seen.append("enter " + m))
    assert seen[1::2] == list("abcbcacababc") and seen[::2] == ["enter " + m for m in "abcbcacababc"]
    assert {m: len(t) for m, t in times.items()} == {"a": 4, "b": 4, "c": 4}
    fake = {"x": [2.0, 3.0, 4.0], "ref": [1.0, 2.0, 2.0]}
    assert benchlib.paired_ratios(fake, "ref") == {
        "x": dict(ref="ref", median=2.0, low=1.5, high=2.0),
        "ref": dict(ref="ref", median=1.0, low=1.0, high=1.0),
    }
    assert benchlib.turn_order(["liger", "eager", "kernelgraft (inductor)"]) == (
        ["eager", "kernelgraft (inductor)", "liger"],
        "liger",
    )
    assert benchlib.turn_order(["eager", "kernelgraft (eager)"]) == (
        ["eager", "kernelgraft (eager)"],
        "eager",
    )
    before = {("m", "f"): print, ("m", "data"): 1, ("m", "g"): len}
    after = {("m", "f"): repr, ("m", "data"): 2, ("m", "g"): len, ("m", "new"): abs}
    assert benchlib.changed_globals(before, after) == {("m", "f"): (print, repr)}  # data and new names left


def test_a_run_whose_kernels_failed_says_so_beside_its_tables(monkeypatch):
    """A kernel that fails sends its sites to the stock code for the rest of the process, so a
    kernelgraft row timed after it measured that code: the JSON records the failures and the
    Markdown names them; nothing is added where none failed."""
    from kernelgraft.kernels import fallback

    monkeypatch.setattr(fallback, "FAILED", {})
    doc = {}
    assert benchlib.failed_kernels_note(doc) == "" and doc == {}
    why = "OutOfResources: out of resource: shared memory, Required: 262144, Hardware limit: 232448."
    monkeypatch.setattr(fallback, "FAILED", {("lora__bfloat16__float32__bfloat16", "cuda"): why})
    note = benchlib.failed_kernels_note(doc)
    assert doc["kernels_failed"] == {"lora__bfloat16__float32__bfloat16 (cuda)": why}
    assert "Kernels that failed in this run" in note and "`lora__bfloat16__float32__bfloat16 (cuda)`" in note
    assert "Required: 262144" in note
