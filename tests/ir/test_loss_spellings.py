"""The LM head + loss is found however a training loop writes it (the view algebra of ir/canonicalize.py:
identity views dropped, view/reshape/flatten to rows one form, the shift of the logits moved onto h),
and the served model's loss and gradients pass the accuracy rule against float64 truth beside eager."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from tiny import batch, compare_models, tiny_model
from transformers.modeling_outputs import CausalLMOutput

import kernelgraft
from kernelgraft.gradcheck import Float64Everywhere, judge

V, H = 96, 32
_log = logging.getLogger(__name__)


class Loop(torch.nn.Module):
    """A hand-written model and loss, its loss spelled as `how` says."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = torch.nn.Embedding(V, H)
        self.head = torch.nn.Linear(H, V, bias="bias" in how)
        self.ce = torch.nn.CrossEntropyLoss()

    def forward(self, ids, y):
        h, how = self.emb(ids), self.how
        if how == "2-D logits, no view":
            return F.cross_entropy(self.head(h.view(-1, H)), y.view(-1))
        z = self.head(h)
        if how == "view(-1, V)":
            return F.cross_entropy(z.view(-1, z.size(-1)), y.view(-1))
        if how == "reshape(-1, V)":
            return F.cross_entropy(z.reshape(-1, V), y.reshape(-1))
        if how == "flatten(0, 1)":
            return F.cross_entropy(z.flatten(0, 1), y.flatten())
        if how == "view(B * S, V)":
            return F.cross_entropy(z.view(z.shape[0] * z.shape[1], V), y.view(-1))
        if how == "nn.CrossEntropyLoss":
            return self.ce(z.view(-1, V), y.view(-1))
        if how == "upcast, contiguous":
            return F.cross_entropy(z.float().contiguous().view(-1, V), y.view(-1))
        if how == "shift in the loop":
            return F.cross_entropy(z[:, :-1].contiguous().view(-1, V), y[:, 1:].contiguous().view(-1))
        if how == "shift, upcast":
            return F.cross_entropy(z[..., :-1, :].float().reshape(-1, V), y[..., 1:].reshape(-1))
        if how == "upcast, then shift":
            return F.cross_entropy(z.float()[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))
        if how == "upcast twice":  # a model's logits.float(), and the loss function's own
            return F.cross_entropy(z.float().float().view(-1, V), y.view(-1))
        if how == "logging in between":  # dynamo breaks the graph at a logging statement, unless told not to
            _log.debug("the loss of %s", how)
            return F.cross_entropy(z.float().view(-1, V), y.view(-1))
        if how == "a bias, upcast":
            return F.cross_entropy(z.float().view(-1, V), y.view(-1))
        if how == "a bias, shift in the loop":
            return F.cross_entropy(z[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))
        raise ValueError(how)


SPELLINGS = [
    "2-D logits, no view",
    "view(-1, V)",
    "reshape(-1, V)",
    "flatten(0, 1)",
    "view(B * S, V)",
    "nn.CrossEntropyLoss",
    "upcast, contiguous",
    "shift in the loop",
    "shift, upcast",
    "upcast, then shift",
    "upcast twice",
    "logging in between",
    "a bias, upcast",
    "a bias, shift in the loop",
]


