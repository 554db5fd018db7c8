"""Spec + derived Backward -> Triton source for a row kernel pair (forward, backward).

Layout: a 2-D block of BLOCK_M rows x BLOCK_N columns (BLOCK_N >= N, the whole row in registers);
every value is computed in float32 (in float64 for a norm whose tensors are all float32: in_float64);
loads upcast, stores round to the destination dtype. A row index
is split over up to three leading dims (D0, D1, D2) and every per-element tensor has its own stride
in each, so transposed views (HF's q after `.transpose(1, 2)`) and broadcast arguments (cos/sin
unsqueezed on the head dim, stride 0) are read in place, never copied.

One row-block function does the work; the entry kernels run it for one group of tensors, or for
several groups in one launch (q and k of a layer share cos and sin, and are served together). Per-column
arguments, scalars and the row length are shared by the groups; per-element ones belong to a group.

Only Triton builtins appear (tl.reduce with the standard sum combiner, not tl.sum; no tl.cdiv, tl.zeros or
tl.sigmoid): those are @jit helpers, which the interpreter runs only when it was switched on
before triton was imported, and kernelgraft runs both modes in one process. The forward
saves the row statistics r_k (float32, one per reduction and row); the backward reloads them and
recomputes everything else. Per-column gradients are summed over the rows a program visits and
written as one partial row per program; a generated kernel adds the partials (no atomics:
deterministic, and the same sum whether the host or inductor launches it).
"""

from __future__ import annotations

import sympy
import torch

from ...ir.sym import round_to
from .. import emit
from ..derive import Backward
from ..spec import LOW, Spec
from .precision import in_float64, sum_type

GROUPS = (1, 2)  # entry kernels generated: one group of tensors per launch, or two

IND, IND2 = "    ", "        "


def _strided(name: str) -> list[str]:
    """A per-element tensor's arguments: pointer, strides of the three leading dims, column stride."""
    return [f"{name}_ptr", f"{name}_s0", f"{name}_s1", f"{name}_s2", f"{name}_sc"]


def _elems(spec: Spec) -> list[str]:
    return [t for t in spec.tensors if spec.kinds[t] == "elem"]


def _cols(spec: Spec) -> list[str]:
    return [t for t in spec.tensors if spec.kinds[t] == "col"]


def _col_vars(spec: Spec, needed: set) -> list[str]:
    """Per-column values the row block reads: loaded once per program by the entry kernel."""
    return [v for t in _cols(spec) for v in (t, f"{t}__p") if v == t or v in needed]


def _rotation(indent: str, needed: set, rotation: str = "half") -> list[str]:
    """The rotated read's column map and sign, when a spelling rotates: rotate_half's (the other
    half of the row) or rotate_pairs' (the other column of each (even, odd) pair)."""
    if not any(n.endswith("__p") or n == "sgn" for n in needed):
        return []
    if rotation == "pairs":  # the partner is swapped in registers (_partner): no column map
        return [f"{indent}sgn = tl.where(cols % 2 == 0, -1.0, 1.0)"]
    return [f"{indent}pcols = (cols + N // 2) % N", f"{indent}sgn = tl.where(cols < N // 2, -1.0, 1.0)"]


def _col_of(spec: Spec, t: str) -> str:
    """The column a tensor is read or stored at for the element at column `cols`: its own, but in
    a row written as two halves of the pairs' rotation (Spec.out_map) the output and its gradient
    at the de-interleaved column, and the half-width arguments at cols // 2."""
    if t in ("out", "g") and spec.out_map == "deinterleave":
        return "ocols"
    if t not in spec.half_inputs:
        return "cols"
    return "(cols // 2)" if spec.half_at == "pairs" else "(cols % (N // 2))"


def _out_map(spec: Spec, indent: str) -> list[str]:
    return [f"{indent}ocols = cols // 2 + (cols % 2) * (N // 2)"] if spec.out_map == "deinterleave" else []


def _row_index(indent: str) -> list[str]:
    # the row split in int32 (the launcher keeps row counts below 2**31: MAX_ROWS), each index
    # widened before it meets a stride: a 64-bit division is several times the instructions
    return [
        f"{indent}rows = (rb * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]",
        f"{indent}rmask = rows < M",
        f"{indent}mask = rmask & cmask",
        f"{indent}i12 = rows // D2",
        f"{indent}i2 = (rows - i12 * D2).to(tl.int64)",
        f"{indent}i1 = (i12 % D1).to(tl.int64)",
        f"{indent}i0 = (i12 // D1).to(tl.int64)",
        f"{indent}rows = rows.to(tl.int64)",
    ]


