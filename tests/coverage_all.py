"""Every causal-LM architecture the installed transformers lists, built from a tiny config (2 layers,
hidden 64, nothing downloaded) and explained with labels: the sites its own modules make, against
the sites kernelgraft serves, and why the rest are not served.

Expected sites come from the model, not from kernelgraft: each norm module it calls (hooks; a class
name ending in "Norm", or "Norm" and a qualifier: Gated, PerHead, 1P), RoPE on q and on k of each attention module it calls where it has a rotary
embedding module, one gated MLP per MLP module it calls that has a gate projection (and per experts
module of an MoE block), one LM head + loss. A model is fully served when every expected site is
AND the loss and every gradient of kernelgraft.optimize(model) pass the accuracy rule against the
stock model, in float32 on one batch and in bfloat16 over two (as tests/test_coverage.py's
test_loss_and_gradients_agree); a row whose sites are all served but whose check fails is "grads".

The model is tests/tiny.py's tiny_model(arch). Where that does not build or run, it is rebuilt once
from repaired_config(arch): the architecture's default config made tiny by attribute names and
values alone (SHRINK and the functions below it), use_cache off; such rows say "(repaired config)".

    make coverage                          # python tests/coverage_all.py --write: the README's table
    python tests/coverage_all.py llama gpt_neox   # some architectures, printed
    python tests/coverage_all.py --no-grads llama # the sites alone, no gradient check
    python tests/coverage_all.py --write --update --memory-gib=20 gemma4_text   # rows surveyed again
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import re
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from tiny import VOCAB, batch, compare_models, kept_in_float32, tiny_model

from kernelgraft.kernels import fallback

HERE = Path(__file__).resolve().parent
README = HERE.parent / "README.md"
START, END = "<!-- decoders:start -->", "<!-- decoders:end -->"


def architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _name(m) -> str:
    return type(m).__name__


ROPE_HELPERS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "apply_rotary_emb")


@contextlib.contextmanager
def _rope_calls(model, calls: Counter):
    """While inside: the tensors the modeling file's RoPE helper rotates (the tensors each call
    returns: q and k, or one) counted as calls["rope_helper"], where the file has one. Attention
    modules that do not rotate (NoPE layers of a hybrid, linear attention) then expect no RoPE."""
    mod = sys.modules.get(type(model).__module__)
    names = [n for n in ROPE_HELPERS if callable(getattr(mod, n, None))]
    saved = {n: getattr(mod, n) for n in names}

    def counted(fn):
        def call(*a, **k):
            out = fn(*a, **k)  # (q, k) rotated, or one tensor (GPT-J rotates one per call)
            calls["rope_helper"] += len(out) if isinstance(out, (tuple, list)) else 1
            return out

        return call

    for n in names:
        setattr(mod, n, counted(saved[n]))
    try:
        yield bool(names)
    finally:
        for n, fn in saved.items():
            setattr(mod, n, fn)


def expected(model, b) -> dict:
    """The sites the model's own modules make on batch b (eager, hooks): RoPE from the calls of the
    modeling file's RoPE helper where it has one, else two per rotary attention module's call."""
    calls: Counter = Counter()
    gated = lambda m: any(hasattr(m, a) for a in ("gate_proj", "gate_up_proj"))  # noqa: E731
    rotary = any("Rotary" in _name(m) for m in model.modules())

    def kind(m) -> str | None:
        n = _name(m)
        if re.search(r"Norm(Gated|PerHead|Zero|[0-9][0-9A-Za-z]*)?$", n):  # not ...PreLayerNormSelfAttention
            return "norm"
        if (
            "Attention" in n
            and rotary
            and hasattr(m, "q_proj") | hasattr(m, "qkv_proj") | hasattr(m, "query_key_value")
        ):
            return "rope"
        if ("MLP" in n or "Mlp" in n) and gated(m):
            return "gated_mlp"
        if n.endswith("Experts") and getattr(m, "has_gate", True):  # transformers' experts say if gated
            return "gated_mlp"
        return None

    hooks = []
    for m in model.modules():
        k = kind(m)
        if k is not None:
            hooks.append(
                m.register_forward_hook(lambda *a, k=k: calls.update([k] * (2 if k == "rope" else 1)))
            )
    try:
        with torch.no_grad(), _rope_calls(model, calls) as helper:
            model(**b)
    finally:
        for h in hooks:
            h.remove()
    if helper:
        calls["rope"] = calls.pop("rope_helper", 0)
    calls["lm_head_ce"] = 1 if model.get_output_embeddings() is not None else 0
    return {k: v for k, v in calls.items() if v}


# --- the repaired tiny config: for an architecture the tiny config of tests/tiny.py cannot build ---

WIDTH, DEPTH, HEADS, KV_HEADS, HEAD_DIM, ROPE_DIM = 64, 2, 4, 2, 16, 8
FFN, EXPERTS, TOP_K, RANK, POSITIONS = 96, 8, 2, 32, 128
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # tests/tiny.py's
HEADS_RULE, KV_HEADS_RULE = r"heads$|^n_head$", r"kv_heads$|key_value_heads$|kv_n_heads$|query_groups$"
ROPE_DIM_RULE, HEAD_DIM_RULE = r"(rope|rotary).*dim$", r"head_?dim$|d_head$|^d_kv$|head_size$"
# (name pattern, tiny value), the first match wins: an int attribute above its tiny value becomes it
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
    (r"^(num_hidden_layers|num_layers|n_layers?|(en|de)coder_layers|num_(en|de)coder_layers)$", DEPTH),
    (r"^(depth|num_blocks|conf_num_hidden_layers)$", DEPTH),
    (r"shared_layers$", 0),  # KV-shared layers: two layers cannot hold each attention kind and a sharer
    (r"_layers$|^first_k_dense", DEPTH - 1),  # a count of some layers (dense, MoE, ...): one of each
    (r"vocab", VOCAB),  # vocab_size, decoder_vocab_size, ngram_vocab_size_base, ...
    (r"^max_position_embeddings$|^n_positions$|^n_ctx$|^max_seq_len$|model_max_length$", POSITIONS),
    (r"hidden_size|^d_model$|^n_embd$|embed_dim$|^embedding_dim$|^lru_width$|_dim$", WIDTH),
]


def _shrunk(name: str, value):
    """An int attribute's tiny value by SHRINK; a dropout probability 0 (the check compares two
    runs); any other value unchanged."""
    if isinstance(value, float) and re.search(r"drop", name):
        return 0.0
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    if name in TOKENS:
        return TOKENS[name] if value >= VOCAB else value
    for pattern, tiny in SHRINK:
        if re.search(pattern, name):
            return tiny if value > tiny or (pattern == HEADS_RULE and WIDTH % value) else value
    return value


def _kinds(kinds: list) -> list:
    """A per-layer list of kinds (layer_types, mlp_layer_types, block_types, ...) cut to DEPTH layers,
    its last layers taking the kinds the cut lost (in order of first appearance): two layers of a
    hybrid model hold a linear-attention (or recurrent, or sliding) layer AND a full-attention one."""
    out = list(kinds[:DEPTH])
    lost = [k for k in dict.fromkeys(kinds) if k not in out]
    for i, k in enumerate(lost[: DEPTH - 1]):
        out[DEPTH - 1 - i] = k
    return out


def _tiny_list(name: str, value: list, depth: int) -> list:
    """A list attribute, tiny: kinds per layer (strings) by _kinds; a [[kinds], repeats] spec expanded
    to DEPTH; a per-layer list (as long as the default depth) cut to DEPTH, each entry shrunk; layer
    indices (a name with "layer", "ids" or "indices") kept below DEPTH, the last layer where none is."""
    if len(value) > DEPTH and all(isinstance(v, str) for v in value):
        return _kinds(value)
    spec = all(isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[0], list) for v in value)
    if value and spec and sum(len(k) * n for k, n in value) == depth:  # e.g. [[["global", "local"], 12]]
        return [[_kinds(list(value[0][0]) * DEPTH), 1]]
    if len(value) == depth and depth > DEPTH:
        return [_shrunk(name, v) for v in value[:DEPTH]]
    if value and all(isinstance(v, int) for v in value) and re.search(r"layer|ids$|indices$", name):
        kept = [v for v in value if v < DEPTH]
        return kept or [DEPTH - 1]
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


def _tiny_kwargs(cfg) -> dict:
    """The keyword arguments that rebuild config `cfg` tiny: _tiny_value of each attribute its class
    declares, then _mamba_heads and _ties."""
    values = _values(cfg)
    depth, kw = _depth(values), {}
    for name, default in _declared(type(cfg)).items():
        value = _tiny_value(name, values.get(name), default, values, depth)
        if value is not DERIVED:
            kw[name] = value
    return _ties(_mamba_heads(kw), values)


DERIVED = object()  # _tiny_value's "leave it out": __post_init__ derives it from the others


def _tiny_value(name: str, value, default, values: dict, depth: int):
    """One declared attribute's tiny value: a sub-config (text_config, vision_config, attn_config...)
    rebuilt tiny the same way; a list by _tiny_list; use_cache off; a value the default leaves
    unset but its model needs by _unset; a dict keyed by layer index ("per_layer_config") by
    _per_layer; anything else by _shrunk. DERIVED where the class declares None (derived)."""
    from transformers import PretrainedConfig

    if isinstance(value, PretrainedConfig):
        return _config(type(value), {**_tiny_kwargs(value), **_inherited(values, value)})
    if isinstance(value, list):
        return _tiny_list(name, value, depth)
    if name == "use_cache":
        return False  # a training step keeps no cache (a hybrid's linear-attention cache fails)
    if value is None or value == {}:
        unset = _unset(name, value, values)
        return unset if unset is not None else DERIVED
    if default is None:
        return DERIVED
    if isinstance(value, dict) and all(str(k).isdigit() for k in value):
        return _per_layer(value)
    return _shrunk(name, value)


# values a default config leaves None that its model cannot run without
UNSET = {
    r"experts_per_tok": TOP_K,  # deepseek_v2's router: topk(k=None)
    r"^clip_": 8.0,  # dbrx's attention clamps q, k, v to +-clip_qkv whether set or not
    r"routed_experts$": EXPERTS,  # dots1's MoE layers: torch.empty(None, ...)
    r"shared_experts$": 1,  # and its shared expert: moe_intermediate_size * None
    r"^layer_types$": ["full_attention"] * DEPTH,  # lfm2_moe's model reads config.layer_types[i]
}


def _unset(name: str, value, values: dict):
    """The value of an attribute the default config leaves None (or {}) where its model needs one
    (None: leave it): by UNSET; a `default_x` the first of the config's `xs` (xmod's
    default_language, of languages); an empty rope_parameters the default RoPE for each layer kind
    (cohere_compass_text's model reads rope_parameters[layer_type])."""
    if name == "rope_parameters" and value == {} and isinstance(values.get("layer_types"), list):
        return {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in values["layer_types"]}
    if name.startswith("default_") and values.get(name[8:] + "s"):
        return list(values[name[8:] + "s"])[0]
    return next((v for p, v in UNSET.items() if re.search(p, name)), None)


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


def _per_layer(overrides: dict) -> dict:
    """Per-layer overrides ({"02": {"num_attention_heads": 64, ...}}) of the layers below DEPTH,
    each shrunk and tied as the config's own attributes."""
    return {
        k: _ties({n: _shrunk(n, v) for n, v in over.items()}, over)
        for k, over in overrides.items()
        if int(k) < DEPTH and isinstance(over, dict)
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


def repaired_config(arch: str):
    """The architecture's default config, rebuilt tiny by attribute names and values alone (never by
    the architecture's name), for when the tiny config of tests/tiny.py does not build or run:
    - every int by SHRINK (width 64, 2 layers, vocabulary 128, 4 heads of 16 with RoPE on 8, MLA
      ranks 32, 8 experts of width 96, 2 per token, ...), every dropout 0 (_shrunk);
    - layer-kind lists cut to two layers that include each kind they can, so that a hybrid's two
      layers include a full-attention one; per-layer lists cut, layer indices kept (_tiny_list);
    - attributes equal by default kept equal: kv heads and heads, a head dim and the RoPE dim, an
      MLA head dim and nope + rope (_ties, _sums); a mamba mixer's heads x head dim (_mamba_heads);
    - values the default leaves unset that its model needs (_unset);
    - every sub-config (text_config, vision_config, attn_config, ...) and per-layer override made
      tiny the same way (_tiny_value, _per_layer, _config);
    - use_cache off and is_decoder on: a training step of a causal LM."""
    from transformers import AutoConfig

    kw = {**_tiny_kwargs(AutoConfig.for_model(arch)), "is_decoder": True}  # a causal LM decodes (reformer)
    return _config(functools.partial(AutoConfig.for_model, arch), kw)


def _config(make, kw: dict):
    """make(**kw), made again with the per-layer overrides it derives itself (dots3's sliding
    layers: 64 heads of 256) tiny as well."""
    cfg = make(**kw)
    derived = cfg.to_dict().get("per_layer_config")
    if derived and _per_layer(derived) != derived:
        cfg = make(**kw, per_layer_config=_per_layer(derived))
    return cfg


# --- building and running the tiny model ---


def _from_config(cfg, dtype, cls=None):
    """A model of cfg (of class `cls`, default: the causal LM of cfg's architecture) made as
    tests/tiny.py's tiny_model makes one: seed 0, every norm weight perturbed (Gemma initializes
    them to 0), then cast to dtype. SDPA attention, or eager where the architecture has no SDPA."""
    from transformers import AutoModelForCausalLM

    for attention in ("sdpa", "eager"):
        torch.manual_seed(0)
        cfg._attn_implementation = attention
        try:
            m = cls._from_config(cfg) if cls else AutoModelForCausalLM.from_config(cfg)
            break
        except ValueError as e:
            if attention == "eager" or "attention implementation" not in str(e):
                raise
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return m.to(dtype=dtype)


def _run(arch: str):
    """The first way that builds and runs the tiny model on batch(): tests/tiny.py's config, else
    repaired_config(arch). (how, build(dtype) -> model, model, expected sites, explain report), or
    the exception of the last way tried."""
    import kernelgraft

    ways = [("tiny", lambda dtype: tiny_model(arch, dtype)), ("repaired", lambda dtype: _repaired(arch, dtype))]
    for how, build in ways:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, b = build(torch.float32), batch()
                return how, build, model, expected(model, b), kernelgraft.explain(model, **b)
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to build or run is the row's finding
            failure, model = e, None
            gc.collect()
    return failure


def _repaired(arch: str, dtype=torch.float32):
    """The causal LM of repaired_config(arch); where that class takes one of the config's sub-configs
    (musicgen's decoder, mllama's and qwen3_5's text config), made of that sub-config alone."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch])
    cfg = repaired_config(arch)
    if not isinstance(cfg, cls.config_class):
        cfg = next((v for v in vars(cfg).values() if isinstance(v, cls.config_class)), cfg)
    return _from_config(cfg, dtype, cls)


def _first_line(e: BaseException, n: int = 140) -> str:
    """The exception's name and first line (and the next one where the first ends with a colon: a
    config validator's "Class validation error for validator ...:" says its cause there)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
    first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return f"{type(e).__name__}: {first[:n]}"


def _non_text(arch: str) -> str:
    """Where the causal LM's forward takes inputs other than text (" (takes pixel_values)"): what a
    row that did not run on token ids alone may need."""
    import inspect

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch], None)
    takes = [p for p in inspect.signature(cls.forward).parameters if re.search(NON_TEXT, p)] if cls else []
    return f" (takes {', '.join(takes)})" if takes else ""


