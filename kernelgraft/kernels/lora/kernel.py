"""LoRA, fused: the adapter path of `(result + lora_B(lora_A(x.to(A.dtype))) * scaling).to(result.dtype)`,
result being the base layer's output (the base layer stays a plain linear: cuBLAS, and its own
node in the autograd graph, so x's gradient is summed in the order and with the roundings of the
unfused model).

peft keeps the adapters in float32 and casts x to float32 for them: a float32 copy of x per adapted
layer, float32 matmuls, and float32 intermediates of the layer's full output width, each one more
pass over memory. Here, for T rows of x (width K), rank r, output width N:

    u    = R_a(x @ A^T)                              down: x read once in its own dtype, float32 sums
    out  = R_o(R_p(result + R_a(R_a(u @ B^T) * s)))  up: one pass over the base output

and in the backward, for the output's gradient g (gv = R_a(R_a(R_p(g)) * s)):

    d result = g      du = R_a(gv @ B)      dB = R_a(gv^T @ u)      dA = R_a(du^T @ R_a(x))
    dx = R_x(R_a(du @ A))

R_a, R_p, R_o and R_x round to the adapters' dtype, to the promoted dtype of the result's and the
adapters', to the result's dtype and to x's: every rounding point the spelling has (float32 adapters: R_a and R_p keep float32; bf16
adapters: every matmul and product rounds, as the unfused model's). The products are summed in
float32 whatever the dtype of x, so x is never copied to float32; on the GPU they run on the tensor
cores, split so that they stay exact (`precision`). dA and dB sum over all rows: the rows are split
across programs and the splits' float32 sums added afterwards, so the GPU is filled.
The matmuls' adjoints are the rules of a product of matrices: d(P Q) = dP Q + P dQ.
"""

from __future__ import annotations

import functools

import torch

from .. import emit
from ..cache import load_module
from ..launching import NotTraceable, cdiv, launch_options, launcher, pow2, register_kernels, tracing
from ..rows import tuning as row_tuning

MAX_RANK = 256  # a rank block of at most 256 columns (one tile: the sums over r stay in registers)

_ROUND = {
    torch.float32: "x",
    torch.bfloat16: "_round_bf16(x)",
    torch.float16: "x.to(tl.float16).to(tl.float32)",
}


def _rounder(name: str, dtype: torch.dtype) -> str:
    return f"""

@triton.jit
def {name}(x):
    return {_ROUND[dtype]}
"""


_SPLIT = """

@triton.jit
def _tf32(v):
    # v rounded to the nearest TF32 value (10 mantissa bits, ties away from zero, as cvt.rna):
    # exact in one TF32 pass; inf and NaN as they are
    bits = v.to(tl.int32, bitcast=True)
    near = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x7F800000) == 0x7F800000, v, near)


@triton.jit
def _split(v):
    # (hi, lo), both exact in TF32: hi + lo is v to 2^-22 of it (lo rounded to TF32, as tf32x3's)
    hi = _tf32(v)
    return hi, tl.where(hi == v, 0.0, _tf32(v - hi))


@triton.jit
def _dot_exact_a(a, b, acc):
    # acc + a @ b with a exact in TF32 (values of a 2-byte dtype): b in two TF32 parts, two passes
    # (tf32x3's third, a's low part times b's high part, is zero here). The passes start from zero
    # and their sum is added to acc in float32, as tf32x3's are: a tensor core adding into a running
    # sum rounds coarser than float32 (on an H200 it made dA 20x less accurate over 4096 rows)
    hi, lo = _split(b)
    return acc + tl.dot(a, hi, tl.dot(a, lo, input_precision="tf32"), input_precision="tf32")


@triton.jit
def _dot_exact_b(a, b, acc):
    # acc + a @ b with b exact in TF32: a in two TF32 parts, two passes
    hi, lo = _split(a)
    return acc + tl.dot(hi, b, tl.dot(lo, b, input_precision="tf32"), input_precision="tf32")
"""


