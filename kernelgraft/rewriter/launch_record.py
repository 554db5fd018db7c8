"""Who launches each compiled graph's kernel calls, kept beside inductor's cache.

kernelgraft's post-grad pass (lowering.PostGradPass) counts, per graph inductor compiles, the kernel
calls inductor's generated code launches and those left to the host. A graph inductor loads from its
caches runs no post-grad pass, so those counts are written here when the graph is compiled, keyed by
what the compiled code depends on, and read back on a cache hit: the report's `launched_by` then says
the same on a warm start as on a cold one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path


def _folder() -> Path:
    try:  # inductor's cache folder (TORCHINDUCTOR_CACHE_DIR where set); its module moved between releases
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # pragma: no cover - older torch
        from torch._inductor.runtime.runtime_utils import cache_dir
    return Path(cache_dir()) / "kernelgraft" / "launches"


def graph_key(*parts) -> str:
    """A key for one compiled graph from what its code depends on (the grafted graph's code, its
    inputs' sizes and dtypes, the options and the pass's own key)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


class LaunchRecord:
    """The launch counts of one compile: its forward and backward graphs, each added to `into`
    (the report's Counter) once, whether the pass counted it or it was read back from the record."""

    def __init__(self, key: str, into: Counter):
        self.key, self.into = key, into
        self.parts: dict[str, dict] = {}  # "forward" / "backward" -> counts, as counted or read back
        self.read_back: set[str] = set()

    @property
    def path(self) -> Path:
        return _folder() / f"{self.key}.json"

    def counted(self, part: str, counts: Counter) -> None:
        """What the pass counted in the compile's `part` graph: into the report (unless read back
        already) and into the record on disk."""
        if part not in self.read_back:
            self.into.update(counts)
        self.parts[part] = dict(counts)
        self._write()

    def read_missing(self) -> None:
        """After the compile: the parts the pass did not count (loaded from inductor's caches, or a
        backward not compiled yet) read back from the record, where one was written."""
        try:
            stored = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return  # no record: a graph compiled before records were kept, or a read-only cache
        for part, counts in stored.items():
            if part not in self.parts and isinstance(counts, dict):
                self.parts[part] = counts
                self.read_back.add(part)
                self.into.update(counts)

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.parts, sort_keys=True))
            os.replace(tmp, self.path)  # whole or not at all, for processes that share the cache
        except OSError:
            pass  # a read-only cache: the counts stay right for this process


def part_of(graph) -> str:
    """"backward" for a post-grad graph that takes the outputs' gradients, else "forward"."""
    return "backward" if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes) else "forward"
