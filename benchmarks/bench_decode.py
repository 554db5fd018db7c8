"""Greedy decoding, where the host is in the loop: `model.generate()` of a random-weight model of the
Llama-3.2-1B shape, a 128-token prompt and 64 new tokens at batch 1 and 8, bf16, for eager,
torch.compile, and kernelgraft (inductor and eager backends), side by side in one process.

Per mode and batch: tokens/s (the median of timed calls after the first; the modes are timed in
turns, one `generate()` each per round), each round's time over torch.compile's, the first call's seconds
(compiles included), and how many sequences are token for token eager's (random weights make
near-ties between the top two logits, where any other rounding may pick the other token: the first
position where a sequence leaves eager's is reported with the gap between eager's top two logits
there, so a divergence at a near-tie can be told from one that is not). With --cold each mode runs
in a process of its own with fresh compile caches (its first generate() then pays every compile, as
a user's first call does; the rounds are timed beside eager's in that process).

    python benchmarks/bench_decode.py [--out DIR] [--batches 1,8] [--prompt 128] [--new 64] [--rounds 5] [--cold]
        -> DIR/decode.json, DIR/decode.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from benchlib import cache_env, failed_kernels_note, names  # noqa: E402
from suite import SHAPES, apply_mode  # noqa: E402

MODES = ("eager", "torch.compile", "kernelgraft (inductor)", "kernelgraft (eager)")
SHAPE = "llama-1b 8x2048"  # the model; the batch and lengths are decoding's own


def build(mode: str, cfg: dict | None = None, device: str = "cuda", dtype=torch.bfloat16):
    """A random-weight Llama (the 1B shape unless `cfg`), in eval mode, as `mode` runs it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **(cfg if cfg is not None else SHAPES[SHAPE]["cfg"]))
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.eval()
    return apply_mode(model, mode)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _request(model, batch: int, prompt: int, new: int, device: str):
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(batch * 1000 + prompt)
    ids = torch.randint(0, vocab, (batch, prompt), generator=g).to(device)
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    return ids, kw


def timed_generate(model, ids, kw, device: str):
    """One greedy generate(): (its output, its wall seconds)."""
    with torch.no_grad():
        _sync(device)
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync(device)
    return out, time.perf_counter() - t


def compile_marks() -> tuple[dict, int]:
    """torch's compile clocks (seconds by the timed function's name) and its count of graphs so far."""
    from torch._dynamo import utils

    clocks = getattr(utils, "compilation_time_metrics", {})
    return {k: sum(v) for k, v in clocks.items()}, utils.counters["stats"]["unique_graphs"]


def compile_work(before: tuple[dict, int]) -> dict:
    """What a call compiled since `before` (compile_marks()): the graphs dynamo made, and the
    seconds of torch's compile stages (dynamo's frame compiles, the backend's, inductor's code
    generation, its wait for Triton builds) that grew, largest first."""
    clocks, graphs = compile_marks()
    grew = {k: round(v - before[0].get(k, 0.0), 2) for k, v in clocks.items()}
    stages = dict(sorted(((k, v) for k, v in grew.items() if v >= 0.05), key=lambda kv: -kv[1])[:12])
    return dict(graphs=graphs - before[1], seconds=stages)


def _result(out, again, first: float, times: list, batch: int, prompt: int, new: int) -> dict:
    med = sorted(times)[len(times) // 2]
    return dict(
        tok_s=batch * new / med,
        first_call_s=first,
        times_ms=[round(x * 1e3, 2) for x in times],
        repeatable=bool(torch.equal(out, again)),
        prompt_tokens=prompt,
        new_tokens=new,
        tokens=out[:, prompt:].tolist(),
        prompt=out[:, :prompt].tolist(),
    )


def top_two_gap(model, prompt: list, tokens: list, at: int, device: str) -> float:
    """The gap between the top two logits the (eager) model gives after `prompt` + tokens[:at]."""
    seq = torch.tensor([prompt + tokens[:at]], device=device)
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def agreement(ref: dict, got: dict, eager_model=None, device: str = "cuda") -> dict:
    """How many of `got`'s sequences are token for token `ref`'s; where one leaves it, the position
    and (with `eager_model`) the gap between eager's top two logits there."""
    same, where = 0, []
    for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])):
        if a == b:
            same += 1
            continue
        at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        gap = top_two_gap(eager_model, ref["prompt"][i], a, at, device) if eager_model is not None else None
        where.append(dict(sequence=i, position=at, top_two_gap=gap))
    return dict(identical=same, of=len(ref["tokens"]), diverged=where)


