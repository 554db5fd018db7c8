"""kernelgraft: graft generated Triton kernels into Hugging Face models, and check they are as accurate.

`kernelgraft demo | explain | audit | patterns | bench`. Exit codes: 0 success, 1 the check failed
(loss curves disagree, an audit found a less accurate site or gradient), 2 bad usage.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import kernelgraft
from kernelgraft.options import BACKENDS
from kernelgraft.patterns import REGISTRY

# transformers is imported where a model is built: `kernelgraft --help` does not wait for it

EXAMPLES = """examples:
  kernelgraft demo                      train a tiny Llama 20 steps, stock vs kernelgraft
  kernelgraft demo --steps 5 --device cpu
  kernelgraft explain --arch qwen3      what would be replaced in a tiny random Qwen3
  kernelgraft explain --model ./my-checkpoint
                                        ... in a local Hugging Face checkpoint
  kernelgraft audit --arch llama --out audit.html
                                        audit a tiny random Llama: per site and parameter, is the
                                        optimized model as accurate as the stock one? (HTML + stdout)
  kernelgraft audit --model ./my-checkpoint --dtype bfloat16 --out audit.html --md audit.md
  kernelgraft patterns                  the registered patterns and their spellings
  kernelgraft bench --out results --parts patterns,steps
                                        the GPU benchmark suite of a source checkout
"""

DEFAULT_ARCH = "llama"  # explain and audit without --arch or --model

# (hidden, intermediate, layers, heads, kv heads, vocab, batch, seq): big enough on a GPU that
# tokens/s mean something, small enough on a CPU to finish in seconds under the interpreter
_DEMO_SIZES = {"cuda": (1024, 2816, 8, 16, 4, 32000, 8, 1024), "cpu": (128, 256, 2, 4, 2, 512, 4, 64)}


def _tiny_llama_config(device: str):
    from transformers import LlamaConfig

    H, inter, L, heads, kv, vocab, B, S = _DEMO_SIZES["cuda" if device == "cuda" else "cpu"]
    cfg = LlamaConfig(
        hidden_size=H,
        intermediate_size=inter,
        num_hidden_layers=L,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=2 * S,
    )
    return cfg, B, S


def demo(steps: int = 20, device: str = "auto", backend: str | None = None, out=sys.stdout) -> int:
    """Train a small random Llama beside an identical stock copy; print both loss curves."""
    from transformers import LlamaForCausalLM

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = backend or ("inductor" if device == "cuda" else "eager")
    cfg, B, S = _tiny_llama_config(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    stock = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g).to(device)
    batch = dict(input_ids=ids, labels=ids)
    print(
        f"kernelgraft demo: Llama {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, batch {B}x{S}, "
        f"{dtype}, {device}, backend={backend}",
        file=out,
    )
    report = kernelgraft.explain(stock, **batch)
    print(report, file=out)

    def train(model, desc):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, times = [], []
        # progress on stderr (a terminal only): stdout keeps the table a script reads
        for _ in tqdm(range(steps), desc=desc, disable=None, leave=False):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            times.append(time.perf_counter() - t)
        return losses, times

    base, t_base = train(stock, "stock model")
    mine, t_mine = train(grafted, "kernelgraft (first step compiles)")
    print(f"\n{'step':>4}  {'stock loss':>12}  {'kernelgraft loss':>16}  {'rel diff':>9}", file=out)
    worst = 0.0
    for i, (a, b) in enumerate(zip(base, mine)):
        d = abs(a - b) / abs(a)
        worst = max(worst, d)
        print(f"{i:>4}  {a:>12.6f}  {b:>16.6f}  {d:>9.2e}", file=out)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    agree = worst <= tol
    print(
        f"\nloss curves {'agree' if agree else 'DISAGREE'}: worst relative difference {worst:.2e} "
        f"(demo threshold {tol:g} for {dtype})",
        file=out,
    )
    if device == "cuda" and steps > 3:
        n_tok = B * S
        tb, tm = sorted(t_base[2:])[len(t_base[2:]) // 2], sorted(t_mine[2:])[len(t_mine[2:]) // 2]
        print(
            f"tokens/s (median step after warm-up, incl. optimizer): stock eager {n_tok / tb:,.0f}, "
            f"kernelgraft {n_tok / tm:,.0f} ({tb / tm:.2f}x)",
            file=out,
        )
        print(
            f"first step: stock {t_base[0]:.1f}s, kernelgraft {t_mine[0]:.1f}s (compile included)", file=out
        )
    return 0 if agree else 1


def _tiny_arch(arch: str, layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        arch,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        head_dim=16,
    )
    return AutoModelForCausalLM.from_config(cfg)


class UsageError(Exception):
    """Bad usage found after parsing (an unknown --arch, a directory that is no checkpoint): main()
    prints it as one line, `kernelgraft <command>: error: ...`, and exits 2."""


def _model_types() -> list[str]:
    """transformers' model types (the `model_type` of a config.json), registered ones included."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    return list(dict.fromkeys([*CONFIG_MAPPING_NAMES, *CONFIG_MAPPING.keys()]))


