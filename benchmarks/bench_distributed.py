"""Distributed training step on the GPUs of one host: eager, torch.compile, kernelgraft and Liger
under PyTorch's own data parallelism, at world size 1 and 2, from one command.

Setups (`--setups`): the per-GPU batch is the one-GPU shape of benchmarks/suite.py (SHAPES, build):
  fsdp2-8b   the Llama-3.1-8B shape, 2x4096 tokens per GPU, FSDP2 (fully_shard per decoder layer,
             then the root)
  fsdp2-8b-keep  the same with fully_shard(..., reshard_after_forward=False): a layer's gathered
             weights stay from its forward to its backward (one all-gather per step, not two;
             the unsharded weights held, 16 GiB for the 8B)
  ddp-1b     the Llama-3.2-1B shape, 8x2048 tokens per GPU, DistributedDataParallel

A step is suite.measure_step's: forward with labels=ids (and use_cache=False: see measure()),
loss.backward(), zero_grad(set_to_none=True), no optimizer; every rank runs its own random batch
(seed + rank). The first step is timed on its own (it compiles), then one warm-up step, then
`--steps` timed steps, each between a barrier and a device synchronize. Reported per (setup, mode, world size): tokens/s per GPU (per-rank tokens over the
slowest rank's median step), the scaling efficiency (tokens/s per GPU at world size N over world size
1), the peak memory per GPU (max over ranks of max_memory_allocated, reset before the timed steps), and
that peak above what the step starts from (weights or shards and the batch: the peers' measure),
the first step's seconds and its loss. At world size 1 the model is measured unwrapped: a plain
one-GPU training step, the baseline of the scaling efficiency (setups of one shape, as with --tiny,
share that run).

Every (setup, world size, mode) runs in a process group of its own, started with torchrun, which
runs this file again in worker mode (Liger patches transformers' classes for the rest of a process;
a fresh process per run keeps every mode clean). A run that fails (exception, OOM, `--timeout`) is
an error row; the others still run. Results merge into DIR/distributed.json (rewritten after every
run; an earlier file in DIR is kept and updated, so a long benchmark can be split over several
commands with the same --out; `--fresh` starts over; or give each command its own --out and join
them with --merge) and DIR/distributed.md. `--repeat N` runs every (setup, world size, mode) N
times, the modes taking turns (run 1 of each mode, then run 2 of each...): a row is then the median
run, with every run's tokens/s; the summary says when the fastest mode's runs overlap another's.
On H200 hosts the same mode moves 2-4 % between runs, more than kernelgraft and Liger differ:
a verdict between them needs this.

`--turns` goes further: one run per (setup, world size) builds every mode's model (Liger's last) and
takes turns step by step, the order rotated each round; Liger's reassigned transformers globals are
swapped in for its steps only. Each mode keeps its row (peak memory above the step's start; the
absolute peak is left out, the other models being resident), and each row also gives its step time
over Liger's in the same round, a round's step being its slowest rank's: the clock drift of a card
at its power limit falls on both steps of a round alike. `--bucket-mb` sets DDP's bucket_cap_mb for
every mode; `--kv-cache` (DDP only) calls the model with its default use_cache, as suite.py does.

    # 2 GPUs of one host (NVLink multicast is switched off in every child: see NO_MULTICAST)
    python benchmarks/bench_distributed.py --out DIR [--setups fsdp2-8b,ddp-1b] \\
        [--modes "eager,torch.compile,kernelgraft (inductor),liger"] [--world-sizes 1,2] [--steps 5] \\
        [--repeat 3] [--turns] [--kv-cache] [--bucket-mb 25] [--profile]
    # CPU smoke test, no GPU: gloo, a tiny Llama in float32, Triton's interpreter
    python benchmarks/bench_distributed.py --out DIR --device cpu --tiny --steps 2 \\
        --modes "eager,kernelgraft (eager)"
    # runs made by several commands (each with its own --out) in one table
    python benchmarks/bench_distributed.py --out DIR --merge A/distributed.json B/distributed.json
    # a PNG of an earlier run (needs matplotlib: run it where that is installed)
    python benchmarks/bench_distributed.py --plot DIR/distributed.json   -> DIR/distributed.png
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import traceback

# NVLink multicast must stay off on the GPU host: set before torch is imported, and passed to
# every torchrun child (they inherit this process's environment).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import suite  # noqa: E402
from benchlib import in_turns, names, paired_ratios, profile_idle, turn_order  # noqa: E402

SETUPS = {
    "fsdp2-8b": dict(shape="llama-8b 2x4096", wrap="fsdp2"),
    "fsdp2-8b-keep": dict(shape="llama-8b 2x4096", wrap="fsdp2-keep"),
    "ddp-1b": dict(shape="llama-1b 8x2048", wrap="ddp"),
}
WRAPPERS = {
    "fsdp2": "FSDP2 (fully_shard per decoder layer, then the root)",
    "fsdp2-keep": "FSDP2, reshard_after_forward=False (each layer's gathered weights kept from its "
    "forward to its backward: no second all-gather, ZeRO-2's traffic)",
    "ddp": "DDP",
}
# --tiny: every setup keeps its wrapper and runs this instead of its shape (float32)
TINY_NAME = "tiny llama 2x16"
TINY = dict(
    arch="llama", B=2, S=16,
    cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256),
)  # fmt: skip
GPU_MODES = ("eager", "torch.compile", "kernelgraft (inductor)", "liger")
CPU_MODES = ("eager", "kernelgraft (eager)")  # what runs on the CPU (the Triton interpreter)
TURNS = "|"  # joins the modes of one --turns run (the worker's --mode)
GOAL = 0.9  # kernelgraft's tokens/s per GPU at world size 2 within 10% of its one-GPU figure


# ---- worker: one rank of one (setup, world size, mode) ---------------------------------------------


def init_rank(device: str, local_rank: int) -> torch.device:
    if device == "cuda":
        torch.cuda.set_device(local_rank)  # "cuda" (suite.build's device) now means this rank's GPU
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=dev)
        return dev
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build_tiny(mode: str, dev: torch.device):
    """suite.build for the tiny config, on `dev`, in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(TINY["arch"], max_position_embeddings=2 * TINY["S"], **TINY["cfg"])
    cfg._attn_implementation = "sdpa"
    with dev:
        model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    return suite.apply_mode(model, mode)


