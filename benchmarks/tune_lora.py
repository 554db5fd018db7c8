"""The LoRA kernels on a GPU, one adapted linear at a time (16384 rows, rank 16, bf16 x and base
output, float32 adapters: peft's default on a bf16 model), for the (width in, width out) pairs of a
Llama-3.2-1B layer (q/o 2048->2048, k/v 2048->512, gate/up 2048->8192, down 8192->2048):

    ops       fwd+bwd ms of the adapter path (`triton.testing.do_bench`): eager (peft's spelling:
              x cast to float32, float32 matmuls), torch.compile of it, kernelgraft's kernels (and
              with du and dB from one read of the output's gradient, grad_ub, where the table has
              them apart, or apart where it has them fused (FUSED_UB); and with the sums over a long
              width added in float32, source.LONG_SUMS)
    accuracy  the error of the output and of the x, A and B gradients against float64 truth, beside
              eager's and torch.compile's, and the accuracy rule's verdict (one shape, 4096 rows)
    tiles     every kernel's device time for each (rows, columns, warps, stages) tile of
              32/64/128 x 64/128/256 x 4/8 x 2/3/4 (Triton's pipelining depth), next to the table's
              (kernels/lora/kernel.py GPU_TILES and GPU_STAGES)
    fills     the kernels that sum over a long dim (u over x's width, du over the output width, dA
              and dB over the rows) at the table's tile, with the programs per SM their splits aim
              at (GPU_FILL; 0: u or du not split) of 0/1/2/4/8
    blocks    grad_ub with 1, 2 and 4 column blocks a program (source.UB_BLOCKS; kernel.py
              GPU_UB_BLOCKS), du's partial sums added as the backward adds them
    hard      the ways of making du (CANDIDATES: its products in float64 or in TF32 passes,
              source.DU_PRODUCTS; grad_ub's blocks and tile; du and dB from one read of the
              output's gradient or apart), each judged by the accuracy rule on cases the thorough
              profile drew (HARD) and timed as the backward of the four pairs

    python benchmarks/tune_lora.py [--out DIR] [--parts ops,accuracy,tiles,fills,blocks,hard] [--kernels K1,K2]
        -> DIR/tune_lora.json, DIR/tune_lora.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F
from benchlib import COPY_RATE, failed_kernels_note

from kernelgraft.gradcheck.rule import bound
from kernelgraft.kernels.launching import cdiv
from kernelgraft.kernels.lora import kernel as K
from kernelgraft.kernels.lora import source

T, R, SCALE = 16384, 16, 2.0
PAIRS = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)]


def floor_us(kernel: str, pair: str) -> float:
    """The least time `kernel` can take on one (width in -> width out) pair: each tensor it must
    read or write moved once at COPY_RATE (x, the base output, the output and its gradient in bf16;
    the adapters, u and du in float32), partial sums left out."""
    k, n = (int(v) for v in pair.split("->"))
    x, g, a, b, u = T * k * 2, T * n * 2, R * k * 4, n * R * 4, T * R * 4
    moved = {
        "down": x + a + u,  # u = x A^T
        "up": 2 * g + u + b,  # out = base + s u B^T
        "grad_u": g + b + u,  # du = g B s
        "grad_b": g + u + b,  # dB = g^T u s
        "grad_ub": g + u + b + u + b,  # du and dB
        "grad_a": u + x + a,  # dA = du^T x
        "grad_x": u + a + x,  # dx = du A
    }
    return moved[kernel.rstrip("0123456789")] / COPY_RATE * 1e6


def spelling(x, res, A, B):
    """peft's adapter path on a base output `res`."""
    return (res + F.linear(F.linear(x.to(A.dtype), A), B) * SCALE).to(res.dtype)


def tensors(rows: int, k: int, n: int, seed: int = 0, dev: str = "cuda") -> dict:
    torch.manual_seed(seed)
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
        _OTHER_UB: _other_ub(lambda: triton.testing.do_bench(lambda: kernelgraft_path(t))),
        "kernelgraft, float32 long sums": _long_sums_f32(lambda: triton.testing.do_bench(lambda: kernelgraft_path(t))),
    }


@contextlib.contextmanager
def _set(module, **values):
    """module's attributes set to `values` inside the block, restored after it."""
    was = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in was.items():
            setattr(module, k, v)


