"""The LoRA pattern and its kernels: peft's adapter path, matched on the graph and served by fused
Triton kernels (kernels/lora/), checked against float64 truth and eager by the accuracy rule."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tiny import batch, compare_models, tiny_model

import kernelgraft
from kernelgraft.gradcheck import check_spelling
from kernelgraft.kernels import refusal
from kernelgraft.patterns import REGISTRY

PEFT = REGISTRY.get("lora", "peft")
SAME = REGISTRY.get("lora", "peft_same_dtype")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _args(T, K, N, r, xd, ad, od, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(xd).requires_grad_()
    res = torch.randn(T, N, generator=g).to(od).requires_grad_()
    a = (torch.randn(r, K, generator=g) / K**0.5).to(ad).requires_grad_()
    b = (torch.randn(N, r, generator=g) / r**0.5).to(ad).requires_grad_()
    return (x, res, a, b, 2.0)


@pytest.mark.parametrize(
    "sp,xd,ad,od,r",
    [
        (SAME, F32, F32, F32, 1),  # a float32 model
        (PEFT, BF16, F32, BF16, 16),  # peft's default on a bf16 model: float32 adapters
        (PEFT, F16, F32, F16, 33),  # a rank block of 64
        (SAME, BF16, BF16, BF16, 5),  # autocast_adapter_dtype=False: every product rounds in bf16
        (PEFT, F32, BF16, F32, 3),  # x rounded to the adapters' dtype first
        (SAME, F32, F32, BF16, 8),  # dropout > 0: x is the float32 dropout output, the result bf16
    ],
    ids=["f32", "bf16-f32adapters", "f16-rank33", "bf16-bf16adapters", "f32-bf16adapters", "dropout-x"],
)
def test_the_op_passes_the_rule_in_every_dtype(sp, xd, ad, od, r):
    """Output and the gradients of x, the base output and both adapters, against float64 truth
    beside eager (the adapter path as peft runs it: float32 adapters run in float32)."""
    verdicts = check_spelling(sp, _args(70, 96, 40, r, xd, ad, od), compile_ref=False)
    assert [v.what for v in verdicts] == ["out", "grad x", "grad result", "grad lora_a", "grad lora_b"]
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("sp,xd,ad", [(PEFT, BF16, F32), (SAME, BF16, BF16)], ids=["bf16-f32", "bf16"])
def test_u_and_du_summed_in_splits_of_their_widths_pass_the_rule(sp, xd, ad, monkeypatch):
    """u = x A^T summed over x's width of 96 and du = gv @ B over an output width of 200, each in
    two splits (the interpreter's, as a GPU's with GPU_FILL set for them), their float64 sums added
    and rounded once: by the rule as the unsplit sums are."""
    from kernelgraft.kernels.lora import kernel as lk

    made = []
    splits = lk._splits

    def spy(T, blocks, BT, device, fill=None):
        made.append((T, splits(T, blocks, BT, device, fill)))
        return made[-1][1]

    monkeypatch.setattr(lk, "_splits", spy)
    monkeypatch.setattr(lk, "FUSED_UB", False)  # du by grad_u (as where dB is not needed)
    verdicts = check_spelling(sp, _args(70, 96, 200, 8, xd, ad, xd), compile_ref=False)
    assert (200, (2, 128)) in made  # the output width, in two splits of two column tiles
    assert (96, (2, 64)) in made  # x's width, in two splits of one column tile
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "sp,xd,ad", [(PEFT, BF16, F32), (SAME, BF16, BF16), (SAME, F32, F32)], ids=["bf16-f32", "bf16", "f32"]
)
@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_du_and_db_from_one_read_of_the_gradient(sp, xd, ad, blocks, monkeypatch):
    """grad_ub reads the output's gradient once for du and dB: du summed over 4 column blocks of an
    output width of 200 (`blocks` of them a program), dB over two splits of the rows. By the rule,
    and dB bitwise as grad_b's (the same products, summed in the same splits); du as grad_u's to
    float32 rounding."""
    from kernelgraft.kernels.lora import kernel as lk

    monkeypatch.setattr(lk, "CPU_UB_BLOCKS", blocks)
    monkeypatch.setattr(lk, "FUSED_UB", True)
    args = _args(70, 96, 200, 8, xd, ad, xd)
    launched = []
    call = lk._Launches.__call__

    def spy(self, kernel, *a, **kw):
        launched.append(kernel)
        return call(self, kernel, *a, **kw)

    monkeypatch.setattr(lk._Launches, "__call__", spy)
    verdicts = check_spelling(sp, args, compile_ref=False)
    name = "grad_ub" if blocks == 1 else f"grad_ub{blocks}"
    assert name in launched and "grad_u" not in launched and "grad_b" not in launched
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)

    x, res, A, B, s = args
    g = torch.randn(res.shape, generator=torch.Generator().manual_seed(3)).to(res.dtype)
    _, u = lk.forward(x.detach(), res.detach(), A.detach(), B.detach(), s)
    assert lk.cdiv(200, lk._blocks(8, "grad_ub", x.device)[1]) == 4
    fused = lk.backward(g, x.detach(), A.detach(), B.detach(), u, s, (True, True, True))
    monkeypatch.setattr(lk, "FUSED_UB", False)
    apart = lk.backward(g, x.detach(), A.detach(), B.detach(), u, s, (True, True, True))
    assert torch.equal(fused[2], apart[2])
    # du's sums differ at float32's rounding: dx (x's dtype) and dA (the adapters') at theirs
    for got, want, dt in zip(fused[:2], apart[:2], (xd, ad)):
        ulp = torch.finfo(dt).eps
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=ulp * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("values", ["gaussian", "constant_rows"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("sp", [PEFT, SAME], ids=["peft", "same_dtype"])
def test_sums_over_65536_columns_pass_the_rule_on_a_gpu(sp, dtype, values):
    """Cases the thorough profile drew on an H200, 4 rows of 65536. Everything float32: split into
    tf32x3 passes the products were 7x (out, dB) and 30x (dA) eager's error; taken in float64 they
    pass (sums_in_float64). fp16 x, float32 adapters: 1024 blocks' sums added in float32 left dB
    (which reads u) 6x eager's error; added in float64 (source.LONG_SUMS) they pass."""
    from kernelgraft.gradcheck.strategies import _values, on_device

    args = on_device(_values(sp.example_args(4, 65536, dtype, 0), values), "cuda")
    bad = [str(v) for v in check_spelling(sp, args, compile_ref=False) if not v.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,dtype,seed", [(38, BF16, 38), (4, F16, 29130)], ids=["38-rows-bf16", "4-rows-fp16"]
)
@pytest.mark.parametrize("fused", [True, False], ids=["grad_ub", "grad_u-grad_b"])
def test_du_summed_over_a_wide_cancelling_output_passes_the_rule_on_a_gpu(rows, dtype, seed, fused, monkeypatch):
    """Two cases the thorough profile drew on an H200: constant rows of 65536, float32 adapters of
    rank 1, an output 32771 wide; du's sum cancels (its terms are 150 times du). With du's
    tensor-core products 64 columns wide the first's dA was 8.1e-7 against the rule's bound of
    4.82e-7 (eager 5.1e-9): 16 columns a product (source.DU_COLUMNS) passes it. With grad_ub's du
    partial sums in float32 the second's was 3.3e-6 against 8.6e-7: in float64 they pass it. du
    and dB from one read (grad_ub) and apart (grad_u summing the whole width, grad_b), each."""
    from kernelgraft.gradcheck.strategies import _values, on_device
    from kernelgraft.kernels.lora import kernel as lk

    monkeypatch.setattr(lk, "FUSED_UB", fused)
    args = on_device(_values(PEFT.example_args(rows, 65536, dtype, seed), "constant_rows"), "cuda")
    bad = [str(v) for v in check_spelling(PEFT, args, compile_ref=False) if not v.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", [1, 8])
def test_u_summed_in_splits_of_x_width_passes_the_rule_on_a_gpu(fill, monkeypatch):
    """The down projection split over x's width on CUDA (GPU_FILL["down"], which `tune_lora.py
    --parts fills` times), at the down projection's width in a Llama-3.2-1B layer."""
    from kernelgraft.gradcheck.strategies import on_device
    from kernelgraft.kernels.lora import kernel as lk

    monkeypatch.setitem(lk.GPU_FILL, "down", fill)
    args = on_device(_args(1000, 8192, 2048, 16, BF16, F32, BF16), "cuda")
    bad = [str(v) for v in check_spelling(PEFT, args, compile_ref=True) if not v.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [2, 4])
def test_du_and_db_with_several_column_blocks_a_program_pass_the_rule_on_a_gpu(blocks, monkeypatch):
    """grad_ub with 2 or 4 column blocks a program on CUDA (GPU_UB_BLOCKS, which `tune_lora.py
    --parts blocks` times), at a gate projection's output width of a Llama-3.2-1B layer."""
    from kernelgraft.gradcheck.strategies import on_device
    from kernelgraft.kernels.lora import kernel as lk

    monkeypatch.setattr(lk, "GPU_UB_BLOCKS", blocks)
    monkeypatch.setattr(lk, "FUSED_UB", True)
    args = on_device(_args(1000, 2048, 8192, 16, BF16, F32, BF16), "cuda")
    bad = [str(v) for v in check_spelling(PEFT, args, compile_ref=True) if not v.ok]
    assert not bad, "\n".join(bad)


def test_the_pipeline_depth_fits_the_shared_memory_at_every_rank(monkeypatch):
    """Each stage holds a tile of the streamed operands: at rank 256 the down projection's tuned 4
    stages (or Triton's 3) of a 64 x 256 float32 adapter tile would need more than an H200's
    232,448 bytes, and Triton refuses the launch; the depth is cut to what fits."""
    from kernelgraft.kernels.lora import kernel as lk

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(lk, "_shared_memory", lambda index: 232448)
    assert lk._stages("down", 64, 64, 16, cuda) == 4  # the tuned tile keeps its tuned depth
    assert lk._stages("grad_u", 64, 64, 16, cuda) is None  # Triton's default, 3
    assert lk._stages("down", 32, 64, 256, cuda) == 2
    assert lk._stages("down", 32, 64, 64, cuda) is None
    for kernel in ("down", "up", "grad_u", "grad_b", "grad_ub2", "grad_a", "grad_x"):
        for r in (1, 16, 32, 64, 128, 256):
            BT, BC, BR, _ = lk._blocks(r, kernel, cuda)
            n = lk._stages(kernel, BT, BC, BR, cuda) or lk.TRITON_STAGES
            assert n * 4 * (BC * BR + BT * max(BC, BR)) <= 232448, (kernel, r, n)
    monkeypatch.setattr(lk, "_shared_memory", lambda index: 101376)  # a consumer card's
    assert lk._stages("down", 32, 64, 256, cuda) == 1
    assert lk._stages("down", 64, 64, 16, torch.device("cpu")) is None  # the interpreter: no stages


@pytest.mark.gpu
@pytest.mark.parametrize("r", [1, 16, 64, 256])
@pytest.mark.parametrize(
    "sp,xd,ad", [(PEFT, BF16, F32), (SAME, BF16, BF16), (SAME, F32, F32)], ids=["bf16-f32", "bf16", "f32"]
)
def test_the_op_passes_the_rule_on_a_gpu(sp, xd, ad, r):
    """The same kernels compiled for CUDA (tensor-core dots split to stay exact), at a model's widths."""
    args = tuple(
        a.detach().cuda().requires_grad_() if isinstance(a, torch.Tensor) else a
        for a in _args(1000, 2048, 1536, r, xd, ad, xd)
    )
    bad = [str(v) for v in check_spelling(sp, args, compile_ref=True) if not v.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "xd,ad,od",
    [(BF16, F32, BF16), (F16, F32, F16), (F32, F32, F32), (BF16, BF16, BF16)],
    ids=["bf16-f32adapters", "f16-f32adapters", "f32", "bf16"],
)
def test_no_tensor_core_pass_adds_into_a_running_sum(xd, ad, od):
    """Every tensor-core product starts from zero and its result is added to the loop's float32 sum
    outside the dot: a dot given the running sum as its accumulator adds into it on the tensor core,
    which rounds coarser than float32 (on an H200 that made dA and dB 20x less accurate than eager
    over 1000 rows; the interpreter computes such a dot exactly, so only this and the GPU test above
    can see it). Read from the generated source, every variant of it."""
    import ast

    from kernelgraft.kernels.lora import kernel as lk

    tree = ast.parse(lk.kernel_source("k", xd, ad, od))
    dots = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "tl.dot"]
    assert dots
    for d in dots:
        given = [ast.unparse(a) for a in d.args[2:]] + [
            ast.unparse(k.value) for k in d.keywords if k.arg == "acc"
        ]
        assert all(g.startswith("tl.dot(") for g in given), ast.unparse(d)


