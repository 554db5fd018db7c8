"""kernelgraft: graft generated Triton kernels into Hugging Face models, and check they are as accurate.

`kernelgraft demo | explain | audit | patterns | bench`. Exit codes: 0 success, 1 the check failed
(loss curves disagree, an audit found a less accurate site or gradient), 2 an error, said in one line
on stderr (bad usage, a model that does not build or run), 3 a report could not be written (said in
one line; the audit's verdict is printed first).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib.util
import os
import re
import sys
import textwrap
import time
from pathlib import Path

# light: the package's names and submodules load on first use, so --help does not wait for torch
import kernelgraft
from kernelgraft.options import BACKENDS

# torch and transformers are imported where a model is built: `kernelgraft --help` does not wait for them

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
  kernelgraft patterns                  the registered patterns, their spellings and their source
  kernelgraft bench --out results --parts patterns,steps
                                        the GPU benchmark suite of a source checkout
"""

DEFAULT_ARCH = "llama"  # explain and audit without --arch or --model

# (hidden, intermediate, layers, heads, kv heads, vocab, batch, seq): big enough on a GPU that
# tokens/s mean something, small enough on a CPU to finish in seconds under the interpreter
_DEMO_SIZES = {"cuda": (1024, 2816, 8, 16, 4, 32000, 8, 1024), "cpu": (128, 256, 2, 4, 2, 512, 4, 64)}


class WriteError(Exception):
    """A report that could not be written after the work: main() prints it in one line and exits 3."""


