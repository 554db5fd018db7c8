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
