"""The repaired tiny config, for an architecture tiny_config cannot build or run: the architecture's
default config made tiny by attribute names and values alone (never by its name), SHRINK and the
functions below it."""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

from .configs import TOKENS, VOCAB

WIDTH, DEPTH, HEADS, KV_HEADS, HEAD_DIM, ROPE_DIM = 64, 2, 4, 2, 16, 8
FFN, EXPERTS, TOP_K, RANK, POSITIONS = 96, 8, 2, 32, 128
HEADS_RULE, KV_HEADS_RULE = r"heads$|^n_head$", r"kv_heads$|key_value_heads$|kv_n_heads$|query_groups$"
ROPE_DIM_RULE, HEAD_DIM_RULE = r"(rope|rotary).*dim$", r"head_?dim$|d_head$|^d_kv$|head_size$"
# (name pattern, tiny value), the first match wins: an int attribute above its tiny value becomes it;
# a value that is a function takes the number of layers (DEPTH, or the `layers` a caller asks for)
_LAYERS, _LAYERS_BUT_ONE = (lambda layers: layers), (lambda layers: layers - 1)
SHRINK = [
    (ROPE_DIM_RULE, ROPE_DIM),  # qk_rope_head_dim, rotary_dim: RoPE on 8 of a head's 16
    (HEAD_DIM_RULE, HEAD_DIM),  # head_dim, v_head_dim, qk_nope_head_dim, ...
    (r"rank$", RANK),  # q_lora_rank, kv_lora_rank, dt_rank, adapter_rank
    (r"intermediate|ffn|^d_ff$|^d_inner$|^n_inner$|feed_forward_size", FFN),
    (KV_HEADS_RULE, KV_HEADS),
    (HEADS_RULE, HEADS),  # also where they do not divide the width (whisper's 6)
    (r"experts_per_tok|top_?k$", TOP_K),
    (r"experts$|expert_num$", EXPERTS),
    (r"groups?$", 1),  # n_group, topk_group, mamba_n_groups: one group of experts (or of SSM heads)
    (r"^(num_hidden_layers|num_layers|n_layers?|(en|de)coder_layers|num_(en|de)coder_layers)$", _LAYERS),
    (r"^(depth|num_blocks|conf_num_hidden_layers)$", _LAYERS),
    (r"shared_layers$", 0),  # KV-shared layers: two layers cannot hold each attention kind and a sharer
    (r"_layers$|^first_k_dense", _LAYERS_BUT_ONE),  # a count of some layers (dense, MoE, ...): one of each
    (r"vocab", VOCAB),  # vocab_size, decoder_vocab_size, ngram_vocab_size_base, ...
    (r"^max_position_embeddings$|^n_positions$|^n_ctx$|^max_seq_len$|model_max_length$", POSITIONS),
    (r"hidden_size|^d_model$|^n_embd$|embed_dim$|^embedding_dim$|^lru_width$|_dim$", WIDTH),
]


def _shrunk(name: str, value, layers: int):
    """An int attribute's tiny value by SHRINK; a dropout probability 0 (a check compares two
    runs); any other value unchanged."""
    if isinstance(value, float) and re.search(r"drop", name):
        return 0.0
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    if name in TOKENS:
        return TOKENS[name] if value >= VOCAB else value
    for pattern, tiny in SHRINK:
        if re.search(pattern, name):
            tiny = tiny(layers) if callable(tiny) else tiny
            return tiny if value > tiny or (pattern == HEADS_RULE and WIDTH % value) else value
    return value


def _kinds(kinds: list, layers: int) -> list:
    """A per-layer list of kinds (layer_types, mlp_layer_types, block_types, ...) cut to `layers`,
    its last layers taking the kinds the cut lost (in order of first appearance): two layers of a
    hybrid model hold a linear-attention (or recurrent, or sliding) layer AND a full-attention one."""
    out = list(kinds[:layers])
    lost = [k for k in dict.fromkeys(kinds) if k not in out]
    for i, k in enumerate(lost[: layers - 1]):
        out[layers - 1 - i] = k
    return out