def _exact_in_tf32(dtype: torch.dtype) -> bool:
    """A value of `dtype` is exact in one TF32 pass (8 or 11 significant bits of TF32's 11, fp16's
    exponents inside TF32's range)."""
    return dtype in (torch.bfloat16, torch.float16)


def kernel_source(
    name: str, xd: torch.dtype, ad: torch.dtype, od: torch.dtype, precision: str = "tf32x3"
) -> str:
    pd = torch.promote_types(od, ad)
    head = emit.HEADER.format(
        qual="lora", dtypes=f"x: {xd}, adapters: {ad}", kinds="rows of x, rank columns", out=str(od)
    )
    rounders = _rounder("_r_a", ad) + _rounder("_r_p", pd) + _rounder("_r_o", od) + _rounder("_r_x", xd)
    split = precision == "tf32x3"
    # which products have one factor exact in TF32, and so take two passes instead of tf32x3's three:
    # x's values (down, grad_a) where R_a keeps them (float32 adapters); the output's gradient
    # (grad_u, grad_b) where R_p keeps it, the scaling then applied to the float32 sums (one
    # float32 rounding of the sum instead of one of each product's factor: no less accurate)
    x_exact = split and ad == torch.float32 and _exact_in_tf32(xd)
    g_exact = split and pd == torch.float32 and _exact_in_tf32(od)

    def dot(a: str, b: str, exact: str | None) -> str:
        """`acc` plus a @ b as the kernel multiplies: `exact` names a factor exact in TF32."""
        if exact is not None:
            return f"_dot_exact_{exact}({a}, {b}, acc)"
        return f'acc + tl.dot({a}, {b}, input_precision="{precision}")'

    xt_f = "_r_a(xt.to(tl.float32))"
    down_dot = dot(xt_f, "at.to(tl.float32)", "a" if x_exact else None)
    grad_a_dot = dot("tl.trans(dut.to(tl.float32))", xt_f, "b" if x_exact else None)
    gu = "_g(g_ptr, t, n, T, N, sg)" if g_exact else "_gv(g_ptr, t, n, T, N, sg, s)"
    grad_u_dot = dot(gu, "bt.to(tl.float32)", "a" if g_exact else None)
    grad_b_dot = dot(f"tl.trans({gu})", "ut.to(tl.float32)", "a" if g_exact else None)
    # the fused du and dB: g's tile loaded once for both products; B's tile is the program's own,
    # split once before the loop where g is exact; du's products of one tile start from zero
    ub_b_dot = dot("tl.trans(gt)", "ut.to(tl.float32)", "a" if g_exact else None)
    if g_exact:
        b_parts = "\n    bhi, blo = _split(bt)"
        ub_u_dot = 'tl.dot(gt, bhi, tl.dot(gt, blo, input_precision="tf32"), input_precision="tf32") * s'
    else:
        b_parts = ""
        ub_u_dot = f'tl.dot(gt, bt, input_precision="{precision}")'
    # the scaling left out of the products above, applied to their sums
    scaled = "\n    acc = acc * s" if g_exact else ""
    return (
        head
        + rounders
        + (_SPLIT if x_exact or g_exact else "")
        + f'''

@triton.jit
def {name}_down(x_ptr, a_ptr, u_ptr, T, K, R, sx, sa, su,
                BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    # u[t, :] = R_a(x[t, :] @ A^T): x read once, in its dtype, summed in float32
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    r = tl.arange(0, BR)
    acc = tl.full((BT, BR), 0.0, tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + t[:, None] * sx + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K), other=0.0)
        at = tl.load(a_ptr + r[None, :] * sa + k[:, None], mask=(r[None, :] < R) & (k[:, None] < K), other=0.0)
        acc = {down_dot}
    tl.store(u_ptr + t[:, None] * su + r[None, :], _r_a(acc), mask=(t[:, None] < T) & (r[None, :] < R))


@triton.jit
def {name}_up(o_ptr, base_ptr, u_ptr, b_ptr, s, T, N, R, so, sbase, su, sb,
              BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # o = R_o(R_p(base + R_a(R_a(u @ B^T) * s)))
    s = tl.full([], s, tl.float32)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    r = tl.arange(0, BR)
    ut = tl.load(u_ptr + t[:, None] * su + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)
    bt = tl.load(b_ptr + n[None, :] * sb + r[:, None], mask=(n[None, :] < N) & (r[:, None] < R), other=0.0)
    v = _r_a(tl.dot(ut.to(tl.float32), bt.to(tl.float32), input_precision="{precision}"))
    m = (t[:, None] < T) & (n[None, :] < N)
    base = tl.load(base_ptr + t[:, None] * sbase + n[None, :], mask=m, other=0.0).to(tl.float32)
    y = _r_o(_r_p(base + _r_a(v * s)))
    tl.store(o_ptr + t[:, None] * so + n[None, :], y, mask=m)


@triton.jit
def _g(g_ptr, t, n, T, N, sg):
    g = tl.load(g_ptr + t[:, None] * sg + n[None, :], mask=(t[:, None] < T) & (n[None, :] < N), other=0.0)
    return _r_a(_r_p(g.to(tl.float32)))


@triton.jit
def _gv(g_ptr, t, n, T, N, sg, s):
    return _r_a(_g(g_ptr, t, n, T, N, sg) * s)


@triton.jit
def {name}_grad_u(g_ptr, b_ptr, du_ptr, s, T, N, R, sg, sb, sdu, cols,
                  BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, SPLIT: tl.constexpr):
    # du = R_a(gv @ B), summed over the output width; SPLIT: over one split of it (`cols` columns),
    # its float32 sums stored at du_ptr as part[split, t, r], added and rounded afterwards
    s = tl.full([], s, tl.float32)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    r = tl.arange(0, BR)
    lo = tl.program_id(1) * cols
    acc = tl.full((BT, BR), 0.0, tl.float32)
    for n0 in range(lo, lo + cols, BN):
        n = n0 + tl.arange(0, BN)
        bt = tl.load(b_ptr + n[:, None] * sb + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
        acc = {grad_u_dot}{scaled}
    m = (t[:, None] < T) & (r[None, :] < R)
    if SPLIT:
        tl.store(du_ptr + tl.program_id(1) * T * R + t[:, None] * R + r[None, :], acc, mask=m)
    else:
        tl.store(du_ptr + t[:, None] * sdu + r[None, :], _r_a(acc), mask=m)


@triton.jit
def {name}_grad_b(g_ptr, u_ptr, part_ptr, s, T, N, R, sg, su, rows,
                  BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # dB's float32 sums of gv^T @ u over one split of the rows: part[split, n, r]
    s = tl.full([], s, tl.float32)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    r = tl.arange(0, BR)
    lo = tl.program_id(1) * rows
    acc = tl.full((BN, BR), 0.0, tl.float32)
    for t0 in range(lo, lo + rows, BT):
        t = t0 + tl.arange(0, BT)
        ut = tl.load(u_ptr + t[:, None] * su + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)
        acc = {grad_b_dot}{scaled}
    out = part_ptr + tl.program_id(1) * N * R + n[:, None] * R + r[None, :]
    tl.store(out, acc, mask=(n[:, None] < N) & (r[None, :] < R))


@triton.jit
def {name}_grad_ub(g_ptr, b_ptr, u_ptr, dupart_ptr, dbpart_ptr, s, T, N, R, sg, sb, su, rows,
                   BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # du and dB from one read of the output's gradient: a program takes BN columns of it over one
    # split of the rows. du's float32 sums over the program's columns, per row: dupart[column
    # block, t, r] (added over the blocks afterwards, as du's split sums are); dB's float32 sums
    # over the split's rows: dbpart[split, n, r]
    s = tl.full([], s, tl.float32)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    r = tl.arange(0, BR)
    bt = tl.load(b_ptr + n[:, None] * sb + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
    bt = bt.to(tl.float32){b_parts}
    lo = tl.program_id(1) * rows
    acc = tl.full((BN, BR), 0.0, tl.float32)
    for t0 in range(lo, lo + rows, BT):
        t = t0 + tl.arange(0, BT)
        gt = {gu}
        ut = tl.load(u_ptr + t[:, None] * su + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)
        acc = {ub_b_dot}
        du = {ub_u_dot}
        m = (t[:, None] < T) & (r[None, :] < R)
        tl.store(dupart_ptr + tl.program_id(0) * T * R + t[:, None] * R + r[None, :], du, mask=m){scaled}
    out = dbpart_ptr + tl.program_id(1) * N * R + n[:, None] * R + r[None, :]
    tl.store(out, acc, mask=(n[:, None] < N) & (r[None, :] < R))


@triton.jit
def {name}_grad_a(du_ptr, x_ptr, part_ptr, T, K, R, sdu, sx, rows,
                  BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    # dA's float32 sums of du^T @ R_a(x) over one split of the rows: part[split, r, k]
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    r = tl.arange(0, BR)
    lo = tl.program_id(1) * rows
    acc = tl.full((BR, BK), 0.0, tl.float32)
    for t0 in range(lo, lo + rows, BT):
        t = t0 + tl.arange(0, BT)
        dut = tl.load(du_ptr + t[:, None] * sdu + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)
        xt = tl.load(x_ptr + t[:, None] * sx + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K), other=0.0)
        acc = {grad_a_dot}
    out = part_ptr + tl.program_id(1) * R * K + r[:, None] * K + k[None, :]
    tl.store(out, acc, mask=(r[:, None] < R) & (k[None, :] < K))


@triton.jit
def {name}_grad_x(dx_ptr, du_ptr, a_ptr, T, K, R, sdx, sdu, sa,
                  BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    # dx = R_x(R_a(du @ A)): the cast's gradient, x's dtype
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    r = tl.arange(0, BR)
    dut = tl.load(du_ptr + t[:, None] * sdu + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)
    at = tl.load(a_ptr + r[:, None] * sa + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)
    dx = _r_x(_r_a(tl.dot(dut.to(tl.float32), at.to(tl.float32), input_precision="{precision}")))
    tl.store(dx_ptr + t[:, None] * sdx + k[None, :], dx, mask=(t[:, None] < T) & (k[None, :] < K))
'''
    )


