"""Lower: kernelgraft's op calls in inductor's post-grad graphs -> the Triton launches they make,
recorded in the graph, so inductor's generated code makes them itself.

A grafted site is a custom op (kernels/: opaque to dynamo and AOT autograd, which see its fake
implementation, shapes and strides). Called as such, each call runs the Python launcher: layout,
grid, block sizes, strides, then Triton's own launch path, a few hundred microseconds of host time
per call, on a GPU. Here, after AOT autograd has split the forward and backward and the rewriter's
recompute pass has run, the calls of each op whose implementation is traceable
(family.define(traceable=True)) are replaced by that implementation traced on each call's fake
arguments (make_fx, launching.traced_launches): the allocations and torch ops it makes, and each
Triton launch as torch's user-defined-kernel call (`triton_kernel_wrapper_mutation`, what
`torch.library.wrap_triton` records), with the grid, block sizes and strides the launcher chose for
these shapes as constants. Inductor then launches the very same kernel source from its wrapper, as
it launches its own kernels, and can put it in a CUDA graph.

A call stays a host launch (counted in the report) where its arguments are not all CUDA tensors of
static sizes (the CPU's kernels run in Triton's interpreter; symbolic sizes have no grid to fix),
or where tracing fails (a kernel that failed in this process: its stock code runs instead).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import operator
from collections import Counter

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from ..kernels import cache_files
from ..kernels.family import eager_call_of, traceable_impl
from ..kernels.launching import is_kernelgraft_kernel, traced_launches
from . import launch_record, recompute, residual


def _static_cuda(v) -> bool:
    if not isinstance(v, torch.Tensor):
        return False
    if v.device.type != "cuda":
        return False
    return all(type(d) is int for d in (*v.shape, *v.stride()))


def host_reason(node: fx.Node) -> str | None:
    """Why this op call keeps its host launch (None: it can be traced for inductor)."""
    vals = []
    for a in node.args:
        if isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
            return "a list of tensors as an argument"
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if v is None:
                return "no fake value recorded for an argument"
            vals.append(v)
    if not vals:
        return "no tensor arguments"
    if not all(v.device.type == "cuda" for v in vals):
        return "not on CUDA (the CPU's kernels run in Triton's interpreter, from the host)"
    if not all(map(_static_cuda, vals)):
        return "symbolic sizes (dynamic shapes): no grid to fix at compile time"
    return None


def _signature(node: fx.Node, vals: list) -> tuple:
    """What a trace of this call depends on: the op, each tensor argument's shape, strides, offset
    and dtype, which arguments are one graph value, and the other arguments' values."""
    first: dict = {}
    tensors = iter(vals)
    sig = [node.target]
    for a in node.args:
        if isinstance(a, fx.Node):
            v = next(tensors)
            sig.append(
                (
                    "T",
                    tuple(v.shape),
                    v.stride(),
                    v.storage_offset(),
                    v.dtype,
                    str(v.device),
                    first.setdefault(a, len(first)),
                )
            )
        else:
            sig.append(repr(a))
    return tuple(sig)


# traces by signature, for the fake mode they were made in (one compile's): a model's layers repeat
# the same calls, each traced once
_TRACES: dict = {"mode": None, "traces": {}}


def _trace(impl, node: fx.Node) -> fx.GraphModule:
    """impl on the node's arguments, traced (once per signature and fake mode): fx nodes become the
    traced function's inputs."""
    positions = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
    vals = [node.args[i].meta["val"] for i in positions]
    fake_mode = detect_fake_mode(vals)
    if _TRACES["mode"] is not fake_mode:
        _TRACES.update(mode=fake_mode, traces={})
    key = _signature(node, vals)
    if key not in _TRACES["traces"]:
        _TRACES["traces"][key] = _make_trace(impl, node, positions, vals, fake_mode)
    return _TRACES["traces"][key]