def _offset(name: str) -> str:
    return f"i0 * {name}_s0 + i1 * {name}_s1 + i2 * {name}_s2"


def _elem_loads(spec: Spec, names: list[str], indent: str, needed: set) -> list[str]:
    out = []
    for t in names:
        out.append(f"{indent}{t}_o = {_offset(t)}")
        out.append(f"{indent}{t} = tl.load({t}_ptr + {t}_o + {_col_of(spec, t)} * {t}_sc, mask=mask, other=0.0).to(tl.float32)")
        if f"{t}__p" in needed:
            out.append(_partner(spec, t, f"{t}_ptr + {t}_o", "mask", "BLOCK_M", indent))
    return out


def _partner(spec: Spec, t: str, base: str, mask: str, rows: str, indent: str) -> str:
    """`t` read at the rotated column: the pairs' partner is swapped in registers from the row
    already loaded; the half rotation's is a second, contiguous load."""
    if spec.rotation == "pairs":
        return f"{indent}{t}__p = _swap_pairs({t}, {rows}, BLOCK_N)"
    if t in spec.half_inputs:  # a half-width angle: the rotated column reads the same one
        return f"{indent}{t}__p = {t}"
    return f"{indent}{t}__p = tl.load({base} + pcols * {t}_sc, mask={mask}, other=0.0).to(tl.float32)"


def _col_loads(spec: Spec, indent: str, needed: set) -> list[str]:
    out = []
    for t in _cols(spec):
        out.append(f"{indent}{t} = tl.load({t}_ptr + {_col_of(spec, t)} * {t}_sc, mask=cmask, other=0.0).to(tl.float32)")
        if f"{t}__p" in needed:
            out.append(_partner(spec, t, f"{t}_ptr", "cmask", "1", indent))
    return out


def _entry_head(spec: Spec, needed: set) -> list[str]:
    # scalars arrive as fp32 from eager launches but fp64 from inductor's: pin them to fp32
    L = [f"{IND}{s} = tl.full([], {s}, tl.float32)" for s in spec.scalars + ["Nf"]]
    L += [
        f"{IND}pid = tl.program_id(0)",
        f"{IND}cols1 = tl.arange(0, BLOCK_N)",
        f"{IND}cols = cols1[None, :]",
        f"{IND}cmask = cols < N",
    ]
    L += _rotation(IND, needed, spec.rotation)
    L += _col_loads(spec, IND, needed)
    return L


def _suffixed(names: list[str], g: int) -> list[str]:
    return [f"{n}_g{g}" for n in names]


# ---- forward -------------------------------------------------------------------------------------


def _fwd_group_args(spec: Spec, add: bool = False) -> list[str]:
    """add: the variant whose first argument is made as the sum of two tensors `a` and `b`, and
    stored (at the first argument's pointer) as well as normed (adds_input)."""
    a = _strided("a") + _strided("b") if add else []
    return a + [x for t in _elems(spec) for x in _strided(t)] + _strided("out") + ["stats_ptr", "M", "D1", "D2"]


def adds_input(spec: Spec) -> bool:
    """Whether the spelling's kernels have the forward that makes its first argument as a sum
    (`_fwda`): a norm (as accumulates) whose first argument is not read at a rotated column. A
    decoder norms the residual stream right after adding a sublayer's output to it; the add then
    happens as the row is loaded, its sum stored for the stream (rewriter/recompute.py)."""
    if not accumulates(spec):
        return False
    need = emit.needed(spec.output, *(r.summand for r in spec.reductions))
    return f"{spec.tensors[0]}__p" not in need


def _added_input(spec: Spec, indent: str) -> list[str]:
    """The first argument made as a + b, rounded as eager's add stores it, then stored where the
    first argument's pointer says: the sum's one write, the norm reading it from registers."""
    x = spec.tensors[0]
    L = [f"{indent}{x}_o = {_offset(x)}"]
    for t in ("a", "b"):
        L.append(f"{indent}{t}_in_ = tl.load({t}_ptr + {_offset(t)} + cols * {t}_sc, mask=mask, other=0.0).to(tl.float32)")
    total = round_to(sympy.Symbol("a_in_") + sympy.Symbol("b_in_"), LOW.get(spec.dtypes[x], "float32"))
    lines, (e,) = emit.cse_lines([total], "xa", indent)
    L += lines
    L.append(f"{indent}{x} = {e}")
    L.append(f"{indent}tl.store({x}_ptr + {x}_o + cols * {x}_sc, {x}, mask=mask)")
    return L


