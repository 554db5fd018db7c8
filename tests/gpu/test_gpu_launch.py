"""On the GPU: kernels launched by inductor's generated code (rewriter/lowering.py) give the bits the
Python launcher gives, and CUDA graphs (mode="reduce-overhead") run kernelgraft's kernels with
gradients exact for any incoming gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import batch, compiled_anew, tiny_model

import kernelgraft
from kernelgraft.patterns import REGISTRY

pytestmark = pytest.mark.gpu

ARCHS = ["llama", "qwen3"]


@pytest.fixture(autouse=True)
def _compiles_that_sum_in_one_order(monkeypatch):
    """These tests compare the bits of two compiles of one model, so each sum must run in one order.
    Two things in inductor's code choose an order at run time. It times a reduction's candidate
    configs on its first run and keeps the fastest: with other work on the GPU two compiles can
    pick two configs (a loss equal to 4 digits, not in bits); its deterministic mode keeps one
    (`config.deterministic`, or deterministic algorithms in an older torch). And it lowers the
    embedding's backward (an index_put that accumulates the rows of repeated tokens) to atomic
    adds, whose order the GPU's scheduling decides, unless deterministic algorithms are on (then
    aten's sorted sum). Both are set here; kernelgraft's kernels make no such choice."""
    from torch._inductor import config

    if hasattr(config, "deterministic"):
        monkeypatch.setattr(config, "deterministic", True)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


ROW = [s for s in REGISTRY.spellings() if s.kernel == "row"]


def _step(model, b, scale: float = 1.0):
    """loss, then every parameter's gradient, of one fwd+bwd with the loss scaled by `scale`."""
    out = model(**b)
    (out.loss * scale).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach().clone(), grads


def _same_bits(a, b):
    la, ga = a
    lb, gb = b
    assert torch.equal(la, lb), (la, lb)
    assert ga.keys() == gb.keys()
    differ = {
        n: float((ga[n].float() - gb[n].float()).abs().max()) for n in ga if not torch.equal(ga[n], gb[n])
    }
    assert not differ, f"{len(differ)} of {len(ga)} gradients differ: {differ}"


@pytest.mark.parametrize("arch", ARCHS)
def test_launched_by_inductor_gives_the_bits_of_the_python_launcher(arch):
    b = batch(B=4, S=64, device="cuda")
    got = {}
    for launch in ("host", "inductor"):
        torch._dynamo.reset()
        model = tiny_model(arch, torch.bfloat16, device="cuda")
        kernelgraft.optimize(model, launch=launch)
        got[launch] = [_step(model, b, s) for s in (1.0, 0.3)]
        report = model.kernelgraft_report
        assert report.sites, "nothing grafted"
        if launch == "inductor":
            assert report.launched_by["inductor"] > 0, report.launched_by
            assert not [k for k in report.launched_by if k.startswith("host")], report.launched_by
    for a, b_ in zip(got["host"], got["inductor"]):
        _same_bits(a, b_)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_residual_adds_joined_to_the_norms_give_the_bits_of_the_adds_apart(arch, monkeypatch):
    """The residual stream's adds made by the norms' kernels (residual.add_into_norms in the
    forward, residual.accumulate_into_gradients in the backward), launched by inductor on the
    GPU: the loss and every gradient but the embedding's are the bits of a step with the adds
    apart (the embedding's: the CPU test says why, and judges it by the rule)."""
    from kernelgraft.rewriter import residual

    b = batch(B=4, S=64, device="cuda")
    real = {name: getattr(residual, name) for name in ("add_into_norms", "accumulate_into_gradients")}
    counts, got = {name: [] for name in real}, {}
    for on in (True, False):
        for name, fn in real.items():
            monkeypatch.setattr(
                residual,
                name,
                (lambda g, fn=fn, name=name: counts[name].append(fn(g)) or counts[name][-1])
                if on
                else (lambda g: 0),
            )
        torch._dynamo.reset()
        model = tiny_model(arch, torch.bfloat16, device="cuda")
        kernelgraft.optimize(model)
        # compiled here, not loaded from inductor's caches (the tests before compile the same
        # models, and a graph loaded from the cache runs no pass)
        with compiled_anew():
            got[on] = [_step(model, b, s) for s in (1.0, 0.3)]
        assert not [k for k in model.kernelgraft_report.launched_by if k.startswith("host")]
    L = model.config.num_hidden_layers
    assert counts == {"add_into_norms": [2 * L, 0], "accumulate_into_gradients": [0, 2 * L]}, counts
    for (la, ga), (lb, gb) in zip(got[True], got[False]):
        ga = {n: g for n, g in ga.items() if "embed_tokens" not in n}
        gb = {n: g for n, g in gb.items() if "embed_tokens" not in n}
        _same_bits((la, ga), (lb, gb))


