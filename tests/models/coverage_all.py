"""Every causal-LM architecture the installed transformers lists, built from a tiny config (2 layers,
hidden 64, nothing downloaded) and explained with labels: the sites its own modules make, against
the sites kernelgraft serves, and why the rest are not served.

Expected sites come from the model, not from kernelgraft: each norm module it calls (hooks; a class
name ending in "Norm", or "Norm" and a qualifier: Gated, PerHead, 1P), RoPE on q and on k of each attention module it calls where it has a rotary
embedding module, one gated MLP per MLP module it calls that has a gate projection (and per experts
module of an MoE block), one LM head + loss. A model is fully served when every expected site is
AND the loss and every gradient of kernelgraft.optimize(model) pass the accuracy rule against the
stock model, in float32 on one batch and in bfloat16 over two (as tests/models/test_coverage.py's
test_loss_and_gradients_agree); a row whose sites are all served but whose check fails is "grads".

The model is kernelgraft.tiny's tiny_model(arch), as `kernelgraft explain --arch` builds it. Where that
does not build or run, it is rebuilt once from repaired_config(arch) (kernelgraft.tiny's
repaired_model): the architecture's default config made tiny by attribute names and values alone,
use_cache off; such rows say "(repaired config)".

    make coverage                          # python tests/models/coverage_all.py --write: the README's table
    python tests/models/coverage_all.py llama gpt_neox   # some architectures, printed
    python tests/models/coverage_all.py --no-grads llama # the sites alone, no gradient check
    python tests/models/coverage_all.py --write --update --memory-gib=20 gemma4_text   # rows surveyed again
"""

from __future__ import annotations

import contextlib
import copy
import gc
import re
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

# run as a script, this file finds tiny in tests/helpers/ itself (under pytest, tests/conftest.py
# puts it on the path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from tiny import batch, compare_models, kept_in_float32, tiny_model  # noqa: E402

from kernelgraft.kernels import fallback  # noqa: E402

# repaired_config too: test_coverage.py checks the repaired configs through this module
from kernelgraft.tiny import first_line, repaired_config, repaired_model  # noqa: E402, F401

HERE = Path(__file__).resolve().parent
README = HERE.parents[1] / "docs" / "architectures.md"
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


# --- building and running the tiny model ---


def _run(arch: str):
    """The first way that builds and runs the tiny model on batch(): tiny_config(arch), else
    repaired_config(arch). (how, build(dtype) -> model, model, expected sites, explain report), or
    the exception of the last way tried."""
    import kernelgraft

    ways = [
        ("tiny", lambda dtype: tiny_model(arch, dtype)),
        ("repaired", lambda dtype: repaired_model(arch, dtype)),
    ]
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
    backend="eager") pass the accuracy rule (tests/helpers/tiny.py's compare_models, eager reference, no
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
            return "did not run", f"{name}: {first_line(e)}"
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
        row.update(status="not built", why=first_line(found) + _non_text(arch))
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
    " {repaired} built from a repaired config (repaired_config in kernelgraft/tiny/repaired.py: the default config"
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
