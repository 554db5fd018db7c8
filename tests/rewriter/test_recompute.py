"""Outputs recomputed in the backward (patterns declared with recompute=True: the gated MLP and
RMSNorm): with the inductor backend AOT autograd's partitioner makes them again from the inputs their
kernels' backward keeps, instead of saving them for the matmuls that read them. Less saved for the
backward, the same numbers (the accuracy rule against float64)."""

import copy
import re
import sys
from pathlib import Path

import pytest
import torch
from tiny import batch, compare_models, compiled_anew, tiny_model

import kernelgraft

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from benchlib import saved_for_backward  # noqa: E402  (the suite's measure of the same)


def test_recomputed_outputs_are_not_saved_and_the_numbers_hold():
    stock = tiny_model("llama", layers=2)
    cfg = stock.config
    b = batch(B=2, S=16)
    T, L = 2 * 16, cfg.num_hidden_layers
    hidden = {}
    for recompute in (True, False):
        # gate and up apart (fuse_projections=False): saved tensors are counted by storage, and fused
        # they are two views of one
        mine = kernelgraft.optimize(
            copy.deepcopy(stock), backend="inductor", recompute=recompute, fuse_projections=False
        )
        bad = [str(v) for v in compare_models(mine, stock, b, compiled=False) if not v.ok]
        assert not bad, (recompute, bad)
        saved = saved_for_backward(mine, lambda m=mine: m(**b, use_cache=False).loss)
        mlp = [s for s, shape in saved.values() if shape and shape[-1] == cfg.intermediate_size]
        assert all(s == T * cfg.intermediate_size * 4 for s in mlp), mlp
        # per layer the MLP's gate and up (its kernel's backward reads them); its output only
        # without recompute (the down projection saves it for its weight gradient)
        assert len(mlp) == (2 if recompute else 3) * L, (recompute, sorted(saved.values()))
        hidden[recompute] = sum(s for s, shape in saved.values() if shape and shape[-1] == cfg.hidden_size)
    # and the RMSNorm outputs (the projections' inputs): 2 per layer and, captured whole, the final
    # norm's (the LM head's input), T x hidden float32 each, saved only without recompute; per layer
    # class the final norm is a graph of its own, whose output the head's graph keeps
    norms = 2 * L + (mine.kernelgraft_report.captured_as["kind"] != "layers")
    assert hidden[False] - hidden[True] >= norms * T * cfg.hidden_size * 4, hidden


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_gradient_checkpointing_regions_are_grafted(backend):
    # Hugging Face's gradient checkpointing puts each decoder layer under torch.utils.checkpoint;
    # dynamo captures the layer as a graph of its own behind a higher-order op. Its sites are
    # served there too (before: the final norm and the LM head only), and the numbers hold (truth
    # and eager from the stock model without checkpointing: the same values)
    stock = tiny_model("llama", layers=2)
    mine = copy.deepcopy(stock)
    if hasattr(mine, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name is deprecated
        mine.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        mine.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mine.train()
    kernelgraft.optimize(mine, backend=backend)
    bad = [str(v) for v in compare_models(mine, stock, batch(), compiled=False) if not v.ok]
    assert not bad, bad
    assert mine.kernelgraft_report.counts() == {"rms_norm": 5, "rope": 4, "gated_mlp": 2, "lm_head_ce": 1}


class _Scope:
    """A library's state, set on entering a forward and reset on leaving it (transformers' kernel-hub
    context variable does this in every attention forward)."""

    active = None


class _CheckpointedNorm(torch.nn.Module):
    def __init__(self, n=64):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(n))

    def _body(self, x):
        _Scope.active = self
        try:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (self.weight * h.to(x.dtype)).sin()
        finally:
            _Scope.active = None

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False).sum()


def test_a_checkpointed_region_that_sets_and_resets_python_state_is_grafted():
    """Dynamo cannot replay a Python side effect in the backward's recompute and, by default, leaves
    the checkpointed region out of the graph: none of its sites would be served. Under kernelgraft
    the side effect runs once, in the forward (the state is reset on leaving it, as in eager); the
    output and the gradients by the rule against float64 truth beside eager."""
    from kernelgraft.gradcheck import judge

    torch.manual_seed(0)
    stock = _CheckpointedNorm()
    models = {"truth": copy.deepcopy(stock).double(), "eager": stock}
    models["kg"] = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    x = torch.randn(4, 8, 64)
    runs = {}
    for name, m in models.items():
        xin = (x.double() if name == "truth" else x).clone().requires_grad_()
        out = m(xin)
        out.backward()
        runs[name] = (out.detach(), xin.grad, m.weight.grad)
    rep = models["kg"].kernelgraft_report
    assert [s.pattern for s in rep.sites] == ["rms_norm"], str(rep)
    assert _Scope.active is None
    for i, what in enumerate(("out", "grad x", "grad weight")):
        v = judge(what, runs["truth"][i], runs["kg"][i], runs["eager"][i])
        assert v.ok, str(v)


