"""Tiny random Hugging Face decoders (kernelgraft.tiny's; nothing downloaded) and the model-level comparison."""

from __future__ import annotations

import contextlib
import copy

import torch

from kernelgraft._dynamo import room_for_recompiles
from kernelgraft.gradcheck import Float64Everywhere, judge

# the tiny configs and models live in the package: the command line builds the same ones
from kernelgraft.tiny import VOCAB, tiny_config, tiny_model  # noqa: F401


@contextlib.contextmanager
def compiled_anew():
    """Inductor compiles every graph inside, instead of loading it from its caches: a graph loaded
    from a cache runs no post-grad pass, and tests that count what a pass did need it run."""
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


def kept_in_float32(m):
    """m with the parameters and buffers its class keeps in float32 (`_keep_in_fp32_modules` and
    `_keep_in_fp32_modules_strict`, names searched in the parameter's name, as transformers'
    from_pretrained(dtype=...) matches them) made float32 again after a cast of the whole model:
    a model whose own code needs them there (a router that multiplies float32 activations)."""
    import re

    keep = [
        *(getattr(m, "_keep_in_fp32_modules", None) or []),
        *(getattr(m, "_keep_in_fp32_modules_strict", None) or []),
    ]
    if keep:
        found = re.compile("|".join(re.escape(k) for k in keep))
        with torch.no_grad():
            for name, t in [*m.named_parameters(), *m.named_buffers()]:
                if found.search(name) and t.is_floating_point():
                    t.data = t.data.float()
    return m


def batch(seed: int = 1, B: int = 2, S: int = 12, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g).to(device)
    return dict(input_ids=ids, labels=ids)


def whole(t: torch.Tensor) -> torch.Tensor:
    """t, or the whole tensor where FSDP2 left a DTensor shard."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def loss_and_grads(model, b, truth: bool = False, wrapped=None):
    """The loss of `wrapped` (default: `model` itself; or e.g. DDP(model)) on batch b and the
    gradients of `model`'s parameters, each whole (an FSDP2-sharded one gathered)."""
    model.zero_grad(set_to_none=True)
    run = wrapped if wrapped is not None else model
    if truth:
        with Float64Everywhere():
            loss = run(**b).loss
    else:
        loss = run(**b).loss
    loss.backward()
    return loss.detach(), {
        n: whole(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


def compare_models(optimized, stock, b, compiled=True, fell_back_ok=False):
    """Verdicts for the loss and every parameter gradient of `optimized` vs float64 truth, beside the
    stock model's eager and torch.compile (inductor) runs in the same dtype: the accuracy rule
    (kernelgraft.gradcheck.judge: an error at most 1.1x the larger reference's + 4 float32 eps).
    `b`: a batch, or a list of batches. Over several batches each quantity is judged on all of them
    at once (its values from every batch in one vector): the loss, one number per batch, and a
    small gradient are then statistics of the rounding, not one draw of it. A site whose kernel
    failed at run time runs the stock code, whose numbers pass: unless `fell_back_ok`, that fails
    the comparison (it would judge eager against itself)."""
    batches = b if isinstance(b, list) else [b]
    truth_model = copy.deepcopy(stock).to(torch.float64)
    if getattr(truth_model.config, "_experts_implementation", None) not in (None, "eager"):
        truth_model.config._experts_implementation = "eager"  # grouped_mm has no float64; same math
    comp = None
    if compiled:
        comp = copy.deepcopy(stock)
        comp.compile(backend="inductor")
    runs = {"truth": [], "eager": [], "compile": [], "kernelgraft": []}
    for x in batches:
        runs["truth"].append(loss_and_grads(truth_model, x, truth=True))
        runs["eager"].append(loss_and_grads(stock, x))
        if comp is not None:
            with room_for_recompiles():  # tests compile many models: keep each one compiled
                runs["compile"].append(loss_and_grads(comp, x))
        runs["kernelgraft"].append(loss_and_grads(optimized, x))

    def joined(name, key):  # one quantity over every batch (None: that reference did not run)
        if not runs[name]:
            return None
        parts = [loss if key is None else grads[key] for loss, grads in runs[name]]
        return parts[0] if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])

    report = getattr(optimized, "kernelgraft_report", None)
    lost = report.fell_back_at_run_time() if report is not None and not fell_back_ok else []
    assert not lost, "kernels fell back at run time, so the check would judge the stock code: " + "; ".join(
        f"{r.module}: {r.status()}" for r in lost[:3]
    )
    tg, eg, kg = runs["truth"][0][1], runs["eager"][0][1], runs["kernelgraft"][0][1]
    assert set(kg) == set(eg) == set(tg), "the optimized model must produce a gradient for every parameter"
    verdicts = [judge("loss", *(joined(r, None) for r in ("truth", "kernelgraft", "eager", "compile")))]
    verdicts += [
        judge(f"grad {n}", *(joined(r, n) for r in ("truth", "kernelgraft", "eager", "compile"))) for n in tg
    ]
    return verdicts


def with_backward(forward, backward):
    """forward (tanh, sigmoid: autograd differentiates them from their saved output y) with its
    backward replaced by backward(incoming gradient, y): a device's eager rounding reproduced on the
    CPU, where bf16/fp16 tensor ops round each step as c10's 2-byte arithmetic does on CUDA."""

    class Replaced(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = forward(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return backward(g, y)

    return Replaced.apply

