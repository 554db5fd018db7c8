"""benchmarks/bench_unsloth.py on the CPU: its rows and modes, its command line, the one-line errors of a
mode that cannot run here, and the QLoRA model (bitsandbytes NF4 with double quantization, bf16
compute, LoRA r16 on every linear of the decoder layers) built from a saved random model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_unsloth as bu  # noqa: E402

LORA_ROW = "llama-1b LoRA 8x2048"


def test_rows_run_the_suites_shapes_and_pair_each_unsloth_mode_with_kernelgraft():
    from suite_args import SHAPES

    assert set(bu.ROWS) == {
        "llama-1b LoRA 8x2048",
        "llama-8b LoRA 2x4096",
        "llama-8b QLoRA 2x4096",
        "llama-1b full 8x2048",
    }
    q = SHAPES[bu.ROWS["llama-8b QLoRA 2x4096"]["shape"]]
    assert (q["B"], q["S"], q["cfg"]["hidden_size"], q["cfg"]["num_hidden_layers"]) == (2, 4096, 4096, 32)
    assert bu.ROWS["llama-8b QLoRA 2x4096"]["train"] == "qlora"
    for name, row in bu.ROWS.items():
        assert row["shape"] in SHAPES, name
        for m in row["modes"]:
            if m.startswith("unsloth") and row["train"] != "full":
                # the same checkpointing choice measured for kernelgraft
                assert m.replace("unsloth", "kernelgraft") in row["modes"], (name, m)
    for name in ("llama-1b LoRA 8x2048", "llama-8b LoRA 2x4096", "llama-8b QLoRA 2x4096"):
        assert set(bu.ROWS[name]["modes"]) == {"eager", "torch.compile", "liger", "kernelgraft",
                                               "kernelgraft (layers)", "kernelgraft (checkpointing)", "unsloth",
                                               "unsloth (checkpointing)"}  # fmt: skip
    assert bu.ROWS["llama-1b full 8x2048"]["modes"] == ("unsloth", "unsloth (checkpointing)")
    assert all(bu.ROWS[r]["shape"] == s for s, r in bu.ROW_OF_SHAPE.items())
    assert [
        bu.checkpointing(m) for m in ("unsloth", "unsloth (checkpointing)", "kernelgraft (checkpointing)")
    ] == [
        False,
        True,
        True,
    ]
    assert bu.slug("llama-8b LoRA 2x4096") == bu.slug("llama-8b 2x4096") == "llama-8b_2x4096"


def test_command_line_parses_and_refuses_a_bad_row_mode_or_count(capsys):
    a = bu.parse(
        [
            "--rows",
            "llama-8b QLoRA 2x4096,llama-1b full 8x2048",
            "--modes",
            "unsloth,kernelgraft (checkpointing)",
        ]
    )
    assert a.row_list == ["llama-8b QLoRA 2x4096", "llama-1b full 8x2048"] and a.steps == 10
    assert bu.parse([]).row_list == list(bu.ROWS)
    for argv, said in [
        (["--rows", "llama-3b LoRA"], "unknown row 'llama-3b LoRA'"),
        (["--modes", "unsloth (fast)"], "unknown mode 'unsloth (fast)'"),
        (["--steps", "0"], "--steps must be 1 or more"),
        (["--one", LORA_ROW], "--one needs --mode"),
    ]:
        with pytest.raises(SystemExit) as e:
            bu.parse(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no mode 'eager'"):
        bu.check_mode("llama-1b full 8x2048", "eager")


def test_bench_train_step_still_parses_and_takes_the_rows(capsys):
    import bench_train_step

    a = bench_train_step.parser().parse_args(["--rows", "llama-8b QLoRA 2x4096", "--modes", "eager,unsloth"])
    assert a.rows == "llama-8b QLoRA 2x4096" and a.modes == "eager,unsloth" and a.steps == 5
    assert bench_train_step.parser().parse_args([]).modes is None  # the shape's five modes, as before
    with pytest.raises(SystemExit) as e:
        bench_train_step.main(["--rows", "llama-8b QLoRA 9x9"])
    assert e.value.code == 2 and "unknown row 'llama-8b QLoRA 9x9'" in capsys.readouterr().err


def test_unsloth_mode_says_in_one_line_that_unsloth_or_cuda_is_missing(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(bu.Unavailable, match=r"^unsloth is not importable: install the peers"):
        bu.need_unsloth()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(bu.Unavailable, match="the unsloth mode needs a CUDA GPU"):
        bu.need_unsloth()
    with pytest.raises(bu.Unavailable, match="the eager mode needs a CUDA GPU"):
        bu.run_one(LORA_ROW, "eager", 1, str(tmp_path))


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("unsloth") is not None, reason="checks the message without unsloth"
)
def test_unsloth_mode_in_its_own_process_fails_with_one_line(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_unsloth.py"),
        "--one",
        LORA_ROW,
        "--mode",
        "unsloth",
    ]
    got = subprocess.run(cmd + ["--models", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        "bench_unsloth.py: unsloth: unsloth is not importable: install the peers' wheels (python "
        "benchmarks/peers.py install --wheels .peers --target .peers_site) and run with "
        "PYTHONPATH=$PWD/.peers_site"
    ]
    assert bu.run_in_process(LORA_ROW, "unsloth", 1, str(tmp_path))["error"].startswith(
        "bench_unsloth.py: unsloth: unsloth is not importable"
    )


def test_a_cold_and_warm_run_gives_each_mode_fresh_caches_then_the_same_ones(monkeypatch):
    calls = []

    def fake(row, mode, steps, models, timeout=1800, caches=None, first_only=False):
        calls.append((caches, first_only))
        return dict(first_step_s=3.0 if first_only else 30.0, loss=1.0, startup=["first training call: ..."])

    monkeypatch.setattr(bu, "run_in_process", fake)
    got = bu.cold_and_warm(LORA_ROW, "kernelgraft (layers)", 2, "/tmp/m")
    assert (got["first_step_s"], got["warm_first_step_s"]) == (30.0, 3.0)
    (cold, first), (warm, again) = calls
    assert cold == warm and os.path.basename(cold).startswith("kg_caches_") and (first, again) == (False, True)
    assert not os.path.exists(cold)  # each mode's caches are its own, gone after it
    env = bu.cache_env("/x")
    assert {k: v.startswith("/x/") for k, v in env.items()} == dict.fromkeys(
        ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KERNELGRAFT_CACHE_DIR", "UNSLOTH_COMPILE_LOCATION"), True
    )


def test_markdown_gives_a_row_per_mode_and_the_errors():
    doc = dict(gpu="NVIDIA H200", date="2026-12-01", versions="torch x", rows={
        "llama-8b QLoRA 2x4096": {
            "kernelgraft": dict(tok_s=12345.6, device_ms=610.2, peak_above_start_gib=20.04, first_step_s=41.0, loss=11.9),
            "kernelgraft (layers)": dict(tok_s=12000.4, device_ms=612.0, peak_above_start_gib=20.1, first_step_s=12.5,
                                         warm_first_step_s=4.25, loss=11.9),
            "unsloth": dict(error="bench_unsloth.py: unsloth: unsloth is not importable"),
        }})  # fmt: skip
    md = bu.markdown(doc)
    assert "| kernelgraft | 12,346 | 610 | 20.0 | 41.0 | - | 11.9000 |" in md
    assert "| kernelgraft (layers) | 12,000 | 612 | 20.1 | 12.5 | 4.2 | 11.9000 |" in md
    assert "| unsloth | error: bench_unsloth.py: unsloth: unsloth is not importable | | | | | |" in md
    assert "process of its own" in md


TINY = dict(
    arch="llama",
    B=2,
    S=32,
    cfg=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False),
)  # fmt: skip


def test_qlora_model_is_nf4_double_quant_of_the_saved_weights_with_lora_on_every_linear(tmp_path):
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the qlora extra")
    from safetensors.torch import load_file

    folder = bu.saved_model(TINY, str(tmp_path / "tiny"), device="cpu")
    assert bu.saved_model(TINY, folder, device="cpu") == folder  # kept: not drawn again
    saved = load_file(os.path.join(folder, "model.safetensors"))
    model = bu.qlora_model(folder, device_map="cpu")

    quantized = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(quantized) == 7 * 2  # every linear of both decoder layers; the LM head stays bf16
    for name, mod in quantized.items():
        qs = mod.weight.quant_state
        assert (qs.quant_type, qs.nested, mod.compute_dtype) == ("nf4", True, torch.bfloat16), name
        w = saved[name.replace("base_model.model.", "").replace(".base_layer", "") + ".weight"]
        # the saved weight, quantized here the same way (NF4, blocks of 64, the absmax quantized too),
        # is what the model holds
        q, s = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        deq = bnb.functional.dequantize_4bit(mod.weight.data, qs)
        assert torch.equal(deq, bnb.functional.dequantize_4bit(q, s)), name
        # and that is the saved weight within NF4's rounding: half its widest step (0.28 of the block's
        # absmax), with the quantized absmax's and bfloat16's rounding on top
        absmax = w.float().reshape(-1, 64).abs().amax(1, keepdim=True)
        assert ((deq.float() - w.float()).reshape(-1, 64).abs() <= 0.17 * absmax).all(), name
    assert model.get_base_model().lm_head.weight.dtype == torch.bfloat16
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    lora = [model.get_submodule(n.removesuffix(".base_layer")) for n in quantized]  # peft's layer over each
    assert {m.lora_A["default"].out_features for m in lora} == {16} and {m.r["default"] for m in lora} == {16}
    assert model.peft_config["default"].lora_alpha == bu.LORA_ALPHA

    ids = torch.randint(0, 256, (2, 32))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    # LoRA's B starts at zero: its gradient is what flows; A's is zero until B moves
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if ".lora_B." in n)


def test_the_qlora_row_trains_in_training_mode_where_checkpointing_takes_effect(monkeypatch, tmp_path):
    """from_pretrained leaves a model in eval mode, where Hugging Face's gradient checkpointing does
    nothing: the QLoRA row's modes train it in training mode, as Unsloth's does."""
    import suite
    from transformers import AutoModelForCausalLM

    folder = bu.saved_model(TINY, str(tmp_path / "tiny"), device="cpu")
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert not loaded.training
    monkeypatch.setattr(bu, "saved_model", lambda spec, f: folder)
    monkeypatch.setattr(bu, "qlora_model", lambda f: AutoModelForCausalLM.from_pretrained(f))
    monkeypatch.setattr(suite, "apply_mode", lambda model, mode: model)
    model = bu.build("llama-8b QLoRA 2x4096", "kernelgraft (checkpointing)", str(tmp_path))
    assert model.training and model.model.layers[0].training and model.model.layers[0].gradient_checkpointing