def test_float32_x_and_adapters_take_float64_products_rounded_once():
    """x and the adapters float32: the kernels' products and sums are float64, rounded once, so u
    is x @ A^T in float64 rounded to float32, bit for bit, and so are dB and dA (float32 split sums
    would differ from it in the last bits over long rows); with x in bf16 the sums stay float32."""
    from kernelgraft.kernels.lora import kernel as lk

    x, res, a, b, s = (t.detach() if isinstance(t, torch.Tensor) else t for t in _args(300, 96, 80, 8, F32, F32, F32))
    out, u = lk.forward(x, res, a, b, s)
    assert torch.equal(u, (x.double() @ a.double().T).float())
    g = torch.randn(res.shape, generator=torch.Generator().manual_seed(1))
    _, dA, dB = lk.backward(g, x, a, b, u, s, (True, True, True))
    du = (g.double() * s).float().double() @ b.double()  # gv = R_a(g * s), then summed in float64
    assert torch.equal(dB, ((g.double() * s).float().double().T @ u.double()).float())
    assert torch.equal(dA, (du.float().double().T @ x.double()).float())
    assert lk.sums_in_float64(F32, F32) and not lk.sums_in_float64(BF16, F32)


@pytest.mark.parametrize("od", [BF16, F16], ids=str)
@pytest.mark.parametrize("n,offset", [(96, 0), (97, 0), (96, 1)], ids=["even", "odd-width", "odd-address"])
@pytest.mark.parametrize("fused", [True, False], ids=["with-dB", "du-alone"])
def test_du_is_summed_in_float64_from_the_gradients_words(od, n, offset, fused, monkeypatch):
    """DU_PRODUCTS = "float64", a bf16/fp16 output with float32 adapters: du's products and sums are
    float64, from g read as
    32-bit words (a copy one column wider where the width is odd or the rows' address is not a
    word's), so du is g @ B * s in float64 rounded once to float32, bit for bit, both in the fused
    du and dB kernel and alone (TF32 products of 16 columns, the table's, are several ulps off)."""
    from kernelgraft.kernels.lora import kernel as lk

    monkeypatch.setattr(lk.source, "DU_PRODUCTS", "float64")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=gen).to(od)
    a, b = torch.randn(8, 64, generator=gen) / 8, torch.randn(n, 8, generator=gen) / 3
    g = torch.randn(40, n + offset, generator=gen).to(od)[:, offset:]  # a view: odd address if offset
    u = torch.randn(40, 8, generator=gen)
    assert lk.source.du_words(od, F32, od) and not lk.source.du_words(F32, F32, od)
    words, stride = lk._words(g, od, F32)
    assert words.dtype == torch.int32 and (words.data_ptr() == g.data_ptr()) == (n % 2 == 0 and offset == 0)
    launch = lk._Launches(x, a, od, g)
    if fused:
        du, _ = lk._grad_ub(launch, g, b, u, 2.0, 40, n, 8, od, F32)
    else:
        du = lk._grad_u(launch, g, b, 2.0, 40, n, 8, od, F32)
    assert torch.equal(du, (g.double() @ b.double() * 2.0).float())


