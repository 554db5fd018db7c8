"""How tensors reach the kernels: read in place through per-tensor strides (HF's transposed q and
cos/sin broadcast over heads are never copied), and two sites in one launch (q and k of a layer)."""

import contextlib
import dataclasses
import warnings

import pytest
import torch
from tiny import batch, compare_models, tiny_model

import kernelgraft
from kernelgraft.kernels import fallback, op_for
from kernelgraft.kernels.lm_head import kernel as lm_kernel
from kernelgraft.kernels.rows import build, launch, layout, pair_op_for, tuning
from kernelgraft.patterns import REGISTRY

ROPE = REGISTRY.get("rope", "rotate_half")
RMS = REGISTRY.get("rms_norm", "llama")


@pytest.fixture
def launches(monkeypatch):
    """Every generated-kernel entry fetched for a launch: (pattern, entry), entry 'fwd' for one set
    of tensors, 'fwd2' for two in one launch."""
    seen = []
    real = build.RowKernel.fn

    def fn(self, which, device):
        seen.append((self.spec.name.split("__")[0], which))
        return real(self, which, device)

    monkeypatch.setattr(build.RowKernel, "fn", fn)
    return seen


def rope_inputs(B, H, S, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    ang = torch.randn(B, S, D // 2, generator=g).repeat(1, 1, 2)
    return q, ang.cos().to(dtype).unsqueeze(1), ang.sin().to(dtype).unsqueeze(1)


def rope_eager(q, cos, sin):
    h = q.shape[-1] // 2
    return q * cos + torch.cat((-q[..., h:], q[..., :h]), dim=-1) * sin


def test_hf_layouts_are_read_in_place():
    q, cos, sin = rope_inputs(2, 4, 6, 8)
    shape = q.shape
    out = torch.empty(shape)
    sizes, strides, views = layout.row_plan(shape, [q, cos, sin, out], main=0)
    assert [v.data_ptr() for v in views] == [t.data_ptr() for t in (q, cos, sin, out)]  # no copies
    # the rows follow q's memory order (batch, position, head): a block of rows is one position's
    # heads, which read one row of cos and sin
    assert sizes == [2, 6, 4]
    # (D0, D1, D2) strides, then the column stride
    assert strides[0] == [6 * 4 * 8, 4 * 8, 8, 1]  # q: contiguous rows, heads innermost
    assert strides[1] == [6 * 8, 8, 0, 1] == strides[2]  # cos/sin: stride 0 over heads
    assert strides[3] == [4 * 6 * 8, 8, 6 * 8, 1]  # out (batch, head, position): written in place


def test_rope_walks_rows_in_the_memory_order_of_q_and_a_norm_as_given(monkeypatch):
    # the launcher's choice, forward and backward: RoPE (no row statistics) walks q's (batch,
    # position, head) memory order; RMSNorm (row statistics stored by place in the walk) keeps the
    # order as given. The numbers are the eager spelling's either way
    seen = []
    rows = launch.row_plan
    monkeypatch.setattr(
        launch,
        "row_plan",
        lambda shape, ts, main=None: (seen.append((main, rows(shape, ts, main)[0])), rows(shape, ts, main))[
            1
        ],
    )
    q, cos, sin = rope_inputs(2, 4, 6, 8)
    y = op_for(ROPE)(q, cos, sin)
    (gq,) = torch.autograd.grad(y, (q,), torch.ones_like(y))
    # the output and gradient are laid out as q (rows_like), so batch and position merge into one dim
    assert seen == [(0, [1, 12, 4]), (1, [1, 12, 4])], seen
    assert y.stride() == gq.stride() == q.stride() != q.contiguous().stride()
    want = rope_eager(q, cos, sin)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close(
        gq, torch.autograd.grad(want, (q,), torch.ones_like(want))[0], rtol=1e-6, atol=1e-6
    )
    seen.clear()
    x = torch.randn(2, 6, 4, 16).transpose(1, 2).requires_grad_()
    torch.autograd.grad(op_for(RMS)(x, torch.ones(16), 1e-6).sum(), (x,))
    assert [m for m, _ in seen] == [None, None], seen


@pytest.mark.parametrize("spelling", ["rotate_half", "interleaved", "halves", "pairs_in_halves"])
def test_a_rotation_is_laid_out_as_eager_lays_out_its_spelling(spelling):
    """An element-wise rotation keeps q's layout (HF's (batch, head, position) view of (batch,
    position, head) memory); one that writes its row whole (cat: GPT-OSS's halves, MLA's pairs in
    halves) is a new contiguous tensor in eager, and the launch and the op's fake implementation
    make it so too: a graph output laid out otherwise than eager's costs a copy of its incoming
    gradient (AOT autograd makes it contiguous). q's gradient keeps q's layout either way."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sp = REGISTRY.get("rope", spelling)
    ex = sp.example(64, 16, torch.float32, torch.Generator().manual_seed(0))
    args = [ex[n] for n in sp.arg_names]
    q = args[0]
    assert not q.is_contiguous()
    want = sp.fn(*args)
    got = op_for(sp)(*args)
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    assert got.is_contiguous() == (spelling in ("halves", "pairs_in_halves"))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (gq,) = torch.autograd.grad(got, (q,), torch.ones_like(got))
    assert gq.stride() == q.stride()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op_for(sp)(*[mode.from_tensor(a) for a in args])
    assert fake.stride() == want.stride()


def test_contiguous_dims_collapse_and_unit_dims_drop():
    x = torch.randn(3, 1, 5, 7, 16)
    w = torch.randn(16)
    sizes, strides, _ = layout.row_plan(x.shape, [x])
    assert sizes == [1, 1, 105] and strides == [[0, 0, 16, 1]]
    del w


def test_an_argument_broadcast_along_the_row_reads_column_stride_0():
    """A per-element argument of last dim 1 (broadcast across the row) gets column stride 0, and the
    kernel reads it in place: the same numbers as with the argument expanded and copied."""
    x = torch.randn(4, 6, 16)
    b = torch.randn(4, 6, 1)
    sizes, strides, views = layout.row_plan(x.shape, [x, b])
    assert strides[1][-1] == 0 and views[1].data_ptr() == b.data_ptr()
    sizes2, strides2, _ = layout.row_plan(x.shape, [x, b.expand(4, 6, 16)])
    assert (sizes, strides) == (sizes2, strides2)  # planned from shapes and strides: cached alike


def test_launch_plans_are_cached():
    layout._plan.cache_clear()
    x = torch.randn(3, 8, 32)
    for _ in range(3):
        layout.row_plan(x.shape, [x, torch.empty_like(x)])
    info = layout._plan.cache_info()
    assert info.misses == 1 and info.hits == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_more_than_three_irregular_dims_fall_back_to_a_copy_and_stay_exact(dtype):
    # 4 leading dims that no stride pattern merges: the launcher copies, numbers unchanged
    base = torch.randn(2, 3, 4, 5, 16).to(dtype)
    x = base.permute(3, 1, 0, 2, 4).detach().requires_grad_()
    w = torch.randn(16).to(dtype).requires_grad_()
    sizes, _, views = layout.row_plan(x.shape, [x])
    assert views[0].is_contiguous() and sizes == [1, 1, 120]
    # walked in its own memory order (kernels without row statistics), the same tensor is one
    # contiguous run of rows: read in place
    sizes, strides, views = layout.row_plan(x.shape, [x], main=0)
    assert views[0].data_ptr() == x.data_ptr() and sizes == [1, 1, 120] and strides[0] == [0, 0, 16, 1]
    op = op_for(RMS)
    y = op(x, w, 1e-6)
    xc = x.detach().contiguous().requires_grad_()
    assert torch.equal(y, op(xc, w, 1e-6))  # the same kernel on the same rows
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), g)
    want = torch.autograd.grad(op(xc, w, 1e-6), (xc, w), g)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_on_strided_layouts_equals_eager_bitwise_in_fp32_math(dtype):
    q, cos, sin = rope_inputs(2, 3, 5, 8, dtype)
    y = op_for(ROPE)(q, cos, sin)
    torch.testing.assert_close(y, rope_eager(q, cos, sin), rtol=0, atol=0 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paired_rope_equals_two_single_launches_bitwise(dtype, launches):
    q, cos, sin = rope_inputs(2, 4, 5, 8, dtype, seed=1)
    k, _, _ = rope_inputs(2, 2, 5, 8, dtype, seed=2)  # GQA: fewer k heads
    yq, yk, _, _ = pair_op_for(ROPE).fwd(q, cos, sin, k, cos, sin)
    assert launches == [("rope", "fwd2")]
    single = op_for(ROPE)
    assert torch.equal(yq, single(q, cos, sin)) and torch.equal(yk, single(k, cos, sin))
    gq, gk = torch.randn_like(yq), torch.randn_like(yk)
    paired = torch.autograd.grad([yq, yk], [q, k], [gq, gk])
    separate = torch.autograd.grad([single(q, cos, sin), single(k, cos, sin)], [q, k], [gq, gk])
    for a, b in zip(paired, separate):
        assert torch.equal(a, b)


def test_paired_norm_counts_a_shared_weight_gradient_once():
    g = torch.Generator().manual_seed(3)
    x1 = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    x2 = torch.randn(5, 16, generator=g, requires_grad=True)
    w = torch.randn(16, generator=g, requires_grad=True)
    y1, y2, _, _ = pair_op_for(RMS).fwd(x1, w, 1e-6, x2, w)
    single = op_for(RMS)
    got = torch.autograd.grad(y1.sum() + (2 * y2).sum(), (x1, x2, w))
    want = torch.autograd.grad(single(x1, w, 1e-6).sum() + (2 * single(x2, w, 1e-6)).sum(), (x1, x2, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_paired_call_with_different_weights_makes_two_launches_and_stays_right(launches):
    x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
    w1, w2 = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    y1, y2, _, _ = pair_op_for(RMS).fwd(x1, w1, 1e-6, x2, w2)
    assert launches == [("rms_norm", "fwd"), ("rms_norm", "fwd")]
    single = op_for(RMS)
    assert torch.equal(y1, single(x1, w1, 1e-6)) and torch.equal(y2, single(x2, w2, 1e-6))
    got = torch.autograd.grad(y1.sum() + y2.sum(), (w1, w2))
    want = torch.autograd.grad(single(x1, w1, 1e-6).sum() + single(x2, w2, 1e-6).sum(), (w1, w2))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_llama_q_and_k_share_one_launch_per_layer(launches):
    model, stock = tiny_model("llama"), tiny_model("llama")
    kernelgraft.optimize(model, backend="eager")
    b = batch()
    verdicts = compare_models(model, stock, b, compiled=False)
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]
    L = model.config.num_hidden_layers
    rope = [w for p, w in launches if p == "rope"]
    assert rope == ["fwd2"] * L + ["bwd2"] * L  # one forward and one backward launch per layer
    rep = model.kernelgraft_report
    # a site record per layer captured whole, one for all the layers captured per class
    per = 1 if rep.captured_as["kind"] == "layers" else L
    assert rep.counts()["rope"] == 2 * L and sum(s.paired for s in rep.sites) == 2 * per
    assert rep.launches() == sum(rep.counts().values()) - L  # per call, whatever the capture


class ReadsQBeforeK(torch.nn.Module):
    """The rotated q is read before k is rotated (k depends on it): one launch cannot serve both."""

    def forward(self, q, k, cos, sin):
        q2 = rope_eager(q, cos, sin)
        k = k * q2.mean()
        return q2, rope_eager(k, cos, sin)


def test_sites_whose_order_forbids_a_shared_launch_stay_separate():
    q, cos, sin = rope_inputs(1, 2, 4, 8)
    k, _, _ = rope_inputs(1, 2, 4, 8, seed=5)
    m = ReadsQBeforeK()
    rep = kernelgraft.explain(m, q, k, cos, sin)
    assert rep.counts() == {"rope": 2} and not any(s.paired for s in rep.sites)
    kernelgraft.optimize(m, backend="eager")
    got = m(q, k, cos, sin)
    want = ReadsQBeforeK.forward(None, q, k, cos, sin)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class ReadsQBeforeKIsRotated(torch.nn.Module):
    """Phi-3's order: both slices taken first, then q rotated and concatenated before k is rotated.
    The rotated q is read early, but k's input already exists there: one launch at q's site."""

    def forward(self, q, k, cos, sin):
        q_rot, q_pass = q[..., :4], q[..., 4:]
        k_rot, k_pass = k[..., :4], k[..., 4:]
        q2 = torch.cat([rope_eager(q_rot, cos, sin), q_pass], dim=-1)
        k2 = torch.cat([rope_eager(k_rot, cos, sin), k_pass], dim=-1)
        return q2, k2


def test_a_pair_launches_at_the_first_site_when_the_second_input_exists_there():
    q, _, _ = rope_inputs(1, 2, 4, 8)
    k, cos, sin = rope_inputs(1, 2, 4, 8, seed=5)
    cos, sin = cos[..., :4], sin[..., :4]
    m = ReadsQBeforeKIsRotated()
    rep = kernelgraft.explain(m, q, k, cos, sin)
    assert rep.counts() == {"rope": 2} and all(s.paired for s in rep.sites)
    want = m(q, k, cos, sin)
    kernelgraft.optimize(m, backend="eager")
    got = m(q, k, cos, sin)
    assert m.kernelgraft_report.launches() == 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_an_unused_output_of_a_pair_gets_no_gradient_and_the_other_is_right():
    q, cos, sin = rope_inputs(1, 2, 4, 8)
    k, _, _ = rope_inputs(1, 2, 4, 8, seed=7)
    yq, yk, _, _ = pair_op_for(ROPE).fwd(q, cos, sin, k, cos, sin)
    dq, dk = torch.autograd.grad(yq.sum(), (q, k), allow_unused=True, materialize_grads=True)
    (want,) = torch.autograd.grad(op_for(ROPE)(q, cos, sin).sum(), (q,))
    assert torch.equal(dq, want) and torch.equal(dk, torch.zeros_like(k))


@pytest.mark.parametrize("shape", [(8, 768), (3, 5, 1400), (2, 4096)])
def test_elementwise_ops_are_recut_into_power_of_two_rows(shape, monkeypatch):
    """A gated MLP's rows of 768 or 1400 are padded in registers; re-cut into rows of up to 4096 that
    divide the tensor, the kernel computes the same numbers bit for bit (forward and backward)."""
    sp = REGISTRY.get("gated_mlp", "silu")
    op = op_for(sp)
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(*shape, generator=g).bfloat16().requires_grad_() for _ in range(2))
    dy = torch.randn(*shape, generator=g).bfloat16()
    cuts = []
    real = launch.recut
    monkeypatch.setattr(launch, "recut", lambda s, a, C: cuts.append(C) or real(s, a, C))
    y = op(gate, up)
    grads = torch.autograd.grad(y, (gate, up), dy)
    n = gate.numel()
    want = next((c for c in tuning.flat_rows() if n % c == 0), 0) if shape[-1] & (shape[-1] - 1) else 0
    assert cuts == ([want, want] if want else [])
    monkeypatch.setitem(tuning.TABLE, "flat_rows", ())  # the rows as they come
    y0 = op(gate, up)
    grads0 = torch.autograd.grad(y0, (gate, up), dy)
    assert torch.equal(y, y0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))
    assert y.shape == gate.shape and all(a.shape == gate.shape for a in grads)


def test_recut_is_not_done_for_rows_that_mean_something():
    """Norms reduce along the row, RoPE permutes within it: their rows are kept."""
    for pattern, spelling in [("rms_norm", "llama"), ("rope", "rotate_half")]:
        sp = REGISTRY.get(pattern, spelling)
        kinds = {n: ("col" if n == "weight" else "elem") for n in sp.tensor_names}
        k = build.row_kernel(sp, {n: torch.float32 for n in sp.tensor_names}, kinds)
        assert not k.elementwise
    sp = REGISTRY.get("gated_mlp", "silu")
    k = build.row_kernel(
        sp, {n: torch.float32 for n in sp.tensor_names}, dict.fromkeys(sp.tensor_names, "elem")
    )
    assert k.elementwise


@pytest.fixture
def broken_kernels(monkeypatch):
    """Every generated kernel fails at launch, as a Triton compile error would."""

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("injected: triton compilation failed")

            return launch

    monkeypatch.setattr(build.RowKernel, "fn", lambda self, which, device: Broken())
    real = lm_kernel._kernel
    monkeypatch.setattr(
        lm_kernel, "_kernel", lambda *a: (dataclasses.replace(real(*a)[0], ce=Broken()), real(*a)[1])
    )
    monkeypatch.setattr(fallback, "FAILED", {})
    monkeypatch.setattr(fallback, "_FAILED_SITES", {})
    monkeypatch.setattr(fallback, "_SITES", {})  # the sites named are this test's models', as in a fresh process
    return fallback


def test_a_kernel_that_fails_to_compile_falls_back_with_a_warning(broken_kernels):
    from kernelgraft.kernels import failed_kernels

    x = torch.randn(6, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="failed on cpu .*injected.*stock PyTorch code"):
        y = op_for(RMS)(x, w, 1e-6)
    gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    ref = RMS.fn(x, w, 1e-6)
    rx, rw = torch.autograd.grad(ref, (x, w), torch.ones_like(ref))
    assert torch.equal(y, ref) and torch.equal(gx, rx) and torch.equal(gw, rw)  # the stock numbers
    assert any("rms_norm" in k[0] and "injected" in v for k, v in failed_kernels().items())


def test_a_check_of_a_kernel_that_fell_back_raises_instead_of_judging_eager(broken_kernels):
    """A kernel that fails gives the stock numbers, which pass the rule: the check raises instead,
    when the failure happens during the check and when it happened before in the process."""
    from kernelgraft.gradcheck import check_spelling
    from kernelgraft.gradcheck.spelling import KernelFellBack

    x = torch.randn(6, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    for _ in range(2):
        with pytest.warns(RuntimeWarning) if not broken_kernels.FAILED else contextlib.nullcontext():
            with pytest.raises(KernelFellBack, match="rms_norm.llama: the kernel fell back.*injected"):
                check_spelling(RMS, (x, w, 1e-6), compile_ref=False)


@pytest.mark.parametrize("error", ["DefaultCPUAllocator: can't allocate memory", "CUDA out of memory."])
def test_a_kernel_that_runs_out_of_memory_raises_and_stays_in_use(monkeypatch, error):
    """Memory that another program holds is not a defect of the kernel: the error reaches the user
    (as the stock code's would), nothing is recorded, and the kernel runs again the next time."""
    from kernelgraft.kernels import failed_kernels

    monkeypatch.setattr(fallback, "FAILED", {})
    monkeypatch.setattr(fallback, "_FAILED_SITES", {})
    real = build.RowKernel.fn
    calls = []

    def fn(self, which, device):
        if not calls:
            calls.append(which)

            class Full:
                def __getitem__(self, grid):
                    def launch(*args, **kwargs):
                        raise RuntimeError(error)

                    return launch

            return Full()
        calls.append(which)
        return real(self, which, device)

    monkeypatch.setattr(build.RowKernel, "fn", fn)
    x = torch.randn(6, 40)
    w = torch.randn(40)
    with pytest.raises(RuntimeError, match="memory"):
        op_for(RMS)(x, w, 1e-6)
    assert failed_kernels() == {}
    y = op_for(RMS)(x, w, 1e-6)
    assert len(calls) == 2 and torch.allclose(y, RMS.fn(x, w, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["eager", "eager, layers", "inductor", "inductor, reduce-overhead"])
def test_a_model_whose_kernels_fail_trains_like_the_stock_one(broken_kernels, backend):
    """Every family's kernel fails at its first launch (the sites were replaced at capture): the
    step trains on with the stock code's numbers, a warning names the sites, and the report says
    they fell back. Under inductor the stock gradients are computed inside a compiled graph; with
    mode="reduce-overhead" the LM head is the variant that makes its gradients in the backward."""
    stock = tiny_model("llama")
    mode = "reduce-overhead" if "reduce-overhead" in backend else None
    capture = "layers" if "layers" in backend else "whole"
    mine = kernelgraft.optimize(tiny_model("llama"), backend=backend.split(",")[0], mode=mode, capture=capture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verdicts = compare_models(mine, stock, batch(), compiled=False, fell_back_ok=True)
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]
    said = [str(w.message) for w in caught if "kernelgraft: the generated kernel" in str(w.message)]
    # norm, rope (paired), gated mlp, the LM head's CE kernel: each warned once, naming its sites
    assert len(said) == len(broken_kernels.FAILED) >= 4, said
    assert any(k[0].startswith("lm_head_ce") for k in broken_kernels.FAILED)
    rep = mine.kernelgraft_report
    # captured per layer class, the layers' sites are one record each (model.layers.*): 5 of them,
    # the final norm and the head; captured whole, 5 per layer
    layers = rep.captured_as["kind"] == "layers"
    first, second, n = ("model.layers.*", "model.layers.*", 7) if layers else ("model.layers.0", "model.layers.1", 12)
    assert any(f"{first}.input_layernorm" in s and "injected" in s for s in said), said
    assert any(f"{second}.mlp" in s for s in said), said
    assert len(rep.sites) == n and rep.counts() == {} and len(rep.fell_back_at_run_time()) == n
    assert all(r.status().startswith("fell back at run time: RuntimeError: injected") for r in rep.sites)
    assert "0 site(s) replaced" in str(rep) and "replaced" not in {r.row()[-1] for r in rep.sites}
    # and it stays so: the next step runs the stock code without a second warning, also for a loss
    # gradient that is not a power of two (the LM head's stock gradients made again in the backward)
    b2 = batch(seed=2)
    for m in (mine, stock):
        m.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        (mine(**b2).loss * 0.3).backward()
    assert not [w for w in again if "kernelgraft" in str(w.message)]
    (stock(**b2).loss * 0.3).backward()
    for (n, p), q in zip(mine.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
    # a comparison that does not expect it refuses to judge such a model (stock against stock)
    with pytest.raises(AssertionError, match="kernels fell back at run time.*injected"):
        compare_models(mine, stock, batch(), compiled=False)


def _real_and_fake(call, tensors):
    """call(*tensors) on the tensors, then on fake copies of them -> (real results, fake results)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = call(*tensors)
    with FakeTensorMode() as mode:
        fake = call(*(mode.from_tensor(t) for t in tensors))
    return real, fake


@pytest.mark.parametrize("layout", ["hf transposed", "contiguous", "gapped"])
def test_outputs_are_laid_out_as_the_fakes_declare(layout):
    """Inductor plans around the strides of an op's fake implementation: the launch must make the
    same ones, forward, backward and the backward that also makes the output (bwdo), single and
    paired. RoPE (no row statistics) lays its output and q's gradient out as q where q is dense
    (HF's transposed q: (batch, position, head) memory), contiguous where q has gaps; RMSNorm
    (row statistics) is contiguous whatever x's layout."""
    q, cos, sin = rope_inputs(2, 4, 6, 8)
    k, _, _ = rope_inputs(2, 2, 6, 8, seed=1)
    if layout == "contiguous":
        q, k = (t.detach().contiguous() for t in (q, k))
    elif layout == "gapped":  # every other head of a wider tensor: not dense
        q = rope_inputs(2, 8, 6, 8)[0].detach()[:, ::2]
    g, gk = torch.randn(q.shape), torch.randn(k.shape)
    single, pair = op_for(ROPE, recompute=True), pair_op_for(ROPE)
    cases = {
        "rope fwd": (lambda q, c, s: single.fwd(q, c, s), (q, cos, sin)),
        "rope bwd": (lambda g, q, c, s, st: single.bwd(g, q, c, s, st, [True, True, False]), (g, q, cos, sin,
                     torch.empty(*q.shape[:-1], 1))),
        "rope bwdo": (lambda g, q, c, s: single.bwd_out(g, q, c, s, [True, False, True]), (g, q, cos, sin)),
        "pair fwd": (lambda q, c, s, k: pair.fwd(q, c, s, k, c, s), (q, cos, sin, k)),
        "pair bwd": (lambda g, gk, q, c, s, k, a, b: pair.bwd(g, gk, q, c, s, k, c, s, a, b, [True] + [False] * 2
                     + [True] * 3), (g, gk, q, cos, sin, k, torch.empty(*q.shape[:-1], 1),
                                     torch.empty(*k.shape[:-1], 1))),
    }  # fmt: skip
    x = q.detach() if layout != "contiguous" else q.detach().transpose(1, 2)
    w = torch.randn(8)
    rms = op_for(RMS, recompute=True)
    cases["rms fwd"] = (lambda x, w: rms.fwd(x, w, 1e-6), (x, w))
    cases["rms bwdo"] = (
        lambda g, x, w: rms.bwd_out(g, x, w, 1e-6, [True, True]),
        (torch.randn(x.shape), x, w),
    )
    for name, (call, tensors) in cases.items():
        real, fake = _real_and_fake(call, [t.detach() for t in tensors])
        real = [t for t in real if t.numel()]
        fake = [t for t in fake if t.numel()]
        assert [(t.shape, t.stride(), t.dtype) for t in real] == [
            (t.shape, t.stride(), t.dtype) for t in fake
        ], name
        mains = [x] if name.startswith("rms") else [q, k] if name.startswith("pair") else [q]
        full = [(t, m) for t in real for m in mains if t.shape == m.shape]
        assert len(full) >= len(mains), name
        for t, m in full:
            if name.startswith("rms") or (layout == "gapped" and m is q):
                assert t.is_contiguous(), name
            else:
                assert t.stride() == m.stride(), name
