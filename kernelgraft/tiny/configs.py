"""The tiny config: an architecture's config with a fixed set of tiny sizes (hidden 64, 2 layers,
vocabulary 128, 4 heads of 16), every dropout zeroed; and the causal LM made of it."""

from __future__ import annotations

import torch

VOCAB = 128
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # ids inside the tiny vocabulary


def tiny_config(arch: str, layers: int = 2):
    from transformers import AutoConfig

    kw = dict(
        hidden_size=64,
        **TOKENS,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        head_dim=16,
        max_position_embeddings=128,
    )
    if arch in ("gemma2", "gemma3_text"):
        kw.update(sliding_window=8, query_pre_attn_scalar=16)
    if arch == "qwen3_moe":  # tiny experts, as many as Mixtral's (its defaults: 128 of width 768, top 8)
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
    return deterministic(AutoConfig.for_model(arch, **kw))


RANDOM_RATES = ("dropout", "pdrop", "jitter")  # config attributes that make a training forward random


def deterministic(cfg):
    """cfg with every dropout and jitter rate zeroed, in its sub-configs too (GPT-2's resid_pdrop,
    BERT's hidden_dropout_prob, an MoE router's jitter): a training forward then gives the same
    numbers each time, so gradients can be compared with float64 truth."""
    for name, value in list(vars(cfg).items()):
        if hasattr(value, "to_dict") and value is not cfg:  # a sub-config (text_config, attn_config...)
            deterministic(value)
        elif isinstance(value, float) and value > 0 and any(r in name for r in RANDOM_RATES):
            setattr(cfg, name, 0.0)
    return cfg


def tiny_model(arch: str, dtype=torch.float32, seed: int = 0, layers: int = 2, device="cpu"):
    """The causal LM of tiny_config(arch, layers): SDPA attention (eager for Gemma-2, and where the
    architecture has no SDPA), every norm weight perturbed (Gemma initializes them to 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, layers)
    cfg._attn_implementation = "sdpa" if arch not in ("gemma2",) else "eager"
    try:
        m = AutoModelForCausalLM.from_config(cfg)
    except ValueError as e:  # an architecture without SDPA (Bloom): its eager attention
        if "attention implementation" not in str(e):
            raise
        torch.manual_seed(seed)
        cfg._attn_implementation = "eager"
        m = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # Gemma initializes norm weights to 0 (it uses 1 + w): perturb every norm
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return m.to(device=device, dtype=dtype)
