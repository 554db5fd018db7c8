"""Coverage matrix: tiny random configs of the decoders people fine-tune (nothing downloaded).
For each: the sites expected from the model itself equal explain().counts(), and the loss and every
gradient agree with the stock model by the accuracy rule in fp32 and bf16. The README's
architecture table is generated from ARCHS and checked here, so it cannot drift:
    python tests/models/test_coverage.py   # rewrites the table in docs/architectures.md
"""

import copy
import functools
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

# run as a script, this file finds tiny in tests/helpers/ itself (under pytest, tests/conftest.py
# puts it on the path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from tiny import batch, compare_models, tiny_model  # noqa: E402

import kernelgraft  # noqa: E402

# one architecture per structure the suite checks in CI; the rest (Mistral and Qwen2 as Llama,
# GLM-4 as GLM with sandwich norms...) are checked with their gradients by `make coverage`
ARCHS = [
    "llama",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "granite",
    "olmo2",
    "mixtral",
    "qwen3_moe",
    "gpt_neox",  # LayerNorm with bias, partial rotary, a GELU MLP (not gated)
    "cohere",  # a hand-written float32 LayerNorm, interleaved RoPE
    "glm",  # interleaved RoPE on half the head, a fused gate_up projection
    "helium",  # interleaved RoPE
]
# the same matrix on the GPU (compiled Triton instead of the interpreter): `pytest -m gpu`
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
README = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
START, END = "<!-- coverage:start -->", "<!-- coverage:end -->"


NORMS = {"RMSNorm": "rms_norm", "LayerNorm": "layer_norm"}  # a norm module's class name ends with


def expected_sites(model, b) -> dict:
    """From the model, not from kernelgraft: the RMSNorm and LayerNorm modules it calls (hooks,
    eager); per decoder layer (the config) RoPE on q and on k, and one gated MLP (dense, or an MoE
    block's experts) where the model has a gate projection or experts."""
    calls = Counter()
    hooks = [
        m.register_forward_hook(lambda *a, k=kind: calls.update([k]))
        for m in model.modules()
        for suffix, kind in NORMS.items()
        if type(m).__name__.endswith(suffix)
    ]
    with torch.no_grad():
        model(**b)
    for h in hooks:
        h.remove()
    L = model.config.num_hidden_layers
    gated = any(hasattr(m, a) for m in model.modules() for a in ("gate_proj", "gate_up_proj", "experts"))
    # and one LM head + loss when the batch has labels (its output embedding is the head)
    heads = 1 if "labels" in b and model.get_output_embeddings() is not None else 0
    out = {"rope": 2 * L, "gated_mlp": L if gated else 0, "lm_head_ce": heads, **calls}
    return {k: v for k, v in out.items() if v}


def kernel_sites(rep, L: int) -> dict:
    """rep.counts() of the pattern kernels. The attention rewrites (a causal mask -> is_causal, then
    repeat_kv'ed keys -> enable_gqa) depend on whether the installed transformers builds the mask
    under compile (5.17 does, 5.24 not always): at most one of each per layer, counted apart."""
    counts = rep.counts()
    for k in ("sdpa", "gqa"):
        assert counts.get(k, 0) <= L, (k, counts)
    return {k: v for k, v in counts.items() if k not in ("sdpa", "gqa")}


LORA_ARCHS = ["llama", "qwen3", "phi3"]  # the LoRA rows: peft's LoRA on every linear layer


def lora_model(arch: str, dtype=torch.float32, device="cpu"):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(tiny_model(arch, dtype), cfg).to(device)


