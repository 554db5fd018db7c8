"""Attention masks that are the causal mask, proven on the captured graph, become `is_causal=True`.

While dynamo traces, transformers up to at least 5.17 never skips building the causal mask
(`masking_utils._ignore_causal_mask_sdpa`: `is_tracing()` is true under torch.compile), so the
captured graph calls `scaled_dot_product_attention(q, k, v, attn_mask=<full 4-D mask>)`. SDPA then
does full attention and reads the mask, where `is_causal=True` would do half the work (the
attention's time under torch.compile is in benchmarks/RESULTS.md). transformers 5.24 skips the
mask under compile when there is no padding.

The proof, per SDPA call (nothing is assumed about how the mask was spelled):
  1. the mask's whole producer slice reads no graph input and no module attribute: its value is a
     function of the constants in the graph alone (the graph is specialized to static sizes; a
     graph with symbolic sizes is left alone), with no random or in-place op in it;
  2. evaluated once, it equals the causal mask of the call's (static) query and key lengths, which
     must be equal: booleans equal to the lower triangle, or an additive float mask that is 0 on the
     lower triangle and at most the dtype's most negative finite value / 2 above it (or -inf), the
     same probabilities after softmax's exp (no row is fully masked).
Then the call gets `attn_mask=None, is_causal=True`; the mask's producers become dead code.

A mask that reads graph inputs cannot be proven on the graph: it is checked at run time instead.
That is the case wherever the mask crosses a graph boundary (FSDP2 captures one graph per decoder
layer: the mask arrives as an input; DDP's graph, cut at its gradient buckets, is grafted whole
before the cut, see backend.py) and where a mask is built from the batch's own `attention_mask`.
When the producers read graph inputs (tensors) and nothing else impure, and the sizes are static,
that SDPA site is rewritten as above, and the backend (backend.py) runs
the graph only after `MaskCheck.holds` has evaluated the mask from those inputs and found it equal to
the causal mask (one device synchronization; the verdict is kept for the same input tensors while
they live and are not written to: one check per forward, shared by every graph the mask reaches).
When a mask is not causal (padding), that call runs a copy of the graph with its masks as written,
compiled on first need: exact either way.

Grouped-query attention: with a mask, Hugging Face repeats the key and value heads to the query's
(`repeat_kv`: kv[:, :, None].expand(...).reshape(...)) before SDPA; without one it passes
`enable_gqa=True`. Once a call has no mask (rewritten above, or as captured), keys and values that
are repeat_kv of k and v are replaced by k and v themselves with `enable_gqa=True`: SDPA maps query
head h to key head h // n_rep, as repeat_kv does, so the result is the same, and the repeated copies
(and, in training, the saved 4x-larger keys and values of a Llama-3 layer) are not made.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .report import SiteRecord, example_value, module_path

PATTERN = "sdpa"
SPELLING = "causal_mask"
CHECKED = "causal_mask_checked"  # the spelling of a site whose mask is checked at run time
# a mask-free call that read repeat_kv'ed keys and values: pattern and spelling
GQA_PATTERN, GQA = "gqa", "unrepeated_kv"
# what a report names these rewrites by, and what each does (`kernelgraft patterns` lists them)
REWRITES = {
    f"{PATTERN}.{SPELLING}": "an attention mask proven causal on the graph: SDPA runs is_causal=True without it",
    f"{PATTERN}.{CHECKED}": "a mask read from the graph's inputs, checked causal at run time, then as above",
    f"{GQA_PATTERN}.{GQA}": "keys and values repeated to the query's heads (repeat_kv) read unrepeated "
    "through SDPA's enable_gqa",
}
META = "kernelgraft_mask_checks"  # gm.meta key: the MaskChecks the graph's rewrite relies on
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_IMPURE = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "empty")


def _is_sdpa(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "scaled_dot_product_attention"


def has_input_masks(gm: torch.fx.GraphModule) -> bool:
    """Whether an SDPA site of the graph has a mask that reads graph inputs (that make_causal(...,
    runtime=True) checks at run time; the backend then keeps a copy of the graph for a failed
    check). A walk of the producers, nothing evaluated."""
    for n in gm.graph.nodes:
        mask = _arg(n, "attn_mask") if _is_sdpa(n) else None
        if isinstance(mask, torch.fx.Node) and _arg(n, "is_causal", False) is False:
            found = _slice(mask, inputs_ok=True)
            if not isinstance(found, str) and found[1]:
                return True
    return False


def _arg(n: torch.fx.Node, name: str, default=None):
    i = _ARGS.index(name)
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _static_shape(v) -> tuple | None:
    if not isinstance(v, torch.Tensor):
        return None
    shape = tuple(v.shape)
    return shape if all(type(d) is int for d in shape) else None


_OPERATOR_IN_PLACE = {"setitem", "delitem"} | {
    f"i{op}" for op in ("add", "and", "concat", "floordiv", "lshift", "mod", "mul", "matmul", "or",
                        "pow", "rshift", "sub", "truediv", "xor")
}  # fmt: skip


def _impure(n: torch.fx.Node, name: str) -> bool:
    """Random, uninitialized or in place: a value that one evaluation does not pin down."""
    if any(k in name for k in _IMPURE):
        return True
    if getattr(n.target, "__module__", None) in ("_operator", "operator"):
        return name in _OPERATOR_IN_PLACE  # operator.and_ is `&`, not in place
    return name.endswith("_") and not name.endswith("__")  # Tensor.masked_fill_, aten add_, ...


def _slice(mask: torch.fx.Node, inputs_ok: bool = False) -> tuple[list, list] | str:
    """(the mask's producers in graph order, the graph inputs they read), or why they are not a
    pure function of constants (and, with inputs_ok, of tensor inputs)."""
    seen: set = set()
    inputs: set = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and inputs_ok and isinstance(example_value(n), torch.Tensor):
            inputs.add(n)
            continue
        if n.op in ("placeholder", "get_attr"):
            return f"the mask reads {n.op} `{n.target}`"
        name = str(getattr(n.target, "__name__", n.target))
        if n.op == "call_module":
            return f"the mask calls module `{n.target}`"
        if _impure(n, name):
            return f"the mask's producer `{name}` is random or in place"
        if any(type(example_value(a)) is torch.SymInt for a in n.all_input_nodes):
            return "the mask depends on symbolic sizes"
        stack.extend(n.all_input_nodes)
    order = list(mask.graph.nodes)
    return [n for n in order if n in seen and n not in inputs], [n for n in order if n in inputs]


def _subgraph(nodes: list, inputs: list, out: torch.fx.Node) -> torch.fx.GraphModule:
    """inputs -> out, a graph of its own (nodes: out's producers in graph order)."""
    g = torch.fx.Graph()
    env: dict = {n: g.placeholder(f"in{i}") for i, n in enumerate(inputs)}
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _evaluate(nodes: list[torch.fx.Node]) -> torch.Tensor:
    with unset_fake_temporarily(), torch.no_grad():  # real values, even inside a fake-tensor trace
        return _subgraph(nodes, [], nodes[-1])()


def causal_verdict(m: torch.Tensor, lq: int, lk: int) -> str | None:
    """None if the mask `m` (broadcast to [..., lq, lk]) is the causal mask; else why not. Decided
    on m's device with one synchronization (run-time checks run it once per forward)."""
    if lq != lk:
        return f"query length {lq} != key length {lk}"
    if m.dim() < 2 or tuple(m.shape[-2:]) != (lq, lk):
        return f"mask shape {tuple(m.shape)} is not [..., {lq}, {lk}]"
    tril = torch.ones(lq, lk, dtype=torch.bool, device=m.device).tril()
    if m.dtype == torch.bool:
        return None if bool((m == tril).all()) else "the boolean mask is not the lower triangle"
    if not m.dtype.is_floating_point:
        return f"mask dtype {m.dtype}"
    # additive: 0 where allowed, at most finfo.min / 2 (or -inf) above the diagonal
    if bool(torch.where(tril, m == 0, m <= torch.finfo(m.dtype).min / 2).all()):
        return None
    return "the additive mask is not 0 on the lower triangle and -inf above it"


def is_causal_mask(m: torch.Tensor, lq: int, lk: int) -> bool:
    return causal_verdict(m, lq, lk) is None


# verdicts of MaskCheck.holds: (ids of the input tensors, check key) -> (weak refs, versions, verdict)
_VERDICTS: dict = {}
_MAX_VERDICTS = 64


@dataclass
class MaskCheck:
    """A mask read from graph inputs: `holds(args)` evaluates it from the graph's run-time arguments
    and tells whether it is the causal mask of (lq, lk)."""

    inputs: tuple  # positions of the graph inputs the mask reads
    fn: torch.fx.GraphModule  # those inputs -> the mask
    lq: int
    lk: int
    key: str = ""  # equal keys: the same function of the same inputs (a verdict is shared)
    runs: list = field(default_factory=lambda: [0, 0])  # [causal, not causal]

    def __post_init__(self):
        self.key = self.key or f"{self.lq}x{self.lk}\n{self.fn.code}"

    def holds(self, args) -> bool:
        ts = [args[i] for i in self.inputs]
        ids = (tuple(id(t) for t in ts), self.key)
        cacheable = not any(t.is_inference() for t in ts)  # inference tensors have no version counter
        hit = _VERDICTS.get(ids) if cacheable else None
        if hit and all(r() is t for r, t in zip(hit[0], ts)) and hit[1] == tuple(t._version for t in ts):
            ok = hit[2]
        else:
            with torch.no_grad():
                ok = is_causal_mask(self.fn(*ts), self.lq, self.lk)
            if cacheable:
                if len(_VERDICTS) >= _MAX_VERDICTS:
                    _VERDICTS.clear()
                _VERDICTS[ids] = (tuple(weakref.ref(t) for t in ts), tuple(t._version for t in ts), ok)
        self.runs[0 if ok else 1] += 1
        return ok


def make_causal(
    gm: torch.fx.GraphModule, *, edit: bool = True, runtime: bool = False
) -> tuple[list[SiteRecord], list[SiteRecord]]:
    """Rewrite every SDPA call whose mask is proven causal -> (rewritten sites, SDPA calls with a mask
    left as they are, with why). runtime=True also rewrites the calls whose mask reads graph inputs;
    their MaskChecks go to gm.meta[META], for the backend to run before the graph."""
    done, kept, checks = [], [], []
    mask_free: set = set()  # SDPA calls rewritten to is_causal=True
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in list(gm.graph.nodes):
        if not _is_sdpa(n):
            continue
        mask = _arg(n, "attn_mask")
        if not isinstance(mask, torch.fx.Node) or _arg(n, "is_causal", False) is not False:
            continue
        q, k = _static_shape(example_value(_arg(n, "query"))), _static_shape(example_value(_arg(n, "key")))
        rec = _record(n, q, k, example_value(mask))
        why = None
        if q is None or k is None:
            why = "query or key has symbolic sizes"
        elif q[-2] != k[-2]:
            why = f"query length {q[-2]} != key length {k[-2]}"
        else:
            found = _slice(mask, inputs_ok=runtime)
            if isinstance(found, str):
                why = found
            elif found[1]:  # reads graph inputs: checked at run time
                nodes, inputs = found
                idx = tuple(placeholders.index(p) for p in inputs)
                checks.append(MaskCheck(idx, _subgraph(nodes, inputs, mask), q[-2], k[-2]))
                rec.spelling = CHECKED
            else:
                try:
                    why = causal_verdict(_evaluate(found[0]), q[-2], k[-2])
                except Exception as e:  # noqa: BLE001 - a mask we cannot evaluate is left as it is
                    why = f"the mask could not be evaluated ({type(e).__name__}: {e})"[:200]
        if why:
            rec.replaced, rec.reason = False, why
            kept.append(rec)
            continue
        done.append(rec)
        mask_free.add(n)
        if edit:
            _set_args(n, attn_mask=None, is_causal=True)
    for n in [n for n in gm.graph.nodes if _is_sdpa(n)]:
        grouped = _grouped_kv(n) if (n in mask_free or _arg(n, "attn_mask") is None) else None
        if grouped is None:
            continue
        (k0, v0), n_rep = grouped
        q = _static_shape(example_value(_arg(n, "query")))
        done.append(_record(n, q, _static_shape(example_value(k0)), None, GQA))
        done[-1].scalars = {"n_rep": n_rep}
        if edit:
            _set_args(n, key=k0, value=v0, enable_gqa=True)
    if edit and checks:
        unique = {c.key + repr(c.inputs): c for c in checks}  # q's and k's layers share one mask
        gm.meta[META] = list(unique.values())
    if done and edit:
        drop_dead_code(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return done, kept


def _writes(n: torch.fx.Node) -> bool:
    """n writes into a tensor (an in-place method or op: `view.copy_(x)`, `x.add_(y)`, setitem), or
    fx knows it has effects: it stays though nothing reads its result."""
    if n.op in ("placeholder", "output") or n.is_impure():
        return True
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._schema.is_mutable
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return n.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("_")


def drop_dead_code(graph: torch.fx.Graph) -> None:
    """The nodes nothing reads (the masks the rewrite no longer passes), dropped; a write into a
    tensor is kept. fx's own dead-code pass removes a `copy_` into a view whose result is unused:
    DeepSeek's MLA builds its keys as `k = new_empty(...); k[..., :d].copy_(k_nope)`, and the keys
    would be left empty."""
    for n in reversed(list(graph.nodes)):
        if not n.users and not _writes(n):
            graph.erase_node(n)


def _set_args(n: torch.fx.Node, **values) -> None:
    """Set SDPA arguments by name, where the call passed them (positionally or by keyword)."""
    args, kwargs = list(n.args), dict(n.kwargs)
    for name, v in values.items():
        i = _ARGS.index(name)
        if i < len(args):
            args[i] = v
        else:
            kwargs[name] = v
    n.args, n.kwargs = tuple(args), kwargs


def _name(n) -> str:
    if not isinstance(n, torch.fx.Node) or n.op not in ("call_method", "call_function"):
        return ""
    return n.target if n.op == "call_method" else str(getattr(n.target, "__name__", ""))


_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa
_NEW_AXIS_2 = (slice(None), slice(None), None, slice(None), slice(None))


def _repeated(x) -> tuple | None:
    """(kv, n_rep) if x is Hugging Face's repeat_kv(kv, n_rep): kv[:, :, None].expand(B, H, n_rep,
    S, D).reshape(B, H * n_rep, S, D), with static sizes; else None."""
    if _name(x) not in ("reshape", "view"):
        return None
    e = x.args[0]
    if _name(e) != "expand":
        return None
    u = e.args[0]
    new_axis = (_name(u) == "getitem" and u.args[1] == _NEW_AXIS_2) or (
        _name(u) == "unsqueeze" and tuple(u.args[1:]) + tuple(u.kwargs.values()) in ((2,), (-3,))
    )
    if not new_axis:
        return None
    base = u.args[0]
    vb, ve, vx = (_static_shape(example_value(t)) for t in (base, e, x))
    if vb is None or ve is None or vx is None or len(vb) != 4:
        return None
    B, H, S, D = vb
    n_rep = ve[2]
    if ve != (B, H, n_rep, S, D) or vx != (B, H * n_rep, S, D):
        return None
    return base, n_rep


def _grouped_kv(n: torch.fx.Node) -> tuple | None:
    """((k, v), n_rep) where the call's key and value are repeat_kv of k and v (grouped-query
    attention spelled out), so SDPA can read k and v themselves with enable_gqa=True; else None."""
    if _arg(n, "enable_gqa", False) or not _HAS_GQA:
        return None
    rk, rv = _repeated(_arg(n, "key")), _repeated(_arg(n, "value"))
    q = _static_shape(example_value(_arg(n, "query")))
    if rk is None or rv is None or q is None or rk[1] != rv[1] or rk[1] < 2:
        return None
    hk = _static_shape(example_value(rk[0]))
    if len(q) != 4 or q[1] != hk[1] * rk[1]:
        return None
    return (rk[0], rv[0]), rk[1]


def _record(n: torch.fx.Node, q, k, m, spelling: str = SPELLING) -> SiteRecord:
    module = module_path(n)
    shapes = {"query": q or (), "key": k or ()}
    if isinstance(m, torch.Tensor):
        shapes["attn_mask"] = tuple(int(d) if type(d) is int else -1 for d in m.shape)
    dt = example_value(_arg(n, "query"))
    dtypes = {"query": str(dt.dtype).replace("torch.", "")} if isinstance(dt, torch.Tensor) else {}
    return SiteRecord(GQA_PATTERN if spelling == GQA else PATTERN, spelling, module, shapes, dtypes, {})
