"""The LoRA kernels on a GPU, one adapted linear at a time (16384 rows, rank 16, bf16 x and base
output, float32 adapters: peft's default on a bf16 model), for the (width in, width out) pairs of a
Llama-3.2-1B layer (q/o 2048->2048, k/v 2048->512, gate/up 2048->8192, down 8192->2048):

    ops       fwd+bwd ms of the adapter path (`triton.testing.do_bench`): eager (peft's spelling:
              x cast to float32, float32 matmuls), torch.compile of it, kernelgraft's kernels
    accuracy  the error of the output and of the x, A and B gradients against float64 truth, beside
              eager's and torch.compile's, and the accuracy rule's verdict (one shape, 4096 rows)
    tiles     every kernel's device time for each (rows, columns, warps) tile of 32/64/128 x
              64/128 x 4/8, next to the table's tile (kernels/lora/kernel.py GPU_TILES)

    python benchmarks/tune_lora.py [--out DIR] [--parts ops,accuracy,tiles]
        -> DIR/tune_lora.json, DIR/tune_lora.md
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os

import torch
import torch.nn.functional as F

from kernelgraft.gradcheck.rule import bound
from kernelgraft.kernels.launching import cdiv
from kernelgraft.kernels.lora import kernel as K

T, R, SCALE = 16384, 16, 2.0
PAIRS = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)]


def spelling(x, res, A, B):
    """peft's adapter path on a base output `res`."""
    return (res + F.linear(F.linear(x.to(A.dtype), A), B) * SCALE).to(res.dtype)


