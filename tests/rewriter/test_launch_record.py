"""The report's `launched_by` (who launches each compiled graph's kernel calls) says the same when
inductor loads the graphs from its caches as when it compiles them: the post-grad pass does not run
on a cache hit, and its counts are read back from the record kept beside the cache."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch
from tiny import batch, tiny_model

import kernelgraft


def _one_step() -> tuple[Counter, int]:
    """A fresh model's training step with inductor, in a process whose compiled code is dropped
    first: its report's launched_by, and how many graphs inductor's caches served."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with (
        torch._inductor.config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=True),
    ):
        model = kernelgraft.optimize(tiny_model("llama", layers=1))
        model(**batch()).loss.backward()
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    return Counter(model.kernelgraft_report.launched_by), hits


@pytest.mark.slow  # three inductor compiles of a training step: over 20 s on a 2-core CPU
def test_launches_read_back_on_a_cache_hit(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cold, cold_hits = _one_step()
    warm, warm_hits = _one_step()
    assert cold_hits == 0 and warm_hits > 0, "the second step must be served by inductor's caches"
    assert sum(cold.values()) > 0, cold
    assert warm == cold
    # the record is what says it: without it, a cache hit counts nothing
    shutil.rmtree(tmp_path / "kernelgraft")
    bare, bare_hits = _one_step()
    assert bare_hits > 0 and sum(bare.values()) == 0, bare
    torch._dynamo.reset()
