"""Training steps (forward + backward, no optimizer) with Unsloth among the peers: the 1B and 8B LoRA r16
steps, an 8B QLoRA r16 step (bitsandbytes NF4 with double quantization, bf16 compute, LoRA on every
linear of the decoder layers) and the 1B full fine-tune, random weights, SDPA. Each (row, mode) runs
in a process of its own: Unsloth patches transformers' classes when it is imported, and Liger
reassigns transformers' globals, so neither may share a process with another mode.

Modes: eager, torch.compile, liger, kernelgraft (the inductor backend), unsloth
(FastLanguageModel.from_pretrained of the row's model saved to a folder, then get_peft_model); and
"unsloth (checkpointing)" with Unsloth's own gradient checkpointing (use_gradient_checkpointing=
"unsloth", its default), beside "kernelgraft (checkpointing)": Hugging Face's gradient checkpointing
(non-reentrant) enabled before kernelgraft.optimize. The plain "unsloth" row has checkpointing off, as
every other row; "kernelgraft (layers)" captures the decoder layers per class (capture="layers"),
"kernelgraft" the model whole. Per mode: tokens/s by wall time (the median of --steps timed steps
after two warm-up steps), the device's time of one step (torch.profiler, the CUDA kernels summed),
the peak GiB above what the step started from, and the first step's seconds twice: cold, with every
compile cache (inductor's, Triton's, kernelgraft's, Unsloth's compiled modules) fresh for the mode,
and warm, in a second process with the caches the first one left.

On the GPU host (no network; .peers filled by `python benchmarks/peers.py download` here, and each of
its parts carried by a call of its own, installed into one folder kept between the calls):

    python benchmarks/peers.py install --wheels .peers --target .peers_site     (once per part)
    PYTHONPATH=$PWD/.peers_site python benchmarks/bench_unsloth.py --out benchmarks/out/unsloth \\
        --rows "llama-1b LoRA 8x2048,llama-8b QLoRA 2x4096" --steps 10
        -> DIR/unsloth.json, DIR/unsloth.md   (rewritten after every mode: a run cut short keeps its rows)

The rows' random models are saved once to --models (default /tmp/kernelgraft_models; the 8B takes
16 GB of disk) and loaded from there by the modes that load a folder (Unsloth, and every mode of the
QLoRA row)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from benchlib import cache_env, names, provenance, versions_text  # noqa: E402
from suite_args import SHAPES  # noqa: E402

# what the results file says of the run: the versions of what is measured
DISTS = ("torch", "transformers", "peft", "unsloth", "unsloth_zoo", "bitsandbytes", "liger-kernel", "kernelgraft")

LORA_R, LORA_ALPHA = 16, 32  # the suite's LoRA: r 16, alpha 32 on every linear of the decoder layers
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEER_MODES = (
    "eager",
    "torch.compile",
    "liger",
    "kernelgraft",
    "kernelgraft (layers)",
    "kernelgraft (checkpointing)",
    "unsloth",
    "unsloth (checkpointing)",
)
# row -> the suite's shape it runs, how its model is trained (lora, qlora or full), and its modes
ROWS = {
    "llama-1b LoRA 8x2048": dict(shape="llama-1b LoRA 8x2048", train="lora", modes=PEER_MODES),
    "llama-8b LoRA 2x4096": dict(shape="llama-8b LoRA 2x4096", train="lora", modes=PEER_MODES),
    "llama-8b QLoRA 2x4096": dict(shape="llama-8b 2x4096", train="qlora", modes=PEER_MODES),
    "llama-1b full 8x2048": dict(
        shape="llama-1b 8x2048", train="full", modes=("unsloth", "unsloth (checkpointing)")
    ),
}
# the row each suite shape is measured as, for bench_train_step.py's unsloth modes
ROW_OF_SHAPE = {"llama-1b 8x2048": "llama-1b full 8x2048", "llama-1b LoRA 8x2048": "llama-1b LoRA 8x2048"}
OFFLINE = dict(
    HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1"
)


class Unavailable(Exception):
    """A mode that cannot run here; its message is one line that says why and what to do."""


def checkpointing(mode: str) -> bool:
    return "(checkpointing)" in mode


def check_mode(row: str, mode: str) -> None:
    if row not in ROWS:
        raise ValueError(f"unknown row {row!r}; one of {', '.join(ROWS)}")
    if mode not in ROWS[row]["modes"]:
        raise ValueError(f"row {row!r} has no mode {mode!r}; its modes: {', '.join(ROWS[row]['modes'])}")


def need_unsloth() -> None:
    """Unavailable unless unsloth can be imported and a CUDA GPU is visible (checked without
    importing unsloth, which fails on import without a GPU)."""
    if importlib.util.find_spec("unsloth") is None:
        raise Unavailable(
            "unsloth is not importable: install the peers' wheels (python benchmarks/peers.py install "
            "--wheels .peers --target .peers_site) and run with PYTHONPATH=$PWD/.peers_site"
        )
    import torch

    if not torch.cuda.is_available():
        raise Unavailable(
            "the unsloth mode needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)"
        )


def config(spec: dict):
    """The transformers config of a suite shape spec, as suite.build makes it."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(spec["arch"], max_position_embeddings=2 * spec["S"], **spec["cfg"])
    cfg._attn_implementation = "sdpa"
    return cfg


