"""optimize() and explain(): the user-facing entry points of the rewriter."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import sys
from collections import Counter

import torch
from torch.utils.hooks import RemovableHandle

from .._dynamo import capture_settings, fresh_entry
from ..kernels import explain_withheld
from ..kernels.fallback import warn_once
from ..options import Options, with_options_help
from . import memory as _memory
from . import runs, startup
from .backend import DECODING, Grafter
from .layers import capture_layers, layer_stacks, no_cache_in_training, own_checkpointing, pass_over, sharded
from .layers import decodes as _decodes
from .recapture import again_with_logits, model_line, recapture, rng_state
from .report import RewriteReport, graph_break_reasons


def optimize(
    model: torch.nn.Module,
    backend: str = Options.backend,
    patterns=None,
    *,
    dynamic: bool | None = None,
    keep_logits: bool = Options.keep_logits,
    lm_head_chunk: int | None = Options.lm_head_chunk,
    lm_head_accumulate: str = Options.lm_head_accumulate,
    lm_head_memory: float | str | None = Options.lm_head_memory,
    memory: float | str | None = Options.memory,
    offload: bool | None = Options.offload,
    capture: str = Options.capture,
    tile_tokens: int | None = Options.tile_tokens,
    causal_attention: bool = Options.causal_attention,
    recompute: bool | str = Options.recompute,
    ddp_piece_mb: float | None = Options.ddp_piece_mb,
    mode: str | None = Options.mode,
    launch: str = Options.launch,
    inference: str = Options.inference,
    fuse_projections: bool = Options.fuse_projections,
    wrapper: str = Options.wrapper,
):
    """Compile `model` in place with the kernelgraft backend and return the same object.

    It patches no model class: state-dict keys, `save_pretrained`/`from_pretrained`, peft and
    `Trainer` keep working, and other models in the process are untouched. What each capture
    replaced accumulates in `model.kernelgraft_report`, kept by kind of graph (a training step's, an
    evaluation forward's, `generate()`'s decoding). Every option is a field of `kernelgraft.Options`,
    validated there, with its default; each is listed under "Other Parameters" with its
    documentation.

    Args:
        model: the module to compile: a Hugging Face model, a peft model, any `torch.nn.Module`.
        patterns: the patterns to match: registered names (`"rms_norm"`, `"rope"`, ...), the
            spellings `kernelgraft.pattern` makes, or a registry; None: every registered pattern.
        dynamic: torch.compile's. Floats the model reads (a norm's eps) stay constants of the
            captured graph even with `dynamic=True`, so that the patterns that take them as numbers
            match (a float that changes between calls recompiles).

    Returns:
        `model` itself, compiled (its first call captures and compiles).

    Examples:
        >>> import torch, kernelgraft
        >>> m = torch.nn.Linear(4, 4)
        >>> kernelgraft.optimize(m, backend="eager") is m
        True
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"kernelgraft.optimize: expected a torch.nn.Module, got {type(model).__name__}")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(
            f"kernelgraft.optimize: dynamic must be True, False or None (torch.compile's), got {dynamic!r}"
        )
    options = Options(
        backend=backend,
        keep_logits=keep_logits,
        lm_head_chunk=lm_head_chunk,
        lm_head_accumulate=lm_head_accumulate,
        lm_head_memory=lm_head_memory,
        memory=memory,
        offload=offload,
        capture=capture,
        tile_tokens=tile_tokens,
        causal_attention=causal_attention,
        recompute=recompute,
        ddp_piece_mb=ddp_piece_mb,
        mode=mode,
        launch=launch,
        inference=inference,
        fuse_projections=fuse_projections,
        wrapper=wrapper,
    )
    grafter = Grafter(patterns=patterns, options=options, heads=output_heads(model))
    runs.LIVE.add(grafter)
    runs.watch()
    compiled = _Compiled(grafter, dynamic, f"{type(model).__name__}@{id(model):x}")
    if options.capture == "layers" or options.offload:
        capture_layers(compiled, model)
    else:
        grafter.report.captured_as = dict(kind="whole", why='as capture="whole" asks')
    model._compiled_call_impl = functools.partial(_call, compiled, model)
    model.kernelgraft_report = grafter.report
    settings = dict(dataclasses.asdict(options), patterns=patterns, dynamic=dynamic)  # optimize()'s arguments
    # copies stay optimized: copy.deepcopy, pickle and torch.save find these on the instance
    model.__dict__["__deepcopy__"] = functools.partial(_deepcopy, model, settings)
    model.__dict__["__reduce_ex__"] = functools.partial(_reduce_ex, model, settings)
    # Module.compile would replace the compiled call with a plain torch.compile: said, and not done
    model.__dict__["compile"] = functools.partial(_compile_again, model)
    return model


