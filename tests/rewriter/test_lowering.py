"""Kernels launched by inductor (rewriter/lowering.py), checked on the CPU: each row op's calls, in a
graph of fake CUDA tensors becomes its launcher traced (allocations, torch ops, Triton launches with
their grids fixed), no kernelgraft op left; the traced launches, run here by Triton's interpreter
from the same generated source, give the Python launcher's numbers. Calls that cannot be traced
(CPU tensors) stay host launches. The GPU side (bits equal to the host launcher's, in whole models;
CUDA graphs) is tests/gpu/test_gpu_launch.py."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_mutation
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import kernelgraft
from kernelgraft.kernels import op_for
from kernelgraft.kernels.lm_head import op_for as lm_head_op_for
from kernelgraft.kernels.lora import kernel as lora_kernel
from kernelgraft.kernels.rows import pair_op_for, row_kernel
from kernelgraft.kernels.rows import tuning as row_tuning
from kernelgraft.kernels.rows.layout import layout, split_args
from kernelgraft.patterns import REGISTRY
from kernelgraft.rewriter.lowering import host_reason, launch_in_graph

ROUNDING = "fused"  # the inductor backend's kernels


@pytest.fixture(autouse=True)
def _an_h200s_sm_count(monkeypatch):
    # the backward's program count reads the GPU's SM count; this machine has none
    monkeypatch.setattr(row_tuning, "sm_count", lambda index: 132)
    monkeypatch.setattr(lora_kernel, "sm_count", lambda index: 132)


def _graph(fn, args):
    """fn traced on fake CUDA copies of args (a post-grad graph's shape: op calls, getitems)."""
    mode = FakeTensorMode()
    with mode:
        fakes = [
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda")
            if isinstance(a, torch.Tensor)
            else a
            for a in args
        ]
        return make_fx(fn, tracing_mode="real")(*fakes)


def _run_on_cpu(gm: fx.GraphModule, sp, spelled: list, args: list):
    """The traced graph run on CPU tensors `args`: each recorded launch by the interpreter's
    instance of the kernel it names (the same generated source; `spelled`: the spelling's arguments
    of the call, which choose the kernel)."""
    tensors, _ = split_args(sp, tuple(spelled))
    k = row_kernel(sp, {n: t.dtype for n, t in tensors.items()}, layout(sp, tensors).kinds, ROUNDING)

    def launch(name, grid, kwargs):
        which = name.removeprefix(k.spec.name + "_")
        k.fn(which, torch.device("cpu"))[grid](**kwargs)
        return which

    return _run_launches_on_cpu(gm, [a for a in args if isinstance(a, torch.Tensor)], launch)


def _run_launches_on_cpu(gm: fx.GraphModule, args: list, launch):
    """gm run on CPU tensors, each recorded Triton launch made by launch(kernel name, grid, its
    arguments) -> (outputs, what launch returned for each launch)."""

    class OnCPU(fx.Interpreter):
        def call_function(self, target, a, kw):
            if target is triton_kernel_wrapper_mutation:
                kernel = kernel_side_table.get_kernel(kw["kernel_idx"])
                consts = kernel_side_table.get_constant_args(kw["constant_args_idx"])
                while not hasattr(kernel, "arg_names") or hasattr(kernel, "configs"):
                    kernel = kernel.fn  # the autotuner that carries num_warps -> the JIT function
                self.launches.append(
                    launch(kernel.__name__, tuple(kw["grid"][0]), {**kw["kwargs"], **consts})
                )
                return None
            if "device" in kw:
                kw = dict(kw, device=torch.device("cpu"))
            return super().call_function(target, a, kw)

    runner = OnCPU(gm)
    runner.launches = []
    return runner.run(*args), runner.launches


def _ops_left(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and "kernelgraft" in str(n.target)]


def _inputs(name: str, dtype=torch.float32):
    sp = REGISTRY.get(*name.split("."))
    return sp, list(sp.example_args(64, 96 if sp.pattern != "rope" else 64, dtype, seed=1))


@pytest.mark.parametrize(
    "name", ["rms_norm.llama", "rms_norm.gemma", "gated_mlp.silu", "gated_mlp.gelu_tanh"]
)
def test_forward_and_backward_traced_run_as_the_python_launcher(name):
    sp, args = _inputs(name)
    op = op_for(sp, ROUNDING)
    n_t = len(sp.tensor_names)
    g = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(2))
    needs = [True] * n_t

    def step(*tensors):
        full = list(tensors[:n_t]) + [a for a in args if not isinstance(a, torch.Tensor)]
        y, st = op.fwd(*full)
        return [y, *op.bwd(tensors[n_t], *full, st, needs)]

    gm = _graph(step, [*args[:n_t], g])
    counts = launch_in_graph(gm.graph)
    gm.recompile()
    assert counts == {"inductor": 2}, counts
    assert _ops_left(gm) == []
    got, launches = _run_on_cpu(gm, sp, args, [*args[:n_t], g])
    # one forward launch, one backward, one column sum per per-column argument
    cols = [n for n in sp.tensor_names if args[sp.arg_names.index(n)].dim() == 1]
    assert launches == ["fwd", "bwd"] + [f"colsum_v_{n}" for n in cols]
    want_y, st = op.fwd(*args)
    want = [want_y, *op.bwd(g, *args, st, needs)]
    for name_, a, b in zip(["out", *sp.tensor_names], got, want):
        if name_ in cols:  # summed over other programs (the CPU's count here, an H200's in the trace)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b), name_


