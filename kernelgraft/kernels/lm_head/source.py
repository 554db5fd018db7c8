"""The LM head's cross-entropy kernels as Triton source: per row, the online logsumexp over vocabulary
blocks and the loss, then (GRAD) the logit gradient written over the logits in place; the mean's
divisor and the gradient's scale; the loss from the rows' losses."""

from __future__ import annotations

from .. import emit
from .transform import Transform


def kernel_source(name: str, tf: Transform, qual: str, accurate_exp: bool = False) -> str:
    """The CE kernels' source. The softmax in the gradient is exp(y - max) times 1/sum, not
    exp(log_softmax) as eager's backward computes it: log(sum)'s rounding (an absolute error, up
    to 2^-21 at a 128k vocabulary) moves every probability of a row by that much relative, twice
    the error of the quotient (float32, on average), and a gradient
    rounded to bf16/fp16 near a rounding tie then falls on the far side more often than eager's.
    accurate_exp (the CUDA kernels): that exponential by emit's EXP_ONE_EX2, tl.exp's one ex2 with
    the rounding of x log2 e put back (tl.exp's error on the GPU grows with |x|: |x| 2^-24 relative).
    It costs the CE kernel a little time beside tl.exp, and far less than the row kernels'
    range-reduced _exp would (benchmarks/diag_ce_exp.py compares the three)."""
    sc = "".join(f"{s}, " for s in tf.scalars)
    exp = "_exp" if accurate_exp else "tl.exp"
    pin = "".join(f"    {s} = tl.full([], {s}, tl.float32)\n" for s in tf.scalars)
    fwd = "\n".join(tf.fwd_lines)
    bwd = "\n".join(tf.bwd_lines)
    return (
        emit.HEADER.format(qual=qual, dtypes="logits: the weight's", kinds="rows of logits", out=str(tf.out_dtype))
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
    # the target's logit, read once. A label outside [0, V) is refused before the launch (an
    # IndexError on the CPU, a device-side assert on a GPU); here it gives its row a NaN loss
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
        r = tl.math.div_rn(1.0, s)
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            msk = c < V
            v_x = tl.load(z_ptr + row * z_s0 + c, mask=msk, other=0.0).to(tl.float32)
            g = ({exp}({name}_y(v_x, {sc}) - m) * r - tl.where(c == t, 1.0, 0.0)) * k
{bwd}
            tl.store(z_ptr + row * z_s0 + c, {tf.bwd}, mask=msk)


@triton.jit
def {name}_scale(t_ptr, T, ignore_index, g_ptr, n_ptr, scale_ptr, denom_ptr, HAS_G: tl.constexpr, HAS_N: tl.constexpr, BLOCK: tl.constexpr):
    # one program: the mean's divisor (the labels counted, or the caller's count n) and the
    # gradient of every counted row's loss, g / divisor, correctly rounded (as torch divides)
    if HAS_N:
        d = tl.load(n_ptr).to(tl.float32)
    else:
        offs = tl.arange(0, BLOCK)
        count = tl.full([BLOCK], 0, tl.int64)
        for s0 in range(0, T, BLOCK):
            msk = s0 + offs < T
            lab = tl.load(t_ptr + s0 + offs, mask=msk, other=0).to(tl.int64)
            count += tl.where(msk & (lab != ignore_index), 1, 0)
        d = tl.reduce(count, 0, tl.standard._sum_combine).to(tl.float32)
    if HAS_G:
        g = tl.load(g_ptr).to(tl.float32)
    else:
        g = tl.full([], 1.0, tl.float32)
    tl.store(denom_ptr, d)
    tl.store(scale_ptr, tl.math.div_rn(g, d))


@triton.jit
def {name}_loss(loss_ptr, T, denom_ptr, out_ptr, BLOCK: tl.constexpr):
    # one program: the rows' losses summed in one fixed order, over the divisor (correctly rounded)
    offs = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for s0 in range(0, T, BLOCK):
        acc += tl.load(loss_ptr + s0 + offs, mask=s0 + offs < T, other=0.0)
    tl.store(out_ptr, tl.math.div_rn(tl.reduce(acc, 0, tl.standard._sum_combine), tl.load(denom_ptr)))
"""
        + (("\n\n" + emit.EXP_ONE_EX2.strip() + "\n") if accurate_exp else "")
    )
