"""Every causal-LM architecture the installed transformers lists, built from a tiny config (2 layers,
hidden 64, nothing downloaded) and explained with labels: the sites its own modules make, against
the sites kernelgraft serves, and why the rest are not served.

Expected sites come from the model, not from kernelgraft: each norm module it calls (hooks; a class
name with "Norm"), RoPE on q and on k of each attention module it calls where it has a rotary
embedding module, one gated MLP per MLP module it calls that has a gate projection (and per experts
module of an MoE block), one LM head + loss. A model is fully served when every expected site is.

    make coverage                          # python tests/coverage_all.py --write: the README's table
    python tests/coverage_all.py llama gpt_neox   # some architectures, printed
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
README = HERE.parent / "README.md"
START, END = "<!-- decoders:start -->", "<!-- decoders:end -->"


def architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _name(m) -> str:
    return type(m).__name__


def expected(model, b) -> dict:
    """The sites the model's own modules make on batch b (eager, hooks)."""
    calls: Counter = Counter()
    gated = lambda m: any(hasattr(m, a) for a in ("gate_proj", "gate_up_proj"))  # noqa: E731
    rotary = any("Rotary" in _name(m) for m in model.modules())

    def kind(m) -> str | None:
        n = _name(m)
        if "Norm" in n:
            return "norm"
        if (
            "Attention" in n
            and rotary
            and hasattr(m, "q_proj") | hasattr(m, "qkv_proj") | hasattr(m, "query_key_value")
        ):
            return "rope"
        if ("MLP" in n or "Mlp" in n) and gated(m):
            return "gated_mlp"
        if n.endswith("Experts"):
            return "gated_mlp"
        return None

    hooks = []
    for m in model.modules():
        k = kind(m)
        if k is not None:
            hooks.append(
                m.register_forward_hook(lambda *a, k=k: calls.update([k] * (2 if k == "rope" else 1)))
            )
    try:
        with torch.no_grad():
            model(**b)
    finally:
        for h in hooks:
            h.remove()
    calls["lm_head_ce"] = 1 if model.get_output_embeddings() is not None else 0
    return {k: v for k, v in calls.items() if v}


def _build(arch: str, tiny_model):
    """The tiny model with SDPA attention, or eager attention where the architecture has no SDPA."""
    try:
        return tiny_model(arch)
    except ValueError as e:
        if "attention implementation" not in str(e):
            raise
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(arch)
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg)


def survey(arch: str) -> dict:
    """One architecture: built?, its expected and served sites, its status and why."""
    sys.path.insert(0, str(HERE))
    from tiny import batch, tiny_model

    import kernelgraft

    row = dict(arch=arch, expected={}, served={}, why="")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _build(arch, tiny_model)
            b = batch()
            want = expected(model, b)
            rep = kernelgraft.explain(model, **b)
    except (MemoryError, TimeoutError):
        raise
    except Exception as e:  # noqa: BLE001 - any failure to build or run the tiny model is the row's finding
        first = (str(e).splitlines() or [""])[0]
        row.update(status="not built", why=f"{type(e).__name__}: {first[:140]}")
        return row
    got = rep.counts()
    served = {
        "norm": got.get("rms_norm", 0) + got.get("layer_norm", 0),
        "rope": got.get("rope", 0),
        "gated_mlp": got.get("gated_mlp", 0),
        "lm_head_ce": got.get("lm_head_ce", 0),
    }
    short = {k: (served.get(k, 0), n) for k, n in want.items()}
    row["expected"], row["served"] = want, served
    missing = [k for k, (s, n) in short.items() if s < n]
    if not missing:
        row["status"] = "full"
    else:
        row["status"] = "partial" if any(s for s, _ in short.values()) else "none"
        reasons = (
            [str(m) for m in rep.near_misses]
            + [str(u) for u in rep.unserved]
            + [f"{r.module}: {r.reason}" for r in rep.fallbacks]
        )
        row["why"] = f"missing {', '.join(missing)}" + (f"; {reasons[0][:160]}" if reasons else "")
    return row


def table(rows: list[dict]) -> str:
    full = sum(r["status"] == "full" for r in rows)
    built = sum(r["status"] != "not built" for r in rows)
    out = [
        f"{full} of {len(rows)} causal-LM architectures fully served ({built} built from a tiny config).",
        "",
        "| architecture | status | norms | RoPE | gated MLP | LM head | why not |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for k in ("norm", "rope", "gated_mlp", "lm_head_ce"):
            n = r["expected"].get(k, 0)
            cells.append(f"{r['served'].get(k, 0)}/{n}" if n else "-")
        why = r["why"].replace("|", "\\|")
        out.append(f"| {r['arch']} | {r['status']} | {' | '.join(cells)} | {why} |")
    return "\n".join(out)


MEMORY_GIB = 12  # a tiny model that allocates more (a default that is not tiny) fails, not the run
SECONDS = 180  # per architecture


def _timed_out(signum, frame):
    raise TimeoutError(f"took more than {SECONDS} s")


def main(argv: list[str]) -> int:
    import resource
    import signal

    write = "--write" in argv
    archs = [a for a in argv if not a.startswith("--")] or architectures()
    limit = MEMORY_GIB * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _timed_out)
    rows = []
    for a in archs:
        signal.alarm(SECONDS)
        try:
            rows.append(survey(a))
        except (MemoryError, TimeoutError) as e:
            rows.append(
                dict(arch=a, expected={}, served={}, status="not built", why=f"{type(e).__name__}: {e}"[:140])
            )
        finally:
            signal.alarm(0)
        print(f"{a}: {rows[-1]['status']} {rows[-1]['why'][:100]}", flush=True)
    text = table(rows)
    if write:
        readme = README.read_text()
        head, rest = readme.split(START, 1)
        _, tail = rest.split(END, 1)
        README.write_text(f"{head}{START}\n{text}\n{END}{tail}")
        print(f"wrote the table of {len(rows)} architectures into {README}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
