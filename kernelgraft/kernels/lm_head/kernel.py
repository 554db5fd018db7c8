"""LM head + cross-entropy, fused: the full logits tensor is never held.

The tokens are taken a chunk at a time. For one chunk:

    z  = h_c @ W^T [+ b]               cuBLAS, in W's dtype (as the model's linear rounds: with a
                                       bias, addmm, as F.linear adds it)
    y  = f(z)                          the spelling's logit transform (softcap, scale, cast), generated
    loss_i = logsumexp_v(y_i) - y_i[t_i]     online max and sum over vocab blocks, one pass
    dz = f'(z) * (softmax(y) - onehot(t)) * s   second pass, written over z in place
    dh_c = dz @ W,  dW += dz^T @ h_c  cuBLAS
    db += sum_rows(dz)                 in float32, rounded once at the end (as eager sums the rows)

so memory beyond the inputs and the gradients is one chunk of logits, sized from the shapes (or
set). The gradients are formed in the forward, for a loss gradient of 1, and scaled in the
backward by the loss's incoming gradient: exact when it is 1 (plain training and HF's Trainer),
one extra rounding otherwise. s is 1 / (number of counted labels) for reduction="mean", or
1 / num_items_in_batch for HF's sum-then-divide.

The transform f and its derivative come from the sympy generator, with the spelling's rounding
points (Gemma-2's softcap runs in bf16 in the model: each op rounds). The matmuls stay with cuBLAS.

Weight-gradient accumulation over chunks (`accumulate`):
    "fp32"   (default) an fp32 buffer of W's shape, rounded once at the end: the same error as the
             unfused model (tests/kernels/test_lm_head.py checks it). Costs 4 bytes per weight element.
    "weight" in W's dtype, rounded after every chunk: half the memory, an error that grows with
             the number of chunks (close to eager's over a few long chunks, above it over many
             short ones).
The gradients made in the forward wait for the backward outside the autograd graph (`_STASH`), so
the backward hands them out without a copy. A label neither in the vocabulary nor the ignore index
is refused before the first launch, as F.cross_entropy refuses it (check_labels).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from ...options import ACCUMULATE, lm_head_chunk_from_env
from ..cache import load_module
from ..fallback import record_failure, warn_once
from ..family import Unsupported
from ..launching import NotTraceable, launch_options, launcher, pow2, register_kernels, tracing
from ..spec import SERVED
from .source import kernel_source
from .transform import transform

CHUNK_BYTES = 256 * 2**20  # default budget for one chunk of logits
SUM_BLOCK = 1024  # the labels counted, the rows' losses summed: this many at a time, in one program


# ---- the Triton kernel (source.py): per row, online logsumexp over vocab blocks, then the gradient


@functools.cache
def kernel_name(spelling, dtype: torch.dtype, rounding: str) -> str:
    return re.sub(r"\W", "_", f"{spelling.pattern}__{spelling.name}__{str(dtype)[6:]}__{rounding}")


def rounds_as(device_type: str) -> str:
    """Whose eager rounding a kernel running on `device_type` reproduces: CUDA's and the CPU's
    elementwise backward kernels round differently in places (derive._local_derivatives: tanh)."""
    return "cuda" if device_type == "cuda" else "cpu"


@functools.cache
def _kernel(spelling, dtype: torch.dtype, rounding: str, device_type: str, rounds: str | None = None):
    """The CE kernel for `device_type` (the interpreter's on the CPU); rounds: whose eager rounding
    it reproduces, rounds_as(device_type) unless given (a CPU test of CUDA's rounding)."""
    rounds = rounds or rounds_as(device_type)
    tf = transform(spelling, dtype, rounding, rounds)
    name = kernel_name(spelling, dtype, rounding)
    src = kernel_source(name, tf, spelling.qualname, accurate_exp=rounds == "cuda")
    mod, _ = load_module(name, src, interpret=device_type == "cpu")
    register_kernels(name, single=True)
    register_kernels(name)  # its helpers: <name>_scale, <name>_loss
    return Kernels(getattr(mod, name), getattr(mod, f"{name}_scale"), getattr(mod, f"{name}_loss")), tf


@dataclass(frozen=True)
class Kernels:
    """One LM head's generated kernels: the rows' loss and gradient (ce), the mean's divisor and the
    gradient's scale (scale), the loss from the rows' (loss)."""

    ce: object
    scale: object
    loss: object


# ---- chunking ------------------------------------------------------------------------------------


def chunk_tokens(T: int, V: int, itemsize: int, chunk: int = 0) -> int:
    """Tokens per chunk: `chunk` if given (> 0), else $KERNELGRAFT_LM_HEAD_CHUNK, else what keeps
    one chunk of logits within CHUNK_BYTES (a multiple of 64 tokens when above 64)."""
    if chunk <= 0:
        chunk = lm_head_chunk_from_env() or 0
    if chunk <= 0:
        chunk = _whole_64s(max(1, CHUNK_BYTES // max(1, V * itemsize)))
    return max(1, min(chunk, max(T, 1)))


def _whole_64s(tokens: int) -> int:
    """A chunk's tokens, a multiple of 64 where above 64 (whole blocks for the matmuls)."""
    return tokens - tokens % 64 if tokens > 64 else tokens


# tokens of a chunk below which the chunked matmuls lose speed (shorter chunks fill the GPU less),
# and the chunk lm_head_memory="min" takes, trading that speed for memory
EFFICIENT_CHUNK = 1024
MIN_MEMORY_CHUNK = 512
# accumulate="auto" sums the weight gradient in a 2-byte weight's own dtype where that is as accurate
# as the unfused model by the rule: chunks of at least EFFICIENT_CHUNK tokens, at most this many of
# them, each chunk's rounding small beside its sum. Shorter chunks are not: tiny shapes of a few
# tokens per chunk lose to eager after a handful of chunks.
WEIGHT_SUM_CHUNKS = 8


def _fit(budget: float, fixed: float, row: int, T1: int) -> int:
    """The most tokens (whole 64s) whose logits fit in `budget` bytes beside `fixed` ones."""
    c = _whole_64s(int(max(budget - fixed, 0) // max(row, 1)))
    return max(min(c, T1), min(MIN_ROWS, T1))


def _sums_in_weight_dtype(T: int, C: int) -> bool:
    n = len(chunk_bounds(T, C))
    return n <= 1 or (n <= WEIGHT_SUM_CHUNKS and C >= EFFICIENT_CHUNK)


def plan(T: int, H: int, V: int, itemsize: int, chunk: int, accumulate: str, memory: float) -> tuple[int, str]:
    """(tokens per chunk, weight-gradient accumulation) for T tokens, H hidden, V vocabulary.

    memory: 0 (no budget), `chunk` (or $KERNELGRAFT_LM_HEAD_CHUNK) given: that chunk, with
    `accumulate` as given ("auto": the weight's dtype where _sums_in_weight_dtype, else float32).
    memory 0, no chunk - the default: "fp32" (or a 4-byte weight) keeps chunks of CHUNK_BYTES of
    logits; otherwise the chunk is the largest that the less of two budgets holds - what that
    float32 plan holds, and half what the unfused head holds (its logits and weight gradient) -
    with the weight gradient in the weight's dtype ("weight", or "auto" where
    _sums_in_weight_dtype), never shorter than the float32 plan's; "auto" otherwise falls back to
    the float32 plan. Fewer chunks, no float32 copy of the weight, no more memory.
    memory > 0: a budget in GiB for what the fused head holds at once besides its inputs - the
    weight gradient (in float32 while "fp32" sums it), h's gradient, and one chunk of logits - and
    the plan is the largest chunk in it: all tokens in one chunk in the weight's dtype where that
    fits (one rounding: as accurate as summing in float32), else float32 accumulation where its
    chunk still has EFFICIENT_CHUNK tokens, else the weight's dtype (accumulate="weight" given:
    always). < 0 ("min"): the weight's dtype, MIN_MEMORY_CHUNK tokens."""
    T1 = max(T, 1)
    env = lm_head_chunk_from_env() or 0
    if chunk > 0 or (memory == 0 and env > 0):
        C = chunk_tokens(T, V, itemsize, chunk)
        if accumulate == "auto":
            accumulate = "weight" if itemsize == 2 and _sums_in_weight_dtype(T, C) else "fp32"
        return C, accumulate
    if memory < 0:
        return max(1, min(MIN_MEMORY_CHUNK, T1)), "weight"
    row = V * itemsize  # one token's logits
    dh = T * H * itemsize
    if memory == 0:
        C32 = chunk_tokens(T, V, itemsize)
        if itemsize == 4 or accumulate == "fp32":
            return C32, "fp32"
        held32 = V * H * 4 + dh + C32 * row
        unfused = T * row + V * H * itemsize
        C = max(_fit(min(held32, unfused / 2), V * H * itemsize + dh, row, T1), C32)
        if accumulate == "weight" or _sums_in_weight_dtype(T, C):
            return C, "weight"
        return C32, "fp32"
    budget = memory * 2**30
    weight_chunk = _fit(budget, V * H * itemsize + dh, row, T1)
    if weight_chunk >= T1 or accumulate == "weight":
        return weight_chunk, "weight"
    fp32_chunk = _fit(budget, V * H * 4 + dh, row, T1)
    if fp32_chunk >= min(EFFICIENT_CHUNK, T1) or itemsize == 4:
        return fp32_chunk, "fp32"
    warn_once(
        ("lm_head_memory", T, H, V, memory),
        f"kernelgraft: lm_head_memory={memory:g} GiB leaves no room to sum the LM head's weight gradient "
        f"in float32 at {T} tokens x {H} x {V}: it is summed in the weight's dtype over "
        f"{-(-T // weight_chunk)} chunks, which rounds once per chunk (the more chunks, the less accurate "
        "than the unfused model). A larger budget keeps the float32 sum.",
    )
    return weight_chunk, "weight"


# A chunk has at least this many tokens (or all of them): with fewer rows its matmuls take the CPU
# BLAS's matrix-vector paths, which sum the vocabulary terms less accurately than a matmul of 4 rows
# or more (fp32, 1-3 rows), so dh lost to eager's.
MIN_ROWS = 8


def chunk_bounds(T: int, C: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of C tokens; none shorter than MIN_ROWS (a short last chunk joins
    the one before it)."""
    C = max(C, min(T, MIN_ROWS))
    bounds = [(s, min(s + C, T)) for s in range(0, T, C)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < MIN_ROWS:
        bounds.pop()
        bounds[-1] = (bounds[-1][0], T)
    return bounds


# (BLOCK_V, num_warps): the GPU's the fastest found; the interpreter's a larger block, as each
# program costs it Python work
CE_CONFIG = {"cuda": (4096, 4), "cpu": (8192, 4)}


def _ce_config(V: int, device: torch.device) -> tuple[int, int]:
    cap, warps = CE_CONFIG.get(device.type, CE_CONFIG["cuda"])
    return min(cap, pow2(max(V, 1))), warps


def narrow_in_place(x: torch.Tensor, dtype: torch.dtype, rows: int = 4096) -> torch.Tensor:
    """x (float32, contiguous) rounded to the 2-byte `dtype` inside x's own storage: a view of its
    first half. Row block [r, r + b) is written over bytes that held rows below r, already read, so
    no second full-size buffer is needed (the fp32 weight-gradient accumulator: 2x the weight,
    not 3x, at its peak). The storage keeps x's size until the result is freed."""
    assert x.dtype == torch.float32 and x.is_contiguous() and torch.empty((), dtype=dtype).element_size() == 2
    n = x.shape[0]
    if n == 0:
        return x.new_empty(x.shape, dtype=dtype)
    flat = x.view(n, -1)
    out = x.view(-1).view(dtype)[: x.numel()].view(n, -1)  # same storage, reinterpreted
    first = min(n, 1)
    head = flat[:first].to(dtype)  # row 0's destination overlaps itself: through a copy
    r = first
    while r < n:
        b = min(r, rows, n - r)  # b <= r: the destination ends at byte 4*r*H, where the source starts
        out[r : r + b].copy_(flat[r : r + b])
        r += b
    out[:first].copy_(head)
    return out.view(x.shape)


# ---- one call: chunk by chunk -------------------------------------------------------------------


def forward(
    spelling,
    h,
    W,
    target,
    divisor,
    scalars,
    ignore_index,
    needs_h,
    needs_w,
    chunk,
    accumulate,
    rounding,
    grad_scale: float | torch.Tensor = 1.0,
    memory: float = 0.0,
    bias: torch.Tensor | None = None,
    needs_b: bool = False,
    check: bool = True,
):
    """-> (loss, dh, dW, db): the gradients for a loss gradient of `grad_scale` (a number, or a
    tensor of one value on the device), empty where not needed (db: where there is no bias or
    needs_b is False). chunk, accumulate, memory: see plan(). check: the labels are checked
    (check_labels); a backward that makes the gradients again, after a forward that checked
    them, passes False.

    Traced for inductor (launching.traced_launches), the same launches and matmuls are recorded
    without out= or in-place ops, which a compiled graph does not take: h's gradient is the chunks'
    products joined, the weight gradient each chunk's addmm on the last (the first chunk's a plain
    product, as addmm with beta 0 computes it), narrowed from float32 by a cast."""
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
    for name, t in (("h", h), ("weight", W)):
        if t.dtype not in SERVED:
            raise Unsupported(f"{name} is {t.dtype}; the fused LM head serves {SERVED}")
    if h.dtype != W.dtype:
        raise Unsupported(f"h is {h.dtype} and the weight {W.dtype}; the linear needs one dtype")
    dev = h.device
    traced = tracing()
    try:
        fn, tf = _kernel(spelling, W.dtype, rounding, dev.type)
    except Unsupported:
        raise
    except Exception as e:  # noqa: BLE001 - generated source that does not load: the caller falls back
        if traced:
            raise
        _failed(spelling, W.dtype, rounding, dev, e)
        raise KernelFailed from e
    H, V = W.shape[1], W.shape[0]
    h2 = h.reshape(-1, H)
    t = target.reshape(-1)
    T = h2.shape[0]
    if t.numel() != T:
        raise ValueError(f"{spelling.qualname}: {t.numel()} labels for {T} hidden rows")
    if check:
        check_labels(t, V, int(ignore_index))
    if traced and T == 0:
        raise NotTraceable("no tokens: nothing to launch")
    needs_b = needs_b and bias is not None
    if traced and needs_b:
        raise NotTraceable(
            "a biased head: its bias gradient sums the logits' gradient over rows, which inductor "
            "would sum in an order of its own (the launch from the host keeps torch's)"
        )
    grad = needs_h or needs_w or needs_b
    losses = torch.empty(T, dtype=torch.float32, device=dev)
    # the mean's divisor: the labels counted, or HF's num_items_in_batch (sum / n); and the counted
    # rows' gradient, the loss gradient (a number, or a tensor on the device: no host sync) over it
    denom = torch.empty(1, dtype=torch.float32, device=dev)
    scale = torch.empty(1, dtype=torch.float32, device=dev)
    g_t = grad_scale if isinstance(grad_scale, torch.Tensor) else None
    if g_t is None and grad_scale != 1.0:
        g_t = torch.full((1,), float(grad_scale), dtype=torch.float32, device=dev)
    n_t = divisor.reshape(1) if isinstance(divisor, torch.Tensor) else None
    if divisor is not None and n_t is None:
        n_t = torch.full((1,), float(divisor), dtype=torch.float32, device=dev)
    launcher(fn.scale)[(1,)](
        t,
        T,
        int(ignore_index),
        scale if g_t is None else g_t.reshape(1),
        denom if n_t is None else n_t,
        scale,
        denom,
        HAS_G=g_t is not None,
        HAS_N=n_t is not None,
        BLOCK=SUM_BLOCK,
    )
    dh = torch.empty_like(h2) if needs_h and not traced else h.new_empty(0)
    dh_parts = []
    C, accumulate = plan(T, H, V, W.element_size(), chunk, accumulate, memory)
    acc32 = accumulate == "fp32" and W.dtype != torch.float32
    dW = (
        torch.empty(W.shape, dtype=torch.float32 if acc32 else W.dtype, device=dev)
        if needs_w and not traced
        else W.new_empty(0)
    )
    db = torch.zeros(V, dtype=torch.float32, device=dev) if needs_b else W.new_empty(0)
    BV, warps = _ce_config(V, dev)
    opts = launch_options(rounding, [W.dtype], dev.type)
    for c0, c1 in chunk_bounds(T, C):
        hc = h2.narrow(0, c0, c1 - c0)  # narrow, not [c0:c1]: Python indexing needs the device itself
        # as F.linear computes the logits (W's dtype, one rounding; a bias added by addmm's epilogue)
        z = hc @ W.t() if bias is None else torch.addmm(bias, hc, W.t())
        try:
            launcher(fn.ce)[(hc.shape[0],)](
                z,
                z.stride(0),
                t.narrow(0, c0, c1 - c0),
                losses.narrow(0, c0, c1 - c0),
                scale,
                *scalars,
                V,
                int(ignore_index),
                GRAD=grad,
                BLOCK_V=BV,
                num_warps=warps,
                **opts,
            )
        except Exception as e:  # noqa: BLE001 - a Triton compile or launch failure: the caller falls back
            if traced:
                raise
            _failed(spelling, W.dtype, rounding, dev, e)
            raise KernelFailed from e
        if needs_b:
            rows = z.sum(0, dtype=torch.float32)
            db = db + rows if traced else db.add_(rows)
        if needs_h:
            if traced:
                dh_parts.append(z @ W)
            else:
                torch.mm(z, W, out=dh.narrow(0, c0, c1 - c0))
        if needs_w:
            dW = _weight_grad(dW, z, hc, c0 == 0, acc32 and dev.type == "cuda", acc32, traced)
        del z
    loss = torch.empty((), dtype=torch.float32, device=dev)  # not a view: callers scale it in place
    launcher(fn.loss)[(1,)](losses, T, denom, loss, BLOCK=SUM_BLOCK)
    if needs_h and traced:
        dh = dh_parts[0] if len(dh_parts) == 1 else torch.cat(dh_parts)
    if needs_w and T == 0:
        dW.zero_()
    if needs_w and acc32:
        dW = dW.to(W.dtype) if traced else narrow_in_place(dW, W.dtype)
    db = db.to(bias.dtype) if needs_b else db
    return loss.to(tf.out_dtype), dh.view(h.shape) if needs_h else dh, dW, db


def check_labels(t: torch.Tensor, V: int, ignore_index: int) -> None:
    """Raise, as F.cross_entropy does, where a label is neither in [0, V) nor the ignore index (the
    kernel would give its row a NaN loss and NaN gradients). On the CPU an IndexError naming the
    label and the vocabulary; on a GPU a device-side assert over one reduction of the labels, as
    torch's own CUDA loss reports it: a RuntimeError at the next synchronization, and no host sync
    on the way (traced for inductor, the assert is recorded in the compiled graph)."""
    if t.device.type == "cpu":
        bad = t[(t != ignore_index) & ((t < 0) | (t >= V))]
        if bad.numel():
            raise IndexError(
                f"Target {int(bad[0])} is out of bounds: the fused LM head's labels are classes of its "
                f"vocabulary of {V} (0 to {V - 1}) or the ignore index {ignore_index}; fix the labels, or "
                "the vocabulary size the model was built with"
            )
        return
    ok = ((t >= 0) & (t < V)) | (t == ignore_index)
    torch._assert_async(
        ok.all(),
        f"kernelgraft: a target is out of bounds: the fused LM head's labels are classes of its vocabulary "
        f"of {V} (0 to {V - 1}) or the ignore index {ignore_index}",
    )


def _weight_grad(dW, z, hc, first: bool, out_fp32: bool, upcast: bool, traced: bool):
    """dW after one chunk's term z^T hc: summed in float32 (cuBLAS's float32 output: out_fp32; the
    CPU's product of float32 copies: upcast) or in W's dtype. The first chunk writes dW without
    reading it (addmm's beta 0). Traced: a new tensor each chunk (mm for the first: the product
    addmm with beta 0 makes), else in dW's storage. On CUDA a column-major chunk of h is read
    row-major: cuBLAS rounds z^T h less accurately with it (bf16 weight gradients of a transposed h
    lost to eager's, which switches formula with the layout)."""
    if hc.device.type == "cuda" and not hc.is_contiguous():
        hc = hc.contiguous()
    a, b = (z.t().float(), hc.float()) if upcast and not out_fp32 else (z.t(), hc)
    kw = {"out_dtype": torch.float32} if out_fp32 else {}
    if traced:
        return torch.mm(a, b, **kw) if first else torch.addmm(dW, a, b, **kw)
    return torch.addmm(dW, a, b, beta=0.0 if first else 1.0, out=dW, **kw)


class KernelFailed(Exception):
    """The CE kernel failed to compile or launch (recorded in FAILED, warned about once)."""


def _failed(spelling, dtype: torch.dtype, rounding: str, dev: torch.device, e: Exception) -> None:
    record_failure(
        kernel_name(spelling, dtype, rounding),
        dev,
        e,
        "They run their stock PyTorch code from now on: same numbers as without kernelgraft, and "
        "the full logits in memory again.",
        spelling,
        dtype,
    )


