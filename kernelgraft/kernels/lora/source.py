"""The LoRA kernels' Triton source, generated for the dtypes of x, the adapters and the base output
(kernel.py has the method and the launches): the rounding points of the spelling, and the tensor-core
products split so that they stay as exact as float32's (`precision`)."""

from __future__ import annotations

import functools
import re

import torch

from .. import emit
from ..cache import load_module
from ..launching import register_kernels

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
    # sum rounds coarser than float32, which loses dA's accuracy over long sums of rows
    hi, lo = _split(b)
    return acc + tl.dot(a, hi, tl.dot(a, lo, input_precision="tf32"), input_precision="tf32")


@triton.jit
def _dot_exact_b(a, b, acc):
    # acc + a @ b with b exact in TF32: a in two TF32 parts, two passes
    hi, lo = _split(a)
    return acc + tl.dot(hi, b, tl.dot(lo, b, input_precision="tf32"), input_precision="tf32")
"""


# du's sums over BN columns from c (both du kernels call `_du`): in float64, from g read as 32-bit
# words (`du_words`), two values each, the even and the odd columns. Triton refuses a float64
# tl.dot whose operand was loaded in 2-byte values (its MMA layout follows the loaded width); a
# word's halves are exact in float64, and times the scaling too (11 by 24 bits)
_DU_WORDS = """@triton.jit
def _du(g_ptr, gw_ptr, b_ptr, t, c, s, T, N, R, sg, sgw, sb, BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # du's sums (g @ B times s) over the BN columns from c, products and sums in float64
    r = tl.arange(0, BR)
    n = c + 2 * tl.arange(0, BN // 2)  # the even columns; the odd ones n + 1
    w = tl.load(gw_ptr + t[:, None] * sgw + n[None, :] // 2, mask=(t[:, None] < T) & (n[None, :] < N), other=0)
    be = tl.load(b_ptr + n[:, None] * sb + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
    bo = tl.load(b_ptr + (n[:, None] + 1) * sb + r[None, :], mask=(n[:, None] + 1 < N) & (r[None, :] < R), other=0.0)
    even = {half}(w).to(tl.float64) * s
    odd = {half}(w >> 16).to(tl.float64) * s
    return (tl.dot(even, be.to(tl.float64)) + tl.dot(odd, bo.to(tl.float64))).to({long_t})"""

# ... or from g's 2-byte tiles, a tensor-core product each `cols` columns, each from zero
_DU_TILES = """@triton.jit
def _du(g_ptr, gw_ptr, b_ptr, t, c, s, T, N, R, sg, sgw, sb, BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # du's sums (gv @ B) over the BN columns from c: one product per {cols} columns, each from
    # zero, the products added in {long_t}
    r = tl.arange(0, BR)
    du = tl.full((BT, BR), 0.0, {long_t})
    for q in tl.static_range(0, BN, {cols}):
        n = c + q + tl.arange(0, {cols})
        bt = tl.load(b_ptr + n[:, None] * sb + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
        du = {du_dot}
    return du{scale}"""

# the low half of a 32-bit word of two 2-byte values, in float32
_HALF = {
    torch.bfloat16: "_half_bf16",
    torch.float16: "_half_f16",
}
_HALVES = """

@triton.jit
def _half_bf16(w):
    return (w << 16).to(tl.float32, bitcast=True)


@triton.jit
def _half_f16(w):
    return (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
"""


def du_words(xd: torch.dtype, ad: torch.dtype, od: torch.dtype, du_products: str | None = None) -> bool:
    """du's kernels read the output's gradient as 32-bit words (the float64 products, DU_PRODUCTS):
    a gradient exact in TF32 (bf16/fp16) with float32 adapters, x not float32 (`sums_in_float64`)."""
    float64 = (du_products or DU_PRODUCTS) == "float64"
    return float64 and ad == torch.float32 and _exact_in_tf32(od) and xd != torch.float32


def _exact_in_tf32(dtype: torch.dtype) -> bool:
    """A value of `dtype` is exact in one TF32 pass (8 or 11 significant bits of TF32's 11, fp16's
    exponents inside TF32's range)."""
    return dtype in (torch.bfloat16, torch.float16)


# The type of the sums over a long width (down over x's, du over the output's): the tensor-core
# products of one block, each from zero, added across the blocks in float64 and rounded once. Added
# in float32, a wide sum of many blocks in sequence left u well past eager's error (cuBLAS splits
# such a sum). "float32": the benchmarks' comparison.
LONG_SUMS = "float64"


# du = gv @ B sums over the output's width, and where that sum cancels dA, which sums du's rows,
# inherits its error. With the output's gradient exact in TF32 (bf16/fp16, float32 adapters) and B
# in two TF32 parts:
#   - a product of many columns leaves dA past the rule's bound on constant rows of a wide output
#     (a tensor core adding a product's terms rounds coarser than float32); products of 16
#     columns, each from zero, added in float32, stay within it;
#   - the column groups' partial sums can be a large part of du, and each one's float32 rounding
#     adds up to several ulps of du: they are stored in float64 (kernel.py `_grad_ub`).
# "tf32x2": those two passes, DU_COLUMNS columns a product (within the rule's bounds);
# "float64": the products and sums in float64 from g's 32-bit words (`_DU_WORDS`), du within half
# a float32 ulp, at the cost of a much longer LoRA backward
DU_PRODUCTS = "tf32x2"
DU_COLUMNS = 16  # tl.dot's least; 0: one product per block of columns
# the defaults, whose kernels keep the module's plain name (kernel_name)
_DU_TABLE = (DU_COLUMNS, DU_PRODUCTS)


def sums_in_float64(xd: torch.dtype, ad: torch.dtype) -> bool:
    """x and the adapters both float32: no factor of the long products is exact in TF32, and
    tf32x3's three passes leave each product up to 2^-22 of itself off (4 float32 ulps), summed by a
    tensor core that rounds coarser than float32, where eager's cuBLAS takes float32 products on the
    CUDA cores: a wide x @ A^T lands well past eager's error. Here the products are
    taken in float64 (exact for float32 factors) and summed in float64, the splits' sums too, and
    rounded once to float32: within half a float32 ulp of the true sum, as eager is within a few."""
    return xd == torch.float32 and ad == torch.float32


def kernel_source(
    name: str,
    xd: torch.dtype,
    ad: torch.dtype,
    od: torch.dtype,
    precision: str = "tf32x3",
    long_sums: str = "float64",
    du_columns: int = DU_COLUMNS,
    du_products: str = DU_PRODUCTS,
) -> str:
    pd = torch.promote_types(od, ad)
    head = emit.HEADER.format(
        qual="lora", dtypes=f"x: {xd}, adapters: {ad}", kinds="rows of x, rank columns", out=str(od)
    )
    rounders = _rounder("_r_a", ad) + _rounder("_r_p", pd) + _rounder("_r_o", od) + _rounder("_r_x", xd)
    wide = sums_in_float64(xd, ad)
    split = precision == "tf32x3" and not wide
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
        return f"acc + {prod(a, b)}"

    def prod(a: str, b: str) -> str:
        """a @ b from zero: in float64 (`wide`), else on the tensor cores at `precision`."""
        if wide:
            return f"tl.dot({a}.to(tl.float64), {b}.to(tl.float64))"
        return f'tl.dot({a}, {b}, input_precision="{precision}")'

    acc_t = "tl.float64" if wide else "tl.float32"  # the sums' type, and their splits' (part buffers)
    long_t = "tl.float64" if wide or long_sums == "float64" else "tl.float32"  # down's and du's
    f32 = ".to(tl.float32)" if wide else ""  # a sum rounded to float32 (R_a then keeps it)

    xt_f = "_r_a(xt.to(tl.float32))"
    down_dot = dot(xt_f, "at.to(tl.float32)", "a" if x_exact else None)
    grad_a_dot = dot("tl.trans(dut.to(tl.float32))", xt_f, "b" if x_exact else None)
    gu = "_g(g_ptr, t, n, T, N, sg)" if g_exact else "_gv(g_ptr, t, n, T, N, sg, s)"
    grad_b_dot = dot(f"tl.trans({gu})", "ut.to(tl.float32)", "a" if g_exact else None)
    # du's products over one block of columns, DU_COLUMNS at a time (the helper `_du`, which both
    # du kernels call), each from zero and added in the long sums' type (DU_PRODUCTS)
    words = du_words(xd, ad, od, du_products)
    if words:
        du_fn = _DU_WORDS.format(half=_HALF[od], long_t=long_t)
    else:
        du_dot = dot(gu, "bt", "a" if g_exact else None).replace("acc", "du")
        du_fn = _DU_TILES.format(
            cols=du_columns or "BN", long_t=long_t, du_dot=du_dot, scale=" * s" if g_exact else ""
        )
    # the fused du and dB: g's tile loaded once for dB's product (du's narrower products load
    # theirs again, from the cache)
    ub_b_dot = dot("tl.trans(gt)", "ut.to(tl.float32)", "a" if g_exact else None)
    # the scaling left out of the products above, applied to their sums
    scaled = "\n    acc = acc * s" if g_exact else ""
    grad_ub = "\n\n".join(
        _grad_ub_source(name, m, gu, ub_b_dot, scaled, acc_t) for m in UB_BLOCKS
    )
    return (
        head
        + rounders
        + (_SPLIT if x_exact or g_exact else "")
        + (_HALVES if words else "")
        + f'''

@triton.jit
def {name}_down(x_ptr, a_ptr, u_ptr, T, K, R, sx, sa, su, cols,
                BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, SPLIT: tl.constexpr):
    # u[t, :] = R_a(x[t, :] @ A^T): x read once, in its dtype; each block's products summed in
    # float32 (float64: sums_in_float64), the blocks' sums in {long_t[3:]}; SPLIT: over one split
    # of x's width (`cols` columns), its sums stored at u_ptr as part[split, t, r], added and
    # rounded afterwards
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    r = tl.arange(0, BR)
    lo = tl.program_id(1) * cols
    acc = tl.full((BT, BR), 0.0, {long_t})
    for k0 in range(lo, lo + cols, BK):
        k = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + t[:, None] * sx + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K), other=0.0)
        at = tl.load(a_ptr + r[None, :] * sa + k[:, None], mask=(r[None, :] < R) & (k[:, None] < K), other=0.0)
        acc = {down_dot}
    m = (t[:, None] < T) & (r[None, :] < R)
    if SPLIT:
        tl.store(u_ptr + tl.program_id(1) * T * R + t[:, None] * R + r[None, :], acc, mask=m)
    else:
        tl.store(u_ptr + t[:, None] * su + r[None, :], _r_a(acc.to(tl.float32)), mask=m)


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
    v = _r_a({prod("ut.to(tl.float32)", "bt.to(tl.float32)")}{f32})
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


{du_fn}


@triton.jit
def {name}_grad_u(g_ptr, gw_ptr, b_ptr, du_ptr, s, T, N, R, sg, sgw, sb, sdu, cols,
                  BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, SPLIT: tl.constexpr):
    # du = R_a(gv @ B), summed over the output width; SPLIT: over one split of it (`cols` columns),
    # its sums stored at du_ptr as part[split, t, r] ({long_t[3:]}), added and rounded afterwards
    s = tl.full([], s, tl.float32)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    r = tl.arange(0, BR)
    lo = tl.program_id(1) * cols
    acc = tl.full((BT, BR), 0.0, {long_t})
    for n0 in range(lo, lo + cols, BN):
        acc = acc + _du(g_ptr, gw_ptr, b_ptr, t, n0, s, T, N, R, sg, sgw, sb, BT, BN, BR)
    m = (t[:, None] < T) & (r[None, :] < R)
    if SPLIT:
        tl.store(du_ptr + tl.program_id(1) * T * R + t[:, None] * R + r[None, :], acc, mask=m)
    else:
        tl.store(du_ptr + t[:, None] * sdu + r[None, :], _r_a(acc.to(tl.float32)), mask=m)


@triton.jit
def {name}_grad_b(g_ptr, u_ptr, part_ptr, s, T, N, R, sg, su, rows,
                  BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # dB's sums of gv^T @ u over one split of the rows: part[split, n, r]
    s = tl.full([], s, tl.float32)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    r = tl.arange(0, BR)
    lo = tl.program_id(1) * rows
    acc = tl.full((BN, BR), 0.0, {acc_t})
    for t0 in range(lo, lo + rows, BT):
        t = t0 + tl.arange(0, BT)
        ut = tl.load(u_ptr + t[:, None] * su + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)
        acc = {grad_b_dot}{scaled}
    out = part_ptr + tl.program_id(1) * N * R + n[:, None] * R + r[None, :]
    tl.store(out, acc, mask=(n[:, None] < N) & (r[None, :] < R))


{grad_ub}

@triton.jit
def {name}_grad_a(du_ptr, x_ptr, part_ptr, T, K, R, sdu, sx, rows,
                  BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    # dA's sums of du^T @ R_a(x) over one split of the rows: part[split, r, k]
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    r = tl.arange(0, BR)
    lo = tl.program_id(1) * rows
    acc = tl.full((BR, BK), 0.0, {acc_t})
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
    dx = _r_x(_r_a({prod("dut.to(tl.float32)", "at.to(tl.float32)")}{f32}))
    tl.store(dx_ptr + t[:, None] * sdx + k[None, :], dx, mask=(t[:, None] < T) & (k[None, :] < K))
'''
    )


UB_BLOCKS = (1, 2, 4)  # the grad_ub variants: column blocks per program (kernel.py picks one)


def _grad_ub_source(name: str, M: int, gu, ub_b_dot, scaled, acc_t) -> str:
    """The kernel making du and dB from one read of the output's gradient, a program taking M column
    blocks of BN over one split of the rows (`{name}_grad_ub`, and `_grad_ubM` for M > 1). du's
    sums over the program's M x BN columns, per row (`_du`'s, block by block): dupart[program's
    column group, t, r] (added over the groups afterwards, as du's split sums are; M blocks a
    program write 1/M of the partial sums of one block a program). dB's sums over the split's
    rows: dbpart[split, n, r], one accumulator per column block. The code of one block (the
    names gt, acc, n in the product above) is repeated with the block's index."""

    def nth(code: str, j: int) -> str:
        return re.sub(r"\b(gt|acc|n)\b", lambda m: f"{m.group(1)}{j}", code)

    kname = f"{name}_grad_ub" + ("" if M == 1 else str(M))
    lines = [
        "@triton.jit",
        f"def {kname}(g_ptr, gw_ptr, b_ptr, u_ptr, dupart_ptr, dbpart_ptr, s, T, N, R, sg, sgw, sb, su, rows,",
        "             BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):",
        f"    # du and dB from one read of the output's gradient, {M} column block(s) of BN a program",
        "    s = tl.full([], s, tl.float32)",
        "    r = tl.arange(0, BR)",
    ]
    for j in range(M):
        lines += [
            f"    c{j} = (tl.program_id(0) * {M} + {j}) * BN",
            f"    n{j} = c{j} + tl.arange(0, BN)",
            f"    acc{j} = tl.full((BN, BR), 0.0, {acc_t})",
        ]
    lines += [
        "    lo = tl.program_id(1) * rows",
        "    for t0 in range(lo, lo + rows, BT):",
        "        t = t0 + tl.arange(0, BT)",
        "        ut = tl.load(u_ptr + t[:, None] * su + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)",
    ]
    for j in range(M):
        du = f"_du(g_ptr, gw_ptr, b_ptr, t, c{j}, s, T, N, R, sg, sgw, sb, BT, BN, BR)"
        lines += [
            f"        gt{j} = {nth(gu, j)}",
            f"        acc{j} = {nth(ub_b_dot, j)}",
            f"        du = {du}" if j == 0 else f"        du = du + {du}",
        ]
    lines += [
        "        m = (t[:, None] < T) & (r[None, :] < R)",
        "        tl.store(dupart_ptr + tl.program_id(0) * T * R + t[:, None] * R + r[None, :], du, mask=m)",
    ]
    for j in range(M):
        if scaled:
            lines.append(nth(scaled, j).lstrip("\n"))
        lines.append(
            f"    tl.store(dbpart_ptr + tl.program_id(1) * N * R + n{j}[:, None] * R + r[None, :], acc{j}, "
            f"mask=(n{j}[:, None] < N) & (r[None, :] < R))"
        )
    return "\n".join(lines)


def kernel_name(xd: torch.dtype, ad: torch.dtype, od: torch.dtype, long_sums: str | None = None, du=None) -> str:
    """The kernels' module name; `du`: (DU_COLUMNS, DU_PRODUCTS) where not the table's."""
    long_sums = long_sums or LONG_SUMS
    du = du or (DU_COLUMNS, DU_PRODUCTS)
    tail = "" if long_sums == "float64" else f"__{long_sums}_sums"
    tail += "" if du == _DU_TABLE else f"__du{du[0]}_{du[1]}"
    return f"lora__{str(xd)[6:]}__{str(ad)[6:]}__{str(od)[6:]}{tail}"


def kernels(xd: torch.dtype, ad: torch.dtype, od: torch.dtype, device_type: str):
    """The module of LoRA kernels for x of dtype xd, adapters of dtype ad and a base output of dtype
    od (the interpreter's on the CPU)."""
    return _kernels(xd, ad, od, device_type, LONG_SUMS, (DU_COLUMNS, DU_PRODUCTS))


@functools.cache
def _kernels(xd: torch.dtype, ad: torch.dtype, od: torch.dtype, device_type: str, long_sums: str, du: tuple):
    name = kernel_name(xd, ad, od, long_sums, du)
    source = kernel_source(name, xd, ad, od, precision(ad), long_sums, *du)
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