def kernel_name(xd: torch.dtype, ad: torch.dtype, od: torch.dtype) -> str:
    return f"lora__{str(xd)[6:]}__{str(ad)[6:]}__{str(od)[6:]}"


@functools.cache
def kernels(xd: torch.dtype, ad: torch.dtype, od: torch.dtype, device_type: str):
    """The module of LoRA kernels for x of dtype xd, adapters of dtype ad and a base output of dtype
    od (the interpreter's on the CPU)."""
    name = kernel_name(xd, ad, od)
    source = kernel_source(name, xd, ad, od, precision(ad))
    mod, _ = load_module(name, source, interpret=device_type == "cpu")
    register_kernels(name)
    return mod, name


def precision(ad: torch.dtype) -> str:
    """How tl.dot multiplies on the GPU's tensor cores, exactly enough for the spelling's float32
    sums. Every factor of a product is a value of the adapters' dtype or of x's (R_a, R_x), or u /
    du / gv, rounded to the adapters' dtype. A bf16 or fp16 value is exact in TF32 (8 or 10
    mantissa bits of TF32's 10, fp16's exponent inside TF32's range): one TF32 pass multiplies
    exactly. A float32 value is split in a TF32 high part and a TF32 low part: three passes
    (hi*hi + hi*lo + lo*hi) leave out only lo*lo, 2^-22 below the product. Where one factor is
    exact in TF32 (x's values, or the output's gradient, in bf16/fp16 with float32 adapters) it
    has no low part, and the kernels split the other factor themselves: two passes, the same
    products (kernel_source). The sums are float32, as IEEE's. (The interpreter multiplies in
    float32: there the split leaves each product 2^-22 of it off, as on the GPU.)"""
    return "tf32x3" if ad == torch.float32 else "tf32"


