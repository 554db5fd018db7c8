"""Hugging Face Trainer and TRL SFTTrainer steps with and without kernelgraft; whose LM head is more accurate.
The Llama-3.2-1B shape (suite.SHAPES), random weights, bf16, 8 x 2048 tokens per step (`--batch`,
`--seq`), the Trainer's default AdamW, the model's default use_cache. Parts:
  trainer   Trainer(bf16=True): `stock`; `liger` (use_liger_kernel=True, where liger_kernel imports);
            `kernelgraft` (kernelgraft.optimize(model), then the same Trainer)
  sft       SFTTrainer (where trl imports): `stock` (TRL's own fused LM head); `kernelgraft` (it
            serves the rest of the model and TRL's head runs, as its report says)
  accuracy  4 layers (`--accuracy-layers`), untied head, 2 x 1024: the loss and the gradients of the
            head's and the final norm's weights under bf16 autocast, against float64 truth, of the
            fused heads alone, the rest of the model eager in each (TRL's: add_fused_lm_head, then
            model(..., fused_lm_head=True); kernelgraft's: optimize(patterns=["lm_head_ce"],
            backend="eager", causal_attention=False)), beside the unfused model's error (gradcheck.judge: ok at most 1.1x
            it + 4 eps); and the kernelgraft model as the benchmark runs it (every site served, the
            benchmark's backend), beside eager and, under inductor, the stock model under torch.compile
Each mode runs one `train()` in a thread of its own, and the threads take turns (Baton), the others
waiting between two steps with their trainers resident: `--warmup` steps per mode (the first timed
apart: it compiles), `--rounds` rounds of `--per-turn` steps per mode, the order rotated each round so
that a card's clock drift falls on all alike, then `--profile-steps` per mode under torch.profiler;
Liger's reassigned transformers globals only in its turns. A step, from the Trainer's on_step_begin to
its on_step_end (forward, backward, clipping, optimizer step, zero_grad), is timed by a TrainerCallback
that synchronizes the device at both ends (the only synchronizations added). Per mode: tokens/s by
wall time (the median timed step), device ms per step (the CUDA kernels' time, profiler), the peak
memory above the step's start, the first step's seconds, the logged losses, kernelgraft's
counts(graph="training") (`lm_head_ce` there: its fused head ran under the Trainer's mixed precision)
and notes; kernelgraft over stock and over Liger by tokens/s, step time paired by round and device
time. DIR/trainer.json (date, host, GPU, versions, commit; an earlier file's other parts kept unless
`--fresh`) and trainer.md are rewritten after every round. One GPU visible, else DataParallel runs.

    python benchmarks/bench_trainer.py --out benchmarks/out/trainer    # on the GPU (--parts: one each);
        # published as benchmarks/results/trainer/<date>-trainer.json for benchmarks/results_md.py
    python benchmarks/bench_trainer.py --out DIR --quick                   # 2 layers, 2 x 512, 2 rounds
    python benchmarks/bench_trainer.py --out DIR --cpu-smoke               # no GPU: a tiny Llama in
        float32 under the Trainer's bf16 autocast, the eager backend, Triton's interpreter
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import sys
import tempfile
import threading
import time
import traceback

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # SFTTrainer's; read as datasets is imported
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, PrinterCallback, Trainer, TrainerCallback  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib as bl  # noqa: E402

PARTS = ("trainer", "sft", "accuracy")
MODES = {"trainer": ("stock", "liger", "kernelgraft"), "sft": ("stock", "kernelgraft")}
NEEDS = {"liger": "liger_kernel", "sft": "trl"}  # the module a mode or a part needs
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True)  # fmt: skip
GRADS = ("lm_head.weight", "model.norm.weight")  # the accuracy part's gradients, beside the loss


def importable(module: str) -> bool:
    try:
        return bool(__import__(module))
    except Exception:  # noqa: BLE001 - a peer that fails to import is not installed for this run
        return False


# what the results file says of the run: the versions of what is measured
DISTS = ("torch", "triton", "transformers", "accelerate", "trl", "liger-kernel", "kernelgraft")


def build_model(spec, layers=None, tie=None, seq=None):
    kw = dict(spec.cfg, num_hidden_layers=layers or spec.layers)
    kw.update({} if tie is None else {"tie_word_embeddings": tie})
    cfg = AutoConfig.for_model("llama", max_position_embeddings=2 * (seq or spec.S), **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)  # every mode starts from the same weights
    with spec.device:
        return AutoModelForCausalLM.from_config(cfg).to(spec.dtype)


def token_rows(spec, n: int, S: int) -> torch.Tensor:
    return torch.randint(0, spec.cfg["vocab_size"], (n, S), generator=torch.Generator().manual_seed(0))


def builder(part, mode, spec):
    """build(max_steps, clock) -> (model, trainer): `part`'s trainer of `mode`, `clock` its callback; gradient
    checkpointing by the name this transformers reads (TRL's configs default it on)."""

    def build(max_steps, clock):
        import kernelgraft

        model = build_model(spec)
        if mode == "kernelgraft":
            kernelgraft.optimize(model, backend=spec.backend)
        ids = token_rows(spec, spec.B * max_steps, spec.S)
        if part == "sft":
            import trl
            from datasets import Dataset
            from tokenizers import Tokenizer, models, pre_tokenizers

            cls, make, rows = trl.SFTConfig, trl.SFTTrainer, Dataset.from_dict({"input_ids": ids.tolist()})
            extra = dict(max_length=spec.S, packing=False)
            # a word-level tokenizer over the model's vocabulary, built in code: SFTTrainer needs one
            tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(spec.cfg["vocab_size"])}, unk_token="t3"))
            tok.pre_tokenizer = pre_tokenizers.Whitespace()
            special = dict(pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")
            kw = dict(processing_class=transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special))
        else:
            cls, make, rows = transformers.TrainingArguments, Trainer, [{"input_ids": r} for r in ids]
            collate = lambda rows: {"input_ids": (x := torch.stack([r["input_ids"] for r in rows])), "labels": x}
            extra, kw = dict(use_liger_kernel=mode == "liger"), dict(data_collator=collate)
        fields = {f.name for f in dataclasses.fields(cls)}
        ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
        args = cls(
            output_dir=spec.scratch, per_device_train_batch_size=spec.B, gradient_accumulation_steps=1,
            max_steps=max_steps, bf16=True, use_cpu=spec.device.type == "cpu", logging_steps=1, report_to=[],
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
            **{ckpt: spec.checkpointing}, **extra,
        )  # fmt: skip
        trainer = make(model=model, args=args, train_dataset=rows, callbacks=[clock], **kw)
        trainer.remove_callback(PrinterCallback)  # the losses are kept by StepClock.on_log
        return model, trainer

    return build


