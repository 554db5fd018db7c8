"""The longest context that trains on one GPU: per (row, mode), the longest sequence at batch 1 for which
a full training step fits (forward with labels, backward, and torch.optim.AdamW's step over the
trainable parameters, fused on CUDA), found by doubling from --min until a step runs out of memory
or --max is reached, then bisecting to --resolution tokens; then tokens/s, the device's time of one
step and the peak memory at that length and at 8k, 32k and 128k where they fit.

Rows: "llama-8b LoRA" (the Llama-3.1-8B shape, bf16, peft LoRA r16 alpha 32 on q, k, v, o, gate, up
and down, dropout 0), "llama-8b QLoRA" (the same on a bitsandbytes NF4 double-quant base,
bench_unsloth.qlora_model) and "llama-1b full" (the Llama-3.2-1B shape, full fine-tune, bf16). Random
weights (seed 0), every dropout and jitter rate zero, SDPA attention, every call with use_cache=False.

Modes: eager; "eager (checkpointing)" (Hugging Face's gradient checkpointing, non-reentrant);
torch.compile; liger; unsloth (FastLanguageModel on the row's model saved to a folder, its default
use_gradient_checkpointing="unsloth", which offloads the checkpoints to the host: Unsloth's
long-context setup); kernelgraft (kernelgraft.optimize(model)); "kernelgraft (memory=auto)" and
"kernelgraft (offload)" (optimize's memory="auto" and offload=True). Each (row, mode) runs in a
process of its own (Unsloth patches transformers' classes at import, Liger reassigns its globals);
a mode whose peer is not importable is skipped with the reason, and a mode that fails otherwise
records its error and the run goes on.

A probe runs one step on 1 x L random token ids. A step that raises torch.OutOfMemoryError (or an
error whose message says it ran out of memory: Triton's, cuBLAS's) does not fit; everything is then
freed (gc, empty_cache) and the search goes on in the same process. AdamW's state is made before
the first probe (a step of zero gradients), so that every step carries it, as a training step does.
A mode's search stops after --mode-seconds (--fresh-seconds for memory="auto", below; a probe already
running finishes): the longest length that fit so far is kept, marked "cut short". The child processes run with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (unless set), the allocator setting long-context runs
use, for every mode alike.

Compiled modes (torch.compile, kernelgraft) mark the sequence dimension dynamic
(torch._dynamo.maybe_mark_dynamic): one graph serves every length, so a probe costs a step, not a
compile. `--shapes static` compiles each length on its own instead (as a run at one length gets it;
recompile limits lifted), at a compile per probe. memory="auto" picks kernelgraft's levers (offload,
token tiles, the LM head's chunks) at the model's first training call, from its length: that mode
builds and optimizes its model anew for every probe and every measured length (static shapes), so
that each length runs with the levers a run at that length gets, at a build and a compile per probe
(the JSON's memory_plans say what was picked at each). At each measured length: one warm-up step, the median
of --steps timed steps by wall time (synchronized), torch.cuda.max_memory_allocated over them (the
whole process: weights, optimizer state and step), and one more step under torch.profiler, its CUDA
kernels summed (benchlib.cuda_kernels).

`--check-grads N`: the Llama-3.2-1B shape with LoRA r16 in bf16 (lora_B drawn at random, so that
lora_A has gradients) at 1 x N tokens: the loss and every LoRA gradient by kernelgraft (memory="auto")
and by eager with gradient checkpointing, judged against the truth by kernelgraft's rule (gradcheck.judge).
The truth runs in float64 where it fits, else in float32 with TF32 off and gradient checkpointing, as
the JSON says.

On the GPU host (the peers installed as bench_unsloth.py says):

    PYTHONPATH=$PWD/.peers_site python benchmarks/bench_context.py --out benchmarks/out/context
        [--rows "llama-8b LoRA"] [--modes "unsloth,kernelgraft (offload)"] [--check-grads 32768]
        -> DIR/context.json, DIR/context.md (rewritten after every mode), DIR/context.png (matplotlib),
           DIR/logs/ (each process's output); published as benchmarks/results/context/<date>-context.json
    python benchmarks/bench_context.py --plot DIR/context.json       (the PNG anywhere)
    python benchmarks/bench_context.py --merge A/context.json B/context.json --out DIR
        (runs of some rows and modes each, one table)
    python benchmarks/bench_context.py --smoke --out DIR             (no GPU: a tiny Llama on the CPU,
        lengths 16..256, a memory limit on the bytes saved for the backward, --smoke-limit-mib)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import bench_unsloth as bu  # noqa: E402
from benchlib import cuda_kernels, names, provenance, versions_text  # noqa: E402
from suite_args import SHAPES, _Parser  # noqa: E402

# what the results file says of the run: the versions of what is measured
DISTS = (
    "torch",
    "triton",
    "transformers",
    "peft",
    "unsloth",
    "unsloth_zoo",
    "bitsandbytes",
    "liger-kernel",
    "kernelgraft",
)
ROWS = {
    "llama-8b LoRA": dict(shape="llama-8b 2x4096", train="lora"),
    "llama-8b QLoRA": dict(shape="llama-8b 2x4096", train="qlora"),
    "llama-1b full": dict(shape="llama-1b 8x2048", train="full"),
}
SMOKE_ROW = "tiny llama"  # kernelgraft.tiny's Llama, float32 on the CPU, full fine-tune
KERNELGRAFT = {"kernelgraft": {}, "kernelgraft (memory=auto)": dict(memory="auto"), "kernelgraft (offload)": dict(offload=True)}  # fmt: skip
MODES = ("eager", "eager (checkpointing)", "torch.compile", "liger", "unsloth", *KERNELGRAFT)
SMOKE_MODES = ("eager", "kernelgraft", "kernelgraft (memory=auto)")
COMPILED = ("torch.compile", *KERNELGRAFT)
# modes whose levers kernelgraft picks at the model's first training call, from its shape: a model per length
FRESH = ("kernelgraft (memory=auto)",)
GRADS_SHAPE = "llama-1b 8x2048"  # --check-grads' model: this shape with LoRA
LORA_B_STD = 0.02  # peft starts lora_B at zero, which would leave lora_A without gradients
# --smoke's defaults, where the option is not given
SMOKE = dict(min=16, max=256, resolution=16, mode_seconds=60.0, fresh_seconds=60.0, steps=1, at="32,128", modes=",".join(SMOKE_MODES))  # fmt: skip
GPU = dict(min=4096, max=524288, resolution=1024, mode_seconds=300.0, fresh_seconds=1800.0, steps=3, at="8192,32768,131072", modes=",".join(MODES))  # fmt: skip


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def is_oom(e: BaseException) -> bool:
    """An error that says the device ran out of memory: torch's, or a library's (Triton, cuBLAS)."""
    import torch

    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text.lower() or "ALLOC_FAILED" in text


def unavailable(row: str, mode: str, smoke: bool) -> str | None:
    """Why (row, mode) cannot run here, in one line; None where it can."""
    if smoke:
        return None
    peers = "install the peers' wheels (python benchmarks/peers.py install --wheels .peers --target .peers_site) and run with PYTHONPATH=$PWD/.peers_site"  # fmt: skip
    if mode == "unsloth":
        try:
            bu.need_unsloth()
        except bu.Unavailable as e:
            return str(e)
    if mode == "liger" and importlib.util.find_spec("liger_kernel") is None:
        return f"liger_kernel is not importable: {peers}"
    if ROWS[row]["train"] == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        return f"bitsandbytes is not importable (the QLoRA row needs it): {peers}"
    return None


# ---- the search --------------------------------------------------------------------------------------


def search(fits, lo: int, hi: int, resolution: int, seconds: float = math.inf, probes=None, clock=time.monotonic,
           on_probe=None) -> dict:  # fmt: skip
    """The longest length in [lo, hi] for which fits(length) is true: lo, 2 lo, 4 lo ... (capped at hi)
    until one does not fit, then bisection on multiples of `resolution` until the longest that fits
    and the shortest that does not are `resolution` apart. No probe starts after `seconds`.

    -> dict(longest: the longest that fit (None: not even lo), shortest_failed (None: none failed),
    search: "complete" (bracketed to the resolution), "reached max" (hi fit), "nothing fit" (lo did
    not) or "cut short" (out of time), probes: [[length, fit, seconds], ...] in order). `probes`, a
    list, is filled as the probes run (a caller keeps them if fits raises); on_probe(probes) after each.

    >>> search(lambda n: n <= 5000, 1024, 65536, 256)["longest"]
    4864
    """
    probes = [] if probes is None else probes
    start = clock()
    best = fail = None

    def probe(n: int) -> bool:
        t = clock()
        ok = bool(fits(n))
        probes.append([n, ok, round(clock() - t, 3)])
        if on_probe is not None:
            on_probe(probes)
        return ok

    def late() -> bool:
        return clock() - start >= seconds

    status = None
    n = lo
    while status is None:
        if late():
            status = "cut short"
        elif not probe(n):
            fail = n
            break
        else:
            best = n
            if n >= hi:
                break
            n = min(2 * n, hi)
    while status is None and best is not None and fail is not None and fail - best > resolution:
        if late():
            status = "cut short"
            break
        # the middle on the resolution's grid, above best (fail - best > resolution leaves room below fail)
        mid = max((best + fail) // 2 // resolution * resolution, (best // resolution + 1) * resolution)
        if probe(mid):
            best = mid
        else:
            fail = mid
    if status is None:
        status = "nothing fit" if best is None else "reached max" if fail is None else "complete"
    return dict(longest=best, shortest_failed=fail, search=status, probes=probes)


# ---- one (row, mode) in this process --------------------------------------------------------------------


def model_config(row: str, a):
    """The row's transformers config: its shape (max_position_embeddings twice --max), every random rate
    zero, SDPA; in --smoke kernelgraft.tiny's Llama."""
    from kernelgraft.tiny import deterministic, tiny_config

    if a.smoke:
        cfg = tiny_config("llama")
        cfg.max_position_embeddings = 2 * a.max
    else:
        cfg = bu.config(dict(SHAPES[ROWS[row]["shape"]], S=a.max))
    cfg._attn_implementation = "sdpa"
    return deterministic(cfg)


