"""Options.memory: the levers a training step's memory budget picks, at the model's first training call.

The step's device memory is estimated from the model's config and the call's tokens:

    static        parameters, the trainable ones' gradients and two optimizer states each
    activations   per layer and token, what a decoder layer keeps for its backward:
                  (6 hidden + 2 kv + 3 intermediate) values of the activations' dtype
                  (the norms' inputs, q/k/v, attention's output, the MLP's gate, up and product)
    head          the fused LM head's chunk of logits and its gradients

Levers, cheapest first, each taken only where the step does not fit without it:

    nothing       the step fits: the defaults run (no slowdown on rows that fit)
    offload       each layer keeps only its input, on the host: one layer's activations on the device
                  (where the model has a layer stack: offload.layer_stacks)
    tile_tokens   the token-wise regions run over tiles of the sequence: the MLP's intermediates are
                  one tile's (a tile is at least MIN_TILE positions)
    lm_head       the fused head's share of what is left (`lm_head_memory`)

A lever the user set (`offload`, `tile_tokens`, `lm_head_chunk`/`lm_head_memory`) keeps its value.
What was chosen, and why, is `report.memory`.
"""

from __future__ import annotations

import dataclasses

import torch

GiB = 2**30
# of the budget, what the estimate may fill: the allocator's fragmentation, attention's workspace and
# cuBLAS's are not in it
FILL = 0.85
MIN_TILE = 1024


@dataclasses.dataclass
class MemoryChoice:
    """What Options.memory chose for a model's training steps, with the estimate it read."""

    budget_gib: float
    tokens: int
    estimate_gib: float  # the step without any lever
    offload: bool
    tile_tokens: int | None
    lm_head_memory: float | str | None
    why: list[str]

    def __str__(self) -> str:
        levers = [
            n
            for n, on in (("offload", self.offload), (f"tiles of {self.tile_tokens}", self.tile_tokens))
            if on
        ]
        head = f"; LM head budget {self.lm_head_memory} GiB" if isinstance(self.lm_head_memory, float) else ""
        return (
            f"memory: budget {self.budget_gib:.1f} GiB, {self.tokens} tokens, step estimated at "
            f"{self.estimate_gib:.1f} GiB without levers -> {', '.join(levers) or 'no lever'}{head}. "
            + " ".join(self.why)
        )


def budget_bytes(memory, device: torch.device) -> int:
    """The budget in bytes: GiB as given, or for "auto" what the device has for this process (its free
    memory and what torch's allocator holds already)."""
    if memory != "auto":
        return int(float(memory) * GiB)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device))
    import psutil  # a CPU step: the host's available memory

    return int(psutil.virtual_memory().available)


def _config(model) -> dict | None:
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "get_text_config", None)
    cfg = text() if callable(text) else cfg
    try:
        hidden, layers = int(cfg.hidden_size), int(cfg.num_hidden_layers)
    except (AttributeError, TypeError):
        return None
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
    inter = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
    return dict(
        hidden=hidden, layers=layers, kv=kv, inter=inter, vocab=int(getattr(cfg, "vocab_size", 0) or 0)
    )


def _static_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        size = p.numel() * p.element_size()
        total += size * (4 if p.requires_grad else 1)  # + gradient + two optimizer states
    for b in model.buffers():
        total += b.numel() * b.element_size()
    return total


def _activation_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point() and p.dtype in (torch.bfloat16, torch.float16, torch.float32):
            return p.dtype
    return torch.float32


def choose(
    model, options, batch: int, seq: int, device: torch.device, no_stack: str = ""
) -> MemoryChoice | None:
    """The levers for a step of `batch` sequences of `seq` tokens under options.memory; None where
    the model's config gives no decoder shape (the report says so instead). `no_stack`: why the
    model has no layer stack to offload ("": it has one); the other levers are chosen then."""
    tokens = batch * seq
    cfg = _config(model)
    if cfg is None:
        return None
    budget = budget_bytes(options.memory, device)
    d = torch.finfo(_activation_dtype(model)).bits // 8
    H, L, kv, inter = cfg["hidden"], cfg["layers"], cfg["kv"], cfg["inter"]
    static = _static_bytes(model)
    per_layer = tokens * d * (6 * H + 2 * kv + 3 * inter)
    head = 3 * 256 * 2**20  # the default chunk of logits, its gradient and the float32 sum
    plain = static + L * per_layer + head + 4 * tokens * H * d
    room = FILL * budget
    why: list[str] = []
    offload, tile, lm_head = options.offload, options.tile_tokens, options.lm_head_memory
    if plain <= room:
        why.append("The step fits: no lever is needed.")
        return MemoryChoice(budget / GiB, tokens, plain / GiB, bool(offload), tile, lm_head, why)
    if offload is None and no_stack:
        offload = False
        why.append(
            f"Not offloaded, though {L} layers' activations ({L * per_layer / GiB:.1f} GiB) exceed the "
            f"budget: the model has no layer stack to offload ({no_stack})."
        )
    elif offload is None:
        offload = True
        why.append(f"Offloaded: {L} layers' activations ({L * per_layer / GiB:.1f} GiB) exceed the budget.")
    else:
        why.append(f"offload={offload} as given.")
    kept = per_layer if offload else L * per_layer
    streams = 4 * tokens * H * d  # the hidden states between layers, their gradients
    left = room - static - streams - (kept - tokens * d * 3 * inter)  # what the MLP's intermediates may take
    if tile is None and left < tokens * d * 3 * inter:
        fit = max(int(left // (d * 3 * inter * batch)), 1)  # positions of the sequence per tile
        tile = max(MIN_TILE, 1 << (fit.bit_length() - 1))
        if tile >= seq:
            tile = None
            why.append(f"Not tiled: a tile is at least {MIN_TILE} positions, the sequence {seq}.")
        else:
            why.append(
                f"Tiled by {tile} positions: one layer's MLP intermediates ({tokens * d * 3 * inter / GiB:.1f} "
                f"GiB) exceed what is left ({max(left, 0) / GiB:.1f} GiB)."
            )
        if left <= 0:
            why.append("Even so the estimate exceeds the budget: the step may not fit.")
    if lm_head is None and options.lm_head_chunk is None and left < 4 * head:
        lm_head = "min"
        why.append("LM head: its smallest chunks, as little is left.")
    return MemoryChoice(budget / GiB, tokens, plain / GiB, bool(offload), tile, lm_head, why)


def call_shape(args, kwargs) -> tuple[int, int, torch.device] | None:
    """(batch, sequence, device) of a call's input ids or embeddings."""
    for t in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1]), t.device
    return None
