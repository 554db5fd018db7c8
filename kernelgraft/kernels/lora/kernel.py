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
adapters', to the result's dtype and to x's: every rounding point the spelling has (float32
adapters: R_a and R_p keep float32; bf16 adapters: every matmul and product rounds, as the unfused
model's). The products are summed in float32 whatever the dtype of x, so x is never copied to
float32; on the GPU they run on the tensor cores, split so that they stay exact (`precision`).
Where x and the adapters are both float32, the products and sums are float64 instead, rounded
once (`sums_in_float64`). dA and dB sum over all rows: the rows are split across programs and the
splits' sums added afterwards, so the GPU is filled.
The matmuls' adjoints are the rules of a product of matrices: d(P Q) = dP Q + P dQ.
"""

from __future__ import annotations

import functools

import torch

from ..launching import NotTraceable, cdiv, launch_options, launcher, pow2, sm_count, tracing
from . import source
from .source import UB_BLOCKS, kernel_name, kernel_source, kernels, precision, sums_in_float64  # noqa: F401

MAX_RANK = 256  # a rank block of at most 256 columns (one tile: the sums over r stay in registers)

# (rows, columns, warps) per kernel's tile on the GPU at ranks up to 16, each the fastest that
# benchmarks/tune_lora.py finds over a Llama-3.2-1B layer's four (width in, width out) pairs. Larger
# ranks (not tuned) and the interpreter keep SMALL_TILE: the float32 sums of a rank-256 tile fill
# the registers.
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
# Triton's software pipelining depth per kernel on the GPU at the tuned tiles (absent: Triton's
# default, which the down projection beats by a stage, `tune_lora.py --parts tiles`). Every stage
# holds one tile of each operand a loop streams: at large ranks (a 64 x 256 float32 adapter tile
# is 64 KiB) the depth is cut to what the device's shared memory holds (_stages), else Triton
# refuses the launch.
GPU_STAGES: dict[str, int] = {"down": 4}
TRITON_STAGES = 3  # Triton's default depth on CUDA
# programs per SM that a kernel summing over a long dim aims at, splitting that dim (its splits'
# float32 sums added afterwards in a fixed order): the weight gradients over the rows, du over the
# output width and u over x's (0: not split, one program per row tile summing all of it). The weight
# gradients sum over every row and gain from filling the GPU; du and u are fastest unsplit
# (`tune_lora.py --parts fills`).
GPU_FILL = {"down": 0, "grad_u": 0, "grad_b": 8, "grad_a": 8, "grad_ub": 8}
# du and dB from one read of the output's gradient (grad_ub) where the backward needs both; off:
# grad_u (a row tile across the whole width, du summed in registers) and grad_b, each reading it.
# Off, because grad_ub's du partial sums, a T x R row per column group and float64 (in float32 they
# cost du its accuracy where it cancels), are as many bytes as g itself at 64 columns a block,
# written and read again: that costs more than the second read of g it saves (`tune_lora.py
# --parts hard`, `profile_lora_ub.py`).
FUSED_UB = False
# grad_ub's column blocks per program on the GPU (source.UB_BLOCKS): a program of M blocks writes du's
# partial sums once for its M x BN columns, 1/M of those of one block a program, and keeps M of
# dB's accumulators, which with their operand splits crowd the registers as M grows: more than one
# block a program gains nothing reliable at the tuned tile (`tune_lora.py --parts blocks`). The
# interpreter's (CPU_UB_BLOCKS) is 2, so CI runs the repeated code.
GPU_UB_BLOCKS = 1
CPU_UB_BLOCKS = 2


def _blocks(R: int, kernel: str, device: torch.device) -> tuple[int, int, int, int]:
    """(rows, columns, rank, warps) of `kernel`'s tile: tl.dot needs each side at least 16."""
    BR = max(16, pow2(R))
    kernel = kernel.rstrip("0123456789")  # grad_ub2, grad_ub4: grad_ub's tile
    BT, BN, warps = GPU_TILES[kernel] if device.type == "cuda" and BR <= 16 else SMALL_TILE
    return BT, BN, BR, warps


