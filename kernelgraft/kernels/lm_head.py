"""LM head + cross-entropy, fused: the full logits tensor is never held.

The tokens are taken a chunk at a time. For one chunk:

    z  = h_c @ W^T                     cuBLAS, in W's dtype (as the model's linear rounds)
    y  = f(z)                          the spelling's logit transform (softcap, scale, cast), generated
    loss_i = logsumexp_v(y_i) - y_i[t_i]     online max and sum over vocab blocks, one pass
    dz = f'(z) * (softmax(y) - onehot(t)) * s   second pass, written over z in place
    dh_c = dz @ W,  dW += dz^T @ h_c  cuBLAS

so memory beyond the inputs and the gradients is one chunk of logits, sized from the shapes (or
set). The gradients are formed in the forward, for a loss gradient of 1, and scaled in the
backward by the loss's incoming gradient: exact when it is 1 (plain training and HF's Trainer),
one extra rounding otherwise. s is 1 / (number of counted labels) for reduction="mean", or
1 / num_items_in_batch for HF's sum-then-divide.

The transform f and its derivative come from the sympy generator, with the spelling's rounding
points (Gemma-2's softcap runs in bf16 in the model: each op rounds). The matmuls stay with cuBLAS.

Weight-gradient accumulation over chunks (`accumulate`):
    "fp32"   (default) an fp32 buffer of W's shape, rounded once at the end: the same error as the
             unfused model (measured: tests/test_lm_head.py). Costs 4 bytes per weight element.
    "weight" in W's dtype, rounded after every chunk: half the memory, an error that grows with
             the number of chunks (bf16: 1.04x eager's at 8192 x 4096 x 128256 on an H200, 8
             chunks; 1.25x on the CPU test's small shapes, 16 chunks).
The gradients made in the forward wait for the backward outside the autograd graph (`_STASH`), so
the backward hands them out without a copy.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
import weakref
from dataclasses import dataclass

import torch

from ..ir import CGraph, CNode
from . import rowkernel
from .cache import load_module
from .codegen import HEADER, _cse_lines
from .derive import derive
from .rowkernel import _pow2, record_failure, spelling_vjp
from .spec import LOW, SERVED, Unsupported, build_spec
from .sym import round_to

ACCUMULATE = ("fp32", "weight")
CHUNK_BYTES = 256 * 2**20  # default budget for one chunk of logits
ABI = 2  # bump when the ops' schemas change: it is in their names, so compiled graphs cached with the old ones are not reused


# ---- the logit transform, from the spelling ------------------------------------------------------


@dataclass
class Transform:
    scalars: list[str]  # spelling arguments it reads (cap, scale), in order
    fwd_lines: list[str]  # Triton lines computing y from v_x (and the scalars)
    fwd: str
    bwd_lines: list[str]  # Triton lines computing dx from v_x and g
    bwd: str
    out_dtype: torch.dtype  # what cross_entropy receives


class _TransformSpelling:
    """The slice of a spelling between its linear and its cross_entropy, as a spelling of its own."""

    def __init__(self, spelling, graph: CGraph, scalars: list[str]):
        self.pattern, self.name = spelling.pattern, f"{spelling.name}__logits"
        self.qualname = f"{spelling.qualname}.logits"
        self.arg_names = ("x", *scalars)
        self.scalar_names = frozenset(scalars)
        self.tensor_names = ("x",)
        self._graph = graph

    def canonical(self) -> CGraph:
        return self._graph


def parts(pg: CGraph) -> tuple[CNode, CNode]:
    """The spelling's linear and cross_entropy nodes."""
    lin = [n for n in pg.nodes if n.op == "linear"]
    ce = [n for n in pg.nodes if n.op == "cross_entropy"]
    if len(lin) != 1 or len(ce) != 1:
        raise TypeError("an lm_head_ce spelling has one F.linear and one F.cross_entropy")
    return lin[0], ce[0]


