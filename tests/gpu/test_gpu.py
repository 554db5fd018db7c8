"""The same checks on a CUDA GPU (run with `pytest -m gpu`): compiled Triton instead of the interpreter."""

import copy

import pytest
import torch
from checks import assert_ok, rounding_module
from checks import rms_norm_inputs as inputs
from tiny import batch, compare_models, tiny_model

import kernelgraft
from kernelgraft.gradcheck import check_spelling
from kernelgraft.kernels import op_for
from kernelgraft.kernels.rows import MAX_N
from kernelgraft.patterns import REGISTRY

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
NORM_WHATS = ["out", "grad x", "grad weight"]  # every gradient of an RMSNorm op compared


@pytest.mark.parametrize("N", [1, 7, 4096, 5120])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1]
)
@pytest.mark.parametrize("spelling", ["llama", "gemma"])
def test_rms_norm_op_on_gpu(spelling, dtype, N):
    sp = REGISTRY.get("rms_norm", spelling)
    M = 4096 if N < 64 else 64
    assert_ok(check_spelling(sp, (*inputs(M, N, dtype, device=CUDA), 1e-6), compile_ref=True), NORM_WHATS)


def test_same_source_compiled_and_interpreted_in_one_process():
    sp = REGISTRY.get("rms_norm", "llama")
    op = op_for(sp)
    x, w = inputs(33, 300, torch.bfloat16)
    cpu = op(x, w, 1e-6)
    gpu = op(x.detach().cuda(), w.detach().cuda(), 1e-6)
    assert torch.equal(cpu, gpu.cpu())  # bf16 output: one rounding path, bit-identical on both
    assert torch.equal(gpu.cpu(), sp.fn(x, w, 1e-6))


def test_bf16_rounding_by_cast_is_the_bits_for_every_float32_on_gpu():
    # the compiled kernels round to bf16 by a cast (cvt.rn), the interpreter in bits: every one of
    # the 2**32 float32 bit patterns rounds to the same value both ways (NaN to NaN)
    mod = rounding_module(interpret=False)
    assert "_round_bf16_cast(x)" in mod._round_bf16.src  # the compiled instance takes the cast
    chunk = 1 << 28
    for start in range(0, 1 << 32, chunk):
        bits = torch.arange(start, start + chunk, device=CUDA, dtype=torch.int64)
        x = (bits - (1 << 32) * (bits >= (1 << 31))).to(torch.int32).view(torch.float32)
        a, b = torch.empty_like(x), torch.empty_like(x)
        mod.both[(chunk // 4096,)](x, a, b, chunk, BLOCK=4096)
        nan = torch.isnan(x)
        assert torch.equal(torch.isnan(a), nan) and torch.equal(torch.isnan(b), nan)
        assert torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan]), hex(start)
        # and both are torch's own float32 -> bfloat16 rounding
        assert torch.equal(a[~nan], x[~nan].to(torch.bfloat16).float()), hex(start)


