"""Lower: the torch.compile backend. On each dynamo graph it runs the pipeline (pipeline.graft), then
hands the rewritten graph to inductor (default) or runs it as is ("eager").
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import time
from collections import Counter

import torch
from torch._guards import CompileContext
from torch._subclasses.fake_tensor import is_fake

from ..kernels.fallback import warn_once
from ..options import Options
from ..patterns import REGISTRY, Registry, Spelling
from . import attention, ddp, launch_record, lowering, runs
from .pipeline import graft
from .report import _RECORDS, RewriteReport
from .runs import LAYERS, under_layers

# set around a model's call that decodes (a KV cache passed in, as generate() passes one): its
# graphs without gradients are reported as decoding, not evaluation
DECODING = contextvars.ContextVar("kernelgraft_decoding", default=False)
# set while an offloaded layer runs its forward under no_grad (offload.py): that graph is a training
# step's, grafted and reported as one, and the backward runs the same kernels again with gradients
CHECKPOINTED: contextvars.ContextVar[bool] = contextvars.ContextVar("kernelgraft_checkpointed", default=False)


def resolve_patterns(patterns) -> list:
    """None -> every registered spelling; a Registry -> its spellings; names and Spelling objects
    -> those."""
    if patterns is None:
        return REGISTRY.spellings()
    if isinstance(patterns, Registry):
        return patterns.spellings()
    if isinstance(patterns, (str, Spelling)):
        patterns = [patterns]
    out = []
    for p in patterns:
        out.extend([p] if isinstance(p, Spelling) else REGISTRY.spellings([p]))
    return out


class Grafter:
    """A torch.compile backend: the pipeline (pipeline.graft), then lower, on every captured graph.

    backend: "inductor" or "eager" (None: options.backend). options: a kernelgraft.Options.
    dry_run: report only, the graph runs as captured. probe (with dry_run): called as
    probe(record, spelling, values) with each served site's run-time arguments (kernelgraft.audit).
    training: judge the sites as a training step (gradients on) whatever the capture's grad mode
    (explain and audit capture under no_grad or for a probe); None: as captured. heads: the paths
    of the model's output embeddings, reported where no LM head + loss site is found.

    >>> import torch, kernelgraft
    >>> f = torch.compile(lambda x: x * 2, backend=kernelgraft.Grafter("eager"))
    >>> f(torch.ones(2)).tolist()
    [2.0, 2.0]
    """

    def __init__(
        self,
        backend: str | None = None,
        patterns=None,
        *,
        options: Options | None = None,
        dry_run: bool = False,
        probe=None,
        training: bool | None = None,
        heads: tuple = (),
    ):
        if options is not None and not isinstance(options, Options):
            raise TypeError(
                f"kernelgraft.Grafter: options must be a kernelgraft.Options, got {type(options).__name__}; "
                "write options=kernelgraft.Options(recompute=False), say"
            )
        options = options or Options()
        self.options = options.replace(backend=backend) if backend is not None else options
        self.spellings = resolve_patterns(patterns)
        self.dry_run = dry_run
        self.probe = probe
        self.training = training
        self.heads = heads  # the model's output embeddings' paths (api.output_heads)
        self.report = RewriteReport(dry_run=dry_run)
        self.runs = self.foreign_runs = 0  # runs of its compiled graphs; others' run in its model's calls
        self.limit_hits: list[str] = []  # dynamo's recompile limits hit in its model's calls
        self.graph_runs: list[int] = []  # runs of each compiled graph (runs.counted), by their order
        self.graph_keys: list = []  # and the capture each belongs to
        # where the model's code read logits a graph withheld, after that graph (its line): the
        # model is captured again with them made (recapture.py; "" while none was read)
        self.logits_read = ""
        self.rewrite_seconds = 0.0  # time spent in the pipeline (graft), for the report's startup lines
        # graph nodes handed to the pipeline and to the lowering (inductor's or eager's): the work of
        # capture, which capture="layers" keeps from growing with depth
        self.nodes: Counter = Counter()
        self._grafted_whole = False  # set while DDP's pieces of an already grafted graph come in
        ddp.install()

    @property
    def backend(self) -> str:
        return self.options.backend

    def capture_kind(self) -> str:
        """The kind of graph being captured (report.CAPTURES): training with gradients on (or where
        `training` says so), else decoding inside a call that passed a KV cache, else evaluation."""
        training = (
            self.training if self.training is not None else torch.is_grad_enabled() or CHECKPOINTED.get()
        )
        if training:
            return "training"
        return "decoding" if DECODING.get() else "evaluation"

    def _graft(self, gm, runtime_masks: bool) -> RewriteReport:
        start = time.perf_counter()
        self.nodes["rewritten"] += len(gm.graph.nodes)
        try:
            return self._pipeline(gm, runtime_masks)
        finally:
            self.rewrite_seconds += time.perf_counter() - start

    def _pipeline(self, gm, runtime_masks: bool) -> RewriteReport:
        return graft(
            gm,
            self.spellings,
            self.options,
            dry_run=self.dry_run,
            probe=self.probe,
            training=True if self.training is None and CHECKPOINTED.get() else self.training,
            runtime_masks=runtime_masks,
            heads=self.heads,
            logits_read=self.logits_read,
        )

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        frame = _frame_id()
        key = frame if frame is not None else self.report.graphs  # as report.extend keys its records
        return runs.counted(self, self._compile(gm, example_inputs), key)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs):
        if self._grafted_whole:
            return self._lower(gm, example_inputs)
        # a copy of the graph as captured, for the calls whose masks fail their run-time check
        checking = not self.dry_run and self.options.causal_attention
        stock = _graph_copy(gm) if checking and attention.has_input_masks(gm) else None
        grafted = self._graft(gm, runtime_masks=True)
        if LAYERS.get():
            _under(grafted, LAYERS.get())
        self.report.extend(grafted, frame=_frame_id(), capture=self.capture_kind())
        compiled = self._lower(gm, example_inputs)
        checks = gm.meta.pop(attention.META, None)
        if not checks:
            return compiled
        self.report.mask_checks += checks
        return MaskChecked(checks, compiled, functools.partial(self._fallback, stock))

    def _lower(self, gm, example_inputs):
        self.nodes["lowered"] += len(gm.graph.nodes)
        if self.options.backend == "inductor" and not self.dry_run:
            counted = Counter(self.report.launched_by)
            try:
                return self._lower_inductor(gm, example_inputs)
            except Exception as e:  # noqa: BLE001 - inductor's own failure: the graph runs as captured
                self._attempt_failed(
                    counted, e, "inductor failed",
                    "kernelgraft: inductor could not compile a graph of this model ({why}). It runs as "
                    "captured instead, kernelgraft's kernels included, each op launched from the host "
                    "(slower than compiled, the same numbers as the model's code).",
                )  # fmt: skip
                why = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                self.report.notes.append(f"a graph inductor could not compile runs as captured ({why})")
        if not self.dry_run:  # run as it is: the kernels called without the dispatcher's work on each call
            lowering.eager_calls(gm)
        return gm.forward

    def _lower_inductor(self, gm, example_inputs):
        """gm compiled by inductor, its kernels launched by inductor's code where that compiles."""
        if not self.options.inductor_launches:
            return self._inductor(gm, example_inputs, launch=False)
        counted = Counter(self.report.launched_by)
        try:
            return self._inductor(gm, example_inputs, launch=True)
        except Exception as e:  # noqa: BLE001 - compiled again with the kernels launched from the host
            self._attempt_failed(
                counted, e, "inductor launches failed",
                "kernelgraft: inductor could not compile this graph with kernelgraft's kernels launched "
                "by its own code ({why}). Compiled again with them launched from kernelgraft's Python "
                "launcher (slower on the host; a kernel that fails there falls back to the stock code). "
                "If this compile fails too, the error is inductor's, not the kernels'.",
            )  # fmt: skip
            return self._inductor(
                gm, example_inputs, launch=False, because="inductor's launches failed to compile"
            )

    def _inductor(self, gm, example_inputs, launch: bool, because: str | None = None):
        """gm compiled by inductor; launch: its generated code launches kernelgraft's kernels
        (rewriter/lowering.py), else they run their Python launcher (`because` is then counted)."""
        # torch's own modules, imported on first use: inductor is slow to import
        from torch._inductor import config as inductor_config
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        o = self.options
        # torch.compile(mode=...)'s inductor settings (CUDA graphs for "reduce-overhead")
        patches = dict(list_mode_options(o.mode)) if o.mode not in (None, "default") else {}
        tags = lowering.recompute_tags(gm)
        if o.fuse_recompute or o.fuse_residual or launch or because or tags:
            key = "post_grad_custom_post_pass"
            patches[key] = lowering.PostGradPass(
                chained=getattr(inductor_config, key),
                fuse_recompute=o.fuse_recompute,  # not "separate": made by the backward kernels
                fuse_residual=o.fuse_residual,
                launch=launch,
                launches=self.report.launched_by,
                host_because=because,
                tags=tags,
            )
        extra = {}
        if launch:  # each launch's kernel analysed once per specialization
            from torch._inductor.compile_fx import compile_fx_inner

            extra["inner_compile"] = lowering.memoizing_inner_compile(compile_fx_inner)
            lowering.keep_static_launches()
        training = self.training if self.training is not None else torch.is_grad_enabled()
        wrapper = "Python"
        post = patches.get("post_grad_custom_post_pass")
        record = functools.partial(self._launch_record, gm, example_inputs, post)
        if o.cpp_wrapper(training, _on_cuda(example_inputs), _dynamic(example_inputs), _has_kernels(gm)):
            counted = Counter(self.report.launched_by)
            try:
                with lowering.tangents_laid_out_as_outputs(), record("C++"):
                    compiled = compile_fx(
                        gm, example_inputs, config_patches=dict(patches, cpp_wrapper=True), **extra
                    )
                self.report.wrappers["C++"] += 1
                return compiled
            except Exception as e:  # noqa: BLE001 - no C++ compiler, or a graph the C++ wrapper cannot take
                self._attempt_failed(
                    counted, e, "cpp wrapper failed",
                    "kernelgraft: inductor's C++ wrapper failed to compile this graph ({why}). Compiled "
                    "again with its Python wrapper (slower on the host; wrapper='python' skips the attempt).",
                )  # fmt: skip
                wrapper = "Python (the C++ wrapper failed to compile)"
        with lowering.tangents_laid_out_as_outputs(), record(wrapper):
            compiled = compile_fx(gm, example_inputs, config_patches=patches or None, **extra)
        self.report.wrappers[wrapper] += 1
        return compiled

    @contextlib.contextmanager
    def _launch_record(self, gm, example_inputs, post, wrapper: str):
        """Around one compile: the post-grad pass counts its launches into a record kept beside
        inductor's cache, and what it did not count (a graph loaded from the cache) is read back."""
        if post is None:
            yield
            return
        inputs = [
            (tuple(a.shape), a.dtype, a.stride()) if isinstance(a, torch.Tensor) else a
            for a in example_inputs
        ]
        key = launch_record.graph_key(
            gm.code, inputs, self.options, wrapper, post.launch, post.host_because, post.uuid()
        )
        # kept on the pass: inductor compiles the backward graph later, on the first backward
        post.record = launch_record.LaunchRecord(key, self.report.launched_by)
        yield
        post.record.read_missing()

    def _attempt_failed(self, counted: Counter, e: Exception, key: str, message: str) -> None:
        """A compile attempt that raised `e`: the launches it counted are void (the report's counts
        go back to `counted`), and `message` (its {why} filled in) is said once per reason."""
        why = f"{type(e).__name__}: {e}"[:300]
        self.report.launched_by.clear()
        self.report.launched_by.update(counted)
        warn_once((key, why), message.format(why=why))

    def _fallback(self, stock: torch.fx.GraphModule, args):
        """The graph with its masks as written (those proven on the graph still rewritten), lowered
        with the arguments of the call that needs it (the graph's sizes are static)."""
        self._graft(stock, runtime_masks=False)
        return self._lower(stock, list(args))

    # ---- DistributedDataParallel (ddp.py): the graph grafted whole, before DDPOptimizer cuts it ----

    def grafts_whole(self) -> bool:
        """Whether a DDP graph about to be cut should be grafted whole first."""
        return not self.dry_run and not self._grafted_whole

    @contextlib.contextmanager
    def grafted_whole(self, gm: torch.fx.GraphModule):
        """gm grafted now; inside the block, the pieces DDPOptimizer cuts from it are only lowered.
        Masks that read graph inputs are kept: checks by position would not survive the cut."""
        self.report.extend(
            self._graft(gm, runtime_masks=False), frame=_frame_id(), capture=self.capture_kind()
        )
        self._grafted_whole = True
        try:
            yield
        finally:
            self._grafted_whole = False


