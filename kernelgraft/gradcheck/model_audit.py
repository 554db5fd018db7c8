"""kernelgraft.audit(model, *args, **kwargs): how accurate is the optimized model, site by site and
parameter by parameter, next to the stock model?

1. Sites. The model runs once, stock, with a probe at every site kernelgraft would replace: each
   site's real arguments are recorded. On them, the site's kernel, eager PyTorch (the spelling in
   the working dtype) and torch.compile of the spelling are compared with float64 truth, output
   and every input gradient, by the comparison rule (rule.py).
2. Parameters. Three copies of the model run forward and backward on the same inputs: a reference
   in `reference_dtype` (float64 by default: stricter than an fp32 reference), the stock model and
   the optimized one, both in the model's own dtype. Per parameter, the optimized model's gradient
   error is judged against the stock model's (the same rule, eager as the reference).
3. Lints from the field: token ids whose embedding rows are all ~0 (untrained tokens, which give
   NaN or huge gradients once trained), and a loss that ignores `num_items_in_batch` (gradient
   accumulation then does not equal the full batch).

The copies run with dropout off (`eval()`) but gradients on, so that every run computes the same
function; the caller's model is not changed.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
from dataclasses import dataclass, field

import torch

from .._dynamo import capture_settings, fresh_entry, room_for_recompiles
from ..kernels import op_for
from ..options import Options
from ..rewriter import Grafter, optimize
from .references import Float64Everywhere
from .render import html, markdown
from .rule import bound, judge, rel_error
from .spelling import compare


@dataclass
class Row:
    """One compared quantity: a site's output or input gradient, or a parameter's gradient."""

    kind: str  # "site" | "param" | "loss"
    where: str  # module path (sites) or parameter name
    what: str  # "out", "grad x", "grad" ...
    pattern: str = ""  # pattern.spelling (sites)
    shapes: str = ""
    dtypes: str = ""
    kernelgraft: float = 0.0
    eager: float = 0.0
    compile: float | None = None
    note: str = ""  # "missing gradient", "nan", ...
    site: int = -1  # which site (sites: several rows each)

    @property
    def bound(self) -> float:
        return bound(self.eager, self.compile)

    @property
    def ok(self) -> bool:
        return not self.note and self.kernelgraft <= self.bound

    @property
    def ratio(self) -> float:
        """kernelgraft's error over its bound: above 1 fails."""
        if self.note:
            return math.inf
        return self.kernelgraft / self.bound


@dataclass
class Lint:
    name: str  # "untrained tokens", "num_items_in_batch ignored"
    message: str
    detail: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.name}: {self.message}"


@dataclass
class ModelAudit:
    """`.ok`, `.worst()`, `.failures()`, `.to_markdown()`, `.to_html(path)`; rows in `.sites`,
    `.params` (the loss first), lints in `.lints`."""

    model: str
    dtype: str
    device: str
    backend: str
    reference: str
    sites: list[Row] = field(default_factory=list)
    params: list[Row] = field(default_factory=list)
    lints: list[Lint] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    batches: int = 1  # the batches the loss and the parameter gradients are judged on
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())
    versions: str = field(default_factory=lambda: f"torch {torch.__version__}")

    @property
    def rows(self) -> list[Row]:
        return self.sites + self.params

    @property
    def ok(self) -> bool:
        """Every site and every parameter gradient at least as accurate as eager's (by the rule).
        Lints are advice about the setup; they do not make an audit fail."""
        return all(r.ok for r in self.rows)

    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    def worst(self) -> Row | None:
        """The row closest to (or furthest past) its bound."""
        return max(self.rows, key=lambda r: r.ratio, default=None)

    def to_markdown(self) -> str:
        return markdown(self)

    def to_html(self, path=None) -> str:
        """A self-contained page (tables, inline SVG plots); written to `path` if given."""
        page = html(self)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(page)
        return page

    def __str__(self) -> str:
        return self.to_markdown()

    __repr__ = __str__


# ---- running it --------------------------------------------------------------------------------