# (rows, columns, warps) per kernel's tile on the GPU at ranks up to 16, each the fastest of rows
# 32/64/128 x columns 64/128 x 4/8 warps summed over a Llama-3.2-1B layer's four (width in, width
# out) pairs at 16384 rows, rank 16 (H200, 2026-12-01: 1.29x faster, summed over the four pairs, than 32 x 64 x 4).
# Larger ranks (not measured yet), and the interpreter, keep the smaller tile (the float32 sums of a
# rank-256 tile fill the registers).
GPU_TILES = {
    "down": (64, 64, 4),
    "up": (64, 128, 4),
    "grad_u": (64, 64, 4),
    "grad_b": (64, 128, 4),
    "grad_ub": (64, 64, 4),
    "grad_a": (64, 128, 4),
    "grad_x": (32, 128, 4),
}
SMALL_TILE = (32, 64, 4)
# Triton's software pipelining depth per kernel on the GPU (absent: Triton's default; the down
# projection's 4 stages 3 % faster than 3 on the H200, 2026-12-03, `tune_lora.py --parts tiles`)
GPU_STAGES: dict[str, int] = {"down": 4}
# programs per SM that a kernel summing over a long dim aims at, splitting that dim (its splits'
# float32 sums added afterwards in a fixed order): the weight gradients over the rows, du over the
# output width (0: not split, one program per row tile summing all of it). The H200, 2026-12-03
# (`tune_lora.py --parts fills`, summed over the four pairs): 8 programs per SM 11 % (grad_b) and
# 7 % (grad_a) faster than 2; du is fastest unsplit
GPU_FILL = {"grad_u": 0, "grad_b": 8, "grad_a": 8, "grad_ub": 8}
# du and dB from one read of the output's gradient (grad_ub) where the backward needs both; off:
# grad_u and grad_b, each reading it
FUSED_UB = True