def fully_shard_fn():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def wrap(model, how: str, dev: torch.device, bucket_mb: float | None = None):
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # bucket_mb: DDP's gradient buckets (default 25 MB), which also set where dynamo's
        # DDPOptimizer cuts a compiled graph into pieces: the same for every mode of a run
        size = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
        return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None, **size)
    fully_shard = fully_shard_fn()
    keep = {"reshard_after_forward": False} if how == "fsdp2-keep" else {}
    for layer in model.model.layers:
        fully_shard(layer, **keep)
    return fully_shard(model, **keep)


def prepare(setup: str, mode: str, dev: torch.device, tiny: bool, world: int, bucket_mb: float | None = None):
    """The model of one run, in the same order for every mode (the order tests/helpers/dist_worker.py checks
    under DDP and FSDP2 on gloo):
      1. build it on this rank's device from seed 0 (the same weights on every rank);
      2. apply the mode to the bare model: model.compile(), kernelgraft.optimize() or Liger's patch
         (suite.build does 1 and 2);
      3. then wrap it: DDP(model), or fully_shard(layer) for every decoder layer and then
         fully_shard(model).
    At world size 1 step 3 is skipped: the model is measured unwrapped, a plain one-GPU step.
    Compiled before it is wrapped, the model still runs inside DDP's forward, where dynamo finds the
    active DDP module: DDPOptimizer cuts the graph into pieces at DDP's bucket size, so a compiled
    backward yields its gradients piece by piece (a kernelgraft row's ddp_cuts counts the pieces)."""
    if tiny:
        model = build_tiny(mode, dev)
    else:
        if dev.type != "cuda":
            raise ValueError("the full shapes run on cuda only: pass --tiny with --device cpu")
        model = suite.build(SETUPS[setup]["shape"], mode)
    wrapped = model if world == 1 else wrap(model, SETUPS[setup]["wrap"], dev, bucket_mb)
    return model, wrapped


def make_batch(spec: dict, seed: int, dev: torch.device):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec["cfg"]["vocab_size"], (spec["B"], spec["S"]), generator=g).to(dev)


def make_step(model, ids, kv_cache: bool = False):
    """One training step of `model` on `ids` (no optimizer) -> its loss, read on the host.
    use_cache=False: under FSDP2 dynamo breaks the graph at every sharded layer, and a KV cache
    makes each layer's frame guard on its layer_idx: a recompile per layer, and past dynamo's
    recompile limit (8) the remaining layers run uncompiled. Training needs no cache. kv_cache: the
    model's default instead (it fills a cache in the training forward, as suite.py's step and the
    peers' published benchmark do), for DDP, whose graph is one."""
    cache = {} if kv_cache else {"use_cache": False}

    def step():
        loss = model(input_ids=ids, labels=ids, **cache).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    return step


