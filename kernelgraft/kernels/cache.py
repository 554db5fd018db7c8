"""The per-user kernel cache: generated source files, written atomically, checked before loading.

Layout: <cache_dir>/triton-<version>/<kernel name>_<key>.py, each file ending in a line with the
sha256 of what precedes it. A truncated or edited file fails the check and is regenerated. The
directory is created 0700, and code is never loaded from a directory that others can write.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
import sys
import tempfile
from pathlib import Path

import triton

_SEAL = "# kernelgraft-sha256: "


def cache_dir() -> Path:
    """Where generated kernels live: $KERNELGRAFT_CACHE_DIR, else ~/.cache/kernelgraft (XDG).

    >>> import os, kernelgraft
    >>> os.environ["KERNELGRAFT_CACHE_DIR"] = "/tmp/kg-doc-cache"
    >>> str(kernelgraft.kernels.cache_dir())
    '/tmp/kg-doc-cache'
    >>> del os.environ["KERNELGRAFT_CACHE_DIR"]
    """
    env = os.environ.get("KERNELGRAFT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kernelgraft"


def _safe_dir() -> Path:
    d = cache_dir() / f"triton-{triton.__version__}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for p in (cache_dir(), d):
        st = p.stat()
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(
                f"kernelgraft: refusing to load generated code from {p}: it is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o}). Run `chmod 700 {p}` or set KERNELGRAFT_CACHE_DIR "
                "to a private directory."
            )
    return d


def _sealed(text: str) -> str:
    return text + _SEAL + hashlib.sha256(text.encode()).hexdigest() + "\n"


def _intact(path: Path) -> bool:
    try:
        data = path.read_text()
    except OSError:
        return False
    head, sep, tail = data.rpartition(_SEAL)
    return bool(sep) and tail.strip() == hashlib.sha256(head.encode()).hexdigest()


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_module(name: str, source: str, *, interpret: bool = False):
    """Write `source` (if missing or damaged) under the cache and import it as a module.

    interpret=True imports a second instance whose @triton.jit helpers are Triton-interpreter
    functions: the interpreter cannot run a compiled JITFunction, and one process runs both."""
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = _safe_dir() / f"{name}_{key}.py"
    if not _intact(path):
        write_atomic(path, _sealed(source))
    modname = f"kernelgraft_generated.{name}_{key}" + ("_interp" if interpret else "")
    if modname in sys.modules:
        return sys.modules[modname], path
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    mod.INTERPRETED = interpret  # read by the generated header (its bf16 rounding)
    spec.loader.exec_module(mod)
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for k, v in list(vars(mod).items()):
            if isinstance(v, JITFunction):
                setattr(mod, k, InterpretedFunction(v.fn))
    sys.modules[modname] = mod
    return mod, path