NON_TEXT = r"^(pixel_values|input_features|input_values|shared_kv_states)$"


# --- the gradient check ---

CHECKS = ((torch.float32, (1,)), (torch.bfloat16, (1, 2)))  # (dtype, batch seeds), as the tests
# a check that fails is run again over this many batches, each quantity judged on all of them at
# once (compare_models): a statistic of the rounding rather than one draw of it. A tiny model's
# gradient from one batch is a few dozen numbers, and one whose truth is zero (an attention key
# bias: softmax ignores a shift shared by every key) is rounding noise in every candidate, which
# one draw ranks by luck
RECHECK = 8


def _verdicts(build, dtype, seeds):
    import kernelgraft

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stock = build(dtype)
            grafted = kernelgraft.optimize(copy.deepcopy(stock), backend="eager")
            verdicts = compare_models(grafted, stock, [batch(seed=s) for s in seeds], compiled=False)
            return verdicts, grafted.kernelgraft_report
    finally:
        stock = grafted = None
        _release()


def gradient_check(build) -> tuple[str, str]:
    """("fp32, bf16", "") when the loss and every gradient of kernelgraft.optimize(stock,
    backend="eager") pass the accuracy rule (tests/tiny.py's compare_models, eager reference, no
    compile), in float32 on one batch and in bfloat16 over two (test_loss_and_gradients_agree), or
    where one fails, over RECHECK batches; else ("failed", how many failed and the first failing
    verdict) or ("did not run", why). A model whose own code fails cast whole to bfloat16 is checked
    as from_pretrained(dtype=) loads it, its float32 modules kept ("(float32 modules kept)")."""
    counts, kept = None, False
    for dtype, seeds in CHECKS:
        name = str(dtype).removeprefix("torch.")
        try:
            try:
                verdicts, rep = _verdicts(build, dtype, seeds)
            except RuntimeError as e:
                # the model's own code fails cast whole to a 2-byte dtype: as from_pretrained(dtype=)
                # loads it, with the modules it keeps in float32 kept there (retried only then, so
                # every other model's check is unchanged)
                if dtype == torch.float32 or "dtype" not in str(e):
                    raise
                build, kept = _kept(build), True
                verdicts, rep = _verdicts(build, dtype, seeds)
                name += " (its float32 modules kept)"
            if any(not v.ok for v in verdicts):
                verdicts, rep = _verdicts(build, dtype, tuple(range(1, RECHECK + 1)))
                name += f" over {RECHECK} batches"
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - a check that cannot run fails, and says why
            return "did not run", f"{name}: {_first_line(e)}"
        bad = [v for v in verdicts if not v.ok]
        if bad:
            # eager's own error above 100%: a quantity that is ~0 in exact arithmetic (a key bias's
            # gradient: softmax ignores a shift that is the same for every key)
            zero = "; its truth is ~0 (eager's error > 1)" if bad[0].eager > 1 else ""
            return "failed", f"{name}: {len(bad)} of {len(verdicts)} fail; {bad[0]}{zero}"
        # a site served in float32 and refused in bfloat16 (a spelling served in one dtype) is not
        # served in both: the model is not fully served
        if counts is not None and rep.counts() != counts:
            why = rep.fallbacks[0].reason if rep.fallbacks else "fewer sites"
            return "failed", f"{name}: sites {rep.counts()} against float32's {counts}; {why}"
        counts = rep.counts()
    return "fp32, bf16" + (" (float32 modules kept)" if kept else ""), ""


