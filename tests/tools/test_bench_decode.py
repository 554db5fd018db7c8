"""benchmarks/bench_decode.py's measurement, run on the CPU on a tiny Llama: every mode decodes,
kernelgraft's tokens are eager's, and the table says so (the GPU figures are RESULTS.md's)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_decode  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
def test_decode_measures_every_mode_and_compares_tokens_with_eager():
    res = bench_decode.run(
        batches=(1, 2), prompt=6, new=4, modes=("eager", "kernelgraft (eager)"), device="cpu",
        cfg=TINY, dtype=torch.float32, rounds=2,
    )  # fmt: skip
    assert set(res) == {"batch 1", "batch 2"}
    for key, B in (("batch 1", 1), ("batch 2", 2)):
        eager, mine = res[key]["eager"], res[key]["kernelgraft (eager)"]
        assert "error" not in mine, mine
        assert len(mine["tokens"]) == B and all(len(t) == 4 for t in mine["tokens"])
        assert mine["tokens"] == eager["tokens"] and mine["repeatable"]
        assert mine["agreement"] == dict(identical=B, of=B, diverged=[])
        assert mine["tok_s"] > 0 and mine["first_call_s"] > 0
        assert len(mine["times_ms"]) == len(eager["times_ms"]) == 2  # one timed generate() per round
        assert eager["first_call_compiled"]["graphs"] == 0
    # the first generate() of a batch compiles (prefill, then decoding), and says where the time went
    work = res["batch 1"]["kernelgraft (eager)"]["first_call_compiled"]
    assert work["graphs"] >= 2 and work["seconds"], work
    assert res["batch 1"]["kernelgraft (eager)"]["captured"] in ("whole", "layers")
    assert res["batch 1"]["kernelgraft (eager)"]["wrappers"] == {}  # the eager backend: no inductor graphs
    md = bench_decode.markdown(res)
    assert "**Greedy decoding, batch 2** (6-token prompt, 4 new tokens)" in md
    assert "| kernelgraft (eager) |" in md and "| 2 of 2 |" in md
    assert f"- kernelgraft (eager): its first generate() compiled {work['graphs']} graph(s)" in md


def test_agreement_reports_where_a_sequence_leaves_eagers():
    ref = dict(tokens=[[1, 2, 3], [4, 5, 6]], prompt=[[0], [0]])
    got = dict(tokens=[[1, 2, 3], [4, 7, 6]])
    a = bench_decode.agreement(ref, got)
    assert a == dict(identical=1, of=2, diverged=[dict(sequence=1, position=1, top_two_gap=None)])


def test_cold_runs_each_mode_in_a_process_of_its_own_with_fresh_caches(tmp_path):
    """--cold: each mode but eager in a process of its own, every compile cache a fresh folder of its
    own; the results merged with eager's from the first process, eager first; a process that fails
    is said in its mode's row."""
    import json
    import os

    seen = []

    def run(argv, env, **kw):
        mode = argv[argv.index("--modes") + 1]
        caches = {k: env[k] for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KERNELGRAFT_CACHE_DIR")}
        seen.append((mode, caches))
        if mode == "broken":
            return type("Done", (), {"stderr": "Traceback...\nRuntimeError: boom\n"})()
        out = argv[argv.index("--out") + 1]
        os.makedirs(out)
        rows = {"eager": {"tok_s": 1.0, "first_call_s": 0.5}, mode: {"tok_s": 2.0, "first_call_s": len(seen)}}
        json.dump({"decode": {"batch 1": rows}}, open(os.path.join(out, "decode.json"), "w"))
        return type("Done", (), {"stderr": ""})()

    modes = ("eager", "torch.compile", "kernelgraft (inductor)", "broken")
    res = bench_decode.cold_runs((1,), 8, 4, modes, 1, str(tmp_path), run=run)
    assert [m for m, _ in seen] == ["torch.compile", "kernelgraft (inductor)", "broken"]
    folders = [set(c.values()) for _, c in seen]
    assert all(len(f) == 3 for f in folders) and not folders[0] & folders[1]  # fresh, and not shared
    got = res["batch 1"]
    assert list(got) == ["eager", "torch.compile", "kernelgraft (inductor)", "broken"]
    assert got["torch.compile"]["first_call_s"] == 1 and got["kernelgraft (inductor)"]["first_call_s"] == 2
    assert got["broken"] == {"error": "its process failed: RuntimeError: boom"}
