"""kernelgraft.audit(model): per-site and per-parameter errors next to eager's, the HTML page and the
Markdown report agreeing number for number, broken kernels caught, lints, the CLI."""

import math
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model

import kernelgraft
from kernelgraft import cli
from kernelgraft.gradcheck import ModelAudit


def batch(vocab=128, B=2, S=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return dict(input_ids=ids, labels=labels)


@pytest.fixture(scope="module")
def llama_audit():
    model = tiny_model("llama")
    b = batch()
    return model, b, kernelgraft.audit(model, **b, compile_reference=True)


def test_tiny_llama_audit_is_ok_and_covers_every_site_and_parameter(llama_audit):
    model, b, rep = llama_audit
    assert isinstance(rep, ModelAudit) and rep.ok, rep.to_markdown()
    # every site explain reports, each with its output and every input gradient
    sites = kernelgraft.explain(model, **b).sites
    assert len({r.site for r in rep.sites}) == len(sites)
    per_pattern = {}
    for r in rep.sites:
        per_pattern.setdefault(r.pattern, set()).add(r.what)
    assert per_pattern["rms_norm.llama"] == {"out", "grad x", "grad weight"}
    assert per_pattern["lm_head_ce.hf_mean"] == {"out", "grad h", "grad weight"}
    assert all(r.compile is not None for r in rep.sites)  # compile_reference ran
    # every trainable parameter, and the loss first
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert [r.where for r in rep.params] == ["loss", *names]
    # the numbers are errors vs float64, of float32 computations: small, positive, finite
    for r in rep.rows:
        assert 0 <= r.kernelgraft < 1e-5 and 0 <= r.eager < 1e-5, r
    assert 0 < rep.worst().ratio <= 1
    assert rep.worst() is max(rep.rows, key=lambda r: r.ratio)
    assert model.training is True or model.training is False  # untouched: no kernelgraft_report on it
    assert not hasattr(model, "kernelgraft_report")


def test_site_errors_are_recomputable_from_the_site_alone(llama_audit):
    """The audit's truth for a site is the float64 spelling on its arguments: an RMSNorm site's
    eager error equals a fresh computation on the recorded layer input."""
    model, b, rep = llama_audit
    norm = model.model.norm
    x = {}
    h = norm.register_forward_pre_hook(lambda m, a: x.setdefault("x", a[0].detach().clone()))
    with torch.no_grad():
        model(**b)
    h.remove()
    row = next(r for r in rep.sites if r.where == "model.norm" and r.what == "out")
    with torch.no_grad():
        y32 = norm(x["x"])
        x64, w64 = x["x"].double(), norm.weight.double()
        y64 = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    err = ((y32.double() - y64).norm() / y64.norm()).item()
    assert math.isclose(row.eager, err, rel_tol=1e-9)


class _Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables, self._row, self._cell, self._tid = {}, None, None, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._tid = dict(attrs)["id"]
            self.tables[self._tid] = []
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr":
            self.tables[self._tid].append(self._row)

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _md_tables(md: str) -> list[list[list[str]]]:
    tables, cur = [], None
    for line in md.splitlines():
        if line.startswith("|"):
            if cur is None:
                cur = []
                tables.append(cur)
            if not re.fullmatch(r"\|(---\|)+", line):
                cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
                cur.append([c.strip().replace("\\|", "|") for c in cells])
        else:
            cur = None
    return tables


def test_html_page_parses_and_equals_the_markdown(llama_audit, tmp_path):
    _, _, rep = llama_audit
    path = tmp_path / "audit.html"
    page = rep.to_html(path)
    assert path.read_text() == page
    p = _Cells()
    p.feed(page)
    p.close()
    md_sites, md_params = _md_tables(rep.to_markdown())
    assert p.tables["sites"] == md_sites
    assert p.tables["params"] == md_params
    assert len(md_sites) == len(rep.sites) + 1 and len(md_params) == len(rep.params) + 1
    # the cells hold the audit's numbers
    assert md_params[1][3] == f"{rep.params[0].kernelgraft:.3e}"
    # self-contained: two inline SVG plots that are well-formed XML, nothing fetched, no scripts
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 2
    for s in svgs:
        root = ET.fromstring(s)
        assert len(root.findall(".//{http://www.w3.org/2000/svg}circle")) >= len(rep.params)
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "id='verdict'>ok<" in page


def test_a_broken_kernel_is_flagged_at_its_sites(monkeypatch):
    """An RMSNorm kernel without a weight gradient: the audit says which sites, which gradient."""
    real = kernelgraft.kernels.op_for

    def broken(spelling, rounding="autograd"):
        op = real(spelling, rounding)
        if spelling.pattern != "rms_norm":
            return op

        def no_weight_grad(x, w, eps):
            return op(x, w.detach(), eps)

        return no_weight_grad

    monkeypatch.setattr(kernelgraft.gradcheck.model_audit, "op_for", broken)
    rep = kernelgraft.audit(tiny_model("llama"), **batch(), compile_reference=False, lints=False)
    assert not rep.ok
    bad = rep.failures()
    assert bad and {(r.pattern, r.what, r.note) for r in bad} == {
        ("rms_norm.llama", "grad weight", "missing gradient")
    }
    assert len(bad) == len({r.site for r in rep.sites if r.pattern == "rms_norm.llama"})
    assert rep.worst().note == "missing gradient"
    assert "FAIL: missing gradient" in rep.to_markdown()
    assert "class=fail" in rep.to_html()


def test_a_less_accurate_kernel_is_flagged(monkeypatch):
    """A gated MLP that rounds its output through bf16 in an fp32 model: inaccurate, flagged."""
    real = kernelgraft.kernels.op_for

    def coarse(spelling, rounding="autograd"):
        op = real(spelling, rounding)
        if spelling.pattern != "gated_mlp":
            return op
        return lambda gate, up: op(gate, up).bfloat16().float()

    monkeypatch.setattr(kernelgraft.gradcheck.model_audit, "op_for", coarse)
    rep = kernelgraft.audit(tiny_model("llama"), **batch(), compile_reference=False, lints=False)
    bad = [r for r in rep.failures() if r.pattern.startswith("gated_mlp")]
    assert bad and all(r.what == "out" or r.what.startswith("grad") for r in bad)
    assert any(r.what == "out" and r.kernelgraft > 100 * r.eager for r in bad)


def test_bf16_audit_of_another_architecture():
    model = tiny_model("qwen3").to(torch.bfloat16)
    rep = kernelgraft.audit(model, **batch(), compile_reference=False)
    assert rep.ok, rep.to_markdown()
    assert rep.dtype == "bfloat16" and {r.dtypes for r in rep.params[1:]} == {"bfloat16"}
    # bf16 errors are bf16-sized, the reference is float64
    assert 1e-4 < max(r.eager for r in rep.params) < 1e-1


def test_untrained_token_lint():
    model = tiny_model("llama")
    b = batch()
    dead = [int(b["input_ids"][0, 5]), int(b["input_ids"][1, 9])]
    with torch.no_grad():
        model.get_input_embeddings().weight[dead] = 0.0
    rep = kernelgraft.audit(model, **b, compile_reference=False)
    lint = [x for x in rep.lints if x.name == "untrained tokens"]
    assert lint and sorted(lint[0].detail["token_ids"]) == sorted(set(dead))
    assert "untrained tokens" in rep.to_markdown() and "untrained tokens" in rep.to_html()
    # no lint on a trained (random) embedding
    assert not kernelgraft.gradcheck.model_audit.untrained_tokens(tiny_model("llama"), b["input_ids"])


class MeanLossLM(torch.nn.Module):
    """A hand-written LM wrapper whose loss is a mean over its own tokens, whatever the caller says."""

    def __init__(self, inner, accept_kwargs=True):
        super().__init__()
        self.inner, self.accept = inner, accept_kwargs

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, labels=None, **kwargs):
        if kwargs and not self.accept:
            raise TypeError(f"forward() got an unexpected keyword argument {next(iter(kwargs))!r}")
        logits = self.inner(input_ids=input_ids).logits
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
        )
        return type("Out", (), {"loss": loss, "logits": logits})()