def measure_turns(a, modes: list[str], dev: torch.device, world: int, ids) -> dict:
    """--turns, one rank: every mode's model built and wrapped in this process (Liger's last: it
    reassigns transformers' globals), then --steps rounds of one step per mode, the order rotated
    each round (benchlib.in_turns), each step under its own mode's globals and after a barrier.
    -> {mode: measure()'s fields, times_s in round order}; peak_gib is left out (the other modes'
    weights are resident), the peak above the step's start is kept."""
    order, _ = turn_order(modes)

    def builder(mode):
        def make():
            model, wrapped = prepare(a.setup, mode, dev, a.tiny, world, a.bucket_mb)
            return model, make_step(wrapped, ids, a.kv_cache)

        return make

    got = in_turns({m: builder(m) for m in order}, a.steps, dev, barrier=dist.barrier)
    out = {}
    for m, v in got.items():
        above = v["peak_above_start"]
        out[m] = dict(
            first_step_s=v["first_step_s"],
            loss=v["loss"],
            peak_gib=None,
            step_s=v["step_s"],
            times_s=v["times_s"],
            peak_above_start_gib=None if above is None else above / 2**30,
            **kernelgraft_fields(v["model"]),
        )
    return out


def kernelgraft_fields(model) -> dict:
    """What a kernelgraft model's report says of its run (nothing for other modes)."""
    if not hasattr(model, "kernelgraft_report"):
        return {}
    rep = model.kernelgraft_report
    return dict(
        sites=rep.counts(),
        # attention masks checked at run time (rewriter/attention.py): [causal, not causal] verdicts
        mask_checks=[sum(c.runs[i] for c in rep.mask_checks) for i in (0, 1)],
        masks_kept=len(rep.masks_kept),
        graphs=rep.graphs,
        ddp_cuts=rep.ddp_cuts,  # DDPOptimizer's cuts: pieces, recomputed calls kept with their readers?
    )