def check_arch(arch: str) -> None:
    """UsageError for a model type transformers does not know, naming the close ones."""
    known = _model_types()
    if arch in known:
        return
    close = difflib.get_close_matches(arch.lower(), known, n=5, cutoff=0.6)
    hint = f"close matches: {', '.join(close)}" if close else "no close match among transformers' model types"
    raise UsageError(f"--arch {arch!r} is not a transformers model type ({hint})")


def load_model(arch: str | None = None, model_dir: str | None = None, layers: int = 2, dtype="auto"):
    """A tiny random model of `arch`, or the local checkpoint in `model_dir` (never downloaded); a
    UsageError (its first line) where transformers cannot build a causal LM from it."""
    from transformers import AutoModelForCausalLM

    try:
        if model_dir is not None:
            return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
        check_arch(arch)
        model = _tiny_arch(arch, layers)
        return model if dtype == "auto" else model.to(dtype)
    except (ValueError, OSError) as e:
        what = f"--model {model_dir}" if model_dir is not None else f"--arch {arch}"
        raise UsageError(f"{what}: {str(e).strip().splitlines()[0]}") from e


def _batch(model, batch: int, seq: int, device="cpu"):
    vocab = model.get_input_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (batch, seq), device=device)


def explain_model(
    arch: str | None = DEFAULT_ARCH, model_dir: str | None = None, layers: int = 2, out=None
) -> int:
    """`kernelgraft explain`: what would be replaced in a tiny random --arch model or a --model checkpoint."""
    out = out or sys.stdout
    torch.manual_seed(0)
    model = load_model(arch, model_dir, layers)
    ids = _batch(model, 2, 16)
    print(kernelgraft.explain(model, input_ids=ids, labels=ids), file=out)
    return 0