def _tiny_list(name: str, value: list, depth: int, layers: int) -> list:
    """A list attribute, tiny: kinds per layer (strings) by _kinds; a [[kinds], repeats] spec expanded
    to `layers`; a per-layer list (as long as the default `depth`) cut to `layers`, each entry shrunk;
    layer indices (a name with "layer", "ids" or "indices") kept below `layers`, the last layer where
    none is."""
    if len(value) > layers and all(isinstance(v, str) for v in value):
        return _kinds(value, layers)
    spec = all(isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[0], list) for v in value)
    if value and spec and sum(len(k) * n for k, n in value) == depth:  # e.g. [[["global", "local"], 12]]
        return [[_kinds(list(value[0][0]) * layers, layers), 1]]
    if len(value) == depth and depth > layers:
        return [_shrunk(name, v, layers) for v in value[:layers]]
    if value and all(isinstance(v, int) for v in value) and re.search(r"layer|ids$|indices$", name):
        kept = [v for v in value if v < layers]
        return kept or [layers - 1]
    return value


def _declared(cls) -> dict:
    """The attributes a config class declares (its dataclass fields past PretrainedConfig's) and
    their declared defaults: a declared None is derived in __post_init__ from the others."""
    from transformers import PretrainedConfig

    if not dataclasses.is_dataclass(cls):
        return {}
    base = {f.name for f in dataclasses.fields(PretrainedConfig)}
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in base}


def _values(cfg) -> dict:
    """cfg's attributes: those its class declares as attributes (sub-configs as configs), the rest
    as its to_dict() has them (a heterogeneous config's per-layer ones, which it will not give as
    attributes, and its per-layer overrides)."""
    values = cfg.to_dict()
    for name in _declared(type(cfg)):
        try:
            values[name] = getattr(cfg, name)
        except (AttributeError, RuntimeError):  # a per-layer one: AmbiguousGlobalPerLayerAttributeError
            pass
    return values


def _depth(values: dict) -> int:
    """The config's (default) number of layers, 0 if it names none."""
    for name in ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "depth"):
        if isinstance(values.get(name), int):
            return values[name]
    return 0


def _tiny_kwargs(cfg, layers: int) -> dict:
    """The keyword arguments that rebuild config `cfg` tiny, of `layers` layers: _tiny_value of each
    attribute its class declares, then _mamba_heads and _ties."""
    values = _values(cfg)
    depth, kw = _depth(values), {}
    for name, default in _declared(type(cfg)).items():
        value = _tiny_value(name, values.get(name), default, values, depth, layers)
        if value is not DERIVED:
            kw[name] = value
    return _ties(_mamba_heads(kw), values)


DERIVED = object()  # _tiny_value's "leave it out": __post_init__ derives it from the others


def _tiny_value(name: str, value, default, values: dict, depth: int, layers: int):
    """One declared attribute's tiny value: a sub-config (text_config, vision_config, attn_config...)
    rebuilt tiny the same way; a list by _tiny_list; use_cache off; a value the default leaves
    unset but its model needs by _unset; a dict keyed by layer index ("per_layer_config") by
    _per_layer; anything else by _shrunk. DERIVED where the class declares None (derived)."""
    from transformers import PretrainedConfig

    if isinstance(value, PretrainedConfig):
        return _config(type(value), {**_tiny_kwargs(value, layers), **_inherited(values, value)}, layers)
    if isinstance(value, list):
        return _tiny_list(name, value, depth, layers)
    if name == "use_cache":
        return False  # a training step keeps no cache (a hybrid's linear-attention cache fails)
    if value is None or value == {}:
        unset = _unset(name, value, values, layers)
        return unset if unset is not None else DERIVED
    if default is None:
        return DERIVED
    if isinstance(value, dict) and all(str(k).isdigit() for k in value):
        return _per_layer(value, layers)
    return _shrunk(name, value, layers)