def measure(model, ids, steps: int, dev: torch.device, profile: bool = False, kv_cache: bool = False) -> dict:
    """One rank's timings; the same code for every mode, world size and device. profile: one more
    step under torch.profiler, its device time and the gaps the GPU waited for the host, charged to
    the host op that launched the kernel waited for (benchlib.idle_by_launcher)."""
    cuda = dev.type == "cuda"

    def synchronize():
        if cuda:
            torch.cuda.synchronize(dev)

    step = make_step(model, ids, kv_cache)
    synchronize()
    dist.barrier()
    t = time.perf_counter()
    first_loss = step()
    synchronize()
    first = time.perf_counter() - t
    dist.barrier()
    step()  # warm-up
    synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    # what a step starts from (this rank's weights or shards and the batch; gradients are None):
    # the peak is also reported above it
    base = torch.cuda.memory_allocated(dev) if cuda else None
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - t)
    if profile:
        dist.barrier()
    prof = profile_idle(step, synchronize, cuda) if profile else None
    return dict(
        profile=prof,
        step_s=sorted(times)[len(times) // 2],
        times_s=times,
        first_step_s=first,
        loss=first_loss,
        peak_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
        peak_above_start_gib=(torch.cuda.max_memory_allocated(dev) - base) / 2**30 if cuda else None,
    )


def dynamo_counts() -> dict:
    try:
        from torch._dynamo.utils import counters

        return dict(
            graphs=int(counters["stats"]["unique_graphs"]),
            graph_breaks=int(sum(counters["graph_break"].values())),
        )
    except Exception:  # noqa: BLE001 - a diagnostic only
        return {}


def run_rank(a, rank: int, local_rank: int, world: int) -> dict:
    dev = init_rank(a.device, local_rank)
    spec = TINY if a.tiny else suite.SHAPES[SETUPS[a.setup]["shape"]]
    ids = make_batch(spec, a.seed + rank, dev)
    if TURNS in a.mode:
        out = dict(by_mode=measure_turns(a, a.mode.split(TURNS), dev, world, ids))
    else:
        model, wrapped = prepare(a.setup, a.mode, dev, a.tiny, world, a.bucket_mb)
        out = measure(wrapped, ids, a.steps, dev, profile=a.profile, kv_cache=a.kv_cache)
        out.update(kernelgraft_fields(model))
    out.update(rank=rank, world_size=world, tokens=ids.numel(), dynamo=dynamo_counts())
    if rank == 0:
        out["device_name"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        out["versions"] = ", ".join(f"{p} {version(p)}" for p in ("torch", "triton", "transformers"))
    return out


def version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(package)
    except PackageNotFoundError:
        return "?"


def worker(a) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(os.path.join(a.run_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))  # for the parent, should torchrun not end this rank after a timeout
    path = os.path.join(a.run_dir, f"rank{rank}.json")
    try:
        out, rc = run_rank(a, rank, int(os.environ["LOCAL_RANK"]), world), 0
    except BaseException as e:  # noqa: BLE001 - recorded, then the run fails (torchrun stops the rest)
        traceback.print_exc()
        out, rc = dict(rank=rank, error=f"{type(e).__name__}: {e}"[:500]), 1
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"rank {rank}: {out}", flush=True)
    if dist.is_initialized():
        if rc == 0:
            dist.barrier()
        dist.destroy_process_group()
    # skip the interpreter's teardown: on gloo a library thread at exit now and then aborts the
    # process ("terminate called without an active exception") after the results are written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ---- parent: one torchrun per (setup, world size, mode) --------------------------------------------


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-")


def shape_of(a, setup: str) -> str:
    return TINY_NAME if a.tiny else SETUPS[setup]["shape"]


def torchrun_cmd(a, setup: str, world: int, mode: str, run_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd += [os.path.abspath(__file__), "--worker", "--setup", setup, "--mode", mode, "--run-dir", run_dir]
    cmd += ["--steps", str(a.steps), "--seed", str(a.seed), "--device", a.device]
    cmd += [] if a.bucket_mb is None else ["--bucket-mb", str(a.bucket_mb)]
    cmd += ["--kv-cache"] if a.kv_cache else []
    return cmd + (["--tiny"] if a.tiny else []) + (["--profile"] if a.profile else [])


def stop_run(p: subprocess.Popen, run_dir: str) -> None:
    """After a timeout: end the torchrun we started (SIGTERM: it stops its workers, waiting up to
    30 s for them), then any worker still alive, by the pid it wrote (each in a process group of its own)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
            p.wait(timeout=60)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    for name in os.listdir(run_dir):
        if name.endswith(".pid"):
            try:
                with open(os.path.join(run_dir, name)) as f:
                    pid = int(f.read())
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    ours = b"--worker" in f.read()  # not a new process that reuses the id
                if ours:
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass  # already gone


def log_tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def launch(a, setup: str, world: int, mode: str, turn: int = 0) -> dict:
    label = f"{setup} ws{world} {mode}" + (f" run{turn + 1}" if a.repeat > 1 else "")
    run_dir = os.path.abspath(os.path.join(a.out, "runs", slug(label)))
    os.makedirs(run_dir, exist_ok=True)
    for name in os.listdir(run_dir):
        os.remove(os.path.join(run_dir, name))
    log = os.path.join(run_dir, "log.txt")
    # the workers import kernelgraft from this checkout (installed or not); PYTHONPATH entries
    # given by the caller (e.g. Liger's unpacked wheel) stay after it
    path = [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": os.pathsep.join(path)}
    t = time.perf_counter()
    timeout = None
    with open(log, "w") as f:
        p = subprocess.Popen(
            torchrun_cmd(a, setup, world, mode, run_dir),
            stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=os.setpgrp,
        )  # fmt: skip
        try:
            rc = p.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            stop_run(p, run_dir)
            rc, timeout = p.returncode, f"timeout: the run took over --timeout {a.timeout:g} s"
    row = dict(
        setup=setup,
        shape=shape_of(a, setup),
        wrapper=SETUPS[setup]["wrap"],
        mode=mode,
        world_size=world,
        wall_s=time.perf_counter() - t,
        log=os.path.relpath(log, a.out),
    )
    if TURNS in mode:  # --turns: a row per mode of the one run
        got = split_turns(load_ranks(run_dir, world), mode.split(TURNS), rc, timeout, log, a.steps)
        return [dict(row, mode=m, **fields) for m, fields in got]
    row.update(merge_ranks(run_dir, world, rc, timeout, log))
    return row


def load_ranks(run_dir: str, world: int) -> list[dict]:
    ranks = []
    for r in range(world):
        try:
            with open(os.path.join(run_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        except (OSError, json.JSONDecodeError):
            ranks.append(dict(rank=r, error=None))
    return ranks


def merge_ranks(run_dir: str, world: int, rc, timeout, log: str) -> dict:
    return merge(load_ranks(run_dir, world), rc, timeout, log)


def split_turns(ranks: list[dict], modes: list[str], rc, timeout, log: str, rounds: int) -> list[dict]:
    """--turns: one row per mode of one run, from each rank's by_mode, each with `paired`: its step
    time over Liger's (or the first mode's) in the same round, a round's step being its slowest
    rank's -> [(mode, merged fields)]."""
    if not all("by_mode" in x for x in ranks):  # a failed run: every mode's row says why
        return [(m, merge(ranks, rc, timeout, log)) for m in modes]
    keep = ("rank", "tokens", "device_name", "versions", "dynamo")
    per = {m: [dict(x["by_mode"][m], **{k: x[k] for k in keep if k in x}) for x in ranks] for m in modes}
    slowest = {m: [max(ts) for ts in zip(*(r["times_s"] for r in per[m]))] for m in modes}
    paired = paired_ratios(slowest, turn_order(modes)[1])
    return [(m, dict(merge(per[m], rc, timeout, log), turns=rounds, paired=paired[m])) for m in modes]


def merge(ranks: list[dict], rc, timeout, log: str) -> dict:
    errors = [f"rank {x['rank']}: {x['error']}" for x in ranks if x.get("error")]
    if timeout or errors or any("step_s" not in x for x in ranks):
        last = log_tail(log, 1).strip()
        why = timeout or "; ".join(errors) or f"exit code {rc}, no result; last log line: {last[-200:]}"
        return dict(error=why[:600])
    warning = {} if rc == 0 else dict(warning=f"torchrun exit code {rc} after every rank wrote its result")
    step_s = max(x["step_s"] for x in ranks)  # the slowest rank sets the pace
    peaks = [x["peak_gib"] for x in ranks]
    above = [x.get("peak_above_start_gib") for x in ranks]
    r0 = ranks[0]
    return dict(
        tok_s_per_gpu=r0["tokens"] / step_s,
        step_s=step_s,
        step_s_per_rank=[x["step_s"] for x in ranks],
        peak_gib_per_gpu=None if None in peaks else max(peaks),
        peak_above_start_gib_per_gpu=None if None in above else max(above),
        first_step_s=max(x["first_step_s"] for x in ranks),
        loss=r0["loss"],
        losses=[x["loss"] for x in ranks],
        tokens_per_gpu=r0["tokens"],
        sites=r0.get("sites"),
        ddp_cuts=r0.get("ddp_cuts"),
        profile=r0.get("profile"),
        dynamo=r0.get("dynamo"),
        device_name=r0.get("device_name"),
        versions=r0.get("versions"),
        **warning,
    )


def median_run(runs: list[dict]) -> dict:
    """The row of several runs of one (setup, world size, mode): the run with the median tok/s (the
    lower of the two middle ones), with every successful run's tok/s in `tok_s_runs`. A failed run
    is left out; if every run failed, the last one's row, failure and all."""
    ok = sorted((r for r in runs if r.get("tok_s_per_gpu")), key=lambda r: r["tok_s_per_gpu"])
    if not ok:
        return runs[-1]
    row = dict(ok[(len(ok) - 1) // 2])
    if len(runs) > 1:
        row["tok_s_runs"] = [r["tok_s_per_gpu"] for r in runs if r.get("tok_s_per_gpu")]
        row["runs_failed"] = len(runs) - len(ok)
    return row


def add_scaling(rows: list[dict]) -> None:
    """Efficiency against the one-GPU run of the same setup and mode, else of the same shape and
    mode (at world size 1 the model runs unwrapped: setups of one shape measure the same step)."""
    one = {(r["setup"], r["mode"]): r.get("tok_s_per_gpu") for r in rows if r["world_size"] == 1}
    by_shape = {(r.get("shape"), r["mode"]): r.get("tok_s_per_gpu") for r in rows if r["world_size"] == 1}
    for r in rows:
        base = one.get((r["setup"], r["mode"])) or by_shape.get((r.get("shape"), r["mode"]))
        ok = base and r.get("tok_s_per_gpu")
        r["scaling_efficiency"] = r["tok_s_per_gpu"] / base if ok else None


# ---- report ----------------------------------------------------------------------------------------


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _overlap(a, b) -> bool:
    """Two modes' runs (tok/s each) overlap: one's slowest is below the other's fastest and back.
    Single runs (no spread measured) never count as overlapping."""
    if not a or not b or len(a) < 2 or len(b) < 2:
        return False
    return min(a) <= max(b) and min(b) <= max(a)


def summary_lines(rows: list[dict]) -> list[str]:
    out = []
    for setup in dict.fromkeys(r["setup"] for r in rows):
        mine = [r for r in rows if r["setup"] == setup and r.get("tok_s_per_gpu")]
        if not mine:
            out.append(f"- {setup}: no successful run")
            continue
        top = max(r["world_size"] for r in mine)
        best = max((r for r in mine if r["world_size"] == top), key=lambda r: r["tok_s_per_gpu"])
        line = f"- {setup}, world size {top}: fastest is {best['mode']} ({best['tok_s_per_gpu']:,.0f} tok/s per GPU)"
        tied = [
            r["mode"]
            for r in mine
            if r is not best
            and r["world_size"] == top
            and _overlap(r.get("tok_s_runs"), best.get("tok_s_runs"))
        ]
        if tied:
            line += f", but its runs overlap those of {', '.join(tied)}: not ahead of them"
        for r in mine:
            if r["mode"].startswith("kernelgraft") and r["world_size"] == top and top > 1:
                eff = r["scaling_efficiency"]
                if eff is None:
                    line += f"; {r['mode']}: no world-size-1 figure to compare with"
                else:
                    met = "met" if eff >= GOAL else "not met"
                    line += (
                        f"; {r['mode']} keeps {eff:.0%} of its one-GPU tok/s "
                        f"(goal: within {1 - GOAL:.0%}: {met})"
                    )
        failed = [r["mode"] for r in rows if r["setup"] == setup and r.get("error")]
        failed = [m for m in dict.fromkeys(failed) if m.startswith("kernelgraft")]
        out.append(line + "".join(f"; {m} failed (see its row)" for m in failed))
    return out


def markdown(doc: dict) -> str:
    rows = doc["rows"]
    cache = "the model's default use_cache, a KV cache filled" if doc.get("kv_cache") else "use_cache=False"
    L = [
        f"Distributed training step (fwd with labels, {cache} + bwd, no optimizer), "
        f"{doc.get('device_name', '?')}, "
        f"{doc['date']}, {doc.get('versions', '?')}, median of {doc['steps']} steps\n",
        "World size 1: the model unwrapped on one device (the baseline); world size N: N ranks, each "
        "with its own batch of the same shape. Scaling efficiency: tok/s per GPU at N over at 1."
        + (
            f" DDP buckets of {doc['bucket_mb']:g} MB (bucket_cap_mb) in every mode."
            if doc.get("bucket_mb")
            else ""
        )
        + "\n",
    ]
    for setup in dict.fromkeys(r["setup"] for r in rows):
        r0 = next(r for r in rows if r["setup"] == setup)
        L.append(f"- {setup}: {r0['shape']} per GPU, {WRAPPERS[r0['wrapper']]}")
    L += [
        "",
        "| setup | mode | world size | tok/s per GPU | scaling efficiency | peak GiB per GPU | "
        "above the step's start | first step s | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['setup']} | {r['mode']} | {r['world_size']} |"
        if r.get("error"):
            L.append(f"{head} failed: {r['error'][:120].replace('|', '/')} | | | | | |")
            continue
        spread = r.get("tok_s_runs") or []
        runs = f" ({min(spread):,.0f}-{max(spread):,.0f} over {len(spread)} runs)" if len(spread) > 1 else ""
        L.append(
            f"{head} {r['tok_s_per_gpu']:,.0f}{runs} | {fmt(r['scaling_efficiency'], '.2f')} | "
            f"{fmt(r['peak_gib_per_gpu'], '.1f')} | {fmt(r.get('peak_above_start_gib_per_gpu'), '.1f')} | "
            f"{r['first_step_s']:.1f} | {r['loss']:.4f} |"
        )
    L += ["", *summary_lines(rows)]
    paired = [r for r in rows if r.get("paired")]
    if paired:
        ref = paired[0]["paired"]["ref"]
        L += [
            "",
            f"Modes taking turns step by step in one run (--turns, {paired[0]['turns']} rounds, the order rotated "
            f"each round): each step's time over {ref}'s in the same round, a round's step being its slowest "
            "rank's; above 1 is slower. With --repeat, the median run's.",
            "",
            "| setup | world size | mode | median | lowest | highest |",
            "|---|---|---|---|---|---|",
        ]
        L += [
            f"| {r['setup']} | {r['world_size']} | {r['mode']} | {r['paired']['median']:.4f} | "
            f"{r['paired']['low']:.4f} | {r['paired']['high']:.4f} |"
            for r in paired
        ]
    for r in rows:
        pr = r.get("profile")
        if not pr or r.get("error"):
            continue
        top = "; ".join(f"`{x['op']}` {x['ms']:.2f} ms in {x['gaps']}" for x in pr["by_op"][:5])
        L.append(
            f"- {r['setup']} {r['mode']} world size {r['world_size']}, one step profiled on rank 0: "
            f"{pr['wall_ms']:.1f} ms wall, device busy {pr['busy_ms']:.1f}, idle gaps {pr['idle_ms']:.1f} ms "
            f"in {pr['gaps']}" + (f", by launching op: {top}" if top else "")
        )
    L += [f"- {n}" for n in doc.get("notes", [])]
    L += [
        f"- {r['setup']} {r['mode']} world size {r['world_size']}: {r['warning']}"
        for r in rows
        if r.get("warning")
    ]
    return "\n".join(L) + "\n"


def plot(path: str) -> str:
    """tok/s per GPU by mode and world size, one panel per setup (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r.get("tok_s_per_gpu")]
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    fig, axes = plt.subplots(1, max(1, len(setups)), figsize=(6 * max(1, len(setups)), 4), squeeze=False)
    for ax, setup in zip(axes[0], setups):
        mine = [r for r in rows if r["setup"] == setup]
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        worlds = sorted({r["world_size"] for r in mine})
        w = 0.8 / len(worlds)
        for i, ws in enumerate(worlds):
            by_mode = {r["mode"]: r for r in mine if r["world_size"] == ws}
            xs = [j + i * w for j in range(len(modes))]
            ys = [by_mode[m]["tok_s_per_gpu"] if m in by_mode else 0 for m in modes]
            bars = ax.bar(xs, ys, w, label=f"world size {ws}")
            for b, m in zip(bars, modes):
                eff = by_mode.get(m, {}).get("scaling_efficiency")
                if ws > 1 and eff is not None:
                    ax.annotate(f"{eff:.0%}", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)  # fmt: skip
        labels = [textwrap.fill(m, 16) for m in modes]  # long mode names on two lines, not overlapping
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(modes))], labels, fontsize=8)
        ax.set_title(f"{setup}: {mine[0]['shape']} per GPU", fontsize=9)
        ax.set_ylabel("tokens/s per GPU")
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=130)
    return png


# ---- main ------------------------------------------------------------------------------------------


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument(
        "--modes", default=None, help=f"default: {','.join(GPU_MODES)} (cpu: {','.join(CPU_MODES)})"
    )
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per (setup, world size, mode), the modes taking turns: a row is the median run, "
        "with every run's tok/s (the host drifts between runs; turns spread the drift over the modes)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="seconds per torchrun (one setup, size, mode)")
    ap.add_argument("--seed", type=int, default=0, help="rank r's batch comes from seed + r")
    ap.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="DDP's bucket_cap_mb for every mode (default: DDP's own, 25); under torch.compile it also "
        "sets the size of the pieces DDPOptimizer cuts the graph into",
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help=f"a {TINY_NAME} (float32) in every setup")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, one step under torch.profiler: rank 0's device time, and the gaps "
        "the GPU waited for the host, by the host op that launched the kernel waited for",
    )
    ap.add_argument(
        "--turns",
        action="store_true",
        help="one run per (setup, world size) holding every mode's model, one step each per round, the "
        "order rotated each round: each row then also gives its step time over Liger's in the same round",
    )
    ap.add_argument(
        "--kv-cache",
        action="store_true",
        help="call the model with its default use_cache (a KV cache filled in the training forward, as "
        "suite.py's step) instead of use_cache=False; DDP setups only (FSDP2 recompiles per layer)",
    )
    ap.add_argument("--fresh", action="store_true", help="drop the rows of an earlier DIR/distributed.json")
    ap.add_argument("--plot", metavar="JSON", help="only make the PNG of an earlier run (needs matplotlib)")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="only merge runs into --out (later wins, but a failure keeps an earlier success)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def check(a) -> tuple[list[str], list[int], list[str], list[str]]:
    """The runs asked for, or SystemExit with a message that says what to pass instead."""
    setups = [s for s in a.setups.split(",") if s]
    bad = [s for s in setups if s not in SETUPS]
    if bad:
        raise SystemExit(f"bench_distributed: unknown setup(s) {bad}; choose from {list(SETUPS)}")
    try:
        worlds = [int(w) for w in a.world_sizes.split(",") if w]
    except ValueError:
        raise SystemExit(
            f"bench_distributed: --world-sizes wants numbers like 1,2, got {a.world_sizes!r}"
        ) from None
    if not worlds or min(worlds) < 1:
        raise SystemExit(f"bench_distributed: --world-sizes wants sizes >= 1, got {a.world_sizes!r}")
    sharded = [s for s in setups if SETUPS[s]["wrap"] != "ddp"]
    if a.kv_cache and sharded:
        raise SystemExit(
            f"bench_distributed: --kv-cache runs DDP setups only; {sharded} shard per layer, where a KV cache "
            "recompiles every layer's graph: drop --kv-cache or pass --setups ddp-1b"
        )
    if a.turns and a.profile:
        raise SystemExit("bench_distributed: --profile profiles one mode per run; drop it or --turns")
    if a.repeat < 1:
        raise SystemExit(f"bench_distributed: --repeat wants 1 or more runs per mode, got {a.repeat}")
    cpu = a.device == "cpu"
    modes = names(a.modes or ",".join(CPU_MODES if cpu else GPU_MODES))
    known = set(suite.MODES) | {"kernelgraft"}
    bad = [m for m in modes if (m not in known and not m.startswith("kernelgraft (")) or TURNS in m]
    if bad:
        raise SystemExit(f"bench_distributed: unknown mode(s) {bad}; choose from {sorted(known)}")
    if a.turns and len(modes) < 2:
        raise SystemExit(f"bench_distributed: --turns takes turns between two or more modes, got {modes}")
    if cpu:
        if not a.tiny:
            raise SystemExit("bench_distributed: --device cpu runs the tiny model only: add --tiny")
        bad = [m for m in modes if m not in CPU_MODES]
        if bad:
            raise SystemExit(f"bench_distributed: mode(s) {bad} do not run on the CPU; use {list(CPU_MODES)}")
    else:
        n = torch.cuda.device_count()
        if n < max(worlds):
            fits = ",".join(str(w) for w in worlds if w <= n) or str(n)
            fix = f"pass --world-sizes {fits} on this host" if n else "this host has no GPU"
            raise SystemExit(
                f"bench_distributed: --world-sizes {a.world_sizes} needs {max(worlds)} GPUs (one per rank), "
                f"but torch.cuda.device_count() found {n}; {fix} "
                "(or run the CPU smoke test: --device cpu --tiny)"
            )
    notes = []
    if "liger" in modes and importlib.util.find_spec("liger_kernel") is None:
        modes.remove("liger")
        notes.append(
            "liger skipped: liger_kernel is not importable (install its wheel or put it on PYTHONPATH)"
        )
        print(f"note: {notes[-1]}", flush=True)
    return setups, worlds, modes, notes


def load_doc(a, notes: list[str]) -> tuple[dict, str]:
    path = os.path.join(a.out, "distributed.json")
    doc = dict(rows=[])
    if os.path.exists(path) and not a.fresh:
        with open(path) as f:
            doc = json.load(f)
        print(f"note: updating the {len(doc['rows'])} rows of {path} (--fresh starts over)", flush=True)
    doc.update(
        date=datetime.date.today().isoformat(),
        steps=a.steps,
        bucket_mb=a.bucket_mb,
        kv_cache=a.kv_cache,
        notes=notes,
    )
    return doc, path


def save(doc: dict, path: str) -> None:
    add_scaling(doc["rows"])
    ok = [r for r in doc["rows"] if r.get("device_name")]
    if ok:
        doc.update(device_name=ok[-1]["device_name"], versions=ok[-1]["versions"])
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(os.path.dirname(path), "distributed.md"), "w") as f:
        f.write(markdown(doc))


def upsert(rows: list[dict], row: dict) -> None:
    key = (row["setup"], row["world_size"], row["mode"])
    rows[:] = [r for r in rows if (r["setup"], r["world_size"], r["mode"]) != key] + [row]
    order = {s: i for i, s in enumerate(SETUPS)}
    rows.sort(key=lambda r: (order.get(r["setup"], 99), r["world_size"]))  # stable: modes in run order


def merge_files(paths: list[str], out: str) -> int:
    """The rows of several distributed.json files (e.g. one per command on the GPU host) in one."""
    doc = dict(rows=[], notes=[])
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        for row in d["rows"]:
            key = (row["setup"], row["world_size"], row["mode"])
            had = [r for r in doc["rows"] if (r["setup"], r["world_size"], r["mode"]) == key]
            if not (row.get("error") and had and not had[0].get("error")):  # a failure keeps a success
                upsert(doc["rows"], row)
        doc.update({k: v for k, v in d.items() if k not in ("rows", "notes")})
        doc["notes"] += [n for n in d.get("notes", []) if n not in doc["notes"]]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "distributed.json")
    save(doc, path)
    print(markdown(doc))
    print(f"wrote {path} and {os.path.join(out, 'distributed.md')}")
    return 0


def report(i: int, n: int, row: dict) -> None:
    took = f"same run as {row['same_run_as']}" if row.get("same_run_as") else f"{row['wall_s']:.0f} s"
    head = f"[{i}/{n}] {row['setup']} world size {row['world_size']} {row['mode']} ({took}):"
    if row.get("warning"):
        print(f"{head} warning: {row['warning']}; log: {row['log']}", flush=True)
    if row.get("error"):
        print(f"{head} FAILED {row['error']}\n  log: {row['log']}", flush=True)
    else:
        print(
            f"{head} {row['tok_s_per_gpu']:,.0f} tok/s per GPU, peak {fmt(row['peak_gib_per_gpu'], '.1f')} "
            f"GiB, first step {row['first_step_s']:.1f} s, loss {row['loss']:.4f}",
            flush=True,
        )


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(a)
    if a.plot:
        print(plot(a.plot))
        return 0
    if a.merge:
        return merge_files(a.merge, a.out)
    setups, worlds, modes, notes = check(a)
    os.makedirs(a.out, exist_ok=True)
    doc, path = load_doc(a, notes)
    # with --repeat the modes take turns: run 1 of every mode, then run 2 of every mode, ...; with
    # --turns one run holds every mode, taking turns step by step
    per_run = [TURNS.join(modes)] if a.turns else modes
    runs = [(s, w, t, m) for s in setups for w in worlds for t in range(a.repeat) for m in per_run]
    unwrapped = {}  # world size 1 runs no wrapper: setups of one shape (all, with --tiny) share that run
    turns: dict = {}  # (setup, world size, mode) -> its runs so far
    for i, (setup, world, turn, mode) in enumerate(runs, 1):
        key = (shape_of(a, setup), mode, turn)
        if world == 1 and key in unwrapped:
            got = [
                {**first, "setup": setup, "wrapper": SETUPS[setup]["wrap"], "same_run_as": first["setup"]}
                for first in unwrapped[key]
            ]
        else:
            got = launch(a, setup, world, mode, turn)
            got = got if isinstance(got, list) else [got]
            if world == 1:
                unwrapped[key] = got
        for row in got:
            if row.get("error"):
                print(log_tail(os.path.join(a.out, row["log"])), flush=True)
            report(i, len(runs), row)
            done = turns.setdefault((setup, world, row["mode"]), [])
            done.append(row)
            upsert(doc["rows"], median_run(done))
        save(doc, path)
    print("\n" + markdown(doc))
    print(f"wrote {path} and {os.path.join(a.out, 'distributed.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