def _transform_graph(spelling) -> tuple[CGraph, list[str]]:
    pg = spelling.canonical()
    lin, ce = parts(pg)
    made: dict = {}
    nodes: list[CNode] = []
    scalars: list[str] = []
    x = CNode("input", attrs=(("name", "x"), ("kind", "tensor")), name="x")
    nodes.append(x)

    def copy(n):
        if not isinstance(n, CNode):
            return n
        if n is lin:
            return x
        if n in made:
            return made[n]
        if n.op == "flatten_rows":  # a view: the transform is element-wise
            made[n] = copy(n.args[0])
            return made[n]
        if n.op == "input":
            if n.attr("kind") != "scalar":
                raise Unsupported(f"the logits are combined with the tensor `{n.attr('name')}`")
            c = CNode("input", attrs=n.attrs, name=n.name)
            scalars.append(n.attr("name"))
        else:
            c = CNode(n.op, tuple(copy(a) for a in n.args), n.attrs, name=n.name)
        made[n] = c
        nodes.append(c)
        return c

    out = copy(ce.args[0])
    return CGraph(nodes, [n for n in nodes if n.op == "input"], out, {}), scalars


@functools.cache
def transform(spelling, dtype: torch.dtype, rounding: str, device: str = "cpu") -> Transform:
    """The logit transform and its gradient. device: whose eager rounding the gradient reproduces
    where CPU and CUDA kernels differ (see rounds_as)."""
    graph, scalars = _transform_graph(spelling)
    ts = _TransformSpelling(spelling, graph, scalars)
    spec = build_spec(ts, {"x": dtype}, {"x": "elem"}, rounding)
    if spec.reductions:
        raise Unsupported("the logit transform reduces along the vocabulary")
    bwd = derive(spec, device)
    y = round_to(spec.output, LOW.get(spec.out_dtype, "float32"))
    dx = round_to(bwd.grads["v_x"], LOW.get(dtype, "float32"))
    fl, (fe,) = _cse_lines([y], "f", "    ")
    bl, (be,) = _cse_lines([dx], "b", "            ")
    return Transform([f"v_{s}" for s in scalars], fl, fe, bl, be, spec.out_dtype)


# ---- the Triton kernel: per row, online logsumexp over vocab blocks, then the gradient -----------


def kernel_source(name: str, tf: Transform, qual: str) -> str:
    sc = "".join(f"{s}, " for s in tf.scalars)
    pin = "".join(f"    {s} = tl.full([], {s}, tl.float32)\n" for s in tf.scalars)
    fwd = "\n".join(tf.fwd_lines)
    bwd = "\n".join(tf.bwd_lines)
    return (
        HEADER.format(qual=qual, dtypes="logits: the weight's", kinds="rows of logits", out=str(tf.out_dtype))
        + f"""

@triton.jit
def {name}_y(v_x, {sc}):
    # the spelling's logit transform (float32 in, its rounding points kept)
{fwd}
    return {tf.fwd}


@triton.jit
def {name}(z_ptr, z_s0, t_ptr, loss_ptr, scale_ptr, {sc}V, ignore_index, GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    # one row (token) per program; z holds its logits, and on return (GRAD) their gradient
{pin}    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row).to(tl.int64)
    valid = t != ignore_index
    # the target's logit, read once. A label outside [0, V) (PyTorch raises there; checking would
    # cost a host sync per call) gives a NaN loss and NaN gradients for its row: loud, never wrong
    inside = valid & (t >= 0) & (t < V)
    zt = tl.load(z_ptr + row * z_s0 + tl.where(inside, t, 0), mask=inside, other=0.0).to(tl.float32)
    yt = {name}_y(zt, {sc})
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        msk = c < V
        v_x = tl.load(z_ptr + row * z_s0 + c, mask=msk, other=0.0).to(tl.float32)
        y = tl.where(msk, {name}_y(v_x, {sc}), float("-inf"))
        m_new = tl.maximum(m, tl.reduce(y, 0, tl.standard._elementwise_max))
        s = s * tl.exp(m - m_new) + tl.reduce(tl.exp(y - m_new), 0, tl.standard._sum_combine)
        m = m_new
    # as log_softmax does: (y - max) - log(sum), never max + log(sum) (it rounds at the scale of max)
    ls = tl.log(s)
    bad = valid & ((t < 0) | (t >= V))
    tl.store(loss_ptr + row, tl.where(bad, float("nan"), tl.where(valid, (m - yt) + ls, 0.0)))
    if GRAD:
        k = tl.where(valid, tl.load(scale_ptr).to(tl.float32), 0.0)
        k = tl.where(bad, float("nan"), k)
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            msk = c < V
            v_x = tl.load(z_ptr + row * z_s0 + c, mask=msk, other=0.0).to(tl.float32)
            g = (tl.exp(({name}_y(v_x, {sc}) - m) - ls) - tl.where(c == t, 1.0, 0.0)) * k
{bwd}
            tl.store(z_ptr + row * z_s0 + c, {tf.bwd}, mask=msk)
"""
    )


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
    tf = transform(spelling, dtype, rounding, rounds or rounds_as(device_type))
    name = kernel_name(spelling, dtype, rounding)
    src = kernel_source(name, tf, spelling.qualname)
    mod, _ = load_module(name, src, interpret=device_type == "cpu")
    return getattr(mod, name), tf


