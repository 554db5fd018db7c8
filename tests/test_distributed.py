"""optimize() under PyTorch's own data parallelism, on the CPU with gloo: 2 processes, DDP and
FSDP2 (fully_shard), the same gradients as the stock model under the same wrapper (the DESIGN.md
rule against float64 under that wrapper). The worker is tests/dist_worker.py."""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "dist_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_optimized_model_under_data_parallel_gives_the_stock_gradients(how):
    r = subprocess.run(
        [sys.executable, str(WORKER), how, str(free_port())], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-4000:]
    pat = r"rank (\d) (ok|FAIL[^\n]*?) (\d+) served (\d+) sdpa (\d+) graphs (\d+) checked causal (\d+)"
    got = sorted(re.findall(pat, r.stdout))
    assert [g[:2] for g in got] == [("0", "ok"), ("1", "ok")], r.stdout
    for _, _, n, served, sdpa, graphs, causal in got:
        # the loss and the 21 parameters of the tiny Llama; every site served: 7 per layer (2 norms,
        # rope's q and k, the MLP, the attention's causal mask, its grouped keys and values) + the
        # final norm and the LM head. DDP: the graph is grafted whole before dynamo cuts it at the
        # buckets (here one per parameter: cut inside every pattern), 16 sites (12 when each piece
        # was grafted alone); FSDP2: one graph per layer, which dynamo captures once for both layers
        # (the report counts it once), 9 sites
        assert int(n) == 22 and int(served) == {"ddp": 16, "fsdp2": 9}[how], r.stdout
        assert int(sdpa) == {"ddp": 2, "fsdp2": 1}[how], r.stdout
        if how == "ddp":  # the mask is made and used in the one graph: proven there
            assert int(graphs) == 1 and int(causal) == 0, r.stdout
        else:  # the mask reaches each layer's graph as an input: checked at run time, causal
            assert int(graphs) > 1 and int(causal) >= 1, r.stdout


def test_recompute_survives_ddp_cutting_the_graph():
    # DDPOptimizer compiles each piece of the cut graph on its own; an output read in a later piece
    # is that piece's input, saved. kernelgraft keeps each recomputed kernel call in one piece with
    # the ops that read its outputs (the gated MLP and its down projection; a norm and the q, k, v
    # or gate and up projections; the final norm, sliced, and the LM head). Here every matmul is a
    # piece of its own, the worst case.
    r = subprocess.run(
        [sys.executable, str(WORKER), "ddp-recompute", str(free_port())],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = re.findall(
        r"recompute (\w+) ddp (\w+) saved (\d+) mlp (\d+) moved (\d+) kept (\[.*?\]) grads (ok|-|FAIL[^\n]*)",
        r.stdout,
    )
    got = {(rc == "True", ddp == "True"): (int(n), int(mlp), ok) for rc, ddp, n, mlp, _, _, ok in rows}
    moved = {(rc == "True", ddp == "True"): int(m) for rc, ddp, _, _, m, _, _ in rows}
    assert all(kept == "[]" for *_, kept, _ in rows), r.stdout  # no plan dropped for DDP's own cut
    # the report says what the cut did: nodes moved only where calls are recomputed and DDP cuts
    assert moved[True, True] > 0 and moved[False, True] == moved[True, False] == moved[False, False] == 0, (
        r.stdout
    )
    assert len(got) == 4, r.stdout
    # and how many pieces it cut the graph into: one per matmul at least, under DDP only
    pieces = {(rc == "True", ddp == "True"): int(p) for rc, ddp, p in re.findall(r"recompute (\w+) ddp (\w+) .* pieces (\d+)", r.stdout)}
    assert pieces[True, True] > 7 and pieces[False, True] > 7 and pieces[True, False] == pieces[False, False] == 0, r.stdout
    assert got[True, True][2] == "ok" and got[False, True][2] == "ok", r.stdout  # the rule, under DDP
    # per layer (2): the MLP's gate and up, which its kernel's backward reads; its output too only
    # where it is not recomputed
    assert got[True, False][1] == got[True, True][1] == 2 * 2, r.stdout
    assert got[False, False][1] == got[False, True][1] == 3 * 2, r.stdout
    # under the cut the forward saves exactly what it saves unwrapped (before: 250,888 of the
    # 251,784 bytes saved without recompute, against 185,352 unwrapped)
    assert got[True, True][0] == got[True, False][0] < got[False, True][0] == got[False, False][0], r.stdout