def _writable(flag: str, path: str | None) -> None:
    """Refuse, before any work, an output path whose folder does not exist or that is a folder."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a folder; give a file path")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist; create it or give another path")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: the folder {folder} is not writable")


def _write(flag: str, path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise WriteError(f"{flag} {path}: could not write the report ({e.strerror or e})") from None


class UsageError(Exception):
    """An error found after parsing (an unknown --arch, a directory that is no checkpoint, a model
    that does not run): main() prints it as one line, `kernelgraft <command>: error: ...`, and exits 2."""


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


def demo(steps: int = 20, device: str = "auto", backend: str | None = None, out=None) -> int:
    """Train a small random Llama beside an identical stock copy; print both loss curves."""
    import torch
    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM

    out = out or sys.stdout
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


# --- the model explain and audit work on: a tiny random one of --arch, or a --model checkpoint ---


def check_arch(arch: str) -> None:
    """UsageError for a model type transformers does not know (naming the close ones) or has no
    causal LM of."""
    known = kernelgraft.tiny.model_types()
    if arch not in known:
        close = difflib.get_close_matches(arch.lower(), known, n=5, cutoff=0.6)
        hint = (
            f"close matches: {', '.join(close)}"
            if close
            else "no close match among transformers' model types"
        )
        raise UsageError(f"--arch {arch!r} is not a transformers model type ({hint})")
    if arch not in kernelgraft.tiny.causal_lm_types():
        raise UsageError(
            f"--arch {arch}: transformers has no causal LM of this model type; give a decoder's "
            "(e.g. llama, qwen3, gemma2, mistral)"
        )


def model_ways(arch: str | None, model_dir: str | None, layers: int = 2, dtype=None, seed: int = 0):
    """[(what it is built from, build() -> model)]: the checkpoint in `model_dir` (never downloaded),
    or a tiny random model of `arch` from the tiny config, then from the repaired one (the
    architecture's default config made tiny), as the README's coverage table builds it."""
    if model_dir is not None:
        from transformers import AutoModelForCausalLM

        load = dict(local_files_only=True, dtype=dtype if dtype is not None else "auto")
        return [("the checkpoint", lambda: AutoModelForCausalLM.from_pretrained(model_dir, **load))]
    check_arch(arch)
    import torch

    return kernelgraft.tiny.tiny_ways(arch, dtype if dtype is not None else torch.float32, layers, seed)


def _failure(where: str, how: str, e: BaseException, tiny: bool, named: bool = False) -> str:
    """Why a way did not run, and whose failure it is, in words; `named`: the way named in it."""
    tg = kernelgraft.tiny
    what = tg.first_line(e, 200)
    batch, way = ("a tiny batch" if tiny else "a random batch"), (f"with {how}, " if named else "")
    if isinstance(e, tg.NotTiny):
        return f"the model of {how} is not tiny ({e})"
    if where == tg.BUILD:
        return (
            f"transformers cannot {f'build a model of {how}' if tiny else 'load it as a causal LM'} ({what})"
        )
    if where == tg.STOCK:
        return f"{way}the stock model fails on {batch} without kernelgraft ({what})"
    return f"{way}kernelgraft fails on {batch} that the stock model runs ({what}); please report it"


def run_first(what: str, ways, inputs, run, tiny: bool, note=None):
    """run(model, **inputs(model)) on the model of the first of `ways` that builds, runs on its
    inputs without kernelgraft, and runs under `run`: the coverage table's choice of config. A
    UsageError `what: why` where none does, saying whose failure it is (transformers', the stock
    model's or kernelgraft's). `tiny`: the ways build tiny random models, quietly (else a checkpoint).
    note(line) is told why the ways before the one taken were not."""
    try:
        result, failed = kernelgraft.tiny.first_that_runs(ways, inputs, run, quietly=tiny)
    except kernelgraft.tiny.NoneRan as e:
        raise UsageError(f"{what}: {_failure(*e.telling, tiny)}") from e
    if failed and note is not None:
        taken = ways[len(failed)][0]
        note(f"{what}: built from {taken}: {_failure(*failed[-1], tiny, named=True)}")
    return result


def _source(arch: str | None, model_dir: str | None) -> str:
    return f"--model {model_dir}" if model_dir is not None else f"--arch {arch}"


def _vocab(model_dir: str | None) -> int | None:
    """The token ids' bound: a tiny model's vocabulary, as the coverage table's batches; a
    checkpoint's own (None)."""
    return None if model_dir is not None else kernelgraft.tiny.VOCAB


def explain_model(
    arch: str | None = DEFAULT_ARCH, model_dir: str | None = None, layers: int = 2, out=None, note=None
) -> int:
    """`kernelgraft explain`: what would be replaced in a tiny random --arch model or a --model checkpoint."""
    out = out or sys.stdout
    ways = model_ways(arch, model_dir, layers)
    report = run_first(
        _source(arch, model_dir),
        ways,
        kernelgraft.tiny.random_inputs(2, 16, vocab=_vocab(model_dir)),
        kernelgraft.explain,
        model_dir is None,
        note,
    )
    print(report, file=out)
    return 0


def audit_cmd(a, out=None, note=None) -> int:
    """`kernelgraft audit`: a tiny random model of --arch, or a local checkpoint (--model PATH)."""
    import torch

    out = out or sys.stdout
    ways = [
        (how, lambda build=build: build().to(a.device))
        for how, build in model_ways(a.arch, a.model, a.layers, getattr(torch, a.dtype), a.seed)
    ]

    def audit(model, **kw):
        return kernelgraft.audit(
            model, **kw, backend=a.backend, compile_reference=not a.no_compile_reference, progress=None,
            batches=[b(model) for b in more],
        )

    inputs, *more = (  # the first batch, and the others of other seeds
        kernelgraft.tiny.random_inputs(a.batch, a.seq, a.device, a.seed + 7919 * i, True, _vocab(a.model))
        for i in range(a.batches)
    )
    rep = run_first(_source(a.arch, a.model), ways, inputs, audit, a.model is None, note)
    print(rep.to_markdown(), file=out)
    if a.out:
        _write("--out", a.out, rep.to_html())
        print(f"HTML report: {a.out}", file=out)
    if a.md:
        _write("--md", a.md, rep.to_markdown())
    return 0 if rep.ok else 1


def patterns(out=None) -> int:
    """Each registered pattern, its spellings' signatures, and each spelling's source as written."""
    out = out or sys.stdout
    registry = kernelgraft.patterns.REGISTRY
    for name in registry.names():
        print(f"{name}:", file=out)
        for sp in registry.spellings([name]):
            args = ", ".join(f"{a}: Scalar" if a in sp.scalar_names else a for a in sp.arg_names)
            print(f"  {sp.name}({args})", file=out)
            try:
                source = textwrap.dedent(sp.source)
            except (OSError, TypeError):  # a spelling defined where Python keeps no source (a REPL)
                source = "(source not available)\n"
            print(textwrap.indent(source, " " * 6), end="", file=out)
    print("graph rewrites, which reports also name (no kernel of their own):", file=out)
    for name, what in kernelgraft.rewriter.REWRITES.items():
        print(f"  {name}: {what}", file=out)
    return 0


SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "suite.py"


def bench(args: list[str]) -> int:
    """Forward to the GPU benchmark suite of a source checkout (benchmarks/suite.py beside the package)."""
    if not SUITE.is_file():
        raise UsageError(f"it runs the GPU benchmark suite of a source checkout, and {SUITE} does not exist: "
                         "clone the repository and run it there (the benchmarks are not part of the installed package)")
    mods = {}
    for name in ("suite_args", "suite"):  # the command line first, without torch: --help and errors at once
        spec = importlib.util.spec_from_file_location(f"kernelgraft_bench_{name}", SUITE.with_name(f"{name}.py"))
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
        if name == "suite_args":
            mods[name].parser().parse_args(args)
    return mods["suite"].main(args)


# --- the parser ---


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line on stderr (no usage block) and exit 2, as every error
    of the command line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _device(text: str) -> str:
    if re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: give cpu, cuda or cuda:N")


def _add_source(sp: argparse.ArgumentParser) -> None:
    """--arch (a tiny random model) or --model (a local checkpoint), not both."""
    src = sp.add_mutually_exclusive_group()
    src.add_argument(  # default None, not "llama": argparse tells a given --arch from its default by identity
        "--arch",
        help="a model type of the installed transformers that has a causal LM (e.g. llama, qwen3, gemma2, "
        f"mistral, deepseek_v3), for a tiny random model of it: hidden 64, vocabulary 128 (default: {DEFAULT_ARCH})",
    )
    src.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face checkpoint directory (config.json and weights; nothing is downloaded)",
    )
    sp.add_argument("--layers", type=int, default=2,
                    help="layers of the tiny random model of --arch, 1 or more (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kernelgraft",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    d = sub.add_parser("demo", help="train a tiny Llama stock vs kernelgraft and compare the loss curves")
    d.add_argument("--steps", type=int, default=20,
                   help="training steps of each model, 1 or more (default: %(default)s)")
    d.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to train; auto: cuda if a GPU is visible, else cpu (default: %(default)s)")
    d.add_argument("--backend", choices=BACKENDS, default=None,
                   help="torch.compile backend of the kernelgraft model; default: inductor on cuda, eager on cpu "
                   "(inductor's CPU compile is slow)")
    e = sub.add_parser(
        "explain",
        help="report what would be replaced in a tiny random model or a local checkpoint",
        epilog="examples:\n  kernelgraft explain --arch qwen3\n  kernelgraft explain --model ./checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_source(e)
    au = sub.add_parser(
        "audit",
        help="per site and parameter, is the optimized model as accurate as the stock one? (exit 1 if not, "
        "3 if a report could not be written)",
        epilog="examples:\n  kernelgraft audit --arch llama --out audit.html\n"
        "  kernelgraft audit --model ./checkpoint --dtype bfloat16 --out audit.html --md audit.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_source(au)
    au.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype the model is audited in (default: %(default)s)")
    au.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    au.add_argument("--backend", choices=BACKENDS, default="eager",
                    help="torch.compile backend of the optimized model (default: %(default)s)")
    au.add_argument("--batch", type=int, default=2,
                    help="sequences in each random batch, 1 or more (default: %(default)s)")
    au.add_argument("--seq", type=int, default=16, help="tokens per sequence, 2 or more; the first quarter is a "
                    "prompt without labels (default: %(default)s)")
    au.add_argument("--seed", type=int, default=0,
                    help="seed of the random model and batches, an integer (default: %(default)s)")
    au.add_argument("--batches", type=int, default=16, help="random batches the loss and each parameter's "
                    "gradient are judged on at once, 1 or more: on one, a loss is one number, its error a draw "
                    "of the rounding (default: %(default)s)")
    au.add_argument("--out", metavar="HTML", help="write the HTML report to this file (its folder must exist)")
    au.add_argument("--md", metavar="MD", help="write the Markdown report to this file (its folder must exist)")
    au.add_argument("--no-compile-reference", action="store_true",
                    help="compare with eager only: skip the torch.compile reference of each site "
                    "(and, under inductor, of the whole model; faster)")
    sub.add_parser("patterns", help="list the registered patterns, their spellings and each one's source")
    sub.add_parser(
        "bench",
        help="run the GPU benchmark suite of a source checkout (its options: kernelgraft bench --help)",
        add_help=False,
    )
    return p


def _subparser(p: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (action,) = (a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _check_device(device: str) -> None:
    """UsageError where --device names a CUDA GPU that is not visible."""
    import torch

    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise UsageError(
            f"--device {device}: {torch.cuda.device_count()} CUDA GPU(s) visible, numbered from 0"
        )


def _run(a, sp: argparse.ArgumentParser) -> int:
    note = lambda line: print(f"{sp.prog}: note: {line}", file=sys.stderr)  # noqa: E731
    if a.cmd == "demo":
        if a.steps < 1:
            raise UsageError("--steps must be at least 1")
        _check_device(a.device)
        return demo(a.steps, a.device, a.backend)
    if a.cmd == "patterns":
        return patterns()
    # explain, audit: a model from --arch or --model
    if a.model is not None and not os.path.isdir(a.model):
        raise UsageError(
            f"--model {a.model}: not a directory; give a local Hugging Face checkpoint directory"
        )
    if a.model is None and a.arch is None:
        a.arch = DEFAULT_ARCH
    if a.layers < 1:
        raise UsageError("--layers must be at least 1")
    if a.cmd == "explain":
        return explain_model(a.arch, a.model, a.layers, note=note)
    for flag, least in (("batch", 1), ("seq", 2), ("batches", 1)):
        if getattr(a, flag) < least:
            raise UsageError(f"--{flag} must be at least {least}")
    _check_device(a.device)
    _writable("--out", a.out)
    _writable("--md", a.md)
    return audit_cmd(a, note=note)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd = argv[0] if argv else None
    try:
        if cmd == "bench":  # every later argument belongs to the suite, --help included
            return bench(argv[1:])
        a, extra = p.parse_known_args(argv)
        sp = _subparser(p, a.cmd)
        if extra:  # said by the subcommand's parser, whose options they were meant to be
            sp.error(f"unrecognized arguments: {' '.join(extra)}")
        return _run(a, sp)
    except UsageError as err:
        print(f"kernelgraft {cmd}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except WriteError as err:
        print(f"kernelgraft {cmd}: error: {err}", file=sys.stderr)
        raise SystemExit(3) from None
    except BrokenPipeError:  # the reader stopped reading (a pipe into head): nothing of ours failed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
