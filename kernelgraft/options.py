"""Options: what a user may set on `kernelgraft.optimize`, frozen and validated in one place, with
every default, and the rounding each backend implies. Every layer reads it; it imports nothing of
kernelgraft.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

BACKENDS = ("inductor", "eager")
ACCUMULATE = ("auto", "fp32", "weight")  # the LM head's weight-gradient sum: by the plan, in float32, in the weight's dtype
DDP_PIECE_MB = 100.0  # the least parameter size of a piece of a DDP-wrapped graph (MiB)
# torch.compile's modes (inductor backend); the last two run under CUDA graphs
MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
LAUNCHES = ("inductor", "host")  # who launches the kernels under inductor: its generated code, or ours
# who serves the row sites (norms, RoPE, gated MLPs) of a graph captured without gradients under inductor
INFERENCE = ("inductor", "kernels")
# inductor's wrapper code, which launches a compiled graph's kernels on CUDA: "auto" (C++ for
# the graphs of decoding steps, Python for the others), or Python for every graph
WRAPPERS = ("auto", "python")
# tokens per chunk of the fused LM head wherever neither lm_head_chunk nor lm_head_memory is given
CHUNK_ENV = "KERNELGRAFT_LM_HEAD_CHUNK"


def lm_head_chunk_from_env() -> int | None:
    """$KERNELGRAFT_LM_HEAD_CHUNK as tokens per chunk; None where it is unset, empty or 0.

    >>> import os
    >>> os.environ["KERNELGRAFT_LM_HEAD_CHUNK"] = "512"
    >>> lm_head_chunk_from_env()
    512
    >>> del os.environ["KERNELGRAFT_LM_HEAD_CHUNK"]
    """
    raw = os.environ.get(CHUNK_ENV, "")
    text = raw.strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()):  # int() would also take "-3", "+3" and "1_000"
        raise ValueError(
            f"kernelgraft: {CHUNK_ENV} must be a positive whole number of tokens per chunk (or 0, empty or "
            f"unset for the default), got {raw!r}"
        )
    return int(text) or None


def _size(value, scale: int) -> bool:
    """value is a positive number whose size in bytes (value * scale) is finite: no bool, inf or nan."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return value > 0 and math.isfinite(float(value) * scale)
    except OverflowError:  # an int beyond any float
        return False


