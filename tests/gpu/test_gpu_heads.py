"""The fused LM heads under bf16 autocast on a GPU (the Trainer's bf16=True), against float64 truth:
benchmarks/bench_trainer.py's accuracy table, asserted. Each head alone in an otherwise eager model
(the unfused one, TRL's add_fused_lm_head, kernelgraft's lm_head_ce), so that only the head differs;
kernelgraft's loss and gradients within the rule beside the unfused model's."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_the_fused_heads_under_autocast_against_float64_on_gpu():
    import bench_trainer as bt
    from suite import SHAPES

    # two layers of the Llama-3.2-1B shape (its 128256-token vocabulary), 2 x 512 tokens
    spec = argparse.Namespace(
        device=torch.device("cuda"), cfg=SHAPES["llama-1b 8x2048"]["cfg"], layers=2, S=512,
        dtype=torch.bfloat16, backend="inductor", acc_layers=2, acc_B=2, acc_S=512,
    )  # fmt: skip
    out = bt.accuracy(spec)
    assert out["trl"] == "measured", out["trl"]  # trl is a test dependency
    assert out["kernelgraft_sites"] == {"lm_head_ce": 1}
    assert set(out["errors"]) == {"loss", *(f"grad {g}" for g in bt.GRADS)}
    for q, row in out["errors"].items():
        assert 0 < row["eager"] < 0.05 and 0 < row["trl"] < 0.05, (q, row)
        assert row["kernelgraft_ok"], (q, row)
