"""The notebooks run top to bottom on the CPU (each in a fresh process, in a scratch directory),
say what they claim, and are stored without outputs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

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


def test_there_are_three_notebooks():
    assert [p.stem for p in NOTEBOOKS] == ["01_quickstart", "02_author_a_pattern", "03_audit"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_says_what_it_claims(path, tmp_path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    # stored stripped: no outputs, no execution counts
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    src = "\n\n".join("".join(c["source"]) for c in code)
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    for want in EXPECT[path.stem]:
        assert want in r.stdout, f"{want!r} not in the output:\n{r.stdout[-3000:]}"
    if path.stem == "01_quickstart":  # the optimized model trains like the stock one
        diffs = [float(line.rsplit(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("step ")]
        assert len(diffs) == 3 and max(diffs) < 1e-4
    if path.stem == "02_author_a_pattern":
        diff = float(r.stdout.split("max |difference|:")[1].split()[0])
        assert diff < 1e-5
    if path.stem == "03_audit":
        assert (tmp_path / "audit.html").read_text().startswith("<!DOCTYPE html>")