def audit(
    model: torch.nn.Module,
    *args,
    backend: str = "eager",
    patterns=None,
    reference_dtype: torch.dtype = torch.float64,
    compile_reference: bool = True,
    lints: bool = True,
    seed: int = 0,
    progress: bool | None = None,
    batches=None,
    **kwargs,
) -> ModelAudit:
    """Audit kernelgraft on `model(*args, **kwargs)` (pass labels to audit a training step: the
    loss is what is differentiated; without a loss, a fixed random projection of the logits is).

    backend: the kernelgraft backend audited ("eager" or "inductor"). compile_reference: also
    compare each site with torch.compile of its spelling, and under the inductor backend the whole
    model with the stock model under torch.compile (slower on CPU). progress: tqdm bars (None:
    only on a terminal). batches: more batches besides `kwargs` (each a dict of keyword arguments,
    as `kwargs` is): the loss and every parameter gradient are judged on all of them at once, one
    vector each. A model's loss is one number a batch and a norm's weight gradient a few dozen: on
    one batch their error is a draw of the rounding, and where two models round apart (the
    inductor backend beside eager) the rule then compares two draws, not two accuracies.

    >>> import torch, kernelgraft
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    >>> torch.manual_seed(0) and None
    >>> ids = torch.randint(0, 64, (1, 8))
    >>> rep = kernelgraft.audit(LlamaForCausalLM(cfg), input_ids=ids, labels=ids, compile_reference=False)
    >>> rep.ok, len(rep.sites) > 0, rep.params[0].where
    (True, True, 'loss')
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"kernelgraft.audit: expected a torch.nn.Module, got {type(model).__name__}")
    rounding = Options(backend=backend).rounding  # validates the backend
    if not reference_dtype.is_floating_point:
        raise ValueError(
            f"kernelgraft.audit: reference_dtype must be a floating dtype, got {reference_dtype}"
        )
    if hasattr(model, "kernelgraft_report"):
        raise ValueError(
            "kernelgraft.audit: this model is already optimized; pass the stock model (the audit optimizes "
            "a copy of it and compares the two)"
        )
    p0 = next(model.parameters(), None)
    if p0 is None:
        raise ValueError("kernelgraft.audit: the model has no parameters to audit")
    rep = ModelAudit(
        model=type(model).__name__,
        dtype=str(p0.dtype).replace("torch.", ""),
        device=str(p0.device),
        backend=backend,
        reference=str(reference_dtype).replace("torch.", ""),
    )
    bar = _bars(progress)

    # 1. sites, on the arguments they really receive
    probed, fallbacks = _probe(model, args, kwargs, patterns)
    rep.fallbacks = fallbacks
    for i, (rec, sp, values) in enumerate(bar(probed, desc="sites")):
        rep.sites += _site_rows(i, rec, sp, values, rounding, compile_reference, seed)

    # 2. parameters, through the whole model, on every batch
    calls = [(args, kwargs)] + [((), _batch(b)) for b in batches or ()]
    rep.batches = len(calls)
    steps = [("reference", reference_dtype), ("stock", None), ("kernelgraft", None)]
    # the inductor backend compiles the code between the sites as torch.compile does: the stock
    # model compiled so is the other reference of the rule, as torch.compile of a spelling is a site's
    steps += [("compiled", None)] if compile_reference and backend == "inductor" else []
    grads = {}
    for name, dt in bar(steps, desc="model runs"):
        m = _copy(model, dt)
        if name == "kernelgraft":
            optimize(m, backend=backend, patterns=patterns)
        if name == "compiled":
            m.compile(backend="inductor")
        # the reference in float64 through and through: the model's own upcasts (`.float()` before
        # the loss, fp32 norms) widen too, as for the sites' truth
        widen = Float64Everywhere() if dt == torch.float64 else contextlib.nullcontext()
        runs = []
        for a, kw in calls:
            with room_for_recompiles(), widen:
                runs.append(_run(m, _cast(a, dt), _cast(kw, dt), seed))
        grads[name] = _joined(runs)
        if name == "reference":
            shapes = {n: list(v.shape) for n, v in runs[0].items() if v is not None}
        del m
    rep.params = _param_rows(grads, shapes)

    # 3. lints
    if lints:
        rep.lints = _lints(model, args, kwargs)
    return rep


def _bars(progress):
    def bar(it, desc):
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is a dependency; this only guards a broken install
            return it
        return tqdm(it, desc=f"kernelgraft audit: {desc}", disable=None if progress is None else not progress)

    return bar


def _copy(model, dtype):
    m = copy.deepcopy(model)
    if dtype is not None:
        m = m.to(dtype)
    m.eval()  # dropout off: the three runs compute one function
    for p in m.parameters():
        p.grad = None
    return m


def _cast(x, dtype):
    if dtype is None:
        return x
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _objective(out, seed):
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is not None:
        return loss
    y = getattr(out, "logits", None)
    if y is None:
        y = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        raise TypeError(
            "kernelgraft.audit: the model returned no loss and no floating tensor to differentiate; "
            "pass labels (or make it return logits)"
        )
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.device)
    return (y.double() * proj).sum()


def _batch(b) -> dict:
    if not isinstance(b, dict):
        raise TypeError(
            f"kernelgraft.audit: each of batches is a dict of the model's keyword arguments (as "
            f"input_ids=..., labels=...), got {type(b).__name__}"
        )
    return b


def _run(model, args, kwargs, seed) -> dict:
    """Forward + backward -> {"loss": value, parameter name: gradient}; the gradients are the
    batch's alone (each run starts from none). Names as the stock model has them (a compiled
    model's parameters are its original module's)."""
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = model(*args, **kwargs)
        obj = _objective(out, seed)
        obj.backward()
    res = {"loss": obj.detach()}
    for n, p in model.named_parameters():
        if p.requires_grad:
            res[n.replace("_orig_mod.", "")] = p.grad
    return res


def _joined(runs: list[dict]) -> dict:
    """One run's {name: value}, or several runs' values of each name in one flat vector (a name
    missing a gradient in any run: None)."""
    if len(runs) == 1:
        return runs[0]
    out = {}
    for name in runs[0]:
        vals = [r.get(name) for r in runs]
        out[name] = None if any(v is None for v in vals) else torch.cat([v.detach().reshape(-1) for v in vals])
    return out


def _param_rows(grads, shapes: dict) -> list[Row]:
    ref, stock, mine = grads["reference"], grads["stock"], grads["kernelgraft"]
    compiled = grads.get("compiled")
    rows = []
    for name, truth in ref.items():
        e, k = stock.get(name), mine.get(name)
        note = ""
        if truth is not None and k is None:
            note = "missing gradient"
        elif k is not None and not torch.isfinite(k).all() and torch.isfinite(truth).all():
            note = "nan"
        what = "value" if name == "loss" else "grad"
        rows.append(
            Row(
                "loss" if name == "loss" else "param",
                name,
                what,
                shapes=str(shapes[name]) if name in shapes else "",
                dtypes="" if k is None else str(k.dtype).replace("torch.", ""),
                kernelgraft=rel_error(k, truth),
                eager=rel_error(e, truth),
                compile=None if compiled is None else rel_error(compiled.get(name), truth),
                note=note,
            )
        )
    return rows


# ---- sites ---------------------------------------------------------------------------------------


def _probe(model, args, kwargs, patterns):
    """Run a stock copy once with a probe at every servable site -> [(record, spelling, values)]."""
    seen = []

    def probe(rec, sp, values):
        seen.append((rec, sp, tuple(_keep(v) for v in values)))

    m = _copy(model, None)
    grafter = Grafter("eager", patterns, dry_run=True, probe=probe, training=True)
    with torch.enable_grad(), room_for_recompiles(), capture_settings():
        torch.compile(fresh_entry("audit"), backend=grafter)(m, *args, **kwargs)
    if grafter.report.graphs == 0:
        raise RuntimeError(
            "kernelgraft.audit: dynamo captured no graph of this model (see TORCH_LOGS=graph_breaks); "
            "there is nothing kernelgraft would replace"
        )
    fallbacks = [f"{r.module}: {r.pattern}.{r.spelling}: {r.reason}" for r in grafter.report.fallbacks]
    return seen, fallbacks


def _keep(v):
    if isinstance(v, torch.Tensor):
        t = v.detach().clone()
        return t.requires_grad_(v.requires_grad) if t.is_floating_point() else t
    return v


def _site_rows(i, rec, sp, values, rounding, compile_reference, seed) -> list[Row]:
    shapes = ", ".join(f"{k}{list(v)}" for k, v in rec.shapes.items())
    dtypes = ",".join(sorted(set(rec.dtypes.values())))
    base = dict(
        kind="site", site=i, where=rec.module, pattern=f"{sp.pattern}.{sp.name}", shapes=shapes, dtypes=dtypes
    )
    try:
        runs = compare(sp, values, op_for(sp, rounding), compile_ref=compile_reference, seed=seed)
    except Exception as e:  # noqa: BLE001 - a kernel that raises is a finding, not a crash of the audit
        return [Row(what="out", note=f"error: {type(e).__name__}: {e}"[:200], **base)]
    rows = []
    for what, t, k, e, c in runs:
        rows.append(_row(judge(what, t, k, e, c), base))
        if k is None and t is not None:
            rows[-1].note = "missing gradient"
    return rows


def _row(v, base) -> Row:
    note = "nan" if math.isinf(v.kernelgraft) and not math.isinf(v.eager) else ""
    return Row(what=v.what, kernelgraft=v.kernelgraft, eager=v.eager, compile=v.compile, note=note, **base)


# ---- lints ---------------------------------------------------------------------------------------


def _lints(model, args, kwargs) -> list[Lint]:
    out = []
    ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    lint = untrained_tokens(model, ids)
    if lint is not None:
        out.append(lint)
    if kwargs.get("labels") is not None:
        lint = num_items_ignored(_copy(model, None), args, kwargs)
        if lint is not None:
            out.append(lint)
    return out


def untrained_tokens(model, input_ids, rel: float = 1e-3) -> Lint | None:
    """Token ids in `input_ids` whose input-embedding row is all ~0 (norm under `rel` x the median
    row norm): tokens the base model never trained (often added special tokens). Their gradients
    blow up or turn NaN once they are trained; initialize them (e.g. to the mean embedding)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is None or input_ids is None or not hasattr(emb, "weight"):
        return None
    w = emb.weight.detach()
    norms = w.float().norm(dim=-1)
    med = norms.median()
    used = torch.unique(input_ids.reshape(-1).to(w.device))
    used = used[(used >= 0) & (used < w.shape[0])]
    bad = used[norms[used] <= rel * med].tolist()
    if not bad:
        return None
    return Lint(
        "untrained tokens",
        f"{len(bad)} token id(s) in the batch have all-~zero embedding rows (e.g. {bad[:8]}): untrained "
        "tokens give NaN or exploding gradients when fine-tuned. Initialize those rows (e.g. to the mean "
        "of the trained rows) or mask them out of the batch.",
        {"token_ids": bad},
    )


