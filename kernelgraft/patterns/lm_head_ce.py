"""LM head + cross-entropy: `cross_entropy(linear(h, W) [transformed], target)`, served by a fused,
chunked kernel (kernels/lm_head/) that never holds the full logits.

Spellings, as Hugging Face's `ForCausalLMLoss` and hand-written loops write them:
- the logits upcast with `.float()` (HF), or passed as they are (a plain loop);
- reduction "mean" (labels counted where not ignore_index), or "sum" divided by
  `num_items_in_batch` (HF with gradient accumulation: a tensor, or a Python number);
- the logit transform in between: none, Gemma-2/3's softcap `cap * tanh(z / cap)` (or that softcap
  computed on the logits upcast first: BEAM, xLSTM), Granite's `z / logits_scaling`, Cohere's
  `z * logit_scale`;
- a head with a bias, `linear(h, W, b)` (Phi-1/2, CTRL, the BERT-style decoders' prediction
  heads), with no transform.
However the logits are taken as rows: 2-D already, `view(-1, V)`, `reshape`, `flatten(0, 1)`
(canonicalization gives them one form, and the matcher takes rows of 2-D logits as they are); the
`nn.CrossEntropyLoss` module as the function. A loop that shifts the logits (`logits[:, :-1]`) is
served on the same rows of h (`linear(h, W)[rows] == linear(h[rows], W)`: ir/rules.py). The
labels' padding and shift stay stock code: `target` is whatever cross_entropy receives. Class weights, label smoothing and reduction="none" are not spelled here,
so those sites keep the stock code (explain reports the near miss). In training, the graph's
`logits` output is withheld (see `kernelgraft.optimize(keep_logits=...)`).
"""

import torch
import torch.nn.functional as F

from .registry import Scalar, pattern


def _example(rows, n, dtype, g):
    """h (rows, n), a weight (3n + 5, n) and a bias, labels with every 7th ignored; Gemma-2's cap, a
    scale."""
    V = 3 * n + 5
    h = torch.randn(rows, n, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, n, generator=g) / n**0.5).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, V, (rows,), generator=g)
    t[::7] = -100
    n_items = torch.tensor(float((t != -100).sum()))
    scalars = {"cap": 30.0, "scale": 0.5, "ignore_index": -100}
    return {"h": h, "weight": w, "bias": bias, "target": t, "n": n_items, **scalars}


_LM = dict(kernel="lm_head_ce", may_withhold=True, example=_example)


def _ce(z, target, ignore_index, reduction):
    return F.cross_entropy(z.view(-1, z.shape[-1]), target, ignore_index=ignore_index, reduction=reduction)


# --- no transform (Llama, Mistral, Qwen, Phi-3, OLMo-2, Mixtral, Gemma-1...) ---


@pattern("lm_head_ce", spelling="hf_mean", **_LM)
def hf_mean(h, weight, target, ignore_index: Scalar):
    return _ce(F.linear(h, weight).float(), target, ignore_index, "mean")


@pattern("lm_head_ce", spelling="hf_sum_n", **_LM)
def hf_sum_n(h, weight, target, n, ignore_index: Scalar):
    return _ce(F.linear(h, weight).float(), target, ignore_index, "sum") / n


@pattern("lm_head_ce", spelling="plain_mean", **_LM)
def plain_mean(h, weight, target, ignore_index: Scalar):
    return _ce(F.linear(h, weight), target, ignore_index, "mean")


# --- a biased head (Phi-1/2, CTRL, BERT-style prediction heads) ---


@pattern("lm_head_ce", spelling="bias_hf_mean", **_LM)
def bias_hf_mean(h, weight, bias, target, ignore_index: Scalar):
    return _ce(F.linear(h, weight, bias).float(), target, ignore_index, "mean")


@pattern("lm_head_ce", spelling="bias_hf_sum_n", **_LM)
def bias_hf_sum_n(h, weight, bias, target, n, ignore_index: Scalar):
    return _ce(F.linear(h, weight, bias).float(), target, ignore_index, "sum") / n


@pattern("lm_head_ce", spelling="bias_plain_mean", **_LM)
def bias_plain_mean(h, weight, bias, target, ignore_index: Scalar):
    return _ce(F.linear(h, weight, bias), target, ignore_index, "mean")


# --- softcap (Gemma-2, Gemma-3) ---


@pattern("lm_head_ce", spelling="softcap_mean", **_LM)
def softcap_mean(h, weight, target, cap: Scalar, ignore_index: Scalar):
    z = torch.tanh(F.linear(h, weight) / cap) * cap
    return _ce(z.float(), target, ignore_index, "mean")


@pattern("lm_head_ce", spelling="softcap_sum_n", **_LM)
def softcap_sum_n(h, weight, target, n, cap: Scalar, ignore_index: Scalar):
    z = torch.tanh(F.linear(h, weight) / cap) * cap
    return _ce(z.float(), target, ignore_index, "sum") / n


# --- softcap computed in float32, the logits upcast first (BEAM, xLSTM) ---


@pattern("lm_head_ce", spelling="softcap_float_mean", **_LM)
def softcap_float_mean(h, weight, target, cap: Scalar, ignore_index: Scalar):
    z = torch.tanh(F.linear(h, weight).float() / cap) * cap
    return _ce(z.float(), target, ignore_index, "mean")


@pattern("lm_head_ce", spelling="softcap_float_sum_n", **_LM)
def softcap_float_sum_n(h, weight, target, n, cap: Scalar, ignore_index: Scalar):
    z = torch.tanh(F.linear(h, weight).float() / cap) * cap
    return _ce(z.float(), target, ignore_index, "sum") / n


# --- divided by logits_scaling (Granite) ---


@pattern("lm_head_ce", spelling="divscale_mean", **_LM)
def divscale_mean(h, weight, target, scale: Scalar, ignore_index: Scalar):
    return _ce((F.linear(h, weight) / scale).float(), target, ignore_index, "mean")


@pattern("lm_head_ce", spelling="divscale_sum_n", **_LM)
def divscale_sum_n(h, weight, target, n, scale: Scalar, ignore_index: Scalar):
    return _ce((F.linear(h, weight) / scale).float(), target, ignore_index, "sum") / n


# --- multiplied by logit_scale (Cohere) ---


@pattern("lm_head_ce", spelling="mulscale_mean", **_LM)
def mulscale_mean(h, weight, target, scale: Scalar, ignore_index: Scalar):
    return _ce((F.linear(h, weight) * scale).float(), target, ignore_index, "mean")


@pattern("lm_head_ce", spelling="mulscale_sum_n", **_LM)
def mulscale_sum_n(h, weight, target, n, scale: Scalar, ignore_index: Scalar):
    return _ce((F.linear(h, weight) * scale).float(), target, ignore_index, "sum") / n
