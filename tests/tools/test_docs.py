"""The documentation site builds in strict mode (a broken link or a missing reference fails it), the
README stays a front page, and every option is documented once, on its Options field, and shown by
optimize's help."""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

from kernelgraft.options import Options, field_docs

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_site_builds_strict(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's notice, not the build's
    )
    assert r.returncode == 0, r.stderr[-3000:]
    options = (tmp_path / "site" / "options" / "index.html").read_text()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # the options page and optimize's reference both show each field's doc (its first words)
    for name, doc in field_docs().items():
        words = " ".join(doc.split()[:4]).replace("`", "")
        assert words in re.sub(r"<[^>]+>", "", options), (name, words)
        assert words in re.sub(r"<[^>]+>", "", api), (name, words)


def test_readme_is_a_front_page():
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; at most 250 (move prose to docs/)"
    first = lines.index("```bash")
    assert first < 60, f"the README's first command (```bash) is on line {first + 1}; it must be within 60"


def test_every_option_has_a_doc():
    docs = field_docs()
    for f in dataclasses.fields(Options):
        assert len(docs.get(f.name, "").split()) >= 8, f"Options.{f.name} has no documentation"


def test_optimize_help_has_every_option_doc():
    import kernelgraft

    helptext = " ".join(kernelgraft.optimize.__doc__.split())
    for name, doc in field_docs().items():
        assert f"{name}: {' '.join(doc.split())}" in helptext, name
    assert "kernelgraft.optimize(m, backend=\"eager\") is m" in helptext  # the doctest stays


def test_readme_links_point_at_files():
    """Every relative link of the README (docs pages, benchmark data, notebooks) names a file of the
    repository; mkdocs checks the docs pages' own links."""
    links = [t for t in re.findall(r"\]\(([^)]+)\)", README) if "://" not in t]
    assert len(links) >= 10
    missing = [t for t in links if not (ROOT / t.split("#")[0]).is_file()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
