"""What an offloaded layer's recompute in the backward must share with its forward (Options.offload):
the random numbers its dropout drew, the autocast it ran under; and the host buffers a forward keeps,
given back with the autograd graph that holds them, whether or not a backward runs."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from tiny import batch, tiny_config, tiny_model

import kernelgraft


def layers_of(model):
    return model._compiled_call_impl.args[0].layers


def with_dropout(arch: str, **rates):
    """The tiny causal LM of `arch` with the given dropout rates (the tiny config zeroes them)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(arch)
    for name, rate in rates.items():
        setattr(cfg, name, rate)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).train()


def step(model, b, seed: int = 123):
    """The loss and every parameter's gradient of one training step drawn from torch.manual_seed(seed),
    and the next number the global generator gives after the backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**b).loss
    loss.backward()
    after = torch.rand(1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, after


def worst_relative(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and got
    return max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)


DROPOUT = {
    "gpt2": dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),  # GPT-2's defaults
    "llama": dict(attention_dropout=0.3),
}


@pytest.mark.parametrize("arch", sorted(DROPOUT))
def test_dropout_draws_the_same_masks_in_the_recompute(arch):
    stock = with_dropout(arch, **DROPOUT[arch])
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True)
    b = batch()
    loss, grads, after = step(mine, b)
    want_loss, want_grads, want_after = step(stock, b)
    torch.testing.assert_close(loss, want_loss)
    # the gradients are those of the loss computed: the recompute drew the forward's masks (a new
    # draw is 80 % off)
    assert worst_relative(grads, want_grads) < 1e-5
    # and the global stream goes on as without the recompute
    assert torch.equal(after, want_after)
    # the masks are drawn anew at each step: another seed, another loss
    assert not torch.equal(step(mine, b, seed=7)[0], loss)


def directional_slope(model, b, direction: dict, eps: float, seed: int = 123) -> float:
    """(loss(p + eps d) - loss(p - eps d)) / (2 eps) of training forwards drawn from one seed."""
    params = dict(model.named_parameters())
    losses = []
    for sign in (1, -1):
        with torch.no_grad():
            for n, d in direction.items():
                params[n].add_(sign * eps * d)
        torch.manual_seed(seed)
        losses.append(model(**b).loss.double().item())
        with torch.no_grad():
            for n, d in direction.items():
                params[n].sub_(sign * eps * d)
    return (losses[0] - losses[1]) / (2 * eps)


@pytest.mark.slow
def test_dropout_under_inductor_gives_the_gradient_of_the_loss_computed():
    # inductor draws its own random numbers (not eager's): the gradient is checked against the loss
    # it computed, by a central difference along the gradient itself
    stock = with_dropout("llama", attention_dropout=0.3)
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="inductor", offload=True)
    b = batch()
    _, grads, _ = step(mine, b)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    direction = {n: g / norm for n, g in grads.items()}
    slope = directional_slope(mine, b, direction, eps=3e-3)
    assert slope == pytest.approx(norm, rel=2e-3)  # the stock model's slope is 2e-4 off its gradient


def test_autocast_is_restored_in_a_recompute_run_outside_it():
    stock = tiny_model("llama")
    plain = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True)
    b = batch()

    def grads(model):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**b).loss
        loss.backward()  # outside the autocast block, as torch's AMP recipe runs it
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, got = grads(mine)
    want_loss, want = grads(plain)
    torch.testing.assert_close(loss, want_loss)
    # the layers ran again in bfloat16, as in the forward: a float32 recompute is 1e-2 off
    assert worst_relative(got, want) < 1e-6
    assert all(p.grad.dtype == torch.float32 for p in mine.parameters())


def test_forwards_without_a_backward_give_their_host_buffers_back():
    stock = tiny_model("llama")
    mine = kernelgraft.optimize(copy.deepcopy(stock), backend="eager", offload=True)
    off = layers_of(mine).offloader
    b = batch()
    kept = [mine(**b).loss for _ in range(3)]  # logged losses: their graphs, and buffers, live
    assert len(off.calls) == 6 and off.bytes == 6 * 2 * 12 * 64 * 4
    del kept
    mine(**b).loss.item()  # a loss read and dropped at once
    gc.collect()
    assert off.calls == [] and off.bytes == 0
    # the pool's buffers serve the next step, which trains as the stock model does
    loss, grads, _ = step(mine, b)
    want_loss, want, _ = step(stock, b)
    torch.testing.assert_close(loss, want_loss)
    assert worst_relative(grads, want) < 1e-5
    assert off.calls == [] and off.bytes == 0


def test_a_forward_that_raises_midway_leaves_nothing_held():
    mine = kernelgraft.optimize(tiny_model("llama"), backend="eager", offload=True)
    off = layers_of(mine).offloader
    held = []

    def fail(module, args):
        held.append((len(off.calls), off.bytes))  # the first layer's input is on the host by now
        raise RuntimeError("stop here")

    handle = mine.model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="stop here"):
        mine(**batch()).loss.backward()
    gc.collect()
    assert held == [(1, 2 * 12 * 64 * 4)] and off.calls == [] and off.bytes == 0
    handle.remove()
    mine(**batch()).loss.backward()
    assert off.calls == [] and off.bytes == 0 and off.peak_bytes > 0


def test_a_backward_fetches_the_layer_before_while_a_layer_runs_again():
    mine = kernelgraft.optimize(tiny_model("llama", layers=3), backend="eager", offload=True)
    off = layers_of(mine).offloader
    b = batch()
    unused = mine(**b).loss  # a graph that never runs backward: its calls are no layer's predecessor
    fetched, prefetched = [], []
    fetch, prefetch = off.fetch, off.prefetch

    def noted(s):
        if s.host is not None:  # an offloaded input: was its copy back started already?
            fetched.append(s.fetched is not None)
        return fetch(s)

    off.fetch = noted
    off.prefetch = lambda s: s.host is not None and prefetched.append(id(s)) or prefetch(s)
    mine(**b).loss.backward()
    # each layer's input (its hidden states) was on its way back before its backward ran, but the
    # last layer's; nothing of the graph without a backward was fetched
    assert fetched == [False, True, True] and len(set(prefetched)) == 3
    del unused
    gc.collect()
    assert off.calls == [] and off.bytes == 0
