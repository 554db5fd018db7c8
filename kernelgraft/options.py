"""Options: what a user may set on `kernelgraft.optimize`, frozen and validated in one place, with
every default, and the rounding each backend implies. Every layer reads it; it imports nothing of
kernelgraft.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import os
from dataclasses import dataclass
from pathlib import Path

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
    """Every option of `kernelgraft.optimize`, validated, with its default. The text under each
    field is that option's documentation, written once: `help(kernelgraft.optimize)` shows the same
    text. `kernelgraft.Grafter(options=Options(...))` is the torch.compile backend with options of
    your own.

    >>> from kernelgraft import Options
    >>> Options().rounding, Options(backend="eager").rounding
    ('fused', 'autograd')
    >>> Options(recompute="fused")
    Traceback (most recent call last):
    ...
    ValueError: kernelgraft: recompute must be True, False or 'separate', got 'fused'
    """

    backend: str = "inductor"
    """Who compiles the code around the kernels: `"inductor"` (the fast one on a GPU: inductor
    compiles the graph and launches the kernels itself) or `"eager"` (the captured graph runs as
    PyTorch would, each kernel called through kernelgraft's Python launcher on every call). Use
    `"eager"` where inductor is unavailable or slow to compile (the CPU, quick experiments, very
    large graphs), to have the kernels round exactly where eager PyTorch rounds, or to debug."""

    keep_logits: bool = False
    """Keep the full logits of a training forward. By default the LM head and its loss are fused
    in training (labels given, gradients on): the logits are never made, and `output.logits` is a
    `WithheldLogits` that raises, saying how to get them, when used. `True` keeps them, and the LM
    head is then not fused. Without labels, or under `torch.no_grad()`, logits are returned as
    usual either way."""

    lm_head_chunk: int | None = None
    """Tokens per chunk of the fused LM head. `None`: chunks of at most 256 MiB of logits, or the
    chunk `lm_head_memory` picks. The environment variable `KERNELGRAFT_LM_HEAD_CHUNK=N` (a
    positive whole number) sets the tokens per chunk wherever neither this nor `lm_head_memory` is
    given; 0, empty or unset keeps the default, and any other value is refused when `optimize()`
    runs. Set either this or `lm_head_memory`, not both."""

    lm_head_accumulate: str = "auto"
    """How the fused LM head sums its weight gradient over the chunks. `"auto"`: a bf16/fp16 head
    sums in the weight's own dtype where that leaves at most 8 chunks of at least 1024 tokens
    (where that sum is as accurate as the unfused model's), and in float32 elsewhere; `"fp32"`
    always sums in float32 (as accurate as the unfused model); `"weight"` always sums in the
    weight's dtype (half the memory, less accurate over many chunks)."""

    lm_head_memory: float | str | None = None
    """A budget in GiB for what the fused LM head holds at once besides its inputs (the weight
    gradient, h's gradient, one chunk of logits): kernelgraft then takes the largest chunk that
    fits and the sum that keeps it accurate, and warns where only a less accurate sum fits.
    `"min"` sums in the weight's dtype over chunks of 512 tokens. `None`: the chunking of
    `lm_head_chunk`. Use it to trade time for memory."""

    memory: float | str | None = None
    """A budget in GiB for a training step's memory on the device, or `"auto"` (the device's free
    memory when the model is optimized). kernelgraft picks the levers below from it, at the first
    training step, from the step's shape: the LM head's chunks (`lm_head_memory`), token tiles
    (`tile_tokens`) and offloaded activations (`offload`); `report.memory` says what it chose and
    why. A lever given its own value keeps it. `None`: none is picked (each lever's own default)."""

    offload: bool | None = None
    """Training: each decoder layer keeps only its input for the backward, in pinned host memory
    (copied on a stream of its own while the next layers run; the backward fetches each one a layer
    ahead), and runs again in the backward to make its gradients: activation checkpointing with the
    checkpoints off the device. It replaces Hugging Face's gradient checkpointing where that is on.
    `None`: on where `memory` needs it."""

    capture: str = "whole"
    """How the model is captured. `"whole"`: the model in one graph (every layer traced, rewritten
    and compiled on its own: the first call's compile grows with depth; fusions cross the layers'
    boundaries). `"layers"`: its decoder layers (the model's layer stack: the `nn.ModuleList` of one
    class that its config's layer count names) through one compiled graph per layer class, which
    serves every layer: dynamo, the rewriter and inductor run once for it, whatever the depth; the
    final norm, the LM head and its loss are captured around them, and the layers' parent module
    (embeddings, rotary tables, the attention mask) runs as Python; a model without a layer stack
    is captured whole, and the report says why. `offload` (and a
    `memory` that offloads) captures the layers so whatever this says. "layers" starts faster and
    steps no slower on the GPU rows benchmarks/RESULTS.md measures; "whole", the default, decodes
    faster (one graph per token instead of one per layer)."""

    tile_tokens: int | None = None
    """Training graphs: the token-wise regions (norms, projections, gated MLPs, residual adds) whose
    intermediates would exceed their share of memory run over tiles of this many tokens of the
    sequence, each tile made again in the backward: their intermediates are one tile's. Token-wise
    ops round as untiled; only the weights' gradients are summed over the tiles, in float32. `None`:
    untiled, unless `memory` picks a tile."""

    causal_attention: bool = True
    """Run an attention call whose mask the captured graph proves to be the causal mask with
    `is_causal=True` instead of the mask (a mask that reaches a graph as an input is checked at
    run time), and let calls left without a mask read grouped keys and values as they are.
    `False` keeps every mask as the model builds it."""

    recompute: bool | str = True
    """Inductor backend: make the outputs of the gated-MLP and RMSNorm kernels again in the
    backward, from the inputs their own backward keeps, instead of saving them for the matmuls
    that read them (less memory; the site's backward kernel makes the output in the pass that makes
    its gradients). `False` saves them; `"separate"` runs the forward kernel again instead, and
    keeps every kernel op apart from the ops around it (the residual adds stay out of the norms'
    kernels). A site whose output only leaves the graph is not recomputed."""

    ddp_piece_mb: float | None = DDP_PIECE_MB
    """Under `DistributedDataParallel`: dynamo cuts the model's graph where DDP's gradient buckets
    fill, each piece a compiled function called on its own; kernelgraft cuts it into pieces of at
    least this many MiB of parameters (DDP's `bucket_cap_mb` where larger), to spend less host time
    per step. DDP's buckets are unchanged and still all-reduced while the backward runs. `None`:
    cut at DDP's buckets, as torch.compile does."""

    mode: str | None = None
    """torch.compile's mode (inductor backend; `None` is `"default"`). `"reduce-overhead"` runs the
    compiled graphs, kernelgraft's kernels inside, under CUDA graphs (call
    `torch.compiler.cudagraph_mark_step_begin()` at the start of each training step): use it where
    the host sets the pace (small models, small batches). The fused LM head then makes its
    gradients in the backward from the loss's gradient on the GPU (one more logits matmul per
    chunk, no host sync)."""

    launch: str = "inductor"
    """Inductor backend, CUDA: who launches the kernels. `"inductor"` has inductor's generated code
    launch them, their grids and strides fixed when the graph compiles; `"host"` launches them from
    kernelgraft's Python launcher on every call (the eager backend's way), for comparison."""

    inference: str = "inductor"
    """Inductor backend: who serves the norms, RoPE and gated MLPs of a graph captured without
    gradients (`generate()`, evaluation under `torch.no_grad()`). `"inductor"` leaves them to
    inductor, which fuses a norm with the residual add before it and RoPE with the KV cache's
    concatenation after it (fewer launches per token, the same numbers: the kernels round as
    inductor's fused code does); `"kernels"` serves them with kernelgraft's forward kernels.
    Training graphs are unaffected."""

    fuse_projections: bool = True
    """Inductor backend, training graphs: linear layers that read the same input (a layer's q, k
    and v; its gate and up) run as one matmul on their stacked weights, where that matmul is small
    enough (at most 1e11 flops) that launches, not work, set its pace. Larger stacked weights are
    made again in the backward rather than kept. The report lists each group
    (`report.projections`) with why it was fused or not. `False` leaves every linear layer apart."""

    wrapper: str = "auto"
    """Inductor backend, CUDA, outside CUDA graphs: the language of the code inductor writes to
    launch a graph's kernels, once per call. `"auto"` writes C++ for the graph of `generate()`'s
    decoding steps (no gradients, dynamic sizes, none of kernelgraft's kernels: a token is a few
    hundred small kernels, whose launches from Python take longer than the GPU runs them) and
    Python for every other graph; `"python"` writes Python for every graph. The C++ wrapper needs a
    C++ compiler and makes the first call slower; where it fails to compile, the graph is compiled
    again with the Python wrapper, with a warning. `report.wrappers` counts graphs by wrapper."""

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
        budget = self.memory
        if budget is not None and budget != "auto" and not _size(budget, 2**30):
            raise ValueError(
                f"kernelgraft: memory must be a positive, finite budget in GiB, \"auto\" or None, got {budget!r}"
            )
        if self.offload is not None and not isinstance(self.offload, bool):
            raise ValueError(f"kernelgraft: offload must be True, False or None, got {self.offload!r}")
        if self.capture not in ("layers", "whole"):
            raise ValueError(f"kernelgraft: capture must be \"layers\" or \"whole\", got {self.capture!r}")
        tile = self.tile_tokens
        if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
            raise ValueError(f"kernelgraft: tile_tokens must be a positive number of tokens or None, got {tile!r}")
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


@functools.cache
def field_docs() -> dict[str, str]:
    """Each Options field's documentation: the string written right after the field in this
    module (where mkdocstrings reads it), read from the source so that it is written once.

    >>> field_docs()["backend"].split(":")[0]
    'Who compiles the code around the kernels'
    """
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == Options.__name__)
    docs = {}
    for field, after in zip(cls.body, cls.body[1:]):
        text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(text, str):
            docs[field.target.id] = inspect.cleandoc(text)
    return docs


def with_options_help(doc: str | None) -> str | None:
    """`doc`, a Google-style docstring, with an "Other Parameters" section before its "Examples:"
    section (or at its end): every Options field and its documentation, as `optimize` shows them.
    None (docstrings stripped by `python -OO`) stays None.

    >>> lines = with_options_help("Do it.\\n\\nExamples:\\n    >>> 1").splitlines()
    >>> lines[2], lines[3].split(":")[0], lines[-2]
    ('Other Parameters:', '    backend', 'Examples:')
    """
    if doc is None:
        return None
    docs = field_docs()
    missing = [f.name for f in dataclasses.fields(Options) if f.name not in docs]
    if missing:
        raise RuntimeError(f"kernelgraft: Options fields without documentation: {missing}; write one under each")
    section = ["Other Parameters:"]
    for name, text in docs.items():
        first, *rest = text.splitlines()
        section += [f"    {name}: {first}", *(f"        {line}" if line else "" for line in rest)]
    lines = inspect.cleandoc(doc).splitlines()
    at = lines.index("Examples:") if "Examples:" in lines else len(lines)
    return "\n".join(lines[:at] + section + [""] + lines[at:])

