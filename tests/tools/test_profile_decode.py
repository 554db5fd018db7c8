"""benchmarks/profile_decode.py, run on the CPU on a tiny Llama: each mode's generate() is timed and
profiled on the host, the graphs dynamo compiled are counted, and kernelgraft's decoding graphs
report their row sites left to inductor (the GPU figures are RESULTS.md's)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import profile_decode  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip


def test_profile_counts_graphs_and_host_time_and_the_sites_left_to_inductor():
    doc = dict(batch=1, prompt=6, new=4, gpu="cpu", torch=torch.__version__, modes={})
    for mode in ("eager", "kernelgraft (inductor, whole)"):  # whole: no graph break at the layers
        doc["modes"][mode] = profile_decode.profile_mode(
            mode, 1, 6, 4, calls=1, device="cpu", cfg=TINY, dtype=torch.float32
        )
    eager, mine = doc["modes"]["eager"], doc["modes"]["kernelgraft (inductor, whole)"]
    assert eager["dynamo"] == {} and mine["dynamo"]["unique_graphs"] >= 2  # prefill and decoding
    assert mine["graph_breaks"] == 0 and mine["kernels"] == 0  # no kernels counted on the CPU
    assert mine["sites"] == {} and mine["left_to_inductor"] == 11  # 5 norms, 4 RoPE, 2 MLPs
    assert all(r["wall_ms"] > 0 and r["tok_s"] > 0 and r["host_functions"] for r in (eager, mine))
    md = profile_decode.markdown(doc)
    assert "| kernelgraft (inductor, whole) |" in md and "host time by function" in md
