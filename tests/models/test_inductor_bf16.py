"""A whole model under the inductor backend in bf16, judged over many batches.

One batch makes the loss one number and a norm weight's gradient a few dozen: the accuracy rule on
them is then a draw of the rounding, not a statistic. Over 8 batches (CPU, 2026-11-30) kernelgraft's
error relative to eager's ranged from 0.05x to 5.8x for the loss of a tiny Qwen3 and from 0.7x to
1.3x for its norm weights, kernelgraft usually the more accurate. The single-batch failures of Gemma-2
and Qwen3 in bf16 under inductor (tests/gpu/test_gpu.py's strict xfails) were largely that. Here every
quantity is judged on all batches at once (tiny.compare_models with a list of batches).

Qwen3 as well, with a caveat on the loss: over batches 65-128 it passes (0.93 of the bound; with the
RMSNorm and RoPE kernels alone also over 129-192, 0.94), over batches 1-64 its loss alone misses
(1.22x eager's error, 1.10 of the bound). Its
logits over 32 batches are as accurate as eager's (0.99x). Sixty-four numbers still leave about 10 %
of noise in a ratio of two errors, the size of the rule's slack. The loss is best judged over more
batches than the interpreter can run in CI; Gemma-2 is the case here (its GPU check is an xfail)."""

import copy

import pytest
import torch
from tiny import batch, compare_models, tiny_model

import kernelgraft


@pytest.mark.slow
def test_gemma2_under_inductor_in_bf16_over_32_batches():
    # one layer: every kernel the model has (its four norms and the final one, RoPE, the gated MLP,
    # the softcapped LM head) at about half the interpreter's time of two
    stock = tiny_model("gemma2", torch.bfloat16, layers=1)
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="inductor")
    # against eager alone: a stricter bound than max(eager, compile), and no CPU compile of the stock
    verdicts = compare_models(grafted, stock, [batch(seed=s) for s in range(1, 33)], compiled=False)
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    assert grafted.kernelgraft_report.counts()["rms_norm"] >= 5


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_llama_in_bf16_over_16_batches_on_both_backends(backend):
    # the inductor backend compiles the code between the sites as torch.compile does: judged beside
    # the stock model under torch.compile too, as the rule reads; the eager backend beside eager alone
    stock = tiny_model("llama", torch.bfloat16)
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    batches = [batch(seed=s) for s in range(1, 17)]
    verdicts = compare_models(grafted, stock, batches, compiled=backend == "inductor")
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    assert grafted.kernelgraft_report.counts(graph="training") == {"rms_norm": 5, "lm_head_ce": 1, "rope": 4, "gated_mlp": 2}