def num_items_ignored(model, args, kwargs) -> Lint | None:
    """Does the loss honor `num_items_in_batch` (HF's sum-then-divide for gradient accumulation)?
    The loss is computed with two different values; if it does not change, it is ignored."""
    labels = kwargs["labels"]
    n = int((labels != -100).sum().clamp(min=1))
    losses = []
    try:
        with torch.no_grad():
            for k in (n, 2 * n):
                out = model(*args, **kwargs, num_items_in_batch=torch.tensor(k, device=labels.device))
                loss = getattr(out, "loss", None)
                if loss is None:
                    return None
                losses.append(float(loss))
    except TypeError as e:
        return Lint(
            "num_items_in_batch ignored",
            f"the model's forward does not accept num_items_in_batch ({e}): with gradient accumulation "
            "each micro-batch's loss is a mean over its own tokens, so the accumulated gradient does not "
            "equal the full batch's. Accept **kwargs and pass them to the loss (HF's loss_function).",
        )
    a, b = losses
    if math.isfinite(a) and abs(a - 2 * b) > 1e-3 * abs(a) and abs(a - b) <= 1e-6 * max(1.0, abs(a)):
        return Lint(
            "num_items_in_batch ignored",
            "the loss does not change with num_items_in_batch: it is a mean over each micro-batch's own "
            "tokens, so gradient accumulation will not equal the full batch. Sum the token losses and "
            "divide by num_items_in_batch (HF's ForCausalLMLoss does).",
            {"loss_n": a, "loss_2n": b},
        )
    return None
