"""What the benchmark scripts share (imported as a sibling module: they run from this folder)."""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess

import torch

# the H200's measured device-to-device copy rate, bytes/s: a kernel's memory floor is the bytes it
# must move at this rate
COPY_RATE = 4275e9


def cache_env(folder: str) -> dict:
    """Every compile cache a mode fills, under `folder`: inductor's (its FX graphs and AOTAutograd's),
    Triton's, kernelgraft's generated kernels and Unsloth's compiled modules."""
    return dict(
        TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"),
        TRITON_CACHE_DIR=os.path.join(folder, "triton"),
        KERNELGRAFT_CACHE_DIR=os.path.join(folder, "kernelgraft"),
        UNSLOTH_COMPILE_LOCATION=os.path.join(folder, "unsloth_compiled_cache"),
    )


def failed_kernels_note(doc: dict) -> str:
    """The generated kernels that failed in this process, recorded in `doc` ("kernels_failed") and
    as a Markdown paragraph to append to the table ('' where none failed). Their sites ran the
    stock PyTorch code from then on, so a kernelgraft row that used them measured that code."""
    from kernelgraft.kernels import failed_kernels

    failed = failed_kernels()
    if not failed:
        return ""
    doc["kernels_failed"] = {f"{name} ({dev})": why for (name, dev), why in failed.items()}
    said = "; ".join(f"`{k}`: {why[:200]}" for k, why in doc["kernels_failed"].items())
    return (
        "\n**Kernels that failed in this run**, whose sites ran the stock PyTorch code from then on "
        f"(the kernelgraft rows that used them measured that code): {said}\n"
    )


def names(spec: str) -> list[str]:
    """A comma-separated list of names; a comma inside parentheses does not split
    ("kernelgraft (inductor, no recompute),liger" is two modes)."""
    return [m.strip() for m in re.split(r",(?![^()]*\))", spec or "") if m.strip()]