def test_each_traced_launch_holds_inductor_to_the_strides_it_was_traced_with():
    """The launcher passes row strides to its kernels as numbers: inductor must give each launch
    its arguments with exactly the traced strides (not only their order), or the kernel would read
    a buffer inductor lays out otherwise with the wrong strides. A launch carries its arguments'
    traced values (eager_input_vals), which make inductor require exact strides."""
    sp, (q, cos, sin) = _inputs("rope.rotate_half")
    wide = torch.randn(q.shape[0], q.shape[1], q.shape[2], 3 * q.shape[3])
    qs = wide[..., : q.shape[3]]  # a slice: rows 3x as far apart as its width, same stride order
    pair = pair_op_for(sp, ROUNDING)

    def fwd(q, cos, sin):
        o = pair.fwd(q, cos, sin, q, cos, sin)
        return [o[0], o[1]]

    gm = _graph(fwd, [qs, cos, sin])
    assert launch_in_graph(gm.graph) == {"inductor": 1}
    launches = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_mutation]
    assert launches
    for n in launches:
        args, kwargs = n.meta["eager_input_vals"]
        assert args == ()
        for name, a in n.kwargs["kwargs"].items():
            v = kwargs["kwargs"][name]
            if isinstance(a, fx.Node):
                assert isinstance(v, torch.Tensor) and v.stride() == a.meta["val"].stride(), name
            else:
                assert v == a, name
        assert {k: v for k, v in kwargs.items() if k != "kwargs"} == {
            k: v for k, v in n.kwargs.items() if k != "kwargs"
        }
    strides = {
        v.stride()
        for n in launches
        for v in n.meta["eager_input_vals"][1]["kwargs"].values()
        if isinstance(v, torch.Tensor)
    }
    assert qs.stride() in strides  # the slice's own strides, as the launcher saw them


def test_two_calls_traced_once_feed_a_third_as_two_values():
    """Two norms of one signature are traced once and copied; their outputs feed a gated MLP. Each
    copy has fake values of its own: with the trace's copied along, the two outputs were one fake
    tensor, and the MLP's trace read its up input for its gate too (seen on an H200: a LoRA model's
    gate and up projections, traced alike, fed the gated MLP kernel the up projection twice)."""
    sp_n, (x, w, eps) = _inputs("rms_norm.llama")
    sp_m = REGISTRY.get("gated_mlp", "silu")
    norm, mlp = op_for(sp_n, ROUNDING), op_for(sp_m, ROUNDING)
    x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))

    def fwd(x, x2, w):
        a, b = norm.fwd(x, w, eps)[0], norm.fwd(x2, w, eps)[0]
        return [a, b, mlp.fwd(a, b)[0]]

    gm = _graph(fwd, [x, x2, w])
    assert launch_in_graph(gm.graph) == {"inductor": 3}
    gm.recompile()
    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "call_function" and "val" in n.meta]
    storages = [v.untyped_storage() for v in vals if isinstance(v, torch.Tensor)]
    assert len({id(s) for s in storages}) > 1
    kernels = {}
    for sp, args in ((sp_n, (x, w, eps)), (sp_m, (x, x2))):
        tensors, _ = split_args(sp, args)
        k = row_kernel(sp, {n: t.dtype for n, t in tensors.items()}, layout(sp, tensors).kinds, ROUNDING)
        kernels[k.spec.name + "_"] = k

    def launch(name, grid, kwargs):
        prefix = next(p for p in kernels if name.startswith(p))
        kernels[prefix].fn(name.removeprefix(prefix), torch.device("cpu"))[grid](**kwargs)
        return name

    got, _ = _run_launches_on_cpu(gm, [x, x2, w], launch)
    a, b = norm.fwd(x, w, eps)[0], norm.fwd(x2, w, eps)[0]
    for what, g, want in zip(("a", "b", "mlp"), got, (a, b, mlp.fwd(a, b)[0])):
        assert torch.equal(g, want), what


def test_recomputing_backward_traced_runs_as_the_python_launcher():
    sp, args = _inputs("gated_mlp.silu")
    op = op_for(sp, ROUNDING, recompute=True)
    g = torch.randn(args[0].shape)
    gm = _graph(lambda a, b, gr: op.bwd_out(gr, a, b, [True, True]), [*args, g])
    assert launch_in_graph(gm.graph) == {"inductor": 1}
    gm.recompile()
    got, launches = _run_on_cpu(gm, sp, args, [*args, g])
    assert launches == ["bwdo"]
    want = op.bwd_out(g, *args, [True, True])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_pair_sharing_cos_and_sin_is_one_traced_launch():
    sp, (q, cos, sin) = _inputs("rope.rotate_half")
    k = q[:, :2].clone()
    pair = pair_op_for(sp, ROUNDING)

    def fwd(q, k, cos, sin):
        o = pair.fwd(q, cos, sin, k, cos, sin)  # one cos, one sin: one graph value each
        return [o[0], o[1]]

    gm = _graph(fwd, [q, k, cos, sin])
    assert launch_in_graph(gm.graph) == {"inductor": 1}
    gm.recompile()
    (oq, ok), launches = _run_on_cpu(gm, sp, [q, cos, sin], [q, k, cos, sin])
    assert launches == ["fwd2"]
    assert torch.equal(oq, sp.fn(q, cos, sin)) and torch.equal(ok, sp.fn(k, cos, sin))