def _fwd_block(spec: Spec, needed: set, add: bool = False) -> list[str]:
    cv = _col_vars(spec, needed)
    sig = ", ".join(
        _fwd_group_args(spec, add)
        + cv
        + list(spec.scalars)
        + ["rb", "N", "Nf", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"]
    )
    L = ["@triton.jit", f"def {spec.name}_{'fwda' if add else 'fwd'}_rows({sig}):"]
    L += [f"{IND}cols = tl.arange(0, BLOCK_N)[None, :]", f"{IND}cmask = cols < N"]
    L += _rotation(IND, needed, spec.rotation) + _out_map(spec, IND)
    L += _row_index(IND)
    elems = _elems(spec)
    if add:
        L += _added_input(spec, IND)
        elems = elems[1:]
    L += _elem_loads(spec, elems, IND, needed)
    wide = in_float64(spec)
    if wide:
        L += _widened(_loaded(spec, needed, cv))
    L += _reduction_lines(spec, IND, wide, stats_store=True)
    L += _output_lines(spec, IND, wide)
    return L


def _fwd_entry(spec: Spec, needed: set, G: int, add: bool = False) -> list[str]:
    shared = [a for t in _cols(spec) for a in (f"{t}_ptr", f"{t}_sc")] + list(spec.scalars)
    groups = [a for g in range(G) for a in _suffixed(_fwd_group_args(spec, add), g)]
    sig = ", ".join(shared + groups + ["N", "Nf", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"])
    which = "fwda" if add else "fwd"
    name = f"{spec.name}_{which}" if G == 1 else f"{spec.name}_{which}{G}"
    L = ["@triton.jit", f"def {name}({sig}):"]
    L += _entry_head(spec, needed)
    tail = _col_vars(spec, needed) + list(spec.scalars)
    L.append(f"{IND}start = 0")
    for g in range(G):
        call = ", ".join(
            _suffixed(_fwd_group_args(spec, add), g) + tail + ["pid - start", "N", "Nf", "BLOCK_M", "BLOCK_N"]
        )
        L.append(f"{IND}nb = (M_g{g} + BLOCK_M - 1) // BLOCK_M")
        L.append(f"{IND}if (pid >= start) & (pid < start + nb):")
        L.append(f"{IND2}{spec.name}_{which}_rows({call})")
        L.append(f"{IND}start = start + nb")
    return L


def forward_source(spec: Spec) -> str:
    """The forward entries (`_fwd`, `_fwd2`); for a norm also `_fwda`, which makes its first
    argument as a sum and stores it (adds_input)."""
    need = emit.needed(spec.output, *(r.summand for r in spec.reductions))
    L = _fwd_block(spec, need)
    for G in GROUPS:
        L += ["", ""] + _fwd_entry(spec, need, G)
    if adds_input(spec):  # one group: a norm's sites are not paired
        L += ["", ""] + _fwd_block(spec, need, add=True)
        L += ["", ""] + _fwd_entry(spec, need, 1, add=True)
    return "\n".join(L) + "\n"


# ---- backward ------------------------------------------------------------------------------------


def _bwd_group_args(spec: Spec, with_out: bool = False, acc: bool = False) -> list[str]:
    """with_out: the variant that makes the row statistics itself and stores the forward's output
    (for an output recomputed in the backward) instead of reading the statistics. acc: the variant
    that adds a tensor `a` to the first argument's gradient as it stores it (accumulates)."""
    a = _strided("g") + [x for t in _elems(spec) for x in _strided(t)] + ([] if with_out else ["stats_ptr"])
    a += [x for t in _elems(spec) for x in _strided(f"d_{t}")]
    a += _strided("a") if acc else []
    return a + (_strided("out") if with_out else []) + ["M", "D1", "D2"]


def accumulates(spec: Spec) -> bool:
    """Whether the spelling's kernels have the accumulating backward (`_bwdoa`): a norm (row
    statistics) whose first argument varies per element. A decoder adds a norm's input gradient to
    the residual stream's; the add then happens as the gradient is stored (rewriter/recompute.py)."""
    return bool(spec.reductions) and spec.kinds[spec.tensors[0]] == "elem"


def _reduction_lines(spec: Spec, indent: str, wide: bool, stats_store: bool) -> list[str]:
    """The forward's row statistics from the loaded row (stored for the backward, or kept); wide:
    the kernel computes in float64 (in_float64)."""
    K = max(len(spec.reductions), 1)
    L = []
    for k, red in enumerate(spec.reductions):
        L.append(f"{indent}# {red.symbol} = {'mean' if red.mean else 'sum'}_j({red.summand})")
        lines, (e,) = emit.cse_lines([red.summand], f"s{k}_", indent)
        L += lines
        total = f"tl.reduce(tl.where(mask, {e}, 0.0), 1, tl.standard._sum_combine)[:, None]"
        if red.mean:  # divided as the reference divides, correctly rounded: a float32 `/` compiles
            # to CUDA's approximate division (2 ulp), which leaves a constant row's mean off its
            # value and LayerNorm's output on such a row off its bias (float64 division is exact)
            total = f"{total} / Nf" if wide else f"tl.math.div_rn({total}, Nf)"
        L.append(f"{indent}{red.symbol} = {total}")
        if stats_store:
            L.append(
                f"{indent}tl.store(stats_ptr + rows * {K} + {k}, {_stored(red.symbol, wide)}, mask=rmask)"
            )
    return L


def _stored(e: str, wide: bool) -> str:
    """A value as stored: rounded to float32 first where the kernel computes in float64."""
    return f"({e}).to(tl.float32)" if wide else e


def _output_lines(spec: Spec, indent: str, wide: bool) -> list[str]:
    L = [f"{indent}# y = {spec.output}"]
    # rounded here, not by the store: Triton's interpreter truncates an implicit fp32 -> bf16 store
    lines, (e,) = emit.cse_lines([round_to(spec.output, LOW.get(spec.out_dtype, "float32"))], "t", indent)
    L += lines
    L.append(f"{indent}tl.store(out_ptr + {_offset('out')} + {_col_of(spec, 'out')} * out_sc, {_stored(e, wide)}, mask=mask)")
    return L


def _widened(names: list[str]) -> list[str]:
    """These values as float64 from here on (in_float64)."""
    return [f"{IND}{v} = {v}.to(tl.float64)" for v in names]


def _loaded(spec: Spec, needed: set, cv: list[str]) -> list[str]:
    """The per-element and per-column values a row block loads, its scalars and Nf."""
    names = [v for t in _elems(spec) for v in (t, f"{t}__p") if v == t or v in needed]
    return names + cv + list(spec.scalars) + ["Nf"]


def backward_kind(with_out: bool, acc: bool) -> str:
    """The backward entry's name after the spec's: `bwd`, `bwdo` (the output made too), `bwdoa`
    (and a tensor added to the first argument's gradient)."""
    return ("bwdo" if with_out else "bwd") + ("a" if acc else "")


def _bwd_block(spec: Spec, bwd: Backward, needed: set, with_out: bool = False, acc: bool = False) -> list[str]:
    K = max(len(spec.reductions), 1)
    cv = _col_vars(spec, needed)
    needs = [f"NEED_{t}: tl.constexpr" for t in spec.tensors]
    sig = ", ".join(
        _bwd_group_args(spec, with_out, acc)
        + cv
        + list(spec.scalars)
        + ["rb", "N", "Nf", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"]
        + needs
    )
    L = ["@triton.jit", f"def {spec.name}_{backward_kind(with_out, acc)}_rows({sig}):"]
    L += [f"{IND}cols = tl.arange(0, BLOCK_N)[None, :]", f"{IND}cmask = cols < N"]
    L += _rotation(IND, needed, spec.rotation) + _out_map(spec, IND)
    L += _row_index(IND)
    L.append(f"{IND}g_o = {_offset('g')}")
    L.append(f"{IND}g = tl.load(g_ptr + g_o + {_col_of(spec, 'g')} * g_sc, mask=mask, other=0.0).to(tl.float32)")
    if "g__p" in needed:
        L.append(_partner(spec, "g", "g_ptr + g_o", "mask", "BLOCK_M", IND))
    L += _elem_loads(spec, _elems(spec), IND, needed)
    wide = in_float64(spec)
    stats = [r.symbol.name for r in spec.reductions]
    if wide:  # float32 tensors, a norm: computed in float64 (in_float64)
        L += _widened(["g"] + (["g__p"] if "g__p" in needed else []) + _loaded(spec, needed, cv))
    if with_out:  # the forward's work, on the row already loaded: statistics, then the output
        L += _reduction_lines(spec, IND, wide, stats_store=False)
        L += _output_lines(spec, IND, wide)
        if wide:  # the statistics as the forward stores them, for the gradients to match _bwd's
            L += [f"{IND}{r} = {r}.to(tl.float32).to(tl.float64)" for r in stats]
    else:
        for k, red in enumerate(spec.reductions):
            L.append(f"{IND}{red.symbol} = tl.load(stats_ptr + rows * {K} + {k}, mask=rmask, other=1.0)")
        if wide:
            L += _widened(stats)
    for a, summand in bwd.adjoints:
        L.append(f"{IND}# {a} = sum_j({summand})")
        lines, (e,) = emit.cse_lines([summand], f"{a}_", IND)
        L += lines
        L.append(f"{IND}{a} = tl.reduce(tl.where(mask, {e}, 0.0), 1, tl.standard._sum_combine)[:, None]")
    for t in spec.tensors:
        L.append(f"{IND}# d{t} = {bwd.grads[t]}")
    # an element-wise gradient is stored in its argument's dtype: round it here, the same on every backend
    grads = [
        bwd.grads[t] if spec.kinds[t] == "col" else round_to(bwd.grads[t], LOW.get(spec.dtypes[t], "float32"))
        for t in spec.tensors
    ]
    lines, exprs = emit.cse_lines(grads, "u", IND)
    L += lines
    partials = []
    for i, (t, e) in enumerate(zip(spec.tensors, exprs)):
        if t in spec.half_inputs:  # read at cols // 2 by two elements: no gradient made (the launcher refuses it)
            L += [f"{IND}p_{t} = tl.full([BLOCK_N], 0.0, tl.float32)"] if spec.kinds[t] == "col" else []
            partials += [f"p_{t}"] if spec.kinds[t] == "col" else []
            continue
        if spec.kinds[t] == "elem":
            L.append(f"{IND}if NEED_{t}:")
            stored = _stored(e, wide)
            if acc and i == 0:  # the gradient as stored, plus `a`, rounded again: eager's add after it
                L.append(f"{IND2}dxr_ = {stored}")
                L.append(f"{IND2}a_in_ = tl.load(a_ptr + {_offset('a')} + cols * a_sc, mask=mask, other=0.0).to(tl.float32)")
                total = round_to(sympy.Symbol("dxr_") + sympy.Symbol("a_in_"), LOW.get(spec.dtypes[t], "float32"))
                lines, (stored,) = emit.cse_lines([total], "ua", IND2)
                L += lines
            L.append(f"{IND2}tl.store(d_{t}_ptr + {_offset(f'd_{t}')} + cols * d_{t}_sc, {stored}, mask=mask)")
        else:  # this block's column sums (float64 where the kernel computes in it: _sum_type)
            L.append(f"{IND}p_{t} = tl.full([BLOCK_N], 0.0, {sum_type(wide)})")
            L.append(f"{IND}if NEED_{t}:")
            L.append(f"{IND2}p_{t} = tl.reduce(tl.where(mask, {e}, 0.0), 0, tl.standard._sum_combine)")
            partials.append(f"p_{t}")
    if partials:
        L.append(f"{IND}return {', '.join(partials)}")
    return L


def _bwd_entry(spec: Spec, needed: set, G: int, with_out: bool = False, acc: bool = False) -> list[str]:
    cols = _cols(spec)
    shared = [a for t in cols for a in (f"{t}_ptr", f"{t}_sc")] + list(spec.scalars)
    shared += [a for t in cols for a in (f"d_{t}_ptr", f"d_{t}_s0")]
    groups = [a for g in range(G) for a in _suffixed(_bwd_group_args(spec, with_out, acc), g)]
    needs = [f"NEED_{t}: tl.constexpr" for t in spec.tensors]
    sig = ", ".join(shared + groups + ["N", "Nf", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"] + needs)
    which = backward_kind(with_out, acc)
    name = f"{spec.name}_{which}" if G == 1 else f"{spec.name}_{which}{G}"
    L = ["@triton.jit", f"def {name}({sig}):"]
    L += _entry_head(spec, needed)
    L.append(f"{IND}nprog = tl.num_programs(0)")
    L += [f"{IND}acc_{t} = tl.full([BLOCK_N], 0.0, {sum_type(in_float64(spec))})" for t in cols]
    tail = _col_vars(spec, needed) + list(spec.scalars)
    flags = [f"NEED_{t}" for t in spec.tensors]
    for g in range(G):
        call = ", ".join(
            _suffixed(_bwd_group_args(spec, with_out, acc), g)
            + tail
            + ["rb", "N", "Nf", "BLOCK_M", "BLOCK_N"]
            + flags
        )
        L.append(f"{IND}for rb in range(pid, (M_g{g} + BLOCK_M - 1) // BLOCK_M, nprog):")
        if cols:
            L.append(f"{IND2}{', '.join(f'p_{t}' for t in cols)} = {spec.name}_{which}_rows({call})")
            L += [f"{IND2}acc_{t} += p_{t}" for t in cols]
        else:
            L.append(f"{IND2}{spec.name}_{which}_rows({call})")
    for t in cols:
        L.append(f"{IND}if NEED_{t}:")
        L.append(f"{IND2}tl.store(d_{t}_ptr + pid * d_{t}_s0 + cols1, acc_{t}, mask=cols1 < N)")
    return L


def _colsum(spec: Spec, t: str) -> list[str]:
    """A per-column gradient from the backward programs' partial rows: each block of BLOCK_P rows
    summed as a tree, the blocks in order (in _sum_type), rounded once to the argument's dtype. Its
    own kernel, not torch's sum: launched from the host or by inductor, the same sum in the same order."""
    wide = in_float64(spec)
    lines, (e,) = emit.cse_lines(
        [round_to(sympy.Symbol("acc"), LOW.get(spec.dtypes[t], "float32"))], "s", IND
    )
    e = _stored(e, wide)
    return [
        "@triton.jit",
        f"def {spec.name}_colsum_{t}(buf_ptr, P, N, out_ptr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):",
        f"{IND}cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)",
        f"{IND}cmask = cols < N",
        f"{IND}acc = tl.full([BLOCK_N], 0.0, {sum_type(wide)})",
        f"{IND}for p0 in range(0, P, BLOCK_P):",
        f"{IND2}rows = p0 + tl.arange(0, BLOCK_P)",
        f"{IND2}m = (rows < P)[:, None] & cmask[None, :]",
        f"{IND2}x = tl.load(buf_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=m, other=0.0)",
        f"{IND2}acc += tl.reduce(x, 0, tl.standard._sum_combine)",
        *lines,
        f"{IND}tl.store(out_ptr + cols, {e}, mask=cmask)",
    ]


def backward_source(spec: Spec, bwd: Backward) -> str:
    """The backward entries (`_bwd`, `_bwd2`), and those that also make the forward's output
    (`_bwdo`, `_bwdo2`): where the output is recomputed for the backward, one pass over the rows
    serves both (the rewriter's recompute pass); for a norm, `_bwdoa`, which also adds a tensor to
    the first argument's gradient (accumulates); then per per-column argument, the sum of the
    programs' partial rows (`_colsum_<argument>`)."""
    need = emit.needed(*bwd.grads.values(), *(e for _, e in bwd.adjoints))
    L = _bwd_block(spec, bwd, need)
    for G in GROUPS:
        L += ["", ""] + _bwd_entry(spec, need, G)
    need_o = need | emit.needed(spec.output, *(r.summand for r in spec.reductions))
    L += ["", ""] + _bwd_block(spec, bwd, need_o, with_out=True)
    for G in GROUPS:
        L += ["", ""] + _bwd_entry(spec, need_o, G, with_out=True)
    if accumulates(spec):  # one group: a norm's sites are not paired
        L += ["", ""] + _bwd_block(spec, bwd, need_o, with_out=True, acc=True)
        L += ["", ""] + _bwd_entry(spec, need_o, 1, with_out=True, acc=True)
    for t in _cols(spec):
        L += ["", ""] + _colsum(spec, t)
    return "\n".join(L) + "\n"


def module_source(spec: Spec, bwd: Backward, qual: str) -> str:
    dtypes = {k: str(v).replace("torch.", "") for k, v in spec.dtypes.items()}
    head = emit.HEADER.format(
        qual=qual, dtypes=dtypes, kinds=spec.kinds, out=str(spec.out_dtype).replace("torch.", "")
    )
    body = forward_source(spec) + "\n\n" + backward_source(spec, bwd)
    wide = any(d in (torch.float32, torch.float64) for d in (*spec.dtypes.values(), spec.out_dtype))
    return head + emit.helpers(body, accurate_exp=wide) + "\n\n" + body