def _kept(build):
    """build, its 2-byte models with the parameters their class keeps in float32 kept there."""
    return lambda dtype: build(dtype) if dtype == torch.float32 else kept_in_float32(build(dtype))


def _release():
    """Free the models of a check before the next is built: a "tiny" config that keeps a default
    vision tower or per-layer embedding is hundreds of MB, its float64 truth twice that."""
    torch._dynamo.reset()  # compiled graphs hold their models' parameters
    fallback.forget_failures()  # a kernel that failed for one model is tried again for the next
    gc.collect()


# --- one architecture ---


def _served(rep) -> dict:
    got = rep.counts()
    return {
        "norm": got.get("rms_norm", 0) + got.get("layer_norm", 0),
        "rope": got.get("rope", 0),
        "gated_mlp": got.get("gated_mlp", 0),
        "lm_head_ce": got.get("lm_head_ce", 0),
    }


def survey(arch: str, grads: bool = True) -> dict:
    """One architecture: built (how), its expected and served sites, its status and why, and, where
    every site is served and `grads`, the gradient check ("grads": what was checked)."""
    row = dict(arch=arch, expected={}, served={}, why="", repaired=False, grads="")
    found = _run(arch)
    if isinstance(found, BaseException):
        row.update(status="not built", why=_first_line(found) + _non_text(arch))
        return row
    how, build, _, want, rep = found
    served = _served(rep)
    row.update(expected=want, served=served, repaired=how == "repaired")
    missing = [k for k, n in want.items() if served.get(k, 0) < n]
    if missing:
        row["status"] = "partial" if any(served.get(k, 0) for k in want) else "none"
        reasons = (
            [str(m) for m in rep.near_misses]
            + [str(u) for u in rep.unserved]
            + [f"{r.module}: {r.reason}" for r in rep.fallbacks]
            # sites in code dynamo did not capture: its graph breaks say why
            + [f"dynamo's graph breaks (x{n}): {why}" for why, n in rep.graph_breaks.most_common()]
        )
        row["why"] = f"missing {', '.join(missing)}" + (f"; {reasons[0][:160]}" if reasons else "")
        return row
    row.update(status="full", grads="not checked")
    if grads:
        found = rep = None
        _release()
        try:
            row["grads"], failed = gradient_check(build)
        except TimeoutError as e:  # the sites were counted: the check is what ran out of time
            row["grads"], failed = "did not run", f"{type(e).__name__}: {e}"
        if failed:
            row.update(status="grads", why=failed[:240])
    return row