def saved_model(spec: dict, folder: str, device: str = "cuda") -> str:
    """A random bf16 model of `spec` (seed 0, the init suite.build draws) saved with save_pretrained to
    folder; kept and reused when folder already holds one."""
    import torch
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config(spec)).to(torch.bfloat16)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    vocab = model.config.vocab_size
    del model
    save_tokenizer(folder, vocab)
    return folder


def save_tokenizer(folder: str, vocab: int) -> None:
    """A word-level tokenizer of `vocab` made-up tokens saved beside the model: Unsloth's loader reads
    the folder's tokenizer (the benchmarks feed token ids and never tokenize text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab - 2)} | {"<unk>": vocab - 2, "<eos>": vocab - 1}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    fast.save_pretrained(folder)


def qlora_model(folder: str, device_map="cuda", r: int = LORA_R, alpha: int = LORA_ALPHA):
    """The model saved in folder loaded with 4-bit base layers (bitsandbytes NF4, double quantization,
    bf16 compute; the LM head and embeddings stay bf16), and peft's LoRA on every linear of the
    decoder layers. Norms are left bf16 (peft's prepare_model_for_kbit_training would make them
    float32): the other modes and Unsloth train them in bf16."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        quantization_config=quant,
        device_map=device_map,
        dtype=torch.bfloat16,
        attn_implementation="sdpa",
    )
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(LINEARS), lora_dropout=0.0, bias="none")
    return get_peft_model(model, lora)


def enable_checkpointing(model) -> None:
    """Hugging Face's gradient checkpointing, non-reentrant (a peft model's frozen embeddings give the
    checkpointed layers inputs without gradients, which the reentrant variant would drop)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build(row: str, mode: str, models: str):
    """The row's model as a non-Unsloth mode runs it: suite.build's (LoRA and full rows) or
    qlora_model's (QLoRA), checkpointing enabled for "... (checkpointing)", then suite.apply_mode."""
    import suite

    r = ROWS[row]
    if r["train"] == "qlora":
        model = qlora_model(saved_model(SHAPES[r["shape"]], os.path.join(models, slug(r["shape"]))))
    else:
        model = suite.build(r["shape"], "eager")
    # from_pretrained (the QLoRA row's) leaves the model in eval mode, where Hugging Face's gradient
    # checkpointing is off: every mode trains in training mode, as Unsloth's does
    model.train()
    if checkpointing(mode):
        enable_checkpointing(model)
    if mode.startswith("kernelgraft"):  # the inductor backend, captured whole or per layer class
        mode = "kernelgraft (inductor, layers)" if "(layers" in mode else "kernelgraft (inductor, whole)"
    return suite.apply_mode(model, mode)


