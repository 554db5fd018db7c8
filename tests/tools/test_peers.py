"""benchmarks/peers.py without a network: the requirement walk over wheels' METADATA (extras and other
platforms left out, the image's packages never fetched, one version of each), the split into parts
a GPU call can carry, and the offline install of a wheel built here into a target folder."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import peers  # noqa: E402


def make_wheel(folder: Path, name: str, version: str, requires=(), pad: int = 0) -> Path:
    """A pure-Python wheel of a package `name` (module `name` with __version__), its METADATA
    listing `requires`; `pad` bytes of stored (uncompressed) data make it that much larger."""
    folder.mkdir(parents=True, exist_ok=True)
    mod = name.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{mod}/__init__.py": f"__version__ = {version!r}\n".encode(),
        f"{info}/METADATA": meta.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if pad:
        files[f"{mod}/pad.bin"] = os.urandom(pad)

    def record_line(path, data):
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(data)}\n"

    record = "".join(record_line(p, d) for p, d in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for p, d in files.items():
            z.writestr(p, d)
        z.writestr(f"{info}/RECORD", record)
    return path


def test_requirements_keep_what_applies_on_the_gpu_host(tmp_path):
    w = make_wheel(
        tmp_path,
        "top",
        "1.0",
        [
            "alpha>=1",
            'beta; extra == "docs"',
            'gamma; sys_platform == "win32"',
            'delta; python_version < "3.10"',
            'eps; platform_machine == "x86_64" and "linux" in sys_platform',
            'zeta<3; python_version >= "3.12"',
        ],
    )
    got = [str(r) for r in peers.requirements(peers.wheel_metadata(w))]
    assert got == ['alpha>=1', 'eps; platform_machine == "x86_64" and "linux" in sys_platform',
                   'zeta<3; python_version >= "3.12"']  # fmt: skip


# a fake index: name -> {version: requirements}
INDEX = {
    "top": {"1.0": ["mid", "leaf", "torch>=2", "nvidia-cublas-cu12", 'docsonly; extra == "docs"']},
    "mid": {"1.0": ["leaf<2"], "2.0": ["leaf<2", "pinme"]},
    "leaf": {"1.0": [], "1.6": [], "2.0": ["onlynew"]},
    "onlynew": {"1.0": []},
    "pinme": {"1.0": [], "3.0": []},
}


def fake_fetch(asked: list):
    def fetch(folder, reqs):
        from packaging.requirements import Requirement

        asked.append(list(reqs))
        for line in reqs:
            req = Requirement(line)
            best = max((v for v in INDEX[req.name] if req.specifier.contains(v)), key=Version)
            make_wheel(folder, req.name, best, INDEX[req.name][best])

    return fetch


def test_download_walks_the_closure_with_one_version_of_each(tmp_path):
    asked: list = []
    specs = peers.download(tmp_path, roots=("top==1.0",), fetch=fake_fetch(asked))
    got = sorted(peers.wheel_id(w) for w in peers.wheels(tmp_path))
    # leaf 2.0 came first (top asks any leaf), then mid's leaf<2 ruled it out: 1.6 replaced it, and
    # onlynew, which only leaf 2.0 needed, went with it; pinme took its pin, not the newest
    assert got == [("leaf", "1.6"), ("mid", "2.0"), ("pinme", "1.0"), ("top", "1.0")]
    assert specs["leaf"] == SpecifierSet("<2")
    flat = [r for call in asked for r in call]
    assert not any(r.startswith(("torch", "nvidia", "docsonly")) for r in flat)  # the image's, an extra's
    assert peers.one_version(tmp_path) == {}


@pytest.fixture(autouse=True)
def _pin(monkeypatch):
    monkeypatch.setattr(peers, "PINS", ("pinme==1.0",))


def test_one_version_names_a_package_with_two_wheels(tmp_path):
    make_wheel(tmp_path / "1", "leaf", "1.0")
    make_wheel(tmp_path / "2", "leaf", "1.6")
    make_wheel(tmp_path, "mid", "1.0")
    assert peers.one_version(tmp_path) == {"leaf": ["1.0", "1.6"]}


def test_split_fills_parts_under_the_limit_and_refuses_a_wheel_over_it(tmp_path):
    mib = 2**20
    sizes = {"a": 600_000, "b": 500_000, "c": 400_000, "d": 300_000, "e": 100_000}
    for name, pad in sizes.items():
        make_wheel(tmp_path, name, "1.0", pad=pad)
    parts = peers.split(tmp_path, part_mib=1.0)
    for part in parts:
        assert sum(w.stat().st_size for w in part) <= mib
    assert [sorted(peers.wheel_id(w)[0] for w in p) for p in parts] == [["a", "c"], ["b", "d", "e"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]
    assert peers.split(tmp_path, part_mib=1.0) == parts  # a second split keeps the parts
    make_wheel(tmp_path, "big", "1.0", pad=2 * mib)
    with pytest.raises(peers.PeersError, match="over --part-mib"):
        peers.split(tmp_path, part_mib=1.0)


def test_install_puts_the_wheels_in_the_target_and_says_what_is_unmet(tmp_path, capsys):
    make_wheel(tmp_path / "w" / "1", "kgtinypkg", "0.3.1", ["packaging>=1", "kg-absent-pkg>=2"])
    make_wheel(tmp_path / "w" / "2", "kgtinydep", "1.2")
    target = tmp_path / "site"
    assert peers.main(["install", "--wheels", str(tmp_path / "w"), "--target", str(target)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "kgtinypkg==0.3.1" in out and "kgtinydep==1.2" in out
    # packaging is the running Python's: met; the absent one is said
    assert [x for x in out if x.startswith("unmet")] == [
        "unmet: kgtinypkg needs kg-absent-pkg>=2 (have none)"
    ]
    assert out[-1] == f"export PYTHONPATH={target.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}"
    got = subprocess.run(
        [
            sys.executable,
            "-c",
            "import kgtinypkg, kgtinydep; print(kgtinypkg.__version__, kgtinydep.__version__)",
        ],
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
    )
    assert got.stdout.split() == ["0.3.1", "1.2"], got.stderr


def test_install_of_a_folder_without_wheels_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert peers.main(["install", "--wheels", str(tmp_path / "empty"), "--target", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no .whl under" in err
    assert peers.main(["install", "--wheels", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_the_pins_and_roots_are_the_peers_versions():
    from packaging.requirements import Requirement

    roots = {Requirement(r).name: str(Requirement(r).specifier) for r in peers.ROOTS}
    assert roots == {"unsloth": "==2026.10.9", "bitsandbytes": "==0.50.2", "liger-kernel": "==0.8.5"}
    assert "manylinux_2_24_x86_64" in peers.PLATFORMS  # bitsandbytes' wheel tag
    assert peers.in_image("Typing_Extensions") and peers.in_image("nvidia-nccl-cu12")
    assert not peers.in_image("trl") and not peers.in_image("datasets")


def test_slim_leaves_out_the_named_files_and_pip_installs_the_rest(tmp_path):
    w = make_wheel(tmp_path / "w", "kgslimpkg", "1.0", pad=200_000)
    drops = (("kgslimpkg", "kgslimpkg/pad.bin", "never loaded"),)
    before, after = peers.slim(w, drops)
    assert after < before / 10  # the incompressible padding was the bulk of it
    with zipfile.ZipFile(w) as z:
        names = z.namelist()
        record = z.read("kgslimpkg-1.0.dist-info/RECORD").decode()
        assert {i.compress_type for i in z.infolist() if i.file_size} == {zipfile.ZIP_LZMA}
    assert "kgslimpkg/pad.bin" not in names and "kgslimpkg/__init__.py" in names
    assert "pad.bin" not in record and "kgslimpkg/__init__.py," in record
    assert peers.slim(w, drops) == (after, after)  # slimmed once: kept as it is
    target = tmp_path / "site"
    assert peers.install(tmp_path / "w", target) == {"kgslimpkg": "1.0"}
    got = subprocess.run(
        [sys.executable, "-c", "import kgslimpkg; print(kgslimpkg.__version__)"],
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
    )
    assert got.stdout.split() == ["1.0"], got.stderr


def test_what_no_benchmark_imports_is_never_fetched(tmp_path):
    make_wheel(tmp_path, "top", "1.0", ["diffusers>=0.3", "hf-transfer", "kept>=1"])
    assert set(peers.needed(tmp_path, roots=("top==1.0",))) == {"top", "kept"}