NOTE = (
    "Fully served: every expected site served, and the loss and every gradient within the accuracy rule in"
    ' float32 and bfloat16 ("gradients checked"; status "grads" where not, or where the check did not run).'
    " {repaired} built from a repaired config (repaired_config in tests/coverage_all.py: the default config"
    ' made tiny by attribute names), marked "(repaired config)"; a row not built failed with both configs,'
    " its why from the repaired one."
)


_REPAIRED = " (repaired config)"


def _row_line(r: dict) -> str:
    cells = []
    for k in ("norm", "rope", "gated_mlp", "lm_head_ce"):
        n = r["expected"].get(k, 0)
        cells.append(f"{r['served'].get(k, 0)}/{n}" if n else "-")
    why = r["why"].replace("|", "\\|")
    name = r["arch"] + (_REPAIRED if r.get("repaired") else "")
    return f"| {name} | {r['status']} | {' | '.join(cells)} | {why} | {r.get('grads') or '-'} |"


def _head(rows: list[dict]) -> list[str]:
    """The table's first lines. The first counts the rows fully served: every expected site served
    and, where the gradients were checked, the check passed."""
    full = sum(r["status"] == "full" for r in rows)
    built = sum(r["status"] != "not built" for r in rows)
    repaired = sum(bool(r.get("repaired")) for r in rows)
    unchecked = "; gradients not checked" if any(r.get("grads") == "not checked" for r in rows) else ""
    return [
        f"{full} of {len(rows)} causal-LM architectures fully served ({built} built from a tiny config{unchecked}).",
        "",
        NOTE.format(repaired=repaired),
        "",
        "| architecture | status | norms | RoPE | gated MLP | LM head | why not | gradients checked |",
        "|---|---|---|---|---|---|---|---|",
    ]