def test_calls_on_the_cpu_stay_host_launches():
    sp, args = _inputs("rms_norm.llama")
    op = op_for(sp, ROUNDING)
    gm = make_fx(lambda x, w: list(op.fwd(x, w, 1e-6)))(*args[:2])
    node = next(n for n in gm.graph.nodes if "kernelgraft" in str(n.target))
    assert host_reason(node).startswith("not on CUDA")
    counts = launch_in_graph(gm.graph)
    assert counts["inductor"] == 0 and sum(counts.values()) == 1
    assert len(_ops_left(gm)) == 1


def test_options_mode_and_launch_are_checked():
    assert kernelgraft.Options(mode="reduce-overhead").cuda_graphs
    assert not kernelgraft.Options().cuda_graphs and kernelgraft.Options().inductor_launches
    assert not kernelgraft.Options(launch="host").inductor_launches
    assert not kernelgraft.Options(backend="eager").inductor_launches
    with pytest.raises(ValueError, match="mode must be one of"):
        kernelgraft.Options(mode="fast")
    with pytest.raises(ValueError, match="inductor's; with backend='eager'"):
        kernelgraft.Options(backend="eager", mode="reduce-overhead")
    with pytest.raises(ValueError, match="launch must be one of"):
        kernelgraft.Options(launch="gpu")


@pytest.mark.parametrize("g", [1.0, 2.0, 0.3, 1 / 3])
def test_lm_head_gradients_made_in_the_backward_are_the_stashed_ones(g):
    """The CUDA-graph LM head (loss in the forward, gradients in the backward for the incoming
    gradient, read as a tensor) gives the bits of the default one, which makes them in the forward
    and scales them (a power of two) or makes them again with g folded in (any other g)."""
    sp = REGISTRY.get("lm_head_ce", "hf_mean")
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 24, 32, generator=gen).bfloat16()
    W = (torch.randn(80, 32, generator=gen) * 0.2).bfloat16()
    t = torch.randint(0, 80, (2, 24), generator=gen)
    t[0, :3] = -100
    named = dict(h=h, weight=W, target=t, ignore_index=-100.0)
    got = {}
    for deferred in (False, True):
        hh, ww = h.clone().requires_grad_(), W.clone().requires_grad_()
        call = [hh if a == "h" else ww if a == "weight" else named[a] for a in sp.arg_names]
        op = lm_head_op_for(sp, "autograd", deferred=deferred)
        loss = op(*call)
        (loss * g).backward()
        got[deferred] = (loss.detach(), hh.grad, ww.grad)
    assert all(torch.equal(a, b) for a, b in zip(got[False], got[True]))


def test_a_small_head_on_a_gpu_makes_its_gradients_in_the_backward():
    """op.defers: on a GPU, a head whose extra logits matmul is at most DEFER_FLOPS makes its
    gradients in the backward (no read of the loss gradient on the host); a large one, or any on
    the CPU, or one of symbolic sizes, in the forward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kernelgraft.kernels.lm_head import FAMILY
    from kernelgraft.kernels.lm_head.op import DEFER_FLOPS, defers
    from kernelgraft.options import Options

    def head(T, H, V, device="cuda"):
        with FakeTensorMode():
            return dict(h=torch.empty(T, H, device=device), weight=torch.empty(V, H, device=device))

    small, large = head(8 * 1024, 576, 49152), head(8 * 2048, 2048, 128256)  # 135M's, 1B's
    assert 2 * 8192 * 576 * 49152 <= DEFER_FLOPS < 2 * 16384 * 2048 * 128256
    assert defers(small) and not defers(large)
    assert not defers(head(8 * 1024, 576, 49152, "cpu")) and not defers({})
    sp = REGISTRY.get("lm_head_ce", "hf_mean")
    pick = lambda metas, **o: FAMILY.op(sp, options=Options(**o), metas=metas).name  # noqa: E731
    assert "__deferred_" in pick(small) and "__deferred_" not in pick(large)
    assert "__deferred_" in pick(large, mode="reduce-overhead")  # CUDA graphs: always


def test_inductors_kernel_analysis_is_made_once_per_kernel_and_specialization(monkeypatch):
    """Inside memoized_kernel_analysis a launch's analysis is made once per (kernel, arguments as
    Triton specializes them), each caller gets its own copy, and the function is restored after."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    from kernelgraft.rewriter.lowering import memoized_kernel_analysis

    name = (
        "identify_accessed_tensors"
        if hasattr(wrap, "identify_accessed_tensors")
        else "identify_mutated_tensors"
    )
    made = []

    def analysis(kernel, kwargs, tma):
        made.append(dict(kwargs))
        return {"writes": ["out_ptr"]}

    monkeypatch.setattr(wrap, name, analysis)
    kernel = object()
    a, b = torch.empty(4), torch.empty(8)
    with memoized_kernel_analysis():
        first = getattr(wrap, name)(kernel, {"x_ptr": a, "N": 64}, {})
        first["writes"].append("changed by a caller")
        again = getattr(wrap, name)(kernel, {"x_ptr": b, "N": 64}, {})  # another tensor, same dtype
        getattr(wrap, name)(kernel, {"x_ptr": a, "N": 65}, {})  # another size: analysed
        getattr(wrap, name)(kernel, {"x_ptr": a.double(), "N": 64}, {})  # another dtype: analysed
        getattr(wrap, name)(object(), {"x_ptr": a, "N": 64}, {})  # another kernel: analysed
    assert again == {"writes": ["out_ptr"]}
    assert len(made) == 4
    assert getattr(wrap, name) is analysis


