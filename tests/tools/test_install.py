"""What a new user gets from `pip install kernelgraft` (no extras): the package builds and installs
offline into a clean virtual environment, and every module imports there without the `test` and
`plots` extras (hypothesis, pytest, matplotlib). kernelgraft.gradcheck.strategies needs hypothesis: it
must fail with a message naming the extra to install.

No network: the wheel is built with this environment's setuptools (--no-build-isolation --no-index),
and the clean environment gets the declared runtime dependencies, and what they require, from this
environment, as symbolic links to their installed files (nothing is downloaded or copied)."""

import email.parser
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
EXTRAS_ONLY = ("hypothesis", "pytest", "matplotlib")  # only in the test and plots extras
PUBLIC = [
    "kernelgraft",
    "kernelgraft.cli",
    "kernelgraft.patterns",
    "kernelgraft.kernels",
    "kernelgraft.rewriter",
    "kernelgraft.gradcheck",
]
NEEDS_TEST_EXTRA = "kernelgraft.gradcheck.strategies"
HINT = "pip install 'kernelgraft[test]'"

# no pip configuration, index, prompt or cache of the machine running the tests
PIP_ENV = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_NO_CACHE_DIR": "1", "PIP_NO_INDEX": "1"}  # fmt: skip


def _clean_env(**extra) -> dict:
    """The environment of a subprocess: nothing that adds to sys.path, no user site, and no .pyc
    written (the linked dependencies' directories belong to the environment running the tests)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _run(cmd, cwd, **env) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=_clean_env(**env))
    shown = " ".join(str(c) if len(str(c)) < 200 else "..." for c in cmd)
    assert r.returncode == 0, f"{shown} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def _copy_source(dst: Path) -> Path:
    """The files a build reads: the top-level files (pyproject.toml, README.md, ...) and the package.
    Built from a copy: an in-tree build leaves build/ in the checkout, and setuptools packs whatever
    build/lib still holds, modules since moved or deleted included."""
    dst.mkdir()
    for p in ROOT.iterdir():
        if p.is_file():
            shutil.copy2(p, dst / p.name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "kernelgraft", dst / "kernelgraft", ignore=ignore)
    return dst


def _requirements(reqs, extras=("",)) -> list[Requirement]:
    """Those of `reqs` that apply here, with the given extras of their distribution requested."""
    out = []
    for r in map(Requirement, reqs or []):
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras):
            out.append(r)
    return out


def runtime_closure(metadata: str) -> dict[str, md.Distribution]:
    """The installed distributions that the wheel's Requires-Dist (without extras) needs, recursively,
    found in the environment running this test."""
    todo = _requirements(email.parser.Parser().parsestr(metadata).get_all("Requires-Dist"))
    found: dict[str, md.Distribution] = {}
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        r = todo.pop()
        key = (canonicalize_name(r.name), frozenset(r.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(r.name)
        except md.PackageNotFoundError:  # not needed on this platform, or this environment runs without it
            continue
        found[key[0]] = dist
        todo += _requirements(dist.requires, ("", *r.extras))
    return found


def _link(src: Path, dst: Path) -> None:
    """dst -> src; where two distributions share a directory (a namespace package), a real directory
    with links to the children of both."""
    if not dst.exists() and not dst.is_symlink():
        dst.symlink_to(src, target_is_directory=src.is_dir())
        return
    if not (src.is_dir() and dst.is_dir()):
        return  # the same file from two distributions: the first one stays
    if dst.is_symlink():
        first = dst.resolve()
        dst.unlink()
        dst.mkdir()
        for child in first.iterdir():
            _link(child, dst / child.name)
    for child in src.iterdir():
        _link(child, dst / child.name)


def link_distributions(dists, site: Path) -> None:
    for dist in dists:
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD: cannot tell its files"
        base = Path(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(tops):
            if (base / top).exists():
                _link(base / top, site / top)


IMPORT_ALL = r"""
import importlib, importlib.util, json, pkgutil, sys, traceback
import kernelgraft

public, needs_test_extra = json.loads(sys.argv[1])
names, failed = list(public), {}
for m in pkgutil.walk_packages(kernelgraft.__path__, "kernelgraft.", onerror=lambda n: failed.setdefault(n, traceback.format_exc())):
    if m.name not in names:
        names.append(m.name)
for name in names:
    if name in (needs_test_extra, "kernelgraft.__main__"):  # __main__ runs the command line: run below
        continue
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc()
strategies = []
for how in ("import", "attribute"):
    sys.modules.pop(needs_test_extra, None)
    try:
        importlib.import_module(needs_test_extra) if how == "import" else kernelgraft.gradcheck.strategies
        strategies.append(None)
    except ImportError as e:
        strategies.append(f"{type(e).__name__}: {e}")