# ---- chunking ------------------------------------------------------------------------------------


def chunk_tokens(T: int, V: int, itemsize: int, chunk: int = 0) -> int:
    """Tokens per chunk: `chunk` if given (> 0), else $KERNELGRAFT_LM_HEAD_CHUNK, else what keeps
    one chunk of logits within CHUNK_BYTES (a multiple of 64 tokens when above 64)."""
    if chunk <= 0:
        chunk = int(os.environ.get("KERNELGRAFT_LM_HEAD_CHUNK", "0") or 0)
    if chunk <= 0:
        chunk = max(1, CHUNK_BYTES // max(1, V * itemsize))
        if chunk > 64:
            chunk -= chunk % 64
    return max(1, min(chunk, max(T, 1)))


# A chunk has at least this many tokens (or all of them): with fewer rows its matmuls take the CPU
# BLAS's matrix-vector paths, which sum the vocabulary terms less accurately (fp32, 1-3 rows: 2-3x
# the error of the same product in a 4-row or larger matmul, measured), so dh lost to eager's.
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


CE_CONFIG = {"cuda": (4096, 4), "cpu": (8192, 4)}  # (BLOCK_V, num_warps); cuda: tuned on an H200


def _ce_config(V: int, device: torch.device) -> tuple[int, int]:
    cap, warps = CE_CONFIG.get(device.type, CE_CONFIG["cuda"])
    return min(cap, _pow2(max(V, 1))), warps


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


# ---- the op ----------------------------------------------------------------------------------------


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
    grad_scale: float = 1.0,
):
    """-> (loss, dh, dW): dh/dW for a loss gradient of `grad_scale`, empty where not needed."""
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
    for name, t in (("h", h), ("weight", W)):
        if t.dtype not in SERVED:
            raise Unsupported(f"{name} is {t.dtype}; the fused LM head serves {SERVED}")
    if h.dtype != W.dtype:
        raise Unsupported(f"h is {h.dtype} and the weight {W.dtype}; the linear needs one dtype")
    dev = h.device
    try:
        fn, tf = _kernel(spelling, W.dtype, rounding, dev.type)
    except Unsupported:
        raise
    except Exception as e:  # noqa: BLE001 - generated source that does not load: the caller falls back
        _failed(kernel_name(spelling, W.dtype, rounding), dev, e)
        raise KernelFailed from e
    H, V = W.shape[1], W.shape[0]
    h2 = h.reshape(-1, H)
    t = target.reshape(-1)
    T = h2.shape[0]
    if t.numel() != T:
        raise ValueError(f"{spelling.qualname}: {t.numel()} labels for {T} hidden rows")
    grad = needs_h or needs_w
    losses = torch.empty(T, dtype=torch.float32, device=dev)
    # mean: over the labels counted; HF's sum / num_items_in_batch: over what the caller counted
    denom = (t != int(ignore_index)).sum().to(torch.float32) if divisor is None else divisor
    scale = (grad_scale / denom.to(torch.float32)).reshape(1) if grad else losses.new_empty(1)
    dh = torch.empty_like(h2) if needs_h else h.new_empty(0)
    acc32 = accumulate == "fp32" and W.dtype != torch.float32
    dW = (
        torch.empty(W.shape, dtype=torch.float32 if acc32 else W.dtype, device=dev)
        if needs_w
        else W.new_empty(0)
    )
    C = chunk_tokens(T, V, W.element_size(), chunk)
    BV, warps = _ce_config(V, dev)
    opts = rowkernel.launch_options(rounding, [W.dtype], dev.type)
    for c0, c1 in chunk_bounds(T, C):
        hc = h2[c0:c1]
        z = hc @ W.t()  # as F.linear computes the logits (W's dtype, one rounding)
        try:
            fn[(hc.shape[0],)](
                z,
                z.stride(0),
                t[c0:c1],
                losses[c0:c1],
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
            _failed(kernel_name(spelling, W.dtype, rounding), dev, e)
            raise KernelFailed from e
        if needs_h:
            torch.mm(z, W, out=dh[c0:c1])
        if needs_w:
            beta = 0.0 if c0 == 0 else 1.0  # the first chunk writes dW without reading it
            if acc32 and dev.type == "cuda":
                torch.addmm(dW, z.t(), hc, beta=beta, out_dtype=torch.float32, out=dW)
            elif acc32:
                torch.addmm(dW, z.t().float(), hc.float(), beta=beta, out=dW)
            else:
                torch.addmm(dW, z.t(), hc, beta=beta, out=dW)
        del z
    loss = losses.sum() / denom
    if needs_w and T == 0:
        dW.zero_()
    if needs_w and acc32:
        dW = narrow_in_place(dW, W.dtype)
    return loss.to(tf.out_dtype), dh.view(h.shape) if needs_h else dh, dW


_OPS: dict = {}


class KernelFailed(Exception):
    """The CE kernel failed to compile or launch (recorded in FAILED, warned about once)."""


def _failed(name: str, dev: torch.device, e: Exception) -> None:
    record_failure(
        name,
        dev,
        e,
        "Its LM-head sites run their stock PyTorch code from now on: same numbers as without "
        "kernelgraft, and the full logits in memory again.",
    )


def reference(spelling, named: dict, needs_h: bool, needs_w: bool, grad_scale: float = 1.0) -> tuple:
    """(loss, dh, dW) from the spelling itself (the stock code, full logits): the path of a kernel
    that failed."""
    named = dict(named, ignore_index=int(named["ignore_index"]))  # the op's schema carries it as a float
    h, W = named["h"], named["weight"]
    diff = [n for n, need in (("h", needs_h), ("weight", needs_w)) if need]
    if not diff:
        with torch.no_grad():
            return spelling.fn(*(named[a] for a in spelling.arg_names)), h.new_empty(0), W.new_empty(0)
    loss, got = spelling_vjp(spelling, named, diff, lambda y: torch.full_like(y, grad_scale))
    return loss, got.get("h", h.new_empty(0)), got.get("weight", W.new_empty(0))


# The gradients the forward made, until the backward takes them: held here rather than saved in the
# autograd graph, so the backward can hand them out without a copy (a custom op may not return its
# input). Each entry lives as long as its ticket (a CPU scalar the graph saves): a graph freed
# without a backward frees its gradients too.
_STASH: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_NEXT = itertools.count(1)


def _ticket_like() -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


def _stash(dh: torch.Tensor, dW: torch.Tensor) -> torch.Tensor:
    key = next(_NEXT)
    ticket = torch.tensor(key, dtype=torch.int64)
    if dh.numel() or dW.numel():
        _STASH[key] = (dh, dW)
        weakref.finalize(ticket, _STASH.pop, key, None)
    return ticket


@dataclass
class LMHeadOp:
    spelling: object
    name: str
    fwd: object
    chunk: int = 0  # tokens per chunk when called directly (0: from the shapes)
    accumulate: str = "fp32"

    def __call__(self, *args):
        """The loss, from the spelling's own arguments (what gradcheck and benchmarks call)."""
        named = dict(zip(self.spelling.arg_names, args))
        g = torch.is_grad_enabled()
        flags = (g and named["h"].requires_grad, g and named["weight"].requires_grad)
        return self.fwd(*args, *flags, self.chunk, self.accumulate)[0]

    def configured(self, chunk: int = 0, accumulate: str = "fp32") -> LMHeadOp:
        return LMHeadOp(self.spelling, self.name, self.fwd, chunk, accumulate)

    def bind(self, args: dict, metas: dict, options: dict) -> tuple:
        """The op's call arguments from the matched ones (fx nodes and numbers by spelling name)."""
        sp = self.spelling
        h, w = metas.get("h"), metas.get("weight")
        needs_h = bool(h is not None and h.requires_grad and torch.is_grad_enabled())
        needs_w = bool(w is not None and w.requires_grad and torch.is_grad_enabled())
        out = [args[a] if a not in sp.scalar_names else float(args[a]) for a in sp.arg_names]
        return (
            *out,
            needs_h,
            needs_w,
            int(options.get("lm_head_chunk", 0) or 0),
            options.get("lm_head_accumulate", "fp32"),
        )


def op_for(spelling, rounding: str = "autograd") -> LMHeadOp:
    name = re.sub(r"\W", "_", f"{spelling.pattern}__{spelling.name}__{spelling.key}__{rounding}_abi{ABI}")
    if name in _OPS:
        return _OPS[name]
    sp = spelling
    names = list(sp.arg_names)
    n_args = len(names)
    tf_scalars = None

    def unpack(args):
        nonlocal tf_scalars
        named = dict(zip(names, args[:n_args]))
        needs_h, needs_w, chunk, accumulate = args[n_args:]
        if tf_scalars is None:
            graph, tf_scalars = _transform_graph(sp)
        return named, needs_h, needs_w, chunk, accumulate

    def run(args, grad_scale=1.0):
        named, needs_h, needs_w, chunk, accumulate = unpack(args)
        W = named["weight"]
        if rowkernel.FAILED and (kernel_name(sp, W.dtype, rounding), W.device.type) in rowkernel.FAILED:
            return reference(sp, named, needs_h, needs_w, grad_scale)
        try:
            return fused(named, needs_h, needs_w, chunk, accumulate, grad_scale)
        except KernelFailed:
            return reference(sp, named, needs_h, needs_w, grad_scale)

    def fused(named, needs_h, needs_w, chunk, accumulate, grad_scale):
        return forward(
            sp,
            named["h"],
            named["weight"],
            named["target"],
            named.get("n"),
            [float(named[x]) for x in tf_scalars],
            named["ignore_index"],
            needs_h,
            needs_w,
            chunk,
            accumulate,
            rounding,
            grad_scale=grad_scale,
        )

    def impl(*args):
        loss, dh, dW = run(args)
        return loss, _stash(dh, dW)

    def fake(*args):
        named, _, _, _, _ = unpack(args)
        h, W = named["h"], named["weight"]
        return h.new_empty((), dtype=_out_dtype(sp, W.dtype)), _ticket_like()

    tensor_idx = [i for i, a in enumerate(names) if a not in sp.scalar_names]
    schema_args = ", ".join(f"float {a}" if a in sp.scalar_names else f"Tensor {a}" for a in names)
    lib = f"kernelgraft::{name}"
    op = torch.library.custom_op(
        lib,
        impl,
        mutates_args=(),
        schema=f"({schema_args}, bool needs_h, bool needs_w, int chunk, str accumulate) -> (Tensor, Tensor)",
    )
    op.register_fake(fake)
    h_idx, w_idx = names.index("h"), names.index("weight")

    def bwd_impl(g, ticket, *args):
        """The gradients for the loss's incoming gradient g, from the ones the forward made for 1.
        Scaling by a power of two (1 in plain training, a loss scale) is exact and done in place;
        any other g, or a second backward through a retained graph (the stash was handed out),
        makes the gradients again with g folded in before the softmax gradient rounds, as the
        unfused model does."""
        gv = float(g)
        got = _STASH.pop(int(ticket), None)
        mant, _ = math.frexp(gv)
        if got is not None and (gv == 0.0 or abs(mant) == 0.5):
            dh, dW = got
            if gv != 1.0:
                dh.mul_(gv)
                dW.mul_(gv)
            return dh, dW
        del got
        _, dh, dW = run(args, grad_scale=gv)
        return dh, dW

    def bwd_fake(g, ticket, *args):
        named, needs_h, needs_w, _, _ = unpack(args)
        h, W = named["h"], named["weight"]
        return (
            torch.empty_like(h) if needs_h else h.new_empty(0),
            torch.empty_like(W) if needs_w else W.new_empty(0),
        )

    bwd = torch.library.custom_op(
        f"{lib}_bwd",
        bwd_impl,
        mutates_args=(),
        schema=f"(Tensor g, Tensor ticket, {schema_args}, bool needs_h, bool needs_w, int chunk, "
        "str accumulate) -> (Tensor, Tensor)",
    )
    bwd.register_fake(bwd_fake)
    bwd_op = getattr(torch.ops.kernelgraft, f"{name}_bwd").default

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output[1], *(inputs[i] for i in tensor_idx))
        ctx.rest = [inputs[i] if i not in tensor_idx else None for i in range(len(inputs))]
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    def backward(ctx, g, _ticket):
        grads = [None] * (n_args + 4)
        if g is None:
            return tuple(grads)
        ticket, *tensors = ctx.saved_tensors
        args = list(ctx.rest)
        for i, t in zip(tensor_idx, tensors):
            args[i] = t
        gh, gw = bwd_op(g, ticket, *args)
        if ctx.needs_input_grad[h_idx] and gh.numel():
            grads[h_idx] = gh.view(args[h_idx].shape)
        if ctx.needs_input_grad[w_idx] and gw.numel():
            grads[w_idx] = gw
        return tuple(grads)

    op.register_autograd(backward, setup_context=setup_context)
    res = LMHeadOp(sp, name, getattr(torch.ops.kernelgraft, name).default)
    _OPS[name] = res
    return res


