"""The LM head's cross-entropy kernel: its gradient by the accuracy rule over a grid of cases, and
its time with three exponentials side by side.

The softmax of the logit gradient is exp(y - max) times 1/sum, and on CUDA the exponential is
emit.EXP_ONE_EX2 (one ex2, the rounding of x log2 e put back). This script shows both choices:

  cases  the rule (kernel vs float64 truth and eager) on 61 cases: the thorough profile's fp16 case
         with constant rows (a rounding tie in the logit gradient), and three spellings x fp16/bf16
         x constant rows/gaussian x 5 shapes; prints every failing case and the count.
  time   the CE kernel alone (loss and logit gradient in place) over 8192 x 128256 bf16 logits with
         tl.exp, with EXP_ONE_EX2 (what ships) and with the row kernels' range-reduced _exp, in
         three turns, median ms less a copy of the logits (each launch starts from fresh logits).

    python benchmarks/diag_ce_exp.py [cases] [time]     (a CUDA GPU; default: both)
"""

from __future__ import annotations

import itertools
import sys

import torch
from triton.testing import do_bench

from kernelgraft.gradcheck.spelling import check_spelling
from kernelgraft.gradcheck.strategies import _values, on_device
from kernelgraft.kernels import emit
from kernelgraft.kernels.cache import load_module
from kernelgraft.kernels.lm_head import kernel as K
from kernelgraft.kernels.lm_head.transform import transform
from kernelgraft.patterns import REGISTRY


def cases() -> None:
    grid = [("bias_hf_mean", 35, 35, torch.float16, "constant_rows", 35)]
    for name, dt, vals, seed in itertools.product(
        ["bias_hf_mean", "hf_mean", "softcap_mean"], [torch.float16, torch.bfloat16], ["constant_rows", "gaussian"], range(5)
    ):  # fmt: skip
        grid.append((name, 16 + 7 * seed, 24 + 11 * seed, dt, vals, seed))
    bad = 0
    for name, rows, n, dt, vals, seed in grid:
        sp = REGISTRY.get("lm_head_ce", name)
        verdicts = check_spelling(sp, on_device(_values(sp.example_args(rows, n, dt, seed), vals), "cuda"), compile_ref=False)
        if not all(v.ok for v in verdicts):
            bad += 1
            print("FAIL", name, rows, n, dt, vals, seed, [str(v) for v in verdicts if not v.ok])
    print(f"cases: {bad} of {len(grid)} fail")


def time() -> None:
    sp = REGISTRY.get("lm_head_ce", "hf_mean")
    T, V = 8192, 128256
    z0 = torch.randn(T, V, device="cuda", dtype=torch.bfloat16) * 3
    t = torch.randint(0, V, (T,), device="cuda")
    base = K.kernel_name(sp, torch.bfloat16, "autograd")
    src = K.kernel_source(base, transform(sp, torch.bfloat16, "autograd", "cuda"), sp.qualname, accurate_exp=True)
    variants = {
        "tl.exp": src.replace("_exp(", "tl.exp(").split("@triton.jit\ndef tl.exp")[0],
        "one ex2 (shipped)": src,
        "range-reduced": src.replace(emit.EXP_ONE_EX2.strip(), emit.EXP.strip()),
    }
    fns = {}
    for i, (k, v) in enumerate(variants.items()):
        name = f"{base}_v{i}"
        mod, _ = load_module(name, v.replace(base, name))
        fns[k] = getattr(mod, name)
    block, warps = K._ce_config(V, z0.device)
    losses = torch.empty(T, device="cuda")
    scale = torch.full((1,), 1.0 / T, device="cuda")
    z = z0.clone()
    runs: dict = {}
    for _ in range(3):
        for k, fn in fns.items():

            def go(fn=fn):
                z.copy_(z0)
                fn[(T,)](z, z.stride(0), t, losses, scale, V, -100, GRAD=True, BLOCK_V=block, num_warps=warps)

            runs.setdefault(k, []).append(do_bench(go, rep=100))
    copy = do_bench(lambda: z.copy_(z0), rep=100)
    med = {k: sorted(v)[1] - copy for k, v in runs.items()}
    print(
        f"time: CE kernel, {T} x {V} bf16, ms: "
        + ", ".join(f"{k} {v:.3f} ({v / med['tl.exp']:.3f}x)" for k, v in med.items())
    )


if __name__ == "__main__":
    parts = sys.argv[1:] or ["cases", "time"]
    if "cases" in parts:
        cases()
    if "time" in parts:
        time()
