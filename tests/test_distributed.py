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
    got = sorted(re.findall(r"rank (\d) (ok|FAIL[^\n]*?) (\d+) served (\d+)", r.stdout))
    assert [(rank, ok) for rank, ok, _, _ in got] == [("0", "ok"), ("1", "ok")], r.stdout
    for _, _, n, served in got:
        # the loss and the 21 parameters of the tiny Llama; kernels ran
        assert int(n) == 22 and int(served) >= 7