def _out_dtype(spelling, dtype: torch.dtype) -> torch.dtype:
    try:
        return transform(spelling, dtype, "autograd").out_dtype
    except Unsupported:
        return dtype


def refusal(spelling, metas: dict, rounding: str, options: dict) -> str | None:
    """Why the fused LM head cannot serve this site (None: it can)."""
    h, W, t = metas.get("h"), metas.get("weight"), metas.get("target")
    if h is None or W is None or t is None:
        return "no shape/dtype recorded for h, weight or target"
    if not torch.is_grad_enabled() and not options.get("assume_training"):
        return "captured without gradients (evaluation): the logits are returned, nothing to fuse"
    if W.dim() != 2 or h.shape[-1] != W.shape[1]:
        return f"weight {tuple(W.shape)} does not multiply h {tuple(h.shape)}"
    if h.dtype != W.dtype or W.dtype not in SERVED:
        return f"h is {h.dtype} and the weight {W.dtype}; the fused LM head serves one of {SERVED}"
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        return f"target is {t.dtype}; class indices (integers) are served, probabilities are not"
    if len({x.device.type for x in (h, W, t)}) > 1:
        return "h, weight and target are on different devices"
    if W.device.type not in ("cuda", "cpu"):
        return f"device {W.device.type}: kernels run on cuda, or on cpu through Triton's interpreter"
    try:
        transform(spelling, W.dtype, rounding)
    except Unsupported as e:
        return str(e)
    return None


def withheld_logits_op():
    """kernelgraft::withheld_logits: what the graph returns in place of logits the fused LM head
    never made (an empty tensor; optimize() turns it into an explicit error on use)."""
    return torch.ops.kernelgraft.withheld_logits.default


@torch.library.custom_op("kernelgraft::withheld_logits", mutates_args=())
def _withheld(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


@_withheld.register_fake
def _(like):
    return like.new_empty(0)


def _withheld_ctx(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


_withheld.register_autograd(lambda ctx, grad: None, setup_context=_withheld_ctx)
