"""Print what kernelgraft.explain sees for tiny random models on this machine's device."""

import sys

import torch

sys.path.insert(0, "tests")
from tiny import batch, tiny_model  # noqa: E402

import kernelgraft  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
for arch in sys.argv[1:] or ["qwen3"]:
    m = tiny_model(arch, device=dev)
    rep = kernelgraft.explain(m, **batch(device=dev))
    print(arch, dev, "graphs", rep.graphs, rep.counts(), "fallbacks", [f.reason for f in rep.fallbacks])
    print("near misses:", [str(n) for n in rep.near_misses][:5])