def test_the_eager_backend_calls_the_kernels_without_the_dispatcher_and_gets_the_same_bits(monkeypatch):
    """backend="eager" runs the graph as it is: each op call becomes its eager call (an
    autograd.Function around the same implementation). Loss and gradients are the op path's bits."""
    from tiny import batch, tiny_model

    from kernelgraft.rewriter import lowering

    b = batch(B=2, S=12)
    got = {}
    real = lowering.eager_calls
    for swap in (False, True):
        torch._dynamo.reset()
        swapped = []
        monkeypatch.setattr(
            lowering,
            "eager_calls",
            (lambda gm, seen=swapped: seen.append(real(gm))) if swap else (lambda gm: 0),
        )
        model = kernelgraft.optimize(tiny_model("llama", torch.bfloat16), backend="eager")
        out = model(**b)
        out.loss.backward()
        got[swap] = [out.loss.detach()] + [p.grad for p in model.parameters()]
        if swap:  # the graphs' row op calls: captured whole 5 norms, 2 MLPs, the 2 layers' q/k pairs;
            # per layer class the layers' graph has one layer's 4, the final norm's graph 1
            layers = model.kernelgraft_report.captured_as["kind"] == "layers"
            assert sum(swapped) == (5 if layers else 9) and max(swapped) == (4 if layers else 9), swapped
    assert all(torch.equal(a, b_) for a, b_ in zip(got[False], got[True]))


def _tuner(name, kernel, heuristic=None):
    """An inductor CachingAutotuner as a worker returns it: one compiled result, no launchers."""
    from torch._inductor.runtime import triton_heuristics as th

    t = object.__new__(th.CachingAutotuner)
    t.fn = type("F", (), {"__name__": name})()
    t.heuristic_type = heuristic or th.HeuristicType.USER_AUTOTUNE
    t.launchers, t.inductor_meta, t.triton_meta = [], {}, {}
    t.compile_results = [th.TritonCompileResult(kernel, {"c": 1}, {"m": 1}, {"i": 1})]
    return t


def _stub_static_launcher(monkeypatch):
    """The static launcher stubbed (no GPU here): it refuses the kernel it returns, takes any other."""
    from torch._inductor.runtime import triton_heuristics as th

    from kernelgraft.kernels import launching

    made = []
    refused = object()

    def precompile(self, compiled_here=False):  # inductor's: compiled in this process or by a worker
        if compiled_here:
            self.compile_results = [th.TritonCompileResult(compiled_here, {"c": 1}, {"m": 1}, {"i": 1})]
        self._make_launchers()

    monkeypatch.setattr(th.CachingAutotuner, "precompile", precompile)
    monkeypatch.setattr(th.CachingAutotuner, "_make_launchers", lambda self: made.append(self))
    monkeypatch.setattr(
        th.StaticTritonCompileResult,
        "can_statically_launch",
        staticmethod(lambda kernel, *a: None if kernel is refused else ("static", kernel)),
    )
    monkeypatch.setattr(launching, "KERNEL_PREFIXES", launching.KERNEL_PREFIXES | {"ours_"})
    return made, refused


def test_static_launches_swap_only_kernelgrafts_kernels_results(monkeypatch):
    """While kernelgraft compiles, a user-defined kernel it generated gets the static launcher's compiled
    result in place of Triton's launcher's (the worker made the latter); any other kernel, or one
    whose result the static launcher refuses, keeps its own. Checked on this torch's classes, the
    compile itself stubbed (no GPU here; tests/gpu/test_gpu_launch.py checks a real compile)."""
    from torch._inductor.runtime import triton_heuristics as th

    from kernelgraft.rewriter.lowering import launcher_kinds, static_launches

    made, refused = _stub_static_launcher(monkeypatch)

    mine, other = _tuner("ours_fwd", "k1"), _tuner("ours_bwd", refused)
    theirs, no = _tuner("theirs_fwd", "k2"), _tuner("ours_fwd", "k3", th.HeuristicType.POINTWISE)
    here = _tuner("ours_fwd", None)
    here.compile_results = []  # no worker result: precompile compiles it in this process
    with static_launches():
        for t in (mine, other, theirs, no):
            t.precompile()
        here.precompile(compiled_here="k5")
    assert made == [mine, other, theirs, no, here]  # inductor's own launchers made for each
    for t, k in ((mine, "k1"), (here, "k5")):
        (r,) = t.compile_results
        assert type(r) is th.StaticTritonCompileResult and r.kernel == ("static", k) and r.config == {"c": 1}
    for t in (other, theirs, no):
        assert type(t.compile_results[0]) is th.TritonCompileResult
    # outside a kernelgraft compile, nothing is swapped
    later = _tuner("ours_fwd", "k4")
    later.precompile()
    assert type(later.compile_results[0]) is th.TritonCompileResult
    # what a test or a profile reads back: kernelgraft's kernels only, each with its results' kinds
    kinds = launcher_kinds()
    assert kinds["ours_bwd"] == {"TritonCompileResult"} and "theirs_fwd" not in kinds
    assert kinds["ours_fwd"] == {"StaticTritonCompileResult", "TritonCompileResult"}


