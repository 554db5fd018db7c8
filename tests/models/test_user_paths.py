"""Where a user's run could quietly lose its kernels or crash for the wrong reason: the cache's
permissions and damaged files, copies of an optimized model, autocast, torch.compile of an
optimized model, hooks. Each is compared with the stock model or checked for a warning."""

from __future__ import annotations

import copy
import io
import os
import pickle
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from tiny import batch, compare_models, loss_and_grads, tiny_model

import kernelgraft
from kernelgraft.gradcheck import judge
from kernelgraft.kernels import cache
from kernelgraft.kernels.lm_head import kernel as lm_kernel
from kernelgraft.kernels.rows import row_kernel
from kernelgraft.patterns import REGISTRY

FULL = {"rms_norm": 5, "lm_head_ce": 1, "rope": 4, "gated_mlp": 2}  # a 2-layer tiny Llama


def _kernelgraft_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "kernelgraft" in str(w.message)]


# ---- the kernel cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o002, 0o022])
def test_every_directory_the_cache_creates_is_private_whatever_the_umask(tmp_path, monkeypatch, mask):
    d = tmp_path / "a" / "b" / "kg"  # three missing levels
    monkeypatch.setenv("KERNELGRAFT_CACHE_DIR", str(d))
    old = os.umask(mask)
    try:
        mod, path = cache.load_module("probe_umask", "X = 7\n")
    finally:
        os.umask(old)
    assert mod.X == 7
    for p in (tmp_path / "a", tmp_path / "a" / "b", d, path.parent):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p