def table(rows: list[dict]) -> str:
    """The README's table."""
    return "\n".join(_head(rows) + [_row_line(r) for r in rows])


def updated(old: str, rows: list[dict]) -> str:
    """The README's table `old` with the rows of `rows` in place of theirs, the other rows as they
    are, its counts made anew (`--update`: some architectures surveyed again, or new in the
    installed transformers: those take their place in the order of the names)."""
    new = {r["arch"]: _row_line(r) for r in rows}
    by_arch = {}
    for line in old.splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")] if line.startswith("| ") else []
        if len(cells) < 8 or cells[0] == "architecture":
            continue
        by_arch[cells[0].removesuffix(_REPAIRED)] = line
    by_arch.update(new)
    lines, kept = [], []
    for arch in sorted(by_arch):
        line = by_arch[arch]
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        lines.append(line)
        kept.append(dict(status=cells[1], repaired=cells[0].endswith(_REPAIRED), grads=cells[-1]))
    return "\n".join(_head(kept) + lines)


MEMORY_GIB = 12  # a tiny model that allocates more (a default that is not tiny) fails, not the run
SECONDS = 300  # per architecture, gradient check included: ~5-20 s, ~2 min where experts stay full size


def _timed_out(signum, frame):
    raise TimeoutError(f"took more than {SECONDS} s")


