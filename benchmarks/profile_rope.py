"""Where the time of kernelgraft's paired RoPE fwd+bwd goes on a GPU (q 8x32x2048x128, k 8x8x2048x128): device
kernels vs host, from torch.profiler.   python benchmarks/profile_rope.py"""

import torch
from torch.profiler import ProfilerActivity, profile

from kernelgraft.kernels.rows import pair_op_for
from kernelgraft.patterns import REGISTRY


def main():
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(8, 2048, 32, 128, **bf).transpose(1, 2).requires_grad_()
    k = torch.randn(8, 2048, 8, 128, **bf).transpose(1, 2).requires_grad_()
    ang = torch.randn(8, 2048, 128, device="cuda")
    cos, sin = ang.cos().to(torch.bfloat16).unsqueeze(1), ang.sin().to(torch.bfloat16).unsqueeze(1)
    pair = pair_op_for(REGISTRY.get("rope", "rotate_half"))
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def step():
        yq, yk, _, _ = pair.fwd(q, cos, sin, k, cos, sin)
        torch.autograd.grad([yq, yk], [q, k], [gq, gk])

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
