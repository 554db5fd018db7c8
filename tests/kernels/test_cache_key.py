"""Inductor's caches are keyed by every kernel family's files (Family.cache_files, through the
post-grad pass's key): a change to a family's kernel code compiles the graphs anew instead of
loading graphs compiled with the old code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import batch, tiny_model

import kernelgraft
from kernelgraft.kernels import FAMILIES
from kernelgraft.rewriter.lowering import PostGradPass


def _lora_files_at(monkeypatch, tmp_path: Path, name: str, extra: str = "") -> None:
    """The LoRA family's kernel file as a copy named `name`, with `extra` appended."""
    lora = FAMILIES["lora"]
    first, *rest = type(lora).cache_files(lora)
    copy = tmp_path / name
    copy.write_text(Path(first).read_text() + extra)
    monkeypatch.setattr(type(lora), "cache_files", lambda self: (str(copy), *rest))


def test_every_family_keys_the_cache():
    for family in FAMILIES.values():
        assert family.cache_files(), family.name
        assert all(Path(f).is_file() for f in family.cache_files())


def test_the_row_kernels_generator_keys_the_cache():
    """A row kernel's source is generated: the files that generate it key the cache as its launcher's do."""
    from kernelgraft.kernels import derive, emit
    from kernelgraft.kernels.rows import codegen

    files = FAMILIES["row"].cache_files()
    assert {codegen.__file__, derive.__file__, emit.__file__} <= set(files)


def test_a_changed_lora_kernel_changes_the_cache_key(tmp_path, monkeypatch):
    _lora_files_at(monkeypatch, tmp_path, "kernel_a.py")
    same = PostGradPass().uuid()
    _lora_files_at(monkeypatch, tmp_path, "kernel_b.py")
    assert PostGradPass().uuid() == same  # the same code under another name: the same key
    _lora_files_at(monkeypatch, tmp_path, "kernel_c.py", "\n# the kernel changed\n")
    assert PostGradPass().uuid() != same


def _lora_step() -> tuple[int, int]:
    """A LoRA model's training step compiled by inductor afresh in this process: (graphs inductor's
    caches served, graphs it compiled)."""
    from peft import LoraConfig, get_peft_model
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    config = LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0, init_lora_weights=False)
    model = kernelgraft.optimize(get_peft_model(tiny_model("llama", layers=1), config))
    with (
        torch._inductor.config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=True),
    ):
        model(**batch()).loss.backward()
    assert model.kernelgraft_report.counts().get("lora") == 1
    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]


@pytest.mark.slow  # four inductor compiles of a LoRA training step: over 20 s on a 2-core CPU
def test_a_changed_lora_kernel_is_not_served_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    _lora_files_at(monkeypatch, tmp_path, "kernel_a.py")
    hits, misses = _lora_step()
    assert hits == 0 and misses > 0
    hits, misses = _lora_step()
    assert hits > 0 and misses == 0, "the same code must be served from the cache"
    _lora_files_at(monkeypatch, tmp_path, "kernel_b.py", "\n# the kernel changed\n")
    hits, misses = _lora_step()
    assert hits == 0 and misses > 0, "a changed LoRA kernel must compile anew"
    torch._dynamo.reset()


def test_another_torch_misses_inductors_cache(monkeypatch):
    """inductor keys a compiled graph by torch's own sources (torch_key) and, through kernelgraft's
    post-grad pass, by kernelgraft's kernel files: another torch, or another kernel, is another key."""
    import torch._inductor.codecache as codecache
    from torch._inductor import config as inductor_config

    gm = torch.fx.symbolic_trace(lambda x: x.sin() + 1)
    args = [torch.randn(4)]

    def key():
        with inductor_config.patch(post_grad_custom_post_pass=PostGradPass(fuse_residual=True)):
            return codecache.compiled_fx_graph_hash(gm, args, {}, [])[0]

    same = key()
    assert key() == same
    monkeypatch.setattr(codecache, "torch_key", lambda: b"another torch")
    assert key() != same
