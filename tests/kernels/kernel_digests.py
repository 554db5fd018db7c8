"""The generated Triton source of every built-in spelling, as sha256 digests: written once, compared
by tests/kernels/test_kernel_digests.py, so that a change to the generator or the primitives table that alters
a kernel's source shows up. `python tests/kernels/kernel_digests.py --write` records the current sources."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

import kernelgraft
from kernelgraft.kernels.lm_head.kernel import kernel_name, kernel_source
from kernelgraft.kernels.lm_head.transform import transform
from kernelgraft.kernels.rows.build import row_kernel
from kernelgraft.kernels.rows.codegen import module_source
from kernelgraft.kernels.rows.layout import layout

STORED = Path(__file__).resolve().parents[1] / "data" / "kernel_digests.json"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROUNDINGS = ("autograd", "fused")


def _name(dt) -> str:
    return str(dt).replace("torch.", "")


def row_sources():
    """(key, source) per row spelling, dtype mix and rounding: every tensor in one dtype, and (for
    bf16/fp16) the first in it with the others float32 (a norm's float32 weight)."""
    for sp in kernelgraft.patterns.REGISTRY.spellings():
        if sp.kernel != "row":
            continue
        args = sp.example_args(4, 16, torch.float32)
        tensors = {n: a for n, a in zip(sp.arg_names, args) if n in sp.tensor_names}
        kinds = layout(sp, tensors).kinds
        names = sp.tensor_names
        mixes = [{n: dt for n in names} for dt in DTYPES]
        mixes += [{n: (dt if i == 0 else torch.float32) for i, n in enumerate(names)} for dt in DTYPES[1:]]
        for dtypes in mixes:
            for rounding in ROUNDINGS:
                k = row_kernel(sp, dtypes, kinds, rounding)
                src = module_source(k.spec, k.backward, sp.qualname)
                key = f"{sp.qualname} {'/'.join(_name(dtypes[n]) for n in names)} {rounding}"
                yield key, src
                cuda = row_kernel(sp, dtypes, kinds, rounding, "cuda")
                if cuda is not k:  # rounds as CUDA's eager kernels do, where they differ from the CPU's
                    yield f"{key} cuda", module_source(cuda.spec, cuda.backward, sp.qualname)


def lm_head_sources():
    for sp in kernelgraft.patterns.REGISTRY.spellings():
        if sp.kernel != "lm_head_ce":
            continue
        for dt in DTYPES:
            for rounding in ROUNDINGS:
                for device in ("cpu", "cuda"):
                    tf = transform(sp, dt, rounding, device)
                    name = kernel_name(sp, dt, rounding)
                    yield f"{sp.qualname} {_name(dt)} {rounding} {device}", kernel_source(name, tf, sp.qualname, accurate_exp=device == "cuda")


def digests() -> dict:
    out = {}
    for key, src in (*row_sources(), *lm_head_sources()):
        out[key] = hashlib.sha256(src.encode()).hexdigest()
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        STORED.write_text(json.dumps(digests(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {STORED}")
    else:
        print(json.dumps(digests(), indent=1, sort_keys=True))