@pytest.mark.slow  # over 20 s on a 2-core CPU
def test_a_fresh_cache_under_umask_002_gives_every_kernel_and_trains(tmp_path):
    """A fresh process as an ordinary Debian/Ubuntu user runs it (umask 002, a new cache): every site
    served, one training step with the default (inductor) backend, no warning. (Under 022 the rest
    of the suite runs; the directories' modes under both are checked above.)"""
    mask = "002"
    script = textwrap.dedent(
        """
        import os, sys, warnings
        sys.path.insert(0, {tests!r})
        os.umask(0o{mask})
        warnings.simplefilter("always")
        import kernelgraft
        from tiny import batch, tiny_model
        b = batch()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("counts", kernelgraft.explain(tiny_model("llama"), **b).counts())
            m = kernelgraft.optimize(tiny_model("llama"))
            m(**b).loss.backward()
        print("served", m.kernelgraft_report.counts())
        print("warned", [str(w.message)[:200] for w in caught if "kernelgraft" in str(w.message)])
        """
    ).format(tests=str(Path(__file__).resolve().parents[1] / "helpers"), mask=mask)
    env = dict(os.environ, KERNELGRAFT_CACHE_DIR=str(tmp_path / "fresh" / "kg"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["counts"] == str(FULL) and lines["served"] == str(FULL), out.stdout
    assert lines["warned"] == "[]", out.stdout
    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o700


def test_a_cache_directory_others_can_write_is_refused_with_one_warning(tmp_path, monkeypatch):
    d = tmp_path / "kg"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o775)
    monkeypatch.setenv("KERNELGRAFT_CACHE_DIR", str(d))
    monkeypatch.setattr(kernelgraft._warnings, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("probe_refused_a", "probe_refused_b"):
            with pytest.raises(cache.CacheRefused, match="writable by group or others"):
                cache.load_module(name, "X = 1\n")
    said = _kernelgraft_warnings(caught)
    assert len(said) == 1, said
    assert str(d) in said[0] and f"chmod 700 {d}" in said[0] and "KERNELGRAFT_CACHE_DIR" in said[0]
    # a site falls back, reported, with nothing more said (its kernel built anew, not taken from
    # the process's memo of kernels built earlier)
    from kernelgraft.kernels.rows import build

    monkeypatch.setattr(build, "_row_kernel", build._row_kernel.__wrapped__)
    sp = REGISTRY.get("rms_norm", "llama")
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        refused = kernelgraft.kernels.family_of(sp).refusal(
            sp, {"x": torch.empty(3, 16), "weight": torch.empty(16)}, "autograd", None, True
        )
    assert refused is not None and "not private" in refused and str(d) in refused
    assert _kernelgraft_warnings(later) == []


def _damage(path, how: str) -> None:
    if how == "truncated":
        path.write_text(path.read_text()[:40])
    elif how == "edited":
        text = path.read_text()
        path.write_text(text.replace("tl.", "tl .", 1))
    elif how == "not utf-8":
        with open(path, "ab") as f:
            f.write(b"\xff\xfe\x80")
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "a directory":
        path.unlink()
        path.mkdir()
        (path / "x").write_text("")


@pytest.mark.parametrize("how", ["truncated", "edited", "not utf-8", "empty", "a directory"])
@pytest.mark.parametrize("family", ["row", "lm_head"])
def test_a_damaged_kernel_file_is_regenerated(tmp_path, monkeypatch, how, family):
    monkeypatch.setenv("KERNELGRAFT_CACHE_DIR", str(tmp_path / "kg"))
    if family == "row":
        sp = REGISTRY.get("rms_norm", "llama")
        k = row_kernel(sp, {"x": torch.float32, "weight": torch.float32}, {"x": "elem", "weight": "col"})
        name, source = k.spec.name, k.source
    else:
        sp = REGISTRY.get("lm_head_ce", "hf_mean")
        tf = lm_kernel.transform(sp, torch.float32, "autograd", "cpu")
        name = lm_kernel.kernel_name(sp, torch.float32, "autograd")
        source = lm_kernel.kernel_source(name, tf, sp.qualname)
    _, path = cache.load_module(name, source)
    assert cache._intact(path)
    _damage(path, how)
    assert not cache._intact(path)
    mod, path2 = cache.load_module(name, source)  # what the next process does
    assert path2 == path and cache._intact(path) and path.read_text().startswith(source)
    assert hasattr(mod, name if family == "lm_head" else f"{name}_fwd")


# ---- copies ----------------------------------------------------------------------------------------


def _round_trips():
    def pickled(m):
        return pickle.loads(pickle.dumps(m))

    def saved(m):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    return {"deepcopy": copy.deepcopy, "pickle": pickled, "torch.save": saved}


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_of_an_optimized_model_stays_optimized(how):
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", lm_head_chunk=8)
    b = batch()
    mine(**b).loss.backward()
    twin = _round_trips()[how](mine)
    assert twin is not mine and twin.kernelgraft_report is not mine.kernelgraft_report
    assert twin.kernelgraft_report.counts() == {}  # its own report: nothing captured yet
    assert all(p is not q for p, q in zip(twin.parameters(), mine.parameters()))
    verdicts = compare_models(twin, stock, b, compiled=False)
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]
    assert twin.kernelgraft_report.counts() == FULL
    # optimized as the original was (its options too), and the original is untouched
    assert twin.__dict__["__deepcopy__"].args[1]["lm_head_chunk"] == 8
    assert mine.kernelgraft_report.counts() == FULL
    torch.testing.assert_close(twin(**b).loss, mine(**b).loss, rtol=0, atol=0)


def test_a_shallow_copy_shares_the_parameters_and_is_optimized_apart():
    """copy.copy: the plain model's shallow copy (parameters shared), optimized as the original
    was, with its own compiled call and report."""
    mine = kernelgraft.optimize(tiny_model("llama"), backend="eager", lm_head_chunk=8)
    twin = copy.copy(mine)
    assert twin is not mine and twin.kernelgraft_report is not mine.kernelgraft_report
    assert all(p is q for p, q in zip(twin.parameters(), mine.parameters()))
    assert twin.__dict__["__deepcopy__"].args[1]["lm_head_chunk"] == 8
    b = batch()
    loss = twin(**b).loss
    assert twin.kernelgraft_report.counts() == FULL and mine.kernelgraft_report.counts() == {}
    torch.testing.assert_close(loss, mine(**b).loss, rtol=0, atol=0)


def test_a_module_holding_an_optimized_model_copies_it_optimized():
    holder = torch.nn.ModuleDict({"policy": kernelgraft.optimize(tiny_model("llama"), backend="eager")})
    twin = copy.deepcopy(holder)
    b = batch()
    twin["policy"](**b).loss.backward()
    assert twin["policy"].kernelgraft_report.counts() == FULL


# ---- autocast --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_with_labels_is_served_and_passes_the_rule(backend, dtype):
    """float32 weights under autocast: the matmuls run in bf16/fp16 (the LM head's too: canonicalize
    makes autocast's casts explicit, so its kernel gets what the stock linear got), the norms upcast
    themselves. Loss and every gradient by the rule against float64 truth, beside eager under the
    same autocast; every site served, the backward called inside the autocast region as users do.
    Judged over four batches at once (each quantity's values from all of them in one vector): with
    q/k/v fused into one matmul the rounding differs from eager's in order, not in kind, and one
    batch is one draw of it (measured over 8 batches, per parameter: kernelgraft's error over
    eager's has median 0.98 fused and apart alike)."""
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    truth_model = copy.deepcopy(stock).double()
    runs = {"truth": [], "eager": [], "mine": []}
    for seed in (1, 2, 3, 4):
        b = batch(seed=seed)
        runs["truth"].append(loss_and_grads(truth_model, b))
        with torch.autocast("cpu", dtype=dtype):
            runs["eager"].append(loss_and_grads(stock, b))
            runs["mine"].append(loss_and_grads(mine, b))

    def joined(name, key=None):
        parts = [loss if key is None else grads[key] for loss, grads in runs[name]]
        return torch.cat([p.reshape(-1) for p in parts])

    # against eager alone: a stricter bound than the rule's max(eager, torch.compile), and no CPU compile
    verdicts = [judge("loss", joined("truth"), joined("mine"), joined("eager"))]
    verdicts += [
        judge(f"grad {n}", joined("truth", n), joined("mine", n), joined("eager", n)) for n in runs["truth"][0][1]
    ]
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]
    rep = mine.kernelgraft_report
    assert rep.counts() == FULL, str(rep)
    (lm,) = [s for s in rep.sites if s.pattern == "lm_head_ce"]
    assert lm.dtypes["h"] == lm.dtypes["weight"] == str(dtype).removeprefix("torch.")


