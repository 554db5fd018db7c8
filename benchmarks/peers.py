"""The peers' wheels (Unsloth, bitsandbytes, Liger) for a GPU host without a network: downloaded
here, carried there, installed there into a folder of their own put on PYTHONPATH.

    python benchmarks/peers.py download --out .peers     (with a network)
        the pinned peers and every dependency of theirs that the GPU image lacks, one version of each,
        as Linux x86_64 CPython 3.12 wheels; each slimmed (SLIM: the files the GPU host never loads
        left out, every member recompressed with LZMA, which pip reads); then split into .peers/1,
        .peers/2, ... of at most --part-mib each (a GPU call carries 64 MiB): each part is carried by a
        call of its own, or all in one call where they fit
    python benchmarks/peers.py install --wheels .peers --target .peers_site     (there, no network)
        every wheel under --wheels into --target (pip --no-index --no-deps); then each installed
        package's version, the requirements neither --target nor the running Python satisfy, and
        the PYTHONPATH to run with. Installing the parts in turn into one --target adds them up.

The walk follows each wheel's Requires-Dist (extras left out, markers evaluated for the GPU host)
and leaves out what the GPU image has (IMAGE: torch, triton, transformers, peft, numpy, the test
tools and their own dependencies)."""

from __future__ import annotations

import argparse
import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

