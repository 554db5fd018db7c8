"""The benchmark suite's command line and its training-step shapes and modes, without importing
torch: `kernelgraft bench --help` answers at once, and a bad argument is one line before any work."""

from __future__ import annotations

import argparse
import os

DESCRIPTION = 'The benchmark suite, in one process per part: every implementation side by side.'

SHAPES = {
    "llama-1b 8x2048": dict(
        arch="llama", B=8, S=2048,
        cfg=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    ),
    "llama-8b 2x4096": dict(
        arch="llama", B=2, S=4096,
        cfg=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    ),
    "gemma2-2b 8x2048": dict(
        arch="gemma2", B=8, S=2048,
        cfg=dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=256, vocab_size=256000, final_logit_softcapping=30.0,
                 attn_logit_softcapping=None, sliding_window=4096),
    ),
    "llama-1b LoRA 8x2048": dict(arch="llama", B=8, S=2048, lora=True, cfg=None),
    "llama-8b LoRA 2x4096": dict(arch="llama", B=2, S=4096, lora=True, cfg=None),
    # a small model, where the host is in the loop: SmolLM-135M's shape; also measured under CUDA graphs
    "llama-135m 8x1024": dict(
        arch="llama", B=8, S=1024, extra_modes=("torch.compile (reduce-overhead)", "kernelgraft (inductor, reduce-overhead)"),
        cfg=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=10000.0,
                 tie_word_embeddings=True),
    ),
}  # fmt: skip
# decoders with a LayerNorm and with interleaved RoPE: Pythia-1B's shape (GPT-NeoX: LayerNorm with
# bias, a quarter of each head rotated, a GELU MLP, parallel residual); GLM-4-9B's shape at 10 of
# its 40 layers (interleaved RoPE on half of each head, a fused gate_up projection)
SHAPES["pythia-1b 8x2048"] = dict(
    arch="gpt_neox", B=8, S=2048,
    cfg=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=8,
             vocab_size=50304, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False),
)  # fmt: skip
SHAPES["glm4-9b-10l 2x4096"] = dict(
    arch="glm4", B=2, S=4096,
    cfg=dict(hidden_size=4096, intermediate_size=13696, num_hidden_layers=10, num_attention_heads=32,
             num_key_value_heads=2, head_dim=128, vocab_size=151552, partial_rotary_factor=0.5,
             tie_word_embeddings=False),
)  # fmt: skip
SHAPES["llama-1b LoRA 8x2048"]["cfg"] = SHAPES["llama-1b 8x2048"]["cfg"]
SHAPES["llama-8b LoRA 2x4096"]["cfg"] = SHAPES["llama-8b 2x4096"]["cfg"]
MODES = ("eager", "torch.compile", "kernelgraft (inductor)", "kernelgraft (eager)", "liger")


class _Parser(argparse.ArgumentParser):
    """A bad argument: one line on stderr and exit 2, as every error of kernelgraft's command line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kernelgraft bench", description=DESCRIPTION)
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT", "benchmarks/out"),
        help="directory the results are written to (suite.json, suite.md), made if missing "
        "(default: $OUT, else benchmarks/out)",
    )
    ap.add_argument(
        "--parts",
        default="patterns,lm_head,steps,curves,decode",
        help="parts to run, comma-separated, any of: %(default)s (default: all of them)",
    )
    ap.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help="training-step shapes of the steps part, comma-separated, any of: %(default)s "
        "(default: all of them)",
    )
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help="implementations the steps part measures, comma-separated (a comma inside parentheses does "
        "not split), any of: %(default)s; or a variant: torch.compile (reduce-overhead), torch.compile "
        "(cpp wrapper), kernelgraft (inductor, OPTION) or kernelgraft (eager, OPTION), OPTION one of "
        "bf16 dW, fp32 dW, no recompute, separate recompute, reduce-overhead, host launch, inference "
        "kernels, no projections, python wrapper, ddp pieces N MB, ddp pieces at buckets "
        "(default: all of the first list, and the shape's own CUDA-graph modes)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=5,
        help="timed training steps per shape and mode after two warm-up steps, 1 or more; with --turns, "
        "rounds (default: %(default)s)",
    )
    ap.add_argument("--quick", action="store_true", help="the reference shapes only, no sweep")
    ap.add_argument(
        "--only",
        default="",
        help="pattern cases whose name contains one of these (comma-separated; default: every case)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="break N training steps down by kernel class (default: 0, none)",
    )
    ap.add_argument(
        "--turns",
        action="store_true",
        help="steps part: build every mode's model in one process and take turns step by step (--steps "
        "rounds); a row then also gives each step's time over Liger's in the same round",
    )
    ap.add_argument(
        "--no-cache",
        action="store_true",
        help="training steps call the model with use_cache=False (default: the model's, which fills a KV cache)",
    )
    ap.add_argument("--plot", metavar="JSON", help="only make the PNG plots of an earlier run")
    ap.add_argument(
        "--merge", nargs="+", metavar="JSON", help="merge runs (later wins) into --out, then plot"
    )
    return ap
