"""`kernelgraft demo | explain | audit | patterns | bench`: the command line.

Exit codes: 0 success, 1 the check failed (loss curves disagree, an audit found a less accurate
site or gradient), 2 bad usage.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

EXAMPLES = """examples:
  kernelgraft demo                      train a tiny Llama 20 steps, stock vs kernelgraft
  kernelgraft demo --steps 5 --device cpu
  kernelgraft explain --arch qwen3      what would be replaced in a tiny random Qwen3
  kernelgraft audit --arch llama --out audit.html
                                        audit a tiny random Llama: per site and parameter, is the
                                        optimized model as accurate as the stock one? (HTML + stdout)
  kernelgraft audit --model ./my-checkpoint --dtype bfloat16 --out audit.html --md audit.md
  kernelgraft patterns                  the registered patterns and their spellings
  kernelgraft bench --out results --parts patterns,steps
                                        the GPU benchmark suite (benchmarks/suite.py of a checkout)
"""


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
    import torch
    from transformers import LlamaForCausalLM

    import kernelgraft

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

    from tqdm.auto import tqdm

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


def explain_arch(arch: str, layers: int = 2, out=sys.stdout) -> int:
    import torch

    import kernelgraft

    torch.manual_seed(0)
    model = _tiny_arch(arch, layers)
    ids = torch.randint(0, 128, (2, 16))
    print(kernelgraft.explain(model, input_ids=ids, labels=ids), file=out)
    return 0


def audit_cmd(a, out=None) -> int:
    """`kernelgraft audit`: a tiny random model of --arch, or a local checkpoint (--model PATH)."""
    import torch

    out = out or sys.stdout
    import kernelgraft

    torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype)
    if a.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(a.model, local_files_only=True, dtype=dtype)
    else:
        model = _tiny_arch(a.arch, a.layers).to(dtype)
    model = model.to(a.device)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (a.batch, a.seq), device=a.device)
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
    from kernelgraft.patterns import REGISTRY

    for name in REGISTRY.names():
        print(f"{name}:", file=out)
        for sp in REGISTRY.spellings([name]):
            args = ", ".join(f"{a}: Scalar" if a in sp.scalar_names else a for a in sp.arg_names)
            print(f"  {sp.name}({args})", file=out)
            for line in sp.source.splitlines()[2:]:
                print(f"      {line.strip()}", file=out)
    return 0


def bench(args: list[str], parser) -> int:
    """Forward to benchmarks/suite.py next to this package (a source checkout)."""
    import importlib.util
    from pathlib import Path

    suite = Path(__file__).resolve().parent.parent / "benchmarks" / "suite.py"
    if not suite.is_file():
        parser.error(
            f"kernelgraft bench runs benchmarks/suite.py of a source checkout, and {suite} does not exist: "
            "clone the repository and run it there (the benchmarks are not part of the installed package)"
        )
    spec = importlib.util.spec_from_file_location("kernelgraft_bench_suite", suite)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kernelgraft",
        description=__doc__.splitlines()[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a tiny Llama stock vs kernelgraft and compare the loss curves")
    d.add_argument("--steps", type=int, default=20)
    d.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    d.add_argument(
        "--backend",
        choices=["inductor", "eager"],
        default=None,
        help="default: inductor on cuda, eager on cpu (inductor's CPU compile is slow)",
    )
    e = sub.add_parser("explain", help="report what would be replaced in a tiny random model")
    e.add_argument("--arch", default="llama", help="a transformers model type, e.g. llama, qwen3, gemma2")
    e.add_argument("--layers", type=int, default=2)
    au = sub.add_parser(
        "audit",
        help="per site and parameter, is the optimized model as accurate as the stock one? (exit 1 if not)",
        epilog="examples:\n  kernelgraft audit --arch llama --out audit.html\n"
        "  kernelgraft audit --model ./checkpoint --dtype bfloat16 --out audit.html --md audit.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = au.add_mutually_exclusive_group()
    src.add_argument("--arch", default="llama", help="a transformers model type for a tiny random model")
    src.add_argument("--model", help="a local Hugging Face checkpoint directory (no download)")
    au.add_argument("--layers", type=int, default=2, help="layers of the tiny random model")
    au.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    au.add_argument("--device", default="cpu", help="cpu or cuda")
    au.add_argument("--backend", choices=["eager", "inductor"], default="eager")
    au.add_argument("--batch", type=int, default=2)
    au.add_argument("--seq", type=int, default=16)
    au.add_argument("--seed", type=int, default=0)
    au.add_argument("--out", help="write the HTML report here")
    au.add_argument("--md", help="write the Markdown report here")
    au.add_argument("--no-compile-reference", action="store_true", help="skip torch.compile of each site")
    sub.add_parser("patterns", help="list registered patterns and their spellings")
    b = sub.add_parser(
        "bench",
        help="run the GPU benchmark suite of a source checkout (benchmarks/suite.py; --help there)",
        add_help=False,
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every later argument belongs to the suite, --help included
        return bench(argv[1:], b)
    a = p.parse_args(argv)
    if a.cmd == "demo":
        if a.steps < 1:
            p.error("--steps must be at least 1")
        if a.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                p.error("--device cuda: no CUDA GPU is visible; use --device cpu")
        return demo(a.steps, a.device, a.backend)
    if a.cmd == "explain":
        return explain_arch(a.arch, a.layers)
    if a.cmd == "audit":
        import os

        if a.model and not os.path.isdir(a.model):
            p.error(f"--model {a.model}: not a directory; give a local Hugging Face checkpoint directory")
        if a.batch < 1 or a.seq < 2 or a.layers < 1:
            p.error("--batch and --layers must be at least 1, --seq at least 2")
        if a.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                p.error("--device cuda: no CUDA GPU is visible; use --device cpu")
        try:
            return audit_cmd(a)
        except ValueError as e:  # e.g. an unknown --arch
            p.error(str(e))
    return patterns()


if __name__ == "__main__":
    sys.exit(main())
