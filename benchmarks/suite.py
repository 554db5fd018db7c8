"""The benchmark suite, in one process per part: every implementation side by side.

Parts (`--parts`, comma-separated; default all):
  patterns   RMSNorm, RoPE, SwiGLU at the reference shapes and a size sweep: fwd, bwd, fwd+bwd
             (median ms, triton.testing.do_bench) and peak memory above the inputs, for eager,
             torch.compile, Liger (when importable), and kernelgraft as users get it: the spelling
             compiled with the kernelgraft backend, "inductor" and "eager"; and fwd+bwd per call
             in a loop of calls with one synchronization at the end, the implementations taking
             turns (loop_times)
  lm_head    bench_lm_head.py's measurement (eager, compile, Liger, CCE, kernelgraft)
  steps      one training step (fwd + bwd, no optimizer) of the Llama-3.2-1B shape (8x2048), the
             Llama-3.1-8B shape (2x4096), a Gemma-2-2B shape (256k vocabulary), peft LoRA on the
             1B and a 135M model (8x1024, where the host is in the loop): eager, torch.compile,
             kernelgraft (inductor and eager backends), Liger last; the 135M model also under
             CUDA graphs (torch.compile and kernelgraft with mode="reduce-overhead")
  curves     50 AdamW steps of the 1B shape, eager vs kernelgraft: the loss curves
  decode     bench_decode.py's measurement: greedy generate() of the 1B shape at batch 1 and 8

    python benchmarks/suite.py --out DIR [--parts patterns,steps] [--quick]
        -> DIR/suite.json, DIR/suite.md     (on the GPU; its host has no matplotlib)
    python benchmarks/suite.py --plot DIR/suite.json
        -> DIR/suite_patterns.png, DIR/suite_steps.png, DIR/suite_curves.png   (anywhere)

`kernelgraft bench` runs this file from a source checkout. JSON is rewritten after every
measurement, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import re
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # sibling modules, also when `kernelgraft bench` loads this file by its path
    sys.path.insert(0, HERE)
from benchlib import (  # noqa: E402
    COPY_RATE,
    failed_kernels_note,
    in_turns,
    names,
    paired_ratios,
    peak_above,
    profile_idle,
    profile_kernels,
    saved_bytes,
    turn_order,
)
from suite_args import MODES, SHAPES, parser  # noqa: E402

# ---- spellings as transformers writes them ---------------------------------------------------------


def hf_rms(x, w, eps=1e-6):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def swiglu(gate, up):
    return F.silu(gate) * up


def hf_layer_norm(x, w, b, eps=1e-5):  # nn.LayerNorm's call (GPT-NeoX, Phi, StarCoder2, OPT...)
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


def _rotate_pairs(x):  # GLM, Cohere, GPT-J: adjacent columns rotated
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def hf_rope_pairs(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_pairs(q) * sin, k * cos + _rotate_pairs(k) * sin


def hf_rope_halves(q, k, cos, sin):  # GPT-OSS: rotate-half over chunk(x, 2, -1), half-width angles
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def hf_rope_complex(q, k, f):  # Llama 4, DeepSeek-V2: the pairs as complex numbers, q (B, S, H, D)
    def rotate(x):
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * f).flatten(3).type_as(x)

    return rotate(q), rotate(k)


def _liger(name):
    try:
        if name == "rms":
            from liger_kernel.transformers.functional import liger_rms_norm

            return lambda x, w: liger_rms_norm(x, w, 1e-6)
        if name == "rope":
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            return liger_rotary_pos_emb
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        if name == "ln":
            from liger_kernel.transformers.functional import liger_layer_norm

            return lambda x, w, b: liger_layer_norm(x, w, b, 1e-5)
    except Exception as e:  # noqa: BLE001 - an optional peer
        print(f"liger {name} unavailable: {e}", flush=True)
    return None


def impls(fn, liger_name):
    import kernelgraft

    out = {
        "eager": fn,
        "torch.compile": torch.compile(fn, dynamic=False),
        "kernelgraft (inductor)": torch.compile(fn, backend=kernelgraft.Grafter("inductor"), dynamic=False),
        "kernelgraft (eager)": torch.compile(fn, backend=kernelgraft.Grafter("eager"), dynamic=False),
    }
    lg = _liger(liger_name)
    if lg is not None:
        out["liger"] = lg  # last: it writes into its inputs' gradients
    return out


def pattern_cases(quick: bool):
    bf = dict(device="cuda", dtype=torch.bfloat16)

    def rms(M, N):
        def make():
            return (torch.randn(M, N, **bf).requires_grad_(), torch.randn(N, **bf).requires_grad_())

        return f"RMSNorm {M}x{N}", hf_rms, "rms", make, 2 * 2 * M * N * 2  # x, y fwd; dy, dx bwd

    def rope(B, Hq, Hk, S, D, pairs=False):
        def make():
            q = torch.randn(B, S, Hq, D, **bf).transpose(1, 2).requires_grad_()
            k = torch.randn(B, S, Hk, D, **bf).transpose(1, 2).requires_grad_()
            ang = torch.randn(B, S, D // 2, device="cuda")
            # cat(freqs, freqs); interleaved: each angle repeated for its pair
            ang = ang.repeat_interleave(2, dim=-1) if pairs else ang.repeat(1, 1, 2)
            return q, k, ang.cos().bfloat16(), ang.sin().bfloat16()

        n = B * S * (Hq + Hk) * D
        name = f"RoPE{' interleaved' if pairs else ''} q {B}x{Hq}x{S}x{D}, k {B}x{Hk}x{S}x{D}"
        return name, hf_rope_pairs if pairs else hf_rope, "-" if pairs else "rope", make, 4 * n * 2

    def rope_half_width(B, Hq, Hk, S, D, how):
        """The rotations whose angles are half a row wide: over the halves (GPT-OSS), or as a
        complex product (Llama 4: q and k as computed, (B, S, heads, D), the angles complex)."""

        def make():
            ang = torch.randn(B, S, D // 2, device="cuda")
            if how == "complex":
                q = torch.randn(B, S, Hq, D, **bf).requires_grad_()
                k = torch.randn(B, S, Hk, D, **bf).requires_grad_()
                return q, k, torch.polar(torch.ones_like(ang), ang)[:, :, None, :]
            q = torch.randn(B, S, Hq, D, **bf).transpose(1, 2).requires_grad_()
            k = torch.randn(B, S, Hk, D, **bf).transpose(1, 2).requires_grad_()
            return q, k, ang.cos().bfloat16(), ang.sin().bfloat16()

        n = B * S * (Hq + Hk) * D
        fn = hf_rope_complex if how == "complex" else hf_rope_halves
        return f"RoPE {how} q {B}x{Hq}x{S}x{D}, k {B}x{Hk}x{S}x{D}", fn, "-", make, 4 * n * 2

    def ln(M, N):
        def make():
            x = torch.randn(M, N, **bf).requires_grad_()
            return x, torch.randn(N, **bf).requires_grad_(), torch.randn(N, **bf).requires_grad_()

        return f"LayerNorm {M}x{N}", hf_layer_norm, "ln", make, 2 * 2 * M * N * 2

    def mlp(M, N):
        def make():
            return torch.randn(M, N, **bf).requires_grad_(), torch.randn(M, N, **bf).requires_grad_()

        return f"SwiGLU {M}x{N}", swiglu, "swiglu", make, 7 * M * N * 2

    cases = [rms(16384, 4096), rope(8, 32, 8, 2048, 128), mlp(16384, 14336)]  # the reference shapes
    cases += [ln(16384, 4096), rope(8, 32, 8, 2048, 128, pairs=True)]
    cases += [rope_half_width(8, 32, 8, 2048, 128, how) for how in ("halves", "complex")]
    if not quick:
        cases += [rms(M, 4096) for M in (1024, 4096, 65536)] + [rms(4096, N) for N in (2048, 8192)]
        cases += [rope(B, 32, 8, 2048, 128) for B in (1, 2)] + [mlp(M, 8192) for M in (4096, 32768)]
    return cases


def measure_pattern(name, fn, liger_name, make, floor_bytes):
    from triton.testing import do_bench

    rows, loops = {}, {}
    # dynamo caches compiled code per code object, and past its recompile limit (8) runs a function
    # uncompiled: a sweep of one spelling over shapes and three compiled modes gets there (seen on
    # the H200: kernelgraft's and torch.compile's rows equal eager's from the fifth case on)
    torch._dynamo.reset()
    for impl, f in impls(fn, liger_name).items():
        try:
            torch.manual_seed(0)
            args = make()
            leaves = [a for a in args if a.requires_grad]
            outs = f(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            g0 = [torch.randn_like(o) for o in outs]

            def fwd(f=f, args=args):
                with torch.no_grad():
                    f(*args)

            def fwd_bwd(f=f, args=args, leaves=leaves, g0=g0):
                o = f(*args)
                torch.autograd.grad(o if isinstance(o, tuple) else (o,), leaves, [g.clone() for g in g0])

            t_f = do_bench(fwd, warmup=25, rep=100, return_mode="median")
            t_fb = do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median")
            peak = peak_above(fwd_bwd) / 2**20
            rows[impl] = dict(fwd_ms=t_f, bwd_ms=max(t_fb - t_f, 0.0), fwd_bwd_ms=t_fb, peak_mib=peak)
            rows[impl].update(device_time(fwd_bwd))
            loops[impl] = fwd_bwd
        except Exception as e:  # noqa: BLE001 - one failing implementation must not hide the others
            traceback.print_exc()
            rows[impl] = dict(error=f"{type(e).__name__}: {e}"[:300])
        print(f"{name} {impl}: {rows[impl]}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    for impl, ms in loop_times(loops).items():
        rows[impl]["loop_ms"] = ms
    print(f"{name} loop ms: {[(k, round(v.get('loop_ms', 0), 3)) for k, v in rows.items()]}", flush=True)
    return dict(name=name, floor_ms=floor_bytes / COPY_RATE * 1e3, impls=rows)


def loop_times(loops: dict, rounds: int = 7, calls: int = 40, sync=None) -> dict:
    """fwd+bwd ms each as a training loop runs them: `calls` of them back to back, one
    synchronization at the end, the host free to run ahead of the device as far as it can. The
    implementations take turns, each round in another order, and each one's median round is kept:
    do_bench above times each one between two events after clearing the L2 cache, which, where
    the host is slower than the device, times the host's jitter as well (its medians of one
    host-bound case moved by 20 % between three runs in one process on the H200)."""
    import statistics
    import time

    sync = sync or torch.cuda.synchronize
    got: dict = {k: [] for k in loops}
    names = list(loops)
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            fn = loops[k]
            fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            got[k].append((time.perf_counter() - t0) / calls * 1e3)
    return {k: statistics.median(v) for k, v in got.items()}


def device_time(fn, n: int = 20) -> dict:
    """The device's time of one fwd+bwd: the CUDA kernels' time summed over n calls (torch.profiler),
    divided by n. do_bench's time above includes the host's (Python, dispatch, launches), which at
    these sizes can exceed the device's; both are reported. (A CUDA graph replay would time the same
    without the profiler, but eager autograd's backward cannot be captured: its worker thread
    invalidates the capture, measured on the H200.)"""
    try:
        kernels = profile_kernels(fn, n)
        return dict(
            device_ms=sum(k[0] for k in kernels),
            kernels=[dict(ms=ms, count=c, kernel=k[:100]) for ms, c, k in kernels[:10]],  # where it goes
        )
    except Exception as e:  # noqa: BLE001 - a diagnostic column: said, not hidden
        return dict(device_error=f"{type(e).__name__}: {e}"[:200])


# ---- training steps --------------------------------------------------------------------------------

# the training-step shapes and modes live with the command line (suite_args.py, no torch import)


def build(shape, mode):
    from transformers import AutoConfig, AutoModelForCausalLM

    s = SHAPES[shape]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(s["arch"], max_position_embeddings=2 * s["S"], **s["cfg"])
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    if s.get("lora"):
        from peft import LoraConfig, get_peft_model

        # r 16, alpha 32 on every linear of the decoder layers
        lin = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lc = LoraConfig(r=16, lora_alpha=32, target_modules=lin)
        model = get_peft_model(model, lc)
    return apply_mode(model, mode)


def apply_mode(model, mode: str):
    """A built model as `mode` runs it: as is (eager), model.compile() (also "... (reduce-overhead)",
    "... (cpp wrapper)"), kernelgraft.optimize()
    ("kernelgraft (inductor)", "kernelgraft (eager)", "... bf16 dW", "... no recompute", "... separate
    recompute", "... layers" (capture="layers", the default: one compiled graph per decoder-layer class), "... whole" (capture="whole": the model in one graph),
    "... reduce-overhead" (CUDA graphs), "... host launch" (the Python launcher per call), "... inference kernels" (row kernels in graphs without gradients too), "... no projections" (q/k/v and gate/up as separate matmuls), "... python wrapper" (inductor's Python wrapper for every graph, decoding's too), "... ddp pieces 200 MB", "... ddp pieces at buckets"), or Liger's
    patch (of a peft model's base model)."""
    if mode == "torch.compile":
        model.compile()
    elif mode == "torch.compile (reduce-overhead)":
        model.compile(mode="reduce-overhead")
    elif mode == "torch.compile (cpp wrapper)":  # inductor's C++ wrapper for every graph
        model.compile(options={"cpp_wrapper": True})
    elif mode.startswith("kernelgraft"):
        import kernelgraft

        acc = "weight" if "bf16 dW" in mode else "fp32" if "fp32 dW" in mode else "auto"
        # "... ddp pieces 200 MB": optimize's ddp_piece_mb; "... ddp pieces at buckets": None
        pieces = re.search(r"ddp pieces (at buckets|[0-9.]+ MB)", mode)
        piece = (
            {}
            if not pieces
            else {"ddp_piece_mb": None if pieces[1] == "at buckets" else float(pieces[1][:-3])}
        )
        kernelgraft.optimize(
            model,
            backend="eager" if "(eager" in mode else "inductor",
            mode="reduce-overhead" if "reduce-overhead" in mode else None,
            launch="host" if "host launch" in mode else "inductor",
            inference="kernels" if "inference kernels" in mode else "inductor",
            fuse_projections="no projections" not in mode,
            wrapper="python" if "python wrapper" in mode else "auto",
            lm_head_accumulate=acc,
            **({"capture": "whole"} if "whole" in mode else {"capture": "layers"} if "layers" in mode else {}),
            **piece,
            recompute=False
            if "no recompute" in mode
            else "separate"
            if "separate recompute" in mode
            else True,
        )
    elif mode == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
        _apply_liger_kernel_to_instance(model=base)
    elif mode != "eager":
        raise ValueError(f"unknown mode {mode!r}; one of {MODES} (or 'kernelgraft (... bf16 dW)')")
    return model


def measure_step(shape, mode, steps):
    s = SHAPES[shape]
    model = build(shape, mode)
    ids = torch.randint(0, s["cfg"]["vocab_size"], (s["B"], s["S"]), device="cuda")

    host_fwd = []  # seconds the host spends launching each forward (nothing in it waits for the GPU)

    cache = {} if USE_CACHE is None else {"use_cache": USE_CACHE}

    graphs = "reduce-overhead" in mode  # CUDA graphs: each step is a new iteration of the graphs

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, **cache).loss
        host_fwd.append(time.perf_counter() - t0)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    torch.cuda.synchronize()
    t = time.perf_counter()
    first_loss = step()
    first = time.perf_counter() - t
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # what a step starts from (the weights and the batch; gradients are None): the peak is also
    # reported above it, as the peers' published figures count it
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    med = sorted(times)[len(times) // 2]
    fwd_host = sorted(host_fwd[-steps:])[steps // 2]
    out = dict(
        tok_s=s["B"] * s["S"] / med,
        times_ms=[round(t * 1e3, 2) for t in times],
        host_fwd_ms=fwd_host * 1e3,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30,
        peak_above_start_gib=(torch.cuda.max_memory_allocated() - base) / 2**30,
        first_step_s=first,
        loss=first_loss,
    )
    # one more step: what its forward saves for the backward (the peak's activations part)
    out["saved_gib"] = saved_bytes(model, lambda: model(input_ids=ids, labels=ids, **cache).loss) / 2**30
    if mode.startswith("kernelgraft"):
        out["sites"] = model.kernelgraft_report.counts()
    if PROFILE_STEPS:
        out["profile"] = profile_steps(step, PROFILE_STEPS)
    return out


def measure_steps_in_turns(
    shape, modes: list[str], rounds: int, device: str = "cuda", build_fn=None, spec: dict | None = None
) -> dict:
    """--turns: every mode's model built in one process (Liger's last: it reassigns transformers'
    globals), then `rounds` rounds of one step per mode, the order rotated each round
    (benchlib.in_turns). Each step runs with the globals its mode was built with (Liger's
    apply_rotary_pos_emb for Liger, the stock one for the others: a compiled graph guards on it).
    Per mode: the median step's tokens/s, the peak above the step's start (the other modes' weights
    are part of that start; absolute peaks are not comparable here and are left out), and each
    step's time over the reference's in the same round (Liger if measured, else the first mode):
    the clock drift that moves whole runs by 1-2 % falls on both steps of a round alike."""
    s = spec or SHAPES[shape]
    build_fn = build_fn or build  # (shape, mode) -> model; tests pass a tiny one
    ids = torch.randint(0, s["cfg"]["vocab_size"], (s["B"], s["S"]), device=device)
    cache = {} if USE_CACHE is None else {"use_cache": USE_CACHE}
    order, ref = turn_order(modes)

    def builder(mode):
        def make():
            model = build_fn(shape, mode)

            def step():
                if "reduce-overhead" in mode:  # CUDA graphs: each step a new iteration of them
                    torch.compiler.cudagraph_mark_step_begin()
                loss = model(input_ids=ids, labels=ids, **cache).loss
                loss.backward()
                model.zero_grad(set_to_none=True)
                return loss.item()

            return model, step

        return make

    got = in_turns({m: builder(m) for m in order}, rounds, torch.device(device))
    paired = paired_ratios({m: v["times_s"] for m, v in got.items()}, ref)
    out = {}
    for m in modes:
        v = got[m]
        out[m] = dict(
            tok_s=s["B"] * s["S"] / v["step_s"],
            times_ms=[round(t * 1e3, 2) for t in v["times_s"]],
            first_step_s=v["first_step_s"],
            loss=v["loss"],
            peak_gib=None,
            turns=rounds,
            paired=paired[m],
        )
        if v["peak_above_start"] is not None:
            out[m]["peak_above_start_gib"] = v["peak_above_start"] / 2**30
        if hasattr(v["model"], "kernelgraft_report"):
            out[m]["sites"] = v["model"].kernelgraft_report.counts()
    return out


# --no-cache: the step calls the model with use_cache=False (bench_distributed's step). Without it the
# model's default holds (True): Hugging Face then fills a KV cache in the training forward, as the
# peers' published benchmark and a Trainer without use_cache=False do
USE_CACHE = None
PROFILE_STEPS = 0  # --profile N: also break N steps down by kernel class (after the timed steps)
KERNEL_CLASSES = ("matmul", "attention", "kernelgraft", "inductor", "other triton", "aten", "copy/fill")


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel, from its name (cuBLAS/cuDNN/flash, kernelgraft's generated kernels
    `<pattern>__<spelling>__...`, inductor's `triton_...`, PyTorch's `at::native::...`)."""
    from kernelgraft.patterns import REGISTRY

    n = name.lower()
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")):
        return "matmul"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    if any(name.startswith(p + "__") for p in REGISTRY.names()):
        return "kernelgraft"
    if name.startswith("triton_"):
        return "inductor"
    if "memcpy" in n or "memset" in n:
        return "copy/fill"
    if "at::native" in name or "at::" in name:
        return "aten"
    return "other triton"


def profile_steps(step, n: int) -> dict:
    """Wall time vs GPU busy time per step, and the busy time by kernel class (torch.profiler):
    wall - busy is time the GPU waited for the host."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        t = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / n
    classes = dict.fromkeys(KERNEL_CLASSES, 0.0)
    top = []
    for e in p.key_averages():
        ms = e.device_time_total / 1e3 / n
        if ms <= 0 or e.key.startswith("ProfilerStep"):
            continue
        classes[kernel_class(e.key)] += ms
        top.append((ms, e.key[:120]))
    busy = sum(classes.values())
    top.sort(reverse=True)
    return dict(
        wall_ms=wall * 1e3,
        busy_ms=busy,
        classes_ms=classes,
        top=[dict(ms=m, kernel=k) for m, k in top[:15]],
        # one more step with host activity too: the idle gaps by the op that launched the kernel waited for
        idle=profile_idle(step, torch.cuda.synchronize),
    )


def loss_curves(steps=50):
    """50 AdamW steps of the 1B shape on one fixed stream of random batches: eager vs kernelgraft."""
    out = {}
    for mode in ("eager", "kernelgraft (inductor)"):
        model = build("llama-1b 8x2048", mode)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        gen = torch.Generator(device="cuda").manual_seed(0)
        losses = []
        for _ in range(steps):
            ids = torch.randint(0, 128256, (8, 2048), device="cuda", generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out[mode] = losses
        print(mode, "losses", [round(x, 4) for x in losses[:: max(1, steps // 10)]], flush=True)
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
    return out


# ---- report ----------------------------------------------------------------------------------------


def _table(L: list, title: str, head: list[str], entries: dict, key: str, faster, cells) -> None:
    """One Markdown table: a row per implementation, its ratios to eager, torch.compile and Liger
    (faster(own, peer) > 1 when it is faster) between its first cell and the rest; a failed entry
    says so across the row."""
    ref = {k: entries.get(k, {}).get(key) for k in ("eager", "torch.compile", "liger")}
    L += [f"\n{title}\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, v in entries.items():
        if "error" in v:
            L.append(f"| {n} | failed: {v['error'][:80]} |" + " |" * (len(head) - 2))
            continue
        first, *rest = cells(v)
        rat = [f"{faster(v[key], ref[k]):.2f}x" if ref[k] else "-" for k in ref]
        L.append(f"| {n} | {first} | {' | '.join(rat)} | {' | '.join(rest)} |")


def _loop_ms(row: dict, impl: str):
    return row["impls"].get(impl, {}).get("loop_ms")


def _loop_cells(v: dict, compile_ms) -> str:
    if "loop_ms" not in v:
        return " | - | -"
    return f" | {v['loop_ms']:.3f} | " + (f"{compile_ms / v['loop_ms']:.3f}x" if compile_ms else "-")


def markdown(doc) -> str:
    L = [f"Benchmark suite, bf16, {doc['gpu']}, {doc['date']}, {doc['versions']}\n"]
    for r in doc.get("patterns", []):
        _table(
            L,
            f"**{r['name']}** (memory floor, fwd+bwd: {r['floor_ms']:.3f} ms)",
            [
                "impl",
                "fwd ms",
                "bwd ms",
                "fwd+bwd ms",
                "vs eager",
                "vs compile",
                "vs Liger",
                "peak MiB",
                "fwd+bwd device ms",
                "device vs floor",
                "in a loop, ms per call",
                "loop vs compile",
            ],
            r["impls"],
            "fwd_bwd_ms",
            lambda own, peer: peer / own,
            lambda v, floor=r["floor_ms"], r=r: (
                f"{v['fwd_ms']:.3f} | {v['bwd_ms']:.3f} | {v['fwd_bwd_ms']:.3f}",
                f"{v['peak_mib']:.0f} | "
                + (f"{v['device_ms']:.3f} | {v['device_ms'] / floor:.2f}x" if "device_ms" in v else "- | -")
                + _loop_cells(v, _loop_ms(r, "torch.compile")),
            ),
        )
    for shape, modes in doc.get("steps", {}).items():
        _table(
            L,
            f"**Training step, {shape}** (fwd + bwd, no optimizer"
            + (", use_cache=False" if doc.get("use_cache") is False else "")
            + ")",
            [
                "mode",
                "tokens/s",
                "vs eager",
                "vs compile",
                "vs Liger",
                "peak GiB",
                "above the step's start",
                "saved GiB",
                "first step s",
            ],
            modes,
            "tok_s",
            lambda own, peer: own / peer,
            lambda v: (
                f"{v['tok_s']:,.0f}",
                f"{v['peak_gib']:.1f}" if v.get("peak_gib") is not None else "-",
                f"{v['peak_above_start_gib']:.1f}" if "peak_above_start_gib" in v else "-",
                f"{v['saved_gib']:.1f}" if "saved_gib" in v else "-",
                f"{v['first_step_s']:.1f}",
            ),
        )
    for shape, modes in doc.get("steps", {}).items():
        turns = {m: v["paired"] for m, v in modes.items() if "paired" in v}
        if not turns:
            continue
        ref = next(iter(turns.values()))["ref"]
        n = next(v["turns"] for v in modes.values() if "turns" in v)
        L += [
            f"\n**Modes taking turns step by step, {shape}** ({n} rounds in one process, the order "
            f"rotated each round): each step's time over {ref}'s in the same round; above 1 is slower\n",
            "| mode | median | lowest | highest |",
            "|---|---|---|---|",
        ]
        L += [f"| {m} | {p['median']:.4f} | {p['low']:.4f} | {p['high']:.4f} |" for m, p in turns.items()]
    for shape, modes in doc.get("steps", {}).items():
        prof = {m: v["profile"] for m, v in modes.items() if "profile" in v}
        if not prof:
            continue
        L += [
            f"\n**Where a step's time goes, {shape}** (torch.profiler, ms per step; idle = wall - GPU busy)\n",
            "| mode | wall | GPU busy | idle | " + " | ".join(KERNEL_CLASSES) + " |",
            "|---|---|---|---|" + "---|" * len(KERNEL_CLASSES),
        ]
        for m, p in prof.items():
            cl = " | ".join(f"{p['classes_ms'].get(k, 0.0):.1f}" for k in KERNEL_CLASSES)
            L.append(
                f"| {m} | {p['wall_ms']:.1f} | {p['busy_ms']:.1f} | {p['wall_ms'] - p['busy_ms']:.1f} | {cl} |"
            )
        for m, p in prof.items():
            idle = p.get("idle")
            if not idle:
                continue
            L.append(
                f"\n{m}: the GPU's idle gaps in one step profiled with host activity ({idle['idle_ms']:.1f} ms in "
                f"{idle['gaps']} gaps; the profiler's host cost inflates them), by the host op that launched "
                "the kernel waited for:\n"
            )
            L += ["| op | ms | gaps |", "|---|---|---|"]
            L += [f"| `{r['op']}` | {r['ms']:.2f} | {r['gaps']} |" for r in idle["by_op"]]
    if doc.get("decode"):
        import bench_decode

        L.append(bench_decode.markdown(doc["decode"]))
    if doc.get("curves"):
        c = doc["curves"]
        a, b = c.get("eager"), c.get("kernelgraft (inductor)")
        if a and b:
            d = max(abs(x - y) / abs(x) for x, y in zip(a, b))
            L.append(
                f"\nLoss curves, 50 AdamW steps, 1B shape: max relative difference {d:.2e}; last {a[-1]:.4f} vs {b[-1]:.4f}"
            )
    return "\n".join(L) + "\n"


def plot(path):
    """PNG plots from a suite.json (needs matplotlib; run where it is installed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.load(open(path))
    stem = os.path.splitext(path)[0]
    made = []
    pats = doc.get("patterns", [])
    if pats:
        names = [r["name"] for r in pats]
        impls_ = sorted({k for r in pats for k in r["impls"]})
        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(names)), 4))
        w = 0.8 / len(impls_)
        for i, imp in enumerate(impls_):
            ys = [
                r["impls"].get(imp, {}).get("fwd_bwd_ms", float("nan")) / r["impls"]["torch.compile"]["fwd_bwd_ms"]
                if "fwd_bwd_ms" in r["impls"].get("torch.compile", {}) else float("nan")
                for r in pats
            ]  # fmt: skip
            ax.bar([j + i * w for j in range(len(names))], ys, w, label=imp)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(
            [j + 0.4 - w / 2 for j in range(len(names))], names, rotation=30, ha="right", fontsize=7
        )
        ax.set_ylabel("fwd+bwd time / torch.compile's")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(stem + "_patterns.png", dpi=130)
        made.append(stem + "_patterns.png")
    steps = doc.get("steps", {})
    if steps:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
        shapes = list(steps)
        modes = sorted({m for v in steps.values() for m in v})
        w = 0.8 / len(modes)
        for i, m in enumerate(modes):
            a1.bar(
                [j + i * w for j in range(len(shapes))],
                [steps[s].get(m, {}).get("tok_s", 0) for s in shapes],
                w,
                label=m,
            )
            a2.bar(
                [j + i * w for j in range(len(shapes))],
                # the peak above the step's start where the run measured it in turns (no peak)
                [_gib(steps[s].get(m, {})) for s in shapes],
                w,
                label=m,
            )
        for ax, lab in ((a1, "tokens/s"), (a2, "GiB (peak, or above the step's start)")):
            ax.set_xticks([j + 0.4 - w / 2 for j in range(len(shapes))], shapes, rotation=15, fontsize=8)
            ax.set_ylabel(lab)
        a1.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(stem + "_steps.png", dpi=130)
        made.append(stem + "_steps.png")
    if doc.get("curves"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for m, ys in doc["curves"].items():
            ax.plot(range(1, len(ys) + 1), ys, label=m, lw=1.2, ls="-" if m == "eager" else "--")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("Llama-3.2-1B shape, 8x2048, AdamW: eager vs kernelgraft")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem + "_curves.png", dpi=130)
        made.append(stem + "_curves.png")
    return made


def _gib(row: dict) -> float:
    return row.get("peak_gib") or row.get("peak_above_start_gib") or 0.0


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    global PROFILE_STEPS, USE_CACHE
    PROFILE_STEPS = a.profile
    USE_CACHE = False if a.no_cache else None
    if a.merge:
        doc = {}
        for p in a.merge:
            d = json.load(open(p))
            for k, v in d.items():
                if k == "steps":
                    for shape, modes in v.items():
                        doc.setdefault("steps", {}).setdefault(shape, {}).update(modes)
                else:
                    doc[k] = v
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "suite.json")
        json.dump(doc, open(path, "w"), indent=1)
        open(os.path.join(a.out, "suite.md"), "w").write(markdown(doc))
        a.plot = path
    if a.plot:
        for p in plot(a.plot):
            print(p)
        return 0
    if not torch.cuda.is_available():
        print("kernelgraft bench: needs a CUDA GPU (the numbers are GPU timings)", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    import transformers
    import triton

    doc = dict(
        date=datetime.date.today().isoformat(),
        gpu=torch.cuda.get_device_name(),
        versions=f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}",
    )
    if a.no_cache:
        doc["use_cache"] = False
    path = os.path.join(a.out, "suite.json")

    def save():
        failed = failed_kernels_note(doc)
        json.dump(doc, open(path, "w"), indent=1)
        open(os.path.join(a.out, "suite.md"), "w").write(markdown(doc) + failed)

    parts = a.parts.split(",")
    if "patterns" in parts:
        doc["patterns"] = []
        keep = [k for k in a.only.split(",") if k]
        for case in pattern_cases(a.quick):
            if keep and not any(k in case[0] for k in keep):
                continue
            doc["patterns"].append(measure_pattern(*case))
            save()
    if "lm_head" in parts:
        import bench_lm_head

        doc["lm_head"] = [bench_lm_head.measure(*s) for s in bench_lm_head.SHAPES]
        save()
    if "steps" in parts:
        doc["steps"] = {shape: {} for shape in a.shapes.split(",")}
        # Liger patches transformers' modules for the rest of the process: its runs come last
        modes = names(a.modes)

        # the shape's own extra modes (the host-bound shape: CUDA graphs) unless --modes names them
        def modes_of(shape):
            extra = [] if a.modes != ap.get_default("modes") else list(SHAPES[shape].get("extra_modes", ()))
            return [m for m in modes if m != "liger"] + extra + (["liger"] if "liger" in modes else [])

        order = [(m, sh) for sh in doc["steps"] for m in modes_of(sh) if m != "liger"]
        order += [("liger", sh) for sh in doc["steps"] if "liger" in modes]
        if a.turns:
            apart = []  # shapes whose modes' models do not fit on the card together: one after another
            for shape in doc["steps"]:
                try:
                    doc["steps"][shape] = measure_steps_in_turns(shape, modes_of(shape), a.steps)
                except torch.cuda.OutOfMemoryError:
                    print(
                        f"{shape}: the modes' models do not fit on the card together; measuring them "
                        "one after another in this process (no paired rounds)",
                        flush=True,
                    )
                    apart.append(shape)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    traceback.print_exc()
                    doc["steps"][shape] = {
                        m: dict(error=f"{type(e).__name__}: {e}"[:300]) for m in modes_of(shape)
                    }
                print(shape, doc["steps"][shape], flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                save()
            order = [(m, sh) for m, sh in order if sh in apart]
        for mode, shape in order:
            try:
                r = measure_step(shape, mode, a.steps)
            except Exception as e:  # noqa: BLE001 - a failing mode is reported, the others still run
                traceback.print_exc()
                r = dict(error=f"{type(e).__name__}: {e}"[:300])
            print(shape, mode, r, flush=True)
            doc["steps"][shape][mode] = r
            gc.collect()
            torch.cuda.empty_cache()
            save()
    if "curves" in parts:
        doc["curves"] = loss_curves()
        save()
    if "decode" in parts:
        import bench_decode

        doc["decode"] = bench_decode.run()
        save()
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