def build_unsloth(row: str, mode: str, models: str):
    """The row's model as Unsloth runs it: FastLanguageModel.from_pretrained of the saved folder (4-bit
    for the QLoRA row, full_finetuning for the full row), then get_peft_model with the other modes'
    LoRA; gradient checkpointing "unsloth" (its default) for "unsloth (checkpointing)", else off."""
    need_unsloth()
    import torch
    import unsloth  # noqa: F401 - before transformers: it patches transformers' classes
    from unsloth import FastLanguageModel

    r = ROWS[row]
    spec = SHAPES[r["shape"]]
    folder = saved_model(spec, os.path.join(models, slug(r["shape"])))
    gc = "unsloth" if checkpointing(mode) else False
    extra = dict(full_finetuning=True, use_gradient_checkpointing=gc) if r["train"] == "full" else {}
    model, _ = FastLanguageModel.from_pretrained(
        model_name=folder,
        max_seq_length=spec["S"],
        dtype=torch.bfloat16,
        load_in_4bit=r["train"] == "qlora",
        **extra,
    )
    if r["train"] != "full":
        model = FastLanguageModel.get_peft_model(
            model,
            r=LORA_R,
            lora_alpha=LORA_ALPHA,
            target_modules=list(LINEARS),
            lora_dropout=0,
            bias="none",
            use_gradient_checkpointing=gc,
        )
    model.train()
    return model


def slug(shape: str) -> str:
    """The folder name of a shape's saved model: a LoRA shape shares its base shape's."""
    return shape.replace(" LoRA", "").replace(" ", "_").replace("/", "_")


