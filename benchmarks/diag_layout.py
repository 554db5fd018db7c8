"""Where a case's error moves with the layout: one drawn case, contiguous and transposed, side by side.

The thorough property profile on an H200 reported LM head + loss cases that fail only with every
2-d tensor stored transposed (`lm_head_ce.bias_hf_mean`, `lm_head_ce.softcap_float_sum_n`,
`Case(rows=16, n=159, bf16, gaussian, transposed, seed=0)`: the weight gradient's error 0.00271
against CUDA eager's 0.00233). This script runs such a case both ways on one device and prints,
for the output and each gradient, the error against float64 truth of the kernel and of eager in
each layout, and whether each side's result keeps its bits when only the layout changes. The side
whose bits move with the layout is the one whose arithmetic depends on it. For an LM head it then
times nothing but rounds the weight gradient's product z^T h alone, in the dtype, with h row-major
and column-major (and eager's other formula, (h^T z)^T), against float64.

    DIAG_CASE="lm_head_ce.bias_hf_mean,16,159,bfloat16,gaussian,0" python benchmarks/diag_layout.py
    (DIAG_DEVICE=cpu: a dry run through Triton's interpreter)
"""

from __future__ import annotations

import os

import torch

from kernelgraft.gradcheck import rel_error
from kernelgraft.gradcheck.spelling import compare
from kernelgraft.gradcheck.strategies import _layout, _values, on_device
from kernelgraft.kernels import op_for
from kernelgraft.patterns import REGISTRY


def main():
    qual, rows, n, dt, vals, seed = os.environ.get(
        "DIAG_CASE", "lm_head_ce.bias_hf_mean,16,159,bfloat16,gaussian,0"
    ).split(",")
    kernel, name = qual.split(".")
    dev = os.environ.get("DIAG_DEVICE", "cuda")
    sp = REGISTRY.get(kernel, name)
    base = on_device(_values(sp.example_args(int(rows), int(n), getattr(torch, dt), int(seed)), vals), dev)
    print(f"case: {qual} rows {rows} n {n} {dt} {vals} seed {seed} on {dev}")
    runs = {lay: compare(sp, _layout(base, lay), op_for(sp), compile_ref=False, seed=int(seed)) for lay in
            ("contiguous", "transposed")}  # fmt: skip
    print(f"{'quantity':14s} {'kg contig':>10s} {'kg transp':>10s} {'eager contig':>12s} {'eager transp':>12s}"
          f" {'kg bits kept':>12s} {'eager bits kept':>15s}")  # fmt: skip
    for (what, truth, kc, ec, _), (_, _, kt, et, _) in zip(runs["contiguous"], runs["transposed"]):
        errs = [rel_error(v, truth) for v in (kc, kt, ec, et)]
        same_k, same_e = torch.equal(kc, kt), torch.equal(ec, et)
        print(f"{what:14s} {errs[0]:10.4g} {errs[1]:10.4g} {errs[2]:12.4g} {errs[3]:12.4g} {same_k!s:>12s} {same_e!s:>15s}")
    if kernel == "lm_head_ce":
        _products(int(rows), int(n), getattr(torch, dt), dev)


def _products(T: int, H: int, dtype: torch.dtype, dev: str) -> None:
    """z^T h in `dtype` at the case's shape (V = 3H + 5), h row-major and column-major, 3 draws."""
    V = 3 * H + 5
    gen = torch.Generator().manual_seed(0)
    for draw in range(3):
        z = (torch.randn(T, V, generator=gen) * 1e-3).to(dev, dtype)
        h = torch.randn(T, H, generator=gen).to(dev, dtype)
        col = h.t().contiguous().t()
        truth = z.double().t() @ h.double()
        row = torch.mm(z.t(), h)
        ways = {"z^T h, h row-major": row, "z^T h, h column-major": torch.mm(z.t(), col),
                "(h^T z)^T, h column-major": (col.t() @ z).t()}  # fmt: skip
        print(f"product {draw}: " + ", ".join(
            f"{k} {rel_error(v, truth):.3g}{'' if torch.equal(v, row) else ' (other bits)'}" for k, v in ways.items()
        ))  # fmt: skip


if __name__ == "__main__":
    main()
