"""benchmarks/bench_distributed.py on the CPU: torchrun process groups over gloo, the tiny Llama under
DDP at world size 1 and 2, eager beside kernelgraft (eager backend, Triton's interpreter). FSDP2's
gradients with an optimized model are checked by tests/models/test_distributed.py; each torchrun here costs
seconds of CI, so the smoke runs the one setup."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_distributed.py"
MODES = ("eager", "kernelgraft (eager)")
SETUPS = ("ddp-1b",)


@pytest.mark.slow
def test_cpu_smoke_run_measures_every_setup_size_and_mode(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu", "--tiny"]
    cmd += ["--setups", ",".join(SETUPS), "--world-sizes", "1,2", "--modes", ",".join(MODES), "--steps", "2"]
    cmd += ["--profile", "--bucket-mb", "1"]  # DDP's smallest allowed (its first bucket)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = json.loads((tmp_path / "distributed.json").read_text())["rows"]
    by = {(x["setup"], x["world_size"], x["mode"]): x for x in rows}
    assert set(by) == {(s, w, m) for s in SETUPS for w in (1, 2) for m in MODES}, r.stdout[-4000:]
    for key, x in by.items():
        assert not x.get("error"), (key, x.get("error"), r.stdout[-4000:])
        assert math.isfinite(x["tok_s_per_gpu"]) and x["tok_s_per_gpu"] > 0, key
        assert math.isfinite(x["first_step_s"]) and x["first_step_s"] > 0, key
        assert x["peak_gib_per_gpu"] is None, key  # no CUDA memory statistics on the CPU
        assert x["tokens_per_gpu"] == 2 * 16 and len(x["losses"]) == x["world_size"], key
        assert x["scaling_efficiency"] > 0, key
        # --profile: one more step under torch.profiler on rank 0; on the CPU no device events,
        # so no busy time and no gaps to charge (the GPU host's rows have them)
        pr = x["profile"]
        assert pr["wall_ms"] > 0 and pr["busy_ms"] == 0 and pr["gaps"] == 0 and pr["by_op"] == [], key
    for s in SETUPS:
        for w in (1, 2):
            # same seed, same batch per rank: the same loss, on every rank
            eager, mine = by[(s, w, "eager")]["losses"], by[(s, w, "kernelgraft (eager)")]["losses"]
            for a, b in zip(eager, mine):
                assert abs(a - b) <= 1e-5 * abs(a), (s, w, eager, mine)
            assert by[(s, w, "kernelgraft (eager)")]["sites"], "kernelgraft replaced nothing"
        two = by[(s, 2, "eager")]["losses"]
        assert two[0] != two[1], "each rank must run its own batch"
    md = (tmp_path / "distributed.md").read_text()
    assert "DDP buckets of 1 MB (bucket_cap_mb) in every mode." in md
    for m in MODES:
        assert f"| {m} |" in md
    assert "world size 2: fastest is" in md
    assert "one step profiled on rank 0:" in md


def test_more_ranks_than_gpus_is_refused_with_what_to_pass(tmp_path):
    # on a machine without the GPUs asked for: a message naming the count found and the fix
    import torch

    n = torch.cuda.device_count()
    want = n + 1
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--world-sizes", f"1,{want}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert f"found {n}" in r.stderr and "--world-sizes" in r.stderr, r.stderr
    assert not (tmp_path / "distributed.json").exists()


def test_mode_lists_split_outside_parentheses():
    # "--modes 'kernelgraft (inductor),kernelgraft (inductor, no recompute)'" is two modes, not a
    # third one " no recompute)", which would stop the run
    sys.path.insert(0, str(SCRIPT.parent))
    from benchlib import names

    assert names("kernelgraft (inductor),kernelgraft (inductor, no recompute), liger,") == [
        "kernelgraft (inductor)",
        "kernelgraft (inductor, no recompute)",
        "liger",
    ]
    assert names("") == []


def test_repeated_runs_take_turns_and_a_row_is_the_median_run(tmp_path, monkeypatch):
    # --repeat: the modes take turns (run 1 of each, then run 2 of each), so the host's drift between
    # runs falls on every mode alike; a row is the median run with every run's tok/s, and a mode whose
    # runs overlap the fastest one's is said not to be behind it
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_distributed as bd

    def run(mode, tok, turn):
        return dict(setup="ddp-1b", shape="s", wrapper="ddp", mode=mode, world_size=2, tok_s_per_gpu=tok,
                    step_s=1.0, first_step_s=1.0, loss=1.0, peak_gib_per_gpu=1.0, turn=turn)  # fmt: skip

    kg = [run("kernelgraft (inductor)", t, i) for i, t in enumerate((64000.0, 66000.0, 65000.0))]
    lg = [run("liger", t, i) for i, t in enumerate((65500.0, 64500.0, 65200.0))]
    row = bd.median_run(kg)
    assert (
        row["tok_s_per_gpu"] == 65000.0
        and row["turn"] == 2
        and row["tok_s_runs"] == [64000.0, 66000.0, 65000.0]
    )
    failed = dict(kg[0], tok_s_per_gpu=None, error="timeout")
    assert bd.median_run([failed, kg[1]])["tok_s_per_gpu"] == 66000.0  # a failed run is left out
    assert bd.median_run([failed])["error"] == "timeout"
    rows = [bd.median_run(kg), bd.median_run(lg)]
    bd.add_scaling(rows)
    doc = dict(rows=rows, date="d", steps=5, notes=[])
    md = bd.markdown(doc)
    assert "| 65,200 (64,500-65,500 over 3 runs) |" in md, md
    assert (
        "fastest is liger (65,200 tok/s per GPU), but its runs overlap those of kernelgraft (inductor)" in md
    )
    # apart: no overlap said
    lg_fast = [run("liger", t, i) for i, t in enumerate((67000.0, 68000.0, 67500.0))]
    rows = [bd.median_run(kg), bd.median_run(lg_fast)]
    bd.add_scaling(rows)
    assert "overlap" not in bd.markdown(dict(doc, rows=rows))
    # the order of the runs: turns, each turn every mode (launches recorded, not run)
    order = []
    speeds = iter([100.0, 200.0, 300.0, 400.0, 500.0, 600.0])

    def fake_launch(a, setup, world, mode, turn=0):
        order.append((mode, turn))
        return run(mode, next(speeds), turn) | dict(setup=setup, world_size=world, wall_s=1.0, log="log.txt")

    monkeypatch.setattr(bd, "launch", fake_launch)
    args = ["--out", str(tmp_path), "--device", "cpu", "--tiny", "--setups", "ddp-1b", "--world-sizes", "2"]
    assert bd.main(args + ["--modes", "eager,kernelgraft (eager)", "--repeat", "3"]) == 0
    assert order == [(m, t) for t in range(3) for m in ("eager", "kernelgraft (eager)")]
    rows = json.loads((tmp_path / "distributed.json").read_text())["rows"]
    assert {r["mode"]: r["tok_s_runs"] for r in rows} == {
        "eager": [100.0, 300.0, 500.0],
        "kernelgraft (eager)": [200.0, 400.0, 600.0],
    }
    with pytest.raises(SystemExit, match=r"--kv-cache runs DDP setups only; \['fsdp2-8b'\]"):
        bd.check(bd.parse(["--kv-cache", "--setups", "ddp-1b,fsdp2-8b", "--device", "cpu", "--tiny"]))
    assert bd.check(bd.parse(["--kv-cache", "--setups", "ddp-1b", "--device", "cpu", "--tiny"]))[0] == [
        "ddp-1b"
    ]
    head = bd.markdown(dict(doc, kv_cache=True)).splitlines()[0]
    assert "the model's default use_cache, a KV cache filled" in head and "use_cache=False" not in head
    assert "use_cache=False" in bd.markdown(doc).splitlines()[0]
    with pytest.raises(SystemExit, match="--repeat wants 1 or more"):
        bd.check(bd.parse(["--repeat", "0", "--device", "cpu", "--tiny"]))


@pytest.mark.slow
def test_turns_run_every_mode_in_one_run_and_pair_their_steps(tmp_path):
    # --turns: one torchrun per (setup, world size) holds both models, wrapped in DDP, and takes turns
    # step by step; each mode still gets its own row, and each row its step time over the reference
    # mode's in the same round (the clock drift between runs cancels there)
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu", "--tiny", "--turns"]
    cmd += ["--setups", "ddp-1b", "--world-sizes", "2", "--modes", ",".join(MODES), "--steps", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = json.loads((tmp_path / "distributed.json").read_text())["rows"]
    by = {x["mode"]: x for x in rows}
    assert set(by) == set(MODES) and all(x["world_size"] == 2 for x in rows), r.stdout[-4000:]
    assert len({x["log"] for x in rows}) == 1  # one run
    for m, x in by.items():
        assert not x.get("error"), (m, x.get("error"))
        assert x["tok_s_per_gpu"] > 0 and x["turns"] == 2 and x["peak_gib_per_gpu"] is None, m
        p = x["paired"]
        assert p["ref"] == "eager" and 0 < p["low"] <= p["median"] <= p["high"], (m, p)
    assert by["eager"]["paired"]["median"] == 1.0
    # the Triton interpreter is far slower than eager PyTorch: the pairing says so
    assert by["kernelgraft (eager)"]["paired"]["low"] > 2.0
    assert by["kernelgraft (eager)"]["sites"] and by["kernelgraft (eager)"]["ddp_cuts"] is not None
    a, b = by["eager"]["losses"], by["kernelgraft (eager)"]["losses"]
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)) and a[0] != a[1], (a, b)
    md = (tmp_path / "distributed.md").read_text()
    assert "Modes taking turns step by step in one run (--turns, 2 rounds" in md
    assert "| ddp-1b | 2 | eager | 1.0000 | 1.0000 | 1.0000 |" in md
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_distributed as bd

    base = ["--device", "cpu", "--tiny", "--setups", "ddp-1b", "--turns"]
    with pytest.raises(SystemExit, match="--turns takes turns between two or more modes"):
        bd.check(bd.parse(base + ["--modes", "eager"]))
    with pytest.raises(SystemExit, match="--profile profiles one mode per run"):
        bd.check(bd.parse(base + ["--modes", "eager,kernelgraft (eager)", "--profile"]))