# each option's help is its Options field's documentation, written once there
optimize.__doc__ = with_options_help(optimize.__doc__)


# the hooks a module runs when called: torch's global ones and each module's own
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hook_dicts(model: torch.nn.Module) -> tuple:
    """The dicts that hold the hooks that calling `model` runs (torch's global ones, then its modules')."""
    from torch.nn.modules import module as nn_module

    found = [
        getattr(nn_module, name) for name in _GLOBAL_HOOKS if isinstance(getattr(nn_module, name, None), dict)
    ]
    for m in model.modules():
        found += [d for name in _MODULE_HOOKS if isinstance(d := m.__dict__.get(name), dict)]
    return tuple(found)


class _Compiled:
    """An optimized model's compiled call (what Module.compile makes, through an entry function of
    the model's own: see fresh_entry), compiled afresh when the model's hooks change.

    torch.compile does not guard a module's hooks (`skip_nnmodule_hook_guards`): a hook registered
    after the first forward would never run, a removed one would keep running. Guarding them in
    dynamo costs every forward a check of every module. Here every forward compares one counter, torch's count of hook handles ever made, and
    the sizes of the hook dicts; only when either moved are the hooks themselves compared, and a
    changed set of hooks starts a new entry (a new capture, with the hooks in it)."""

    def __init__(self, grafter: Grafter, dynamic: bool | None, tag: str):
        self.grafter, self.dynamic, self.tag = grafter, dynamic, tag
        self.backend = grafter  # what torch.compile is given (recapture.Again: the grafter, captured again)
        self.layers = None  # layers.LayerStack, where the layers are captured per class
        self.clock = startup.Clock()  # the first calls' timings, for the report
        self.memory_chosen = False  # Options.memory's levers chosen (at the first training call)
        self.layered = None  # whether FSDP2 sharded its layers (looked at the first training call)
        self.trained = False  # a training call ran through (the model's code has had its logits)
        self.dicts: tuple = ()
        self.sizes: tuple | None = None  # the dicts' sizes when last compared; None: all empty
        self.hooks: tuple | None = None  # the hook ids of each dict, when last compared
        self.handles = -1  # torch's count of hook handles, when last compared
        self.graphs = -1  # the report's graph count when the dicts were last listed
        self.fn = self._entry()

    def _entry(self):
        return torch.compile(fresh_entry(self.tag), backend=self.backend, dynamic=self.dynamic)

    def __call__(self, model, *args, **kwargs):
        if self._hooks_changed(model):
            recapture(self, model)  # the new captures are what runs now
        out = self.fn(model, *args, **kwargs)
        if self.grafter.report.graphs != self.graphs:  # a new capture: modules may have changed
            self.graphs = self.grafter.report.graphs
            self.dicts = _hook_dicts(model)
            self._compare()
        return out

    def _hooks_changed(self, model) -> bool:
        """Whether the hooks changed since last noted (the dicts are listed after the first capture:
        before it there is nothing to compare)."""
        if RemovableHandle.next_id == self.handles and (
            not any(self.dicts) if self.sizes is None else tuple(map(len, self.dicts)) == self.sizes
        ):
            return False
        return self._compare()

    def _compare(self) -> bool:
        """Note the hooks as they are now; whether they differ from those last noted."""
        hooks = tuple(tuple(d) for d in self.dicts)
        changed = self.hooks is not None and hooks != self.hooks
        sizes = tuple(map(len, self.dicts))
        # None: no hooks at all (most models), where `any` over the dicts is the cheaper check
        self.hooks, self.sizes, self.handles = hooks, sizes if any(sizes) else None, RemovableHandle.next_id
        return changed


