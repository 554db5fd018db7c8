"""The notebooks are stored with their outputs, and the outputs are current. Each notebook runs top to
bottom on the CPU (all its code cells in one fresh process, in a scratch directory), says what it
claims (EXPECT), and prints, cell by cell, what its stored outputs show: up to what legitimately
varies from run to run and machine to machine (timings, memory addresses, temporary paths, progress
bars, warnings, the last digits of rounding errors).

After a change to a notebook, or to what kernelgraft prints, store the outputs anew:

    python tests/tools/test_notebooks.py --write                 # every notebook
    python tests/tools/test_notebooks.py --write 03_audit        # one

It executes the notebooks as the test does and writes each code cell's outputs (nbformat 4 "stream"
outputs, stdout then stderr, and an "execute_result" where the cell ends in an expression whose value
is not None, as Jupyter shows it) and its execution count. No Jupyter needed.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
WRITE = "python tests/tools/test_notebooks.py --write"

# what each notebook must print: its claims, checked
EXPECT = {
    "01_quickstart": [
        "{'rms_norm': 5, 'lm_head_ce': 1, 'rope': 4, 'gated_mlp': 2}",
        "sites replaced: {'rms_norm': 5, 'lm_head_ce': 1, 'rope': 4, 'gated_mlp': 2}",
        "RuntimeError: kernelgraft fused the LM head",
        "eval logits: (4, 32, 256)",
    ],
    "02_author_a_pattern": ["dx = ", "dweight = ", "8 drawn cases passed", "replaced: {'layer_norm_nobias': 1}"],
    "03_audit": ["ok: True", "# kernelgraft audit: LlamaForCausalLM", "untrained tokens: 2 token id(s)",
                 "False ['missing gradient']"],
}  # fmt: skip


# --- running a notebook ---------------------------------------------------------------------------

# Runs in the notebook's process: each code cell in one module, __main__, as a kernel would; a marker on
# stdout and stderr before each cell splits the streams per cell; a cell ending in an expression
# (and not in `;`) has the repr of its value shown, as Jupyter does.
RUNNER = r"""
import ast, json, sys, traceback, types
cells, mark, results_path = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
main = sys.modules["__main__"] = types.ModuleType("__main__")  # the cells' own, as a kernel's
ns, results = main.__dict__, {}
for i, src in enumerate(cells):
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"{mark}{i}{mark}")
        stream.flush()
    name = f"<cell {i + 1}>"
    try:
        tree = ast.parse(src, name)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, name, "exec"), ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), name, "eval"), ns)
            if value is not None and not src.rstrip().endswith(";"):
                results[i] = repr(value)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.exit(f"cell {i + 1} raised")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        with open(results_path, "w") as f:
            json.dump(results, f)
"""


@dataclass
class Run:
    cells: list[dict]  # per code cell: {"stdout": str, "stderr": str, "result": str | None}
    cwd: Path
    returncode: int
    stderr_tail: str

    @property
    def stdout(self) -> str:
        return "".join(c["stdout"] for c in self.cells)


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _text(source) -> str:
    return "".join(source) if isinstance(source, list) else source


def execute(path: Path, cwd: Path, timeout: int = 900) -> Run:
    """All code cells of the notebook at `path`, in one fresh process in `cwd` (a scratch directory:
    a notebook may write files)."""
    cells = [_text(c["source"]) for c in code_cells(json.loads(path.read_text()))]
    mark = f"\x1ekernelgraft-cell-{uuid.uuid4().hex}\x1e"
    with tempfile.TemporaryDirectory() as tmp:
        src, results = Path(tmp) / "cells.json", Path(tmp) / "results.json"
        src.write_text(json.dumps(cells))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        r = subprocess.run(
            [sys.executable, "-c", RUNNER, str(src), mark, str(results)],
            capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env,
        )  # fmt: skip
        shown = json.loads(results.read_text()) if results.exists() else {}
    outs = [re.split(re.escape(mark) + r"\d+" + re.escape(mark), s)[1:] for s in (r.stdout, r.stderr)]
    ran = [{"stdout": o, "stderr": e, "result": shown.get(str(i))} for i, (o, e) in enumerate(zip(*outs))]
    return Run(ran, cwd, r.returncode, r.stderr[-4000:])


# --- the stored outputs ---------------------------------------------------------------------------


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def outputs_of(cell: dict, count: int) -> list[dict]:
    """nbformat 4 outputs of one executed cell, as Jupyter stores them."""
    outs = []
    for name in ("stdout", "stderr"):
        text = _without_progress_bars(cell[name]) if name == "stderr" else cell[name]
        if text:
            outs.append({"name": name, "output_type": "stream", "text": _lines(text)})
    if cell["result"] is not None:
        outs.append(
            {
                "data": {"text/plain": _lines(cell["result"])},
                "execution_count": count,
                "metadata": {},
                "output_type": "execute_result",
            }
        )
    return outs


def stored(cell: dict) -> dict:
    """What a stored code cell shows: {"stdout", "stderr", "result"}, as `execute` gives them."""
    got = {"stdout": "", "stderr": "", "result": None}
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            got[o["name"]] += _text(o["text"])
        elif o["output_type"] == "execute_result":
            got["result"] = _text(o["data"].get("text/plain", ""))
        else:  # error, display_data: not what a current, passing notebook stores
            got["stdout"] += f"<{o['output_type']} output>\n"
    return got


def write(path: Path, run: Run) -> None:
    """Store the outputs and execution counts of `run` in the notebook at `path`."""
    nb = json.loads(path.read_text())
    cells = code_cells(nb)
    assert len(cells) == len(run.cells), f"{path.name}: only {len(run.cells)} of {len(cells)} cells ran"
    for i, c in enumerate(nb["cells"]):
        c.setdefault("id", f"cell-{i + 1}")  # nbformat 4.5 wants cell ids
    for n, (c, ran) in enumerate(zip(cells, run.cells), 1):
        c["execution_count"] = n
        c["outputs"] = outputs_of(ran, n)
    # as Jupyter writes them (nbformat.writes): an edit saved from Jupyter changes no other line
    path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# --- what may differ between the stored outputs and a fresh run -----------------------------------

_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\bit/s\]|s/it\]")
_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: |^\s*warnings\.warn\(|^\[transformers\]|^\S+ - WARNING - ")
_FLOAT = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)|[-+]?\d+\.\d+")


def _without_progress_bars(text: str) -> str:
    """A terminal's view of tqdm: each line as its last carriage return leaves it; bars dropped."""
    out = []
    for line in _lines(text):
        end = "\n" if line.endswith("\n") else ""
        last = line.rstrip("\n").split("\r")[-1]
        if not _BAR.search(last) and (last or not line.startswith("\r")):
            out.append(last + end)
    return "".join(out)