def audit_cmd(a, out=None) -> int:
    """`kernelgraft audit`: a tiny random model of --arch, or a local checkpoint (--model PATH)."""
    out = out or sys.stdout
    torch.manual_seed(a.seed)
    model = load_model(a.arch, a.model, a.layers, getattr(torch, a.dtype)).to(a.device)
    ids = _batch(model, a.batch, a.seq, a.device)
    labels = ids.clone()
    labels[:, : a.seq // 4] = -100  # a prompt that is not trained on, as in fine-tuning
    rep = kernelgraft.audit(
        model,
        input_ids=ids,
        labels=labels,
        backend=a.backend,
        compile_reference=not a.no_compile_reference,
        progress=True,
    )
    print(rep.to_markdown(), file=out)
    if a.out:
        rep.to_html(a.out)
        print(f"HTML report: {a.out}", file=out)
    if a.md:
        with open(a.md, "w", encoding="utf-8") as f:
            f.write(rep.to_markdown())
    return 0 if rep.ok else 1


def patterns(out=sys.stdout) -> int:
    for name in REGISTRY.names():
        print(f"{name}:", file=out)
        for sp in REGISTRY.spellings([name]):
            args = ", ".join(f"{a}: Scalar" if a in sp.scalar_names else a for a in sp.arg_names)
            print(f"  {sp.name}({args})", file=out)
            for line in sp.source.splitlines()[2:]:
                print(f"      {line.strip()}", file=out)
    return 0


def bench(args: list[str], parser) -> int:
    """Forward to the GPU benchmark suite of a source checkout (benchmarks/suite.py beside the package)."""
    suite = Path(__file__).resolve().parent.parent / "benchmarks" / "suite.py"
    if not suite.is_file():
        parser.error(
            f"kernelgraft bench runs the GPU benchmark suite of a source checkout, and {suite} does not "
            "exist: clone the repository and run it there (the benchmarks are not part of the installed package)"
        )
    spec = importlib.util.spec_from_file_location("kernelgraft_bench_suite", suite)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(args)


def _add_source(sp: argparse.ArgumentParser) -> None:
    """--arch (a tiny random model) or --model (a local checkpoint), not both."""
    src = sp.add_mutually_exclusive_group()
    src.add_argument(  # default None, not "llama": argparse tells a given --arch from its default by identity
        "--arch",
        help=f"a transformers model type (e.g. llama, qwen3, gemma2, mistral) for a tiny random model "
        f"(default: {DEFAULT_ARCH})",
    )
    src.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face checkpoint directory (config.json and weights; nothing is downloaded)",
    )
    sp.add_argument(
        "--layers",
        type=int,
        default=2,
        help="layers of the tiny random model of --arch (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kernelgraft",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a tiny Llama stock vs kernelgraft and compare the loss curves")
    d.add_argument(
        "--steps", type=int, default=20, help="training steps of each model (default: %(default)s)"
    )
    d.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where to train; auto: cuda if a GPU is visible, else cpu (default: %(default)s)",
    )
    d.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="torch.compile backend of the kernelgraft model; default: inductor on cuda, eager on cpu "
        "(inductor's CPU compile is slow)",
    )
    e = sub.add_parser(
        "explain",
        help="report what would be replaced in a tiny random model or a local checkpoint",
        epilog="examples:\n  kernelgraft explain --arch qwen3\n  kernelgraft explain --model ./checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_source(e)
    au = sub.add_parser(
        "audit",
        help="per site and parameter, is the optimized model as accurate as the stock one? (exit 1 if not)",
        epilog="examples:\n  kernelgraft audit --arch llama --out audit.html\n"
        "  kernelgraft audit --model ./checkpoint --dtype bfloat16 --out audit.html --md audit.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_source(au)
    au.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype the model is audited in (default: %(default)s)",
    )
    au.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    au.add_argument(
        "--backend",
        choices=BACKENDS,
        default="eager",
        help="torch.compile backend of the optimized model (default: %(default)s)",
    )
    au.add_argument(
        "--batch", type=int, default=2, help="sequences in the random batch (default: %(default)s)"
    )
    au.add_argument(
        "--seq",
        type=int,
        default=16,
        help="tokens per sequence; the first quarter is a prompt without labels (default: %(default)s)",
    )
    au.add_argument(
        "--seed", type=int, default=0, help="seed of the random model and batch (default: %(default)s)"
    )
    au.add_argument("--out", metavar="HTML", help="write the HTML report here")
    au.add_argument("--md", metavar="MD", help="write the Markdown report here")
    au.add_argument(
        "--no-compile-reference",
        action="store_true",
        help="compare with eager only: skip the torch.compile reference of each site (faster)",
    )
    sub.add_parser("patterns", help="list the registered patterns and their spellings")
    sub.add_parser(
        "bench",
        help="run the GPU benchmark suite of a source checkout (its options: kernelgraft bench --help)",
        add_help=False,
    )
    return p


def _subparser(p: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (action,) = (a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _usage_error(sp: argparse.ArgumentParser, message: str):
    """One line on stderr, as argparse words its errors, and exit 2 (no usage block, no traceback)."""
    print(f"{sp.prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every later argument belongs to the suite, --help included
        return bench(argv[1:], _subparser(p, "bench"))
    a = p.parse_args(argv)
    sp = _subparser(p, a.cmd)
    if a.cmd == "demo":
        if a.steps < 1:
            sp.error("--steps must be at least 1")
        if a.device == "cuda" and not torch.cuda.is_available():
            sp.error("--device cuda: no CUDA GPU is visible; use --device cpu")
        return demo(a.steps, a.device, a.backend)
    if a.cmd == "patterns":
        return patterns()
    # explain, audit: a model from --arch or --model
    if a.model is not None and not os.path.isdir(a.model):
        sp.error(f"--model {a.model}: not a directory; give a local Hugging Face checkpoint directory")
    if a.model is None and a.arch is None:
        a.arch = DEFAULT_ARCH
    if a.layers < 1:
        sp.error("--layers must be at least 1")
    try:
        if a.cmd == "explain":
            return explain_model(a.arch, a.model, a.layers)
        if a.batch < 1 or a.seq < 2:
            sp.error("--batch must be at least 1, --seq at least 2")
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            sp.error("--device cuda: no CUDA GPU is visible; use --device cpu")
        return audit_cmd(a)
    except UsageError as err:
        _usage_error(sp, str(err))


if __name__ == "__main__":
    sys.exit(main())
