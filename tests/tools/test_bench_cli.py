"""`kernelgraft bench`: forwards to benchmarks/suite.py; without a GPU it says so (exit 2); its
report side (Markdown, merge of partial runs, PNG plots) works anywhere."""

import json

import pytest
import torch

from kernelgraft import cli


def fake_run(date="2026-11-29"):
    imp = lambda ms: dict(fwd_ms=ms / 3, bwd_ms=2 * ms / 3, fwd_bwd_ms=ms, peak_mib=100.0)  # noqa: E731
    return dict(
        date=date,
        gpu="NVIDIA H200",
        versions="torch x",
        patterns=[
            dict(
                name="RMSNorm 16384x4096",
                floor_ms=0.157,
                impls={
                    "eager": imp(2.7),
                    "torch.compile": dict(imp(0.3), loop_ms=0.5),
                    "kernelgraft (inductor)": dict(imp(0.25), device_ms=0.1884, loop_ms=0.4),
                },
            )
        ],
        steps={"llama-1b 8x2048": {"eager": dict(tok_s=50000.0, peak_gib=50.0, first_step_s=2.0, loss=12.0)}},
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_bench_without_a_gpu_says_so(capsys):
    assert cli.main(["bench", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_help_is_the_suites(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0 and "--parts" in capsys.readouterr().out


def test_merge_of_partial_runs_makes_the_table_and_plots(tmp_path):
    a = fake_run()
    b = fake_run()
    del b["patterns"]
    b["steps"] = {
        "llama-1b 8x2048": {
            "kernelgraft (inductor)": dict(
                tok_s=60000.0, peak_gib=26.0, peak_above_start_gib=23.7, first_step_s=20.0, loss=12.0
            )
        }
    }
    b["curves"] = {"eager": [12.0, 11.0, 10.5], "kernelgraft (inductor)": [12.0, 11.0001, 10.5002]}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out = tmp_path / "merged"
    assert cli.main(["bench", "--merge", str(pa), str(pb), "--out", str(out)]) == 0
    doc = json.loads((out / "suite.json").read_text())
    assert set(doc["steps"]["llama-1b 8x2048"]) == {"eager", "kernelgraft (inductor)"}
    md = (out / "suite.md").read_text()
    # the device-time column (profiler): the kernels' time, and its ratio to the memory floor (0.1884 / 0.157)
    assert (
        "| kernelgraft (inductor) | 0.083 | 0.167 | 0.250 | 10.80x | 1.20x | - | 100 | 0.188 | 1.20x |" in md
    )
    assert "| torch.compile | 0.100 | 0.200 | 0.300 | 9.00x | 1.00x | - | 100 | - | - |" in md
    # a run from before the saved-for-backward column: "-" there
    assert "| kernelgraft (inductor) | 60,000 | 1.20x | - | - | 26.0 | 23.7 | - | 20.0 |" in md
    assert "max relative difference 1.90e-05" in md
    for part in ("patterns", "steps", "curves"):
        png = out / f"suite_{part}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tune_lora_report_names_the_tables_tile_and_the_fastest():
    import sys

    sys.path.insert(0, "benchmarks")
    import tune_lora

    table = {k: str(tune_lora.table_tile(k)) for k in tune_lora.K.GPU_TILES}
    tiles = {  # the fastest tile; one faster still where it ran, but it failed on a pair
        k: {
            table[k]: {"2048->512": 2e-3, "8192->2048": 1e-3},
            "(128, 64, 8, 2)": {"2048->512": 0.25e-3, "8192->2048": 0.75e-3},
            "(32, 64, 4, 4)": {"2048->512": 0.1e-3},
        }
        for k in table
    }
    fills = {"grad_u": {"0": {"2048->512": 2e-3}, "4": {"2048->512": 1e-3}}}
    acc = [dict(what="dA", eager=4.7e-7, compile=4.7e-7, kernelgraft=2.7e-7, ok=True)]
    blocks = {"1": {"2048->512": 0.1, "8192->2048": 0.2}, "2": {"2048->512": 0.05, "8192->2048": 0.15}}  # ms
    other = "kernelgraft, du and dB " + ("apart" if tune_lora.K.FUSED_UB else "from one read")
    ops = [{"pair": "2048->512", "eager": 1.0, "torch.compile": 0.8, "kernelgraft": 0.3, other: 0.35,
            "kernelgraft, float32 long sums": 0.29}]  # fmt: skip
    md = tune_lora.markdown(
        dict(device="NVIDIA H200", date="2026-12-01", torch="2.11", ops=ops, accuracy=acc, tiles=tiles, fills=fills,
             blocks=blocks)
    )  # fmt: skip
    # the ops table's column of the way of making du and dB that the table does not take
    assert f"| kernelgraft | {other} | kernelgraft, float32 long sums |" in md
    assert "| 2048->512 | 1.000 | 0.800 | 0.300 | 0.350 | 0.290 |" in md
    assert "| 2 | 50 | 150 | 200 |" in md  # grad_ub with two column blocks a program, us
    # with the memory floor of the pairs run: the tensors each kernel must move, once, at 4275 GB/s
    # (down: x, A and u, 270,008,320 + 68,288,512 bytes; grad_u: g, B and du, 17,858,560 bytes)
    assert f"| down | {table['down']} | 3 | (128, 64, 8, 2) | 1 | 79 | 7913% |" in md
    assert f"| grad_u | {tune_lora.K.GPU_FILL['grad_u']} | 2 | 4 | 1 | 4 | 418% |" in md
    assert "| dA | 4.700e-07 | 4.700e-07 | 2.700e-07 | ok |" in md


def test_tune_lora_launches_every_kernel_with_the_arguments_of_the_backward():
    """tune_lora.py's launches, run here by the interpreter on a few rows: each kernel with the
    table's tiles, with another tile and pipelining depth, and u and du summed in splits of their
    widths (each launch must take the arguments the kernels' signatures have)."""
    import sys

    sys.path.insert(0, "benchmarks")
    import tune_lora

    t = tune_lora.tensors(40, 160, 200, dev="cpu")  # x 160 wide: u summed in two splits of 64-column tiles
    for kw in ({}, dict(BT=32, BN=64, warps=4, stages=2), dict(fills={"down": 2, "grad_u": 2, "grad_b": 4})):
        runs = tune_lora._launches(t, **kw)
        assert sorted(runs) == sorted(tune_lora.K.GPU_TILES)
        for fn in runs.values():
            fn()
    for m in tune_lora.K.UB_BLOCKS:  # grad_ub with 1, 2 and 4 column blocks a program
        tune_lora._launches(t, ub_blocks=m)["grad_ub"]()


def test_tune_lora_judges_each_tile_candidate_on_the_hard_cases_and_restores_the_table():
    """--parts hard, run here by the interpreter on a small case: every candidate judged by the
    rule and timed, its tiles and du's product width set only while it runs, the table's after."""
    import sys

    sys.path.insert(0, "benchmarks")
    import tune_lora

    src = tune_lora.source
    table, blocks, du = dict(tune_lora.K.GPU_TILES), tune_lora.K.GPU_UB_BLOCKS, (src.DU_COLUMNS, src.DU_PRODUCTS)
    fused = tune_lora.K.FUSED_UB
    with tune_lora._candidate_set({"grad_a": (16, 128, 4)}, 4, (0, "tf32x2"), not fused):
        assert tune_lora.K.GPU_TILES["grad_a"] == (16, 128, 4) and tune_lora.K.GPU_UB_BLOCKS == 4
        assert (src.DU_COLUMNS, src.DU_PRODUCTS) == (0, "tf32x2") and tune_lora.K.FUSED_UB == (not fused)
    with pytest.raises(RuntimeError), tune_lora._candidate_set({"grad_ub": (64, 16, 4)}, 4, (0, "tf32x2")):
        raise RuntimeError("a failed launch")
    assert tune_lora.K.GPU_TILES == table and tune_lora.K.GPU_UB_BLOCKS == blocks and tune_lora.K.FUSED_UB == fused
    assert (src.DU_COLUMNS, src.DU_PRODUCTS) == du == (16, "tf32x2")
    res = tune_lora.hard(dev="cpu", cases=[(12, 96, torch.bfloat16, "constant_rows", 1)], pairs=[(96, 72)], rows=40)
    assert list(res) == list(tune_lora.CANDIDATES)
    for r in res.values():
        assert r["cases"] == [dict(case="12 x 96 bfloat16 constant_rows", failed=[])] and r["backward_ms"] > 0
    assert tune_lora.K.GPU_TILES == table and tune_lora.K.GPU_UB_BLOCKS == blocks
    assert (src.DU_COLUMNS, src.DU_PRODUCTS) == du
    md = tune_lora.markdown(dict(device="cpu", date="d", torch="t", hard=res))
    assert md.count("| 12 x 96 bfloat16 constant_rows | ok |") == len(tune_lora.CANDIDATES)
    res["grad_ub, 2 column blocks a program"]["cases"][0]["failed"] = ["grad lora_a: ... FAIL"]
    assert "| FAIL: grad lora_a: ... FAIL |" in tune_lora.markdown(dict(device="cpu", date="d", torch="t", hard=res))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_tune_lora_without_a_gpu_says_so(monkeypatch):
    import sys

    sys.path.insert(0, "benchmarks")
    import tune_lora

    monkeypatch.setattr(sys, "argv", ["tune_lora.py"])
    with pytest.raises(SystemExit, match="no CUDA device"):
        tune_lora.main()


def test_pattern_rows_carry_the_loop_time_and_its_ratio():
    import sys

    sys.path.insert(0, "benchmarks")
    import suite

    md = suite.markdown(fake_run())
    assert "| in a loop, ms per call | loop vs compile |" in md
    assert "| 0.400 | 1.250x |" in md and "| 0.500 | 1.000x |" in md


def test_loop_times_take_turns_and_keep_each_ones_median():
    import sys
    import time

    sys.path.insert(0, "benchmarks")
    import suite

    order = []

    def work(name, s):
        def fn():
            order.append(name)
            time.sleep(s)

        return fn

    got = suite.loop_times({"a": work("a", 0.002), "b": work("b", 0.0)}, rounds=3, calls=5, sync=lambda: None)
    assert got["a"] > 1.5 and got["b"] < 1.0  # ms per call
    firsts = [order[i] for i in range(0, len(order), 6)]  # each turn: one to warm up and 5 timed
    assert firsts == ["a", "b", "b", "a", "a", "b"]


def test_profile_lora_ub_groups_kernels_and_tables_both_builds(monkeypatch):
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_lora_ub as p

    assert p.group("lora__bfloat16__float32__bfloat16_grad_ub") == "LoRA"
    assert p.group("triton_poi_fused_add_view_3") == "inductor"
    assert p.group("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "cuBLAS"
    assert p.group("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert p.group("rms_norm__llama__fused_bwd").startswith("the rest")
    build = lambda ub: dict(  # noqa: E731
        wall_ms=210.0, wall_least_ms=205.0, walls_ms=[210.0], device_ms=200.0,
        groups_ms={"LoRA": 30.0 + ub}, kernels={"nvjet_a": [100.0, 4], **({"lora__x_grad_ub": [ub, 112]} if ub else {})},
    )  # fmt: skip
    md = p.markdown({"one read": build(11.5), "apart": build(0.0)})
    assert "| wall ms, median (least) | 210.0 (205.0) | 210.0 (205.0) |" in md
    assert "| LoRA | 41.5 | 30.0 |" in md
    assert "| `lora__x_grad_ub` | 11.50 (112) | 0.00 (0) |" in md
    assert md.index("nvjet_a") < md.index("lora__x_grad_ub")  # the largest kernels first
    assert p.main([]) == 1 or torch.cuda.is_available()  # without a GPU it says so
    del sys.modules["profile_lora_ub"]