class _Adapted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(64, 96, bias=False)

    def forward(self, x):
        return self.q_proj(x)


def _lora_layer(launch: str):
    """y, and the gradients of x and the adapters, of one peft LoRA layer (bf16 base, float32
    adapters: peft's default) optimized with `launch`."""
    from peft import LoraConfig, get_peft_model

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = get_peft_model(
        _Adapted().cuda().bfloat16(), LoraConfig(r=8, target_modules=["q_proj"], init_lora_weights=False)
    )
    kernelgraft.optimize(m, launch=launch)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    y = m(x)
    y.backward(torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=g) * 0.3)
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return (y.detach(), dict(grads, x=x.grad.clone())), m.kernelgraft_report


def test_lora_launched_by_inductor_gives_the_bits_of_the_python_launcher():
    """A LoRA layer's kernels (float32 adapters) launched by inductor's code give the bits of the
    Python launcher's: the output, x's and the adapters' gradients. (Whole models are compared by
    the rule below: with the adapters' ops opaque or traced, inductor lays out the base model's
    matmuls differently, and cuBLAS rounds those differently.)"""
    host, _ = _lora_layer("host")
    traced, report = _lora_layer("inductor")
    assert report.counts() == {"lora": 1} and report.launched_by["inductor"] > 0, report
    assert not [k for k in report.launched_by if k.startswith("host")], report.launched_by
    assert any("lora_A" in n for n in host[1]) and any("lora_B" in n for n in host[1])
    _same_bits(host, traced)


def _lora_model(dtype):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(tiny_model("llama", dtype, device="cuda"), cfg)


def test_a_lora_model_launched_by_inductor_gives_the_bits_of_the_python_launcher():
    """peft LoRA on every linear of a bf16 tiny Llama: every kernel launched by inductor's code
    (LoRA's and the row kernels) gives the loss and gradients of the same graft launched from the
    host, bit for bit. The LoRA calls of the gate and up projections are traced once and copied:
    the gated MLP kernel once read the up projection for both (its trace saw one fake value for
    the two), a loss 1e-3 off."""
    import copy

    stock = _lora_model(torch.bfloat16)
    b = batch(B=4, S=64, device="cuda")
    got = {}
    for launch in ("host", "inductor"):
        torch._dynamo.reset()
        model = kernelgraft.optimize(copy.deepcopy(stock), launch=launch)
        got[launch] = [_step(model, b, s) for s in (1.0, 0.3)]
        report = model.kernelgraft_report
        assert report.counts()["lora"] == 7 * stock.config.num_hidden_layers
        if launch == "inductor":
            assert not [k for k in report.launched_by if k.startswith("host")], report.launched_by
    for a, b_ in zip(got["host"], got["inductor"]):
        assert any("lora_A" in n for n in a[1]) and any("lora_B" in n for n in a[1])
        _same_bits(a, b_)


def test_a_float32_lora_model_under_inductor_passes_the_rule():
    """The same model in float32 under the inductor backend: loss and every adapter gradient by the
    accuracy rule beside eager and torch.compile, all kernels launched by inductor's code."""
    import copy

    from tiny import compare_models

    stock = _lora_model(torch.float32)
    mine = kernelgraft.optimize(copy.deepcopy(stock))
    bs = [batch(seed=s, B=4, S=64, device="cuda") for s in (1, 2)]
    verdicts = compare_models(mine, stock, bs)
    assert sum("lora_" in v.what for v in verdicts) == 2 * 7 * stock.config.num_hidden_layers
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    report = mine.kernelgraft_report
    assert report.counts()["lora"] == 7 * stock.config.num_hidden_layers
    assert not [k for k in report.launched_by if k.startswith("host")], report.launched_by
    assert report.launched_by["inductor"] > 0, report.launched_by


class _Spelled(torch.nn.Module):
    def __init__(self, sp):
        super().__init__()
        self.sp = sp

    def forward(self, *args):
        return self.sp.fn(*args)