def normalize(text: str, cwd: Path | None = None) -> str:
    text = _without_progress_bars(text)
    for path, name in ((cwd, "<cwd>"), (ROOT, "<repo>"), (Path(sys.prefix), "<prefix>")):
        if path is not None:
            text = text.replace(str(path), name)
    text = re.sub(r"(?:/private)?/(?:tmp|var/folders)/\S+", "<tmp>", text)
    text = re.sub(r"\b0x[0-9a-fA-F]{4,}\b", "0x<addr>", text)
    text = re.sub(r"\b\d{4}-\d{2}-\d{2}(?:[ T]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?)?\b", "<date>", text)
    text = re.sub(r"\b\d+\.\d+\.\d+[\w.+-]*", "<version>", text)  # torch 2.13.0+cpu
    text = re.sub(r"\b\d+(?:\.\d+)?\s?(?:ns|us|µs|ms|s|min|h)\b(?![/\w])", "<time>", text)
    text = re.sub(r"\b\d+(?:\.\d+)?\s?(?:it/s|s/it|tokens/s)\b", "<rate>", text)
    kept, skip_source_line = [], False
    for line in text.splitlines():
        if skip_source_line and line.startswith("  "):  # the source line warnings.warn shows
            skip_source_line = False
            continue
        skip_source_line = bool(_WARNING.search(line))
        if not skip_source_line:
            kept.append(line.rstrip())
    return "\n".join(kept).strip("\n")


def _same_number(a: str, b: str) -> bool:
    """Floats printed by the notebooks: losses, errors of float32 arithmetic and their ratios. Their
    last digits depend on the CPU's vector width and thread count (summation order), so they agree
    to 5 % or, at the scale of float32 rounding, within 1e-6."""
    x, y = float(a), float(b)
    return x == y or math.isclose(x, y, rel_tol=5e-2, abs_tol=1e-6)


def same_output(want: str, got: str) -> bool:
    """Equal after normalize(), floats to within _same_number, everything else exactly."""
    split_w, split_g = _FLOAT.split(want), _FLOAT.split(got)
    nums_w, nums_g = _FLOAT.findall(want), _FLOAT.findall(got)
    return split_w == split_g and all(map(_same_number, nums_w, nums_g)) and len(nums_w) == len(nums_g)


# --- the tests ------------------------------------------------------------------------------------

_RUNS: dict[str, Run] = {}


@pytest.fixture
def ran(request, tmp_path_factory):
    """The notebook executed once per pytest run (two tests read it)."""
    path = request.param
    if path.stem not in _RUNS:
        _RUNS[path.stem] = execute(path, tmp_path_factory.mktemp(path.stem))
    run = _RUNS[path.stem]
    assert run.returncode == 0, f"{path.name} failed:\n{run.stderr_tail}"
    return path, run