# values a default config leaves None that its model cannot run without
UNSET = {
    r"experts_per_tok": TOP_K,  # deepseek_v2's router: topk(k=None)
    r"^clip_": 8.0,  # dbrx's attention clamps q, k, v to +-clip_qkv whether set or not
    r"routed_experts$": EXPERTS,  # dots1's MoE layers: torch.empty(None, ...)
    r"shared_experts$": 1,  # and its shared expert: moe_intermediate_size * None
    r"^layer_types$": lambda layers: ["full_attention"] * layers,  # lfm2_moe's model reads layer_types[i]
}


def _unset(name: str, value, values: dict, layers: int):
    """The value of an attribute the default config leaves None (or {}) where its model needs one
    (None: leave it): by UNSET (a function of the number of layers where it is one); a `default_x` the first of the config's `xs` (xmod's
    default_language, of languages); an empty rope_parameters the default RoPE for each layer kind
    (cohere_compass_text's model reads rope_parameters[layer_type])."""
    if name == "rope_parameters" and value == {} and isinstance(values.get("layer_types"), list):
        return {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in values["layer_types"]}
    if name.startswith("default_") and values.get(name[8:] + "s"):
        return list(values[name[8:] + "s"])[0]
    found = next((v for p, v in UNSET.items() if re.search(p, name)), None)
    return found(layers) if callable(found) else found


# (follower, leader): a follower (not also a leader) equal to a leader by default stays equal to it
TIES = [
    (KV_HEADS_RULE, r"attention_heads$|^num_heads$|^n_heads?$"),
    (HEAD_DIM_RULE, ROPE_DIM_RULE),
    (r"(size|dim)$", r"^(hidden_size|d_model|n_embd)$"),  # dots3's audio adapter_input_size
]


def _ties(kw: dict, values: dict) -> dict:
    """Attributes equal by default stay equal (TIES): kv heads as many as the heads where the
    default has as many (multi-head attention; MLA expands its latent to every head), a head dim
    the RoPE dim where the default makes them one (MLA's head_dim is its qk_rope_head_dim), and a
    size the width where it is the width. Then _sums."""
    for follower, leader in TIES:
        leaders = [n for n in kw if re.search(leader, n)]
        for f in [n for n in kw if re.search(follower, n) and n not in leaders]:
            same = [n for n in leaders if values.get(n) == values.get(f) is not None]
            if same:
                kw[f] = kw[same[0]]
    return _sums(kw, values)


def _sums(kw: dict, values: dict) -> dict:
    """A head dim that is by default another head dim plus a RoPE dim (MLA's nope + rope: dots3's
    sliding layers' head_dim) stays that sum, tiny; the smallest first, so that sums of sums add up."""
    dims = [n for n in kw if re.search(HEAD_DIM_RULE, n) and isinstance(values.get(n), int)]
    rope = [r for r in dims if re.search(ROPE_DIM_RULE, r)]
    for f in sorted(dims, key=values.get):
        parts = [(a, r) for a in dims for r in rope if len({f, a, r}) == 3]
        same = [(a, r) for a, r in parts if values[a] + values[r] == values[f]]
        if same:
            kw[f] = kw[same[0][0]] + kw[same[0][1]]
    return kw


def _per_layer(overrides: dict, layers: int) -> dict:
    """Per-layer overrides ({"02": {"num_attention_heads": 64, ...}}) of the layers kept (below
    `layers`), each shrunk and tied as the config's own attributes."""
    return {
        k: _ties({n: _shrunk(n, v, layers) for n, v in over.items()}, over)
        for k, over in overrides.items()
        if int(k) < layers and isinstance(over, dict)
    }


