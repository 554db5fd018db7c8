"""Launch configs of the generated row kernels, swept on a GPU: device time of each forward and backward
launch (a CUDA graph replayed: no host in the loop) for every (BLOCK_M, num_warps[, programs per SM,
row length of the flat re-cut]) tried, next to the config the launch table
(kernelgraft/kernels/rows/launch_configs.json) gives.

    python benchmarks/tune_rows.py [--out DIR] [--quick] [--write-table]
        -> DIR/tune_rows.json, DIR/tune_rows.md; with --write-table, the best column-summing
           backward configs of the norms written into the launch table

Each config's outputs are checked against the default config's: a forward must be bitwise equal (rows
are independent), a backward's per-element gradients too; per-column gradients (summed by a different
number of programs) to 1e-2 relative, and their largest difference is reported."""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os

import torch
from benchlib import COPY_RATE

from kernelgraft.kernels.rows import build, launch, layout, tuning
from kernelgraft.patterns import REGISTRY


def cases(quick: bool, dtype: torch.dtype = torch.bfloat16):
    """The cases swept. float32: the RMSNorm rows only (the kernels that compute in float64:
    codegen.in_float64), whose launch configs were tuned for bf16."""
    bf = dict(device="cuda", dtype=dtype)
    torch.manual_seed(0)
    out = []
    for M, N in [(16384, 4096)] + ([] if quick else [(16384, 2048), (4096, 4096), (65536, 128)]):
        if (M, N) == (4096, 4096) and dtype != torch.float32:
            continue
        x, w = torch.randn(M, N, **bf), torch.randn(N, **bf)
        out.append(
            (
                f"RMSNorm {M}x{N}",
                REGISTRY.get("rms_norm", "llama"),
                [(x, w, 1e-6)],
                [True, True],
                2 * M * N * x.element_size(),
                3 * M * N * x.element_size(),
            )
        )
    if dtype == torch.float32:
        return out
    for D in (128,) if quick else (128, 64):  # 64: the Llama-3.2-1B's heads
        B, S = 8, 2048
        q = torch.randn(B, S, 32, D, **bf).transpose(1, 2)
        k = torch.randn(B, S, 8, D, **bf).transpose(1, 2)
        ang = torch.randn(B, 1, S, D // 2, device="cuda").repeat(1, 1, 1, 2)
        cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
        n = (q.numel() + k.numel()) * 2
        out.append((f"RoPE q 8x32x2048x{D}, k 8x8x2048x{D} (one launch)", REGISTRY.get("rope", "rotate_half"),
                [(q, cos, sin), (k, cos, sin)], [True, False, False], 2 * n, 2 * n))  # fmt: skip
    for M, N in [(16384, 14336)] + ([] if quick else [(16384, 8192)]):
        g, u = torch.randn(M, N, **bf), torch.randn(M, N, **bf)
        out.append(
            (
                f"SwiGLU {M}x{N}",
                REGISTRY.get("gated_mlp", "silu"),
                [(g, u)],
                [True, True],
                3 * M * N * 2,
                5 * M * N * 2,
            )
        )
    return out


def trials(N: int, elementwise: bool, sums_columns: bool, quick: bool):
    """(label, config patch) pairs: None is the current default. Programs per SM are varied only where a
    backward sums columns (elsewhere every block is a program)."""
    yield "default", None
    bms, warpss, per_sms = (
        ((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16), (1, 2, 4, 8))
        if not quick
        else ((1, 2, 4, 8, 16, 32), (2, 4, 8, 16), (2, 4, 8))
    )
    BN = tuning.pow2(N)
    flat = (4096, 2048, 1024) if elementwise and not (N <= 4096 and N & (N - 1) == 0) else (None,)
    for C in flat:
        bn = tuning.pow2(C) if C else BN
        for bm, warps in itertools.product(bms, warpss):
            if bm * bn > 32768 or bm * bn < 32 * warps or bm * bn // (32 * warps) > 128:
                continue
            for per_sm in per_sms if sums_columns else per_sms[:1]:
                yield (
                    f"C={C or N} BM={bm} w={warps} P/SM={per_sm}",
                    dict(C=C, BM=bm, warps=warps, per_sm=per_sm),
                )


def patched(cfg):
    """The row kernels launched with one trial config inside the block (None: the table's)."""
    if cfg is None:
        return tuning.trial(None)
    return tuning.trial(tuning.Trial(cfg["BM"], cfg["warps"], cfg["per_sm"], cfg["C"]))


def run_case(name, sp, arg_sets, need, fwd_bytes, bwd_bytes, rounding="fused"):
    from triton.testing import do_bench_cudagraph

    def fwd():
        return launch.forward_group(sp, arg_sets, rounding)

    ref = fwd()
    ref_f, stats = [o for o, _ in ref], [s for _, s in ref]
    grads = [torch.randn_like(o) for o in ref_f]
    needs = [list(need) for _ in arg_sets]  # RoPE: q and k only (cos and sin take no gradient)

    def bwd():
        return launch.backward_group(sp, grads, arg_sets, stats, needs, rounding)

    ref_b = bwd()
    group = layout.groups_of(sp, arg_sets)[0][0]
    k = build.kernel_for(sp, group, rounding)
    col_idx = [i for i, n in enumerate(sp.tensor_names) if group.lay.kinds[n] == "col"]
    rows = {}
    seen_fwd = {}
    for label, cfg in trials(group.lay.N, k.elementwise, bool(col_idx), QUICK):
        try:
            with patched(cfg):
                f_out = [o for o, _ in fwd()]
                same_f = all(torch.equal(a, b) for a, b in zip(f_out, ref_f))
                fkey = None if cfg is None else (cfg["C"], cfg["BM"], cfg["warps"])
                t_f = (
                    seen_fwd.get(fkey)
                    if fkey in seen_fwd
                    else do_bench_cudagraph(fwd, rep=40, return_mode="median")
                )
                seen_fwd[fkey] = t_f
                b_out = bwd()
                t_b = do_bench_cudagraph(bwd, rep=40, return_mode="median")
            col_err, same_b = 0.0, True
            for s_ref, s_new in zip(ref_b, b_out):
                for i, (a, b) in enumerate(zip(s_ref, s_new)):
                    if i in col_idx:
                        col_err = max(
                            col_err,
                            ((a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-30)).item(),
                        )
                    elif not torch.equal(a, b):
                        same_b = False
            ok = same_f and same_b and col_err < 1e-2
            rows[label] = dict(fwd_ms=t_f, bwd_ms=t_b, ok=ok, col_rel_diff=col_err, cfg=cfg)
        except Exception as e:  # noqa: BLE001 - a config that does not compile (registers): noted
            rows[label] = dict(error=f"{type(e).__name__}: {e}"[:160], cfg=cfg)
        print(name, label, rows[label], flush=True)
    good = {k_: v for k_, v in rows.items() if "error" not in v and v["ok"]}
    best_f = min(good, key=lambda k_: good[k_]["fwd_ms"])
    best_b = min(good, key=lambda k_: good[k_]["bwd_ms"])
    return dict(
        width=group.lay.N, sums_columns=bool(col_idx), reduces=bool(k.spec.reductions),
        default_warps=tuning.config(group.lay.M, group.lay.N, group.tensors[sp.tensor_names[0]].device,
                                    sums_columns=True, reduces=bool(k.spec.reductions))["num_warps"],
        name=name, fwd_floor_ms=fwd_bytes / COPY_RATE * 1e3, bwd_floor_ms=bwd_bytes / COPY_RATE * 1e3,
        default=rows["default"], best_fwd=(best_f, rows[best_f]), best_bwd=(best_b, rows[best_b]),
        bad=[k_ for k_, v in rows.items() if "error" not in v and not v["ok"]], trials=rows,
    )  # fmt: skip


def markdown(doc) -> str:
    L = [f"Row-kernel launch configs, {doc.get('dtype', 'bfloat16')}, {doc['gpu']}, {doc['date']} (device time, CUDA graph replay)\n",
         "| case | launch | floor ms | default ms | best ms | best config | best vs default |",
         "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in doc["results"]:
        for which in ("fwd", "bwd"):
            d = r["default"][f"{which}_ms"]
            label, best = r[f"best_{which}"]
            L.append(
                f"| {r['name']} | {which} | {r[f'{which}_floor_ms']:.3f} | {d:.3f} | {best[f'{which}_ms']:.3f} | "
                f"{label} | {d / best[f'{which}_ms']:.2f}x |"
            )
        if r["bad"]:
            L.append(
                f"| {r['name']} | configs whose numbers differed from the default's: {', '.join(r['bad'][:6])} | | | | | |"
            )
    return "\n".join(L) + "\n"


def table_from(doc) -> dict:
    """The launch table with the column-summing backward of each norm width swept set to its fastest
    config among those that keep the default's num_warps (and so its numbers bit for bit)."""
    table = tuning.load()
    for r in doc["results"]:
        if not (r.get("sums_columns") and r.get("reduces")):
            continue
        same = {k_: v for k_, v in r["trials"].items() if "error" not in v and v["ok"] and v["cfg"]
                and v["cfg"]["warps"] == r["default_warps"] and not v["cfg"]["C"]}  # fmt: skip
        if same:
            best = min(same.values(), key=lambda v: v["bwd_ms"])
            if best["bwd_ms"] < r["default"]["bwd_ms"]:
                table["cuda"]["column_sums"][tuning.pow2(r["width"])] = (best["cfg"]["BM"], best["cfg"]["per_sm"])
    return table


QUICK = False


def main():
    global QUICK
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--quick", action="store_true", help="the reference shapes only, no other widths")
    ap.add_argument("--only", default="", help="cases whose name contains one of these (comma-separated)")
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="float32: the RMSNorm cases only, whose kernels compute in float64",
    )
    ap.add_argument(
        "--write-table",
        action="store_true",
        help="write the fastest column-summing backward configs found into the launch table "
        f"({tuning.TABLE_PATH})",
    )
    a = ap.parse_args()
    QUICK = a.quick
    os.makedirs(a.out, exist_ok=True)
    doc = dict(
        date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), dtype=a.dtype, results=[]
    )
    keep = [k for k in a.only.split(",") if k]
    for case in cases(a.quick, getattr(torch, a.dtype)):
        if keep and not any(k in case[0] for k in keep):
            continue
        doc["results"].append(run_case(*case))
        json.dump(doc, open(os.path.join(a.out, "tune_rows.json"), "w"), indent=1)
        open(os.path.join(a.out, "tune_rows.md"), "w").write(markdown(doc))
    print(markdown(doc))
    if a.write_table:
        tuning.write(table_from(doc))
        print(f"launch table written: {tuning.TABLE_PATH}")


if __name__ == "__main__":
    main()