def _graph_with_a_recomputed_call():
    """x -> call (tagged for recompute) -> getitem -> three readers (a, b, c); c also reads z, which a
    node `late` makes; and a slice of the output read by d."""
    import operator

    import torch.fx as fx

    from kernelgraft.rewriter.replace import RECOMPUTE_META

    g = fx.Graph()
    x = g.placeholder("x")
    call = g.call_function(torch.ops.aten.relu.default, (x,))
    call.meta[RECOMPUTE_META] = True
    out = g.call_function(operator.getitem, (call, 0))
    a = g.call_function(torch.ops.aten.neg.default, (out,))
    b = g.call_function(torch.ops.aten.exp.default, (out,))
    late = g.call_function(torch.ops.aten.sin.default, (x,))
    c = g.call_function(torch.ops.aten.add.Tensor, (out, late))
    sl = g.call_function(operator.getitem, (out, slice(0, 1)))
    d = g.call_function(torch.ops.aten.cos.default, (sl,))
    g.output((a, b, c, d))
    return dict(call=call, out=out, a=a, b=b, late=late, c=c, sl=sl, d=d)


def _moves(graph, piece_of) -> dict:
    """node -> the piece it moves to, over all of ddp._move_groups' groups."""
    from kernelgraft.rewriter.ddp import _move_groups

    return {n: to for group in _move_groups(graph, piece_of) for n, to in group.items()}


def test_ddp_cut_keeps_a_recomputed_call_with_its_readers():
    # the plan applied while DDPOptimizer cuts a graph (rewriter/ddp.py): pieces by number, in
    # graph order, as DDPOptimizer numbers them
    n = _graph_with_a_recomputed_call()
    g = n["call"].graph
    # readers in pieces 1, 2, 3 (and the slice's reader in 2); c's other input made in piece 3
    piece = {n["call"]: 0, n["out"]: 0, n["a"]: 1, n["b"]: 2, n["late"]: 3, n["c"]: 3, n["sl"]: 0, n["d"]: 2}
    moved = _moves(g, lambda x: piece[x])
    assert moved == {}, moved  # c cannot join piece 1 (sin is made in 3): the call stays, as cut
    # with sin made in piece 0, every reader joins piece 1, and the call, its getitem and the slice
    piece[n["late"]] = 0
    moved = _moves(g, lambda x: piece[x])
    want = {k: 1 for k in ("call", "out", "sl", "b", "c", "d")}
    assert {k: moved[v] for k, v in n.items() if v in moved} == want
    # an in-place reader never moves (nor, then, the call)
    n["c"].target = torch.ops.aten.add_.Tensor
    assert _moves(g, lambda x: piece[x]) == {}
    n["c"].target = torch.ops.aten.add.Tensor
    # readers all in the call's own piece: nothing to move
    assert _moves(g, lambda x: 0) == {}
    # a numbering that is not DDPOptimizer's (not numbers): left alone
    assert _moves(g, lambda x: "p") == {}


