"""benchmarks/bench_context.py: the search (doubling, then bisection to the resolution) on a fake
predicate; the CPU smoke run (a tiny Llama, a memory limit on the bytes saved for the backward) with
every mode's longest length bracketed by its probes, the JSON, the Markdown table, the plot and
RESULTS.md's table of it; and the gradient check against float64 truth."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_context as bc  # noqa: E402

K = 1024


def _lengths(got: dict) -> list[int]:
    return [n for n, _, _ in got["probes"]]


def test_search_doubles_then_bisects_to_the_longest_multiple_of_the_resolution_that_fits():
    edge = 37 * K + 5
    got = bc.search(lambda n: n <= edge, 4096, 524288, K)
    assert (got["longest"], got["shortest_failed"], got["search"]) == (37 * K, 38 * K, "complete")
    seen = _lengths(got)
    assert seen[:5] == [4096, 8192, 16384, 32768, 65536]  # doubled until a step does not fit
    assert all(n % K == 0 for n in seen) and len(seen) == len(set(seen))
    assert len(seen) <= 5 + 5  # then at most log2((65536 - 32768) / 1024) = 5 probes
    fit = {n: ok for n, ok, _ in got["probes"]}
    assert fit[37 * K] is True and fit[38 * K] is False
    assert all(ok == (n <= edge) for n, ok in fit.items())


def test_search_says_when_everything_fits_and_when_nothing_does():
    got = bc.search(lambda n: True, 4096, 524288, K)
    assert (got["longest"], got["shortest_failed"], got["search"]) == (524288, None, "reached max")
    assert _lengths(got) == [4096 * 2**i for i in range(8)]
    off_path = bc.search(
        lambda n: True, 4096, 50000, K
    )  # a max the doubling does not land on is probed itself
    assert off_path["longest"] == 50000 and _lengths(off_path)[-1] == 50000
    none = bc.search(lambda n: False, 4096, 524288, K)
    assert (none["longest"], none["shortest_failed"], none["search"]) == (None, 4096, "nothing fit")
    assert _lengths(none) == [4096]


def test_search_stops_when_its_time_is_spent_and_keeps_the_longest_so_far():
    now = [0.0]

    def fits(n):  # each probe takes 100 s of a fake clock
        now[0] += 100.0
        return True

    probes = []
    got = bc.search(fits, 4096, 524288, K, seconds=250.0, probes=probes, clock=lambda: now[0])
    assert (got["longest"], got["search"]) == (16384, "cut short")
    assert probes is got["probes"] and _lengths(got) == [4096, 8192, 16384]


def test_search_keeps_the_probes_of_a_predicate_that_raises():
    def fits(n):
        if n > 8192:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return True

    probes = []
    with pytest.raises(RuntimeError, match="illegal memory access"):
        bc.search(fits, 4096, 524288, K, probes=probes)
    assert [n for n, _, _ in probes] == [4096, 8192]


def test_out_of_memory_is_recognized_by_type_and_by_message():
    import torch

    assert bc.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert bc.is_oom(RuntimeError("Triton Error [CUDA]: out of memory"))
    assert bc.is_oom(
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    )
    assert not bc.is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_command_line_refuses_a_bad_row_mode_or_range_in_one_line(capsys):
    a = bc.parse(["--rows", "llama-8b QLoRA", "--modes", "unsloth,kernelgraft (memory=auto)"])
    assert (a.row_list, a.mode_list) == (["llama-8b QLoRA"], ["unsloth", "kernelgraft (memory=auto)"])
    assert (a.min, a.max, a.resolution, a.mode_seconds, a.steps, a.at_list) == (4096, 524288, 1024, 300.0, 3, [8192, 32768, 131072])  # fmt: skip
    smoke = bc.parse(["--smoke"])
    assert (smoke.row_list, smoke.mode_list) == ([bc.SMOKE_ROW], list(bc.SMOKE_MODES))
    for argv, said in (
        (["--rows", "llama-70b"], "unknown row 'llama-70b'"),
        (["--modes", "deepspeed"], "unknown mode 'deepspeed'"),
        (["--min", "8192", "--max", "4096"], "--max (4096) is below --min (8192)"),
        (["--resolution", "0"], "--resolution must be 1 or more"),
    ):
        with pytest.raises(SystemExit):
            bc.parse(argv)
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err


def _results_md():
    spec = importlib.util.spec_from_file_location("results_md", ROOT / "benchmarks" / "results_md.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_md_leaves_the_context_table_out_until_a_run_is_published(tmp_path, monkeypatch):
    mod = _results_md()
    from results_tables import CONTEXT, STEPS

    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    assert not mod.present(CONTEXT) and mod.present(STEPS)


@pytest.mark.slow  # four Python processes, kernelgraft's captures on the CPU: about 35 s on a 2-core CPU
def test_smoke_run_brackets_every_modes_longest_and_writes_json_markdown_and_tables(tmp_path, monkeypatch):
    res, top = 8, 64
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_context.py"), "--smoke", "--out", str(out)]
    args = [
        "--min",
        "16",
        "--max",
        str(top),
        "--resolution",
        str(res),
        "--at",
        "16",
        "--smoke-limit-mib",
        "0.75",
    ]
    run = subprocess.run(cmd + args, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    doc = json.loads((out / "context.json").read_text())
    assert doc["args"]["resolution"] == res and doc["date"] and "torch" in doc["versions"]
    modes = doc["rows"][bc.SMOKE_ROW]
    assert list(modes) == list(bc.SMOKE_MODES)
    for mode, r in modes.items():
        assert "error" not in r and "skipped" not in r, (mode, r)
        n = r["longest"]
        assert n and n % res == 0, (mode, n)
        fit = {length: ok for length, ok, _ in r["probes"]}
        assert fit[n] is True, (mode, r["probes"])
        assert n + res > top or fit.get(n + res) is False, (
            mode,
            r["probes"],
        )  # the bracket: n fits, n + res not
        assert all(ok == (length <= n) for length, ok in fit.items()), (mode, r["probes"])
        assert r["search"] in ("complete", "reached max")
        m = r["measurements"][str(n)]
        assert m["tokens_per_s_wall"] > 0 and m["peak_gib"] > 0 and len(m["times_s"]) == 1
        assert "tokens_per_s_wall" in r["measurements"]["16"] or n == 16
        assert r["vs_best_peer"] > 0
    # a model per length where kernelgraft picks its levers at the first training call
    assert set(modes["kernelgraft (memory=auto)"]["memory_plans"]) >= {
        str(modes["kernelgraft (memory=auto)"]["longest"])
    }
    md = (out / "context.md").read_text()
    for mode in modes:
        assert f"| {bc.SMOKE_ROW} | {mode} | {modes[mode]['longest']:,}" in md
    assert importlib.util.find_spec("matplotlib") is None or (out / "context.png").stat().st_size > 0
    assert "| kernelgraft |" in run.stdout  # the table at the end

    # RESULTS.md's table, from this run published into a results folder of its own
    results = tmp_path / "results"
    (results / "context").mkdir(parents=True)
    shutil.copy(out / "context.json", results / "context" / f"{doc['date']}-context.json")
    mod = _results_md()
    from results_tables import CONTEXT

    monkeypatch.setattr(mod, "RESULTS", results)
    assert mod.present(CONTEXT)
    table = mod.table(CONTEXT)
    for mode in modes:
        assert f"| {bc.SMOKE_ROW} | {mode} | {modes[mode]['longest']:,}" in table, table


@pytest.mark.slow  # three copies of a model, a float64 one among them, and a capture
def test_check_grads_judges_every_lora_gradient_against_float64_truth():
    a = bc.parse(["--smoke"])
    got = bc.check_grads(16, a)
    assert got["truth"].startswith("float64")
    quantities = [v["quantity"] for v in got["verdicts"]]
    assert quantities[0] == "loss" and len(quantities) == 1 + 2 * 7 * 2  # A and B of 7 linears in 2 layers
    assert all(".lora_A." in q or ".lora_B." in q for q in quantities[1:])
    assert all(v["eager"] > 0 for v in got["verdicts"][1:])  # lora_B drawn at random: lora_A's gradients too
    assert got["ok"], got["worst"]
    assert got["sites"].get("lora", 0) > 0 and not got["fell_back"]


def _run(mode_longest: dict, at: list[int]) -> dict:
    """A context.json of one row whose modes fit up to the lengths given, measured there and at `at`."""
    modes = {
        m: dict(
            longest=n, search="complete", shortest_failed=n + K, probes=[[n, True, 1.0], [n + K, False, 1.0]],
            measurements={str(x): dict(tokens_per_s_wall=1000.0 + x, peak_gib=70.0) for x in [n, *at] if x <= n},
        )
        for m, n in mode_longest.items()
    }  # fmt: skip
    args = dict(min=4096, max=524288, resolution=K, mode_seconds=300.0, fresh_seconds=1800.0, steps=3, at_list=at, shapes="dynamic")  # fmt: skip
    return dict(date="2026-01-01", gpu="NVIDIA H100", versions={"torch": "2.11"}, commit=None, args=args, rows={"llama-8b LoRA": modes})  # fmt: skip


def test_merge_joins_runs_of_some_modes_each_and_compares_with_the_best_peer(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run({"unsloth": 300 * K, "kernelgraft (offload)": 100 * K}, [8192])))
    b.write_text(json.dumps(_run({"kernelgraft (offload)": 360 * K, "eager": 12 * K}, [32768])))
    assert bc.main(["--merge", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "context.json").read_text())
    modes = doc["rows"]["llama-8b LoRA"]
    assert list(modes) == ["unsloth", "kernelgraft (offload)", "eager"]
    assert modes["kernelgraft (offload)"]["longest"] == 360 * K  # the later run's
    assert modes["kernelgraft (offload)"]["best_peer"] == "unsloth"
    assert modes["kernelgraft (offload)"]["vs_best_peer"] == pytest.approx(1.2)
    assert doc["args"]["at_list"] == [8192, 32768]
    md = (tmp_path / "out" / "context.md").read_text()
    assert (
        "| llama-8b LoRA | kernelgraft (offload) | 368,640 | 369,640 | 70.0 | 1.20x (unsloth) | - | 33,768 |"
        in md
    )