def test_loss_ignoring_num_items_in_batch_is_linted():
    b = batch()
    lints = kernelgraft.gradcheck.model_audit.num_items_ignored
    assert lints(tiny_model("llama"), (), b) is None  # HF's loss divides by num_items_in_batch
    found = lints(MeanLossLM(tiny_model("llama")), (), b)
    assert found is not None and "does not change" in found.message
    found = lints(MeanLossLM(tiny_model("llama"), accept_kwargs=False), (), b)
    assert found is not None and "does not accept" in found.message


def test_bad_input_is_refused_clearly():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        kernelgraft.audit(lambda x: x)
    with pytest.raises(ValueError, match="backend"):
        kernelgraft.audit(tiny_model("llama"), backend="tvm", **batch())
    m = kernelgraft.optimize(tiny_model("llama"), backend="eager")
    with pytest.raises(ValueError, match="already optimized"):
        kernelgraft.audit(m, **batch())


def test_cli_audit_writes_html_and_markdown_and_exits_0(tmp_path, capsys):
    html, md = tmp_path / "a.html", tmp_path / "a.md"
    rc = cli.main(
        ["audit", "--arch", "mistral", "--out", str(html), "--md", str(md), "--no-compile-reference", "--batches", "2"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "verdict: ok" in out and md.read_text() in out and html.read_text().startswith("<!DOCTYPE html>")


def test_cli_audit_exit_codes_for_bad_usage(tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "--model", str(tmp_path / "nope")])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "--arch", "not-a-model-type"])
    assert e.value.code == 2