def _long_sums_f32(fn):
    """fn() with the blocks' sums over a long width (u, du) added in float32 instead of float64."""
    with _set(source, LONG_SUMS="float32"):
        return fn()


# the ops table's column of the other way of making du and dB than the table's (FUSED_UB)
_OTHER_UB = "kernelgraft, du and dB " + ("apart" if K.FUSED_UB else "from one read")


def _other_ub(fn):
    """fn() with du and dB made the other way than the table's: from one read of the output's
    gradient (grad_ub) or apart (grad_u and grad_b, each reading it)."""
    with _set(K, FUSED_UB=not K.FUSED_UB):
        return fn()


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


# cases drawn by the thorough profile that a build failed: (rows, width, dtype, values, seed) of
# the `lora.peft` spelling's example (on an H200, dA against the rule's bound: 8.1e-7 against
# 4.82e-7 with du's products 64 columns wide, then 3.3e-6 against 8.6e-7 with 16)
HARD = [(38, 65536, torch.bfloat16, "constant_rows", 38), (4, 65536, torch.float16, "constant_rows", 29130)]
# candidates: kernel -> (rows, columns, warps), grad_ub's column blocks a program, how du's products
# are taken (source.DU_PRODUCTS: float64, or two TF32 passes) over how many columns each
# (source.DU_COLUMNS; 0: one per block of 64), and whether du and dB come from one read of the
# output's gradient (grad_ub, whose du partial sums per column group are float64: as many bytes as
# g itself at 64 columns a block) or apart (grad_u summing the whole width in registers, grad_b)
CANDIDATES = {
    "du and dB apart (grad_u, grad_b), du in TF32 passes of 16 columns: the table's": ({}, None, (16, "tf32x2"), False),
    "du and dB from one read (grad_ub)": ({}, None, (16, "tf32x2"), True),
    "grad_ub, du in float64": ({}, None, (16, "float64"), True),
    "grad_ub, 2 column blocks a program": ({}, 2, (16, "tf32x2"), True),
    "grad_ub, 128 columns a block": ({"grad_ub": (64, 128, 4)}, None, (16, "tf32x2"), True),
}


@contextlib.contextmanager
def _candidate_set(tiles: dict, ub_blocks: int | None, du: tuple, fused: bool | None = None):
    """GPU_TILES, GPU_UB_BLOCKS, FUSED_UB, DU_COLUMNS and DU_PRODUCTS as a candidate sets them
    (None: the table's), inside the block."""
    tiles = {**K.GPU_TILES, **tiles}
    fused = K.FUSED_UB if fused is None else fused
    with (
        _set(K, GPU_TILES=tiles, GPU_UB_BLOCKS=ub_blocks or K.GPU_UB_BLOCKS, FUSED_UB=fused),
        _set(source, DU_COLUMNS=du[0], DU_PRODUCTS=du[1]),
    ):
        yield


def hard(dev: str = "cuda", cases=None, pairs=None, rows: int = T) -> dict:
    """Each candidate: the rule's verdicts on the hard cases and the backward's ms summed over the
    pairs (`triton.testing.do_bench`; on the CPU one call's, the interpreter's)."""
    import triton

    from kernelgraft.gradcheck.spelling import check_spelling
    from kernelgraft.gradcheck.strategies import _values, on_device
    from kernelgraft.kernels import fallback
    from kernelgraft.patterns import REGISTRY

    peft = next(s for s in REGISTRY.spellings() if s.qualname == "lora.peft")
    out = {}
    for name, candidate in CANDIDATES.items():
        # each candidate afresh: a kernel that failed under another's tiles is tried again (its
        # failure is in that candidate's verdicts)
        fallback.forget_failures()
        verdicts, ms = [], 0.0
        for r, n, dtype, values, seed in cases or HARD:
            args = on_device(_values(peft.example_args(r, n, dtype, seed), values), dev)
            try:  # a candidate that fails (a launch Triton refuses, a kernel that fell back) is said
                with _candidate_set(*candidate):
                    failed = [str(v) for v in check_spelling(peft, args, compile_ref=False) if not v.ok]
            except Exception as e:  # noqa: BLE001
                failed = [f"error: {type(e).__name__}: {e}"[:300]]
            verdicts.append(dict(case=f"{r} x {n} {str(dtype)[6:]} {values}", failed=failed))
        for k, n in pairs or PAIRS:
            t = tensors(rows, k, n, dev=dev)
            _, u = K.forward(t["x"], t["res"], t["A"], t["B"], SCALE)
            bwd = functools.partial(K.backward, t["g"], t["x"], t["A"], t["B"], u, SCALE, (True, True, True))
            try:
                with _candidate_set(*candidate):
                    ms += triton.testing.do_bench(bwd) if dev == "cuda" else _once(bwd)
            except Exception:  # noqa: BLE001
                ms = float("nan")
        out[name] = dict(cases=verdicts, backward_ms=ms)
        print(name, out[name], flush=True)
    return out


