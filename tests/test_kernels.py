"""kernels/: the generated source, and the cache it lives in."""

import os
import stat

import pytest
import torch

import kernelgraft
from kernelgraft.kernels import cache
from kernelgraft.patterns import REGISTRY


def test_source_returns_forward_and_backward():
    src = kernelgraft.kernels.source("rms_norm")
    # one row-block function, and entries for one launch per site and for a pair of sites
    assert src.forward.startswith("@triton.jit\ndef rms_norm__llama_fwd_rows(")
    assert "\ndef rms_norm__llama_fwd(" in src.forward and "\ndef rms_norm__llama_fwd2(" in src.forward
    assert src.backward.startswith("@triton.jit\ndef rms_norm__llama_bwd_rows(")
    assert "\ndef rms_norm__llama_bwd(" in src.backward and "\ndef rms_norm__llama_bwd2(" in src.backward
    assert "tl.rsqrt" in src.forward and "stats_ptr" in src.forward
    assert "acc_v_weight" in src.backward  # weight gradient: a column sum
    gem = kernelgraft.kernels.source("rms_norm", "gemma", dtype=torch.bfloat16)
    assert "_round_bf16" in gem.forward  # rounds once, at the end, like the spelling
    assert os.path.exists(gem.path)


def test_bf16_rounding_is_to_nearest_even_in_the_interpreter():
    # Triton's interpreter truncates x.to(tl.bfloat16); the generated helper must round like the GPU.
    from kernelgraft.kernels import op_for

    op = op_for(REGISTRY.get("rms_norm", "gemma"))
    x = torch.randn(64, 300, dtype=torch.bfloat16)
    w = torch.randn(300, dtype=torch.bfloat16) * 0.1
    ref = REGISTRY.get("rms_norm", "gemma").fn(x, w, 1e-6)
    assert torch.equal(op(x, w, 1e-6), ref)  # one rounding, at the same point: bit-identical


def test_cache_dir_env_private_and_checked(tmp_path, monkeypatch):
    d = tmp_path / "kg"
    monkeypatch.setenv("KERNELGRAFT_CACHE_DIR", str(d))
    assert cache.cache_dir() == d
    mod, path = cache.load_module("probe", "X = 1\n")
    assert mod.X == 1 and path.parent.parent == d
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # a truncated file is detected and rewritten
    path.write_text(path.read_text()[:5])
    assert not cache._intact(path)
    cache.load_module("probe", "X = 1\n")
    assert cache._intact(path)
    # a directory others can write is refused
    os.chmod(path.parent, 0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        cache.load_module("probe3", "X = 3\n")
    os.chmod(path.parent, 0o700)
