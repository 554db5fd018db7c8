"""The per-user kernel cache: generated source files, written atomically, checked before loading.

Layout: <cache_dir>/triton-<version>/<kernel name>_<key>.py, each file ending in a line with the
sha256 of what precedes it. A file that cannot be read, is not UTF-8, or fails the check (truncated,
edited) is regenerated; so is anything that is not a regular file (a directory; a named pipe, which
would block the reader), warned once. Every directory kernelgraft creates is made 0700 whatever the
umask, and code is never loaded from a directory that another user owns or that group or others can
write: such a directory is refused with one warning that names it and says what to do, and the
kernels then fall back to the stock code.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import stat
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton

from .fallback import warn_once
from .launching import INTERPRETER

_SEAL = "# kernelgraft-sha256: "
# this process's loads of generated kernels: "hit" (the cached file was intact) or "written"
STATS: Counter = Counter()


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


class CacheRefused(PermissionError):
    """The cache directory is not private: no generated code is loaded from it (warned once)."""

    warned = True


def _make_private(d: Path) -> None:
    """Create d and its missing parents, each 0700 whatever the umask (mkdir's mode is masked by it)."""
    missing = []
    p = d
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first: checked below like any directory
            continue
        os.chmod(p, 0o700)


def _refusal(p: Path) -> str | None:
    st = p.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it is owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _safe_dir() -> Path:
    d = cache_dir() / f"triton-{triton.__version__}"
    _make_private(d)
    for p in (cache_dir(), d):
        why = _refusal(p)
        if why:
            msg = (
                f"kernelgraft: refusing to load generated code from {p}: {why}. kernelgraft's kernels "
                f"are off in this process (every site runs its stock PyTorch code). To fix: `chmod 700 {p}` "
                "if it is yours, or set KERNELGRAFT_CACHE_DIR to a directory of your own."
            )
            warn_once(("cache", str(p)), msg)
            e = CacheRefused(msg)
            e.short = f"the kernel cache {p} is not private ({why}); see the warning"
            raise e
    return d


def _sealed(text: str) -> str:
    return text + _SEAL + hashlib.sha256(text.encode()).hexdigest() + "\n"


def _kind(path: Path) -> str | None:
    """What path is where it is not a regular file (a link is followed), else None (missing too)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a named pipe", stat.S_ISSOCK: "a socket"}
    return next((name for test, name in kinds.items() if test(mode)), "a device")


def _intact(path: Path) -> bool:
    if _kind(path):  # opening a named pipe would wait for a writer: never read
        return False
    try:
        data = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):  # unreadable, missing, a directory, not UTF-8
        return False
    head, sep, tail = data.rpartition(_SEAL)
    return bool(sep) and tail.strip() == hashlib.sha256(head.encode()).hexdigest()


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@functools.cache
def _interpreted() -> type:
    """Triton's InterpretedFunction whose launches hold launching.INTERPRETER: one thread at a time."""
    from triton.runtime.interpreter import InterpretedFunction

    class Interpreted(InterpretedFunction):
        def run(self, *args, **kwargs):
            with INTERPRETER:
                return super().run(*args, **kwargs)

    return Interpreted


def load_module(name: str, source: str, *, interpret: bool = False):
    """Write `source` (if missing or damaged) under the cache and import it as a module.

    interpret=True imports a second instance whose @triton.jit helpers are Triton-interpreter
    functions: the interpreter cannot run a compiled JITFunction, and one process runs both."""
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = _safe_dir() / f"{name}_{key}.py"
    intact = _intact(path)
    STATS["hit" if intact else "written"] += 1
    if not intact:
        kind = _kind(path)
        if kind:
            warn_once(
                ("cache entry", str(path)),
                f"kernelgraft: the kernel cache entry {path} is not a regular file ({kind}); it is "
                "replaced with the generated kernel's source.",
            )
        if path.is_dir() and not path.is_symlink():  # a directory in the file's place
            shutil.rmtree(path)
        write_atomic(path, _sealed(source))
    modname = f"kernelgraft_generated.{name}_{key}" + ("_interp" if interpret else "")
    if modname in sys.modules:
        return sys.modules[modname], path
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    mod.INTERPRETED = interpret  # read by the generated header (its bf16 rounding)
    spec.loader.exec_module(mod)
    if interpret:
        from triton.runtime.jit import JITFunction

        for k, v in list(vars(mod).items()):
            if isinstance(v, JITFunction):
                setattr(mod, k, _interpreted()(v.fn))
    sys.modules[modname] = mod
    return mod, path