def _compile_again(model, *args, **kwargs) -> None:
    """`model.compile(...)` on an optimized model: it would swap kernelgraft's compiled call for a
    plain torch.compile one (no kernels) while the report still listed them. The model stays as
    optimize() compiled it, and a warning says so."""
    warn_once(
        ("model.compile", id(model)),
        f"kernelgraft: {type(model).__name__}.compile() on a model kernelgraft.optimize compiled: ignored, the "
        "model keeps kernelgraft's compiled graphs (inductor with its kernels). To compile it with torch.compile "
        "alone, load the model again and call compile() on that instead of optimize().",
    )


# what optimize() adds to a model's instance dict: left out of a copy, which gets its own
_ADDED = ("__deepcopy__", "__reduce_ex__", "compile", "_compiled_call_impl", "kernelgraft_report")


@contextlib.contextmanager
def _without_added(model):
    """Inside the block `model` looks as it did before optimize (for the copy machinery)."""
    call = model.__dict__.get("_compiled_call_impl")
    layers = getattr(getattr(call, "args", (None,))[0], "layers", None)
    saved = {k: model.__dict__.pop(k) for k in _ADDED if k in model.__dict__}
    if layers is not None:  # the layers' calls: the copy makes its own
        layers.remove()
    try:
        yield
    finally:
        model.__dict__.update(saved)
        if layers is not None:
            layers.install()


def _deepcopy(model, settings, memo):
    """copy.deepcopy of an optimized model: the copy of the plain model, optimized as the original
    was (its own compiled call and report; it compiles on its first call)."""
    with _without_added(model):
        clone = copy.deepcopy(model, memo)
    return optimize(clone, **settings)


def _reduce_ex(model, settings, protocol):
    """pickle / torch.save of an optimized model: the plain model's state, and on loading it is
    optimized again as the original was (kernelgraft must be importable where it is loaded).
    copy.copy asks for this too, and takes no state setter: it gets a shallow copy made as below."""
    if sys._getframe(1).f_globals.get("__name__") == "copy":
        return (_shallow_copy, (model, settings))
    with _without_added(model):
        rv = model.__reduce_ex__(protocol)
    if not isinstance(rv, tuple) or len(rv) < 3:
        return rv
    return (rv[0], rv[1], (rv[2], settings), None, None, _restore)


def _shallow_copy(model, settings):
    """copy.copy of an optimized model: the plain model's shallow copy (its parameters shared),
    optimized as the original was (its own compiled call and report)."""
    with _without_added(model):
        clone = copy.copy(model)
    return optimize(clone, **settings)


def _restore(obj, state) -> None:
    """The state setter of an unpickled optimized model: its state, then optimize()."""
    plain, settings = state
    if hasattr(obj, "__setstate__"):
        obj.__setstate__(plain)
    else:  # pragma: no cover - every nn.Module has __setstate__
        obj.__dict__.update(plain)
    optimize(obj, **settings)


def _call(compiled, model, *args, **kwargs):
    # an outer torch.compile traces this call (this thread's): run it as is
    if torch.compiler.is_dynamo_compiling():
        return _nested(compiled, model, *args, **kwargs)
    return _run(compiled, model, *args, **kwargs)


def _choose_memory(compiled, model, args, kwargs) -> None:
    """Options.memory's levers, from the first training call's tokens (memory.choose); offload only
    where the model has a layer stack."""
    grafter = compiled.grafter
    found = _memory.call_shape(args, kwargs)
    no_stack = layer_stacks(model)[1] if compiled.layers is None else ""
    choice = _memory.choose(model, grafter.options, *found, no_stack=no_stack) if found else None
    compiled.memory_chosen = True
    if choice is None:
        model.kernelgraft_report.notes.append(
            "memory: no decoder shape (hidden size, layers) in the model's config, or no input ids in "
            "its call: no lever chosen"
        )
        return
    model.kernelgraft_report.memory = choice
    grafter.options = grafter.options.replace(
        tile_tokens=choice.tile_tokens, lm_head_memory=choice.lm_head_memory
    )
    if choice.offload and compiled.layers is None:
        capture_layers(compiled, model, offload=True)
    elif choice.offload:
        compiled.layers.offload = True