def cuda_kernels(prof, calls: int) -> list[tuple[float, int, str]]:
    """(ms per call, launches per call, name) of each CUDA kernel in a torch.profiler run of `calls`
    calls, largest first. Only the kernels themselves: host ops also carry their kernels' device
    time, and would count it twice."""
    from torch.autograd import DeviceType

    rows = [
        (e.device_time_total / 1e3 / calls, e.count // calls, e.key)
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA
    ]
    return sorted(rows, reverse=True)


def profile_kernels(fn, calls: int = 20) -> list[tuple[float, int, str]]:
    """cuda_kernels of `calls` calls of fn (after one unprofiled call): where its device time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return cuda_kernels(prof, calls)


def peak_above(fn) -> int:
    """Bytes the CUDA allocator held at its peak while `fn()` ran, above what was allocated before
    (the inputs): a call's own memory, outputs and gradients included."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def saved_for_backward(model: torch.nn.Module, loss_fn) -> dict:
    """What `loss_fn()` (a forward of `model`) saves for the backward: storage address -> (bytes,
    shape of a tensor saved on it), `model`'s parameters aside (saved_tensors_hooks); then runs that
    backward and clears the gradients. Summed with the peak and the parameters' bytes it splits a
    step's memory into weights, gradients, saved activations and the rest (transient buffers)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = (st.nbytes(), tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return seen


def saved_bytes(model: torch.nn.Module, loss_fn) -> int:
    """The bytes of saved_for_backward(model, loss_fn)."""
    return sum(b for b, _ in saved_for_backward(model, loss_fn).values())


def profile_idle(step, synchronize, cuda: bool = True) -> dict:
    """One run of `step` under torch.profiler with host activity (and the device's if `cuda`):
    its wall time, and idle_by_launcher of its trace (by_op as dicts, for JSON)."""
    import json
    import os
    import tempfile
    import time

    from torch.profiler import ProfilerActivity, profile

    synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        t = time.perf_counter()
        step()
        synchronize()
        wall = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        p.export_chrome_trace(path)
        with open(path) as f:
            got = idle_by_launcher(json.load(f))
    got["by_op"] = [dict(ms=ms, gaps=n, op=op[:100]) for ms, n, op in got["by_op"]]
    return dict(wall_ms=wall * 1e3, **got)


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def idle_by_launcher(trace: dict, min_gap_us: float = 2.0, top: int = 12) -> dict:
    """Where the GPU waited for the host, from a torch.profiler Chrome trace (CPU and CUDA activity).

    Every gap of at least `min_gap_us` between one device event's end and the next one's start is
    charged to the host op that launched the next: the innermost `kernelgraft::` op around its launch
    launch if there is one, else the innermost op. -> {idle_ms, gaps, by_op: [(ms, count, op)]}, the
    largest `top` first, with busy_ms (the time some device event ran) and span_ms (first device
    event's start to last one's end). The profiler's own host cost inflates the gaps; their places
    are what counts.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    launches = sorted(
        (
            e
            for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
        ),
        key=lambda e: e["ts"],
    )
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"]))
    # a sweep in time order per host thread (autograd's backward runs on its own): the ops open at
    # each launch, outermost first
    launched_by: dict = {}
    for tid in {e.get("tid") for e in launches}:
        mine = [o for o in ops if o.get("tid") == tid]
        stack: list = []
        i = 0
        for la in (e for e in launches if e.get("tid") == tid):
            while i < len(mine) and mine[i]["ts"] <= la["ts"]:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < mine[i]["ts"]:
                    stack.pop()
                stack.append(mine[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < la["ts"]:
                stack.pop()
            ours = [o for o in stack if o["name"].startswith("kernelgraft::")]
            pick = ours[-1] if ours else (stack[-1] if stack else None)
            launched_by[la["args"]["correlation"]] = pick["name"] if pick else "(no host op)"

    by: dict[str, list] = {}
    end = None
    gaps = 0
    busy = 0.0
    for e in device:
        stop = e["ts"] + e["dur"]
        busy += max(0.0, stop - max(e["ts"], end if end is not None else e["ts"]))
        if end is not None and e["ts"] - end >= min_gap_us:
            corr = e.get("args", {}).get("correlation")
            name = launched_by.get(corr, "(launch not traced)")
            slot = by.setdefault(name, [0.0, 0])
            slot[0] += (e["ts"] - end) / 1e3
            slot[1] += 1
            gaps += 1
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    rows = sorted(((ms, n, name) for name, (ms, n) in by.items()), reverse=True)
    span = (end - device[0]["ts"]) / 1e3 if device else 0.0
    return dict(
        idle_ms=sum(r[0] for r in rows), gaps=gaps, by_op=rows[:top], busy_ms=busy / 1e3, span_ms=span
    )


# ---- modes taking turns step by step in one process ------------------------------------------------
#
# A GPU at its power limit changes its clocks with the load: the same mode moves 1-2 % between runs,
# as much as the modes differ. Taking turns step by step puts every mode through the same drift, and
# the ratio of two modes' steps in one round cancels it (paired_ratios).


def module_globals(prefix: str = "transformers.") -> dict:
    """{(module name, global name): value} of every loaded module under `prefix`."""
    import sys

    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is not None and name.startswith(prefix):
            out.update(((name, k), v) for k, v in list(vars(mod).items()))
    return out


def changed_globals(before: dict, after: dict) -> dict:
    """{(module, name): (before, after)} for the functions and classes a setup reassigned between two
    module_globals snapshots (Liger assigns transformers' apply_rotary_pos_emb, and its norm and MLP
    classes, at module level). Names that appeared are left out (lazy imports add them), and so is
    data (caches a module fills as it runs)."""
    return {
        key: (old, after[key])
        for key, old in before.items()
        if key in after and after[key] is not old and (callable(old) or isinstance(old, type))
    }


def set_globals(changes: dict, which: int) -> None:
    """Put the globals of `changes` back to their values before (which=0) or after (1) the setup."""
    import sys

    for (mod, name), values in changes.items():
        setattr(sys.modules[mod], name, values[which])


def take_turns(steps: dict, rounds: int, enter=None, synchronize=None) -> dict:
    """Each mode's step once per round, the order rotated by one every round (no mode always first
    after another). enter(mode) runs before a mode's step (outside its time); synchronize after it
    (inside) -> {mode: [seconds of each of its steps]}."""
    import time

    modes = list(steps)
    times = {m: [] for m in modes}
    for r in range(rounds):
        for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
            if enter is not None:
                enter(m)
            t = time.perf_counter()
            steps[m]()
            if synchronize is not None:
                synchronize()
            times[m].append(time.perf_counter() - t)
    return times


def in_turns(builders: dict, rounds: int, device: torch.device, barrier=None) -> dict:
    """Modes taking turns in one process. builders: {mode: build() -> (model, step)}, in the order
    to build them: a mode that reassigns module globals (Liger) comes last, and its changes
    (changed_globals) are swapped in before its own steps and out before the others' (a compiled
    graph guards on them). Each mode's first step is timed alone (it compiles), then one warm-up;
    then `rounds` rounds of take_turns, barrier() (a process group's) before every step. The
    globals are left as the last build left them.
    -> {mode: dict(model, first_step_s, loss, times_s, step_s (the median), peak_above_start: bytes
    above what its step started from, the largest over its steps; None off CUDA)}."""
    import time

    cuda = device.type == "cuda"
    barrier = barrier or (lambda: None)

    def synchronize():
        if cuda:
            torch.cuda.synchronize(device)

    out, steps, patched = {}, {}, {}
    for mode, build in builders.items():
        before = module_globals()
        model, step = build()
        patched[mode] = changed_globals(before, module_globals())
        synchronize()
        barrier()
        t = time.perf_counter()
        loss = step()
        synchronize()
        out[mode] = dict(model=model, first_step_s=time.perf_counter() - t, loss=loss)
        barrier()
        step()  # warm-up
        synchronize()
        steps[mode] = step

    def enter(mode):
        for m, changes in patched.items():
            set_globals(changes, 1 if m == mode else 0)
        barrier()

    peaks = dict.fromkeys(steps, 0)

    def measured(mode):
        def run():
            base = torch.cuda.memory_allocated(device) if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            steps[mode]()  # take_turns synchronizes after it; the allocator's peak needs no sync
            if cuda:
                peaks[mode] = max(peaks[mode], torch.cuda.max_memory_allocated(device) - base)

        return run

    times = take_turns({m: measured(m) for m in steps}, rounds, enter=enter, synchronize=synchronize)
    enter(list(steps)[-1])
    for m, ts in times.items():
        out[m].update(
            times_s=ts, step_s=sorted(ts)[len(ts) // 2], peak_above_start=peaks[m] if cuda else None
        )
    return out


def turn_order(modes: list[str]) -> tuple[list[str], str]:
    """(the order to build the modes in: Liger last, as it reassigns transformers' globals; the
    reference of paired_ratios: Liger where measured, else the first mode)."""
    order = [m for m in modes if m != "liger"] + (["liger"] if "liger" in modes else [])
    return order, ("liger" if "liger" in modes else modes[0])


def paired_ratios(times: dict, ref: str) -> dict:
    """{mode: dict(ref, median, low, high)} of a mode's step time over ref's step time in the same
    round. Above 1: slower than ref."""
    out = {}
    for m, ts in times.items():
        r = sorted(t / u for t, u in zip(ts, times[ref]))
        out[m] = dict(ref=ref, median=r[len(r) // 2], low=r[0], high=r[-1])
    return out


def provenance(device: torch.device, dists: tuple) -> dict:
    """Date, host, device, the versions of `dists` (None: not installed), git commit (+: tracked
    files changed): what a results file says of the run that made it."""
    from importlib.metadata import distributions

    have = {(d.metadata["Name"] or "").lower().replace("_", "-"): d.version for d in distributions()}
    here = os.path.dirname(os.path.abspath(__file__))
    git = lambda *c: subprocess.run(["git", *c], cwd=here, capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD") + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # noqa: BLE001 - no git here: said as unknown
        commit = ""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), gpu=gpu,
                versions={d: have.get(d.lower().replace("_", "-")) for d in dists}, commit=commit or None)  # fmt: skip


def versions_text(versions) -> str:
    """provenance()'s versions as a line of text ("torch 2.11.0, unsloth not installed")."""
    if isinstance(versions, str):
        return versions
    return ", ".join(f"{d} {v or 'not installed'}" for d, v in (versions or {}).items())
