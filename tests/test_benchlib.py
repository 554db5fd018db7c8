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
