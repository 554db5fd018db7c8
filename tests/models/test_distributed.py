"""optimize() under PyTorch's own data parallelism, on the CPU with gloo: 2 processes, DDP and
FSDP2 (fully_shard), the same gradients as the stock model under the same wrapper (the accuracy
rule against float64 under that wrapper). The worker is tests/helpers/dist_worker.py."""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two processes each

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "dist_worker.py"


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
        # buckets (here one per parameter: cut inside every pattern), 16 sites (12 if each piece
        # were grafted alone); FSDP2: one graph per layer, which dynamo captures once for both layers
        # (the report counts it once), 9 sites
        assert int(n) == 22 and int(served) == {"ddp": 16, "fsdp2": 9}[how], r.stdout
        # counts() is per step: FSDP2's one layer graph runs once per layer, its SDPA twice
        assert int(sdpa) == 2, r.stdout
        if how == "ddp":  # the mask is made and used in the one graph: proven there
            assert int(graphs) == 1 and int(causal) == 0, r.stdout
        else:  # the mask reaches each layer's graph as an input: checked at run time, causal
            assert int(graphs) > 1 and int(causal) >= 1, r.stdout


@pytest.mark.parametrize("how", ["ddp layers", "fsdp2 layers", "ddp-lora layers"])
def test_layers_captured_per_class_under_data_parallel_give_the_stock_gradients(how):
    r = subprocess.run(
        [sys.executable, str(WORKER), how, str(free_port())], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = sorted(re.findall(r"rank (\d) (ok|FAIL[^\n]*?) (\d+) served .* lora (\d+) per step (\d+)", r.stdout))
    assert [g[:2] for g in got] == [("0", "ok"), ("1", "ok")], r.stdout
    for _, _, n, lora, per_step in got:
        # every site of both layers served in each step: 2 norms, q and k's RoPE and the MLP per
        # layer, the final norm and the LM head (and with LoRA the 7 adapters of each layer); under
        # FSDP2 the layers' causal mask (an input of their graph, checked at run time) and grouped
        # keys and values too. DDP's pieces of the layers' graph are grafted whole, where a mask read
        # from an input is kept as written (not checked at run time): the numbers are stock's
        want = 12 + (14 if "lora" in how else 0) + (4 if how.startswith("fsdp2") else 0)
        assert int(n) == (1 + 28 if "lora" in how else 22), r.stdout  # the loss and each trained parameter
        assert int(per_step) == want and int(lora) == (14 if "lora" in how else 0), r.stdout


def test_lora_under_ddp_gives_the_stock_adapter_gradients():
    """peft's LoRA on every linear layer of a tiny Llama under DDP, each parameter a bucket of its
    own: every adapted layer is served, and the loss and the 28 adapter gradients (averaged over
    the two ranks) pass the rule."""
    r = subprocess.run(
        [sys.executable, str(WORKER), "ddp-lora", str(free_port())], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = sorted(re.findall(r"rank (\d) (ok|FAIL[^\n]*?) (\d+) served .* lora (\d+)", r.stdout))
    assert got == [("0", "ok", "29", "14"), ("1", "ok", "29", "14")], r.stdout


def test_recompute_survives_ddp_cutting_the_graph():
    # DDPOptimizer compiles each piece of the cut graph on its own; an output read in a later piece
    # is that piece's input, saved. kernelgraft keeps each recomputed kernel in one piece with
    # the ops that read its outputs (the gated MLP and its down projection; a norm and the q, k, v
    # or gate and up projections; the final norm, sliced, and the LM head). Here every matmul is a
    # piece of its own, the worst case (ddp_piece_mb=None), and then a few pieces (optimize's
    # ddp_piece_mb cutting coarser than DDP's buckets).
    r = subprocess.run(
        [sys.executable, str(WORKER), "ddp-recompute", str(free_port())],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = re.findall(
        r"recompute (\w+) ddp (\w+) saved (\d+) mlp (\d+) moved (\d+) kept (\[.*?\]) grads (ok|-|FAIL.*?) "
        r"pieces (\d+) at (\S+)",
        r.stdout,
    )
    assert len(rows) == 5, r.stdout
    assert all(kept == "[]" for _, _, _, _, _, kept, _, _, _ in rows), (
        r.stdout
    )  # no plan dropped for DDP's own cut
    # by (recompute, under DDP, ddp_piece_mb): (bytes saved, MLP-wide tensors saved, grads, moved, pieces)
    got = {
        (rc == "True", ddp == "True", None if at == "None" else float(at)): (
            int(n),
            int(mlp),
            ok,
            int(m),
            int(p),
        )
        for rc, ddp, n, mlp, m, _, ok, p, at in rows
    }
    cut, cut_off, whole, whole_off = (
        (True, True, None),
        (False, True, None),
        (True, False, None),
        (False, False, None),
    )
    coarse = (True, True, 0.1)
    # the report says what the cut did: nodes moved only where calls are recomputed and DDP cuts
    assert got[cut][3] > 0 and got[coarse][3] > 0, r.stdout
    assert got[cut_off][3] == got[whole][3] == got[whole_off][3] == 0, r.stdout
    # and how many pieces it cut the graph into: under DDP only; at DDP's buckets (ddp_piece_mb None:
    # a bucket per parameter here) one per matmul at least; at 0.1 MiB a quarter as many (8 of 32)
    assert got[cut][4] > 7 and got[cut_off][4] > 7 and got[whole][4] == got[whole_off][4] == 0, r.stdout
    assert 1 < got[coarse][4] <= got[cut][4] // 4, r.stdout
    assert got[cut][2] == got[cut_off][2] == got[coarse][2] == "ok", r.stdout  # the rule, under DDP
    # per layer (2): the MLP's gate and up, which its kernel's backward reads; its output too only
    # where it is not recomputed
    assert got[whole][1] == got[cut][1] == got[coarse][1] == 2 * 2, r.stdout
    assert got[whole_off][1] == got[cut_off][1] == 3 * 2, r.stdout
    # q/k/v and gate/up fused (the default), cut at DDP's buckets: every group fused, the rule holds
    fused = re.search(r"projections fused (\d+) ddp grads (ok|FAIL.*?) pieces (\d+)", r.stdout)
    assert fused and fused[1] == str(2 * 2) and fused[2] == "ok" and int(fused[3]) > 1, r.stdout
    # under the cut the forward saves exactly what it saves unwrapped (before: 250,888 of the
    # 251,784 bytes saved without recompute, against 185,352 unwrapped)
    assert got[cut][0] == got[whole][0] == got[coarse][0] < got[cut_off][0] == got[whole_off][0], r.stdout