def _run(compiled, model, *args, **kwargs):
    if compiled.trained or not (model.training and torch.is_grad_enabled()):
        return _run_once(compiled, model, *args, **kwargs)
    rng = rng_state()
    try:
        out = _run_once(compiled, model, *args, **kwargs)
    except Exception as e:
        # a first training call that failed where a graph withheld the logits: the model's own code
        # may have used them after that graph (a wrapper's metric after the layers' calls or a graph
        # break). Captured again with the logits made, the call runs again as it was; an error
        # that was not theirs comes back then
        if compiled.grafter.logits_read or not any(s.withheld for s in model.kernelgraft_report.sites):
            raise
        again_with_logits(compiled, model, model_line(e) or f"{type(e).__name__}")
        rng_state(rng)
        out = _run_once(compiled, model, *args, **kwargs)
    compiled.trained = True
    return out


def _run_once(compiled, model, *args, **kwargs):
    grafter = compiled.grafter
    training = model.training and torch.is_grad_enabled()
    if training and grafter.options.memory is not None and not compiled.memory_chosen:
        _choose_memory(compiled, model, args, kwargs)
    if training and compiled.layered is None:
        compiled.layered = sharded(model)
    kwargs = no_cache_in_training(model, kwargs, compiled.layers is not None or bool(compiled.layered))
    if compiled.layers is not None:
        with own_checkpointing(compiled.layers):
            out = _run_compiled(compiled, model, *args, **kwargs)
        if compiled.layers.not_a_stack:
            pass_over(compiled, model)
        return out
    return _run_compiled(compiled, model, *args, **kwargs)


def _run_compiled(compiled, model, *args, **kwargs):
    grafter = compiled.grafter
    decoding, caller, before = DECODING.set(_decodes(kwargs)), runs.CALLER.set(grafter), runs.runs(grafter)
    taken = compiled.clock.before(grafter)
    try:
        # floats as numbers, hooks guarded, logging calls no graph break, room for every live model
        with capture_settings(models=_pow2(len(runs.LIVE)), nested=compiled.layers is not None):
            out = compiled(model, *args, **kwargs)
        kind = grafter.capture_kind()  # this call's kind of graph, as its captures are reported
    finally:
        DECODING.reset(decoding)
        runs.CALLER.reset(caller)
    runs.check(grafter, model, before, args, kwargs)
    runs.times(grafter, before, kind)
    compiled.clock.after(grafter, taken, kind)
    rep = model.kernelgraft_report
    if rep.graphs != rep.hooks_seen_at:  # a new capture: look for what breaks graphs (rarely run)
        rep.hooks_seen_at = rep.graphs
        _warn_backward_hooks(model)
        _note_other_heads(model)
    # logits the fused LM head never made: the report confirms that this model withholds them
    return explain_withheld(out, lambda: any(s.withheld for s in model.kernelgraft_report.sites))


def _pow2(n: int) -> int:
    """The power of two at or above n (the recompile limits' factor changes only as models double)."""
    return 1 << max(0, n - 1).bit_length()


# forwards that libraries put on a model to fuse its LM head with the loss themselves:
# (the function's name, a folder its file is in) -> who
_OTHER_HEADS = {("_fused_forward", "trl"): "TRL's fused LM head (trl's add_fused_lm_head)"}


def _note_other_heads(model) -> None:
    """A forward put on the model (or a submodule) by a library that fuses the LM head with the
    loss itself, as TRL's SFTTrainer does: said in the report, since kernelgraft's head then
    never sees the logits and one fused head, theirs, runs."""
    rep = model.kernelgraft_report
    for name, mod in model.named_modules():
        fn, seen = getattr(mod.__dict__.get("forward"), "__func__", None), 0
        while fn is not None and seen < 8:  # through the wrappers around it (accelerate's mixed precision)
            code, seen = getattr(fn, "__code__", None), seen + 1
            folders = set(code.co_filename.replace("\\", "/").split("/")) if code is not None else set()
            for (name_of, folder), who in _OTHER_HEADS.items():
                note = (
                    f"the LM head and its loss run in {who} on {name or '<top>'}: kernelgraft's lm_head_ce "
                    "never sees the logits there, so one fused head runs, theirs"
                )
                if (
                    code is not None
                    and code.co_name == name_of
                    and folder in folders
                    and note not in rep.notes
                ):
                    rep.notes.append(note)
            fn = getattr(fn, "__wrapped__", None)


