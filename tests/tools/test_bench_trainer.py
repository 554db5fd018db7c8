"""benchmarks/bench_trainer.py on the CPU (--cpu-smoke: a tiny Llama in float32 under the Trainer's bf16
autocast, kernelgraft's eager backend): every mode's row, the modes in turns, kernelgraft's fused LM
head served under the Trainer's mixed precision and TRL's in SFTTrainer, the accuracy table, the JSON
and the Markdown (the GPU figures come from the GPU run)."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_trainer  # noqa: E402

B, S = 2, 32  # --cpu-smoke's rows per step and tokens per row
SERVED = {"rms_norm": 5, "rope": 4, "gated_mlp": 2}  # the tiny 2-layer Llama's sites besides the head


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def _timed_row(row, rounds):
    """Fails unless `row` is a measured mode: positive tokens/s from its median step, one time per step
    of `rounds` rounds of one step, a first step, a loss logged at every step (2 warm-up + rounds)."""
    assert "error" not in row, row
    assert row["tok_s"] > 0 and row["first_step_s"] > 0
    assert len(row["times_ms"]) == len(row["rounds_s"]) == rounds
    assert row["step_ms"] == pytest.approx(_median(row["times_ms"]), abs=0.01)
    assert row["tok_s"] == pytest.approx(B * S / (row["step_ms"] / 1e3), rel=1e-3)
    assert len(row["losses"]) == 2 + rounds


def _same_training(row, stock):
    """The same weights, batches and order: each logged loss is stock's to bf16 autocast's rounding."""
    for got, want in zip(row["losses"], stock["losses"], strict=True):
        assert abs(got - want) <= 1e-3 * abs(want), (row["losses"], stock["losses"])


@pytest.mark.slow  # every mode's Trainer and SFTTrainer and the accuracy part: about 30 s on a 2-core CPU
def test_cpu_smoke_measures_every_mode_in_turns_and_writes_json_and_markdown(tmp_path):
    rounds = 3
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_trainer.py"), "--cpu-smoke", "--rounds", str(rounds),
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp_path / "trainer.json").read_text())
    md = (tmp_path / "trainer.md").read_text()
    assert doc["gpu"] == "cpu" and doc["versions"]["torch"] == torch.__version__ and doc["date"]
    liger, trl = bench_trainer.importable("liger_kernel"), bench_trainer.importable("trl")

    # Trainer(bf16=True): a row per mode, Liger last in every warm-up and rotated through the rounds
    part = doc["trainer"]
    assert part["args"]["B"] == B and part["args"]["S"] == S and part["args"]["rounds"] == rounds
    assert list(part["modes"]) == ["stock", "liger", "kernelgraft"]
    order = ["stock", "kernelgraft"] + ["liger"] * liger
    rotated = [m for r in range(rounds) for m in order[r % len(order) :] + order[: r % len(order)]]
    assert part["ran"] == order + rotated
    stock, mine = part["modes"]["stock"], part["modes"]["kernelgraft"]
    for row in (stock, mine) + ((part["modes"]["liger"],) if liger else ()):
        _timed_row(row, rounds)
    if not liger:
        assert part["modes"]["liger"] == {"skipped": "liger_kernel not installed"}
    _same_training(mine, stock)
    # the fused head served under the Trainer's autocast: float32 weights, made bf16 on their way into it
    assert mine["sites"]["lm_head_ce"] == 1 and {k: mine["sites"][k] for k in SERVED} == SERVED
    (head,) = mine["lm_head"]
    assert (
        part["args"]["weights"] == "float32" and head["dtypes"]["h"] == head["dtypes"]["weight"] == "bfloat16"
    )
    ratio = part["ratios"]["kernelgraft / stock"]
    assert ratio["tok_s"] == pytest.approx(mine["tok_s"] / stock["tok_s"])
    assert ratio["step_time"]["low"] <= ratio["step_time"]["median"] <= ratio["step_time"]["high"]
    assert ratio["device_time"] is None  # no profiler off CUDA

    # SFTTrainer: TRL's fused head runs in both modes; kernelgraft serves the rest and says so
    if trl:
        part = doc["sft"]
        assert list(part["modes"]) == ["stock", "kernelgraft"]
        stock, mine = part["modes"]["stock"], part["modes"]["kernelgraft"]
        _timed_row(stock, rounds)
        _timed_row(mine, rounds)
        _same_training(mine, stock)
        assert "lm_head_ce" not in mine["sites"] and {k: mine["sites"][k] for k in SERVED} == SERVED
        assert any("TRL's fused LM head" in n for n in mine["notes"]), mine["notes"]
    else:
        assert doc["sft"]["skipped"] == "trl not installed"

    # accuracy: each head's error against float64 truth, kernelgraft's within the rule
    acc = doc["accuracy"]
    assert acc["kernelgraft_sites"]["lm_head_ce"] == 1
    assert set(acc["errors"]) == {"loss", "grad lm_head.weight", "grad model.norm.weight"}
    for q, row in acc["errors"].items():
        assert 0 < row["eager"] < 0.1 and row["kernelgraft_ok"], (q, row)
        assert row["bound"] == pytest.approx(1.1 * row["eager"] + 4 * torch.finfo(torch.float32).eps)
        assert (0 < row["trl"] < 0.1) if trl else "trl" not in row, (q, row)
    assert acc["trl"] == ("measured" if trl else "trl not installed")

    # the Markdown: every mode's row in each table, the ratios, the accuracy table
    trainer_md, _, rest = md.partition("**TRL SFTTrainer(bf16=True)**")
    assert "**Hugging Face Trainer(bf16=True)**" in trainer_md
    for m in ("stock", "liger", "kernelgraft"):
        assert f"\n| {m} | " in trainer_md, m
    assert ("| liger | liger_kernel not installed |" in trainer_md) != liger
    assert "- kernelgraft / stock: tokens/s " in trainer_md
    if trl:
        assert "\n| stock | " in rest and "\n| kernelgraft | " in rest
    assert "**Accuracy of the fused LM heads**" in md and "\n| loss | " in md
    assert md.strip() in run.stdout  # printed at the end


def test_baton_runs_the_queue_in_order_and_skips_the_turns_of_a_holder_that_left():
    """Two workers and the coordinating thread: b leaves after its first turn (a failure), so its second
    turn is skipped and the baton comes back to "main"; each holder enters its globals on its turn."""
    queue = [("main", 0), ("a", 1), ("b", 1), ("a", 1), ("b", 1), ("main", 0)]
    entered, ran = [], []
    baton = bench_trainer.Baton(queue, entered.append)

    def worker(me, turns):
        baton.wait(me)
        for k in range(turns):
            ran.append(me)
            if k < turns - 1:
                baton.pass_on()
                baton.wait(me)
        baton.leave(me)

    baton.wait("main")
    threads = [threading.Thread(target=worker, args=a, daemon=True) for a in (("a", 2), ("b", 1))]
    for t in threads:
        t.start()
    baton.pass_on()
    baton.wait("main")
    for t in threads:
        t.join(timeout=10)
    assert ran == ["a", "b", "a"] and baton.ran == ["main", "a", "b", "a"]
    assert entered == ["main", "a", "b", "a", "main"] and baton.holder() == "main"


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--parts", "trainer,bogus"], "--parts 'trainer,bogus': name some of trainer, sft, accuracy"),
        (["--cpu-smoke", "--rounds", "0"], "--rounds is 0: give 1 or more"),
        (["--cpu-smoke", "--per-turn", "-2"], "--per-turn is -2: give 1 or more"),
        ([], "needs a CUDA GPU (the figures are GPU timings); without one, the smoke test: --cpu-smoke"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(argv, said, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    with pytest.raises(SystemExit) as e:
        bench_trainer.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].endswith(said), err