print(json.dumps(dict(
    file=kernelgraft.__file__, names=names, failed=failed, strategies=strategies,
    hypothesis=importlib.util.find_spec("hypothesis") is not None,
    extras_loaded=sorted(m for m in ("hypothesis", "pytest", "matplotlib") if m in sys.modules),
)))
"""


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
def test_installs_without_extras_and_every_module_imports(tmp_path):
    src = _copy_source(tmp_path / "src")
    # the wheel, offline, with this environment's setuptools; -v shows the build backend's warnings
    build = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                  "-w", tmp_path / "wheels", src], tmp_path, **PIP_ENV)  # fmt: skip
    log = build.stdout + build.stderr
    warned = [line for line in log.splitlines() if re.search(r"licen[sc]e", line, re.I) and "arn" in line]
    assert not warned, "the build warns about the license:\n" + "\n".join(warned)
    (wheel,) = (tmp_path / "wheels").glob("kernelgraft-*.whl")
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        packed = z.namelist()
    assert "License-Expression: Apache-2.0" in metadata
    assert not [n for n in packed if n.startswith(("tests/", "benchmarks/", "notebooks/"))]
    # every file of the package is in the wheel: modules, and the data they read (package-data)
    files = sorted(p.relative_to(src).as_posix() for p in (src / "kernelgraft").rglob("*") if p.is_file())
    missing = [f for f in files if f not in packed]
    assert not missing, (
        f"files of the package missing from the wheel (pyproject.toml package-data?): {missing}"
    )

    # a clean environment: no system site-packages, no pip; the wheel installed without extras
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", wheel], tmp_path, **PIP_ENV)

    # the runtime dependencies, from this environment, linked into the clean one
    deps = runtime_closure(metadata)
    names = set(deps)
    assert {"torch", "triton", "transformers", "sympy", "peft", "tqdm"} <= names, sorted(names)
    assert not names & set(EXTRAS_ONLY), (
        f"a runtime dependency needs an extra: {sorted(names & set(EXTRAS_ONLY))}"
    )
    site = Path(
        _run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path).stdout.strip()
    )
    link_distributions(deps.values(), site)

    # the extras are out of sight there, and the checkout is not on the path (cwd is tmp_path)
    probe = "import importlib.util as u, json, sys; print(json.dumps([u.find_spec(m) is not None for m in sys.argv[1:]]))"
    r = _run([py, "-c", probe, *EXTRAS_ONLY], tmp_path)
    assert json.loads(r.stdout) == [False] * len(EXTRAS_ONLY), (
        f"the clean environment sees {EXTRAS_ONLY}: {r.stdout}"
    )

    r = _run([py, "-c", IMPORT_ALL, json.dumps([PUBLIC, NEEDS_TEST_EXTRA])], tmp_path)
    got = json.loads(r.stdout.splitlines()[-1])
    assert Path(got["file"]).is_relative_to(site), got["file"]
    assert not got["failed"], "modules that do not import without the extras:\n\n" + "\n".join(
        f"{name}:\n{tb}" for name, tb in got["failed"].items()
    )
    assert set(PUBLIC) <= set(got["names"]) and NEEDS_TEST_EXTRA in got["names"]
    assert not got["hypothesis"] and got["extras_loaded"] == []
    for how, err in zip(("import", "attribute access"), got["strategies"]):
        assert err is not None, f"{NEEDS_TEST_EXTRA} imported ({how}) without hypothesis"
        assert err.startswith("ImportError") and HINT in err and "hypothesis" in err, err

    # the command line, both ways in
    assert _run([venv / "bin" / "kernelgraft", "--help"], tmp_path).stdout.startswith("usage: kernelgraft")
    assert (
        "rms_norm:\n  llama(x, weight, eps: Scalar)"
        in _run([py, "-m", "kernelgraft", "patterns"], tmp_path).stdout
    )


def test_import_kernelgraft_does_not_import_the_extras():
    """Here, where hypothesis is installed: `import kernelgraft` still leaves it (and pytest,
    matplotlib) unimported; gradcheck.strategies comes on first use."""
    code = (
        "import sys, kernelgraft, kernelgraft.gradcheck, kernelgraft.cli\n"
        f"print(sorted(m for m in {EXTRAS_ONLY!r} if m in sys.modules))\n"
        "s = kernelgraft.gradcheck.strategies\n"
        "print(s.__name__, 'hypothesis' in sys.modules)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=_clean_env()
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["[]", "kernelgraft.gradcheck.strategies True"]


def test_strategies_without_hypothesis_names_the_extra(monkeypatch):
    import kernelgraft.gradcheck

    monkeypatch.setitem(sys.modules, "hypothesis", None)  # import hypothesis -> ImportError
    monkeypatch.delitem(sys.modules, NEEDS_TEST_EXTRA, raising=False)
    if "strategies" in vars(kernelgraft.gradcheck):  # imported by an earlier test (not hasattr: it imports)
        monkeypatch.delitem(vars(kernelgraft.gradcheck), "strategies")
    with pytest.raises(ImportError, match=re.escape(HINT)):
        kernelgraft.gradcheck.strategies  # noqa: B018
    with pytest.raises(ImportError, match=re.escape(HINT)):
        from kernelgraft.gradcheck import strategies  # noqa: F401