def random_model(cfg, device, dtype):
    """A causal LM of cfg with random weights (seed 0), as suite.build and bench_unsloth.saved_model draw them."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg).to(dtype)


def with_lora(model):
    """peft LoRA as bench_unsloth's rows: r 16, alpha 32 on every linear of the decoder layers, no dropout."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=bu.LORA_R, lora_alpha=bu.LORA_ALPHA, target_modules=list(bu.LINEARS), lora_dropout=0.0, bias="none")  # fmt: skip
    return get_peft_model(model, lora)


def saved(row: str, a) -> str:
    """The folder of the row's random bf16 model (saved once; Unsloth and QLoRA load a folder), its
    max_position_embeddings twice --max, so that Unsloth scales no RoPE. The memory saving took is
    given back before the folder is loaded."""
    import torch

    shape = ROWS[row]["shape"]
    folder = os.path.join(a.models, f"context-{bu.slug(shape)}-{2 * a.max}")
    bu.saved_model(dict(SHAPES[shape], S=a.max), folder)
    gc.collect()
    torch.cuda.empty_cache()
    return folder


def build_unsloth(row: str, a):
    """FastLanguageModel.from_pretrained of the row's saved folder, its max_seq_length --max (Unsloth
    truncates longer inputs), with Unsloth's default gradient checkpointing ("unsloth"); LoRA through
    get_peft_model as the other modes'; 4-bit for the QLoRA row, full_finetuning for the full row."""
    bu.need_unsloth()
    import torch
    import unsloth  # noqa: F401 - before transformers: it patches transformers' classes
    from unsloth import FastLanguageModel

    train = ROWS[row]["train"]
    extra = dict(full_finetuning=True, use_gradient_checkpointing="unsloth") if train == "full" else {}
    model, _ = FastLanguageModel.from_pretrained(
        model_name=saved(row, a),
        max_seq_length=a.max,
        dtype=torch.bfloat16,
        load_in_4bit=train == "qlora",
        **extra,
    )
    if train != "full":
        model = FastLanguageModel.get_peft_model(
            model, r=bu.LORA_R, lora_alpha=bu.LORA_ALPHA, target_modules=list(bu.LINEARS), lora_dropout=0,
            bias="none", use_gradient_checkpointing="unsloth",
        )  # fmt: skip
    return model


