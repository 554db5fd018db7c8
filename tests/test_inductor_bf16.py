"""A whole model under the inductor backend in bf16, judged over many batches.

One batch makes the loss one number and a norm weight's gradient a few dozen: the DESIGN.md rule on
them is then a draw of the rounding, not a statistic. Over 8 batches (CPU, 2026-11-30) kernelgraft's
error relative to eager's ranged from 0.05x to 5.8x for the loss of a tiny Qwen3 and from 0.7x to
1.3x for its norm weights, kernelgraft usually the more accurate. The single-batch failures of Gemma-2
and Qwen3 in bf16 under inductor (tests/test_gpu.py's strict xfails) were largely that. Here every
quantity is judged on all batches at once (tiny.compare_models with a list of batches).

Found with it, not yet fixed (CPU, 64 batches): a tiny Qwen3's loss has 1.22x eager's error under
inductor (5.12e-5 vs 4.18e-5; bound 4.64e-5), every gradient within the rule. Only with the RMSNorm
and RoPE kernels both grafted (each alone passes: 0.89 and 0.80 of the bound); the eager backend
passes (0.91); recompute and the causal-mask rewrite do not change it; kernels rounding as eager does
leave 1.14x. 64 batches take minutes in the Triton interpreter, so that case is not in the default
suite; `python -m pytest tests/test_inductor_bf16.py` with KERNELGRAFT_QWEN3_BATCHES=64 runs it."""

import copy
import os

import pytest
import torch
from tiny import batch, compare_models, tiny_model

import kernelgraft

QWEN3 = int(os.environ.get("KERNELGRAFT_QWEN3_BATCHES", "0") or 0)
CASES = [pytest.param("gemma2", 32, id="gemma2")]
if QWEN3:
    CASES.append(
        pytest.param("qwen3", QWEN3, id="qwen3", marks=pytest.mark.xfail(strict=True, reason=__doc__))
    )


@pytest.mark.parametrize("arch,batches", CASES)
def test_inductor_bf16_model_over_many_batches(arch, batches):
    stock = tiny_model(arch, torch.bfloat16)
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="inductor")
    # against eager alone: a stricter bound than max(eager, compile), and no CPU compile of the stock
    verdicts = compare_models(grafted, stock, [batch(seed=s) for s in range(1, batches + 1)], compiled=False)
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    assert grafted.kernelgraft_report.counts()["rms_norm"] >= 5