@functools.cache
def explained(arch: str, device: str = "cpu", lora: bool = False):
    """(model, explain report) of a tiny model on the default batch: shared by the site counts and
    the README's table."""
    model = lora_model(arch, device=device) if lora else tiny_model(arch, device=device)
    return model, kernelgraft.explain(model, **batch(device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_sites_match_the_model(arch, device):
    model, rep = explained(arch, device, False)
    b = batch(device=device)
    expected = expected_sites(model, b)
    assert kernel_sites(rep, model.config.num_hidden_layers) == expected, str(rep)
    assert not rep.fallbacks and not rep.near_misses, str(rep)
    # nothing skipped silently: no norm left unserved, and an MLP only where it has no gate
    unserved = Counter(u.kind for u in rep.unserved)
    assert unserved == ({} if "gated_mlp" in expected else {"mlp": model.config.num_hidden_layers}), str(rep)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_loss_and_gradients_agree(arch, dtype, device):
    stock = tiny_model(arch, dtype, device=device)
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    b = batch(device=device)
    # in bf16 over two batches: a bias gradient summed over one batch's 24 tokens is one draw of
    # the rounding (GPT-NeoX's MLP biases); against eager alone: a stricter bound than
    # max(eager, compile), and no CPU compile per model
    bs = b if dtype == torch.float32 else [b, batch(seed=2, device=device)]
    verdicts = compare_models(grafted, stock, bs, compiled=False)
    assert len(verdicts) == 1 + sum(1 for _ in stock.parameters())
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    rep = grafted.kernelgraft_report
    L = stock.config.num_hidden_layers
    assert kernel_sites(rep, L) == expected_sites(stock, b)
    # q and k of each layer: one launch (a graph that serves every layer runs once per layer)
    assert sum(rep.times(s) for s in rep.sites if s.paired) == 2 * L


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", LORA_ARCHS)
def test_peft_lora(arch, dtype, device):
    stock = lora_model(arch, dtype, device)
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    # judged over four batches at once (each quantity's values from all of them in one vector): on one
    # batch of 24 tokens an adapter's gradient is one draw of the rounding, and single batches go
    # either side of eager's error; against eager alone: stricter than max(eager, compile)
    batches = [batch(seed=s, device=device) for s in (1, 2, 3, 4)]
    verdicts = compare_models(grafted, stock, batches, compiled=False)
    adapted = 4 if arch == "phi3" else 7  # q,k,v,o,gate,up,down; Phi-3: qkv_proj, o, gate_up_proj, down
    lora = [v for v in verdicts if "lora_" in v.what]
    assert len(lora) == 2 * adapted * stock.config.num_hidden_layers  # A and B of each
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    rep = grafted.kernelgraft_report
    assert rep.counts()["rms_norm"] >= 5 and rep.counts()["lora"] == adapted * stock.config.num_hidden_layers
    assert not rep.fallbacks and not rep.near_misses, str(rep)


def test_cohere_is_served_in_full():
    # Cohere writes its LayerNorm by hand in float32 (the mean subtracted, written twice) and rotates
    # interleaved pairs: served as layer_norm.weight_only and rope.interleaved
    model = tiny_model("cohere")
    rep = kernelgraft.explain(model, **batch())
    assert rep.counts() == {"layer_norm": 3, "rope": 4, "gated_mlp": 2, "lm_head_ce": 1}
    spellings = {(s.pattern, s.spelling) for s in rep.sites}
    assert ("layer_norm", "weight_only") in spellings and ("rope", "interleaved") in spellings
    assert not rep.near_misses and not rep.fallbacks


def coverage_table() -> str:
    """The README's table: for each architecture (and with peft's LoRA on every linear layer), the
    spellings kernelgraft finds and how often."""
    pats = ("rms_norm", "layer_norm", "rope", "gated_mlp", "lm_head_ce", "lora")
    rows = [
        "| architecture | " + " | ".join(f"{p} sites (spelling)" for p in pats) + " | checked |",
        "|" + "---|" * (len(pats) + 2),
    ]
    for arch, lora in [(a, False) for a in ARCHS] + [(a, True) for a in LORA_ARCHS]:
        _, rep = explained(arch, "cpu", lora)
        cells = []
        for pat in pats:
            sp = Counter(s.spelling for s in rep.sites if s.pattern == pat)
            cells.append(", ".join(f"{n} ({k})" for k, n in sorted(sp.items())) or "-")
        what = "loss + all grads" if not lora else "loss + adapter grads"
        name = f"{arch} + LoRA (all linear)" if lora else arch
        rows.append(f"| {name} | {' | '.join(cells)} | {what}, fp32 and bf16 |")
    return "\n".join(rows)


@pytest.mark.slow  # over 20 s on a 2-core CPU
def test_readme_table_is_current():
    text = README.read_text()
    m = re.search(re.escape(START) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    assert m, "README.md lacks the coverage table markers"
    assert m.group(1) == coverage_table(), (
        "run `python tests/models/test_coverage.py` to regenerate the table"
    )


if __name__ == "__main__":
    text = README.read_text()
    new = re.sub(
        re.escape(START) + r".*?" + re.escape(END), f"{START}\n{coverage_table()}\n{END}", text, flags=re.S
    )
    README.write_text(new)
    sys.exit(0)


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
def test_the_every_decoder_survey_counts_sites_from_the_model():
    """tests/models/coverage_all.py (`make coverage`): the expected sites come from the model's modules; a
    model whose every expected site is served is "full", and a row says what is missing and why."""
    import coverage_all

    llama, neox = coverage_all.survey("llama"), coverage_all.survey("gpt_neox")
    assert llama["status"] == "full" and llama["expected"] == {
        "norm": 5,
        "rope": 4,
        "gated_mlp": 2,
        "lm_head_ce": 1,
    }
    assert neox["status"] == "full" and "gated_mlp" not in neox["expected"]  # its MLP has no gate
    missing = dict(llama, status="partial", served=dict(llama["served"], rope=0), why="missing rope; x")
    text = coverage_all.table([llama, missing])
    assert text.startswith("1 of 2 causal-LM architectures fully served (2 built from a tiny config).")
    assert "| llama | full | 5/5 | 4/4 | 2/2 | 1/1 |  |" in text and "| partial | 5/5 | 0/4 |" in text


def test_the_survey_repairs_a_tiny_config_and_counts_only_checked_gradients():
    """tests/models/coverage_all.py: an architecture tests/helpers/tiny.py's config cannot build is
    rebuilt from its default config made tiny by attribute names (MLA's head dims and kv heads tied, a
    hybrid's two layers one of each kind); a row whose sites are all served but whose gradients fail
    is "grads", and the first line counts it out."""
    import coverage_all

    mla = coverage_all.repaired_config("deepseek_v3")
    assert (mla.hidden_size, mla.num_hidden_layers, mla.vocab_size) == (64, 2, 128)
    assert mla.head_dim == mla.qk_rope_head_dim == 8 and mla.num_key_value_heads == mla.num_attention_heads
    hybrid = coverage_all.repaired_config("qwen3_next")
    assert hybrid.layer_types == ["linear_attention", "full_attention"] and not hybrid.use_cache
    gptj = coverage_all.survey("gptj", grads=False)  # rotary_dim 64 > head dim 16 in the tiny config
    assert gptj["repaired"] and gptj["status"] == "full" and gptj["grads"] == "not checked"
    passed = dict(gptj, grads="fp32, bf16")
    failed = dict(gptj, arch="x", status="grads", grads="failed", why="float32: 1 of 9 fail")
    text = coverage_all.table([passed, failed])
    assert text.startswith("1 of 2 causal-LM architectures fully served (2 built from a tiny config).")
    assert "| gptj (repaired config) | full | 3/3 | 4/4 | - | 1/1 |  | fp32, bf16 |" in text
    assert "| x (repaired config) | grads | 3/3 | 4/4 | - | 1/1 | float32: 1 of 9 fail | failed |" in text


def test_the_survey_table_takes_rows_surveyed_again():
    """`coverage_all.py --write --update arch...`: the README table with those rows replaced, the
    others kept as they are, an architecture new in the installed transformers added in the order
    of the names, the first line's counts made anew."""
    import coverage_all

    def row(arch, status, repaired=False):
        served = {"norm": 5 if status == "full" else 4}
        return dict(arch=arch, expected={"norm": 5}, served=served, status=status, why="", repaired=repaired,
                    grads="fp32, bf16" if status == "full" else "")  # fmt: skip

    old = coverage_all.table([row("a", "partial"), row("b", "partial", True), row("c", "full")])
    assert old.splitlines()[0].startswith("1 of 3 causal-LM architectures fully served (3 built")
    new = coverage_all.updated(old, [row("b", "full", True)])
    lines = new.splitlines()
    assert lines[0].startswith("2 of 3 causal-LM architectures fully served (3 built")
    assert [ln.split(" | ")[0:2] for ln in lines[-3:]] == [
        ["| a", "partial"], ["| b (repaired config)", "full"], ["| c", "full"]
    ]
    assert lines[-3] == old.splitlines()[-3] and lines[-1] == old.splitlines()[-1]
    added = coverage_all.updated(new, [row("bb", "full"), row("0", "partial")]).splitlines()
    assert added[0].startswith("3 of 5 causal-LM architectures fully served (5 built")
    assert [ln.split(" | ")[0] for ln in added[-5:]] == ["| 0", "| a", "| b (repaired config)", "| bb", "| c"]