# ---- torch.compile of an optimized model ---------------------------------------------------------


def test_torch_compile_of_an_optimized_model_runs_its_kernels():
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock))
    outer = torch.compile(mine)
    b = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, got = loss_and_grads(mine, b, wrapped=outer)
    said = _kernelgraft_warnings(caught)
    assert any("outer torch.compile adds nothing" in s for s in said), said
    truth_loss, truth = loss_and_grads(copy.deepcopy(stock).double(), b)
    eager_loss, eager = loss_and_grads(stock, b)
    verdicts = [judge("loss", truth_loss, loss, eager_loss)]
    verdicts += [judge(f"grad {n}", truth[n], got[n], eager[n]) for n in truth]
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]
    assert mine.kernelgraft_report.counts() == FULL


def test_model_compile_after_optimize_keeps_the_kernels_and_says_so():
    mine = kernelgraft.optimize(tiny_model("llama"), backend="eager")
    ours = mine._compiled_call_impl
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mine.compile(mode="max-autotune") is None
    said = _kernelgraft_warnings(caught)
    assert len(said) == 1 and "ignored" in said[0], said
    assert mine._compiled_call_impl is ours
    mine(**batch()).loss.backward()
    assert mine.kernelgraft_report.counts() == FULL
    # a copy is optimized with its own compile guard, and pickles without it
    twin = pickle.loads(pickle.dumps(mine))
    assert twin.compile.args[0] is twin


# ---- hooks -------------------------------------------------------------------------------------------


def test_a_forward_hook_registered_after_the_first_call_runs():
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    b = batch()
    mine(**b).loss.backward()
    seen = []

    def double_output(module, inputs, output):
        seen.append(module)
        return output * 2

    for m in (stock, mine):
        m.model.layers[0].mlp.register_forward_hook(double_output)
    torch.testing.assert_close(mine(**b).loss, stock(**b).loss, rtol=1e-5, atol=0)
    assert len(seen) == 2  # once in each model: the hook changed the optimized model's loss too
    assert mine.kernelgraft_report.counts() == FULL


@pytest.mark.slow  # over 20 s on a 2-core CPU
def test_a_removed_hook_stops_running_and_a_global_hook_added_later_runs():
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    b = batch()
    seen = []

    def double_output(module, inputs, output):
        seen.append(module)
        return output * 2

    handle = mine.model.layers[0].mlp.register_forward_hook(double_output)
    hooked = mine(**b).loss
    assert len(seen) == 1 and not torch.equal(hooked, stock(**b).loss)
    handle.remove()
    torch.testing.assert_close(mine(**b).loss, stock(**b).loss, rtol=1e-5, atol=0)
    assert len(seen) == 1  # removed: not called again

    def triple_norms(module, inputs, output):
        return output * 3 if type(module).__name__ == "LlamaRMSNorm" else None

    handle = torch.nn.modules.module.register_module_forward_hook(triple_norms)
    try:
        torch.testing.assert_close(mine(**b).loss, stock(**b).loss, rtol=1e-5, atol=0)
    finally:
        handle.remove()
    assert mine.kernelgraft_report.counts() == FULL


# per layer class the hooked layer runs an entry of its own, whose graph break (the hook's setup)
# resumes in that entry's frame
@pytest.mark.parametrize("capture", ["whole", "layers"])
def test_full_backward_hooks_are_named_in_a_warning(capture):
    mine = kernelgraft.optimize(tiny_model("llama"), backend="eager", capture=capture)
    seen = []
    mine.model.layers[0].mlp.register_full_backward_hook(lambda m, gi, go: seen.append(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine(**batch()).loss.backward()
    said = _kernelgraft_warnings(caught)
    assert seen and len(said) == 1, said
    assert "full backward hooks on model.layers.0.mlp" in said[0] and "handle.remove()" in said[0]
