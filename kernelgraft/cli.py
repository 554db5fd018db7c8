"""`kernelgraft demo | explain | patterns`: the command line.

Exit codes: 0 success, 1 the check failed (e.g. loss curves disagree), 2 bad usage.
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
  kernelgraft patterns                  the registered patterns and their spellings
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

    def train(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, times = [], []
        for _ in range(steps):
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

    base, t_base = train(stock)
    mine, t_mine = train(grafted)
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


def explain_arch(arch: str, layers: int = 2, out=sys.stdout) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import kernelgraft

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
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (2, 16))
    print(kernelgraft.explain(model, input_ids=ids, labels=ids), file=out)
    return 0


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
    sub.add_parser("patterns", help="list registered patterns and their spellings")
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
    return patterns()


if __name__ == "__main__":
    sys.exit(main())
