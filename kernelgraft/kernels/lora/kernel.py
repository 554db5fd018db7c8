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
float32 (`tl.dot`, IEEE float32: no TF32) whatever the dtype of x, so x is never copied to float32.
The matmuls' adjoints are the rules of a product of matrices: d(P Q) = dP Q + P dQ.
"""

from __future__ import annotations

import functools

import torch

from .. import emit
from ..cache import load_module
from ..launching import cdiv, launch_options, pow2, register_kernels

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


def kernel_source(name: str, xd: torch.dtype, ad: torch.dtype, od: torch.dtype) -> str:
    pd = torch.promote_types(od, ad)
    head = emit.HEADER.format(
        qual="lora", dtypes=f"x: {xd}, adapters: {ad}", kinds="rows of x, rank columns", out=str(od)
    )
    rounders = _rounder("_r_a", ad) + _rounder("_r_p", pd) + _rounder("_r_o", od) + _rounder("_r_x", xd)
    return (
        head
        + rounders
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
        acc += tl.dot(_r_a(xt.to(tl.float32)), at.to(tl.float32), input_precision="ieee")
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
    v = _r_a(tl.dot(ut.to(tl.float32), bt.to(tl.float32), input_precision="ieee"))
    m = (t[:, None] < T) & (n[None, :] < N)
    base = tl.load(base_ptr + t[:, None] * sbase + n[None, :], mask=m, other=0.0).to(tl.float32)
    y = _r_o(_r_p(base + _r_a(v * s)))
    tl.store(o_ptr + t[:, None] * so + n[None, :], y, mask=m)


@triton.jit
def _gv(g_ptr, t, n, T, N, sg, s):
    g = tl.load(g_ptr + t[:, None] * sg + n[None, :], mask=(t[:, None] < T) & (n[None, :] < N), other=0.0)
    return _r_a(_r_a(_r_p(g.to(tl.float32))) * s)


@triton.jit
def {name}_grad_u(g_ptr, b_ptr, du_ptr, s, T, N, R, sg, sb, sdu,
                  BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # du = R_a(gv @ B), summed over the output width
    s = tl.full([], s, tl.float32)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    r = tl.arange(0, BR)
    acc = tl.full((BT, BR), 0.0, tl.float32)
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        bt = tl.load(b_ptr + n[:, None] * sb + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
        acc += tl.dot(_gv(g_ptr, t, n, T, N, sg, s), bt.to(tl.float32), input_precision="ieee")
    tl.store(du_ptr + t[:, None] * sdu + r[None, :], _r_a(acc), mask=(t[:, None] < T) & (r[None, :] < R))


@triton.jit
def {name}_grad_b(g_ptr, u_ptr, db_ptr, s, T, N, R, sg, su, sdb,
                  BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # dB = R_a(gv^T @ u), summed over the rows
    s = tl.full([], s, tl.float32)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    r = tl.arange(0, BR)
    acc = tl.full((BN, BR), 0.0, tl.float32)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        ut = tl.load(u_ptr + t[:, None] * su + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)
        acc += tl.dot(tl.trans(_gv(g_ptr, t, n, T, N, sg, s)), ut.to(tl.float32), input_precision="ieee")
    tl.store(db_ptr + n[:, None] * sdb + r[None, :], _r_a(acc), mask=(n[:, None] < N) & (r[None, :] < R))


@triton.jit
def {name}_grad_a(du_ptr, x_ptr, da_ptr, T, K, R, sdu, sx, sda,
                  BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    # dA = R_a(du^T @ R_a(x)), summed over the rows
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    r = tl.arange(0, BR)
    acc = tl.full((BR, BK), 0.0, tl.float32)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        dut = tl.load(du_ptr + t[:, None] * sdu + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)
        xt = tl.load(x_ptr + t[:, None] * sx + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K), other=0.0)
        acc += tl.dot(tl.trans(dut.to(tl.float32)), _r_a(xt.to(tl.float32)), input_precision="ieee")
    tl.store(da_ptr + r[:, None] * sda + k[None, :], _r_a(acc), mask=(r[:, None] < R) & (k[None, :] < K))


@triton.jit
def {name}_grad_x(dx_ptr, du_ptr, a_ptr, T, K, R, sdx, sdu, sa,
                  BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    # dx = R_x(R_a(du @ A)): the cast's gradient, x's dtype
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    r = tl.arange(0, BR)
    dut = tl.load(du_ptr + t[:, None] * sdu + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)
    at = tl.load(a_ptr + r[:, None] * sa + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)
    dx = _r_x(_r_a(tl.dot(dut.to(tl.float32), at.to(tl.float32), input_precision="ieee")))
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
    mod, _ = load_module(name, kernel_source(name, xd, ad, od), interpret=device_type == "cpu")
    register_kernels(name)
    return mod, name


def _blocks(R: int) -> tuple[int, int, int]:
    """(rows, columns, rank) per tile: tl.dot needs each at least 16."""
    return 32, 64, max(16, pow2(R))


def _options(*ts: torch.Tensor) -> dict:
    """No FMA contraction where a 2-byte dtype rounds (the products and sums round as eager's)."""
    return launch_options("autograd", [t.dtype for t in ts], ts[0].device.type)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as rows of its last dim, unit stride along them."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def forward(x, result, A, B, scaling: float):
    """-> (out, u): the layer's output (result's dtype and shape) and u = x A^T (rows x rank, the
    adapters' dtype), which the backward reads."""
    mod, name = kernels(x.dtype, A.dtype, result.dtype, x.device.type)
    x2, base = _rows(x), _rows(result)
    T, K, R, N = x2.shape[0], x2.shape[1], A.shape[0], base.shape[1]
    Ac, Bc = A.contiguous(), B.contiguous()
    out = torch.empty((T, N), dtype=result.dtype, device=x.device)
    u = torch.empty((T, R), dtype=A.dtype, device=x.device)
    BT, BN, BR = _blocks(R)
    opts = _options(x, A, result)
    if T:
        getattr(mod, f"{name}_down")[(cdiv(T, BT),)](
            x2, Ac, u, T, K, R, x2.stride(0), Ac.stride(0), u.stride(0), BT=BT, BK=BN, BR=BR, **opts
        )
        getattr(mod, f"{name}_up")[(cdiv(T, BT), cdiv(N, BN))](
            out, base, u, Bc, float(scaling), T, N, R, out.stride(0), base.stride(0), u.stride(0), Bc.stride(0),
            BT=BT, BN=BN, BR=BR, **opts,
        )  # fmt: skip
    return out.view(result.shape), u


def backward(g, x, A, B, u, scaling: float, needs: tuple[bool, bool, bool]):
    """-> (dx, dA, dB) for the output's gradient g; None where `needs` (x, A, B) says no. The base
    output's gradient is g itself."""
    need_x, need_a, need_b = needs
    mod, name = kernels(x.dtype, A.dtype, g.dtype, x.device.type)
    x2, g2 = _rows(x), _rows(g)
    T, K, R, N = x2.shape[0], x2.shape[1], A.shape[0], g2.shape[1]
    Ac, Bc = A.contiguous(), B.contiguous()
    BT, BN, BR = _blocks(R)
    opts = _options(x, A, g)
    s = float(scaling)
    dx = dA = dB = du = None
    if (need_x or need_a) and T:
        du = torch.empty((T, R), dtype=A.dtype, device=x.device)
        getattr(mod, f"{name}_grad_u")[(cdiv(T, BT),)](
            g2, Bc, du, s, T, N, R, g2.stride(0), Bc.stride(0), du.stride(0), BT=BT, BN=BN, BR=BR, **opts
        )
    if need_b:
        dB = (torch.empty if T else torch.zeros)((N, R), dtype=B.dtype, device=x.device)  # T rows: all written
        if T:
            getattr(mod, f"{name}_grad_b")[(cdiv(N, BN),)](
                g2, u, dB, s, T, N, R, g2.stride(0), u.stride(0), dB.stride(0), BT=BT, BN=BN, BR=BR, **opts
            )
    if need_a:
        dA = (torch.empty if T else torch.zeros)((R, K), dtype=A.dtype, device=x.device)
        if T:
            getattr(mod, f"{name}_grad_a")[(cdiv(K, BN),)](
                du, x2, dA, T, K, R, du.stride(0), x2.stride(0), dA.stride(0), BT=BT, BK=BN, BR=BR, **opts
            )
    if need_x:
        dx = torch.empty((T, K), dtype=x.dtype, device=x.device)
        if T:
            getattr(mod, f"{name}_grad_x")[(cdiv(T, BT), cdiv(K, BN))](
                dx, du, Ac, T, K, R, dx.stride(0), du.stride(0), Ac.stride(0), BT=BT, BK=BN, BR=BR, **opts
            )
        dx = dx.view(x.shape)
    return dx, dA, dB
