"""A label outside the vocabulary through the fused LM head + cross-entropy: an error that names the
label and the vocabulary, as F.cross_entropy raises, with both backends and through the op itself;
the ignore index stays ignored, and a valid batch's loss is what it was without the check. On a GPU
the check is a device-side assert over one reduction of the labels, with no host sync: its traced
form is checked here on the meta device, and tests/gpu/test_gpu.py runs it on CUDA."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import kernelgraft
from kernelgraft.gradcheck import judge
from kernelgraft.kernels import op_for
from kernelgraft.kernels.lm_head import kernel as lm_kernel
from kernelgraft.kernels.lm_head.transform import transform_graph
from kernelgraft.patterns import REGISTRY

V = 128
BAD = [128, -5, 1000]


class Loop(torch.nn.Module):
    """A hand-written model and loss over a vocabulary of V."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, 16)
        self.head = torch.nn.Linear(16, V, bias=False)

    def forward(self, ids, targets):
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 9), generator=g)
    return ids, torch.randint(0, V, (2, 9), generator=g)


@pytest.fixture(scope="module")
def stock():
    torch.manual_seed(0)
    return Loop()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_label_outside_the_vocabulary_raises_as_stock_does(stock, backend):
    model = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    ids, targets = _batch()
    model(ids, targets).backward()  # captured and served
    assert model.kernelgraft_report.counts() == {"lm_head_ce": 1}
    for bad in BAD:
        t = targets.clone()
        t[1, 3] = bad
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
            stock(ids, t)  # what stock PyTorch does
        with pytest.raises(
            IndexError, match=rf"Target {bad} is out of bounds.* vocabulary of {V} \(0 to {V - 1}\)"
        ):
            model(ids, t)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_the_ignore_index_stays_ignored_and_a_valid_batch_is_unchanged(stock, backend):
    model = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    for ignored in (False, True):
        ids, targets = _batch(1)
        if ignored:
            targets[0, ::2] = -100
        truth_model = copy.deepcopy(stock).double()
        got, eager, truth = (
            (m(ids, targets), torch.autograd.grad(m(ids, targets), m.head.weight)[0])
            for m in (model, stock, truth_model)
        )
        assert model.kernelgraft_report.counts() == {"lm_head_ce": 1}
        for what, t, k, e in zip(("loss", "grad weight"), truth, got, eager):
            v = judge(what, t, k, e)
            assert v.ok, str(v)


@pytest.mark.parametrize("name", ["hf_mean", "hf_sum_n", "softcap_mean"])
def test_the_op_raises_and_a_valid_batch_gives_the_loss_it_gave_unchecked(name):
    sp = REGISTRY.get("lm_head_ce", name)
    g = torch.Generator().manual_seed(0)
    values = {
        "h": torch.randn(12, 16, generator=g).requires_grad_(),
        "weight": (torch.randn(V, 16, generator=g) / 4).requires_grad_(),
        "target": torch.randint(0, V, (12,), generator=g),
        "ignore_index": -100,
        "n": torch.tensor(9.0),
        "cap": 3.0,
    }
    values["target"][::5] = -100
    args = [values[a] for a in sp.arg_names]
    loss = op_for(sp)(*args)
    scalars = [float(values[s]) for s in transform_graph(sp)[1]]
    n = values["n"] if "n" in sp.arg_names else None
    unchecked = lm_kernel.forward(
        sp, values["h"], values["weight"], values["target"], n, scalars, -100, False, False, 0, "auto", "autograd",
        check=False,
    )[0]  # fmt: skip
    assert torch.equal(loss.detach(), unchecked), (loss, unchecked)
    for bad in BAD:
        t = values["target"].clone()
        t[4] = bad
        with pytest.raises(IndexError, match=rf"Target {bad} is out of bounds.* vocabulary of {V}"):
            op_for(sp)(*[t if a == "target" else values[a] for a in sp.arg_names])


def test_on_a_gpu_the_check_is_one_reduction_and_a_device_assert_without_a_host_read():
    """The check as a GPU runs it (any device but the CPU: here the meta device), traced: the
    labels' validity reduced once (all) into an asynchronous assert naming the vocabulary, and no
    value read on the host (_local_scalar_dense is what .item() and `if tensor:` record)."""
    t = torch.empty(37, dtype=torch.int64, device="meta")
    gm = make_fx(lambda t: lm_kernel.check_labels(t, V, -100))(t)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    asserts = [n for n in gm.graph.nodes if n.target == torch.ops.aten._assert_async.msg]
    assert len(asserts) == 1 and f"vocabulary of {V} (0 to {V - 1})" in asserts[0].args[1]
    reductions = [o for o in ops if o in (torch.ops.aten.all.default, torch.ops.aten.any.default)]
    assert len(reductions) == 1, ops
    assert torch.ops.aten._local_scalar_dense.default not in ops and torch.ops.aten.nonzero.default not in ops
