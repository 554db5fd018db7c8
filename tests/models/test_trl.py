"""TRL's SFTTrainer puts its own fused LM head on the model (`add_fused_lm_head`: per-token
log-probabilities in tiles, with the entropy and token accuracy it logs). With kernelgraft, one fused
head runs, TRL's: kernelgraft's never sees the logits, serves the rest of the model, and its report
says so; the losses are the stock SFTTrainer's."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import VOCAB, tiny_model

import kernelgraft

trl = pytest.importorskip("trl", reason="trl is in the test extra", minversion="1.16")


def _tokenizer():
    """A word-level tokenizer over the tiny model's vocabulary, built in code (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")


def _sft_losses(model, out: str) -> list[float]:
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in (5, 12, 7, 9, 4, 11, 6, 10)]
    args = trl.SFTConfig(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=_tokenizer())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow  # two SFTTrainer runs: over 20 s on a 2-core CPU
def test_sft_trainer_runs_one_fused_head_and_says_whose(tmp_path):
    stock = tiny_model("llama")
    want = _sft_losses(copy.deepcopy(stock), str(tmp_path / "stock"))
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    got = _sft_losses(mine, str(tmp_path / "kernelgraft"))
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)
    rep = mine.kernelgraft_report
    counts = rep.counts(graph="training")
    assert "lm_head_ce" not in counts
    assert {k: counts.get(k) for k in ("rms_norm", "rope", "gated_mlp")} == {"rms_norm": 5, "rope": 4, "gated_mlp": 2}
    (note,) = rep.notes
    assert "TRL's fused LM head" in note and "one fused head runs, theirs" in note
    assert note in " ".join(str(rep).split())  # printed, wrapped at 120 columns