def main(argv: list[str]) -> int:
    import resource
    import signal

    write, grads, update = "--write" in argv, "--no-grads" not in argv, "--update" in argv
    memory = next((float(a.split("=", 1)[1]) for a in argv if a.startswith("--memory-gib=")), MEMORY_GIB)
    archs = [a for a in argv if not a.startswith("--")] or architectures()
    if update and (not write or archs == architectures()):
        raise SystemExit("--update takes --write and the architectures to survey again")
    limit = int(memory * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _timed_out)
    rows = []
    for a in archs:
        start = time.monotonic()
        signal.alarm(SECONDS)
        try:
            rows.append(survey(a, grads))
        except (MemoryError, TimeoutError) as e:
            rows.append(
                dict(arch=a, expected={}, served={}, status="not built", why=f"{type(e).__name__}: {e}"[:140])
            )
        finally:
            signal.alarm(0)
        took = time.monotonic() - start
        print(f"{a}: {rows[-1]['status']} ({took:.0f} s) {rows[-1]['why'][:100]}", flush=True)
    if write:
        readme = README.read_text()
        head, rest = readme.split(START, 1)
        old, tail = rest.split(END, 1)
        text = updated(old, rows) if update else table(rows)
        README.write_text(f"{head}{START}\n{text}\n{END}{tail}")
        print(f"wrote the table of {len(rows)} architectures into {README}")
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