def check_deterministic(model) -> None:
    """Refuse a model whose config has a dropout or jitter rate above zero (a folder saved elsewhere)."""
    from kernelgraft.tiny.configs import RANDOM_RATES

    cfg = getattr(model, "config", None)
    rates = vars(cfg) if cfg is not None else {}
    bad = {k: v for k, v in rates.items() if isinstance(v, float) and v > 0 and any(r in k for r in RANDOM_RATES)}  # fmt: skip
    if bad:
        raise ValueError(f"the model's config has random rates {bad}: remove the saved folder under --models and run again")  # fmt: skip


def build(row: str, mode: str, a):
    """The model of (row, mode), on the device, in training mode."""
    import torch

    if mode == "unsloth":
        model = build_unsloth(row, a)
    else:
        if a.smoke:
            model = random_model(model_config(row, a), "cpu", torch.float32)
        elif ROWS[row]["train"] == "qlora":
            model = bu.qlora_model(saved(row, a))
        else:
            model = random_model(model_config(row, a), "cuda", torch.bfloat16)
            model = with_lora(model) if ROWS[row]["train"] == "lora" else model
        if mode == "eager (checkpointing)":
            bu.enable_checkpointing(model)
        elif mode in ("torch.compile", "liger"):
            import suite

            suite.apply_mode(model, mode)
        elif mode in KERNELGRAFT:
            import kernelgraft

            kernelgraft.optimize(model, backend="eager" if a.smoke else "inductor", **KERNELGRAFT[mode])
    check_deterministic(model)
    model.train()
    return model


