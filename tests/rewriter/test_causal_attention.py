"""Attention masks proven causal on the captured graph run as `is_causal=True`
(kernelgraft/rewriter/attention.py); every other mask is kept, with the reason reported, and the
numbers are the stock module's either way (the accuracy rule against float64)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny import batch, compare_models, tiny_model

import kernelgraft
from kernelgraft.gradcheck import judge
from kernelgraft.rewriter.attention import causal_verdict


class Attn(torch.nn.Module):
    """One attention call; the mask spelled in one of several ways."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, pad=None):
        lq, lk = q.shape[-2], k.shape[-2]
        i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        j = torch.arange(lk, device=q.device)[None, :]
        if self.kind == "bool":
            m = j <= i
        elif self.kind == "float":  # HF's older additive spelling: finfo.min above the diagonal
            m = torch.zeros(lq, lk, dtype=q.dtype, device=q.device).masked_fill(
                j > i, torch.finfo(q.dtype).min
            )
        elif self.kind == "window":  # causal and a sliding window of 3: not the causal mask
            m = (j <= i) & (i - j < 3)
        elif self.kind == "upper":
            m = j >= i
        elif self.kind == "padded":  # reads an input: not a function of the shapes
            m = (j <= i)[None, None] & pad[:, None, None, :].bool()
        else:
            raise ValueError(self.kind)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


class MaskIn(torch.nn.Module):
    """The mask comes in (as it does to a DDP piece or an FSDP2 layer graph), sliced as HF's
    attention slices it."""

    def forward(self, q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, :, :, : k.shape[-2]])


def masks(L=9, B=2):
    tril = torch.ones(L, L, dtype=torch.bool).tril()
    causal = torch.zeros(B, 1, L, L).masked_fill(~tril, float("-inf"))
    padded = causal.clone()
    padded[1, :, :, 6:] = float("-inf")  # the second sequence's last 3 positions are padding
    padded[1, :, 6:, :] = 0.0  # (their own rows attend everywhere: no row is fully masked)
    return causal, padded


def qkv(B=2, H=2, L=9, Lk=None, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, H, Lk or L, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, H, Lk or L, D, generator=g).to(dtype).requires_grad_()
    return q, k, v


def run(module, args):
    out = module(*args)
    grads = torch.autograd.grad(
        out, [a for a in args if a is not None and a.requires_grad], torch.ones_like(out)
    )
    return [out, *grads]


def assert_as_stock(stock, mine, args):
    """Output and every input gradient of `mine` by the rule, against float64 and the stock module."""
    wide = [a.detach().double().requires_grad_(a.requires_grad) if a is not None else None for a in args]
    truth = run(stock, wide)
    eager = run(stock, args)
    got = run(mine, args)
    bad = [str(v) for v in map(judge, ["out", "q", "k", "v"], truth, got, eager) if not v.ok]
    assert not bad, bad


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_causal_mask_built_from_the_shapes_becomes_is_causal(kind):
    stock = Attn(kind)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    args = qkv()
    assert_as_stock(stock, mine, args)
    rep = mine.kernelgraft_report
    assert rep.counts() == {"sdpa": 1} and not rep.masks_kept, str(rep)


@pytest.mark.parametrize(
    "kind,why",
    [("window", "not the lower triangle"), ("upper", "not the lower triangle")],
)
def test_other_masks_are_kept_with_the_reason(kind, why):
    stock = Attn(kind)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    args = qkv()
    assert_as_stock(stock, mine, args)
    rep = mine.kernelgraft_report
    assert "sdpa" not in rep.counts()
    assert [r.pattern for r in rep.masks_kept] == ["sdpa"] and why in rep.masks_kept[0].reason, str(rep)
    assert "attention masks kept as written (1):" in str(rep) and not rep.fallbacks


def test_a_padded_mask_built_from_an_input_runs_as_written():
    # reads the `pad` input: checked at run time; with padding it is not causal, the call runs as written
    stock = Attn("padded")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    pad = torch.ones(2, 9)
    pad[1, 6:] = 0
    assert_as_stock(stock, mine, (*qkv(), pad))
    rep = mine.kernelgraft_report
    assert [c.runs for c in rep.mask_checks] == [[0, 1]], str(rep)
    assert "causal in 0 of 1 checks" in str(rep)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_mask_read_from_the_inputs_is_checked_at_run_time(backend, monkeypatch):
    import kernelgraft.rewriter.attention as attention

    evaluated = []
    real = attention.is_causal_mask
    monkeypatch.setattr(attention, "is_causal_mask", lambda m, *a: evaluated.append(1) or real(m, *a))
    stock = MaskIn()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend=backend)
    causal, padded = masks()
    args = qkv()
    assert_as_stock(stock, mine, (*args, causal))
    rep = mine.kernelgraft_report
    assert [(s.pattern, s.spelling) for s in rep.sites] == [("sdpa", "causal_mask_checked")], str(rep)
    (check,) = rep.mask_checks
    assert check.runs == [1, 0] and len(evaluated) == 1
    # the same tensor, unchanged: the verdict is kept (one check per forward, whatever the graphs)
    mine(*args, causal)
    assert check.runs == [2, 0] and len(evaluated) == 1
    # padding: not causal, the graph with its mask as written runs (compiled now)
    assert_as_stock(stock, mine, (*args, padded))
    assert check.runs == [2, 1] and len(evaluated) == 2
    # the causal tensor written in place (its version changes): checked again, found padded, exact
    causal.copy_(padded)
    assert_as_stock(stock, mine, (*args, causal))
    assert check.runs == [2, 2] and len(evaluated) == 3