def _make_trace(impl, node: fx.Node, positions: list, vals: list, fake_mode) -> fx.GraphModule:
    """make_fx of impl on the node's fake arguments (at `positions`), its launches recorded."""

    def launch(*tensors):
        args = list(node.args)
        for i, t in zip(positions, tensors):
            args[i] = t
        with traced_launches():
            out = impl(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    # one graph value, one fake tensor: a value passed twice (a pair's shared cos) is seen so (two
    # graph values carry two: _inline gives each copy of a trace fake values of its own)
    first: dict = {}
    vals = [first.setdefault(node.args[i], v) for i, v in zip(positions, vals)]
    # in the post-grad graph's own terms: aten ops decomposed as inductor's graphs have them
    from torch._inductor.decomposition import select_decomp_table  # import here: inductor is slow to import

    with fake_mode:
        return make_fx(launch, decomposition_table=select_decomp_table(), tracing_mode="real")(*vals)


def _pin_strides(n: fx.Node) -> None:
    """A recorded launch's tensors held to the exact strides they were traced with. The launcher
    passed them to the kernel as constants (row strides, say), but inductor by default holds a
    user-defined kernel's arguments only to their stride order: a buffer it lays out otherwise
    (padded, or a view it materializes) would be read with the traced strides, wrongly. Where a
    node carries the eager values of its arguments, inductor requires their exact strides
    (copying into them where its layout differs)."""

    def val(a):
        if isinstance(a, fx.Node):
            return a.meta.get("val")
        return a

    if all(isinstance(a.meta.get("val"), torch.Tensor) for a in n.all_input_nodes):
        n.meta["eager_input_vals"] = (
            tuple(fx.node.map_aggregate(n.args, val)),
            dict(fx.node.map_aggregate(n.kwargs, val)),
        )


def _inline(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule) -> None:
    """sub's nodes in `graph` in place of `node` (whose users are getitems of its outputs). Each
    copy gets fake values of its own, made from its inputs' (a trace is made once and copied for
    the calls of its signature: copied with it, its fake values would make the calls' outputs one
    tensor to the passes that follow: one storage, and a later trace reading two of them would read
    one twice)."""
    inputs = [a for a in node.args if isinstance(a, fx.Node)]
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env = dict(zip(placeholders, inputs))
    with graph.inserting_before(node):
        outs = graph.graph_copy(sub.graph, env)
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation as launch

    fake_mode = detect_fake_mode([a.meta.get("val") for a in inputs])
    with fake_mode:
        for s in sub.graph.nodes:
            if s.op != "call_function":
                continue
            n = env[s]
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
            n.meta["val"] = n.target(*args, **kwargs)
            if n.target is launch:
                _pin_strides(n)
    for u in list(node.users):
        if u.op == "call_function" and u.target is operator.getitem:
            u.replace_all_uses_with(outs[u.args[1]])
            graph.erase_node(u)
        else:  # pragma: no cover - the ops return tuples or lists, read through getitem
            raise AssertionError(f"{node}: read other than through getitem ({u})")
    graph.erase_node(node)


def launch_in_graph(graph: fx.Graph) -> Counter:
    """The calls of traceable kernelgraft ops in `graph` -> their traced launches, in place.
    -> Counter: "inductor" (calls replaced), and per reason the calls left to launch from the host."""
    counts: Counter = Counter()
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        impl = traceable_impl(node.target)
        if impl is None:
            continue
        why = host_reason(node)
        if why is None:
            try:
                sub = _trace(impl, node)
            except Exception as e:  # noqa: BLE001 - any trace failure: the op launches from the host, as before
                why = f"could not be traced ({type(e).__name__}: {e})"
        if why is not None:
            counts[f"host: {why}"] += 1
            continue
        _inline(graph, node, sub)
        counts["inductor"] += 1
    return counts


def eager_calls(gm: torch.fx.GraphModule) -> int:
    """A graph run as it is (the eager backend): each kernelgraft op whose family has an eager
    function (family.eager_call) runs that instead, the same implementation without the
    dispatcher's work on each call. -> how many calls changed."""
    done = 0
    for node in gm.graph.nodes:
        if node.op == "call_function":
            eager = eager_call_of(node.target)
            if eager is not None:
                node.target = eager
                done += 1
    if done:
        gm.recompile()
    return done


# ---- compile time: inductor reads each launch's kernel to learn which arguments it writes --------

# the analysis functions inductor calls per user-defined kernel launch (the names differ between
# torch releases): each makes the kernel's Triton IR anew, for every one of a model's hundreds of
# launches, though a model's layers repeat the same few
_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")


def _analysis_key(args: tuple, kwargs: dict):
    """What the analysis of one launch depends on: the kernel, and each argument as Triton
    specializes it (a tensor by its dtype, anything else by its value)."""
    kernel, named, *rest = args

    def arg(v):
        dtype = getattr(v, "dtype", None)
        if dtype is None and hasattr(v, "get_dtype"):
            dtype = v.get_dtype()
        if dtype is not None:
            return ("T", str(dtype))
        if isinstance(v, (int, float, bool, str, type(None))):
            return v
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("sym",)
        return ("repr", repr(v))

    return (
        id(kernel),
        tuple((k, arg(v)) for k, v in sorted(named.items())),
        repr(rest),
        repr(sorted(kwargs.items())),
    )


@contextlib.contextmanager
def memoized_kernel_analysis():
    """Inside the block, inductor's analysis of a user-defined kernel launch (which arguments it
    reads and writes) is made once per kernel and argument specialization: a model's layers launch
    the same kernels with the same sizes. The result is a copy each time, as if made anew; the
    memo lives as long as the block (one graph's compile, which keeps the kernels alive)."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap  # import here: inductor's, slow to import

    originals = {name: getattr(wrap, name) for name in _ANALYSES if hasattr(wrap, name)}
    memo: dict = {}

    def memoized(fn):
        def analysis(*args, **kwargs):
            try:
                key = _analysis_key(args, kwargs)
            except Exception:  # noqa: BLE001 - arguments not as expected: no memo, the analysis as is
                return fn(*args, **kwargs)
            if key not in memo:
                memo[key] = fn(*args, **kwargs)
            return copy.deepcopy(memo[key])

        return analysis

    for name, fn in originals.items():
        setattr(wrap, name, memoized(fn))
    try:
        yield memo
    finally:
        for name, fn in originals.items():
            setattr(wrap, name, fn)


@contextlib.contextmanager
def static_launches():
    """Inside the block, kernelgraft's generated kernels (launching.is_kernelgraft_kernel) are
    launched by inductor's static launcher, as inductor launches its own kernels. To inductor they are
    user-defined kernels, which it compiles in its worker processes under its default of launching
    them through Triton's own launcher (each argument bound in Python on every launch), which a
    small model's step would pay on hundreds of launches. Their compiled results are swapped for static ones in this
    process, as inductor makes their launchers; the same cubin. Anything unexpected (another
    torch, a kernel the static launcher cannot take) leaves a result as it is."""
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.runtime import triton_heuristics as th

        tuner, dynamic, static = th.CachingAutotuner, th.TritonCompileResult, th.StaticTritonCompileResult
        user = th.HeuristicType.USER_AUTOTUNE
        usable = hasattr(inductor_config, "static_launch_user_defined_triton_kernels") and bool(
            getattr(inductor_config, "use_static_cuda_launcher", False)
        )
    except (ImportError, AttributeError):
        usable = False
    if not usable:
        yield
        return

    def as_static(result, at):
        if type(result) is not dynamic:
            return result
        try:
            with inductor_config.patch(static_launch_user_defined_triton_kernels=True):
                kernel = static.can_statically_launch(result.kernel, at.inductor_meta, at.triton_meta, user)
            if kernel is None:
                return result
            return static(kernel, result.config, result.compile_meta, result.inductor_meta)
        except Exception:  # noqa: BLE001 - a launcher this torch cannot make statically keeps Triton's own
            return result

    # swapped where the launchers are made from the compiled results: after a worker compiled them
    # (precompile finds them made) and also where precompile compiles them in this process (a
    # process whose compile workers are not ready yet: a short script's first compile)
    original = tuner._make_launchers

    def make_launchers(self, *args, **kwargs):
        if (
            self.heuristic_type == user
            and self.compile_results
            and not self.launchers
            and is_kernelgraft_kernel(getattr(self.fn, "__name__", None))
        ):
            self.compile_results = [as_static(r, self) for r in self.compile_results]
        return original(self, *args, **kwargs)

    tuner._make_launchers = make_launchers
    try:
        yield
    finally:
        tuner._make_launchers = original


def launcher_kinds() -> dict[str, set[str]]:
    """Each kernelgraft kernel inductor has compiled in this process -> the kinds of its compiled
    results (`StaticTritonCompileResult`: inductor's static launcher; `TritonCompileResult`:
    Triton's own, every argument bound in Python on each launch). For tests and profiles."""
    import gc
    import warnings

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    kinds: dict[str, set[str]] = {}
    with warnings.catch_warnings():  # isinstance on every object touches deprecated module proxies
        warnings.simplefilter("ignore", FutureWarning)
        tuners = []
        for o in gc.get_objects():
            try:
                if isinstance(o, CachingAutotuner):
                    tuners.append(o)
            except ReferenceError:
                continue
    for o in tuners:
        name = getattr(o.fn, "__name__", None)
        if is_kernelgraft_kernel(name):
            kinds.setdefault(name, set()).update(type(r).__name__ for r in o.compile_results)
    return kinds


_kept: contextlib.ExitStack | None = None


def keep_static_launches() -> None:
    """static_launches from now on, for the rest of the process (once; called before inductor
    compiles a graph with kernelgraft's launches). Not scoped to the inner compile: a graph AOT
    autograd loads from its cache never reaches the inner compile, and its kernels' launchers are made
    as it loads them; a lazily compiled backward makes them at the first backward call."""
    global _kept
    if _kept is None:
        stack = contextlib.ExitStack()
        stack.enter_context(static_launches())
        _kept = stack


def tangents_laid_out_as_outputs():
    """Inside the block, AOT autograd traces each output's incoming gradient with the output's own
    strides (the default of newer torch releases, 2.13 among them; an option, off, in 2.11), not
    as contiguous. Under the contiguous guess every non-contiguous output - a rotation of HF's
    (batch, head, position) view of q, laid out as q as eager lays it out - costs a copy of its
    gradient in every backward, nearly as long as the kernels themselves. A gradient laid out otherwise is still made to match, as before."""
    from torch._functorch import config as functorch_config

    if not hasattr(functorch_config, "guess_tangent_strides_as_outputs"):
        return contextlib.nullcontext()
    return functorch_config.patch(guess_tangent_strides_as_outputs=True)


def memoizing_inner_compile(inner):
    """inductor's inner compile (forward and backward graphs alike), under memoized_kernel_analysis."""

    def compile_graph(*args, **kwargs):
        with memoized_kernel_analysis():
            return inner(*args, **kwargs)

    return compile_graph


try:  # inductor's interface for a pass it keys its caches by (torch >= 2.5)
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
except ImportError:  # pragma: no cover - older torch: a plain callable, caching bypassed
    CustomGraphPass, get_hash_for_files = object, None


class PostGradPass(CustomGraphPass):
    """kernelgraft's passes over inductor's post-grad graphs, after any the user set (`chained`):
    recomputed outputs made by the backward kernels (recompute.py), the residual stream's adds
    joined to the norms' kernels (residual.py), then the launches recorded
    (launch_in_graph). `launches` (the report's Counter) counts what launch_in_graph did, through
    `record` where set: a graph inductor loads from its cache runs no pass, and reads them back."""

    def __init__(
        self,
        chained=None,
        fuse_recompute: bool = True,
        fuse_residual: bool = True,
        launch: bool = True,
        launches=None,
        host_because=None,
        tags: tuple = (),
    ):
        self.chained = chained
        # the graph's recompute tags (recompute_tags): AOT autograd's partition follows them, but its
        # cache does not key by them, so the pass's key does (a graph tagged otherwise, by another
        # option or release, is partitioned anew, not loaded as the other was cut)
        self.tags = tags
        self.fuse_recompute = fuse_recompute
        self.fuse_residual = fuse_residual
        self.launch = launch
        self.launches: Counter = launches if launches is not None else Counter()
        self.host_because = host_because  # without launches: why, counted per kernel call (None: not counted)
        self.record = None  # the compile's launch_record.LaunchRecord

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        if self.fuse_recompute:
            recompute.fuse_recomputed_outputs(graph)
        if self.fuse_residual:  # after the above: the backward's adds read its calls
            residual.add_into_norms(graph)
            residual.accumulate_into_gradients(graph)
        counts = launch_in_graph(graph) if self.launch else Counter()
        if not self.launch and self.host_because:
            calls = sum(
                1 for n in graph.nodes if n.op == "call_function" and traceable_impl(n.target) is not None
            )
            if calls:
                counts[f"host: {self.host_because}"] += calls
        if self.record is None:
            self.launches.update(counts)
        else:
            self.record.counted(launch_record.part_of(graph), counts)

    def uuid(self):
        if get_hash_for_files is None:
            return None
        theirs = None
        if self.chained is not None:
            theirs = self.chained.uuid() if hasattr(self.chained, "uuid") else None
            if theirs is None:
                return None  # a pass inductor cannot key: no caching, as without us
        # every family's files (their ops' names carry their ABI), and the passes' own
        files = (__file__, recompute.__file__, residual.__file__, *cache_files())
        return (
            get_hash_for_files(files),
            self.fuse_recompute,
            self.fuse_residual,
            self.launch,
            hashlib.sha256(repr(self.tags).encode()).hexdigest(),
            theirs,
        )


def recompute_tags(gm: torch.fx.GraphModule) -> tuple:
    """The recompute tags on `gm`'s nodes (kernelgraft's and the user's checkpointing), in order."""
    return tuple(
        (n.name, str(n.meta["recompute"]), n.meta.get("ac_graph_id"))
        for n in gm.graph.nodes
        if "recompute" in n.meta
    )