class Steps:
    """Training steps at batch 1 of the model make() builds: run(ids) is forward, backward, AdamW's step
    and zero_grad. AdamW's state is made before the first step (a step of zero gradients), so that every
    step finds it, as a training step does. With `fresh` every length gets a model built anew (its
    first training call at that length: the levers memory="auto" picks there are that length's), else
    one model serves every length. In --smoke a step whose tensors saved for the backward (the
    parameters aside) pass --smoke-limit-mib raises torch.OutOfMemoryError: the CPU's stand-in for the
    GPU's memory."""

    def __init__(self, make, a, mode: str):
        self.make, self.smoke, self.cuda = make, a.smoke, not a.smoke
        self.fresh = mode in FRESH
        # one graph for every length; a model built per length sees one length, and compiles it as such
        self.mark = mode in COMPILED and a.shapes == "dynamic" and not self.fresh
        self.limit = a.smoke_limit_mib * 2**20
        self.model = self.opt = None
        self.saved = self.saved_peak = 0
        self.plans: dict = {}  # length -> what memory="auto" chose there (kernelgraft's report.memory)
        self.leftover_gib = 0.0
        self.ready()

    def ready(self) -> None:
        """A model and its optimizer to step: the one there is, or one built anew where `fresh`."""
        import torch

        if self.model is not None and not self.fresh:
            return
        if self.model is not None:
            self.model = self.opt = None
            torch._dynamo.reset()  # the dropped model's graphs: the next model compiles its own
            self.clean()
            if self.cuda:  # what the dropped model left on the device (0 unless something holds on to it)
                self.leftover_gib = max(self.leftover_gib, torch.cuda.memory_allocated() / 2**30)
        self.model = model = self.make()
        self.vocab = model.config.vocab_size
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=1e-5, fused=self.cuda)
        for p in trainable:
            p.grad = torch.zeros_like(p)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def note_plan(self, n: int) -> None:
        plan = getattr(getattr(self.model, "kernelgraft_report", None), "memory", None)
        if self.fresh and plan is not None:
            self.plans[str(n)] = str(plan)[:1000]

    def ids(self, n: int):
        import torch

        ids = torch.randint(0, self.vocab, (1, n), generator=torch.Generator().manual_seed(n))
        ids = ids.to("cuda" if self.cuda else "cpu")
        if self.mark:
            torch._dynamo.maybe_mark_dynamic(ids, 1)
        return ids

    def _pack(self, t):
        import torch

        st = t.untyped_storage()
        if st.data_ptr() not in self.params:
            self.saved += st.nbytes()
            self.saved_peak = max(self.saved_peak, self.saved)
            if self.saved > self.limit:
                raise torch.OutOfMemoryError(
                    f"smoke: {self.saved} bytes saved for the backward, over --smoke-limit-mib (out of memory)"
                )
        return t

    def run(self, ids) -> float:
        import torch

        self.saved = 0
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t) if self.smoke else contextlib.nullcontext()  # fmt: skip
        with hooks:
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def clean(self) -> None:
        """Free what a step (or a step that ran out of memory) left: gradients, cached blocks, the peak."""
        import torch

        for m in (self.opt, self.model):
            if m is not None:
                m.zero_grad(set_to_none=True)
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        self.saved = self.saved_peak = 0

    def reset_peak(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.saved_peak = 0

    def peak_gib(self) -> float:
        import torch

        return (torch.cuda.max_memory_allocated() if self.cuda else self.saved_peak) / 2**30

    def fits(self, n: int, failures: dict) -> bool:
        """One step at n tokens; False where it ran out of memory (its message kept in failures[n])."""
        why = None
        self.ready()
        try:
            ids = self.ids(n)
            self.run(ids)
            self.sync()
        except Exception as e:  # noqa: BLE001 - only running out of memory is a probe's answer
            if not is_oom(e):
                raise
            why = first_line(e)
        ids = None  # the except block is left: the traceback, and the activations its frames held, are gone
        self.note_plan(n)
        self.clean()
        if why is not None:
            failures[str(n)] = why
        return why is None

    def measure(self, n: int, steps: int) -> dict:
        """Tokens/s by wall time (median of `steps` after one warm-up), the peak GiB over them, and the
        device ms of one more step (its CUDA kernels summed)."""

        out = {}
        self.ready()
        try:
            ids = self.ids(n)
            self.run(ids)
            self.sync()
            self.reset_peak()
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                loss = self.run(ids)
                self.sync()
                times.append(time.perf_counter() - t)
            med = sorted(times)[len(times) // 2]
            out.update(tokens_per_s_wall=n / med, step_s=med, times_s=[round(x, 4) for x in times], peak_gib=self.peak_gib(), loss=loss)  # fmt: skip
            if self.cuda:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    self.run(ids)
                    self.sync()
                kernels = cuda_kernels(prof, 1)
                out.update(device_ms=sum(k[0] for k in kernels), kernels=[dict(ms=ms, count=c, kernel=k[:100]) for ms, c, k in kernels[:5]])  # fmt: skip
            else:
                out["peak_note"] = "smoke: GiB saved for the backward, not device memory"
        except Exception as e:  # noqa: BLE001 - as in fits
            if not is_oom(e):
                raise
            out["error"] = f"out of memory at measurement: {first_line(e)}"
        ids = None
        self.note_plan(n)
        self.clean()
        if not self.cuda:
            out.setdefault("device_ms", None)
        return out


def run_one(row: str, mode: str, a) -> None:
    """One (row, mode) in this process, written to --json after every probe and measurement."""
    import torch

    out: dict = dict(row=row, mode=mode, shapes=a.shapes)

    def save(*_):
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)

    why = unavailable(row, mode, a.smoke)
    if why is None and not a.smoke and not torch.cuda.is_available():
        why = f"the {mode} mode needs a CUDA GPU, and torch sees none"
    if why:
        out["skipped"] = why
        return save()
    cfg = torch._dynamo.config
    if a.shapes == "static":
        cfg.automatic_dynamic_shapes = False
    from kernelgraft._dynamo import room_for_recompiles

    t = time.perf_counter()
    # every length of --shapes static compiles anew, and must not hit the limit that falls back to eager
    with room_for_recompiles():
        steps = Steps(lambda: build(row, mode, a), a, mode)
        out["build_s"] = round(time.perf_counter() - t, 1)
        if not a.smoke:
            props = torch.cuda.get_device_properties(0)
            out.update(device=props.name, device_memory_gib=props.total_memory / 2**30)
            out["start_gib"] = torch.cuda.memory_allocated() / 2**30  # weights and optimizer state
        out["oom"] = {}
        probes = out["probes"] = []
        t = time.perf_counter()
        try:
            got = search(lambda n: steps.fits(n, out["oom"]), a.min, a.max, a.resolution, budget(mode, a), probes, on_probe=save)  # fmt: skip
            out.update(got, search_s=round(time.perf_counter() - t, 1))
        except Exception as e:  # noqa: BLE001 - the mode's error, one line; the lengths that fit are kept
            traceback.print_exc()
            fit = [n for n, ok, _ in probes if ok]
            out.update(search="error", error=first_line(e), longest=max(fit, default=None))
            out["search_s"] = round(time.perf_counter() - t, 1)
        save()
        longest = out["longest"] if out["search"] != "error" else None
        at = [] if longest is None else [longest] + [n for n in a.at_list if n < longest]
        out["measurements"] = {}
        for n in at:
            try:
                out["measurements"][str(n)] = steps.measure(n, a.steps)
            except Exception as e:  # noqa: BLE001 - as the search's
                traceback.print_exc()
                out["measurements"][str(n)] = dict(error=first_line(e))
            save()
    rep = getattr(steps.model, "kernelgraft_report", None)
    if rep is not None:
        out["sites"] = rep.counts(graph="training")
        out["stock_runs"] = list(rep.stock_runs)
        out["fell_back"] = [f"{r.module}: {r.status()}" for r in rep.fell_back_at_run_time()][:10]
        if steps.plans:
            out["memory_plans"] = steps.plans
            out["leftover_gib"] = steps.leftover_gib
        elif getattr(rep, "memory", None) is not None:
            out["memory_plan"] = str(rep.memory)[:1000]
    save()


# ---- --check-grads --------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_tf32():
    """float32 matmuls and convolutions in IEEE float32 (no TF32) inside."""
    import torch

    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was


def loss_and_grads(model, ids, float64: bool = False):
    """The loss and the trainable parameters' gradients (on the host) of one forward and backward."""
    from kernelgraft.gradcheck import Float64Everywhere

    model.zero_grad(set_to_none=True)
    with Float64Everywhere() if float64 else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    got = loss.detach().double().cpu().reshape(1), grads
    model.zero_grad(set_to_none=True)
    return got


def check_grads(n: int, a) -> dict:
    """--check-grads: kernelgraft (memory="auto") and eager with gradient checkpointing against the
    truth, the loss and every LoRA gradient, at 1 x n tokens."""
    import copy

    import torch

    from kernelgraft.gradcheck import judge

    cuda = not a.smoke
    device = "cuda" if cuda else "cpu"

    def free():
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    if a.smoke:
        cfg = model_config(SMOKE_ROW, a)
    else:
        cfg = bu.config(dict(SHAPES[GRADS_SHAPE], S=n))
        cfg._attn_implementation = "sdpa"
        from kernelgraft.tiny import deterministic

        deterministic(cfg)
    base = with_lora(random_model(cfg, device, torch.bfloat16))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * LORA_B_STD)
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    out = dict(
        shape="tiny Llama" if a.smoke else f"Llama-3.2-1B shape ({cfg.num_hidden_layers} layers)",
        tokens=n, weights="bf16 base, LoRA r16 alpha 32 on every linear (peft's float32 adapters)",
        lora_B=f"drawn from N(0, {LORA_B_STD}^2), so that lora_A has gradients",
        candidate='kernelgraft.optimize(model, memory="auto")', reference="eager, gradient checkpointing (non-reentrant)",
    )  # fmt: skip
    truth = None
    try:
        truth = loss_and_grads(copy.deepcopy(base).double(), ids, float64=True)
        out["truth"] = "float64 (every dtype the model names promoted: gradcheck.Float64Everywhere)"
    except Exception as e:  # noqa: BLE001 - only running out of memory moves on to the float32 truth
        if not is_oom(e):
            raise
        why = first_line(e)
    free()
    if truth is None:
        try:
            with no_tf32():
                m = copy.deepcopy(base).float()
                bu.enable_checkpointing(m)
                truth = loss_and_grads(m, ids)
            out["truth"] = f"float32, TF32 off, gradient checkpointing: the float64 truth did not fit ({why})"
        except Exception as e:  # noqa: BLE001 - as above
            if not is_oom(e):
                raise
            out["truth"] = f"none: neither the float64 nor the float32 truth fit ({first_line(e)})"
        m = None
        free()
    m = copy.deepcopy(base)
    bu.enable_checkpointing(m)
    eager = loss_and_grads(m, ids)
    m = None
    free()
    import kernelgraft

    m = kernelgraft.optimize(copy.deepcopy(base), backend="eager" if a.smoke else "inductor", memory="auto")
    mine = loss_and_grads(m, ids)
    rep = m.kernelgraft_report
    out["sites"] = rep.counts(graph="training")
    out["fell_back"] = [f"{r.module}: {r.status()}" for r in rep.fell_back_at_run_time()][:10]
    m = None
    free()
    if truth is None:
        return out
    quantities = [("loss", truth[0], mine[0], eager[0])]
    quantities += [(f"grad {k}", t, mine[1].get(k), eager[1].get(k)) for k, t in truth[1].items()]
    verdicts = [judge(q, t, k, e) for q, t, k, e in quantities]
    out["verdicts"] = [dict(quantity=v.what, kernelgraft=v.kernelgraft, eager=v.eager, bound=v.bound, ok=v.ok) for v in verdicts]  # fmt: skip
    out["ok"] = all(v.ok for v in verdicts)
    worst = max(verdicts, key=lambda v: v.kernelgraft / v.bound)
    out["worst"] = dict(
        quantity=worst.what, kernelgraft=worst.kernelgraft, eager=worst.eager, bound=worst.bound
    )
    return out


