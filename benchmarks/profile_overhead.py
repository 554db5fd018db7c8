"""Where the host time of one kernelgraft RMSNorm fwd+bwd goes (cProfile), next to its device time.

python benchmarks/profile_overhead.py [--shape 16384x4096] [--calls 50]"""

import argparse
import cProfile
import io
import pstats
import time

import torch

from kernelgraft.kernels import op_for
from kernelgraft.patterns import REGISTRY


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096")
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    M, N = map(int, a.shape.split("x"))
    op = op_for(REGISTRY.get("rms_norm", "llama"))
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.autograd.grad(op(x, w, 1e-6), (x, w), g)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.calls):
        step()
    host = (time.perf_counter() - t) / a.calls  # launches are asynchronous: this is host time per call
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / a.calls
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        step()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
    print(s.getvalue())
    print(f"host time per fwd+bwd {host * 1e6:.0f} us, wall (after sync) {wall * 1e6:.0f} us")


if __name__ == "__main__":
    main()