class MaskChecked:
    """A compiled graph whose attention calls run with is_causal=True on the condition that their
    masks, read from the graph's inputs, are causal (attention.MaskCheck): each call checks them and
    runs the compiled graph, or else the graph with its masks as written (compiled on first need)."""

    def __init__(self, checks, compiled, make_fallback):
        self.checks, self.compiled, self.make_fallback = checks, compiled, make_fallback
        self.fallback = None

    def __call__(self, *args):
        if any(is_fake(a) for a in args):
            # a trace, not a run (DDP's graph splitter runs each compiled piece on fake tensors to
            # propagate shapes): no values to check, and either graph gives the same shapes
            return self.compiled(*args)
        if all(c.holds(args) for c in self.checks):
            return self.compiled(*args)
        if self.fallback is None:
            self.fallback = self.make_fallback(args)
        return self.fallback(*args)


def _under(report: RewriteReport, path: str) -> None:
    """The records' module paths, relative to a layer, read from the model's root (`path.*`)."""
    for name in _RECORDS:
        for r in getattr(report, name):
            if isinstance(getattr(r, "module", None), str):
                r.module = under_layers(r.module, path)


def _on_cuda(example_inputs) -> bool:
    """Whether a graph's tensor inputs are on a CUDA device."""
    return any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in example_inputs)