def test_static_launches_are_kept_for_graphs_loaded_from_caches(monkeypatch):
    """Once kernelgraft has compiled a graph with its launches, the swap stays for the process: a graph
    AOT autograd loads from its cache makes its kernels' launchers outside any inner compile (the
    GPU test of a second process on filled caches found Triton's launcher there). Installed once."""
    from torch._inductor.runtime import triton_heuristics as th

    from kernelgraft.rewriter import lowering

    monkeypatch.setattr(lowering, "_kept", None)
    made, refused = _stub_static_launcher(monkeypatch)
    lowering.keep_static_launches()
    hook = th.CachingAutotuner._make_launchers
    lowering.keep_static_launches()
    assert th.CachingAutotuner._make_launchers is hook  # not wrapped twice
    try:
        loaded, theirs = _tuner("ours_bwd", "k1"), _tuner("theirs_bwd", "k2")
        for t in (loaded, theirs):
            t.precompile()
        assert made == [loaded, theirs]
        assert type(loaded.compile_results[0]) is th.StaticTritonCompileResult
        assert loaded.compile_results[0].kernel == ("static", "k1")
        assert type(theirs.compile_results[0]) is th.TritonCompileResult
    finally:
        lowering._kept.close()


def test_a_graph_inductor_cannot_compile_with_its_launches_is_compiled_with_host_launches(monkeypatch):
    """Where inductor fails to compile a graph with kernelgraft's launches in it (a Triton compile
    error of a traced kernel, say), the graph is compiled again with the kernels launched from the
    Python launcher: a warning says so, the report counts those calls as host launches, and the
    step trains as the stock model does."""
    import copy
    import warnings

    from tiny import batch, compare_models, tiny_model

    from kernelgraft.rewriter import lowering

    def broken(graph):
        raise RuntimeError("forced: a traced kernel that does not compile")

    monkeypatch.setattr(lowering, "launch_in_graph", broken)
    # compiled here, not loaded from inductor's cache of graphs other tests compiled (a loaded graph
    # runs no post-grad pass, so nothing fails and nothing is counted)
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock))
    with warnings.catch_warnings(record=True) as caught, torch._inductor.config.patch(fx_graph_cache=False):
        warnings.simplefilter("always")
        verdicts = compare_models(mine, stock, batch(), compiled=False)
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]
    said = [str(w.message) for w in caught if "could not compile this graph" in str(w.message)]
    assert len(said) == 1 and "forced: a traced kernel" in said[0], said
    rep = mine.kernelgraft_report
    assert rep.counts() == {"rms_norm": 5, "lm_head_ce": 1, "rope": 4, "gated_mlp": 2}
    assert set(rep.launched_by) == {"host: inductor's launches failed to compile"}, rep.launched_by
    assert rep.launched_by["host: inductor's launches failed to compile"] >= 10


def test_every_generated_row_kernel_is_known_as_kernelgrafts():
    """The names inductor sees for a row module's kernels (every entry, the column sums too) are
    known as kernelgraft's from the moment the module is built; other names are not."""
    from triton.runtime.jit import JITFunction

    from kernelgraft.kernels.cache import load_module
    from kernelgraft.kernels.launching import is_kernelgraft_kernel

    sp = REGISTRY.get("rms_norm", "gemma")
    k = row_kernel(
        sp, {"x": torch.bfloat16, "weight": torch.bfloat16}, {"x": "elem", "weight": "col"}, ROUNDING
    )
    mod, _ = load_module(k.spec.name, k.source)
    names = [v.fn.__name__ for v in vars(mod).values() if isinstance(v, JITFunction)]
    entries = [n for n in names if n.startswith(k.spec.name)]
    assert len(entries) >= 4 and all(is_kernelgraft_kernel(n) for n in entries), names
    assert not is_kernelgraft_kernel("triton_poi_fused_add_0") and not is_kernelgraft_kernel(None)


@pytest.mark.parametrize("fused", [False, True], ids=["grad_u-grad_b", "grad_ub"])
@pytest.mark.parametrize("r", [4, 40])
def test_lora_traced_runs_as_the_python_launcher(monkeypatch, r, fused):
    """peft's default on a bf16 model (float32 adapters): the forward and backward calls become
    their launches, with a GPU's tiles (rank 4: the tuned tile; 40: the small one) and a GPU's
    row splits for dA and dB; run here, they give the Python launcher's bits with the same tiles.
    du and dB apart (the default) and from one read of the output's gradient (FUSED_UB)."""
    from kernelgraft.kernels.lora import kernel as lk

    monkeypatch.setattr(lk, "FUSED_UB", fused)

    sp = REGISTRY.get("lora", "peft")
    gen = torch.Generator().manual_seed(3)
    x, res = torch.randn(600, 96, generator=gen).bfloat16(), torch.randn(600, 40, generator=gen).bfloat16()
    a, b = torch.randn(r, 96, generator=gen) / 10, torch.randn(40, r, generator=gen) / 5
    g = torch.randn(600, 40, generator=gen).bfloat16()
    op = kernelgraft.kernels.op_for(sp)
    bwd = getattr(torch.ops.kernelgraft, f"{op.name}_bwd").default

    def step(x, res, a, b, g):
        out, u = op.fwd(x, res, a, b, 2.0)
        return [out, *bwd(g, u, [True, True, True], x, res, a, b, 2.0)]

    gm = _graph(step, [x, res, a, b, g])
    assert launch_in_graph(gm.graph) == {"inductor": 2}
    gm.recompile()
    assert _ops_left(gm) == []
    module, _ = lk.kernels(torch.bfloat16, torch.float32, torch.bfloat16, "cpu")

    def launch(name, grid, kwargs):  # the interpreter's instance of the same generated source
        getattr(module, name)[grid](**kwargs)
        return name

    got, launches = _run_launches_on_cpu(gm, [x, res, a, b, g], launch)
    name = lk.kernel_name(torch.bfloat16, torch.float32, torch.bfloat16)
    du_db = ("grad_ub",) if fused else ("grad_u", "grad_b")
    assert launches == [f"{name}_{k}" for k in ("down", "up", *du_db, "grad_a", "grad_x")]
    cuda = torch.device("cuda")
    blocks, splits = lk._blocks, lk._splits
    monkeypatch.setattr(lk, "_blocks", lambda R, kernel, device: blocks(R, kernel, cuda))
    monkeypatch.setattr(lk, "_splits", lambda T, n, BT, device, fill=None: splits(T, n, BT, cuda, fill))
    assert lk._splits(600, 1, 64, None)[0] > 1  # the row split is exercised
    out, u = lk.forward(x, res, a, b, 2.0)
    want = [out, *lk.backward(g, x, a, b, u, 2.0, (True, True, True))]
    for what, k, w in zip(("out", "dx", "dA", "dB"), got, want):
        assert torch.equal(k, w), what