def test_the_largest_rank_is_served_and_a_larger_one_refused():
    x, res, a, b, s = _args(9, 40, 24, 256, BF16, F32, BF16)
    assert all(v.ok for v in check_spelling(PEFT, (x, res, a, b, s), compile_ref=False))
    metas = dict(x=x, result=res, lora_a=torch.empty(257, 40), lora_b=torch.empty(24, 257))
    assert refusal(PEFT, metas) == "rank 257; the kernels serve ranks up to 256"
    metas = dict(x=x, result=res, lora_a=a.double(), lora_b=b.double())
    assert "adapters of torch.float64" in refusal(PEFT, metas)


def test_gradients_the_graph_does_not_need_are_not_made():
    """A frozen base output and x that needs no gradient (the first adapted layer's input)."""
    x, res, a, b, s = _args(12, 32, 16, 4, BF16, F32, BF16)
    x, res = x.detach(), res.detach()
    out = PEFT.fn(x, res, a, b, s)
    sp_op = kernelgraft.kernels.op_for(PEFT)
    mine = sp_op(x, res, a, b, s)
    g = torch.randn_like(out)
    want = torch.autograd.grad(out, (a, b), g)
    got = torch.autograd.grad(mine, (a, b), g)
    for w, k in zip(want, got):
        torch.testing.assert_close(k, w, rtol=1e-5, atol=1e-6)