def tensors(rows: int, k: int, n: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    dev = "cuda"
    return dict(
        x=torch.randn(rows, k, device=dev, dtype=torch.bfloat16),
        res=torch.randn(rows, n, device=dev, dtype=torch.bfloat16),
        A=torch.randn(R, k, device=dev) / k**0.5,
        B=torch.randn(n, R, device=dev) / R**0.5,
        g=torch.randn(rows, n, device=dev, dtype=torch.bfloat16),
    )


def kernelgraft_path(t: dict):
    out, u = K.forward(t["x"], t["res"], t["A"], t["B"], SCALE)
    return out, *K.backward(t["g"], t["x"], t["A"], t["B"], u, SCALE, (True, True, True))


def autograd_path(fn, t: dict, dtype=None):
    x, res, A, B = (t[k].to(dtype) if dtype else t[k].clone() for k in ("x", "res", "A", "B"))
    for v in (x, A, B):
        v.requires_grad_()
    out = fn(x, res, A, B)
    out.backward(t["g"].to(out.dtype))
    return out, x.grad, A.grad, B.grad


def ops() -> list[dict]:
    compiled = torch.compile(spelling)
    rows = []
    for k, n in PAIRS:
        row = dict(pair=f"{k}->{n}", **_fwd_bwd_ms(tensors(T, k, n), compiled))
        rows.append(row)
        print(row, flush=True)
    return rows


def _fwd_bwd_ms(t: dict, compiled) -> dict:
    import triton

    return {
        "eager": triton.testing.do_bench(lambda: autograd_path(spelling, t)),
        "torch.compile": triton.testing.do_bench(lambda: autograd_path(compiled, t)),
        "kernelgraft": triton.testing.do_bench(lambda: kernelgraft_path(t)),
    }


def accuracy() -> list[dict]:
    t = tensors(4096, 2048, 2048, seed=1)
    truth = autograd_path(lambda x, res, A, B: res + F.linear(F.linear(x, A), B) * SCALE, t, torch.float64)
    got = dict(
        eager=autograd_path(spelling, t),
        compile=autograd_path(torch.compile(spelling), t),
        kernelgraft=kernelgraft_path(t),
    )

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    rows = []
    for i, what in enumerate(("out", "dx", "dA", "dB")):
        e = {m: err(v[i], truth[i]) for m, v in got.items()}
        rows.append(dict(what=what, **e, ok=e["kernelgraft"] <= bound(e["eager"], e["compile"])))
    return rows


def tiles() -> dict:
    import triton

    got: dict = {}
    for k_in, n in PAIRS:
        t = tensors(T, k_in, n)
        pair = f"{k_in}->{n}"
        for tile in itertools.product((32, 64, 128), (64, 128), (4, 8)):
            for kn, fn in _launches(t, *tile).items():
                ms = triton.testing.do_bench(fn, warmup=5, rep=15)
                got.setdefault(kn, {}).setdefault(str(tile), {})[pair] = ms
        print(pair, flush=True)
    return got


def _launches(t: dict, BT: int, BN: int, warps: int) -> dict:
    """Each LoRA kernel's launch on t's shapes with one tile (rank 16: BR 16), as a thunk."""
    dev = torch.device("cuda")
    mod, name = K.kernels(torch.bfloat16, torch.float32, torch.bfloat16, "cuda")
    x, base, A, B, g = t["x"], t["res"], t["A"], t["B"], t["g"]
    k_in, n = x.shape[1], base.shape[1]
    out, dx = torch.empty_like(base), torch.empty_like(x)
    u, du = torch.randn(T, R, device=dev), torch.randn(T, R, device=dev)
    nb, rb = K._splits(T, cdiv(n, BN), BT, dev)
    na, ra = K._splits(T, cdiv(k_in, BN), BT, dev)
    pb, pa = torch.empty((nb, n, R), device=dev), torch.empty((na, R, k_in), device=dev)
    m = dict(BR=16, num_warps=warps, **K._options(A, x))

    def kern(e):
        return getattr(mod, f"{name}_{e}")

    return {
        "down": lambda: kern("down")[(cdiv(T, BT),)](x, A, u, T, k_in, R, k_in, k_in, R, BT=BT, BK=BN, **m),
        "up": lambda: kern("up")[(cdiv(T, BT), cdiv(n, BN))](
            out, base, u, B, SCALE, T, n, R, n, n, R, R, BT=BT, BN=BN, **m
        ),
        "grad_u": lambda: kern("grad_u")[(cdiv(T, BT),)](
            g, B, du, SCALE, T, n, R, n, R, R, BT=BT, BN=BN, **m
        ),
        "grad_b": lambda: kern("grad_b")[(cdiv(n, BN), nb)](
            g, u, pb, SCALE, T, n, R, n, R, rb, BT=BT, BN=BN, **m
        ),
        "grad_a": lambda: kern("grad_a")[(cdiv(k_in, BN), na)](
            du, x, pa, T, k_in, R, R, k_in, ra, BT=BT, BK=BN, **m
        ),
        "grad_x": lambda: kern("grad_x")[(cdiv(T, BT), cdiv(k_in, BN))](
            dx, du, A, T, k_in, R, k_in, R, k_in, BT=BT, BK=BN, **m
        ),
    }


def markdown(res: dict) -> str:
    lines = [f"LoRA kernels, {res['device']}, {res['date']}, torch {res['torch']}, 16384 rows, rank 16", ""]
    if "ops" in res:
        lines += [
            "**fwd+bwd of one adapted linear, ms**",
            "",
            "| in->out | eager | torch.compile | kernelgraft |",
        ]
        lines += ["|---|---|---|---|"]
        lines += [
            f"| {r['pair']} | {r['eager']:.3f} | {r['torch.compile']:.3f} | {r['kernelgraft']:.3f} |"
            for r in res["ops"]
        ]
        lines.append("")
    if "accuracy" in res:
        lines += ["**error against float64 truth (4096 x 2048 -> 2048)**", ""]
        lines += ["| quantity | eager | torch.compile | kernelgraft | rule |", "|---|---|---|---|---|"]
        lines += [
            f"| {r['what']} | {r['eager']:.3e} | {r['compile']:.3e} | {r['kernelgraft']:.3e} | {'ok' if r['ok'] else 'FAIL'} |"
            for r in res["accuracy"]
        ]
        lines.append("")
    if "tiles" in res:
        lines += ["**each kernel summed over the four pairs, us: the table's tile and the fastest**", ""]
        lines += ["| kernel | table's tile | us | fastest | us |", "|---|---|---|---|---|"]
        for kn, by_tile in res["tiles"].items():
            tot = {tile: sum(v.values()) * 1e3 for tile, v in by_tile.items()}
            best = min(tot, key=tot.get)
            mine = str(K.GPU_TILES[kn])
            lines.append(f"| {kn} | {mine} | {tot[mine]:.0f} | {best} | {tot[best]:.0f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--parts", default="ops,accuracy,tiles")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_lora.py measures the kernels on a GPU: no CUDA device here")
    res = dict(
        device=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
    )
    for part in a.parts.split(","):
        res[part] = {"ops": ops, "accuracy": accuracy, "tiles": tiles}[part]()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tune_lora.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(a.out, "tune_lora.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
