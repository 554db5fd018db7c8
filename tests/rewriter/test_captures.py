"""Each kind of graph a model is captured as (a training step, an evaluation forward, generate()'s
decoding) is reported on its own, and a capture of one kind never changes what another kind's
graphs report or return: a Trainer that evaluates every few steps and generates in a callback keeps
the fused LM head in its training steps, and gets real logits, those of the stock model, in evaluation."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import batch, tiny_model
from trainer_helpers import collate, examples

import kernelgraft
from kernelgraft.gradcheck import judge
from kernelgraft.kernels.lm_head import WithheldLogits

FULL = {"rms_norm": 5, "lm_head_ce": 1, "rope": 4, "gated_mlp": 2}  # a 2-layer tiny Llama


# inductor's compiles of three kinds of graph take over 20 s on a 2-core CPU: `make test-slow`
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_evaluation_and_generate_leave_training_graphs_alone(backend):
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    b = batch()
    out = mine(**b)
    out.loss.backward()
    assert isinstance(out.logits, WithheldLogits)
    with torch.no_grad():
        evaluated = mine(**b)
    mine.generate(b["input_ids"][:1, :6], max_new_tokens=3, do_sample=False)
    after = mine(**b)
    assert isinstance(after.logits, WithheldLogits), type(after.logits)
    with pytest.raises(RuntimeError, match="never computed"):
        after.logits.sum()
    rep = mine.kernelgraft_report
    assert rep.captures() == ["training", "evaluation", "decoding"]
    assert rep.counts() == FULL and rep.counts(graph="training") == FULL, str(rep)
    assert "lm_head_ce" not in rep.counts(graph="evaluation")
    assert "lm_head_ce" not in rep.counts(graph="decoding")
    assert set(rep.by_graph()) == {"training", "evaluation", "decoding"}
    assert rep.by_graph()["training"].counts() == FULL
    assert all(s.capture in ("training", "evaluation", "decoding") for s in rep.sites + rep.fallbacks)
    text = str(rep)
    assert all(f"{kind} graphs:" in text for kind in ("training", "evaluation", "decoding")), text
    assert max(len(line) for line in text.splitlines()) <= 120, text
    # evaluation's logits are real, and those of the stock model by the rule
    truth = copy.deepcopy(stock).double()
    with torch.no_grad():
        want, true = stock(**b).logits, truth(**b).logits
    verdict = judge("evaluation logits", true, evaluated.logits.double(), want.double())
    assert verdict.ok, str(verdict)


def test_a_kind_that_recompiles_counts_what_its_latest_call_ran():
    """A recapture of one kind (a new sequence length without dynamic shapes) adds an entry beside
    the first, as dynamo does: counts describe the latest call (they do not double), and the other
    kinds' records stay. Captured whole: one graph per kind and call, a site record per site."""
    mine = kernelgraft.optimize(tiny_model("llama"), backend="eager", dynamic=False, capture="whole")
    for S in (12, 10):
        b = batch(S=S)
        mine(**b).loss.backward()
        with torch.no_grad():
            mine(**b)
    rep = mine.kernelgraft_report
    assert rep.counts(graph="training") == FULL, str(rep)
    assert rep.graphs_by["training"] == 2 and rep.graphs_by["evaluation"] == 2
    assert len(rep.of("training").sites) == sum(FULL.values())
    assert len([s for s in rep.sites if s.capture == "training"]) == 2 * sum(FULL.values())
    # output_hidden_states=True is another capture of the same frame: the counts do not double
    mine(**batch(S=10), output_hidden_states=True).loss.backward()
    assert rep.counts(graph="training") == FULL and rep.counts() == FULL, str(rep)


def test_an_unknown_kind_of_graph_is_refused():
    rep = kernelgraft.optimize(tiny_model("llama"), backend="eager").kernelgraft_report
    with pytest.raises(ValueError, match="the kinds are training, evaluation, decoding"):
        rep.counts(graph="train")


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_trainer_evaluating_and_generating_keeps_the_fused_head(tmp_path, backend):
    """Trainer: evaluation every 2 steps and a generate() in a callback after each. Every training
    step keeps lm_head_ce in the training graphs' report and returns WithheldLogits; every
    evaluation batch's logits are real and pass the rule against the stock model with the same
    weights at that point."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    seen = {"train": [], "eval": [], "generated": 0}

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kw)
            if model.training and torch.is_grad_enabled():
                rep = model.kernelgraft_report
                seen["train"].append((type(outputs.logits), rep.counts(graph="training"), rep.counts()))
            return (loss, outputs) if return_outputs else loss

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            loss, logits, labels = super().prediction_step(model, inputs, False, ignore_keys)
            ref = copy.deepcopy(stock)
            ref.load_state_dict(model.state_dict())
            with torch.no_grad():
                want = ref(**inputs).logits
                true = copy.deepcopy(ref).double()(**inputs).logits
            seen["eval"].append((type(logits), judge("eval logits", true, logits.double(), want.double())))
            return loss, logits, labels

    class Generating(TrainerCallback):
        def on_evaluate(self, args, state, control, model=None, **kw):
            ids = batch()["input_ids"][:1, :6]
            model.generate(ids, max_new_tokens=3, do_sample=False)
            seen["generated"] += 1

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Recording(
        model=mine,
        args=args,
        train_dataset=examples(),
        eval_dataset=examples(seed=1),
        data_collator=collate,
        callbacks=[Generating()],
    )
    trainer.train()
    assert len(seen["train"]) == 6 and seen["generated"] == 3 and len(seen["eval"]) == 6
    for kind, training_counts, counts in seen["train"]:
        assert kind is WithheldLogits
        # with padding, the attention rewrites (sdpa, gqa) are counted too
        assert {k: training_counts.get(k) for k in FULL} == FULL and counts == training_counts
    for kind, verdict in seen["eval"]:
        assert kind is torch.Tensor and verdict.ok, str(verdict)
    assert mine.kernelgraft_report.captures() == ["training", "evaluation", "decoding"]