def test_there_are_three_notebooks():
    assert [p.stem for p in NOTEBOOKS] == ["01_quickstart", "02_author_a_pattern", "03_audit"]


@pytest.mark.slow
@pytest.mark.parametrize("ran", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS], indirect=True)
def test_notebook_runs_and_says_what_it_claims(ran):
    path, run = ran
    for want in EXPECT[path.stem]:
        assert want in run.stdout, f"{want!r} not in the output:\n{run.stdout[-3000:]}"
    if path.stem == "01_quickstart":  # the optimized model trains like the stock one
        diffs = [
            float(line.rsplit(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("step ")
        ]
        assert len(diffs) == 3 and max(diffs) < 1e-4
    if path.stem == "02_author_a_pattern":
        diff = float(run.stdout.split("max |difference|:")[1].split()[0])
        assert diff < 1e-5
    if path.stem == "03_audit":
        assert (run.cwd / "audit.html").read_text().startswith("<!DOCTYPE html>")


def test_the_comparison_ignores_what_varies_and_nothing_else():
    stored_text = (
        "step 0: stock 5.523635  kernelgraft 5.523635  rel. diff 0.0e+00\n"
        "error 4.88e-07 vs eager 4.82e-07 (0.48x the bound); <Case at 0x7f3a2c1b9e50>, 2026-12-01, torch 2.13.0+cpu\n"
        "compiled in 1.8s, 12.5 it/s, wrote /tmp/tmpab12cd/audit.html\n"
        "/x/site-packages/transformers/utils.py:12: FutureWarning: `torch_dtype` is deprecated\n"
        "  warnings.warn(\n"
        "sites replaced: {'rms_norm': 5, 'rope': 4}\n"
    )
    now = (
        "step 0: stock 5.523636  kernelgraft 5.523635  rel. diff 1.2e-07\n"
        "error 4.71e-07 vs eager 4.90e-07 (0.47x the bound); <Case at 0x7f00deadbeef>, 2027-01-31, torch 2.14.1+cu130\n"
        "compiled in 0.4s, 3.1 it/s, wrote /tmp/tmpzz99/audit.html\n"
        "loading: 100%|██████████| 27/27 [00:00<00:00, 32939.56it/s]\n"
        "sites replaced: {'rms_norm': 5, 'rope': 4}\n"
    )
    assert same_output(normalize(stored_text), normalize(now))
    line = "sites replaced: {'rms_norm': 5, 'rope': 4}"
    for stale in ("sites replaced: {'rms_norm': 4, 'rope': 4}", "sites fused: {'rms_norm': 5, 'rope': 4}",
                  "sites replaced: {'rms_norm': 5, 'rope': 4, 'gated_mlp': 2}"):  # fmt: skip
        assert not same_output(normalize(stored_text), normalize(now.replace(line, stale))), stale
    assert not same_output(normalize(stored_text), normalize(now.replace("5.523636", "5.9")))  # a loss
    assert not same_output(normalize(stored_text), normalize(now.replace("(0.47x", "(0.95x")))  # a ratio


@pytest.mark.slow
@pytest.mark.parametrize("ran", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS], indirect=True)
def test_stored_outputs_are_current(ran):
    path, run = ran
    cells = code_cells(json.loads(path.read_text()))
    hint = f"{path.name}: its stored outputs are not current; regenerate them with `{WRITE} {path.stem}`"
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1)), (
        f"{hint} (execution counts {[c['execution_count'] for c in cells]})"
    )
    assert any(c["outputs"] for c in cells), f"{hint} (no outputs stored)"
    for n, (cell, fresh) in enumerate(zip(cells, run.cells), 1):
        want = stored(cell)
        for what in ("stdout", "stderr", "result"):
            w, g = (normalize(x or "", run.cwd) for x in (want[what], fresh[what]))
            if (want[what] is None) != (fresh[what] is None) or not same_output(w, g):
                diff = "\n".join(
                    difflib.unified_diff(w.splitlines(), g.splitlines(), "stored", "now", lineterm="", n=2)
                )
                pytest.fail(f"{hint}\ncell {n}, {what} (normalized):\n{diff[:4000]}")


def main(argv: list[str]) -> int:
    if argv[:1] != ["--write"]:
        print(__doc__)
        return 2
    wanted = argv[1:]
    for path in NOTEBOOKS:
        if wanted and path.stem not in wanted and path.name not in wanted:
            continue
        with tempfile.TemporaryDirectory() as cwd:
            run = execute(path, Path(cwd))
            if run.returncode != 0:
                print(f"{path.name} failed; outputs not stored:\n{run.stderr_tail}", file=sys.stderr)
                return 1
            write(path, run)
        print(f"{path.relative_to(ROOT)}: outputs of {len(run.cells)} cells stored")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