def run(batches=(1, 8), prompt=128, new=64, modes=MODES, device="cuda", cfg=None, dtype=torch.bfloat16, rounds=5):
    """Every mode at every batch -> {f"batch {B}": {mode: result}}, eager first (the reference).

    All modes are built first and make their first call (compiles included); then `rounds` rounds
    time one generate() per mode, the order rotated each round, so that a change of the host's
    speed during the run falls on every mode alike. Each mode's tokens/s is from the median of its
    rounds; `vs_compile_rounds` is its time over torch.compile's in the same round, per round."""
    modes = ["eager"] + [m for m in modes if m != "eager"]
    eager_model = build("eager", cfg, device, dtype)
    res: dict = {f"batch {B}": {} for B in batches}
    models: dict = {}
    for mode in modes:
        try:
            models[mode] = eager_model if mode == "eager" else build(mode, cfg, device, dtype)
        except Exception as e:  # noqa: BLE001 - a failing mode is reported, the others still run
            traceback.print_exc()
            for B in batches:
                res[f"batch {B}"][mode] = dict(error=f"{type(e).__name__}: {e}"[:300])
    for B in batches:
        key = f"batch {B}"
        firsts: dict = {}
        for mode, model in list(models.items()):
            try:
                ids, kw = _request(model, B, prompt, new, device)
                before = compile_marks()
                out, t = timed_generate(model, ids, kw, device)
                firsts[mode] = (ids, kw, out, t, compile_work(before))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                res[key][mode] = dict(error=f"{type(e).__name__}: {e}"[:300])
        times: dict = {m: [] for m in firsts}
        last: dict = {}
        order = list(firsts)
        for r in range(rounds):
            for mode in order[r % len(order) :] + order[: r % len(order)]:
                ids, kw = firsts[mode][:2]
                last[mode], t = timed_generate(models[mode], ids, kw, device)
                times[mode].append(t)
        for mode, (_, _, out, first, work) in firsts.items():
            r = _result(out, last.get(mode, out), first, times[mode] or [first], B, prompt, new)
            r["first_call_compiled"] = work
            rep = getattr(models[mode], "kernelgraft_report", None)
            if rep is not None:
                r["captured"] = rep.captured_as.get("kind", "?")
                r["wrappers"] = dict(rep.wrappers)  # inductor's graphs by the language that launches their kernels
            if "torch.compile" in times and times[mode]:
                per = sorted(a / b for a, b in zip(times[mode], times["torch.compile"]))
                r["vs_compile_rounds"] = [round(x, 3) for x in per]
            ref = res[key].get("eager")
            if ref is not None:
                r["agreement"] = agreement(ref, r, eager_model, device)
            res[key][mode] = r
            print(mode, B, {k: v for k, v in r.items() if k not in ("tokens", "prompt")}, flush=True)
    models.clear()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def cold_runs(batches, prompt: int, new: int, modes, rounds: int, out: str, run=subprocess.run) -> dict:
    """Every mode but eager in a process of its own whose compile caches (inductor's, Triton's,
    kernelgraft's) are fresh, so that its first generate() is a cold start, as a user's first is;
    its rounds are timed in that process beside eager's. -> run()'s result, eager's from the first
    process. `run`: how a process is run (subprocess.run)."""
    import tempfile

    res: dict = {f"batch {B}": {} for B in batches}
    for mode in [m for m in modes if m != "eager"]:
        with tempfile.TemporaryDirectory(prefix="kg_decode_") as folder:
            argv = [
                sys.executable, os.path.abspath(__file__), "--out", os.path.join(folder, "out"),
                "--batches", ",".join(map(str, batches)), "--prompt", str(prompt), "--new", str(new),
                "--modes", mode, "--rounds", str(rounds),
            ]  # fmt: skip
            done = run(argv, env={**os.environ, **cache_env(folder)}, capture_output=True, text=True)
            try:
                got = json.load(open(os.path.join(folder, "out", "decode.json")))["decode"]
            except (OSError, ValueError, KeyError):
                tail = (getattr(done, "stderr", "") or "").strip().splitlines()[-1:] or ["no output"]
                for key in res:
                    res[key][mode] = dict(error=f"its process failed: {tail[0]}"[:300])
                continue
            for key, modes_got in got.items():
                for m, r in modes_got.items():
                    if m == mode or (m == "eager" and "eager" not in res[key]):
                        res[key][m] = r
    return {key: dict(sorted(v.items(), key=lambda kv: kv[0] != "eager")) for key, v in res.items()}