def test_lora_with_2_byte_adapters_stays_a_host_launch_and_says_why():
    sp = REGISTRY.get("lora", "peft_same_dtype")
    x, res = torch.randn(16, 32).bfloat16(), torch.randn(16, 24).bfloat16()
    a, b = torch.randn(4, 32).bfloat16(), torch.randn(24, 4).bfloat16()
    op = kernelgraft.kernels.op_for(sp)
    gm = _graph(lambda x, res, a, b: list(op.fwd(x, res, a, b, 2.0)), [x, res, a, b])
    counts = launch_in_graph(gm.graph)
    assert counts["inductor"] == 0
    (why,) = [k for k in counts if k.startswith("host:")]
    assert "FMA contraction off" in why and "2-byte" in why


@pytest.mark.parametrize(
    "spelling, dtype, accumulate",
    [("hf_mean", torch.bfloat16, "weight"), ("plain_mean", torch.float32, "fp32")],
)
def test_the_deferred_lm_head_traced_runs_as_the_python_launcher(spelling, dtype, accumulate):
    """The LM head that makes its gradients in the backward (a small head on a GPU, or under CUDA
    graphs): its forward and backward calls become their launches and matmuls (three chunks, h's
    gradient joined from them, the weight's summed by addmm), no kernelgraft op left; run here by
    the interpreter from the same generated source, they give the Python launcher's bits: loss
    and every gradient, for an incoming gradient that is not a power of two."""
    from kernelgraft.kernels.lm_head.kernel import _kernel

    sp = REGISTRY.get("lm_head_ce", spelling)
    op = lm_head_op_for(sp, "autograd", deferred=True)
    bwd = getattr(torch.ops.kernelgraft, f"{op.name}_bwd").default
    gen = torch.Generator().manual_seed(4)
    T, H, V = 48, 32, 80
    named = {
        "h": torch.randn(T, H, generator=gen).to(dtype),
        "weight": (torch.randn(V, H, generator=gen) * 0.2).to(dtype),
        "bias": (torch.randn(V, generator=gen) * 0.1).to(dtype),
        "target": torch.randint(0, V, (T,), generator=gen),
        "ignore_index": -100.0,
    }
    named["target"][:5] = -100
    g = torch.tensor(0.3, dtype=dtype)
    needs = (True, True, "bias" in sp.arg_names)
    how = (16, accumulate, 0.0)  # 16 tokens a chunk: three chunks
    tensor_names = [a for a in sp.arg_names if a not in sp.scalar_names]

    def call_args(tensors):
        it = iter(tensors)
        return [next(it) if a in tensor_names else named[a] for a in sp.arg_names]

    def step(*tensors):
        args = call_args(tensors[:-1])
        loss, ticket = op.fwd(*args, *needs, *how)
        return [loss, *bwd(tensors[-1], ticket, *args, *needs, *how)]

    inputs = [named[a] for a in tensor_names] + [g]
    gm = _graph(step, inputs)
    assert launch_in_graph(gm.graph) == {"inductor": 2}
    gm.recompile()
    assert _ops_left(gm) == []
    ks = _kernel(sp, dtype, "autograd", "cpu")[0]
    by_name = {k.fn.__name__: k for k in (ks.ce, ks.scale, ks.loss)}

    def launch(name, grid, kwargs):  # the interpreter's instance of the same generated source
        by_name[name][grid](**kwargs)
        return name.removeprefix(ks.ce.fn.__name__) or "ce"

    got, launches = _run_launches_on_cpu(gm, inputs, launch)
    # the forward's and the backward's: the divisor and scale, three chunks, the loss
    assert launches == 2 * ["_scale", "ce", "ce", "ce", "_loss"], launches
    loss, ticket = op.fwd(*call_args(inputs[:-1]), *needs, *how)
    want = [loss, *bwd(g, ticket, *call_args(inputs[:-1]), *needs, *how)]
    names = ["loss", "h", "weight", "bias"]
    for what, a, b in zip(names, got, want):
        assert a.shape == b.shape and torch.equal(a, b), what