def test_deterministic():
    sp = REGISTRY.get("rms_norm", "llama")
    op = op_for(sp)
    x, w = inputs(4096, 4096, torch.bfloat16, device=CUDA)
    g = torch.randn(4096, 4096, device=CUDA, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        xi, wi = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = op(xi, wi, 1e-6)
        y.backward(g)
        runs.append((y, xi.grad, wi.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# Known gap, measured on an H200 (2026-11-29): with the inductor backend in bf16 a few quantities
# miss the rule by 5-75% (loss; norm weights; q/k projections). The custom op is a fusion barrier:
# torch.compile keeps fp32 between the residual add, the norm and RoPE inside one fused kernel,
# while the grafted graph stores the norm's input, output and incoming gradient in bf16 at the cut.
# Fusing those neighbours into the pattern would close it; strict: a pass is news. Llama passes
# (q and k share one launch, read in place), and Gemma-2 since the norms add the residual stream
# themselves (rewriter/residual.py; passed on an H200 twice, 2026-12-04). On the CPU, with one batch the loss is one number and
# a norm weight's gradient a few dozen, so these checks are largely a draw of the rounding; over
# 32 batches Gemma-2 passes (tests/models/test_inductor_bf16.py), and Qwen3 over batches 65-192 (its loss
# over batches 1-64 misses by 10 %: noise of that size remains at 64 numbers). These GPU cases are
# judged on one batch.
_CUT = pytest.mark.xfail(strict=True, reason="bf16 precision lost at the fusion barrier under inductor")
CASES = [
    pytest.param(
        arch,
        backend,
        dtype,
        marks=_CUT if (backend, dtype, arch) == ("inductor", torch.bfloat16, "qwen3") else (),
    )
    for arch in ("llama", "gemma2", "qwen3")
    for backend in ("eager", "inductor")
    for dtype in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize("arch,backend,dtype", CASES, ids=lambda v: str(v).split(".")[-1])
def test_models_on_gpu(arch, backend, dtype):
    stock = tiny_model(arch, dtype, device="cuda")
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    verdicts = compare_models(grafted, stock, batch(device="cuda"))
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
    assert grafted.kernelgraft_report.counts()["rms_norm"] >= 5


@pytest.mark.parametrize("spelling", ["llama", "gemma"])
def test_large_rows_loop_path_on_gpu(spelling):
    sp = REGISTRY.get("rms_norm", spelling)
    x, w = inputs(16384, 4096, torch.bfloat16, device=CUDA)
    assert_ok(check_spelling(sp, (x, w, 1e-6), compile_ref=True), NORM_WHATS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paired_rope_in_place_layouts_on_gpu(dtype):
    # Llama-3-8B attention at S=2048: q 32 heads, k 8, transposed views; cos/sin broadcast over heads
    from kernelgraft.kernels.rows import pair_op_for

    sp = REGISTRY.get("rope", "rotate_half")
    B, S, D = 2, 2048, 128
    g = torch.Generator(device=CUDA).manual_seed(0)
    q = torch.randn(B, S, 32, D, device=CUDA, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, 8, D, device=CUDA, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    ang = torch.randn(B, S, D // 2, device=CUDA, generator=g).repeat(1, 1, 2)
    cos, sin = ang.cos().to(dtype).unsqueeze(1), ang.sin().to(dtype).unsqueeze(1)
    yq, yk, _, _ = pair_op_for(sp).fwd(q, cos, sin, k, cos, sin)
    single = op_for(sp)
    assert torch.equal(yq, single(q, cos, sin)) and torch.equal(yk, single(k, cos, sin))
    gq, gk = torch.randn_like(yq), torch.randn_like(yk)
    paired = torch.autograd.grad([yq, yk], [q, k], [gq, gk])
    separate = torch.autograd.grad([single(q, cos, sin), single(k, cos, sin)], [q, k], [gq, gk])
    assert all(torch.equal(a, b) for a, b in zip(paired, separate))
    verdicts = check_spelling(sp, (q, cos, sin), compile_ref=True)
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]




EXAMPLES_RUN: dict = {}


@pytest.mark.parametrize("sp", REGISTRY.spellings(), ids=[s.qualname for s in REGISTRY.spellings()])
def test_every_spelling_on_gpu(sp, request):
    """The property test of tests/gradcheck/test_every_pattern.py compiled for the GPU, with rows up to
    65536 wide (the LM head up to 4096: its weight is (3n + 5) x n), as many cases per spelling as the
    hypothesis profile draws: `make gpu-test` the default's few, fixed; `make gpu-test-thorough` the
    "thorough" profile's 200, drawn anew."""
    from checks import dtypes_for
    from hypothesis import given, settings

    from kernelgraft.gradcheck import strategies

    wide = 4096 if sp.kernel == "lm_head_ce" else MAX_N  # wider rows are refused (see test_kernels)
    # The LM head's gradients are sums over the vocabulary: at 4 rows x 8 the 32 numbers of grad h
    # make the rule a coin toss between equally good roundings; from 16 rows the error is a
    # statistic. (The softcap spellings need the kernel to round as CUDA eager does: CUDA's
    # tanh_backward rounds y*y and 1 - y*y in bf16/fp16, and the kernel launches without FMA
    # contraction, which would fuse 1 - y*y into one FMA. On an H200, 2026-11-30: 0 of 4016
    # logit-gradient elements differ from CUDA eager's on the fp16 case, and both softcap spellings
    # pass this test, 200 examples each.)
    low = 16 if sp.kernel == "lm_head_ce" else 4
    count = EXAMPLES_RUN.setdefault(sp.qualname, [0])
    failed: list = []

    @given(strategies.cases(sp, min_rows=low, max_width=wide, dtype_choices=dtypes_for(sp), device="cuda"))
    def check(case):
        count[0] += 1
        if count[0] % 50 == 0:
            print(f"{sp.qualname}: {count[0]} examples so far", flush=True)
        verdicts = check_spelling(sp, case.args, compile_ref=False)  # eager alone: the stricter bound
        bad = [str(v) for v in verdicts if not v.ok]
        if bad and not failed:  # said at once (with -s): a run cut short by its time keeps the case
            failed.append(case)
            print(f"\n{sp.qualname}: first failing case {case!r}: {'; '.join(bad)}", flush=True)
        assert not bad, "\n".join(bad)

    check()
    print(f"\n{sp.qualname}: {count[0]} examples")
    # the profile ran (hypothesis stops early only when it runs out of cases)
    assert count[0] >= settings().max_examples // 4


@pytest.mark.parametrize("name", ["llama", "olmo2", "gemma"])
@pytest.mark.parametrize("where", ["constant rows of 65536", "g = x, rows of 83"])
def test_float32_norms_on_long_constant_rows_and_cancelling_gradients(name, where):
    """Two float32 cases (drawn by the thorough profile on an H200) that a norm computed in float32
    fails and one computed in float64 (codegen.in_float64) passes: constant rows of 65536, where
    Triton's per-thread sums in float32 leave the statistic (and the output) at 5.7 float32 epsilons
    against eager's 0.8; and rows of 83 whose incoming gradient is x itself, where the x gradient's
    two terms cancel (2.3x eager's error for Gemma in float32)."""
    from kernelgraft.gradcheck.strategies import _values

    sp = REGISTRY.get("rms_norm", name)
    if where.startswith("constant"):
        args = _values(sp.example_args(4, 65536, torch.float32, 65535), "constant_rows")
    else:
        args = sp.example_args(4, 83, torch.float32, 0)
    args = tuple(
        a.detach().to(CUDA).requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in args
    )
    g = args[0].detach().clone() if where.startswith("g = x") else None
    verdicts = check_spelling(sp, args, grad_out=g, compile_ref=False)
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]


@pytest.mark.parametrize("name", ["affine", "weight_only", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [13, 4096, 5000])
def test_layer_norm_of_constant_rows_gives_the_bias(name, dtype, n):
    """A constant row's mean is its value and its variance 0, so LayerNorm gives the bias exactly
    (eager's Welford mean does); a float32 mean by Triton's `/` (CUDA's approximate division) was
    an ulp off on such rows: the output off by 5e-5 and the weight gradient, 0 in truth, nonzero
    (drawn by the thorough profile on an H200: 4 rows of 13, bf16, seed 1)."""
    from kernelgraft.gradcheck.strategies import _values

    sp = REGISTRY.get("layer_norm", name)
    args = _values(sp.example_args(4, n, dtype, 1), "constant_rows")
    args = tuple(
        a.detach().to(CUDA).requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in args
    )
    verdicts = check_spelling(sp, args, compile_ref=False)
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]


@pytest.mark.parametrize("pattern, name", [("layer_norm", "plain"), ("layer_norm", "affine"), ("rms_norm", "llama")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
def test_two_byte_norms_whose_gradient_is_their_input(pattern, name, dtype):
    """A bf16/fp16 norm whose incoming gradient is x itself (4 rows of 8: drawn by the thorough
    profile on an H200 for layer_norm.plain): the x gradient's terms (about 2) cancel
    to about 1e-5, amplifying the error of the row's 1/sqrt by var / eps. With CUDA's approximate
    rsqrt the kernel's error was 0.0131 against eager's 0.0114 (bound 0.0125); the kernels now take
    1/sqrt correctly rounded at each step (ir/sym.py: RSQRT)."""
    sp = REGISTRY.get(pattern, name)
    args = sp.example_args(4, 8, dtype, 0)
    args = tuple(
        a.detach().to(CUDA).requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in args
    )
    verdicts = check_spelling(sp, args, grad_out=args[0].detach().clone(), compile_ref=False)
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]


# ---- tensors over 2**31 elements (64-bit offsets) ---------------------------------------------------

BIG = 2**31 + 2**22  # elements: offsets past what int32 holds


def _big(N: int, seed: int, n: int):
    """n bf16 tensors of M x N > 2**31 elements (requiring grad), an incoming gradient, and M."""
    M = -(-BIG // N)
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    ts = [torch.randn(M, N, device=CUDA, generator=gen, dtype=torch.bfloat16) for _ in range(n + 1)]
    return [t.requires_grad_() for t in ts[:n]], ts[n], M


def _rows_vs_truth(sp, args, got, g, rows):
    """The rule on a slice of rows (row-wise patterns): kernelgraft's output and input gradient there
    vs eager's, against float64 truth, each from the spelling run on those rows alone."""
    from kernelgraft.gradcheck import judge

    x = args[0][rows].detach()
    outs = {}
    for name, dt in (("truth", torch.float64), ("eager", x.dtype)):
        xi = x.to(dt).requires_grad_()
        y = sp.fn(xi, *(a.detach().to(dt) if torch.is_tensor(a) else a for a in args[1:]))
        (gx,) = torch.autograd.grad(y, xi, g[rows].to(dt))
        outs[name] = (y, gx)
    return [judge(w, outs["truth"][i], got[i], outs["eager"][i]) for i, w in enumerate(("out", "grad x"))]


def test_rms_norm_over_2_31_elements():
    sp = REGISTRY.get("rms_norm", "llama")
    N = 4096
    (x,), g, M = _big(N, 0, 1)
    w = (1 + 0.2 * torch.linspace(-1, 1, N, device=CUDA)).bfloat16().requires_grad_()
    y = op_for(sp)(x, w, 1e-6)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    assert x.numel() >= BIG and torch.isfinite(gw).all()
    for rows in (slice(0, 256), slice(M // 2 - 128, M // 2 + 128), slice(M - 256, M)):
        bad = [str(v) for v in _rows_vs_truth(sp, (x, w, 1e-6), (y[rows], gx[rows]), g, rows) if not v.ok]
        assert not bad, (rows, bad)
    # the weight gradient sums every row: against float64 summed a block of rows at a time
    w64 = w.detach().double().requires_grad_()
    xe, we = x.detach().requires_grad_(), w.detach().requires_grad_()
    (gw_eager,) = torch.autograd.grad(sp.fn(xe, we, 1e-6), we, g)
    del xe, we
    for r0 in range(0, M, 65536):
        xs = x[r0 : r0 + 65536].detach().double()
        sp.fn(xs, w64, 1e-6).backward(g[r0 : r0 + 65536].double())
    from kernelgraft.gradcheck import judge

    v = judge("grad weight", w64.grad, gw, gw_eager)
    assert v.ok, str(v)


def test_gated_mlp_over_2_31_elements():
    sp = REGISTRY.get("gated_mlp", "silu")
    (gate, up), g, M = _big(14336, 1, 2)
    y = op_for(sp)(gate, up)
    gg, gu = torch.autograd.grad(y, (gate, up), g)
    from kernelgraft.gradcheck import judge

    for rows in (slice(0, 64), slice(M - 64, M)):
        outs = {}
        for name, dt in (("truth", torch.float64), ("eager", torch.bfloat16)):
            a, b = gate[rows].detach().to(dt).requires_grad_(), up[rows].detach().to(dt).requires_grad_()
            ye = sp.fn(a, b)
            outs[name] = (ye, *torch.autograd.grad(ye, (a, b), g[rows].to(dt)))
        for i, (what, got) in enumerate((("out", y), ("grad gate", gg), ("grad up", gu))):
            v = judge(what, outs["truth"][i], got[rows], outs["eager"][i])
            assert v.ok, (rows, str(v))


def test_lm_head_chunk_of_logits_over_2_31_elements():
    # one chunk of 16800 x 128256 bf16 logits (2.15e9 elements): the CE kernel's row offsets in int64
    import torch.nn.functional as F

    from kernelgraft.gradcheck import judge

    sp = REGISTRY.get("lm_head_ce", "hf_mean")
    T, H, V = 16800, 64, 128256
    gen = torch.Generator(device=CUDA).manual_seed(2)
    h = torch.randn(T, H, device=CUDA, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device=CUDA, generator=gen) / H**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, V, (T,), device=CUDA, generator=gen)
    t[::13] = -100
    assert T * V > 2**31  # one chunk past int32 offsets
    loss = op_for(sp).configured(chunk=T)(h, w, t, -100)
    gh, gw = torch.autograd.grad(loss, (h, w))
    ref = {}
    for name, dt in (("truth", torch.float64), ("eager", torch.bfloat16)):
        hh, ww = h.detach().to(dt).requires_grad_(), w.detach().to(dt).requires_grad_()
        le = F.cross_entropy(F.linear(hh, ww).float(), t, ignore_index=-100)
        ref[name] = (le, *torch.autograd.grad(le, (hh, ww)))
        del le
    for i, (what, got) in enumerate((("loss", loss), ("grad h", gh), ("grad weight", gw))):
        v = judge(what, ref["truth"][i], got, ref["eager"][i])
        assert v.ok, str(v)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_causal_mask_rewrite_on_gpu(backend, monkeypatch):
    # transformers 5.17 builds the causal mask whenever dynamo traces; newer
    # ones skip it. Made to build it here either way: every layer's SDPA runs with is_causal=True
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    stock = tiny_model("llama", torch.float32, device="cuda")
    grafted = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    bad = [str(v) for v in compare_models(grafted, stock, batch(device="cuda")) if not v.ok]
    assert not bad, "\n".join(bad)
    assert grafted.kernelgraft_report.counts()["sdpa"] == stock.config.num_hidden_layers


@pytest.mark.parametrize(
    "sp", [sp for sp in REGISTRY.spellings() if sp.recompute], ids=lambda sp: sp.qualname
)
def test_backward_kernel_makes_the_recomputed_output_on_gpu(sp):
    # the `_bwdo` entry against the forward and backward kernels. Element-wise spellings (the gated
    # MLP): bitwise. Norms: their row statistic is summed under the backward's launch configuration,
    # in another order than the forward's, so a rare element may round the other way (by one unit
    # in the last place), never more
    op = op_for(sp, "fused", recompute=True)
    N = 8192 if sp.pattern == "gated_mlp" else 2048
    args = tuple(
        a.detach().to(CUDA) if isinstance(a, torch.Tensor) else a
        for a in sp.example_args(4096, N, torch.bfloat16)
    )
    y, stats = op.fwd(*args)
    g = torch.randn(y.shape, device=CUDA).to(y.dtype)
    needs = [True] * len(sp.tensor_names)
    want = [*op.bwd(g, *args, stats, needs), y]
    got = op.bwd_out(g, *args, needs)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        if sp.pattern == "gated_mlp":
            assert torch.equal(a, b)
            continue
        a, b = a.float(), b.float()
        differ = (a != b).float().mean().item()
        assert differ <= 1e-3, differ
        assert ((a - b).abs() <= b.abs() * 2**-7 + 1e-6).all()


@pytest.mark.parametrize(
    "sp",
    [sp for sp in REGISTRY.spellings() if sp.recompute and sp.pattern in ("rms_norm", "layer_norm")],
    ids=lambda sp: sp.qualname,
)
def test_norms_take_the_residual_streams_adds_bitwise_on_gpu(sp):
    """The `_fwda` entry (the norm of a + b, the sum stored) against the add and then the forward
    kernel, and `_bwdoa` (the input gradient stored with r added) against `_bwdo` and then the add:
    bitwise, at a decoder's width in bf16 (the same launch configurations as the entries they
    stand for, so the same sums)."""
    op = op_for(sp, "fused", recompute=True)
    args = tuple(
        a.detach().to(CUDA) if isinstance(a, torch.Tensor) else a
        for a in sp.example_args(4096, 2048, torch.bfloat16, seed=3)
    )
    gen = torch.Generator(device=CUDA).manual_seed(4)
    x = args[0]
    o = torch.randn(x.shape, device=CUDA, generator=gen).to(x.dtype)
    h = x + o
    y, stats = op.fwd(h, *args[1:])
    got = op.fwd_add(x, o, *args[1:])
    for what, a, b in zip(["out", "stats", "sum"], got, [y, stats, h]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what
    g = torch.randn(y.shape, device=CUDA, generator=gen).to(y.dtype)
    r = torch.randn(x.shape, device=CUDA, generator=gen).to(x.dtype)
    needs = [True] * len(sp.tensor_names)
    want = op.bwd_out(g, h, *args[1:], needs)
    want[0] = want[0] + r
    got = op.bwd_out_acc(g, h, *args[1:], r, needs)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), i


@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
def test_a_biased_heads_weight_gradient_over_constant_rows_on_gpu(layout):
    """A case the thorough profile drew (lm_head_ce.bias_hf_sum_n, 16 rows of 62, bf16, constant rows,
    seed 7793): on an H100 the kernel's weight gradient erred 0.00402 against CUDA eager's 0.0026."""
    from kernelgraft.gradcheck.strategies import _layout, _values, on_device

    sp = REGISTRY.get("lm_head_ce", "bias_hf_sum_n")
    args = _values(sp.example_args(16, 62, torch.bfloat16, 7793), "constant_rows")
    verdicts = check_spelling(sp, _layout(on_device(args, CUDA), layout), compile_ref=False)
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts]


@pytest.mark.parametrize("name", ["bias_hf_mean", "softcap_float_sum_n"])
def test_lm_head_gradients_keep_their_bits_when_h_and_the_weight_are_stored_transposed(name):
    """cuBLAS rounds a bf16 z^T h with a column-major h less accurately than with a row-major one
    (an H200: 0.00244 against 0.00166 relative, T 16, H 159, V 482), which made the weight gradient
    of a transposed h fail the rule; the kernel reads such a chunk row-major. Every output and
    gradient is the same bits in either layout."""
    from kernelgraft.gradcheck.spelling import compare
    from kernelgraft.gradcheck.strategies import _layout, _values, on_device

    sp = REGISTRY.get("lm_head_ce", name)
    base = on_device(_values(sp.example_args(16, 159, torch.bfloat16, 0), "gaussian"), "cuda")
    runs = [compare(sp, _layout(base, lay), op_for(sp), compile_ref=False) for lay in ("contiguous", "transposed")]
    for (what, _, kc, _, _), (_, _, kt, _, _) in zip(*runs):
        assert torch.equal(kc, kt), what


# a CUDA process that trains the tiny Llama a step, then meets a label outside its vocabulary: what
# reaches the host is printed (a device-side assert poisons the process's CUDA context: its own process)
_BAD_LABEL_STEP = """
import sys
import torch
import kernelgraft
from tiny import VOCAB, batch, tiny_model
backend = sys.argv[1]
model = kernelgraft.optimize(tiny_model("llama", torch.float32, device="cuda"), backend=backend)
b = batch(B=2, S=16, device="cuda")
model(**b).loss.backward()
torch.cuda.synchronize()
print("SERVED", model.kernelgraft_report.counts().get("lm_head_ce"))
b["labels"] = b["labels"].clone()
b["labels"][0, 5] = VOCAB
try:
    model(**b).loss.backward()
    torch.cuda.synchronize()
except RuntimeError as e:
    print("RAISED", " ".join(str(e).split()))
else:
    print("NOTHING RAISED")
"""


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_label_outside_the_vocabulary_is_a_device_assert(backend):
    """On CUDA the fused LM head checks its labels on the device, as torch's own loss kernel does: a
    device-side assert, a RuntimeError at the next synchronization (the CPU's IndexError is
    tests/kernels/test_bad_labels.py's), after one reduction of the labels and no host read, in the launcher
    the eager backend calls and in the launches traced into inductor's graph alike."""
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).resolve().parents[1] / "helpers"  # tiny, imported from the cwd
    r = subprocess.run(
        [sys.executable, "-c", _BAD_LABEL_STEP, backend], capture_output=True, text=True, timeout=600, cwd=here
    )
    out = r.stdout + r.stderr
    assert "SERVED 1" in r.stdout, out
    assert "RAISED" in r.stdout and "device-side assert" in r.stdout, out


def test_the_label_check_reads_nothing_on_the_host():
    """The check itself, on valid labels and the ignore index, under CUDA's sync debug mode set to raise
    on any host read of a device value (tests/gpu/test_gpu_launch.py runs a whole step so)."""
    from kernelgraft.kernels.lm_head.kernel import check_labels

    t = torch.randint(0, 128, (4096,), device="cuda")
    t[::7] = -100
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        check_labels(t, 128, -100)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