def test_cli_audit_of_a_local_checkpoint(tmp_path, capsys):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "ckpt")
    rc = cli.main(["audit", "--model", str(tmp_path / "ckpt"), "--no-compile-reference", "--seq", "12", "--batches", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "# kernelgraft audit: Qwen2ForCausalLM" in out and "verdict: ok" in out


def test_the_loss_and_the_gradients_are_judged_over_every_batch():
    """batches=: each quantity's values from every batch in one vector, judged once: the loss row's
    errors are those of the losses of the three batches, recomputed here from the stock model."""
    from kernelgraft.gradcheck import Float64Everywhere, rel_error

    model = tiny_model("llama")
    first, more = batch(seed=0), [batch(seed=1), batch(seed=2)]
    rep = kernelgraft.audit(model, **first, batches=more, compile_reference=False, lints=False)
    assert rep.ok and rep.batches == 3 and "the model on 3 batches" in rep.to_markdown()
    assert all(r.compile is None for r in rep.params)  # the eager backend: eager is the stock reference
    wide = model.double()
    with Float64Everywhere():
        truth = torch.stack([wide(**b).loss.detach() for b in (first, *more)])
    stock = torch.stack([model.float()(**b).loss.detach() for b in (first, *more)])
    assert rep.params[0].where == "loss" and rep.params[0].shapes == "[]"
    assert rep.params[0].eager == pytest.approx(rel_error(stock, truth), rel=1e-12)
    assert rep.params[1].shapes == str(list(model.model.embed_tokens.weight.shape))
    with pytest.raises(TypeError, match="each of batches is a dict"):
        kernelgraft.audit(model, **first, batches=[first["input_ids"]], compile_reference=False)


@pytest.mark.slow  # five audits of about 50 s each on a 2-core CPU
def test_cli_audit_in_bf16_under_inductor_passes_at_seeds_0_to_4():
    """A documented configuration: on one batch, its loss (one number) and norm weights (a few
    dozen) missed the rule at seeds 0 and 2 by a draw of the rounding, as the stock model under
    torch.compile misses it against eager (5.5x the bound at seed 0); judged over 16 batches and
    beside torch.compile, as the rule reads, every seed passes."""
    import subprocess
    import sys

    for seed in range(5):  # each in a process of its own, as a user runs it (and five audits' graphs
        # stay out of this worker's dynamo caches)
        cmd = ["audit", "--arch", "llama", "--backend", "inductor", "--dtype", "bfloat16", "--seed", str(seed)]
        r = subprocess.run([sys.executable, "-m", "kernelgraft", *cmd], capture_output=True, text=True, timeout=900)
        out = r.stdout
        assert r.returncode == 0, (out[-3000:], r.stderr[-2000:])
        params = out.partition("## Parameters")[2]
        assert "| compile |" in params and "the model on 16 batches" in out
        assert re.search(r"\| loss \| \[\] \| float32 \| [0-9.e-]+ \| [0-9.e-]+ \| [0-9.e-]+ \|", params), params


def test_cli_audit_checks_its_output_paths_before_the_work(tmp_path, monkeypatch, capsys):
    """A report path in a folder that does not exist is a bad invocation (exit 2) said before any
    model is built; a report that cannot be written after the work exits 3 (1 means less accurate),
    the verdict printed first; progress bars are left to tqdm's terminal check."""
    calls = []

    def fake_audit(model, **kw):
        calls.append(kw)
        (tmp_path / "gone").rmdir()  # the folder vanishes while the audit runs
        return ModelAudit(model="M", dtype="float32", device="cpu", backend="eager", reference="float64")

    monkeypatch.setattr(kernelgraft, "audit", fake_audit)
    for flag in ("--out", "--md"):
        with pytest.raises(SystemExit) as e:
            cli.main(["audit", flag, str(tmp_path / "missing" / "a.report")])
        assert e.value.code == 2 and not calls
        assert f"{flag} {tmp_path / 'missing' / 'a.report'}: the folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "--md", str(tmp_path)])
    assert e.value.code == 2 and "is a folder" in capsys.readouterr().err
    (tmp_path / "gone").mkdir()
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "--batches", "1", "--md", str(tmp_path / "gone" / "a.md")])
    assert e.value.code == 3 and len(calls) == 1 and calls[0]["progress"] is None
    io = capsys.readouterr()
    assert "verdict: ok" in io.out and "--md" in io.err and "could not write the report" in io.err