def test_a_biased_deferred_lm_head_stays_a_host_launch_and_says_why():
    sp = REGISTRY.get("lm_head_ce", "bias_hf_mean")
    op = lm_head_op_for(sp, "autograd", deferred=True)
    bwd = getattr(torch.ops.kernelgraft, f"{op.name}_bwd").default
    h, w, b = torch.randn(32, 16), torch.randn(40, 16), torch.randn(40)
    t, g = torch.randint(0, 40, (32,)), torch.tensor(0.5)

    def step(h, w, b, t, g):
        loss, ticket = op.fwd(h, w, b, t, -100.0, True, True, True, 0, "auto", 0.0)
        return [loss, *bwd(g, ticket, h, w, b, t, -100.0, True, True, True, 0, "auto", 0.0)]

    gm = _graph(step, [h, w, b, t, g])
    counts = launch_in_graph(gm.graph)
    # the forward (the loss alone) is traced; the backward, which sums the bias gradient, is not
    assert counts["inductor"] == 1, counts
    (why,) = [k for k in counts if k.startswith("host")]
    assert "biased head" in why and counts[why] == 1, counts


def test_the_post_grad_pass_keys_inductors_caches_by_the_graphs_recompute_tags():
    """AOT autograd partitions a graph by its recompute tags but keys its cache without them: the
    same graph tagged otherwise (another option, another release's policy) loaded the other's
    partition. kernelgraft's pass, which inductor's key includes, keys by them."""
    from torch.utils.checkpoint import CheckpointPolicy

    from kernelgraft.rewriter.lowering import PostGradPass, recompute_tags

    gm = fx.symbolic_trace(lambda x, w: torch.cat([w, w]) @ x)
    assert recompute_tags(gm) == ()
    cat = next(n for n in gm.graph.nodes if n.target is torch.cat)
    keys = []
    for policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE):
        cat.meta.update(recompute=policy, ac_graph_id=1)
        keys.append(PostGradPass(tags=recompute_tags(gm)).uuid())
    assert keys[0] == keys[2] != keys[1]
    assert PostGradPass().uuid() not in keys


@pytest.mark.parametrize(
    "name, dtype", [("rms_norm.llama", torch.bfloat16), ("layer_norm.affine", torch.float32)]
)
def test_a_norms_input_gradient_added_to_another_is_stored_summed(name, dtype):
    """The backward of a recomputed norm whose input gradient is added to another gradient (the
    residual stream's): residual.accumulate_into_gradients puts the accumulating op in place of
    the add, which inductor then launches; run here, the bits of the op and the add apart."""
    from kernelgraft.kernels.rows import launch as row_launch
    from kernelgraft.rewriter.residual import accumulate_into_gradients

    sp, args = _inputs(name, dtype)
    op = op_for(sp, ROUNDING, recompute=True)
    n_t = len(sp.tensor_names)
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(args[0].shape, generator=gen).to(dtype)
    r = torch.randn(args[0].shape, generator=gen).to(dtype)
    needs = [True] * n_t
    scalars = [a for a in args if not isinstance(a, torch.Tensor)]

    def step(*tensors):
        full = list(tensors[:n_t]) + scalars
        dx, *rest = op.bwd_out(tensors[n_t], *full, needs)
        return [tensors[n_t + 1] + dx, *rest]

    inputs = [*args[:n_t], g, r]
    gm = _graph(step, inputs)
    assert accumulate_into_gradients(gm.graph) == 1
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert launch_in_graph(gm.graph) == {"inductor": 1}
    gm.recompile()
    got, launches = _run_on_cpu(gm, sp, args, inputs)
    assert launches[0] == "bwdoa"
    want = row_launch.backward_with_out(sp, g, tuple(args), needs, ROUNDING)
    want[0] = r + want[0]
    for what, a, b in zip(["x", *sp.tensor_names[1:], "out"], got, want):
        if what in sp.tensor_names[1:]:  # per-column: summed over another program count here
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b), what


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("rms_norm.llama", torch.bfloat16),
        ("rms_norm.gemma", torch.float16),
        ("layer_norm.affine", torch.float32),
    ],
)
def test_a_norm_of_a_sum_makes_and_stores_the_sum_as_it_loads_the_rows(name, dtype):
    """A norm whose input is an add of two tensors (the residual stream and a sublayer's output):
    residual.add_into_norms puts the adding forward in place of both, which inductor then launches;
    run here, the norm's output and statistics and the sum are the bits of the add and the norm
    apart, and the add's other readers read the stored sum."""
    from kernelgraft.kernels.rows import launch as row_launch
    from kernelgraft.rewriter.residual import add_into_norms

    sp, args = _inputs(name, dtype)
    op = op_for(sp, ROUNDING)
    n_t = len(sp.tensor_names)
    gen = torch.Generator().manual_seed(7)
    r = torch.randn(args[0].shape, generator=gen).to(dtype)
    o = (torch.randn(args[0].shape, generator=gen) * 3).to(dtype)
    scalars = [a for a in args if not isinstance(a, torch.Tensor)]

    def step(r, o, *rest):
        h = r + o
        y, st = op.fwd(h, *rest, *scalars)
        return [y, st, h * 2]  # h read on: the stream

    inputs = [r, o, *args[1:n_t]]
    gm = _graph(step, inputs)
    assert add_into_norms(gm.graph) == 1
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert launch_in_graph(gm.graph) == {"inductor": 1}
    gm.recompile()
    got, launches = _run_on_cpu(gm, sp, args, inputs)
    assert launches == ["fwda"]
    h = r + o
    y, st = row_launch.forward(sp, (h, *args[1:]), ROUNDING)
    for what, a, b in zip(["out", "stats", "stream"], got, [y, st, h * 2]):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), what


