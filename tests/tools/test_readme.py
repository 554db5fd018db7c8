"""Every python block of the README and of the docs pages with examples runs (each in a fresh
process: one registers a pattern), and so does every `kernelgraft ...` line of their shell blocks."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# the pages whose examples are meant to run as written (the README's quickstart is shown there too)
PAGES = [README] + [(ROOT / "docs" / p).read_text() for p in ("getting-started.md", "patterns.md", "audits.md")]
BLOCKS = [b for page in PAGES for b in re.findall(r"```python\n(.*?)```", page, re.S)]


def test_readme_has_python_blocks():
    assert re.findall(r"```python\n(.*?)```", README, re.S), "the README lost its quickstart"
    # each kind of example the checks below hold to its output is still there
    for marker in ("counts()", "audit_kernel", "kernelgraft.audit(", "@kernelgraft.pattern("):
        assert any(marker in b for b in BLOCKS), marker


@pytest.mark.slow
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


def _fenced(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block, fences paired in order."""
    blocks, cur = [], None
    for ln in text.splitlines():
        if ln.startswith("```"):
            if cur is None:
                cur = (ln[3:].strip(), [])
            else:
                blocks.append(cur)
                cur = None
        elif cur is not None:
            cur[1].append(ln)
    return blocks


CLI_LINES = [
    ln.strip()
    for page in PAGES
    for lang, lines in _fenced(page)
    if lang in ("", "bash", "sh")
    for ln in lines
    if ln.strip().startswith("kernelgraft ")
]


def test_readme_has_cli_lines():
    assert any(ln.startswith("kernelgraft audit") for ln in CLI_LINES)


@pytest.mark.slow
@pytest.mark.parametrize("line", CLI_LINES)
def test_readme_cli_line_runs(line, tmp_path):
    """The README's shell examples, as written (`make demo`/`make test` are what CI itself runs).
    A local checkpoint named in them is made first: a tiny random Llama."""
    if "./my-checkpoint" in line:
        from tiny import tiny_model

        tiny_model("llama").save_pretrained(tmp_path / "my-checkpoint")
    args = line.split()[1:]
    r = subprocess.run(
        [sys.executable, "-m", "kernelgraft", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    for flag in ("--out", "--md"):
        if flag in args:
            assert (tmp_path / args[args.index(flag) + 1]).stat().st_size > 1000
