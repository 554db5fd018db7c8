"""QLoRA: peft's LoRA adapters over bitsandbytes' 4-bit base layers (NF4, double quantization), on
bitsandbytes' CPU backend. Every adapted layer is served (the `peft_4bit` spellings), and the loss
and every adapter gradient pass the accuracy rule, the truth computed in float64 with the
dequantized weights: the 4-bit rounding is the model's, not kernelgraft's."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import batch, loss_and_grads, tiny_config
from trainer_helpers import max_rel_diff, train_one_step

import kernelgraft
from kernelgraft.gradcheck import judge

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the qlora extra, which make test installs")


def qlora_model(
    arch: str, compute_dtype, folder, quant_type: str = "nf4", double: bool = True, layers: int = 2
):
    """A tiny random `arch` saved to `folder`, loaded back with 4-bit base weights, and peft's LoRA
    (rank 8) on every linear layer. Widths are multiples of bitsandbytes' block of 64."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = tiny_config(arch, layers=layers)
    cfg.intermediate_size = 128
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # norms off 1, as tiny_model perturbs them
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(folder)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map="cpu", dtype=compute_dtype)
    torch.manual_seed(1)
    lora = LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, lora)


def dequantized(model):
    """`model` with every 4-bit base layer made a plain float64 linear of its dequantized weight."""
    truth = model
    for name, mod in list(truth.named_modules()):
        if isinstance(mod, bnb.nn.Linear4bit):
            w = bnb.functional.dequantize_4bit(mod.weight.data, mod.weight.quant_state)
            plain = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            plain.weight = torch.nn.Parameter(w.to(torch.float64), requires_grad=False)
            if mod.bias is not None:
                plain.bias = torch.nn.Parameter(mod.bias.detach().to(torch.float64), requires_grad=False)
            parent, _, leaf = name.rpartition(".")
            setattr(truth.get_submodule(parent), leaf, plain)
    return truth.to(torch.float64)


@pytest.mark.slow  # three quantized models loaded and judged per case: over 20 s on a 2-core CPU
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_qlora_adapters_are_served_and_pass_the_rule(tmp_path, arch, dtype):
    stock = qlora_model(arch, dtype, tmp_path)
    mine = kernelgraft.optimize(qlora_model(arch, dtype, tmp_path), backend="eager")
    truth = dequantized(qlora_model(arch, dtype, tmp_path))
    runs = {"truth": [], "eager": [], "mine": []}
    for seed in (1, 2, 3, 4):  # judged over four batches at once, as the LoRA coverage rows
        b = batch(seed=seed)
        runs["truth"].append(loss_and_grads(truth, b, truth=True))
        runs["eager"].append(loss_and_grads(stock, b))
        runs["mine"].append(loss_and_grads(mine, b))

    def joined(name, key=None):
        return torch.cat([(loss if key is None else grads[key]).reshape(-1).double() for loss, grads in runs[name]])

    names = sorted(runs["truth"][0][1])
    assert len(names) == 2 * 7 * 2 and all("lora_" in n for n in names)  # A and B, 7 layers, 2 decoder layers
    verdicts = [judge("loss", joined("truth"), joined("mine"), joined("eager"))]
    verdicts += [judge(f"grad {n}", joined("truth", n), joined("mine", n), joined("eager", n)) for n in names]
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    rep = mine.kernelgraft_report
    assert rep.counts()["lora"] == 7 * 2, str(rep)
    assert {s.spelling for s in rep.sites if s.pattern == "lora"} <= {"peft_4bit", "peft_4bit_same_dtype"}
    assert not [u for u in rep.unserved if u.kind == "lora"], str(rep)


def _matrix():
    """Every 4-bit format, double quantization and compute dtype; one case in the default suite,
    the rest with `make test-slow` (a quantized model loaded and captured each)."""
    for quant_type in ("nf4", "fp4"):
        for double in (True, False):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                fast = (quant_type, double, dtype) == ("nf4", True, torch.bfloat16)
                marks = () if fast else (pytest.mark.slow,)
                name = f"{quant_type}-{'double' if double else 'single'}-{str(dtype)[6:]}"
                yield pytest.param(quant_type, double, dtype, marks=marks, id=name)


@pytest.mark.parametrize("quant_type,double,dtype", list(_matrix()))
def test_every_adapted_layer_of_a_4bit_model_is_served(tmp_path, quant_type, double, dtype):
    """NF4 and FP4, double quantization on and off, compute in fp32, bf16 and fp16: explain finds
    the seven adapted layers of each decoder layer served."""
    model = qlora_model("llama", dtype, tmp_path, quant_type, double)
    rep = kernelgraft.explain(model, **batch())
    assert rep.counts().get("lora") == 7 * 2, str(rep)
    assert not rep.near_misses and not rep.unserved, str(rep)


@pytest.mark.slow  # two Trainer runs over quantized models: over 20 s on a 2-core CPU
def test_qlora_under_trainer_with_accumulation_equals_the_stock_step(tmp_path):
    stock = qlora_model("llama", torch.float32, tmp_path)
    start = {n: p.detach().clone() for n, p in stock.named_parameters() if p.requires_grad}
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    ref = train_one_step(stock, 2, 4, tmp_path / "stock")
    got = train_one_step(mine, 2, 4, tmp_path / "kernelgraft")
    ref = {n: p for n, p in ref.items() if n in start}
    got = {n: p for n, p in got.items() if n in start}
    assert max_rel_diff(ref, start) > 1e-3  # the step moved the adapters
    assert max_rel_diff(got, ref) < 1e-5, max_rel_diff(got, ref)
    assert mine.kernelgraft_report.counts()["lora"] == 7 * 2