# unsloth_zoo is added by the walk, at the version unsloth's own metadata asks for
ROOTS = ("unsloth==2026.10.9", "bitsandbytes==0.50.2", "liger-kernel==0.8.5")
# a package built against torch's C++ interface is pinned to the release made for the image's torch 2.11
PINS = ("torchvision==0.26.0",)
PYTHON = "3.12"
# glibc 2.28 and older (torch's wheels need 2.28): bitsandbytes' wheel is tagged manylinux_2_24, so every
# step down to manylinux2014 (2.17) is named
PLATFORMS = tuple(f"manylinux_2_{v}_x86_64" for v in range(28, 16, -1)) + (
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# the files of a wheel the GPU host never loads: (package, member glob, why). What imports the peers
# need stays; what is left out would only be loaded by a feature the benchmarks never use.
SLIM = (
    ("bitsandbytes", "bitsandbytes/libbitsandbytes_cuda1[0-2]*", "CUDA 10-12 builds: the image's torch is CUDA 13.0"),
    ("bitsandbytes", "bitsandbytes/libbitsandbytes_cuda132*", "CUDA 13.2 build: the image's torch is CUDA 13.0"),
    ("bitsandbytes", "bitsandbytes/libbitsandbytes_rocm*", "AMD builds"),
    ("bitsandbytes", "bitsandbytes/libbitsandbytes_xpu*", "Intel builds"),
    ("unsloth", "studio/*", "Unsloth Studio, a web interface"),
    ("pyarrow", "pyarrow/include/*", "C++ headers"),
    ("pyarrow", "pyarrow/src/*", "C++ sources"),
    ("pyarrow", "pyarrow/tests/*", "pyarrow's tests"),
    ("pyarrow", "pyarrow/*flight*", "Arrow Flight RPC"),
    ("pyarrow", "pyarrow/_substrait*", "Substrait query plans (its library stays: pyarrow.lib links it)"),
    ("pyarrow", "pyarrow/*_s3*", "S3 file system (pyarrow.fs imports it only if present)"),
    ("pyarrow", "pyarrow/_gcsfs*", "Google Cloud file system (likewise)"),
    ("pyarrow", "pyarrow/_azurefs*", "Azure file system (likewise)"),
    ("pyarrow", "pyarrow/_hdfs*", "HDFS file system (likewise)"),
    ("pandas", "pandas/tests/*", "pandas' tests"),
)
# packages a peer's metadata asks for that only features the benchmarks never use import (each found by
# reading the peers' imports): never downloaded, so that every wheel fits one GPU call's 64 MiB
UNUSED = {
    canonicalize_name("diffusers"): "Unsloth's diffusion-model trainer",
    canonicalize_name("hf-transfer"): "faster Hub downloads (Unsloth looks for it without importing it)",
}
# the GPU image's packages (torch 2.11 with its CUDA libraries, triton, transformers, peft, numpy, sympy,
# hypothesis, pytest) and their own dependencies: never downloaded, whatever version a peer names
IMAGE = frozenset(
    canonicalize_name(n)
    for n in """torch triton transformers peft numpy sympy mpmath hypothesis pytest filelock typing-extensions
    networkx jinja2 markupsafe fsspec setuptools huggingface-hub hf-xet tokenizers safetensors regex pyyaml
    packaging tqdm requests urllib3 idna certifi charset-normalizer httpx httpcore h11 anyio sniffio
    shellingham typer typer-slim click rich markdown-it-py mdurl pygments accelerate psutil attrs
    sortedcontainers iniconfig pluggy exceptiongroup tomli cuda-bindings cuda-pathfinder""".split()
)
# the markers of a requirement, evaluated for the GPU host; extra "" leaves every extra's requirements out
TARGET_ENV = dict(
    python_version=PYTHON,
    python_full_version=f"{PYTHON}.0",
    implementation_name="cpython",
    implementation_version=f"{PYTHON}.0",
    platform_python_implementation="CPython",
    sys_platform="linux",
    platform_system="Linux",
    platform_machine="x86_64",
    os_name="posix",
    platform_release="",
    platform_version="",
    extra="",
)


class PeersError(Exception):
    """A step that cannot go on: its message says what was wrong and what to do."""


def in_image(name: str) -> bool:
    n = canonicalize_name(name)
    return n in IMAGE or n.startswith("nvidia-")


def wheel_id(path: Path) -> tuple[str, str]:
    """(canonical name, version) of a wheel, from its file name."""
    name, version, _, _ = parse_wheel_filename(path.name)
    return canonicalize_name(name), str(version)


def wheel_metadata(path: Path) -> email.message.Message:
    """The METADATA of a wheel's .dist-info."""
    with zipfile.ZipFile(path) as z:
        found = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if not found:
            raise PeersError(
                f"{path.name} has no .dist-info/METADATA: not a wheel; delete it and download again"
            )
        return email.message_from_bytes(z.read(found[0]))


def requirements(meta: email.message.Message, env: dict | None = None) -> list[Requirement]:
    """The Requires-Dist entries that apply on the GPU host: those of an extra, or whose marker is
    false there, are left out."""
    env = env or TARGET_ENV
    out = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out.append(req)
    return out


def wheels(folder: Path) -> list[Path]:
    """Every .whl under folder (its parts' subfolders too), sorted by name."""
    return sorted(Path(folder).rglob("*.whl"), key=lambda p: p.name)


def one_version(folder: Path) -> dict[str, list[str]]:
    """{name: [versions]} of the packages with more than one wheel under folder (should be none)."""
    seen: dict[str, list[str]] = {}
    for w in wheels(folder):
        name, version = wheel_id(w)
        seen.setdefault(name, []).append(version)
    return {n: sorted(v) for n, v in seen.items() if len(v) > 1}


def needed(folder: Path, roots=ROOTS, pins=None) -> dict[str, SpecifierSet]:
    """{name: the specifiers every requirement on it asks together}: the roots, and the requirements
    of every wheel under folder reachable from them, the image's packages left out; a name of `pins`
    takes its pin too, when something requires it."""
    by_name = {wheel_id(w)[0]: w for w in wheels(folder)}
    pinned = {canonicalize_name(Requirement(p).name): Requirement(p).specifier for p in pins or PINS}
    specs: dict[str, SpecifierSet] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if in_image(name) or name in UNUSED:
            continue
        first = name not in specs
        specs[name] = specs.get(name, pinned.get(name, SpecifierSet())) & req.specifier
        if first and name in by_name:
            todo.extend(requirements(wheel_metadata(by_name[name])))
    return specs


def missing(folder: Path, specs: dict[str, SpecifierSet]) -> dict[str, SpecifierSet]:
    """The needed names with no wheel under folder whose version their specifiers allow."""
    have = {}
    for w in wheels(folder):
        name, version = wheel_id(w)
        have.setdefault(name, []).append(version)
    return {
        n: s for n, s in specs.items() if not any(s.contains(v, prereleases=True) for v in have.get(n, []))
    }


def pip_download(folder: Path, reqs: list[str]) -> None:
    """pip download of reqs, no dependencies, wheels for CPython 3.12 on Linux x86_64 only."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", PYTHON, "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += ["-d", str(folder), *reqs]
    print("+", " ".join(cmd), flush=True)
    got = subprocess.run(cmd, capture_output=True, text=True)
    if got.returncode != 0:
        tail = (got.stderr or got.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise PeersError(f"pip download of {' '.join(reqs)} failed: {tail[0]}")


def download(folder: Path, roots=ROOTS, fetch=pip_download, rounds: int = 20) -> dict[str, SpecifierSet]:
    """Fetch the roots and their requirements' closure into folder until every needed name has one
    wheel its specifiers allow; a wheel of another version, or of a name no longer needed, is deleted.
    `fetch(folder, ["name<spec>", ...])` downloads (pip_download; the tests pass their own)."""
    folder.mkdir(parents=True, exist_ok=True)
    for _ in range(rounds):
        specs = needed(folder, roots)
        lack = missing(folder, specs)
        if not lack:
            break
        for w in wheels(folder):  # the versions a newer specifier rules out go
            if wheel_id(w)[0] in lack:
                w.unlink()
        fetch(folder, [f"{n}{s}" for n, s in sorted(lack.items())])
    else:
        raise PeersError(f"the requirements did not settle in {rounds} rounds: {sorted(lack)}")
    for w in wheels(folder):
        name, version = wheel_id(w)
        if name not in specs or not specs[name].contains(version, prereleases=True):
            w.unlink()
    twice = one_version(folder)
    if twice:
        raise PeersError(
            f"more than one version of {twice} under {folder}: delete the folder and download again"
        )
    return specs


def slim(path: Path, drops=SLIM) -> tuple[int, int]:
    """Rewrite the wheel at path without the members `drops` names for its package, every member
    recompressed with LZMA (pip installs through Python's zipfile, which reads it) and its RECORD
    without the dropped files' lines. (bytes before, bytes after); a wheel already slimmed is kept."""
    import fnmatch

    name = wheel_id(path)[0]
    globs = [g for pkg, g, _ in drops if canonicalize_name(pkg) == name]
    before = path.stat().st_size
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        if all(i.compress_type == zipfile.ZIP_LZMA for i in infos if i.file_size):
            return before, before
        kept = [i for i in infos if not any(fnmatch.fnmatch(i.filename, g) for g in globs)]
        gone = {i.filename for i in infos} - {i.filename for i in kept}
        tmp = path.with_suffix(".slim")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as out:
            for i in kept:
                data = z.read(i)
                if i.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(ln for ln in lines if ln.split(",", 1)[0] not in gone).encode()
                info = zipfile.ZipInfo(i.filename, i.date_time)
                info.external_attr, info.compress_type = i.external_attr, zipfile.ZIP_LZMA
                out.writestr(info, data)
    tmp.replace(path)
    return before, path.stat().st_size


def image_requirements(folder: Path) -> list[str]:
    """What the wheels under folder ask of the image's packages ("wheel: requirement"): the image's
    versions must meet them (`install` checks them there)."""
    out = []
    for w in wheels(folder):
        name, version = wheel_id(w)
        out += [f"{name} {version}: {r}" for r in requirements(wheel_metadata(w)) if in_image(r.name)]
    return out


def split(folder: Path, part_mib: float) -> list[list[Path]]:
    """Move the wheels into folder/1, folder/2, ... each at most part_mib (the largest first, each into
    the first part it fits); a wheel larger than part_mib alone is an error."""
    limit = part_mib * 2**20
    parts: list[list[Path]] = []
    sizes: list[int] = []
    for w in sorted(wheels(folder), key=lambda p: -p.stat().st_size):
        size = w.stat().st_size
        if size > limit:
            raise PeersError(f"{w.name} is {size / 2**20:.1f} MiB, over --part-mib {part_mib}: raise it")
        for i, used in enumerate(sizes):  # noqa: B007 - i is the part the wheel goes to
            if used + size <= limit:
                break
        else:
            parts.append([])
            sizes.append(0)
            i = len(parts) - 1
        sizes[i] += size
        parts[i].append(w)
    out = []
    for i, ws in enumerate(parts, 1):
        (folder / str(i)).mkdir(exist_ok=True)
        moved = []
        for w in ws:
            dest = folder / str(i) / w.name
            if w != dest:
                shutil.move(str(w), dest)
            moved.append(dest)
        out.append(moved)
    for d in folder.iterdir():  # parts left empty by an earlier split
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    return out


def installed(target: Path) -> dict[str, str]:
    """{name: version} of the distributions in target."""
    from importlib.metadata import distributions

    return {canonicalize_name(d.metadata["Name"]): d.version for d in distributions(path=[str(target)])}


def unmet(target: Path) -> list[str]:
    """The requirements of target's distributions (markers evaluated for this Python) that neither
    target nor the running Python's site-packages satisfy: what would fail at import."""
    from importlib.metadata import PackageNotFoundError, distributions, version

    here = installed(target)
    out = []
    for d in distributions(path=[str(target)]):
        for line in d.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = canonicalize_name(req.name)
            have = here.get(name)
            if have is None:
                try:
                    have = version(req.name)
                except PackageNotFoundError:
                    have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                out.append(f"{d.metadata['Name']} needs {req} (have {have or 'none'})")
    return out


def install(folder: Path, target: Path) -> dict[str, str]:
    """pip install of every wheel under folder into target, offline, no dependencies resolved."""
    ws = wheels(folder)
    if not ws:
        raise PeersError(f"no .whl under {folder}: carry the folder `peers.py download` filled")
    target.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
    cmd += ["--disable-pip-version-check", "--target", str(target), *map(str, ws)]
    got = subprocess.run(cmd, capture_output=True, text=True)
    if got.returncode != 0:
        tail = (got.stderr or got.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise PeersError(f"pip install into {target} failed: {tail[0]}")
    return installed(target)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="peers.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download", help="fetch the peers' wheels (needs a network)")
    d.add_argument("--out", default=".peers", type=Path, help="folder of the wheels (default: %(default)s)")
    d.add_argument(
        "--part-mib", type=float, default=60.0, help="most MiB of one part folder (default: %(default)s)"
    )
    i = sub.add_parser("install", help="install the wheels offline into a folder")
    i.add_argument(
        "--wheels", default=".peers", type=Path, help="folder of the wheels (default: %(default)s)"
    )
    i.add_argument("--target", default=".peers_site", type=Path, help="install folder (default: %(default)s)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "download":
            specs = download(a.out)
            for w in wheels(a.out):
                before, after = slim(w)
                if after < before:
                    print(f"slimmed {w.name}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
            parts = split(a.out, a.part_mib)
            for n, ws in enumerate(parts, 1):
                mib = sum(w.stat().st_size for w in ws) / 2**20
                print(f"{a.out}/{n}: {mib:.1f} MiB, {len(ws)} wheels")
                for w in ws:
                    print(f"  {w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
            for line in image_requirements(a.out):
                print(f"of the image: {line}")
            print(
                f"{len(specs)} packages; carry each of {', '.join(f'{a.out}/{n}' for n in range(1, len(parts) + 1))}"
            )
        else:
            if not a.wheels.is_dir():
                raise PeersError(
                    f"--wheels {a.wheels} is not a folder: carry the folder `peers.py download` filled"
                )
            got = install(a.wheels, a.target)
            for name, version in sorted(got.items()):
                print(f"{name}=={version}")
            for line in unmet(a.target):
                print(f"unmet: {line}")
            print(f"export PYTHONPATH={a.target.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}")
    except PeersError as e:
        print(f"peers.py {a.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