# ---- the run: a process per (row, mode), the JSON, the table, the plot ---------------------------------


def child_args(a) -> list[str]:
    """The options a child process takes from this run."""
    args = ["--min", str(a.min), "--max", str(a.max), "--resolution", str(a.resolution), "--mode-seconds", str(a.mode_seconds), "--fresh-seconds", str(a.fresh_seconds)]  # fmt: skip
    args += ["--steps", str(a.steps), "--at", a.at, "--shapes", a.shapes, "--models", a.models]
    return args + (["--smoke", "--smoke-limit-mib", str(a.smoke_limit_mib)] if a.smoke else [])


def budget(mode: str, a) -> float:
    """Seconds of search of a mode: --fresh-seconds for a mode that builds a model per length."""
    return a.fresh_seconds if mode in FRESH else a.mode_seconds


def run_in_process(what: list[str], a, log: str, seconds: float) -> dict:
    """This file in a fresh process (`what`: --one ROW --mode MODE, or --one-grads N) given `seconds` of
    search, its output in `log` -> what it wrote to its JSON (kept if it died), with "error" where it
    failed."""
    import tempfile

    timeout = a.timeout or seconds + 3600
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "one.json")
        cmd = [sys.executable, os.path.abspath(__file__), *what, "--json", path, *child_args(a)]
        env = {**os.environ, **bu.OFFLINE}
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        with open(log, "w") as f:
            try:
                rc = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env
                ).returncode
            except subprocess.TimeoutExpired:
                rc = f"timed out after {timeout:.0f} s (--timeout)"
        got = {}
        if os.path.exists(path):
            with open(path) as f:
                got = json.load(f)
    if rc != 0:
        lines = [x for x in open(log).read().strip().splitlines() if x.strip()]
        last = lines[-1] if lines else "no output"
        said = rc if isinstance(rc, str) else f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"
        got.setdefault("error", f"{said}: {last}"[:300])
        if "probes" in got and "search" not in got:  # died within the search (the host's memory, say)
            fit = [n for n, ok, _ in got["probes"] if ok]
            got.update(search="error", longest=max(fit, default=None))
    return got