@functools.cache
def _shared_memory(index) -> int:
    """Bytes of shared memory one program may use on the device (the limit Triton checks against);
    where no driver answers (a graph traced for a GPU on a machine without one), an H100's or
    H200's 232,448."""
    import triton

    try:
        index = index if index is not None else torch.cuda.current_device()
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - no GPU driver here: the launch is not run on this machine
        return 232448


def _stages(kernel: str, BT: int, BC: int, BR: int, device: torch.device) -> int | None:
    """The pipelining depth of `kernel`'s launch on the GPU (None: Triton's default). A stage holds
    a tile of each streamed operand, at most BC x BR and BT x max(BC, BR) float32 values: the depth
    stays within 7/8 of the device's shared memory (the rest for the layout conversions)."""
    if device.type != "cuda":
        return None
    want = GPU_STAGES.get(kernel.rstrip("0123456789"), TRITON_STAGES) if BR <= 16 else TRITON_STAGES
    fit = max(1, _shared_memory(device.index) * 7 // 8 // (4 * (BC * BR + BT * max(BC, BR))))
    if fit >= want:
        return None if want == TRITON_STAGES else want
    return fit


def _splits(T: int, blocks: int, BT: int, device: torch.device, fill: int | None = None) -> tuple[int, int]:
    """(splits, elements per split) of the T elements (rows, or columns for du) a sum runs over, in
    tiles of BT: enough programs (`blocks` other tiles x splits) to fill the GPU `fill` times
    (GPU_FILL's weight gradients' by default; 0: one split), each split at least 4 tiles. The
    splits' float32 sums are added in a fixed order afterwards (deterministic). On the CPU two
    splits, so the interpreter runs the same two-stage sum."""
    tiles = cdiv(max(T, 1), BT)
    fill = GPU_FILL["grad_b"] if fill is None else fill
    if device.type == "cuda":
        want = cdiv(fill * sm_count(device.index), blocks)
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
        # the type of the splits' sums (the kernels' own): float64 where x and A are float32
        self.sums = torch.float64 if sums_in_float64(x.dtype, A.dtype) else torch.float32

    def tile(self, kernel: str) -> tuple[int, int]:
        BT, BC, _, _ = _blocks(self.R, kernel, self.dev)
        return BT, BC

    def __call__(self, kernel: str, grid, *args, cols: str = "BN", **consts) -> None:
        """`kernel` on `args`; grid(rows per tile, columns per tile) -> its grid; cols: the name of
        its column block; consts: its other compile-time arguments."""
        BT, BC, BR, warps = _blocks(self.R, kernel, self.dev)
        stages = _stages(kernel, BT, BC, BR, self.dev)
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
        part = torch.empty((n, *shape), dtype=self.sums, device=self.dev)
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
    u = torch.empty((0, R), dtype=A.dtype, device=x.device)
    if T:
        u = _over_width(  # u = R_a(x A^T)
            launch, "down", K, T, R, A.dtype,
            lambda o, so, cols: (x2, Ac, o, T, K, R, x2.stride(0), Ac.stride(0), so, cols), cols="BK",
        )  # fmt: skip
        launch(
            "up", lambda bt, bc: (cdiv(T, bt), cdiv(N, bc)),
            out, base, u, Bc, float(scaling), T, N, R, out.stride(0), base.stride(0), u.stride(0), Bc.stride(0),
        )  # fmt: skip
    return out.view(result.shape), u


def _over_width(launch: _Launches, kernel: str, width: int, T: int, R: int, dtype: torch.dtype, args, cols="BN"):
    """The T x R sums of `kernel` over a width (u over x's, du over the output's), rounded to
    `dtype` (R_a): one program per row tile summing all of it, or, split (GPU_FILL; always on the
    CPU, so the interpreter runs the two-stage sum), each split's float64 sums added in a fixed
    order and then rounded once. args(out, its row stride, columns per program) -> the kernel's
    arguments."""
    BT, BC = launch.tile(kernel)
    fill = GPU_FILL[kernel]
    n, per = _splits(width, cdiv(T, BT), BC, launch.dev, fill) if fill or launch.dev.type != "cuda" else (1, width)
    if n == 1:
        out = torch.empty((T, R), dtype=dtype, device=launch.dev)
        launch(kernel, lambda bt, bc: (cdiv(T, bt), 1), *args(out, out.stride(0), max(width, 1)), cols=cols, SPLIT=False)
        return out
    part = torch.empty((n, T, R), dtype=torch.float64, device=launch.dev)  # the kernel's long sums
    launch(kernel, lambda bt, bc: (cdiv(T, bt), n), *args(part, R, per), cols=cols, SPLIT=True)
    return part.sum(0).float().to(dtype)


def _words(g2: torch.Tensor, xd: torch.dtype, ad: torch.dtype) -> tuple[torch.Tensor, int]:
    """(g's rows as 32-bit words, their stride) where du's kernels read g so (`source.du_words`):
    a view of g where its width, strides and address allow, else a copy one zero column wider
    (odd widths); (g, its stride) where they read g's own values."""
    if not source.du_words(xd, ad, g2.dtype):
        return g2, g2.stride(0)
    if g2.shape[1] % 2 or g2.stride(0) % 2 or g2.stride(1) != 1 or g2.data_ptr() % 4:
        g2 = torch.nn.functional.pad(g2, (0, g2.shape[1] % 2)).contiguous()
    w = g2.view(torch.int32)
    return w, w.stride(0)


def _grad_u(launch: _Launches, g2, Bc, s: float, T: int, N: int, R: int, xd, dtype: torch.dtype) -> torch.Tensor:
    """du = R_a(gv @ B) (T x R, the adapters' dtype)."""
    gw, sgw = _words(g2, xd, dtype)
    return _over_width(
        launch, "grad_u", N, T, R, dtype,
        lambda out, so, cols: (g2, gw, Bc, out, s, T, N, R, g2.stride(0), sgw, Bc.stride(0), so, cols),
    )  # fmt: skip


def _grad_ub(launch: _Launches, g2, Bc, u, s: float, T: int, N: int, R: int, xd, ad: torch.dtype):
    """(du, dB) from one read of g (T, N > 0): du's sums per group of column blocks (a program's,
    GPU_UB_BLOCKS; in float64, as the unfused kernel's splits of the width: stored in float32, the
    257-513 partial sums of an output 32771 wide left du 8x a float32 rounding's error where it cancels) and
    dB's float32 sums per split of the rows, each added in a fixed order and rounded once (the
    same products as the unfused kernels'; du's sums split by column groups instead of unsplit)."""
    BT, BN = launch.tile("grad_ub")
    M = GPU_UB_BLOCKS if launch.dev.type == "cuda" else CPU_UB_BLOCKS
    C = cdiv(N, BN * M)  # column groups: a program each per split of the rows
    n, rows = _splits(T, C, BT, launch.dev, GPU_FILL["grad_ub"])
    long_t = torch.float64 if source.LONG_SUMS == "float64" else launch.sums
    gw, sgw = _words(g2, xd, ad)
    dupart = torch.empty((C, T, R), dtype=long_t, device=launch.dev)
    dbpart = torch.empty((n, N, R), dtype=launch.sums, device=launch.dev)
    launch(
        "grad_ub" if M == 1 else f"grad_ub{M}", lambda bt, bc: (C, n),
        g2, gw, Bc, u, dupart, dbpart, s, T, N, R, g2.stride(0), sgw, Bc.stride(0), u.stride(0), rows,
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
        du, dB = _grad_ub(launch, g2, Bc, u, s, T, N, R, x.dtype, A.dtype)
    elif (need_x or need_a) and T:
        du = _grad_u(launch, g2, Bc, s, T, N, R, x.dtype, A.dtype)
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