def _run(model, ids, y, truth=False):
    ctx = Float64Everywhere() if truth else torch.enable_grad()
    with ctx:
        loss = model(ids, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("how", SPELLINGS)
def test_every_loss_spelling_is_served_and_passes_the_rule(how, dtype):
    torch.manual_seed(0)
    stock = Loop(how).to(dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (4, 17), generator=g)
    y = torch.randint(0, V, (4, 17), generator=g)
    y[:, ::5] = -100
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    truth = _run(copy.deepcopy(stock).double(), ids, y, truth=True)
    eager = _run(stock, ids, y)
    got = _run(mine, ids, y)
    assert mine.kernelgraft_report.counts() == {"lm_head_ce": 1}, str(mine.kernelgraft_report)
    verdicts = [judge("loss", truth[0], got[0], eager[0])]
    verdicts += [judge(f"grad {n}", truth[1][n], got[1][n], eager[1][n]) for n in truth[1]]
    assert all(v.ok for v in verdicts), [str(v) for v in verdicts if not v.ok]


def test_a_loss_over_the_class_dim_of_3d_logits_is_not_taken_for_rows():
    # cross_entropy of (B, V, S) logits reads classes along dim 1: not the LM head's rows
    class ClassDim(Loop):
        def forward(self, ids, y):
            return F.cross_entropy(self.head(self.emb(ids)).transpose(1, 2), y)

    ids = torch.randint(0, V, (2, 5))
    stock = ClassDim("-")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    assert "lm_head_ce" not in kernelgraft.explain(ClassDim("-"), ids, ids).counts()
    torch.testing.assert_close(mine(ids, ids), stock(ids, ids), rtol=0, atol=0)


def test_the_shift_is_moved_onto_h_and_audited_there():
    # the served site reads h[:, :-1] (a node the rewrite adds), not the full logits; the audit's
    # probe records the site's arguments through the same node
    ids = torch.randint(0, V, (2, 7))
    mine = kernelgraft.optimize(Loop("shift in the loop"), backend="eager")
    mine(ids, ids)
    assert [s.shapes["h"] for s in mine.kernelgraft_report.sites] == [(2, 6, H)]
    rep = kernelgraft.audit(Loop("shift in the loop"), ids, ids, compile_reference=False, lints=False)
    assert [r.shapes for r in rep.sites if r.what == "out"] == ["h[2, 6, 32], weight[96, 32], target[12]"]
    assert rep.ok, rep.to_markdown()


class WithLoss(torch.nn.Module):
    """A tiny Hugging Face Llama whose loss the training loop spells: the model returns logits."""

    def __init__(self, how: str):
        super().__init__()
        self.lm, self.how = tiny_model("llama"), how
        self.config = self.lm.config

    def forward(self, input_ids, labels):
        z, y = self.lm(input_ids=input_ids).logits, labels
        V_ = z.shape[-1]
        if self.how == "shift in the loop":
            loss = F.cross_entropy(z[:, :-1].contiguous().view(-1, V_), y[:, 1:].contiguous().view(-1))
        elif self.how == "flatten(0, 1)":
            loss = F.cross_entropy(z.float().flatten(0, 1), y.flatten())
        elif self.how == "nn.CrossEntropyLoss":
            loss = torch.nn.CrossEntropyLoss()(z.reshape(-1, V_), y.reshape(-1))
        else:
            raise ValueError(self.how)
        return CausalLMOutput(loss=loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("how", ["shift in the loop", "flatten(0, 1)", "nn.CrossEntropyLoss"])
@pytest.mark.parametrize("capture", ["whole", "layers"])
def test_a_tiny_llama_with_the_loss_in_the_loop(capture, how, dtype):
    # the loss and every parameter gradient by the rule, judged over eight batches at once: with bf16
    # logits into the loss (no upcast), one tiny batch makes a layer's weight gradient a draw of the
    # rounding (1.2x eager's error in some seeds, 0.98x in others); four were still a draw on one
    # machine's CPU (a norm weight's gradient at 1.10x), eight a statistic (at most 1.01x there).
    # Captured per layer class, the head (the inner model's) and the loss (the wrapper's) follow
    # the layers' calls in two frames, resumed as one graph
    torch.manual_seed(0)
    stock = WithLoss(how).to(dtype)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", capture=capture)
    verdicts = compare_models(mine, stock, [batch(seed=1 + i) for i in range(8)], compiled=False)
    assert mine.kernelgraft_report.counts()["lm_head_ce"] == 1, str(mine.kernelgraft_report)
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)
