"""tests/gpu/thorough_gpu.py, the per-spelling runner of the thorough profile: what it reads from a log,
which spellings a part takes, the record it writes, and `make gpu-test-thorough`, which runs it."""

import argparse
import json
import re
import subprocess

import pytest
import thorough_gpu
from thorough_gpu import ROOT, TEST, of_part, part, spellings, summarize


def test_a_log_says_passed_failed_or_cut_short():
    q = "rms_norm.l2"
    passed = f"{q}: 50 examples so far\n{q}: 200 examples\n.\n1 passed"
    assert summarize(q, passed, 0) == ("passed", "200")
    failed = f"{q}: 50 examples so far\n\n{q}: first failing case Case(rows=4, n=8): grad x: FAIL\n"
    result, cases = summarize(q, failed, 1)
    assert result.startswith("FAILED: Case(rows=4, n=8)") and cases == "50"
    assert summarize(q, f"{q}: 50 examples so far\n{q}: 100 examples so far\n", 124) == (
        "cut short by its time, no failure",
        ">= 100",
    )
    # another spelling's lines (rms_norm.l2_scaled) are not this one's
    assert summarize(q, "rms_norm.l2_scaled: 200 examples\n", 124)[1] == "< 50"


def test_only_picks_whole_spellings_and_kernels():
    assert spellings("rms_norm.l2") == ["rms_norm.l2"]
    lm = spellings("lm_head_ce")
    assert lm and all(n.startswith("lm_head_ce.") for n in lm)
    assert len(spellings("")) == len(set(spellings("")))


def test_the_parts_take_every_spelling_once_in_the_registrys_order():
    names = spellings("")
    parts = [of_part(names, k, 4) for k in range(1, 5)]
    assert sorted(sum(parts, [])) == sorted(names)
    assert parts[1] == names[1::4] and all(len(p) in (len(names) // 4, -(-len(names) // 4)) for p in parts)
    assert part("2/4") == (2, 4)
    for spec in ("2", "0/4", "5/4", "a/b"):
        with pytest.raises(argparse.ArgumentTypeError, match="K/N"):
            part(spec)


def test_the_runner_reads_the_test_that_test_gpu_defines():
    path, name = TEST.split("::")
    assert f"def {name}(" in (ROOT / path).read_text()


def _fake_run(failing):
    def run_one(qualname, out, timeout, gpu=None, threads=0):
        if qualname == failing:
            return qualname, "FAILED: Case(rows=4)", "50", 3.0
        return qualname, "passed", "200", 2.0

    return run_one


def test_a_part_runs_its_spellings_and_writes_its_record(tmp_path, monkeypatch, capsys):
    names = of_part(spellings(""), 2, 4)
    monkeypatch.setattr(thorough_gpu, "run_one", _fake_run(failing=names[1]))
    argv = ["--part", "2/4", "--jobs", "2", "--out", str(tmp_path / "logs" / "{part}")]
    argv += ["--record", str(tmp_path / "{date}-gpu-test-thorough-{part}.json")]
    assert thorough_gpu.main(argv) == 1  # a spelling failed
    (path,) = tmp_path.glob("*.json")
    rec = json.loads(path.read_text())
    assert path.name == f"{rec['date']}-gpu-test-thorough-2-of-4.json" and f"record: {path}" in capsys.readouterr().out
    assert (tmp_path / "logs" / "2-of-4" / "thorough.md").exists()
    assert [s["spelling"] for s in rec["spellings"]] == names
    assert rec["spellings"][0] == {"spelling": names[0], "result": "passed", "cases": 200, "s": 2.0}
    assert rec["counts"] == {"passed": len(names) - 1, "failed": 1, "xfailed": 0, "xpassed": 0, "skipped": 0,
                             "errors": 0, "cut_short": 0}  # fmt: skip
    assert rec["failures"] == [f"{TEST}[{names[1]}]"]
    assert rec["part"] == "2/4" and rec["profile"] == "thorough" and rec["budget"] == 520 and rec["jobs"] == 2
    assert rec["command"].startswith("python tests/gpu/thorough_gpu.py --part 2/4")
    assert {"date", "commit", "dirty", "gpu", "versions", "wall_s", "exit_status"} <= set(rec)


def test_a_run_without_failures_exits_0_and_counts_cut_short_and_errors():
    rows = [("a.x", "passed", "200", 1.0), ("a.y", "cut short by its time, no failure", ">= 100", 9.0),
            ("a.z", "error (exit 2): see its log", "?", 0.5)]  # fmt: skip
    rec = thorough_gpu.record(rows, "2026-01-02", "cmd", None, 10.0)
    assert (rec["counts"]["passed"], rec["counts"]["cut_short"], rec["counts"]["errors"]) == (1, 1, 1)
    assert rec["failures"] == [f"{TEST}[a.z]"] and rec["spellings"][1]["cases"] == ">= 100"


@pytest.mark.parametrize(
    "args, part_arg, loop",
    [(["PART=2"], "2/4", None), (["PART=3/5"], "3/5", None), ([], "$k/4", "seq 1 4"),
     (["THOROUGH_PARTS=3"], "$k/3", "seq 1 3")],
)  # fmt: skip
def test_make_gpu_test_thorough_runs_a_part_in_a_budget_and_records_it(args, part_arg, loop):
    # PART=K/N one part; PART=K the K-th of THOROUGH_PARTS; none: every part in turn
    p = subprocess.run(["make", "-n", "gpu-test-thorough", *args], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    (run,) = [line for line in p.stdout.replace("\\\n", " ").splitlines() if "thorough_gpu.py" in line]
    assert re.findall(r"--part (\S+)", run) == [part_arg] and (loop is None or loop in run)
    assert "--budget 520" in run and "--jobs 6" in run
    assert "--record 'benchmarks/results/gpu_tests/{date}-gpu-test-thorough-{part}.json'" in run