def measure(model, spec: dict, steps: int, device_steps: int = 3, first_only: bool = False) -> dict:
    """tokens/s by wall time (median of `steps` timed steps after a first and a warm-up step), the
    peak above each step's start (the largest), the first step's seconds and loss, and the device
    time of one step (suite.device_time over `device_steps` steps)."""
    import torch
    from suite import device_time

    ids = torch.randint(0, spec["cfg"]["vocab_size"], (spec["B"], spec["S"]), device="cuda")

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    torch.cuda.synchronize()
    t = time.perf_counter()
    loss = step()
    first = time.perf_counter() - t
    if first_only:
        return dict(first_step_s=first, loss=loss, **startup(model))
    step()
    torch.cuda.synchronize()
    times, peak = [], 0
    for _ in range(steps):
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
    med = sorted(times)[len(times) // 2]
    out = dict(
        tok_s=spec["B"] * spec["S"] / med,
        times_ms=[round(x * 1e3, 2) for x in times],
        peak_above_start_gib=peak / 2**30,
        first_step_s=first,
        loss=loss,
    )
    dev = device_time(step, device_steps)
    out.update({k: v for k, v in dev.items() if k != "kernels"})
    if hasattr(model, "kernelgraft_report"):
        out["sites"] = model.kernelgraft_report.counts()
    return {**out, **startup(model)}


def startup(model) -> dict:
    """What kernelgraft's report says of the first calls' time, and how the model was captured."""
    rep = getattr(model, "kernelgraft_report", None)
    if rep is None:
        return {}
    return dict(startup=[str(x) for x in rep.startup.values()], captured=rep.captured_as.get("kind", "?"))


def run_one(row: str, mode: str, steps: int, models: str, first_only: bool = False) -> dict:
    """One (row, mode) in this process."""
    check_mode(row, mode)
    if mode.startswith("unsloth"):
        model = build_unsloth(row, mode, models)
    else:
        import torch

        if not torch.cuda.is_available():
            raise Unavailable(f"the {mode} mode needs a CUDA GPU, and torch sees none")
        model = build(row, mode, models)
    out = measure(model, SHAPES[ROWS[row]["shape"]], steps, first_only=first_only)
    if mode.startswith("unsloth"):
        out["process"] = "own process (Unsloth patches transformers' classes at import)"
    return out


def cold_and_warm(row: str, mode: str, steps: int, models: str) -> dict:
    """The mode measured in a process whose compile caches are fresh (cold), then its first step
    again in a second process that finds the caches the first left (warm)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kg_caches_") as folder:
        got = run_in_process(row, mode, steps, models, caches=folder)
        if "error" not in got:
            warm = run_in_process(row, mode, steps, models, caches=folder, first_only=True)
            got["warm_first_step_s"] = warm.get("first_step_s")
            got["warm_loss"] = warm.get("loss")
            got["warm_startup"] = warm.get("startup", warm.get("error"))
    return got


def run_in_process(
    row: str, mode: str, steps: int, models: str, timeout: float = 1800, caches: str | None = None,
    first_only: bool = False,
) -> dict:
    """run_one in a fresh Python process (this file with --one) -> its result, or dict(error=...) with
    the last line it wrote to stderr. caches: the folder of its compile caches (cache_env; the
    process runs there, where Unsloth writes its compiled modules)."""
    import tempfile

    check_mode(row, mode)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "one.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", row, "--mode", mode, "--steps", str(steps)]
        cmd += ["--models", os.path.abspath(models), "--json", path] + (["--first-only"] if first_only else [])
        env = {**os.environ, **OFFLINE, **(cache_env(caches) if caches else {})}
        try:
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=caches)
        except subprocess.TimeoutExpired:
            return dict(error=f"timed out after {timeout:.0f} s")
        if got.returncode == 0 and os.path.exists(path):
            return json.load(open(path))
        lines = [x for x in (got.stderr or got.stdout).strip().splitlines() if x.strip()]
        return dict(error=(lines[-1] if lines else f"exit {got.returncode}, no output")[:300])


def markdown(doc: dict) -> str:
    L = [
        f"Training steps with Unsloth ({doc.get('gpu', '?')}, {doc.get('date', '?')}; {versions_text(doc.get('versions'))})",
        "",
    ]
    L.append("Each mode ran in a process of its own (Unsloth patches transformers' classes at import).")
    for row, modes in doc.get("rows", {}).items():
        L += [
            "",
            f"### {row}",
            "",
            "| mode | tokens/s | device ms | peak above start GiB | first step s (cold) | first step s (warm) | loss |",
        ]
        L.append("|---|---|---|---|---|---|---|")
        for m, r in modes.items():
            if "error" in r:
                L.append(f"| {m} | error: {r['error'][:120]} | | | | | |")
                continue
            dev = f"{r['device_ms']:.0f}" if "device_ms" in r else "-"
            warm = r.get("warm_first_step_s")
            L.append(
                f"| {m} | {r['tok_s']:,.0f} | {dev} | {r['peak_above_start_gib']:.1f} | {r['first_step_s']:.1f} "
                f"| {'-' if warm is None else f'{warm:.1f}'} | {r['loss']:.4f} |"
            )
    return "\n".join(L) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_unsloth.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"), help="results folder")
    ap.add_argument("--rows", default=",".join(ROWS), help="rows, comma-separated, any of: %(default)s")
    ap.add_argument(
        "--modes",
        default="",
        help=f"modes, comma-separated, any of: {', '.join(PEER_MODES)} (default: each row's own)",
    )
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode (default: %(default)s)")
    ap.add_argument(
        "--models",
        default="/tmp/kernelgraft_models",
        help="folder of the rows' saved models (default: %(default)s)",
    )
    ap.add_argument(
        "--cold-warm",
        action="store_true",
        help="each mode with fresh compile caches, then its first step again in a second process (warm)",
    )
    ap.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)  # --one: the first step alone
    ap.add_argument("--one", metavar="ROW", help=argparse.SUPPRESS)  # one (row, mode) in this process
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    return ap


def parse(argv=None) -> argparse.Namespace:
    ap = parser()
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps must be 1 or more, got {a.steps}")
    rows = names(a.one) if a.one else names(a.rows)
    for row in rows:
        if row not in ROWS:
            ap.error(f"unknown row {row!r}; one of: {', '.join(ROWS)}")
    for m in names(a.mode if a.one else a.modes):
        if m not in PEER_MODES:
            ap.error(f"unknown mode {m!r}; one of: {', '.join(PEER_MODES)}")
    if a.one and not a.mode:
        ap.error("--one needs --mode")
    a.row_list = rows
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.one:
        try:
            got = run_one(a.one, a.mode, a.steps, a.models, first_only=a.first_only)
        except Unavailable as e:
            print(f"bench_unsloth.py: {a.mode}: {e}", file=sys.stderr)
            return 2
        json.dump(got, open(a.json, "w"), indent=1) if a.json else print(json.dumps(got))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_unsloth.py: needs a CUDA GPU (the numbers are GPU timings)", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    doc = dict(provenance(torch.device("cuda"), DISTS), rows={})
    for row in a.row_list:
        for mode in [m for m in (names(a.modes) or ROWS[row]["modes"]) if m in ROWS[row]["modes"]]:
            got = (cold_and_warm if a.cold_warm else run_in_process)(row, mode, a.steps, a.models)
            doc["rows"].setdefault(row, {})[mode] = got
            print(row, "|", mode, "|", got, flush=True)
            json.dump(doc, open(os.path.join(a.out, "unsloth.json"), "w"), indent=1)
            open(os.path.join(a.out, "unsloth.md"), "w").write(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