class Baton:
    """Whose turn it is: a queue of (holder, steps), "main" being the coordinating thread's turns; a
    holder that left (done or failed) has its later turns skipped. `ran`: the holders, as they ran."""

    def __init__(self, queue, enter):
        self.queue, self.enter, self.i, self.gone, self.ran = queue, enter, 0, set(), []
        self.cond = threading.Condition()  # its lock is reentrant: leave() passes on while holding it

    def holder(self):  # None once the queue is done
        return self.queue[self.i][0] if self.i < len(self.queue) else None

    def wait(self, me):
        """Until it is `me`'s turn; then the globals `me` was built with (enter)."""
        with self.cond:
            self.cond.wait_for(lambda: self.holder() in (me, None))
        self.enter(me)

    def pass_on(self):
        with self.cond:
            self.ran.append(self.holder())
            self.i += 1
            while self.holder() in self.gone:
                self.i += 1
            self.cond.notify_all()

    def leave(self, me):
        with self.cond:
            self.gone.add(me)
            if self.holder() == me:
                self.pass_on()


class StepClock(TrainerCallback):
    """One mode's callback: times each step between device synchronizations at on_step_begin and on_step_end,
    with the peak memory above the step's start; on CUDA profiles turn `profiled` (a failing profiler is
    said in `device_error`); keeps the logged losses; hands the baton on after each turn but the last."""

    def __init__(self, mode, baton, turns, profiled, cuda):
        self.mode, self.baton, self.turns, self.profiled, self.cuda = mode, baton, turns, profiled, cuda
        self.turn = self.in_turn = 0
        self.steps, self.losses, self.kernels, self.prof, self.device_error = [], [], None, None, None

    def on_step_begin(self, args, state, control, **kw):
        if not self.steps:
            self.baton.wait(self.mode)
        if self.cuda:
            torch.cuda.synchronize()
            if self.turn == self.profiled and self.in_turn == 0:
                try:
                    self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    self.prof.start()
                except Exception as e:  # noqa: BLE001 - a diagnostic column: said, not fatal
                    self.prof, self.device_error = None, f"{type(e).__name__}: {e}"[:200]
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.t
        peak = torch.cuda.max_memory_allocated() - self.base if self.cuda else None
        self.steps.append(dict(turn=self.turn, s=seconds, peak=peak))
        self.in_turn += 1
        if self.in_turn < self.turns[self.turn]:
            return
        if self.prof is not None:
            try:
                self.prof.stop()
                got = bl.cuda_kernels(self.prof, self.in_turn)
                self.kernels = [dict(ms=ms, count=c, kernel=k[:100]) for ms, c, k in got]
            except Exception as e:  # noqa: BLE001 - as at the start
                self.device_error = f"{type(e).__name__}: {e}"[:200]
            self.prof = None
        self.turn, self.in_turn = self.turn + 1, 0
        if self.turn < len(self.turns):  # after its last turn train() returns, and the thread leaves
            self.baton.pass_on()
            self.baton.wait(self.mode)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(round(float(logs["loss"]), 5))


