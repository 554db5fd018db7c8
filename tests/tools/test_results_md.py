"""benchmarks/RESULTS.md is what benchmarks/results_md.py makes of benchmarks/results/."""
import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module():
    spec = importlib.util.spec_from_file_location("results_md", BENCH / "results_md.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_results_md_is_what_the_data_makes():
    assert (BENCH / "RESULTS.md").read_text() == _module().render()


def test_check_flags_a_results_md_that_differs(tmp_path, monkeypatch):
    mod = _module()
    out = tmp_path / "RESULTS.md"
    out.write_text(mod.render() + "edited\n")
    monkeypatch.setattr(mod, "OUT", out)
    assert mod.main(["--check"]) == 1
    out.write_text(mod.render())
    assert mod.main(["--check"]) == 0


def test_every_results_json_is_readable_and_dated():
    files = sorted((BENCH / "results").rglob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        assert isinstance(data.get("date"), str) and path.name.startswith(data["date"]), path


def test_a_missing_key_is_named(monkeypatch):
    mod = _module()
    with pytest.raises(SystemExit, match="no key 'nope'"):
        mod.walk({"a": {}}, "a/nope", "x.json")


def _record(folder: Path, name: str, **fields) -> None:
    counts = dict.fromkeys(["passed", "failed", "xfailed", "xpassed", "skipped", "errors"], 0)
    counts.update(fields.pop("counts"))
    data = {"date": name[:10], "commit": "0123456789abcdef" * 2 + "01234567", "dirty": False,
            "gpu": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11.0", "triton": "3.6.0"},
            "wall_s": 431.2, "counts": counts, "failures": [], "exit_status": 0, **fields}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(data))


def test_gpu_test_runs_list_the_newest_record_of_each_tier(tmp_path, monkeypatch):
    mod = _module()
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    assert mod.gpu_runs() == ""  # no record yet: no section
    runs = tmp_path / "gpu_tests"
    _record(runs, "2026-01-01-gpu-test", counts={"passed": 3, "failed": 1}, failures=["t.py::a"], exit_status=1)
    _record(runs, "2026-01-05-gpu-test", counts={"passed": 224, "xfailed": 1, "skipped": 3})
    _record(runs, "2026-01-05-gpu-test-2-of-4", counts={"passed": 50})  # a part of gpu-test: not the whole
    _record(runs, "2026-01-02-gpu-test-thorough-1-of-4", counts={"passed": 12})
    _record(runs, "2026-01-06-gpu-test-thorough-3-of-4", dirty=True, wall_s=519.0,
            counts={"passed": 10, "cut_short": 1, "failed": 1}, failures=["test_gpu.py::t[rope.x]"])  # fmt: skip
    text = mod.gpu_runs()
    lines = text.splitlines()
    assert lines[0] == "## GPU test runs"
    (whole,) = [row for row in lines if row.startswith("| `make gpu-test`")]
    assert whole == ("| `make gpu-test` | 2026-01-05 | NVIDIA H100 80GB HBM3 | `0123456789ab` | passed whole: "
                     "224 passed, 1 xfailed, 3 skipped | 431 |")  # fmt: skip
    parts = [row for row in lines if row.startswith("| `make gpu-test-thorough")]
    assert [row.split(" | ")[0] for row in parts] == [f"| `make gpu-test-thorough PART={k}/4`" for k in range(1, 5)]
    assert "passed whole: 12 passed" in parts[0] and "no record" in parts[1] and "no record" in parts[3]
    assert "(dirty)" in parts[2] and "| 519 |" in parts[2]
    assert "not whole: 10 passed, 1 failed, 1 cut short; failing: `test_gpu.py::t[rope.x]`" in parts[2]
    assert "gpu_tests/2026-01-05-gpu-test.json" in text and "2026-01-01" not in text
    monkeypatch.setattr(mod, "TABLES", [])  # the benchmark tables read files this folder lacks
    assert mod.render() == "\n".join([mod.INTRO, text, mod.HOW]).rstrip("\n") + "\n"


def test_the_unsloth_table_shows_cold_and_warm_first_steps_over_unsloths(tmp_path, monkeypatch):
    mod = _module()
    tables = __import__("results_tables")
    folder = tmp_path / "unsloth"
    folder.mkdir()
    doc = {"date": "2026-12-07", "gpu": "NVIDIA H100 80GB HBM3", "rows": {"llama-1b LoRA 8x2048": {
        "unsloth": {"tok_s": 73217.4, "device_ms": 217.0, "peak_above_start_gib": 16.8, "first_step_s": 20.0,
                    "warm_first_step_s": 12.0},
        "kernelgraft (layers)": {"tok_s": 74000.0, "device_ms": 215.0, "peak_above_start_gib": 15.6,
                                 "first_step_s": 15.0, "warm_first_step_s": 5.0},
        "torch.compile": {"error": "timed out after 1800 s"}}}}  # fmt: skip
    (folder / "2026-12-07-unsloth.json").write_text(json.dumps(doc))
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    assert mod.present(tables.UNSLOTH)
    text = mod.table(tables.UNSLOTH)
    assert "| llama-1b LoRA 8x2048 | unsloth | 73,217 | 217 | 16.8 | 20.0 (1.00x) | 12.0 (0.60x) |" in text
    assert "| llama-1b LoRA 8x2048 | kernelgraft (layers) | 74,000 | 215 | 15.6 | 15.0 (0.75x) | 5.0 (0.25x) |" in text
    assert "| torch.compile | error: timed out after 1800 s |" in text
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "none")
    assert not mod.present(tables.UNSLOTH)  # left out until a run is published