def _dynamic(example_inputs) -> bool:
    """Whether a graph was captured with dynamic sizes (symbolic ints among its inputs or in its
    inputs' shapes)."""
    return any(
        isinstance(a, torch.SymInt)
        or (isinstance(a, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in a.shape))
        for a in example_inputs
    )


def _has_kernels(gm: torch.fx.GraphModule) -> bool:
    """Whether the grafted graph calls any of kernelgraft's ops."""
    return any(n.op == "call_function" and str(n.target).startswith("kernelgraft.") for n in gm.graph.nodes)


def _graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """gm's graph copied (nodes and their meta), sharing gm's attributes."""
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out.meta.update(gm.meta)
    return out


def _frame_id():
    """(dynamo's id of the frame being compiled, the number of this compile of it), if it tells."""
    try:
        cid = CompileContext.current_compile_id()
        if getattr(cid, "frame_id", None) is None:
            return None
        return (cid.frame_id, getattr(cid, "frame_compile_id", None))
    except Exception:  # noqa: BLE001 - older/newer torch without it: every capture counts
        return None


def _named_backend(gm, example_inputs):
    return Grafter()(gm, example_inputs)  # the default Options


def register() -> None:
    """Make `torch.compile(model, backend="kernelgraft")` work (idempotent)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "kernelgraft" not in _BACKENDS:
        register_backend(name="kernelgraft")(_named_backend)