def test_a_trace_on_fake_tensors_checks_nothing():
    # DDP's graph splitter (torch 2.11) runs every compiled piece on fake tensors to propagate shapes:
    # the check has no values to read there (reading them fails with _local_scalar_dense)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kernelgraft.rewriter.attention import MaskCheck
    from kernelgraft.rewriter.backend import MaskChecked

    g = torch.fx.Graph()
    g.output(g.placeholder("m"))
    calls = []
    check = MaskCheck((0,), torch.fx.GraphModule(torch.nn.Module(), g), 9, 9)
    wrapped = MaskChecked([check], lambda *a: calls.append("causal") or a[0], lambda args: None)
    causal, _ = masks()
    with FakeTensorMode() as mode:
        out = wrapped(mode.from_tensor(causal))
    assert calls == ["causal"] and check.runs == [0, 0] and tuple(out.shape) == tuple(causal.shape)
    wrapped(causal)  # a run: checked
    assert calls == ["causal", "causal"] and check.runs == [1, 0]


class GQA(torch.nn.Module):
    """Grouped-query attention as Hugging Face spells it with a mask: keys and values repeated to
    the query's heads (repeat_kv), then SDPA; the mask causal (bool) or a sliding window."""

    def __init__(self, kind="bool"):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v):
        def repeat_kv(x, n):
            b, h, s, d = x.shape
            return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)

        n = q.shape[1] // k.shape[1]
        L = q.shape[-2]
        i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
        m = (j <= i) if self.kind == "bool" else (j <= i) & (i - j < 3)
        return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=m)


def test_grouped_keys_and_values_are_read_unrepeated_once_the_mask_is_gone():
    stock = GQA()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 9, 8, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, 9, 8, generator=g).requires_grad_() for _ in range(2))
    assert_as_stock(stock, mine, (q, k, v))
    rep = mine.kernelgraft_report
    assert rep.counts() == {"sdpa": 1, "gqa": 1}, str(rep)
    (gqa,) = [s for s in rep.sites if s.pattern == "gqa"]
    assert gqa.scalars == {"n_rep": 4} and gqa.shapes["key"] == (2, 2, 9, 8)
    # a mask that stays (a sliding window): the repeated keys stay too (SDPA's own choice with a mask)
    kept = kernelgraft.optimize(GQA("window"), backend="eager")
    assert_as_stock(GQA("window"), kept, (q, k, v))
    assert kept.kernelgraft_report.counts() == {}, str(kept.kernelgraft_report)


def test_query_and_key_of_different_lengths_keep_their_mask():
    # SDPA's is_causal aligns the triangle to the top left; a mask aligned to the bottom right differs
    stock = Attn("bool")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    args = qkv(L=5, Lk=9)
    assert_as_stock(stock, mine, args)
    assert mine.kernelgraft_report.masks_kept[0].reason.startswith("query length 5 != key length 9")


def test_symbolic_sizes_keep_the_mask():
    # after a second length dynamo captures with symbolic sizes: one evaluation would prove nothing
    stock = Attn("bool")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    for L in (9, 13, 21):
        assert_as_stock(stock, mine, qkv(L=L, seed=L))
    rep = mine.kernelgraft_report
    assert any("symbolic" in r.reason for r in rep.masks_kept), str(rep)


def test_hugging_face_mask_built_under_compile_becomes_is_causal(monkeypatch):
    # transformers 5.17 never skips the causal mask while dynamo traces; 5.24 does. Make the
    # installed one build it, as 5.17 does: the model's SDPA calls then carry HF's real mask graph
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    bad = [str(v) for v in compare_models(mine, stock, batch(), compiled=False) if not v.ok]
    assert not bad, bad
    assert mine.kernelgraft_report.counts()["sdpa"] == stock.config.num_hidden_layers
    off = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", causal_attention=False)
    off(**batch()).loss.backward()
    assert "sdpa" not in off.kernelgraft_report.counts()


def test_verdict_on_masks_directly():
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    assert causal_verdict(tril[None, None].expand(2, 1, 4, 4), 4, 4) is None
    add = torch.zeros(4, 4).masked_fill(~tril, float("-inf"))
    assert causal_verdict(add, 4, 4) is None
    assert causal_verdict(torch.zeros(4, 4).masked_fill(~tril, -1e4), 4, 4) is not None  # not -inf enough
    assert causal_verdict(tril.float(), 4, 4) is not None  # a 0/1 float mask adds 1: not causal
    assert causal_verdict(tril, 4, 5) is not None


class KeysBuiltInPlace(torch.nn.Module):
    """DeepSeek's MLA builds its keys in place: an empty tensor, then its two parts copied into
    slices of it (`k[..., :d].copy_(k_nope)`: nothing reads the copies' results)."""

    def forward(self, q, k, v):
        L = q.shape[-2]
        keys = k.new_empty(*k.shape[:-1], 2 * k.shape[-1])
        keys[..., : k.shape[-1]].copy_(k)
        keys[..., k.shape[-1] :].copy_(k * 0.5)
        m = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(torch.cat((q, q), -1), keys, v, attn_mask=m)


def test_the_writes_into_keys_built_in_place_survive_the_rewrite():
    args = qkv()
    stock = KeysBuiltInPlace()
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    assert_as_stock(stock, mine, args)
    assert mine.kernelgraft_report.counts() == {"sdpa": 1}