def _blocks(R: int, kernel: str, device: torch.device) -> tuple[int, int, int, int]:
    """(rows, columns, rank, warps) of `kernel`'s tile: tl.dot needs each side at least 16."""
    BR = max(16, pow2(R))
    BT, BN, warps = GPU_TILES[kernel] if device.type == "cuda" and BR <= 16 else SMALL_TILE
    return BT, BN, BR, warps


def _splits(T: int, blocks: int, BT: int, device: torch.device, fill: int | None = None) -> tuple[int, int]:
    """(splits, elements per split) of the T elements (rows, or columns for du) a sum runs over, in
    tiles of BT: enough programs (`blocks` other tiles x splits) to fill the GPU `fill` times
    (GPU_FILL's weight gradients' by default; 0: one split), each split at least 4 tiles. The
    splits' float32 sums are added in a fixed order afterwards (deterministic). On the CPU two
    splits, so the interpreter runs the same two-stage sum."""
    tiles = cdiv(max(T, 1), BT)
    fill = GPU_FILL["grad_b"] if fill is None else fill
    if device.type == "cuda":
        want = cdiv(fill * row_tuning.sm_count(device.index), blocks)
    else:
        want = 2
    n = max(1, min(want, tiles // 4 if device.type == "cuda" else tiles))
    rows = cdiv(tiles, n) * BT
    return cdiv(max(T, 1), rows), rows


def _options(A: torch.Tensor, *ts: torch.Tensor) -> dict:
    """Triton's options for the launches. With float32 adapters no product or sum of the
    element-wise parts rounds to a 2-byte dtype before the last cast (R_a and R_p keep float32), so
    contracting `base + v * s` into one FMA only drops a float32 rounding: Triton's default, which
    is also all that inductor's launches can take. With 2-byte adapters every product rounds as
    eager's: no FMA contraction (launching.launch_options), and the launch stays a host launch
    under inductor (NotTraceable)."""
    if tracing() and A.dtype != torch.float32:
        raise NotTraceable(
            "adapters in a 2-byte dtype need Triton's FMA contraction off to round as eager does, "
            "which a launch by inductor's code cannot set"
        )
    if A.dtype == torch.float32:
        return {}
    return launch_options("autograd", [t.dtype for t in (A, *ts)], A.device.type)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as rows of its last dim, unit stride along them."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _Launches:
    """The LoRA kernels of one call: each launched with its tile (_blocks) and the call's options."""

    def __init__(self, x, A, od: torch.dtype, *ts: torch.Tensor):
        self.mod, self.name = kernels(x.dtype, A.dtype, od, x.device.type)
        self.R, self.dev, self.opts = A.shape[0], x.device, _options(A, x, *ts)

    def tile(self, kernel: str) -> tuple[int, int]:
        BT, BC, _, _ = _blocks(self.R, kernel, self.dev)
        return BT, BC

    def __call__(self, kernel: str, grid, *args, cols: str = "BN", **consts) -> None:
        """`kernel` on `args`; grid(rows per tile, columns per tile) -> its grid; cols: the name of
        its column block; consts: its other compile-time arguments."""
        BT, BC, BR, warps = _blocks(self.R, kernel, self.dev)
        stages = GPU_STAGES.get(kernel) if self.dev.type == "cuda" else None
        opts = dict(self.opts, **({} if stages is None else {"num_stages": stages}))
        launcher(getattr(self.mod, f"{self.name}_{kernel}"))[grid(BT, BC)](
            *args, BT=BT, BR=BR, num_warps=warps, **{cols: BC}, **consts, **opts
        )

    def summed(self, kernel: str, shape: tuple, dtype: torch.dtype, T: int, blocks, args, cols: str = "BN"):
        """A weight gradient summed over T rows: each split's float32 sums from `kernel` (blocks:
        columns per tile -> column blocks; args(part, rows per split) -> its arguments), then added
        and rounded once to `dtype` (R_a)."""
        if not T:
            return torch.zeros(shape, dtype=dtype, device=self.dev)
        BT, BC = self.tile(kernel)
        n, rows = _splits(T, blocks(BC), BT, self.dev, GPU_FILL[kernel])
        part = torch.empty((n, *shape), dtype=torch.float32, device=self.dev)
        self(kernel, lambda bt, bc: (blocks(bc), n), *args(part, rows), cols=cols)
        total = part.squeeze(0) if n == 1 else part.sum(0)
        return total.to(dtype)


def forward(x, result, A, B, scaling: float):
    """-> (out, u): the layer's output (result's dtype and shape) and u = x A^T (rows x rank, the
    adapters' dtype), which the backward reads."""
    launch = _Launches(x, A, result.dtype, result)
    x2, base = _rows(x), _rows(result)
    T, K, R, N = x2.shape[0], x2.shape[1], A.shape[0], base.shape[1]
    Ac, Bc = A.contiguous(), B.contiguous()
    out = torch.empty((T, N), dtype=result.dtype, device=x.device)
    u = torch.empty((T, R), dtype=A.dtype, device=x.device)
    if T:
        launch(
            "down", lambda bt, bc: (cdiv(T, bt),),
            x2, Ac, u, T, K, R, x2.stride(0), Ac.stride(0), u.stride(0), cols="BK",
        )  # fmt: skip
        launch(
            "up", lambda bt, bc: (cdiv(T, bt), cdiv(N, bc)),
            out, base, u, Bc, float(scaling), T, N, R, out.stride(0), base.stride(0), u.stride(0), Bc.stride(0),
        )  # fmt: skip
    return out.view(result.shape), u


def _grad_u(launch: _Launches, g2, Bc, s: float, T: int, N: int, R: int, dtype: torch.dtype) -> torch.Tensor:
    """du = R_a(gv @ B) (T x R, the adapters' dtype): one program per row tile summing the whole
    output width, or, split (GPU_FILL), each split's float32 sums added in a fixed order and then
    rounded once."""
    BT, BN = launch.tile("grad_u")
    fill = GPU_FILL["grad_u"]
    n, cols = _splits(N, cdiv(T, BT), BN, launch.dev, fill) if fill or launch.dev.type != "cuda" else (1, N)
    if n == 1:
        du = torch.empty((T, R), dtype=dtype, device=launch.dev)
        launch(
            "grad_u", lambda bt, bc: (cdiv(T, bt), 1),
            g2, Bc, du, s, T, N, R, g2.stride(0), Bc.stride(0), du.stride(0), max(N, 1), SPLIT=False,
        )  # fmt: skip
        return du
    part = torch.empty((n, T, R), dtype=torch.float32, device=launch.dev)
    launch(
        "grad_u", lambda bt, bc: (cdiv(T, bt), n),
        g2, Bc, part, s, T, N, R, g2.stride(0), Bc.stride(0), R, cols, SPLIT=True,
    )  # fmt: skip
    return part.sum(0).to(dtype)


def _grad_ub(launch: _Launches, g2, Bc, u, s: float, T: int, N: int, R: int, ad: torch.dtype):
    """(du, dB) from one read of g (T, N > 0): du's float32 sums per column block and dB's per
    split of the rows, each added in a fixed order and rounded once, as the unfused kernels' split
    sums are (the same products; du's sums are split by column blocks instead of unsplit)."""
    BT, BN = launch.tile("grad_ub")
    C = cdiv(N, BN)
    n, rows = _splits(T, C, BT, launch.dev, GPU_FILL["grad_ub"])
    dupart = torch.empty((C, T, R), dtype=torch.float32, device=launch.dev)
    dbpart = torch.empty((n, N, R), dtype=torch.float32, device=launch.dev)
    launch(
        "grad_ub", lambda bt, bc: (C, n),
        g2, Bc, u, dupart, dbpart, s, T, N, R, g2.stride(0), Bc.stride(0), u.stride(0), rows,
    )  # fmt: skip
    du = dupart.squeeze(0) if C == 1 else dupart.sum(0)
    dB = dbpart.squeeze(0) if n == 1 else dbpart.sum(0)
    return du.to(ad), dB.to(ad)


def backward(g, x, A, B, u, scaling: float, needs: tuple[bool, bool, bool]):
    """-> (dx, dA, dB) for the output's gradient g; None where `needs` (x, A, B) says no. The base
    output's gradient is g itself."""
    need_x, need_a, need_b = needs
    launch = _Launches(x, A, g.dtype, g)
    x2, g2 = _rows(x), _rows(g)
    T, K, R, N = x2.shape[0], x2.shape[1], A.shape[0], g2.shape[1]
    Ac, Bc = A.contiguous(), B.contiguous()
    s = float(scaling)
    dev = x.device
    dx = dA = dB = du = None
    if FUSED_UB and need_b and (need_x or need_a) and T and N:
        du, dB = _grad_ub(launch, g2, Bc, u, s, T, N, R, A.dtype)
    elif (need_x or need_a) and T:
        du = _grad_u(launch, g2, Bc, s, T, N, R, A.dtype)
    if need_b and dB is None:
        dB = launch.summed(
            "grad_b", (N, R), B.dtype, T, lambda bc: cdiv(N, bc),
            lambda part, rows: (g2, u, part, s, T, N, R, g2.stride(0), u.stride(0), rows),
        )  # fmt: skip
    if need_a:
        dA = launch.summed(
            "grad_a", (R, K), A.dtype, T, lambda bc: cdiv(K, bc),
            lambda part, rows: (du, x2, part, T, K, R, du.stride(0), x2.stride(0), rows), cols="BK",
        )  # fmt: skip
    if need_x:
        dx = torch.empty((T, K), dtype=x.dtype, device=dev)
        if T:
            launch(
                "grad_x", lambda bt, bc: (cdiv(T, bt), cdiv(K, bc)),
                dx, du, Ac, T, K, R, dx.stride(0), du.stride(0), Ac.stride(0), cols="BK",
            )  # fmt: skip
        dx = dx.view(x.shape)
    return dx, dA, dB