def test_ddp_cut_moves_keep_autocast_switches_in_place():
    # split_module wants a graph with autocast (or grad-mode) switches cut into pieces in graph order:
    # the moved nodes are put in piece order, and a move that would carry a node past a switch (so
    # that it ran in another mode) is dropped with its whole group
    import operator

    import torch.fx as fx

    from kernelgraft.rewriter.ddp import _in_piece_order, _move_groups
    from kernelgraft.rewriter.replace import RECOMPUTE_META

    def graph(switch_between: bool):
        g = fx.Graph()
        x = g.placeholder("x")
        nodes = {}
        if not switch_between:  # an autocast region before everything: nothing crosses it
            nodes["enter"] = g.call_function(torch.amp._enter_autocast, ("cpu", None, False, None))
            nodes["exit"] = g.call_function(torch.amp._exit_autocast, (nodes["enter"],))
        nodes["call"] = g.call_function(torch.ops.aten.relu.default, (x,))
        nodes["call"].meta[RECOMPUTE_META] = True
        nodes["out"] = g.call_function(operator.getitem, (nodes["call"], 0))
        nodes["mid"] = g.call_function(torch.ops.aten.sin.default, (x,))
        if switch_between:  # a region between the call and its reader
            nodes["enter"] = g.call_function(torch.amp._enter_autocast, ("cpu", None, False, None))
            nodes["exit"] = g.call_function(torch.amp._exit_autocast, (nodes["enter"],))
        nodes["a"] = g.call_function(torch.ops.aten.neg.default, (nodes["out"],))
        g.output((nodes["a"], nodes["mid"]))
        return g, nodes

    for switch_between in (False, True):
        g, n = graph(switch_between)
        # DDPOptimizer's numbering: in graph order; the reader a is in the last piece
        piece = {n["call"]: 0, n["out"]: 0, n["mid"]: 0, n["a"]: 2}
        piece.update({n["enter"]: 1, n["exit"]: 1} if switch_between else {n["enter"]: 0, n["exit"]: 0})
        moved = _moves(g, piece.__getitem__)
        assert moved == {n["call"]: 2, n["out"]: 2}, moved  # the call joins its reader
        kept = _in_piece_order(g, piece.__getitem__, _move_groups(g, piece.__getitem__))
        final = [kept.get(v, piece.get(v)) for v in g.nodes if v.op == "call_function"]
        assert final == sorted(final), final  # pieces in graph order, as split_module checks
        order = [v for v in g.nodes if v.op == "call_function"]
        if switch_between:  # relu would move past the region's switches: it stays, as DDP cut it
            assert kept == {} and order.index(n["call"]) < order.index(n["enter"])
        else:  # relu moves after sin, into its reader's piece
            assert kept == moved and order.index(n["mid"]) < order.index(n["call"]) < order.index(n["a"])


def test_an_output_only_returned_is_not_recomputed(monkeypatch):
    # recompute is for outputs the graph reads on (the projections after a norm or a gated MLP):
    # a site whose output only leaves the graph is not tagged, and its forward kernel runs once per
    # forward + backward; read by a matmul, it is tagged and runs again in the backward
    from kernelgraft.kernels.rows import launch
    from kernelgraft.rewriter.replace import RECOMPUTE_META

    calls, fused = [], []
    forward, with_out = launch.forward_group, launch.backward_with_out
    monkeypatch.setattr(launch, "forward_group", lambda *a, **k: (calls.append(1), forward(*a, **k))[1])
    monkeypatch.setattr(
        launch, "backward_with_out", lambda *a, **k: (fused.append(1), with_out(*a, **k))[1]
    )

    def norm(x, w):
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    tagged = []  # per capture: the sites tagged, as the graph reaches inductor
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    p = torch.randn(32, 8, requires_grad=True)
    read_on = lambda x, w: norm(x, w) @ p  # noqa: E731
    # (fn, recompute option, sites tagged, forward kernel runs, backward runs that make the output):
    # by default the backward kernel makes the recomputed output (rewriter/recompute.py); "separate"
    # runs the forward kernel again
    for fn, mode, want_tags, want_calls, want_fused in (
        (norm, True, 0, 1, 0),
        (read_on, True, 1, 1, 1),
        (read_on, "separate", 1, 2, 0),
    ):
        torch._dynamo.reset()
        grafter = kernelgraft.Grafter("inductor", options=kernelgraft.Options(recompute=mode))
        lower = grafter._lower

        def spy(gm, example_inputs, lower=lower):
            tagged.append(sum(1 for n in gm.graph.nodes if n.meta.get(RECOMPUTE_META)))
            return lower(gm, example_inputs)

        grafter._lower = spy
        f = torch.compile(fn, backend=grafter, dynamic=False)
        y = f(x, w)
        calls.clear()
        fused.clear()
        y = f(x, w)
        torch.autograd.grad(y.sum(), (x, w))
        assert grafter.report.counts() == {"rms_norm": 1}
        assert tagged[-1] == want_tags and len(calls) == want_calls, (mode, tagged, calls)
        assert len(fused) == want_fused, (mode, fused)
        want = torch.autograd.grad(fn(x, w).sum(), (x, w))  # the numbers: the spelling's own
        got = torch.autograd.grad(f(x, w).sum(), (x, w))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


RECOMPUTED = [sp for sp in kernelgraft.patterns.REGISTRY.spellings() if sp.recompute]


