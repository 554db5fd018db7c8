"""benchmarks/benchlib.py's helpers that run without a GPU."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
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