@pytest.mark.parametrize("sp", ROW, ids=[s.qualname for s in ROW])
def test_each_row_kernel_launched_by_inductor_gives_the_bits_of_the_python_launcher(sp):
    from checks import served_dtypes

    n = 128 if sp.pattern == "rope" else 1000
    dt = torch.bfloat16 if torch.bfloat16 in served_dtypes(sp) else torch.float32  # no_cast: float32 only
    spelled = [a.cuda() if isinstance(a, torch.Tensor) else a for a in sp.example_args(512, n, dt, seed=3)]
    out = sp.fn(*spelled)
    g = torch.randn(out.shape, device="cuda", dtype=out.dtype)
    got = {}
    for launch in ("host", "inductor"):
        torch._dynamo.reset()
        model = kernelgraft.optimize(_Spelled(sp), launch=launch)
        args = [
            a.detach().clone().requires_grad_(a.dim() > 0 and not (sp.pattern == "rope" and i > 0))
            if isinstance(a, torch.Tensor)
            else a
            for i, a in enumerate(spelled)
        ]
        out = model(*args)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        got[launch] = [out, *torch.autograd.grad(out, leaves, g)]
        assert model.kernelgraft_report.counts() == {sp.pattern: 1}
        if launch == "inductor":
            assert model.kernelgraft_report.launched_by == {"inductor": 2}, (
                model.kernelgraft_report.launched_by
            )
    for a, b in zip(got["host"], got["inductor"]):
        assert torch.equal(a, b), float((a.float() - b.float()).abs().max())


def test_the_traced_launch_runs_no_python_launcher():
    """Once compiled, a step calls none of the row family's Python launchers."""
    from kernelgraft.kernels.rows import launch

    model = tiny_model("llama", torch.bfloat16, device="cuda")
    kernelgraft.optimize(model)
    b = batch(B=2, S=32, device="cuda")
    _step(model, b)
    calls = []
    saved = launch.forward_group, launch.backward_group
    launch.forward_group = lambda *a, **k: calls.append("fwd") or saved[0](*a, **k)
    launch.backward_group = lambda *a, **k: calls.append("bwd") or saved[1](*a, **k)
    try:
        _step(model, b)
    finally:
        launch.forward_group, launch.backward_group = saved
    assert calls == []


_STATIC_CHECK = """
import sys
import torch
sys.path.insert(0, {tests!r})
from tiny import batch, tiny_model
import kernelgraft
from kernelgraft.rewriter.lowering import launcher_kinds

model = tiny_model("llama", torch.bfloat16, device="cuda")
kernelgraft.optimize(model)
out = model(**batch(B=2, S=32, device="cuda"))
out.loss.backward()
torch.cuda.synchronize()
print("KINDS", sorted((k, sorted(v)) for k, v in launcher_kinds().items()))
"""