@pytest.mark.parametrize("sp", RECOMPUTED, ids=lambda sp: sp.qualname)
@pytest.mark.parametrize("rounding", ["autograd", "fused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_kernel_makes_the_recomputed_output_bitwise(sp, rounding, dtype):
    # the `_bwdo` entry (rewriter/recompute.py puts it in the backward graph): the gradients of the
    # backward kernel and the output of the forward kernel, from one pass that reads no statistics.
    # 8 x 96: the gated MLP's rows are re-cut (768 elements = 3 rows of 256), the norms' are not
    from kernelgraft.kernels import op_for

    op = op_for(sp, rounding, recompute=True)
    args = sp.example_args(8, 96, dtype, seed=3)
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    y, stats = op.fwd(*args)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(y.dtype)
    needs = [True] * len(sp.tensor_names)
    want = op.bwd(g, *args, stats, needs)
    got = op.bwd_out(g, *args, needs)
    assert len(got) == len(want) + 1
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[-1].dtype == y.dtype and torch.equal(got[-1], y)
    # a gradient not asked for is not made, and the output still is
    part = op.bwd_out(g, *args, [False] + needs[1:])
    assert part[0].numel() == 0 and torch.equal(part[-1], y)


def test_every_recomputed_site_is_made_by_its_backward_kernel(monkeypatch):
    # tiny Llama, 2 layers, inductor: per layer 2 norms and a gated MLP, each a (forward again,
    # backward) pair in the backward graph, become one `_bwdo` call. The final norm stays as it
    # is: its output is the LM head's input, whose backward makes that norm's incoming gradient (a
    # cycle). The numbers: the accuracy rule, as everywhere
    from kernelgraft.rewriter import recompute

    stock = tiny_model("llama", layers=2)
    counts = []
    fuse = recompute.fuse_recomputed_outputs

    def spy(graph):
        n = fuse(graph)
        # a recomputed site's calls by kind: forward ("...__rc_abi<N>"), "_bwd", "_bwdo"
        kinds = [re.search(r"__rc_abi\d+(\w*)\.", str(x.target)) for x in graph.nodes]
        kinds = [k.group(1) or "fwd" for k in kinds if k]
        counts.append((n, {k: kinds.count(k) for k in kinds}))
        return n

    monkeypatch.setattr(recompute, "fuse_recomputed_outputs", spy)
    torch._dynamo.reset()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="inductor", capture="whole")  # its graphs read per layer
    b = batch(B=2, S=16)
    # compiled here, not loaded from inductor's caches (a cache hit runs no pass)
    with compiled_anew():
        bad = [str(v) for v in compare_models(mine, stock, b, compiled=False) if not v.ok]
    assert not bad, bad
    L = stock.config.num_hidden_layers
    assert counts[0] == (0, {"fwd": 3 * L + 1}), counts  # the forward graph: its sites, untouched
    assert counts[1] == (3 * L, {"fwd": 1, "_bwd": 1, "_bwdo": 3 * L}), counts


def _site_graph(reader):
    """x, w -> (forward again) y, stats -> reader(y) -> backward(dy, x, w, stats): the pair the pass
    fuses, with one reader of y before the backward call; `reader` (graph, y, dy) -> the node."""
    import operator

    import torch.fx as fx

    from kernelgraft.kernels import op_for

    op = op_for(kernelgraft.patterns.REGISTRY.get("rms_norm", "llama"), "fused", recompute=True)
    g = fx.Graph()
    x, w, dy, buf = (g.placeholder(n) for n in ("x", "w", "dy", "buf"))
    f = g.call_function(op.fwd, (x, w, 1e-6))
    y = g.call_function(operator.getitem, (f, 0))
    st = g.call_function(operator.getitem, (f, 1))
    r, dy = reader(g, y, dy, buf)
    b = g.call_function(op.bwd, (dy, x, w, 1e-6, st, [True, True]))
    dx = g.call_function(operator.getitem, (b, 0))
    dw = g.call_function(operator.getitem, (b, 1))
    g.output((dx, dw, r))
    return op, g


def _run(g, inputs):
    import torch.fx as fx

    return fx.GraphModule(torch.nn.Module(), g)(*[t.clone() for t in inputs])


@pytest.mark.parametrize(
    "case, fused",
    [
        # y read by a pure op before the backward call: fused, the reader moved after it
        ("pure", 1),
        # the backward's incoming gradient made from y: moving the reader would make a cycle
        ("feeds the gradient", 0),
        # a reader that writes into a buffer: never moved (it could pass a read of that buffer)
        ("mutates", 0),
    ],
)
def test_the_pass_fuses_a_site_only_where_it_keeps_the_graph(case, fused):
    from kernelgraft.rewriter.recompute import fuse_recomputed_outputs

    aten = torch.ops.aten

    def reader(g, y, dy, buf):
        if case == "pure":
            return g.call_function(aten.mul.Tensor, (y, 2.0)), dy
        if case == "feeds the gradient":
            r = g.call_function(aten.mul.Tensor, (y, 2.0))
            return r, g.call_function(aten.add.Tensor, (dy, r))
        return g.call_function(aten.add_.Tensor, (buf, y)), dy

    op, g = _site_graph(reader)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(6, 64, generator=gen), torch.randn(64, generator=gen)]
    inputs += [torch.randn(6, 64, generator=gen), torch.zeros(6, 64)]
    before = _run(g, inputs)
    assert fuse_recomputed_outputs(g) == fused
    g.lint()
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert (op.bwd_out in targets) == bool(fused) and (op.fwd in targets) != bool(fused)
    if fused:  # the reader now follows the call that makes y
        order = list(g.nodes)
        mul = next(n for n in order if n.target is aten.mul.Tensor)
        assert order.index(mul) > next(i for i, n in enumerate(order) if n.target is op.bwd_out)
    after = _run(g, inputs)
    for a, b in zip(after, before):
        assert torch.equal(a, b)  # on the CPU the fused pass is bitwise the pair it replaces


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
def test_the_residual_streams_adds_joined_to_the_norms_give_the_same_bits(monkeypatch):
    """Under inductor a layer's norms make the residual stream's sums as they load their rows
    (residual.add_into_norms) and add their input gradients to the stream's as they store them
    (residual.accumulate_into_gradients): 2 of each per layer in a tiny Llama. A step with the
    passes and one without, in bf16: the same loss and the same bits in every gradient but the
    embedding's. The first layer's input norm's sum feeds the embedding's backward, into which
    inductor fuses the add without rounding it to bf16; the pass rounds it, as eager does. That
    gradient is judged by the rule (beside float64 truth and eager), as every other."""
    from kernelgraft.rewriter import residual

    stock = tiny_model("llama", torch.bfloat16, layers=2)
    b = batch(B=2, S=16)
    real = {name: getattr(residual, name) for name in ("add_into_norms", "accumulate_into_gradients")}
    counts, got = {name: [] for name in real}, {}

    def counted(name):
        return lambda g: counts[name].append(real[name](g)) or counts[name][-1]

    for on in (True, False):
        for name in real:
            monkeypatch.setattr(residual, name, counted(name) if on else (lambda g: 0))
        torch._dynamo.reset()
        mine = kernelgraft.optimize(copy.deepcopy(stock), backend="inductor")
        with compiled_anew():
            loss = mine(**b).loss
            loss.backward()
        got[on] = (loss.detach(), {n: p.grad.clone() for n, p in mine.named_parameters()})
    L = stock.config.num_hidden_layers
    # the forward graph, then the backward: the adds before every norm but the first layer's input norm
    assert counts == {"add_into_norms": [2 * L, 0], "accumulate_into_gradients": [0, 2 * L]}, counts
    assert torch.equal(got[True][0], got[False][0])
    differ = [n for n in got[True][1] if not torch.equal(got[True][1][n], got[False][1][n])]
    assert set(differ) <= {"model.embed_tokens.weight"}, differ
    for name in real:
        monkeypatch.setattr(residual, name, real[name])
    torch._dynamo.reset()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="inductor")
    with compiled_anew():
        verdicts = compare_models(mine, stock, [b, batch(seed=2, B=2, S=16)], compiled=False)
    # the one quantity the pass changes (the loss and the rest are its bits without it, above)
    (embedding,) = [v for v in verdicts if "embed_tokens" in str(v)]
    assert embedding.ok, str(embedding)


@pytest.mark.parametrize("recompute, want", [(False, {"add_into_norms": [4, 0], "accumulate_into_gradients": [0, 0]}), ("separate", {})])
def test_the_forwards_residual_adds_join_the_norms_whether_or_not_outputs_are_recomputed(recompute, want, monkeypatch):
    """recompute=False: the forward's adds still join the norms' kernels (the backward's have no
    recomputing op to join); recompute="separate": every kernel op stays apart, no pass runs."""
    from kernelgraft.rewriter import residual

    stock = tiny_model("llama", torch.bfloat16, layers=2)
    counts = {}
    for name in ("add_into_norms", "accumulate_into_gradients"):
        real = getattr(residual, name)
        monkeypatch.setattr(
            residual, name, lambda g, real=real, name=name: counts.setdefault(name, []).append(real(g)) or counts[name][-1]
        )
    torch._dynamo.reset()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="inductor", recompute=recompute, capture="whole")  # counts per layer
    b = batch(B=2, S=16)
    with compiled_anew():
        bad = [str(v) for v in compare_models(mine, stock, b, compiled=False) if not v.ok]
    assert not bad, bad
    assert counts == want, counts
