"""Optimized models trained in several threads of one process on the CPU, where every kernel runs
in Triton's interpreter (which patches triton.language for the kernel it runs): the threads' kernels
take turns, none is recorded as failed, and the numbers are those of the same runs one after
another."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from tiny import batch, tiny_model

import kernelgraft
from kernelgraft.kernels import fallback

FULL = {"rms_norm": 5, "lm_head_ce": 1, "rope": 4, "gated_mlp": 2}  # a 2-layer tiny Llama
STEPS = 3


def _train(model, seed: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = model(**batch(seed=seed + step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _in_threads(models: dict) -> dict:
    """Each model trained in a thread of its own, started together; what each raised is re-raised."""
    out, errors = {}, {}
    start = threading.Barrier(len(models))

    def run(seed):
        try:
            start.wait()
            out[seed] = _train(models[seed], seed)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors[seed] = e

    threads = [threading.Thread(target=run, args=(seed,)) for seed in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not any(t.is_alive() for t in threads), "a training thread did not finish"
    for e in errors.values():
        raise e
    return out


@pytest.fixture
def no_failures_yet(monkeypatch):
    """This test's own record of failed kernels (whatever earlier tests in the process recorded)."""
    monkeypatch.setattr(fallback, "FAILED", {})
    monkeypatch.setattr(fallback, "_FAILED_SITES", {})


@pytest.mark.slow  # over 20 s on a 2-core CPU
def test_two_threads_train_two_optimized_models_as_one_thread_does(no_failures_yet):
    seeds = (1, 5)
    stock = tiny_model("llama")
    models = {s: kernelgraft.optimize(copy.deepcopy(stock), backend="eager") for s in seeds}
    with warnings.catch_warnings(record=True) as caught:  # records every thread's warnings
        warnings.simplefilter("always")
        together = _in_threads(models)  # first: the threads also build and define the kernels
    said = [str(w.message) for w in caught if "kernelgraft" in str(w.message)]
    failed = [s for s in said if "failed" in s]
    assert failed == [] and fallback.FAILED == {} and fallback._FAILED_SITES == {}
    alone = {s: _train(kernelgraft.optimize(copy.deepcopy(stock), backend="eager"), s) for s in seeds}
    assert together == alone  # the same losses, step by step, to the last bit
    for m in models.values():
        assert m.kernelgraft_report.counts() == FULL and not m.kernelgraft_report.fallbacks
    later = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
    later(**batch()).loss.backward()
    assert later.kernelgraft_report.counts() == FULL and not later.kernelgraft_report.fallbacks
    assert not any(s.failure() for s in later.kernelgraft_report.sites)


def test_two_threads_say_nothing_of_an_outer_torch_compile(no_failures_yet):
    """One thread compiling its model's graph is no outer torch.compile of the other thread's call."""
    stock = tiny_model("llama")
    models = {s: kernelgraft.optimize(copy.deepcopy(stock), backend="eager") for s in (1, 5)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _in_threads(models)
    said = [str(w.message) for w in caught if "kernelgraft" in str(w.message)]
    assert not [s for s in said if "torch.compile of a model that kernelgraft.optimize compiled" in s], said