@dataclass(frozen=True)
class Options:
    """How kernelgraft compiles a model (see `kernelgraft.optimize` for what each option does).

    >>> from kernelgraft import Options
    >>> Options().rounding, Options(backend="eager").rounding
    ('fused', 'autograd')
    >>> Options(recompute="fused")
    Traceback (most recent call last):
    ...
    ValueError: kernelgraft: recompute must be True, False or 'separate', got 'fused'
    """

    backend: str = "inductor"
    keep_logits: bool = False
    lm_head_chunk: int | None = None  # tokens per chunk; None: a chunk of logits of at most 256 MiB
    lm_head_accumulate: str = "auto"
    # a budget in GiB for the fused LM head's working memory (it then picks chunk and accumulation),
    # or "min"; None: chunks of lm_head_chunk tokens, or of at most 256 MiB of logits
    lm_head_memory: float | str | None = None
    causal_attention: bool = True
    recompute: bool | str = True  # True, False or "separate"
    ddp_piece_mb: float | None = DDP_PIECE_MB
    mode: str | None = None  # torch.compile's mode; None: "default"
    launch: str = "inductor"
    inference: str = "inductor"
    # linear layers that read one input (q/k/v, gate/up) as one matmul where it pays
    # (rewriter/projections.py): training graphs under inductor, small matmuls
    fuse_projections: bool = True
    wrapper: str = "auto"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"kernelgraft: backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"kernelgraft: mode must be one of {MODES} or None, got {self.mode!r}")
        if self.mode not in (None, "default") and self.backend != "inductor":
            raise ValueError(
                f"kernelgraft: mode={self.mode!r} is inductor's; with backend={self.backend!r} leave "
                "mode at None, or use backend='inductor'"
            )
        if self.launch not in LAUNCHES:
            raise ValueError(f"kernelgraft: launch must be one of {LAUNCHES}, got {self.launch!r}")
        if self.inference not in INFERENCE:
            raise ValueError(f"kernelgraft: inference must be one of {INFERENCE}, got {self.inference!r}")
        if self.wrapper not in WRAPPERS:
            raise ValueError(f"kernelgraft: wrapper must be one of {WRAPPERS}, got {self.wrapper!r}")
        if not isinstance(self.recompute, bool) and self.recompute != "separate":
            raise ValueError(
                f"kernelgraft: recompute must be True, False or 'separate', got {self.recompute!r}"
            )
        piece = self.ddp_piece_mb
        if piece is not None and not _size(piece, 2**20):
            raise ValueError(
                f"kernelgraft: ddp_piece_mb must be a positive, finite size in MiB or None (DDP's own "
                f"buckets), got {piece!r}"
            )
        if self.lm_head_accumulate not in ACCUMULATE:
            raise ValueError(
                f"kernelgraft: lm_head_accumulate must be one of {ACCUMULATE}, got {self.lm_head_accumulate!r}"
            )
        chunk = self.lm_head_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"kernelgraft: lm_head_chunk must be a positive number of tokens, got {chunk!r}")
        mem = self.lm_head_memory
        if mem is not None and mem != "min" and not _size(mem, 2**30):
            raise ValueError(
                f"kernelgraft: lm_head_memory must be a positive, finite budget in GiB, \"min\" or None, "
                f"got {mem!r}"
            )
        if mem is not None and chunk is not None:
            raise ValueError(
                "kernelgraft: set lm_head_memory (a budget: kernelgraft picks the chunk) or lm_head_chunk "
                "(the chunk itself), not both"
            )
        for name in ("keep_logits", "causal_attention", "fuse_projections"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kernelgraft: {name} must be True or False, got {getattr(self, name)!r}")
        lm_head_chunk_from_env()  # a bad value is said now, not at the first step of a model with an LM head

    @property
    def rounding(self) -> str:
        """How the kernels round: as the code around them will, eager's per-op rounding ("autograd")
        or inductor's fused one ("fused")."""
        return "fused" if self.backend == "inductor" else "autograd"

    @property
    def fuse_recompute(self) -> bool:
        """Recomputed outputs made by the sites' backward kernels (recompute=True, inductor)."""
        return self.recompute is True and self.backend == "inductor"

    @property
    def fuse_residual(self) -> bool:
        """The residual stream's adds joined to the norms' kernels (inductor; off with
        recompute="separate", which keeps every kernel op apart from the ops around it)."""
        return self.backend == "inductor" and self.recompute != "separate"

    @property
    def cuda_graphs(self) -> bool:
        """The compiled graphs run under CUDA graphs (mode "reduce-overhead" or "max-autotune"):
        nothing grafted may then read a value on the host or keep state outside the graph."""
        return self.mode in CUDA_GRAPH_MODES

    @property
    def inductor_launches(self) -> bool:
        """Inductor's generated code launches the kernels (where their arguments allow it: CUDA,
        static sizes; rewriter/lowering.py)."""
        return self.backend == "inductor" and self.launch == "inductor"

    def rows_left_to_inductor(self, training: bool) -> bool:
        """Whether a graph's row sites are left to inductor: a graph without gradients (generate(),
        evaluation) under the inductor backend with inference="inductor". There a row kernel would
        compute what inductor computes (it rounds as inductor's fused code does), one more launch:
        inductor fuses a norm with the residual add before it, RoPE with the KV cache's
        concatenation after it."""
        return not training and self.backend == "inductor" and self.inference == "inductor"

    def cpp_wrapper(self, training: bool, cuda: bool, dynamic: bool, kernels: bool) -> bool:
        """Whether inductor writes a graph's wrapper (the code that launches its kernels, once per
        call) in C++ rather than Python ("auto"): on CUDA, outside CUDA graphs (which replay the
        launches without any wrapper), for a graph without gradients, with dynamic sizes and none
        of kernelgraft's kernels (`kernels`): the graph of generate()'s decoding steps, which
        serves every token after the first few, its norms, RoPE and MLPs left to inductor. A token
        is a few hundred small kernels, whose launches from Python take longer than the GPU runs
        them. A C++ wrapper compiles for longer (a C++ compiler's run per graph), which such a
        graph repays, and a graph of fixed sizes (the prompt's, run once per call) does not.
        kernelgraft's own kernels stay with the Python wrapper, the one they are tested under."""
        if self.backend != "inductor" or not cuda or self.cuda_graphs or self.wrapper != "auto":
            return False
        return not training and dynamic and not kernels

    def replace(self, **changes) -> Options:
        return dataclasses.replace(self, **changes)
