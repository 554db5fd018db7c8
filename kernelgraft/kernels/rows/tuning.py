"""Launch configurations of the row kernels: data (launch_configs.json, which
benchmarks/tune_rows.py writes with --write-table), and the rules that read it.

On CUDA a program takes BLOCK_M rows of BLOCK_N (the row padded to a power of two):
- `warps_by_width`: num_warps by padded row width (the first [width, warps] whose width holds the row);
- `elements_per_program`: BLOCK_M x BLOCK_N of a kernel that reduces along rows (a norm: 8192, more
  rows a program at the same num_warps, so the numbers are the same) or not (4096); at most
  `max_block_m` rows;
- `narrow_rows`: rows of at most 128 without a reduction (RoPE's head dims) take 2 warps, fewer
  than their width's, as short rows leave more warps idle;
- `column_sums`: a row-reducing kernel's backward that sums columns (RMSNorm's weight gradient):
  [BLOCK_M, programs per SM] by padded row width, the fastest among configs whose numbers are
  bitwise the default's. Other column-summing backwards run `programs_per_sm` programs per SM.
- `provenance`: the card and benchmark the CUDA entries were chosen on, with the timings that chose
  them; read by no rule.
Under Triton's interpreter numpy does a program's work in one go and the Python around it costs
per program, so blocks are large (`elements_per_program`: RoPE's 32-wide rows 1024 at a time);
but numpy sums a column of a block one row after another, so where a program sums columns at most
`max_block_m_summing` rows keep the per-column gradients as accurate as torch's.
`flat_rows`: row lengths an element-wise kernel's contiguous tensors may be re-cut into (launch.py).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..launching import pow2, sm_count

TABLE_PATH = Path(__file__).with_name("launch_configs.json")


def load(path: Path = TABLE_PATH) -> dict:
    table = json.loads(Path(path).read_text())
    table["cuda"]["column_sums"] = {int(k): tuple(v) for k, v in table["cuda"]["column_sums"].items()}
    table["flat_rows"] = tuple(table["flat_rows"])
    return table


def write(table: dict, path: Path = TABLE_PATH) -> None:
    """Store a table (tune_rows.py --write-table): column_sums keyed by width as text, as JSON has it."""
    out = json.loads(json.dumps(table, default=list))
    out["cuda"]["column_sums"] = {str(k): list(v) for k, v in table["cuda"]["column_sums"].items()}
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


TABLE = load()


@dataclass(frozen=True)
class Trial:
    """One config for every CUDA launch of the row kernels (what tune_rows.py sweeps): BLOCK_M,
    num_warps, programs per SM of a column-summing backward, and a row length to re-cut into."""

    block_m: int
    num_warps: int
    programs_per_sm: int = 4
    flat_rows: int | None = None


_TRIALS: list[Trial] = []


@contextlib.contextmanager
def trial(t: Trial | None):
    """Launch every row kernel with `t` inside the block (None: the table's configs)."""
    if t is None:
        yield
        return
    _TRIALS.append(t)
    try:
        yield
    finally:
        _TRIALS.pop()


def flat_rows() -> tuple[int, ...]:
    t = _TRIALS[-1] if _TRIALS else None
    return (t.flat_rows,) if t is not None and t.flat_rows else TABLE["flat_rows"]


def _column_sums(N: int, reduces: bool) -> tuple[int, int] | None:
    """[BLOCK_M, programs per SM] of a row-reducing kernel's column-summing backward for rows of
    N; None where the general rule holds."""
    return TABLE["cuda"]["column_sums"].get(pow2(max(N, 1))) if reduces else None


def config(M: int, N: int, device: torch.device, sums_columns: bool = True, reduces: bool = False) -> dict:
    """Launch config of a row kernel: BLOCK_M rows of BLOCK_N per program. sums_columns: the
    program sums its rows into per-column gradients (a backward with weight-like arguments);
    reduces: the kernel reduces along each row (a norm)."""
    BN = pow2(max(N, 1))
    if device.type == "cuda":
        if _TRIALS:
            return dict(BLOCK_M=_TRIALS[-1].block_m, BLOCK_N=BN, num_warps=_TRIALS[-1].num_warps)
        cuda = TABLE["cuda"]
        warps = next((w for width, w in cuda["warps_by_width"] if BN <= width), cuda["warps_by_width"][-1][1])
        tuned = _column_sums(N, reduces) if sums_columns else None
        if tuned:
            BM = tuned[0]
        else:
            per_program = cuda["elements_per_program"]["reducing" if reduces else "other"]
            BM = max(1, min(cuda["max_block_m"], per_program // BN))
            if not reduces and BN <= cuda["narrow_rows"]["max_width"]:
                warps = cuda["narrow_rows"]["num_warps"]
        return dict(BLOCK_M=BM, BLOCK_N=BN, num_warps=warps)
    cpu = TABLE["interpreter"]
    if not sums_columns:
        return dict(BLOCK_M=max(1, cpu["elements_per_program"] // BN), BLOCK_N=BN)
    BM = max(1, min(pow2(max(M, 1)), cpu["elements_per_program"] // BN, cpu["max_block_m_summing"]))
    return dict(BLOCK_M=BM, BLOCK_N=BN)


def programs(n_blocks: int, device: torch.device, N: int = 0, reduces: bool = False) -> int:
    """Backward programs. Each writes one partial row of every per-column gradient; the generated
    `_colsum` kernel adds the partial rows (tree sums of blocks of rows), so more programs also means
    shorter sequential sums."""
    if device.type == "cuda":
        if _TRIALS:
            per_sm = _TRIALS[-1].programs_per_sm
        else:
            per_sm = (_column_sums(N, reduces) or (0, TABLE["cuda"]["programs_per_sm"]))[1]
        return max(1, min(n_blocks, per_sm * sm_count(device.index)))
    return max(1, min(n_blocks, TABLE["interpreter"]["max_programs"]))
