"""Every python block of the README runs (in a fresh process: the README registers a pattern)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i, tmp_path):
    # in a scratch directory: a block may write files (the audit's HTML page)
    r = subprocess.run(
        [sys.executable, "-c", BLOCKS[i]], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    if "audit_kernel" in BLOCKS[i]:
        assert "False ['missing gradient']" in r.stdout and "eager = inductor" in r.stdout
    if "kernelgraft.audit(" in BLOCKS[i]:
        assert r.stdout.startswith("True True\n# kernelgraft audit: LlamaForCausalLM")
        assert (tmp_path / "audit.html").read_text().startswith("<!DOCTYPE html>")
    if "counts()" in BLOCKS[i]:
        assert "{'rms_norm': 5, 'lm_head_ce': 1, 'rope': 4, 'gated_mlp': 2}" in r.stdout