def _inherited(parent: dict, sub) -> dict:
    """What a sub-config takes from its parent: the RoPE base where it has none of its own (dbrx's
    attention reads attn_config.rope_theta, which its attention config does not declare)."""
    theta = (parent.get("rope_parameters") or {}).get("rope_theta")
    return {"rope_theta": theta} if theta is not None and not hasattr(sub, "rope_theta") else {}


def _mamba_heads(kw: dict) -> dict:
    """A state-space mixer's heads times its head dim must make its expanded width (expand x
    hidden): where kw has an `expand` factor, its mamba heads (or plain num_heads) are set so."""
    expand = next((v for n, v in kw.items() if n.endswith("expand") and isinstance(v, int)), None)
    dim = next((v for n, v in kw.items() if re.search(r"mamba.*(head_?dim|d_head)$|^head_dim$", n)), None)
    if expand and isinstance(dim, int) and dim:
        for n in kw:
            if re.search(r"mamba.*heads$|^num_heads$", n):
                kw[n] = expand * WIDTH // dim
    return kw


def repaired_config(arch: str, layers: int = DEPTH):
    """The architecture's default config, rebuilt tiny by attribute names and values alone (never by
    the architecture's name), for when tiny_config does not build or run:
    - every int by SHRINK (width 64, 2 layers (or `layers`), vocabulary 128, 4 heads of 16 with RoPE on 8, MLA
      ranks 32, 8 experts of width 96, 2 per token, ...), every dropout 0 (_shrunk);
    - layer-kind lists cut to the layers kept, which include each kind they can, so that a hybrid's
      two layers include a full-attention one; per-layer lists cut, layer indices kept (_tiny_list);
    - attributes equal by default kept equal: kv heads and heads, a head dim and the RoPE dim, an
      MLA head dim and nope + rope (_ties, _sums); a mamba mixer's heads x head dim (_mamba_heads);
    - values the default leaves unset that its model needs (_unset);
    - every sub-config (text_config, vision_config, attn_config, ...) and per-layer override made
      tiny the same way (_tiny_value, _per_layer, _config);
    - use_cache off and is_decoder on: a training step of a causal LM."""
    from transformers import AutoConfig

    # is_decoder: a causal LM decodes (reformer)
    kw = {**_tiny_kwargs(AutoConfig.for_model(arch), layers), "is_decoder": True}
    return _config(functools.partial(AutoConfig.for_model, arch), kw, layers)


def _config(make, kw: dict, layers: int):
    """make(**kw), made again with the per-layer overrides it derives itself (dots3's sliding
    layers: 64 heads of 256) tiny as well."""
    cfg = make(**kw)
    derived = cfg.to_dict().get("per_layer_config")
    if derived and _per_layer(derived, layers) != derived:
        cfg = make(**kw, per_layer_config=_per_layer(derived, layers))
    return cfg


def _from_config(cfg, dtype, cls, seed: int = 0):
    """A model of cfg (of class `cls`) made as tiny_model makes one: seeded, every norm weight
    perturbed, then cast to dtype. SDPA attention, or eager where the architecture has no SDPA."""
    for attention in ("sdpa", "eager"):
        torch.manual_seed(seed)
        cfg._attn_implementation = attention
        try:
            m = cls._from_config(cfg)
            break
        except ValueError as e:
            if attention == "eager" or "attention implementation" not in str(e):
                raise
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return m.to(dtype=dtype)


def repaired_model(arch: str, dtype=torch.float32, layers: int = DEPTH, seed: int = 0):
    """The causal LM of repaired_config(arch, layers); where that class takes one of the config's
    sub-configs (musicgen's decoder, mllama's and qwen3_5's text config), made of that sub-config alone."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch])
    cfg = repaired_config(arch, layers)
    if not isinstance(cfg, cls.config_class):
        cfg = next((v for v in vars(cfg).values() if isinstance(v, cls.config_class)), cfg)
    return _from_config(cfg, dtype, cls, seed)