def _warn_backward_hooks(model) -> None:
    """Modules with full backward hooks: dynamo breaks the graph at each, and the sites around the
    breaks are captured in pieces or not at all. Said once per model and set of modules."""
    hooked = [
        name or "<top>"
        for name, mod in model.named_modules()
        if any(getattr(mod, a, None) for a in ("_backward_hooks", "_backward_pre_hooks"))
    ]
    if hooked:
        shown = ", ".join(hooked[:5]) + (f" and {len(hooked) - 5} more" if len(hooked) > 5 else "")
        warn_once(
            ("backward hooks", id(model), tuple(hooked)),
            f"kernelgraft: full backward hooks on {shown} ({type(model).__name__}): torch.compile breaks "
            "the model's graph at each hooked module, and kernelgraft serves only the sites it still "
            f"captures whole ({model.kernelgraft_report.counts()}). Remove the hooks (handle.remove()) "
            "for full speed; forward hooks do not break the graph.",
        )


@torch.compiler.disable
def _nested(compiled, model, *args, **kwargs):
    """A call traced by an outer torch.compile (`torch.compile(model)` of an optimized model): not
    traced, but run as it is (its own compiled graphs, kernels included); the outer compile breaks
    its graph here."""
    warn_once(
        ("nested", id(model)),
        f"kernelgraft: torch.compile of a model that kernelgraft.optimize compiled already "
        f"({type(model).__name__}): the model runs its own compiled graphs with kernelgraft's kernels, and "
        "the outer torch.compile adds nothing around it: use the model itself.",
    )
    return _run(compiled, model, *args, **kwargs)


def output_heads(model: torch.nn.Module) -> tuple[str, ...]:
    """The paths (as `named_modules` names them) of the model's output embeddings, where it declares
    them (Hugging Face's `get_output_embeddings`): where an LM head + loss site is expected, and
    reported when none is served, refused or close."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a model whose accessor fails declares no head
        return ()
    if not isinstance(head, torch.nn.Module):
        return ()
    return tuple(name for name, m in model.named_modules() if m is head and name)


def explain(model: torch.nn.Module, *args, patterns=None, **kwargs) -> RewriteReport:
    """Capture `model(*args, **kwargs)` once, without changing the model, and report what
    kernelgraft would replace (`.counts()`, `.sites`), what it would not serve (`.fallbacks`)
    and what nearly matched (`.near_misses`).

    >>> import torch, kernelgraft
    >>> class Norm(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = torch.nn.Parameter(torch.ones(8))
    ...     def forward(self, x):
    ...         h = x.float()
    ...         h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    ...         return self.weight * h.to(x.dtype)
    >>> kernelgraft.explain(Norm(), torch.randn(2, 8)).counts()
    {'rms_norm': 1}
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"kernelgraft.explain: expected a torch.nn.Module, got {type(model).__name__}")
    # explain shows what a training step would get (the LM head fused) though it captures under no_grad
    grafter = Grafter("eager", patterns, dry_run=True, training=True, heads=output_heads(model))
    from torch._dynamo.utils import counters  # import here: dynamo's, read around the capture

    before, ran = Counter(counters["graph_break"]), runs.runs(grafter)
    with torch.no_grad(), capture_settings():
        torch.compile(fresh_entry("explain"), backend=grafter)(model, *args, **kwargs)
    runs.times(grafter, ran, "training")  # a frame resumed after a graph break runs once per layer
    grafter.report.graph_breaks = graph_break_reasons(Counter(counters["graph_break"]) - before)
    if grafter.report.graphs == 0:
        raise RuntimeError(
            "kernelgraft.explain: dynamo captured no graph of this model (see TORCH_LOGS=graph_breaks); "
            "nothing would be replaced"
        )
    return grafter.report