def test_a_norm_of_a_broadcast_or_later_sum_is_left_apart():
    from kernelgraft.rewriter.residual import add_into_norms

    sp, args = _inputs("rms_norm.llama", torch.float32)
    op = op_for(sp, ROUNDING)
    x, w, eps = args

    def broadcast(x, w):
        return list(op.fwd(x + x.sum(0, keepdim=True), w, eps))  # a term of another shape

    def weight_made_after(x, w):
        h = x + x
        y, st = op.fwd(h, w.exp(), eps)  # the weight is made after the add, where the fused op would go
        return [y, st, h]

    def rounded_otherwise(x, w):
        return list(op.fwd(x + x.to(torch.bfloat16), w, eps))  # a term's dtype is not the norm input's

    for fn in (broadcast, weight_made_after, rounded_otherwise):
        gm = _graph(fn, [x, w])
        assert add_into_norms(gm.graph) == 0, fn.__name__


def test_an_input_gradient_read_twice_or_added_to_a_later_one_is_left_apart():
    from kernelgraft.rewriter.residual import accumulate_into_gradients

    sp, args = _inputs("rms_norm.llama", torch.float32)
    op = op_for(sp, ROUNDING, recompute=True)
    g = torch.randn(args[0].shape)

    def twice(x, w, g):
        dx, dw, y = op.bwd_out(g, x, w, args[2], [True, True])
        return [dx + g, dx * 2, dw, y]

    def later(x, w, g):
        dx, dw, y = op.bwd_out(g, x, w, args[2], [True, True])
        return [dx + g.exp(), dw, y]  # g.exp() is made after the call

    for fn in (twice, later):
        gm = _graph(fn, [args[0], args[1], g])
        assert accumulate_into_gradients(gm.graph) == 0, fn.__name__


def test_an_outputs_incoming_gradient_is_traced_with_the_outputs_strides(monkeypatch):
    """A compiled rotation of HF's transposed q returns its result laid out as q (as eager does), and
    the backward graph takes that output's gradient with the same strides, where torch's older guess
    (contiguous, set here as a torch that still defaults to it would have it) copies every incoming
    gradient into that layout first."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from kernelgraft.patterns import REGISTRY
    from kernelgraft.rewriter import lowering

    seen = {}
    real = lowering.PostGradPass.__call__

    def spy(self, graph):
        for n in graph.nodes:
            if n.op == "placeholder" and n.name.startswith("tangents"):
                seen[n.name] = n.meta["val"].stride()
        return real(self, graph)

    monkeypatch.setattr(lowering.PostGradPass, "__call__", spy)
    torch._dynamo.reset()
    q = torch.randn(2, 8, 4, 16).transpose(1, 2).requires_grad_()
    ang = torch.randn(2, 8, 16)
    cos, sin = ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)
    rope = REGISTRY.get("rope", "rotate_half").fn
    f = torch.compile(rope, backend=kernelgraft.Grafter("inductor"), dynamic=False)
    # the config's own patch: pytest's monkeypatch deletes a config entry on undo
    older_guess = functorch_config.patch(guess_tangent_strides_as_outputs=False)
    with older_guess, inductor_config.patch(force_disable_caches=True):
        y = f(q, cos, sin)
        g = torch.randn_like(y)
        (gq,) = torch.autograd.grad(y, (q,), g)
    assert y.stride() == q.stride() != q.contiguous().stride()
    assert seen == {"tangents_1": q.stride()}, seen
    want = rope(q, cos, sin)
    torch.testing.assert_close(gq, torch.autograd.grad(want, (q,), g)[0], rtol=1e-6, atol=1e-6)


def test_a_graph_inductor_cannot_compile_runs_as_captured_and_is_reported(monkeypatch):
    """Inductor's own failure on a graph (as on a library's Triton kernel it re-types) is not the
    user's: the graph runs as captured, kernelgraft's kernels included, with the model's numbers,
    and the report says which failure."""
    import copy

    import torch._inductor.compile_fx as inductor_compile
    from tiny import batch, tiny_model

    def compile_fx(gm, example_inputs, config_patches=None, **kw):
        raise RuntimeError("Loop-carried variable m of type fp32 is re-assigned to fp64")

    monkeypatch.setattr(inductor_compile, "compile_fx", compile_fx)
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="inductor")
    b = batch()
    with pytest.warns(RuntimeWarning, match="inductor could not compile a graph"):
        out = mine(**b)
    want = stock(**b)
    torch.testing.assert_close(out.loss, want.loss)
    out.loss.backward(), want.loss.backward()
    for (name, p), q in zip(mine.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name, rtol=1e-4, atol=1e-5)
    rep = mine.kernelgraft_report
    assert rep.counts()["rms_norm"] == 5 and rep.counts()["lm_head_ce"] == 1  # the kernels still serve
    assert any("runs as captured (RuntimeError: Loop-carried variable m" in n for n in rep.notes), rep.notes
