"""Where the host time of one fwd+bwd goes (cProfile), next to its device time.

python benchmarks/profile_overhead.py [--shape 16384x4096] [--calls 50]
    kernelgraft's RMSNorm op called eagerly (its Python launcher)
python benchmarks/profile_overhead.py --compiled RMSNorm [--calls 50]
    a spelling of the benchmark suite (a case whose name contains the word) compiled by
    torch.compile and by the kernelgraft backend: host time of the forward and of the backward,
    the CUDA kernels each launches, and cProfile's costliest functions, side by side"""

import argparse
import cProfile
import io
import pstats
import time

import torch

from kernelgraft.kernels import op_for
from kernelgraft.patterns import REGISTRY


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--compiled", metavar="CASE", help="a suite case compiled both ways (see above)")
    a = ap.parse_args()
    if a.compiled:
        return compiled(a.compiled, a.calls)
    M, N = map(int, a.shape.split("x"))
    op = op_for(REGISTRY.get("rms_norm", "llama"))
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.autograd.grad(op(x, w, 1e-6), (x, w), g)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.calls):
        step()
    host = (time.perf_counter() - t) / a.calls  # launches are asynchronous: this is host time per call
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / a.calls
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        step()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
    print(s.getvalue())
    print(f"host time per fwd+bwd {host * 1e6:.0f} us, wall (after sync) {wall * 1e6:.0f} us")


def _host_ms(fn, calls: int) -> float:
    """Median host time of fn, ms: each run timed without waiting for the device (a sync between
    calls, outside the timing, keeps the launch queue from filling)."""
    ts = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def _bypass_reasons() -> list:
    """The reasons inductor logs when it launches a kernel through Triton's launcher instead of its
    static one, collected from here on."""
    import logging

    reasons = []

    class Keep(logging.Handler):
        def emit(self, record):
            reasons.append(record.getMessage()[:300])

    log = logging.getLogger("torch._inductor.runtime.triton_heuristics")
    log.setLevel(logging.INFO)
    log.addHandler(Keep(logging.INFO))
    return reasons


def compiled(case: str, calls: int) -> None:
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import suite
    from benchlib import profile_kernels

    import kernelgraft
    from kernelgraft.rewriter.lowering import launcher_kinds

    name, fn, _, make, _ = next(c for c in suite.pattern_cases(True) if case in c[0])
    modes = {
        "torch.compile": torch.compile(fn, dynamic=False),
        "kernelgraft (inductor)": torch.compile(fn, backend=kernelgraft.Grafter("inductor"), dynamic=False),
    }
    print(f"## {name}")
    bypassed = _bypass_reasons()
    for mode, f in modes.items():
        torch.manual_seed(0)
        args = make()
        leaves = [t for t in args if t.requires_grad]
        outs = f(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g0 = [torch.randn_like(o) for o in outs]
        held = {}

        def forward(f=f, args=args, held=held):
            o = f(*args)
            held["o"] = o if isinstance(o, tuple) else (o,)

        def backward(leaves=leaves, g0=g0, held=held):
            torch.autograd.grad(held.pop("o"), leaves, g0)

        def both():
            forward()
            backward()

        for _ in range(10):
            both()
        if mode.startswith("kernelgraft"):
            print(
                f"kernelgraft's kernels by launcher: {launcher_kinds()}; static launch refused: {bypassed or 'never'}"
            )
        fwd_ms, bwd_ms = [], []
        for _ in range(calls):
            torch.cuda.synchronize()
            t = time.perf_counter()
            forward()
            t1 = time.perf_counter()
            backward()
            t2 = time.perf_counter()
            fwd_ms.append((t1 - t) * 1e3)
            bwd_ms.append((t2 - t1) * 1e3)
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        print(
            f"\n### {mode}: host ms, forward {med(fwd_ms):.3f}, backward {med(bwd_ms):.3f}, both {_host_ms(both, calls):.3f}"
        )
        for ms, n, k in profile_kernels(both, 20):
            print(f"  {ms:8.4f} ms x{n}  {k[:110]}")
        for part in ("forward", "backward"):
            prof = cProfile.Profile()
            for _ in range(calls):
                if part == "backward":
                    forward()
                torch.cuda.synchronize()
                prof.enable()
                forward() if part == "forward" else backward()
                prof.disable()
                if part == "forward":
                    backward()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(f"\n#### {mode}, {part}, cProfile over {calls} calls, by own time")
            print("\n".join(s.getvalue().splitlines()[4:]))


if __name__ == "__main__":
    main()