def _once(fn) -> float:
    """ms of one call."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


STAGES_DEFAULT = 3  # Triton's num_stages on CUDA where none is given


def table_tile(kn: str) -> tuple:
    """The (rows, columns, warps, stages) a kernel runs with at rank 16 on the GPU today."""
    return (*K.GPU_TILES[kn], K.GPU_STAGES.get(kn, STAGES_DEFAULT))


def tiles(kernels: set | None = None) -> dict:
    import triton

    got: dict = {}
    for k_in, n in PAIRS:
        t = tensors(T, k_in, n)
        pair = f"{k_in}->{n}"
        for tile in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3, 4)):
            for kn, fn in _launches(t, *tile).items():
                if kernels and kn not in kernels:
                    continue
                try:
                    ms = triton.testing.do_bench(fn, warmup=5, rep=15)
                except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory): skipped
                    print(f"{pair} {kn} {tile}: {type(e).__name__}", flush=True)
                    continue
                got.setdefault(kn, {}).setdefault(str(tile), {})[pair] = ms
        print(pair, flush=True)
    return got


def fills(kernels: set | None = None) -> dict:
    import triton

    got: dict = {}
    for k_in, n in PAIRS:
        t = tensors(T, k_in, n)
        pair = f"{k_in}->{n}"
        for fill in (0, 1, 2, 4, 8):
            runs = {
                kn: fn
                for kn, fn in _launches(t, fills={k: fill for k in K.GPU_FILL}).items()
                if kn in K.GPU_FILL and (not kernels or kn in kernels)
            }
            for kn, fn in runs.items():
                if fill == 0 and kn not in ("grad_u", "down"):
                    continue  # a weight gradient's sum over the rows is always split
                got.setdefault(kn, {}).setdefault(str(fill), {})[pair] = triton.testing.do_bench(
                    fn, warmup=5, rep=15
                )
        print(pair, flush=True)
    return got


def blocks() -> dict:
    import triton

    got: dict = {}
    for k_in, n in PAIRS:
        t = tensors(T, k_in, n)
        for m in K.UB_BLOCKS:
            fn = _launches(t, ub_blocks=m)["grad_ub"]
            got.setdefault(str(m), {})[f"{k_in}->{n}"] = triton.testing.do_bench(fn, warmup=5, rep=15)
        print(k_in, n, {m: got[str(m)][f"{k_in}->{n}"] for m in K.UB_BLOCKS}, flush=True)
    return got


def _launches(t: dict, BT=None, BN=None, warps=None, stages=None, fills=None, ub_blocks: int = 1) -> dict:
    """Each LoRA kernel's launch on t's shapes (rank 16: BR 16) with one tile (None: each kernel's
    table tile) and the splits GPU_FILL (or `fills`) gives, as a thunk: du's split sums added as
    the backward adds them."""
    x, base, A, B, g = t["x"], t["res"], t["A"], t["B"], t["g"]
    dev, T = x.device, x.shape[0]  # the rows of t (16384 on the GPU; a few in a CPU test)
    mod, name = K.kernels(torch.bfloat16, torch.float32, torch.bfloat16, dev.type)
    k_in, n = x.shape[1], base.shape[1]
    out, dx = torch.empty_like(base), torch.empty_like(x)
    u, du = torch.randn(T, R, device=dev), torch.randn(T, R, device=dev)
    fill = dict(K.GPU_FILL, **(fills or {}))
    gw, sgw = K._words(g, torch.bfloat16, torch.float32)  # g as du's kernels read it

    def cfg(kn):
        bt, bn, w, st = table_tile(kn) if BT is None else (BT, BN, warps, stages)
        return bt, bn, dict(BR=16, num_warps=w, num_stages=st, **K._options(A, x))

    def kern(e):
        return getattr(mod, f"{name}_{e}")

    def grad_u():
        bt, bn, m = cfg("grad_u")
        ns, cols = K._splits(n, cdiv(T, bt), bn, dev, fill["grad_u"]) if fill["grad_u"] else (1, n)
        if ns == 1:
            kern("grad_u")[(cdiv(T, bt), 1)](
                g, gw, B, du, SCALE, T, n, R, n, sgw, R, R, n, BT=bt, BN=bn, SPLIT=False, **m
            )
            return
        part = torch.empty((ns, T, R), dtype=torch.float64, device=dev)
        kern("grad_u")[(cdiv(T, bt), ns)](
            g, gw, B, part, SCALE, T, n, R, n, sgw, R, R, cols, BT=bt, BN=bn, SPLIT=True, **m
        )
        part.sum(0)

    def down():
        bt, bk, m = cfg("down")
        ns, cols = K._splits(k_in, cdiv(T, bt), bk, dev, fill["down"]) if fill["down"] else (1, k_in)
        if ns == 1:
            kern("down")[(cdiv(T, bt), 1)](x, A, u, T, k_in, R, k_in, k_in, R, k_in, BT=bt, BK=bk, SPLIT=False, **m)
            return
        part = torch.empty((ns, T, R), dtype=torch.float64, device=dev)
        kern("down")[(cdiv(T, bt), ns)](x, A, part, T, k_in, R, k_in, k_in, R, cols, BT=bt, BK=bk, SPLIT=True, **m)
        part.sum(0).float()

    def grad_ub():
        bt, bn, m = cfg("grad_ub")
        C = cdiv(n, bn * ub_blocks)
        ns, rows = K._splits(T, C, bt, dev, fill["grad_ub"])
        dupart = torch.empty((C, T, R), dtype=torch.float64, device=dev)
        dbpart = torch.empty((ns, n, R), device=dev)
        kern("grad_ub" if ub_blocks == 1 else f"grad_ub{ub_blocks}")[(C, ns)](
            g, gw, B, u, dupart, dbpart, SCALE, T, n, R, n, sgw, R, R, rows, BT=bt, BN=bn, **m
        )
        dupart.sum(0), dbpart.sum(0)

    def summed(kn, width, launch):
        bt, bn, m = cfg(kn)
        ns, rows = K._splits(T, cdiv(width, bn), bt, dev, fill[kn])
        part = torch.empty((ns, *((width, R) if kn == "grad_b" else (R, width))), device=dev)
        launch(bt, bn, m, ns, rows, part)
        if ns > 1:
            part.sum(0)

    def run(kn, grid, args, cols="BN"):
        bt, bn, m = cfg(kn)
        kern(kn)[grid(bt, bn)](*args(bt, bn), BT=bt, **{cols: bn}, **m)

    return {
        "down": down,
        "up": lambda: run(
            "up", lambda bt, bn: (cdiv(T, bt), cdiv(n, bn)),
            lambda bt, bn: (out, base, u, B, SCALE, T, n, R, n, n, R, R),
        ),
        "grad_u": grad_u,
        "grad_b": lambda: summed(
            "grad_b", n,
            lambda bt, bn, m, ns, rows, part: kern("grad_b")[(cdiv(n, bn), ns)](
                g, u, part, SCALE, T, n, R, n, R, rows, BT=bt, BN=bn, **m
            ),
        ),
        "grad_ub": grad_ub,
        "grad_a": lambda: summed(
            "grad_a", k_in,
            lambda bt, bn, m, ns, rows, part: kern("grad_a")[(cdiv(k_in, bn), ns)](
                du, x, part, T, k_in, R, R, k_in, rows, BT=bt, BK=bn, **m
            ),
        ),
        "grad_x": lambda: run(
            "grad_x", lambda bt, bn: (cdiv(T, bt), cdiv(k_in, bn)),
            lambda bt, bn: (dx, du, A, T, k_in, R, k_in, R, k_in), cols="BK",
        ),
    }  # fmt: skip


def _fastest(runs: dict, title: str, what: str, table) -> list[str]:
    """Per kernel, its device time summed over the four pairs with the table's setting and with the
    fastest (a setting that failed on a pair is not a candidate), and the least time the tensors it
    must move allow at the card's copy rate (floor_us), as a share of the fastest's."""
    lines = [f"**each kernel summed over the four pairs, us: {title}**", ""]
    lines += [
        f"| kernel | table's {what} | us | fastest | us | memory floor, us | floor / fastest |",
        "|---|---|---|---|---|---|---|",
    ]
    for kn, by in runs.items():
        most = max(len(v) for v in by.values())
        tot = {k: sum(v.values()) * 1e3 for k, v in by.items() if len(v) == most}
        best, mine = min(tot, key=tot.get), str(table(kn))
        at = f"{tot[mine]:.0f}" if mine in tot else "-"
        floor = sum(floor_us(kn, pair) for pair in by[best])
        lines.append(f"| {kn} | {mine} | {at} | {best} | {tot[best]:.0f} | {floor:.0f} | {floor / tot[best]:.0%} |")
    return lines + [""]


def markdown(res: dict) -> str:
    lines = [f"LoRA kernels, {res['device']}, {res['date']}, torch {res['torch']}, 16384 rows, rank 16", ""]
    if "ops" in res:
        lines += [
            "**fwd+bwd of one adapted linear, ms**",
            "",
            f"| in->out | eager | torch.compile | kernelgraft | {_OTHER_UB} | kernelgraft, float32 long sums |",
        ]
        lines += ["|---|---|---|---|---|---|"]
        lines += [
            f"| {r['pair']} | {r['eager']:.3f} | {r['torch.compile']:.3f} | {r['kernelgraft']:.3f} | "
            f"{r.get(_OTHER_UB, float('nan')):.3f} | "
            f"{r.get('kernelgraft, float32 long sums', float('nan')):.3f} |"
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
        title = "the table's (rows, columns, warps, stages) and the fastest"
        lines += _fastest(res["tiles"], title, "tile", table_tile)
    if "fills" in res:
        title = "the table's programs per SM for the split sums and the fastest"
        lines += _fastest(res["fills"], title, "fill", lambda kn: K.GPU_FILL[kn])
    if "blocks" in res:
        pairs = list(next(iter(res["blocks"].values())))
        lines += ["**grad_ub, us, by column blocks a program**", ""]
        lines += ["| blocks | " + " | ".join(pairs) + " | sum |", "|---" * (len(pairs) + 2) + "|"]
        for m, by in res["blocks"].items():
            us = [by[p] * 1e3 for p in pairs]
            lines.append(f"| {m} | " + " | ".join(f"{v:.0f}" for v in us) + f" | {sum(us):.0f} |")
        lines.append("")
    if "hard" in res:
        lines += ["**ways of making du and dB on the hard cases: the rule, and the backward's ms over the pairs**", ""]
        lines += ["| candidate | backward ms | case | rule |", "|---|---|---|---|"]
        for name, r in res["hard"].items():
            for c in r["cases"]:
                verdict = "ok" if not c["failed"] else "FAIL: " + "; ".join(c["failed"])
                lines.append(f"| {name} | {r['backward_ms']:.3f} | {c['case']} | {verdict} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--parts", default="ops,accuracy,tiles,fills")
    ap.add_argument("--kernels", default="", help="tiles and fills of these kernels only (comma-separated)")
    a = ap.parse_args()
    only = set(filter(None, a.kernels.split(",")))
    if not torch.cuda.is_available():
        raise SystemExit("tune_lora.py measures the kernels on a GPU: no CUDA device here")
    res = dict(
        device=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
    )
    os.makedirs(a.out, exist_ok=True)
    for part in a.parts.split(","):  # written after each part: a run cut short keeps what it measured
        run = {
            "ops": ops, "accuracy": accuracy, "tiles": lambda: tiles(only), "fills": lambda: fills(only),
            "blocks": blocks, "hard": hard,
        }  # fmt: skip
        res[part] = run[part]()
        failed = failed_kernels_note(res)
        with open(os.path.join(a.out, "tune_lora.json"), "w") as f:
            json.dump(res, f, indent=1)
        md = markdown(res) + failed
        with open(os.path.join(a.out, "tune_lora.md"), "w") as f:
            f.write(md)
    print(md)


if __name__ == "__main__":
    main()
