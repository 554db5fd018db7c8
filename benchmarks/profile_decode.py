"""Where greedy decoding's time goes, per mode, side by side in one process: one `generate()` of the
Llama-3.2-1B shape (bench_decode.py's model and request), its wall time, the kernels it launches
(in all, per new token, and by kernel name with their device time), the graphs dynamo compiled for
it, and the Python functions that took the most host time (cProfile).

    python benchmarks/profile_decode.py [--batch 1] [--new 32] [--modes "torch.compile,kernelgraft (inductor)"]
        -> OUT/profile_decode.json, OUT/profile_decode.md
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from bench_decode import _request, build, timed_generate  # noqa: E402


def _host_functions(pr: cProfile.Profile, top: int) -> list[dict]:
    """cProfile's functions with the most own time: file:line(name), calls, own and cumulative ms."""
    st = pstats.Stats(pr)
    rows = []
    for (file, line, name), (_cc, calls, own, cum, _callers) in st.stats.items():
        rows.append(
            dict(
                function=f"{os.path.basename(file)}:{line}({name})",
                calls=calls,
                own_ms=own * 1e3,
                cum_ms=cum * 1e3,
            )
        )
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


def profile_mode(
    mode: str, batch: int, prompt: int, new: int, calls: int = 3, top: int = 25,
    device: str = "cuda", cfg: dict | None = None, dtype=torch.bfloat16,
) -> dict:  # fmt: skip
    """One mode's profile (the model built as bench_decode.build builds it; `cfg` a smaller one).
    On the CPU no kernels are counted (0): the host side alone."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build(mode, cfg=cfg, device=device, dtype=dtype)
    ids, kw = _request(model, batch, prompt, new, device)
    out, first = timed_generate(model, ids, kw, device)
    walls = [timed_generate(model, ids, kw, device)[1] for _ in range(calls)]
    graphs = dict(counters["stats"])
    breaks = sum(counters["graph_break"].values())
    kernels = []
    if device.startswith("cuda"):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            timed_generate(model, ids, kw, device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict = {}
    for e in kernels:
        ms, n = by_name.get(e.name, (0.0, 0))
        by_name[e.name] = (ms + e.device_time / 1e3, n + 1)
    top_kernels = sorted(((n, ms, k[:100]) for k, (ms, n) in by_name.items()), reverse=True)[:top]
    pr = cProfile.Profile()
    pr.enable()
    timed_generate(model, ids, kw, device)
    pr.disable()
    res = dict(
        first_call_s=first,
        wall_ms=sorted(walls)[len(walls) // 2] * 1e3,
        tok_s=batch * new / (sorted(walls)[len(walls) // 2]),
        kernels=len(kernels),
        kernels_per_token=len(kernels) / new,
        device_ms=sum(e.device_time for e in kernels) / 1e3,
        dynamo=graphs,
        graph_breaks=breaks,
        top_kernels=[dict(count=n, ms=ms, kernel=k) for n, ms, k in top_kernels],
        host_functions=_host_functions(pr, top),
    )
    rep = getattr(model, "kernelgraft_report", None)
    if rep is not None:
        res["launched_by"] = dict(rep.launched_by)
        res["sites"] = rep.counts()
        res["left_to_inductor"] = sum(f.reason.startswith("left to inductor") for f in rep.current().fallbacks)
    model.to("meta")
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def markdown(doc: dict) -> str:
    L = [
        f"**One greedy `generate()`, batch {doc['batch']}, {doc['prompt']}-token prompt, {doc['new']} new tokens** "
        f"({doc['gpu']}, torch {doc['torch']})\n",
        "| mode | wall ms | tokens/s | kernels | kernels per new token | device ms | graphs compiled | graph breaks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, r in doc["modes"].items():
        L.append(
            f"| {m} | {r['wall_ms']:.1f} | {r['tok_s']:.1f} | {r['kernels']} | {r['kernels_per_token']:.1f} | "
            f"{r['device_ms']:.2f} | {r['dynamo'].get('unique_graphs', '-')} | {r['graph_breaks']} |"
        )
    for m, r in doc["modes"].items():
        L += [f"\n{m}: kernels by launches (one generate())\n", "| launches | ms | kernel |", "|---|---|---|"]
        L += [f"| {k['count']} | {k['ms']:.3f} | `{k['kernel']}` |" for k in r["top_kernels"]]
    for m, r in doc["modes"].items():
        L += [
            f"\n{m}: host time by function (one generate())\n",
            "| own ms | cumulative ms | calls | function |",
            "|---|---|---|---|",
        ]
        L += [
            f"| {f['own_ms']:.1f} | {f['cum_ms']:.1f} | {f['calls']} | `{f['function']}` |"
            for f in r["host_functions"]
        ]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--modes", default="eager,torch.compile,kernelgraft (inductor)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    doc = dict(
        batch=a.batch,
        prompt=a.prompt,
        new=a.new,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        modes={},
    )
    for mode in a.modes.split(","):
        doc["modes"][mode] = profile_mode(mode, a.batch, a.prompt, a.new)
        r = doc["modes"][mode]
        print(
            mode,
            {k: r[k] for k in ("wall_ms", "tok_s", "kernels_per_token", "device_ms", "graph_breaks")},
            flush=True,
        )
    json.dump(doc, open(os.path.join(a.out, "profile_decode.json"), "w"), indent=1)
    md = markdown(doc)
    open(os.path.join(a.out, "profile_decode.md"), "w").write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