def test_inductor_launches_the_kernels_through_its_static_launcher(tmp_path):
    """Every kernelgraft kernel inductor launches goes through its static launcher (as its own kernels
    do), not through Triton's Python-side launcher: in a fresh process, whose compile workers are
    not ready for its first compiles (inductor then compiles in the process itself), with inductor's
    caches empty, and again with them filled by that run (the graphs loaded, not compiled)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = _STATIC_CHECK.format(tests=str(Path(__file__).resolve().parents[1] / "helpers"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    for run in ("empty caches", "filled caches"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("KINDS ")][-1]
        kinds = eval(line[len("KINDS ") :])  # noqa: S307 - the list the script above printed
        assert kinds and all(k == ["StaticTritonCompileResult"] for _, k in kinds), (run, kinds)


@pytest.mark.parametrize("backend", ["inductor", "eager"])
def test_autocast_on_cuda_is_served_and_passes_the_rule(backend):
    """float32 weights under CUDA's bf16 autocast, labels given: every site served (the LM head in
    bf16, as autocast's linear), loss and gradients by the rule beside eager and, for the inductor
    backend, torch.compile under autocast."""
    import copy

    from tiny import loss_and_grads

    from kernelgraft.gradcheck import judge

    stock = tiny_model("llama", device="cuda")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    b = batch(device="cuda")
    truth_loss, truth = loss_and_grads(copy.deepcopy(stock).double(), b)
    comp = copy.deepcopy(stock)  # the rule's second reference where inductor compiles the rest
    comp.compile()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager_loss, eager = loss_and_grads(stock, b)
        comp_loss, compiled = loss_and_grads(comp, b) if backend == "inductor" else (None, {})
        loss, got = loss_and_grads(mine, b)
    verdicts = [judge("loss", truth_loss, loss, eager_loss, comp_loss)]
    verdicts += [judge(f"grad {n}", truth[n], got[n], eager[n], compiled.get(n)) for n in truth]
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]
    counts = mine.kernelgraft_report.counts()  # on CUDA the attention rewrites are counted too
    full = {"rms_norm": 5, "lm_head_ce": 1, "rope": 4, "gated_mlp": 2}
    assert {k: counts.get(k) for k in full} == full, counts


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_cuda_graphs_run_the_kernels_with_exact_gradients_for_any_loss_gradient(arch, monkeypatch):
    from torch._dynamo.utils import counters

    from kernelgraft.kernels.lm_head import op as lm_head_op

    b = batch(B=4, S=64, device="cuda")
    torch._dynamo.reset()
    ref = tiny_model(arch, torch.bfloat16, device="cuda")
    with monkeypatch.context() as m:  # the reference makes the LM head's gradients in the forward
        m.setattr(lm_head_op, "DEFER_FLOPS", 0)
        kernelgraft.optimize(ref)
        ref(**b)
    want = [_step(ref, b, s) for s in (1.0, 0.3, 1.0 / 3)]
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(arch, torch.bfloat16, device="cuda")
    kernelgraft.optimize(model, mode="reduce-overhead")
    for _ in range(2):  # recorded, then replayed
        got = []
        for s in (1.0, 0.3, 1.0 / 3):
            torch.compiler.cudagraph_mark_step_begin()
            got.append(_step(model, b, s))
        for w, g in zip(want, got):
            _same_bits(w, g)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert model.kernelgraft_report.counts().get("lm_head_ce") == 1


def test_generate_with_inductor_launches_gives_eager_tokens():
    """Greedy decoding gives eager's tokens both ways: by default (graphs without gradients leave
    their row sites to inductor) and with the row kernels serving them, launched by inductor."""
    stock = tiny_model("llama", torch.float32, device="cuda").eval()  # float32: no near-ties
    ids = torch.randint(3, 128, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = stock.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        for inference in ("inductor", "kernels"):
            model = kernelgraft.optimize(copy.deepcopy(stock), inference=inference)
            got = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            assert torch.equal(want, got), inference
            launched = model.kernelgraft_report.launched_by["inductor"]
            assert (launched > 0) == (inference == "kernels"), (inference, model.kernelgraft_report)


def _wrappers_asked(monkeypatch) -> list:
    """Whether each of inductor's compile_fx calls from here on asked for the C++ wrapper."""
    import torch._inductor.compile_fx as inductor_compile

    real, asked = inductor_compile.compile_fx, []

    def compile_fx(gm, example_inputs, config_patches=None, **kw):
        asked.append(bool((config_patches or {}).get("cpp_wrapper")))
        return real(gm, example_inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(inductor_compile, "compile_fx", compile_fx)
    return asked


def test_generate_with_the_cpp_wrapper_gives_the_python_wrappers_logits(monkeypatch):
    """Greedy decoding's graph of dynamic sizes (no gradients) compiles with inductor's C++
    wrapper by default, without falling back to Python's, and gives eager's tokens and the Python
    wrapper's logits, bit for bit (the same kernels, launched from C++)."""
    import warnings

    stock = tiny_model("llama", torch.float32, device="cuda").eval()
    ids = torch.randint(3, 128, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kw = dict(
        max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    got = {}
    with torch.no_grad():
        want = stock.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        for wrapper in ("python", "auto"):
            torch._dynamo.reset()
            asked = _wrappers_asked(monkeypatch)
            model = kernelgraft.optimize(copy.deepcopy(stock), wrapper=wrapper)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got[wrapper] = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            assert not [w for w in caught if "wrapper failed" in str(w.message)], wrapper
            # "auto": the decoding steps' graph of dynamic sizes (the prompt's and the first step's
            # are fixed-size graphs, Python's)
            assert any(asked) == (wrapper == "auto") and not asked[0], (wrapper, asked)
            assert (model.kernelgraft_report.wrappers["C++"] > 0) == (wrapper == "auto"), wrapper
            assert torch.equal(got[wrapper].sequences, want.sequences), wrapper
    for a, b in zip(got["python"].logits, got["auto"].logits, strict=True):
        assert torch.equal(a, b)


def test_a_small_models_step_reads_nothing_on_the_host():
    """Default mode, a small head (op.defers): after the first step, forward and backward run with
    CUDA's sync debug mode set to raise on any host read of a device value."""
    model = tiny_model("llama", torch.bfloat16, device="cuda")
    kernelgraft.optimize(model)
    b = batch(B=4, S=64, device="cuda")
    _step(model, b)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(**b)
        out.loss.mul(0.3).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rep = model.kernelgraft_report
    assert rep.counts().get("lm_head_ce") == 1
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