def test_the_base_output_is_not_kept_for_the_backward():
    """No gradient depends on the base output's value: saving it would keep every adapted layer's
    full output alive until the backward. What the op saves is x, the adapters and u."""
    x, res, a, b, s = _args(24, 32, 40, 4, BF16, F32, BF16)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mine = kernelgraft.kernels.op_for(PEFT)(x, res, a, b, s)
    assert not any(t.data_ptr() == res.data_ptr() or t.shape == res.shape for t in saved)
    assert any(t.data_ptr() == x.data_ptr() for t in saved)
    g = torch.randn_like(mine)
    gx, gres = torch.autograd.grad(mine, (x, res), g)
    assert torch.equal(gres, g)  # the base output's gradient is g itself
    want = torch.autograd.grad(PEFT.fn(x, res, a, b, s), x, g)[0]
    assert gx.shape == want.shape and gx.dtype == want.dtype  # its values: the rule, tests above


def _lora(arch, dtype, **cfg):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = dict(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(tiny_model(arch, dtype), LoraConfig(**dict(config, **cfg)))


def test_rslora_and_dropout_are_served_with_the_models_numbers():
    """rsLoRA is another scaling (a captured number); with dropout > 0 the dropout stays the model's
    own op (the same random stream), and the kernels take its output."""
    stock = _lora("llama", torch.bfloat16, use_rslora=True, lora_dropout=0.1)
    stock.register_forward_pre_hook(lambda *_: torch.manual_seed(7) and None)  # one dropout stream per run
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    batches = [batch(seed=s) for s in range(2)]
    verdicts = compare_models(mine, stock, batches, compiled=False)
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    assert mine.kernelgraft_report.counts()["lora"] == 14


def test_unserved_adapters_are_reported_with_why():
    """Two active adapters on a layer of a bf16 model with float32 adapters: the second, whose
    float32 sum is cast back, is served; the first, whose sum stays float32 (wider than the base
    output the kernels would return), falls back, with the reason. A rank above 256: a fallback
    with the reason."""
    from peft import LoraConfig

    two = _lora("llama", torch.bfloat16, target_modules=["q_proj"])
    two.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    two.base_model.set_adapter(["default", "second"])
    rep = kernelgraft.explain(two, **batch())
    assert rep.counts()["lora"] == 2 and {s.shapes["lora_a"][0] for s in rep.sites if s.pattern == "lora"} == {4}
    refused = [f for f in rep.fallbacks if f.pattern == "lora"]
    assert len(refused) == 2 and all("wider than the base output's" in f.reason for f in refused), str(rep)
    assert {f.shapes["lora_a"][0] for f in refused} == {8}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        big = _lora("llama", torch.bfloat16, r=300, target_modules=["v_proj"])
    rep = kernelgraft.explain(big, **batch())
    assert [f.reason for f in rep.fallbacks] == ["rank 300; the kernels serve ranks up to 256"] * 2, str(rep)


def test_every_active_adapter_of_a_layer_is_served_or_reported():
    """Two active adapters on a layer of a float32 model: each is served or reported (naming the
    layer and the adapter); both are served, the first by the spelling whose sum is not cast back."""
    from peft import LoraConfig

    two = _lora("llama", torch.float32, target_modules=["q_proj", "v_proj"])
    two.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    two.base_model.set_adapter(["default", "second"])
    rep = kernelgraft.explain(two, **batch())
    layers = [n for n, _ in two.named_modules() if n.endswith(("q_proj", "v_proj")) and ".lora_" not in n and n.count(".") > 4]
    assert len(layers) == 4
    served = {(s.module, s.shapes["lora_a"][0]) for s in rep.sites if s.pattern == "lora"}
    said = {(u.module, u.cls) for u in rep.unserved if u.kind == "lora"}
    for layer in layers:
        ranks = {r for m, r in served if m == layer}
        names = {c for m, c in said if m == layer}
        # rank 8 is "default", rank 4 "second": each either served or reported
        assert ranks | {8 if c == "adapter 'default'" else 4 for c in names} == {8, 4}, (layer, ranks, names)
    # in a float32 model every sum keeps the base output's dtype: both adapters are served
    assert rep.counts()["lora"] == 8 and not said, str(rep)


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
def test_dora_merged_adapters_and_an_lm_head_in_modules_to_save():
    """DoRA: peft's DoRA forward breaks dynamo's graph at the adapted layers (on torch 2.13 it calls
    str.startswith, which dynamo does not trace), so no adapter is served, and explain says why:
    the graph breaks with their reasons. Merged adapters: plain linear layers, nothing of LoRA left,
    every other site served. An LM head in modules_to_save: served, with the adapters."""
    # dynamo's caches as a fresh process has them: the graph breaks here leave each piece of the
    # model to dynamo's per-function recompile limit, which the tests before this one in a worker
    # process may have spent on the same transformers functions
    torch._dynamo.reset()
    try:
        dora = kernelgraft.explain(_lora("llama", torch.bfloat16, use_dora=True), **batch())
    finally:
        # the breaks leave peft's layer code compiled for this model's modules; dynamo keeps a few
        # such entries per code object, then runs it uncompiled: later peft models in this process
        # would lose their adapter sites (measured: 7 of 14)
        torch._dynamo.reset()
    assert "lora" not in dora.counts()
    assert sum(dora.graph_breaks.values()) >= 14, dora.graph_breaks  # at least one per adapted layer
    assert "graph breaks (" in str(dora) and all(why for why in dora.graph_breaks)
    merged = _lora("llama", torch.bfloat16)
    merged.merge_adapter()
    rep = kernelgraft.explain(merged, **batch())
    assert rep.counts() == {"rms_norm": 5, "rope": 4, "gated_mlp": 2, "lm_head_ce": 1}, str(rep)
    assert not rep.graph_breaks and not rep.near_misses
    saved = kernelgraft.explain(_lora("llama", torch.bfloat16, modules_to_save=["lm_head"]), **batch())
    assert saved.counts() == {"lora": 14, "rms_norm": 5, "rope": 4, "gated_mlp": 2, "lm_head_ce": 1}, str(
        saved
    )


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
def test_gradient_checkpointing_and_save_pretrained():
    """Each decoder layer under torch.utils.checkpoint: its adapters are served there too, with the
    numbers of the stock model (truth and eager without checkpointing: the same values; float32,
    where checkpointing's own order of summing x's gradient does not move the errors); the adapter
    then saves and loads as peft's own."""
    from peft import PeftModel

    stock = _lora("llama", torch.float32)
    mine = copy.deepcopy(stock)
    kw = {"use_reentrant": False}
    if hasattr(mine, "activation_checkpointing_enable"):  # transformers >= 5.2x
        mine.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        mine.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    mine.enable_input_require_grads()
    mine.train()
    kernelgraft.optimize(mine, backend="eager")
    bad = [str(v) for v in compare_models(mine, stock, batch(), compiled=False) if not v.ok]
    assert not bad, bad
    assert mine.kernelgraft_report.counts()["lora"] == 14
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        mine.save_pretrained(d)
        loaded = PeftModel.from_pretrained(tiny_model("llama", torch.float32), d)
    want = {k: v for k, v in mine.state_dict().items() if "lora_" in k}
    got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(want) == 28 and want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