def compare(doc: dict) -> None:
    """Each mode's longest over the best peer's (the longest of the row's other modes than kernelgraft's)."""
    for modes in doc["rows"].values():
        peers = {
            m: r["longest"] for m, r in modes.items() if not m.startswith("kernelgraft") and r.get("longest")
        }
        best = max(peers, key=peers.get, default=None)
        for r in modes.values():
            r["best_peer"] = best
            r["vs_best_peer"] = r["longest"] / peers[best] if best and r.get("longest") else None


def gib(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"


def kilo(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def longest_text(r: dict, a: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"[:160]
    n, status = r.get("longest"), r.get("search")
    if n is None:
        why = f"none fit from {a['min']:,}" if status == "nothing fit" else "-"
        return why + (f" (error: {r['error'][:120]})" if "error" in r else "")
    said = {"reached max": " (the max)", "cut short": " (cut short)", "error": f" (then error: {r.get('error', '')[:120]})"}  # fmt: skip
    return f"{n:,}" + said.get(status, "") + (f" (error: {r['error'][:120]})" if "error" in r and status != "error" else "")  # fmt: skip


def markdown(doc: dict) -> str:
    a = doc["args"]
    L = [
        f"Longest context that trains on one GPU ({doc.get('gpu', '?')}, {doc.get('date', '?')}; "
        f"{versions_text(doc.get('versions'))}; commit {doc.get('commit')})",
        "",
        f"Batch 1, a full step (forward, backward, AdamW); lengths {a['min']:,} doubled to {a['max']:,}, then "
        f"bisected to {a['resolution']:,} tokens, {a['mode_seconds']:.0f} s per mode ({a.get('fresh_seconds', 0):.0f} s for "
        f"a model per length: {', '.join(FRESH)}); compiled modes' shapes: "
        f"{a['shapes']}; tokens/s by wall time, median of {a['steps']}; peak: max_memory_allocated.",
        "",
    ]
    at = a["at_list"]
    head = [
        "row",
        "mode",
        "longest context",
        "tok/s at longest",
        "peak GiB at longest",
        "longest / best peer's",
    ]
    L += [
        "| " + " | ".join(head + [f"tok/s at {kilo(n)}" for n in at]) + " |",
        "|" + "---|" * (len(head) + len(at)),
    ]
    for row, modes in doc["rows"].items():
        for mode, r in modes.items():
            meas = r.get("measurements", {})
            top = meas.get(str(r.get("longest")), {})
            tok = (
                f"{top['tokens_per_s_wall']:,.0f}"
                if "tokens_per_s_wall" in top
                else top.get("error", "-")[:80]
            )
            peak = gib(top["peak_gib"]) if "peak_gib" in top else "-"
            vs = f"{r['vs_best_peer']:.2f}x ({r['best_peer']})" if r.get("vs_best_peer") else "-"
            cells = [f"{meas[str(n)]['tokens_per_s_wall']:,.0f}" if "tokens_per_s_wall" in meas.get(str(n), {}) else "-" for n in at]  # fmt: skip
            L.append("| " + " | ".join([row, mode, longest_text(r, a), tok, peak, vs, *cells]) + " |")
    gr = doc.get("gradients")
    if gr:
        L += ["", f"**Gradients** at 1 x {gr.get('tokens', '?'):,} tokens, {gr.get('shape', '?')}, {gr.get('weights', '')}: "
              f"{gr.get('candidate', '')} against {gr.get('reference', '')}; truth: {gr.get('truth', '?')}."]  # fmt: skip
        if "error" in gr:
            L.append(f"error: {gr['error']}")
        if "verdicts" in gr:
            ok = sum(v["ok"] for v in gr["verdicts"])
            w = gr["worst"]
            L.append(f"{ok} of {len(gr['verdicts'])} quantities within the bound (1.1x eager's error + 4 float32 eps); "
                     f"closest to its bound: {w['quantity']}, kernelgraft {w['kernelgraft']:.3g}, eager {w['eager']:.3g}, "
                     f"bound {w['bound']:.3g}.")  # fmt: skip
            loss = gr["verdicts"][0]
            L.append(f"Loss: kernelgraft {loss['kernelgraft']:.3g}, eager {loss['eager']:.3g} ({'ok' if loss['ok'] else 'over'}).")  # fmt: skip
    return "\n".join(L) + "\n"


def plot(path: str) -> str | None:
    """DIR/context.png from a context.json: tokens/s against the context, one line per mode, an x where
    it ran out of memory, one panel per row -> its path (None without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    with open(path) as f:
        doc = json.load(f)
    rows = doc.get("rows", {})
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.5), squeeze=False)
    for ax, (row, modes) in zip(axes[0], rows.items()):
        for i, (mode, r) in enumerate(modes.items()):
            pts = sorted((int(n), m["tokens_per_s_wall"]) for n, m in r.get("measurements", {}).items() if "tokens_per_s_wall" in m)  # fmt: skip
            if not pts:
                continue
            color = f"C{i % 10}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=mode, lw=1.2, ms=4)
            if r.get("shortest_failed"):
                ax.plot([r["shortest_failed"]], [pts[-1][1]], "x", color=color, ms=9, mew=2)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: kilo(int(v))))
        ax.set_xlabel("context length (tokens), x: out of memory")
        ax.set_ylabel("tokens/s (wall)")
        ax.set_title(row)
        ax.legend(fontsize=7)
    fig.suptitle(f"Longest context, batch 1, full training step ({doc.get('gpu', '?')}, {doc.get('date', '?')})", fontsize=10)  # fmt: skip
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def merge(paths: list[str], out: str) -> int:
    """One context.json (and its table and plot) in `out` from runs of some rows and modes each: every
    row's modes, a later file's replacing an earlier one's; the provenance and arguments of the last
    file (the lengths measured beside the longest: every file's), each mode keeping the device it said
    it ran on."""
    doc: dict = {}
    for path in paths:
        with open(path) as f:
            got = json.load(f)
        rows = doc.get("rows", {})
        for row, modes in got.get("rows", {}).items():
            rows.setdefault(row, {}).update(modes)
        at = set(doc.get("args", {}).get("at_list", [])) | set(got.get("args", {}).get("at_list", []))
        doc.update({k: v for k, v in got.items() if k != "rows"}, rows=rows)
        doc["args"] = dict(doc.get("args", {}), at_list=sorted(at))
    os.makedirs(out, exist_ok=True)
    json_path = os.path.join(out, "context.json")
    compare(doc)
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, "context.md"), "w") as f:
        f.write(markdown(doc))
    print(markdown(doc))
    print(plot(json_path) or "no plot: matplotlib is not importable here")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="bench_context.py", description=__doc__.split("\n\n")[0])
    arg = ap.add_argument
    arg("--out", default=os.environ.get("OUT", "benchmarks/out"), help="results folder (default: $OUT, else benchmarks/out)")  # fmt: skip
    arg(
        "--rows",
        default=None,
        help=f"rows, comma-separated, any of: {', '.join(ROWS)} (default: all; '' none)",
    )
    arg("--modes", default=None, help=f"modes, comma-separated, any of: {', '.join(MODES)} (default: all)")
    arg("--min", type=int, help="the first length probed (default 4096; --smoke 16)")
    arg("--max", type=int, help="the longest length probed (default 524288; --smoke 256)")
    arg("--resolution", type=int, help="the bisection's last step, tokens (default 1024; --smoke 16)")
    arg("--mode-seconds", type=float, help="seconds of search per mode (default 300; --smoke 60)")
    arg("--fresh-seconds", type=float, help="seconds of search of kernelgraft (memory=auto), which builds and compiles a model per length (default 1800; --smoke 60)")  # fmt: skip
    arg("--steps", type=int, help="timed steps per measured length (default 3; --smoke 1)")
    arg(
        "--at",
        help="lengths measured beside the longest, where shorter (default 8192,32768,131072; --smoke 32,128)",
    )
    arg("--shapes", choices=("dynamic", "static"), default="dynamic",
        help="compiled modes: one graph for every length (dynamic, the default) or a compile per length")  # fmt: skip
    arg(
        "--models",
        default="/tmp/kernelgraft_models",
        help="folder of the saved random models (default: %(default)s)",
    )
    arg(
        "--timeout",
        type=float,
        help="seconds per (row, mode) process (default: its seconds of search + 3600)",
    )
    arg("--check-grads", type=int, metavar="N", help="also judge kernelgraft's gradients at 1 x N tokens")
    arg(
        "--smoke",
        action="store_true",
        help="no GPU: a tiny Llama on the CPU, the eager backend, a fake memory limit",
    )
    arg("--smoke-limit-mib", type=float, default=1.5, help="--smoke's memory: MiB saved for the backward (default: %(default)s)")  # fmt: skip
    arg("--plot", metavar="JSON", help="only make the PNG of an earlier run's context.json")
    arg(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="merge runs' context.json files (a later one's modes win) into --out",
    )
    arg("--one", metavar="ROW", help=argparse.SUPPRESS)  # one (row, mode) in this process
    arg("--mode", help=argparse.SUPPRESS)
    arg("--one-grads", type=int, help=argparse.SUPPRESS)  # --check-grads in this process
    arg("--json", help=argparse.SUPPRESS)
    return ap


def parse(argv=None) -> argparse.Namespace:
    ap = parser()
    a = ap.parse_args(argv)
    defaults = SMOKE if a.smoke else GPU
    for k, v in defaults.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.rows is None:
        a.rows = SMOKE_ROW if a.smoke else ",".join(ROWS)
    a.row_list = names(a.one) if a.one else names(a.rows)
    known_rows = (SMOKE_ROW,) if a.smoke else tuple(ROWS)
    for row in a.row_list:
        if row not in known_rows:
            ap.error(f"unknown row {row!r}; one of: {', '.join(known_rows)}")
    a.mode_list = names(a.mode if a.one else a.modes)
    known = SMOKE_MODES if a.smoke else MODES
    for m in a.mode_list:
        if m not in known:
            ap.error(f"unknown mode {m!r}; one of: {', '.join(known)}")
    if a.one and not a.mode:
        ap.error("--one needs --mode")
    for k in ("min", "max", "resolution", "steps"):
        if getattr(a, k) < 1:
            ap.error(f"--{k} must be 1 or more, got {getattr(a, k)}")
    if a.max < a.min:
        ap.error(f"--max ({a.max}) is below --min ({a.min}): give a --max at least --min")
    for k in ("mode_seconds", "fresh_seconds"):
        if getattr(a, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be above 0, got {getattr(a, k)}")
    if a.check_grads is not None and a.check_grads < 2:
        ap.error(
            f"--check-grads needs 2 or more tokens (the loss predicts the next one), got {a.check_grads}"
        )
    try:
        a.at_list = sorted({int(x) for x in a.at.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--at must be lengths separated by commas (8192,32768), got {a.at!r}")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.merge:
        return merge(a.merge, a.out)
    if a.plot:
        made = plot(a.plot)
        print(made or "bench_context.py: no plot: matplotlib is not importable, or the file has no rows")
        return 0
    if a.one or a.one_grads:
        if a.one:
            run_one(a.one, a.mode, a)
        else:
            got = check_grads(a.one_grads, a)
            with open(a.json, "w") as f:
                json.dump(got, f, indent=1)
        return 0
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("bench_context.py: needs a CUDA GPU (the lengths are the GPU's); without one, the smoke run: --smoke", file=sys.stderr)  # fmt: skip
        return 2
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    # this process never touches the GPU (a CUDA context would take memory from the children's): they say which it is
    doc = dict(provenance(torch.device("cpu"), DISTS), gpu="cpu (--smoke)" if a.smoke else "?", rows={})
    doc["args"] = {k: getattr(a, k) for k in ("min", "max", "resolution", "mode_seconds", "fresh_seconds", "steps", "at_list", "shapes", "smoke")}  # fmt: skip
    if a.smoke:
        doc["args"]["smoke_limit_mib"] = a.smoke_limit_mib
    json_path = os.path.join(a.out, "context.json")

    def save():
        compare(doc)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(a.out, "context.md"), "w") as f:
            f.write(markdown(doc))

    for row in a.row_list:
        for mode in a.mode_list:
            why = unavailable(row, mode, a.smoke)
            log = os.path.join(a.out, "logs", f"{row}-{mode}".replace(" ", "_").replace("/", "_") + ".log")
            got = (
                dict(skipped=why)
                if why
                else run_in_process(["--one", row, "--mode", mode], a, log, budget(mode, a))
            )
            if "device" in got:
                doc["gpu"], doc["gpu_memory_gib"] = got["device"], got["device_memory_gib"]
            doc["rows"].setdefault(row, {})[mode] = got
            save()
            m = got.get("measurements", {}).get(str(got.get("longest")), {})
            tok = f"{m['tokens_per_s_wall']:,.0f} tok/s" if "tokens_per_s_wall" in m else ""
            print(f"{row} | {mode} | {longest_text(got, doc['args'])} | {tok}", flush=True)
    if a.check_grads:
        log = os.path.join(a.out, "logs", "gradients.log")
        doc["gradients"] = run_in_process(["--one-grads", str(a.check_grads)], a, log, 0.0)
        save()
    try:
        made = plot(json_path)
    except Exception as e:  # noqa: BLE001 - the plot is an extra: the JSON and the table are written
        made = f"no plot ({first_line(e)})"
    print(markdown(doc))
    print(
        made
        or "no plot: matplotlib is not importable here (python benchmarks/bench_context.py --plot DIR/context.json)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