def row_of(spec, clock, model, error) -> dict:
    row = dict({"error": error} if error else {}, losses=clock.losses)
    row.update(first_step_s=clock.steps[0]["s"]) if clock.steps else None
    timed = [s for s in clock.steps if 0 < s["turn"] <= spec.rounds]
    if timed:
        ts = [s["s"] for s in timed]
        med = sorted(ts)[len(ts) // 2]
        turns = [sorted(s["s"] for s in timed if s["turn"] == t) for t in sorted({s["turn"] for s in timed})]
        peak = max(s["peak"] for s in timed) / 2**30 if spec.device.type == "cuda" else None
        row.update(tok_s=spec.B * spec.S / med, step_ms=med * 1e3, times_ms=[round(t * 1e3, 2) for t in ts])
        row.update(rounds_s=[t[len(t) // 2] for t in turns], peak_above_start_gib=peak)
    if clock.kernels is not None:
        row.update(device_ms=sum(k["ms"] for k in clock.kernels), kernels=clock.kernels[:8])
    row.update({"device_error": clock.device_error} if clock.device_error else {})
    rep = getattr(model, "kernelgraft_report", None)
    if rep is not None:
        row.update(sites=rep.counts(graph="training"), notes=list(rep.notes), stock_runs=len(rep.stock_runs))
        row["lm_head"] = [dict(spelling=s.spelling, dtypes=s.dtypes) for s in rep.sites if s.pattern == "lm_head_ce"]
    return row


def run_in_turns(builders: dict, spec, save) -> dict:
    """{mode: build(max_steps, clock) -> (model, trainer)} in turns -> {mode: row}, and "_ran": the
    modes in the order their turns ran. save(rows) after each mode's first turn and each round."""
    order, _ = bl.turn_order(list(builders))
    n, R, P, K = len(order), spec.rounds, spec.profile, spec.per_turn
    turns = [spec.warmup] + [K] * R + [P] * bool(P)
    queue = [("main", 0)] + [t for m in order for t in ((m, spec.warmup), ("main", 0))]
    for r in range(R):
        queue += [(m, K) for m in order[r % n :] + order[: r % n]] + [("main", 0)]
    queue += [(m, P) for m in order if P] + [("main", 0)] * bool(P)
    patched, clocks, models, errors, threads = {}, {}, {}, {}, []

    def enter(mode):
        for m, changes in list(patched.items()):
            bl.set_globals(changes, 1 if m == mode else 0)

    baton = Baton(queue, enter)

    def failed(mode, e):
        traceback.print_exc()
        errors[mode] = f"{type(e).__name__}: {e}"[:300]

    def work(mode, trainer):
        try:
            trainer.train()
        except Exception as e:  # noqa: BLE001 - a failing mode is its row's error; the others go on
            failed(mode, e)
        finally:
            baton.leave(mode)

    def rows():
        return {m: row_of(spec, clocks[m], models.get(m), errors.get(m)) for m in order if m in clocks}

    baton.wait("main")
    for m in order:
        before = bl.module_globals()
        clocks[m] = StepClock(m, baton, turns, R + 1 if P else None, spec.device.type == "cuda")
        try:
            models[m], trainer = builders[m](sum(turns), clocks[m])
        except Exception as e:  # noqa: BLE001 - as in work()
            failed(m, e)
            baton.gone.add(m)
        else:
            threads.append(threading.Thread(target=work, args=(m, trainer), name=f"bench {m}", daemon=True))
            threads[-1].start()
            del trainer
        baton.pass_on()
        baton.wait("main")
        patched[m] = bl.changed_globals(before, bl.module_globals())
        save(rows())
    while baton.i < len(queue) - 1:
        baton.pass_on()
        baton.wait("main")
        save(rows())
    for t in threads:
        t.join()
    out = dict(rows(), _ran=[h for h in baton.ran if h != "main"])
    models.clear()
    gc.collect()
    torch.cuda.empty_cache()  # nothing where CUDA was never initialized
    return out


def measure_part(part, spec, save, doc: dict) -> None:
    """One part's modes in turns, into doc: "modes" {mode: row}, "ratios", "ran" (turns' order), "notes"."""
    skipped = {m: f"{NEEDS[m]} not installed" for m in MODES[part] if m in NEEDS and not importable(NEEDS[m])}
    run = [m for m in MODES[part] if m not in skipped]
    doc["notes"] = []

    def partial(rows):
        doc["modes"] = {m: {"skipped": skipped[m]} if m in skipped else rows.get(m, {}) for m in MODES[part]}
        save()

    got = run_in_turns({m: builder(part, m, spec) for m in run}, spec, partial)
    doc["ran"] = got.pop("_ran")
    oom = [m for m, r in got.items() if "OutOfMemoryError" in r.get("error", "")]
    if oom and len(run) > 1:
        doc["notes"].append(f"{', '.join(oom)}: out of memory with the other modes' trainers resident")
    partial(got)
    doc["ratios"], mine = {}, doc["modes"]["kernelgraft"]
    for ref, other in ((r, doc["modes"].get(r, {})) for r in ("stock", "liger")):
        if "tok_s" in mine and "tok_s" in other:  # timed rounds, in turns
            n = min(len(mine["rounds_s"]), len(other["rounds_s"]))
            paired = bl.paired_ratios({"kernelgraft": mine["rounds_s"][:n], ref: other["rounds_s"][:n]}, ref)
            device = mine["device_ms"] / other["device_ms"] if "device_ms" in mine and "device_ms" in other else None
            doc["ratios"][f"kernelgraft / {ref}"] = dict(tok_s=mine["tok_s"] / other["tok_s"], step_time=paired["kernelgraft"], device_time=device)  # fmt: skip


def accuracy(spec) -> dict:
    """The loss and GRADS under bf16 autocast (the Trainer's bf16=True) against float64 truth: the
    unfused model, TRL's fused head and kernelgraft's, each head alone in an otherwise eager model
    (so that only the head differs), judged beside the unfused one; and the kernelgraft model as the
    benchmark runs it, judged beside eager and the stock model under torch.compile (the inductor
    backend compiles the code between the sites as torch.compile does)."""
    import kernelgraft
    from kernelgraft.gradcheck import Float64Everywhere, judge

    base = build_model(spec, layers=spec.acc_layers, tie=False, seq=spec.acc_S)  # untied: the head's own grad
    ids = token_rows(spec, spec.acc_B, spec.acc_S).to(spec.device)

    def run(model, truth=False, **kw):
        model.zero_grad(set_to_none=True)
        with Float64Everywhere() if truth else torch.autocast(spec.device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, **kw).loss
        loss.backward()
        got = {"loss": loss.detach().double().cpu().reshape(1)}
        got.update({f"grad {k}": p.grad.detach().cpu() for k, p in model.named_parameters() if k in GRADS})
        del model, loss  # the loss's graph holds the parameters
        gc.collect()
        torch.cuda.empty_cache()
        return got

    truth = run(copy.deepcopy(base).double(), truth=True)
    out = {"shape": f"{spec.acc_layers} layers, {spec.acc_B} x {spec.acc_S}", "errors": {}}
    heads, have = {}, importable("trl")
    if add_fused_lm_head := have and getattr(__import__("trl.trainer.utils").trainer.utils, "add_fused_lm_head", None):
        add_fused_lm_head(m := copy.deepcopy(base))
        heads["trl"] = run(m, fused_lm_head=True)
    out["trl"] = "measured" if heads else "this trl has no add_fused_lm_head" if have else "trl not installed"
    # the head alone: attention keeps its mask as the eager model does (no causal rewrite)
    m = kernelgraft.optimize(copy.deepcopy(base), backend="eager", patterns=["lm_head_ce"], causal_attention=False)
    heads["kernelgraft"] = run(m)
    out["kernelgraft_sites"] = m.kernelgraft_report.counts(graph="training")
    m = kernelgraft.optimize(copy.deepcopy(base), backend=spec.backend)
    whole = run(m)
    out["model_sites"] = m.kernelgraft_report.counts(graph="training")
    compiled = None
    if spec.backend == "inductor":
        (m := copy.deepcopy(base)).compile(backend="inductor")
        compiled = run(m)
    del m
    eager = run(base)
    for q in truth:
        row = out["errors"][q] = {}
        for who, got in heads.items():
            v = judge(q, truth[q], got[q], eager[q])
            row.update({"eager": v.eager, "bound": v.bound, who: v.kernelgraft, f"{who}_ok": v.ok})
        v = judge(q, truth[q], whole[q], eager[q], None if compiled is None else compiled[q])
        row.update(model=v.kernelgraft, model_ok=v.ok, model_bound=v.bound)
        row.update({} if compiled is None else {"compile": v.compile})
    return out


TITLES = {"trainer": "Hugging Face Trainer(bf16=True)", "sft": "TRL SFTTrainer(bf16=True)"}
HEAD = ("| mode | tokens/s | step ms (median) | device ms per step | GiB above the step's start | first step s "
        "| loss (first, last) | kernelgraft's sites (training graph) |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
_num = lambda v, fmt: "-" if v is None else format(v, fmt)


def markdown(doc) -> str:
    L = []
    for part in ("trainer", "sft", "accuracy"):
        d, title = doc.get(part), TITLES.get(part, "Accuracy of the fused LM heads")
        if d is None or "modes" not in d and "errors" not in d:
            L += [f"**{title}**: {d.get('skipped') or d.get('error')}", ""] if d else []
            continue
        a, run = d["args"], d["run"]
        if part == "accuracy":
            L += [f"**{title}**, {d['shape']} of the {a['shape']}, untied head, {a['weights']} weights under bf16 "
                  f"autocast; error ||x - truth|| / ||truth|| against float64. Each fused head alone, the rest of "
                  f"the model eager (TRL: {d['trl']}; kernelgraft's sites: {d['kernelgraft_sites']}); then the "
                  f"kernelgraft model on the {a['backend']} backend ({d.get('model_sites')}), judged beside eager "
                  f"and torch.compile ({run['date']}, {run['gpu']}):", "",
                  "| quantity | unfused (eager) | TRL's fused head | kernelgraft's fused head | bound (1.1x eager "
                  "+ 4 eps) | kernelgraft model | torch.compile | its bound |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
            for q, r in d["errors"].items():
                pairs = (("trl", "trl_ok"), ("kernelgraft", "kernelgraft_ok"), ("model", "model_ok"))
                cell = {w: f"{r[w]:.3g} ({'ok' if r[ok] else 'over'})" if w in r else "-" for w, ok in pairs}
                L += [f"| {q} | {r['eager']:.3g} | {cell['trl']} | {cell['kernelgraft']} | {r['bound']:.3g} "
                      f"| {cell['model']} | {_num(r.get('compile'), '.3g')} | {_num(r.get('model_bound'), '.3g')} |"]  # fmt: skip
            L += [""]
            continue
        L += [f"**{title}**, {a['shape']}, {a['weights']} weights, {a['B']} x {a['S']} tokens per step, AdamW, "
              f"gradient checkpointing {'on' if a['checkpointing'] else 'off'}; the modes in turns, {a['rounds']} "
              f"rounds of {a['per_turn']} steps after {a['warmup']} (the first timed apart), then {a['profile']} "
              f"profiled ({run['date']}, {run['gpu']}, commit {run['commit']}):", "", HEAD]  # fmt: skip
        for m, r in d["modes"].items():
            if "tok_s" not in r:
                why = r.get("skipped") or ("error: " + r["error"][:160] if "error" in r else "not measured")
                L.append(f"| {m} | {why} |" + " |" * 6)
                continue
            sites = ", ".join(f"{k} {v}" for k, v in r.get("sites", {}).items()) or "-"
            loss = f"{r['losses'][0]:.4f}, {r['losses'][-1]:.4f}" if r["losses"] else "-"
            L.append(f"| {m} | {r['tok_s']:,.0f} | {r['step_ms']:.1f} "
                     f"| {_num(r.get('device_ms'), '.1f')} | {_num(r.get('peak_above_start_gib'), '.2f')} "
                     f"| {_num(r.get('first_step_s'), '.1f')} | {loss} | {sites} |")  # fmt: skip
        L.append("")
        for name, q in d.get("ratios", {}).items():
            st = q["step_time"]  # the median of the rounds' ratios, and their range
            L.append(f"- {name}: tokens/s {q['tok_s']:.3f}x; step time, paired by round, {st['median']:.3f} "
                     f"({st['low']:.3f}-{st['high']:.3f}); "
                     f"device time {_num(q['device_time'], '.3f')}")  # fmt: skip
        L += [f"- kernelgraft's report: {n}" for r in d["modes"].values() for n in r.get("notes", [])]
        L += [f"- {n}" for n in d.get("notes", [])] + [""]
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arg = ap.add_argument
    arg("--out", default=os.environ.get("OUT", "benchmarks/out"), help="where trainer.json and .md go")
    arg("--parts", default=",".join(PARTS), help="any of: %(default)s (default: all)")
    arg("--cpu-smoke", action="store_true", help="no GPU: a tiny Llama on the CPU, float32, eager backend")
    arg("--quick", action="store_true", help="2 layers of the shape, 2 x 512, 2 rounds, accuracy at 1 x 512")
    arg("--batch", type=int, help="rows per step (default 8; --quick, --cpu-smoke 2)")
    arg("--seq", type=int, help="tokens per row (default 2048; --quick 512; --cpu-smoke 32)")
    arg("--rounds", type=int, help="rounds of turns (default 5; --quick, --cpu-smoke 2)")
    arg("--per-turn", type=int, help="steps per mode per round (default 2; --cpu-smoke 1)")
    arg("--warmup", type=int, default=2, help="steps per mode before the rounds, the first timed apart")
    arg("--profile-steps", type=int, help="steps per mode under the profiler (default 2; --quick 1; cpu 0)")
    arg("--checkpointing", action="store_true", help="Hugging Face gradient checkpointing on")
    arg("--accuracy-layers", type=int, help="layers of the accuracy part's model (default 4; --quick 2)")
    arg("--fresh", action="store_true", help="drop the parts of an earlier DIR/trainer.json")
    a = ap.parse_args(argv)
    parts, cpu = bl.names(a.parts), a.cpu_smoke
    if not parts or set(parts) - set(PARTS):
        ap.error(f"--parts {a.parts!r}: name some of {', '.join(PARTS)}")
    if not cpu and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the figures are GPU timings); without one, the smoke test: --cpu-smoke")
    if not cpu and torch.cuda.device_count() > 1:
        ap.error("several GPUs visible: Trainer would run DataParallel; make one visible (CUDA_VISIBLE_DEVICES=0)")
    pick = lambda given, *by_size: by_size[2 if cpu else 1 if a.quick else 0] if given is None else given
    from suite import SHAPES

    spec = argparse.Namespace(
        device=torch.device("cpu" if cpu else "cuda"), cfg=TINY if cpu else SHAPES["llama-1b 8x2048"]["cfg"],
        layers=pick(None, 16, 2, 2), B=pick(a.batch, 8, 2, 2), S=pick(a.seq, 2048, 512, 32),
        rounds=pick(a.rounds, 5, 2, 2), per_turn=pick(a.per_turn, 2, 2, 1), warmup=a.warmup,
        profile=0 if cpu else pick(a.profile_steps, 2, 1, 0), checkpointing=a.checkpointing,
        dtype=torch.float32 if cpu else torch.bfloat16, backend="eager" if cpu else "inductor",
        acc_layers=pick(a.accuracy_layers, 4, 2, 2), acc_B=pick(None, 2, 1, 2), acc_S=pick(None, 1024, 512, 32),
        scratch=tempfile.mkdtemp(prefix="bench_trainer_"),
    )  # fmt: skip
    for k in ("B", "S", "rounds", "per_turn", "warmup", "acc_layers", "profile"):
        if getattr(spec, k) < (k != "profile"):
            ap.error(f"--{k.replace('_', '-')} is {getattr(spec, k)}: give {int(k != 'profile')} or more")
    transformers.logging.set_verbosity_warning()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "trainer.json")
    doc = {} if a.fresh or not os.path.exists(path) else json.load(open(path))
    doc.update(run := bl.provenance(spec.device, DISTS))
    args = {k: getattr(spec, k) for k in ("B", "S", "backend", "rounds", "per_turn", "warmup", "profile", "checkpointing")}
    args.update(shape="tiny Llama" if cpu else f"Llama-3.2-1B shape ({spec.layers} layers)", weights=str(spec.dtype)[6:])

    def save():
        failed = bl.failed_kernels_note(doc)
        json.dump(doc, open(path, "w"), indent=1)
        open(os.path.join(a.out, "trainer.md"), "w").write(markdown(doc) + failed)

    for part in parts:
        doc[part] = {"run": run, "args": args}
        try:
            if part == "accuracy":
                doc[part].update(accuracy(spec))
            elif part in NEEDS and not importable(NEEDS[part]):
                doc[part]["skipped"] = f"{NEEDS[part]} not installed"
            else:
                measure_part(part, spec, save, doc[part])
        except Exception as e:  # noqa: BLE001 - a failing part is said; the next still runs
            traceback.print_exc()
            doc[part] = {"run": run, "args": args, "error": f"{type(e).__name__}: {e}"[:300]}
        save()
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