def markdown(res: dict) -> str:
    L = []
    for key, modes in res.items():
        lengths = next((r for r in modes.values() if "new_tokens" in r), None)
        prompt, new = (lengths["prompt_tokens"], lengths["new_tokens"]) if lengths else ("?", "?")
        eager = modes.get("eager", {}).get("tok_s")
        comp = modes.get("torch.compile", {}).get("tok_s")
        L += [
            f"\n**Greedy decoding, {key}** ({prompt}-token prompt, {new} new tokens)\n",
            "| mode | tokens/s | vs eager | vs compile | time over torch.compile's, median (range) of the rounds | first generate() s | sequences as eager's |",
            "|---|---|---|---|---|---|---|",
        ]
        for m, r in modes.items():
            if "error" in r:
                L.append(f"| {m} | error: {r['error'][:80]} | | | | | |")
                continue
            ve = f"{r['tok_s'] / eager:.2f}x" if eager else "-"
            vc = f"{r['tok_s'] / comp:.2f}x" if comp else "-"
            a = r.get("agreement")
            same = "reference" if a is None else f"{a['identical']} of {a['of']}"
            if a and a["diverged"]:
                gaps = [d["top_two_gap"] for d in a["diverged"] if d["top_two_gap"] is not None]
                if gaps:
                    same += f" (largest top-two gap where one left: {max(gaps):.3g})"
            per = r.get("vs_compile_rounds")
            rounds = f"{per[len(per) // 2]:.3f} ({per[0]:.3f}-{per[-1]:.3f})" if per else "-"
            L.append(f"| {m} | {r['tok_s']:,.1f} | {ve} | {vc} | {rounds} | {r['first_call_s']:.1f} | {same} |")
        L.append("")
        for m, r in modes.items():
            work = r.get("first_call_compiled")
            if work and work["graphs"]:
                top = ", ".join(f"{k} {v:.1f} s" for k, v in list(work["seconds"].items())[:4])
                L.append(f"- {m}: its first generate() compiled {work['graphs']} graph(s); torch's compile clocks: {top}")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--modes", default=",".join(MODES), help="modes, comma-separated (a comma inside parentheses does not split)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, every mode once per round")
    ap.add_argument(
        "--cold", action="store_true",
        help="each mode in a process of its own with fresh compile caches: its first generate() is a cold start",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode: needs a CUDA GPU (the numbers are GPU timings)", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    batches = tuple(int(b) for b in a.batches.split(","))
    modes = tuple(names(a.modes))
    if a.cold:
        res = cold_runs(batches, a.prompt, a.new, modes, a.rounds, a.out)
    else:
        res = run(batches, a.prompt, a.new, modes, rounds=a.rounds)
    day = datetime.date.today().isoformat()
    doc = dict(date=day, gpu=torch.cuda.get_device_name(), decode=res, cold=a.cold)
    failed = failed_kernels_note(doc)
    json.dump(doc, open(os.path.join(a.out, "decode.json"), "w"), indent=1)
    md = f"Greedy decoding, bf16, {doc['gpu']}, {doc['date']}\n" + markdown(res) + failed
    open(os.path.join(a.out, "decode.md"), "w").write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
