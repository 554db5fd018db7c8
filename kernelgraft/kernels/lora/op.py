"""The LoRA custom ops: forward (out, and u = x A^T for the backward) and backward, per spelling.

A kernel that fails to load, compile or launch is recorded once (a warning names the sites), and
the site runs its spelling's own code from then on: the same numbers as without kernelgraft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fallback import has_failed, record_failure, reference_gradients
from ..family import cached_op, define, op_name, save_inputs, saved_inputs, schema_args
from ..launching import tracing
from . import kernel

ABI = 1


@dataclass
class LoRAOp:
    spelling: object
    name: str
    fwd: object

    def __call__(self, *args):
        """The layer's output, from the spelling's own arguments (what gradcheck calls)."""
        return self.fwd(*args)[0]

    def bind(self, args: dict, metas: dict, options) -> tuple:
        sp = self.spelling
        return tuple(args[a] if a not in sp.scalar_names else float(args[a]) for a in sp.arg_names)


# spellings that add the update cast to the base output's dtype: `result + (update).to(result.dtype)`
ROUNDS_UPDATE_FIRST = frozenset({"peft_4bit", "peft_4bit_same_dtype", "peft_4bit_autocast"})


def op_for(spelling) -> LoRAOp:
    name = op_name(spelling, "", ABI)
    return cached_op(name, lambda: _define(spelling, name))


def _failed(x: torch.Tensor, A: torch.Tensor, od: torch.dtype, e: Exception, spelling) -> None:
    record_failure(
        kernel.kernel_name(x.dtype, A.dtype, od),
        x.device,
        e,
        "Its sites run the adapter path as PyTorch does.",
        spelling,
        x.dtype,
    )


def _define(sp, name: str) -> LoRAOp:
    names = list(sp.arg_names)
    tensors = [a for a in names if a not in sp.scalar_names]
    scalar = next(iter(sp.scalar_names))

    def parts(args):
        n = dict(zip(names, args))
        return n["x"], n["result"], n["lora_a"], n["lora_b"], n[scalar]

    # the update rounded to the output's dtype before the add (peft's layers over 4-bit bases), where
    # that is not the sum's own rounding: the kernel makes the rounded update, the add is the spelling's
    first = sp.name in ROUNDS_UPDATE_FIRST

    def impl(*args):
        x, result, A, B, s = parts(args)
        if not has_failed(kernel.kernel_name(x.dtype, A.dtype, result.dtype), x.device.type):
            try:
                if first and torch.promote_types(result.dtype, A.dtype) != result.dtype:
                    update, u = kernel.forward(x, torch.zeros_like(result), A, B, s)
                    return result + update, u
                return kernel.forward(x, result, A, B, s)
            except Exception as e:  # noqa: BLE001 - compile or launch failure: the stock code runs
                if tracing():  # traced for inductor: left to launch from the host, nothing marked failed
                    raise
                _failed(x, A, result.dtype, e, sp)
        with torch.no_grad():
            return sp.fn(*args), torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).to(A.dtype), A)

    def fake(*args):
        x, result, A, B, s = parts(args)
        T = x.numel() // max(x.shape[-1], 1)
        return torch.empty_like(result, memory_format=torch.contiguous_format), A.new_empty((T, A.shape[0]))

    args_schema = schema_args(sp)
    # traceable: on CUDA under the inductor backend the calls become their launches in the compiled
    # graph (rewriter/lowering.py), launched by inductor's generated code
    op, fwd_op = define(name, impl, fake, f"({args_schema}) -> (Tensor, Tensor)", traceable=True)

    def bwd_impl(g, u, needs, *args):
        """(dx, dA, dB) for `needs` of (x, lora_a, lora_b); empty where not needed. `result` in
        args stands for the base output's shape and dtype only (the backward passes g)."""
        x, result, A, B, s = parts(args)
        if not has_failed(kernel.kernel_name(x.dtype, A.dtype, result.dtype), x.device.type):
            try:
                got = kernel.backward(g, x, A, B, u, s, tuple(needs))
                return [d if d is not None else t.new_empty(0) for d, t in zip(got, (x, A, B))]
            except Exception as e:  # noqa: BLE001 - compile or launch failure: the stock code runs
                if tracing():
                    raise
                _failed(x, A, result.dtype, e, sp)
        want = dict(zip(("x", "lora_a", "lora_b"), needs))
        got = reference_gradients(sp, g, args, [want.get(n, False) for n in tensors])
        by_name = dict(zip(tensors, got))
        return [by_name[n] for n in ("x", "lora_a", "lora_b")]

    def bwd_fake(g, u, needs, *args):
        x, result, A, B, s = parts(args)
        return [torch.empty_like(t) if need else t.new_empty(0) for t, need in zip((x, A, B), needs)]

    _, bwd_op = define(
        f"{name}_bwd",
        bwd_impl,
        bwd_fake,
        f"(Tensor g, Tensor u, bool[] needs, {args_schema}) -> Tensor[]",
        traceable=True,
    )
    x_i, r_i, a_i, b_i = (names.index(n) for n in ("x", "result", "lora_a", "lora_b"))
    # the base output is not saved: no gradient depends on its value (the update is added to it),
    # and the backward passes g (its shape and dtype) in its place. Saved, it would keep every
    # adapted layer's full output alive until the backward, most of a LoRA step's activations
    t_idx = [names.index(n) for n in tensors if n != "result"]

    def setup_context(ctx, inputs, output):
        save_inputs(ctx, inputs, t_idx, output[1])
        ctx.rest[r_i] = None
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    def backward(ctx, g, _u):
        grads = [None] * len(names)
        if g is None:
            return tuple(grads)
        (u,), args = saved_inputs(ctx, t_idx, 1)
        args[r_i] = g
        if ctx.needs_input_grad[r_i]:
            grads[r_i] = g  # the base output's gradient: g itself (an exact cast where the sum promoted)
        needs = [bool(ctx.needs_input_grad[i]) for i in (x_i, a_i, b_i)]
        if any(needs):
            got = bwd_op(g, u, needs, *args)
            for i, need, d in zip((x_i, a_i, b_i), needs, got):
                if need:
                    grads[i] = d
        return tuple(grads)

    op.register_autograd(backward, setup_context=setup_context)
    return LoRAOp(sp, name, fwd_op)
