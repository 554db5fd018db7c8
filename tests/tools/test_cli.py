import argparse
import ast
import inspect
import io
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kernelgraft
from kernelgraft import cli


@pytest.mark.slow  # over 20 s on a 2-core CPU: `make test-slow`
def test_demo_losses_agree():
    out = io.StringIO()
    assert cli.demo(steps=3, device="cpu", out=out) == 0
    text = out.getvalue()
    assert "loss curves agree" in text and "rms_norm: 5" in text
    rows = [
        line.split() for line in text.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 4
    ]
    assert len(rows) == 3
    for _, stock, mine, _ in rows:
        assert abs(float(stock) - float(mine)) <= 1e-4 * abs(float(stock))


def test_patterns_lists_spellings():
    out = io.StringIO()
    assert cli.patterns(out=out) == 0
    assert "llama(x, weight, eps: Scalar)" in out.getvalue() and "gemma(" in out.getvalue()


def test_patterns_prints_each_spellings_source_exactly():
    """Each spelling's block is its function's whole source (decorator included), dedented once and
    indented by 6 spaces, in the registry's order under its pattern's name."""
    out = io.StringIO()
    assert cli.patterns(out=out) == 0
    lines = out.getvalue().splitlines()
    registry = kernelgraft.patterns.REGISTRY
    expected = [(sp.pattern, sp) for name in registry.names() for sp in registry.spellings([name])]
    assert len(expected) >= 20
    i, pattern = 0, None
    for want_pattern, sp in expected:
        if want_pattern != pattern:
            assert lines[i] == f"{want_pattern}:", (i, lines[i])
            pattern, i = want_pattern, i + 1
        assert lines[i].startswith(f"  {sp.name}(") and lines[i].endswith(")"), (sp.qualname, lines[i])
        block = []
        i += 1
        while i < len(lines) and (lines[i].startswith(" " * 6) or not lines[i]):
            block.append(lines[i][6:])
            i += 1
        assert "\n".join(block) + "\n" == textwrap.dedent(inspect.getsource(sp.fn)), sp.qualname
    # then the graph rewrites, a line each
    assert lines[i].startswith("graph rewrites") and len(lines) == i + 1 + len(kernelgraft.rewriter.REWRITES)


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--steps", "0"])
    assert e.value.code == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


# --- help texts -----------------------------------------------------------------------------------

# what a user of the installed package cannot look up: source files, modules, design notes
INTERNAL = re.compile(r"\.py\b|benchmarks/|kernelgraft\.\w|DESIGN|_\w+\(|issue", re.I)


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _help(argv, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "200")  # one line per option
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_option_of_every_subcommand_has_help_without_internal_references():
    p = cli.build_parser()
    subs = _subparsers(p)
    assert sorted(subs) == ["audit", "bench", "demo", "explain", "patterns"]
    for name, sp in subs.items():
        for action in sp._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            where = f"kernelgraft {name} {'/'.join(action.option_strings)}"
            assert action.help and action.help != argparse.SUPPRESS, f"{where} has no help"
            assert not INTERNAL.search(action.help), f"{where}: {action.help!r}"
    (subcommands,) = (a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for choice in subcommands._choices_actions:
        assert choice.help and not INTERNAL.search(choice.help), (choice.dest, choice.help)
    assert not INTERNAL.search(p.description + p.epilog)


@pytest.mark.parametrize(
    "cmd, lines",
    [
        (
            "demo",
            [
                "  --steps STEPS         training steps of each model, 1 or more (default: 20)",
                "                        where to train; auto: cuda if a GPU is visible, else cpu (default: auto)",
            ],
        ),
        (
            "explain",
            [
                "usage: kernelgraft explain [-h] [--arch ARCH | --model DIR] [--layers LAYERS]",
                "  --model DIR      a local Hugging Face checkpoint directory (config.json and weights; nothing is downloaded)",
                "  --layers LAYERS  layers of the tiny random model of --arch, 1 or more (default: 2)",
            ],
        ),
        (
            "audit",
            [
                "  --dtype {float32,bfloat16,float16}",
                "  --backend {inductor,eager}",
                "  --batch BATCH         sequences in each random batch, 1 or more (default: 2)",
                "  --seq SEQ             tokens per sequence, 2 or more; the first quarter is a prompt without labels (default: 16)",
                "  --seed SEED           seed of the random model and batches, an integer (default: 0)",
                "  --batches BATCHES     random batches the loss and each parameter's gradient are judged on at once, 1 or more: on one, a loss is one number, its error a draw of the rounding (default: 16)",
                "  --device DEVICE       cpu, cuda or cuda:N (default: cpu)",
            ],
        ),
    ],
)  # fmt: skip
def test_subcommand_help_shows_each_option_with_its_help(cmd, lines, capsys, monkeypatch):
    out = _help([cmd, "--help"], capsys, monkeypatch)
    for line in lines:
        assert line in out.splitlines(), f"{line!r} not in:\n{out}"


def test_top_level_help_words_bench_without_internal_paths(capsys, monkeypatch):
    out = _help(["--help"], capsys, monkeypatch)
    assert "run the GPU benchmark suite of a source checkout" in out
    assert "suite.py" not in out and "benchmarks/" not in out
    assert "kernelgraft explain --model ./my-checkpoint" in out


# --- explain --model, and the checks explain shares with audit ------------------------------------


def test_explain_a_local_checkpoint(tmp_path, capsys):
    from tiny import tiny_model

    tiny_model("qwen2").save_pretrained(tmp_path / "ckpt")  # intermediate size 96: not --arch's 128
    assert cli.main(["explain", "--model", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "kernelgraft: 12 site(s) would be replaced in 1 graph(s) (gated_mlp: 2, lm_head_ce: 1, rms_norm: 5, rope: 4)\n"
    )
    assert "gated_mlp.silu      model.layers.0.mlp" in out and "gate[2, 16, 96], up[2, 16, 96]" in out


def test_explain_model_is_a_directory_and_excludes_arch(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", "--model", str(tmp_path / "nope")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kernelgraft explain: error: --model {tmp_path / 'nope'}: not a directory")
    assert err.count("\n") == 1, err
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", "--model", str(tmp_path), "--arch", "llama"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --arch: not allowed with argument --model" in err and err.count("\n") == 1, err


def test_a_directory_that_is_no_checkpoint_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", "--model", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kernelgraft explain: error: --model {tmp_path}: ") and err.count("\n") == 1


@pytest.mark.parametrize("cmd", ["explain", "audit"])
def test_unknown_arch_is_one_line_with_close_matches(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([cmd, "--arch", "lama"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and len(err) < 300, err
    assert err.startswith(
        f"kernelgraft {cmd}: error: --arch 'lama' is not a transformers model type (close matches: llama, "
    ), err
    with pytest.raises(SystemExit) as e:
        cli.main([cmd, "--arch", "qwen-3"])
    assert "(close matches: qwen3, " in capsys.readouterr().err


def test_unknown_arch_without_a_close_match(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "--arch", "xyzzy-0000"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "kernelgraft audit: error: --arch 'xyzzy-0000' is not a transformers model type "
        "(no close match among transformers' model types)\n"
    )


def test_a_model_type_without_a_causal_lm_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", "--arch", "vit"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kernelgraft explain: error: --arch vit: ") and err.count("\n") == 1, err


# --- imports --------------------------------------------------------------------------------------


def test_kernelgraft_imports_are_at_module_level_and_transformers_is_not():
    tree = ast.parse(Path(cli.__file__).read_text())
    inner = [
        node
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    own = [
        ast.unparse(n)
        for n in inner
        if (isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] == "kernelgraft"))
        or (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "kernelgraft" for a in n.names))
    ]
    assert own == [], f"imports of kernelgraft inside functions of cli.py: {own}"
    # --help does not wait for transformers
    code = "import sys, kernelgraft.cli; print('transformers' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "False\n", r.stderr[-2000:]


# --- --help without torch, and every option's valid values ---------------------------------------


def test_help_answers_without_importing_torch():
    """`kernelgraft --help` and each command's --help parse and answer before torch or transformers is
    imported (bench's is the suite's own parser, in a module that imports torch)."""
    code = (
        "import contextlib, io, sys\n"
        "from kernelgraft import cli\n"
        "for argv in (['--help'], ['demo', '--help'], ['explain', '--help'], ['audit', '--help'],\n"
        "             ['patterns', '--help'], ['audit', '--device', 'tpu'], []):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            cli.main(argv)\n"
        "        except SystemExit as e:\n"
        "            assert e.code == (0 if '--help' in argv else 2), (argv, e.code)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "[]\n", r.stderr[-2000:]
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kernelgraft", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.startswith("usage: kernelgraft")
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()}
    assert "kernelgraft.cli" in imported and "torch" not in imported


def _options_without_help(text: str) -> list[str]:
    """The option entries of an argparse help page (COLUMNS=200) with no help text beside or below."""
    lines = text.splitlines()
    start = lines.index("options:") + 1
    bare = []
    for i, line in enumerate(lines[start:], start):
        if not line.startswith("  -"):
            continue
        beside = re.split(r"\s{2,}", line.strip(), maxsplit=1)[1:]
        below = lines[i + 1] if i + 1 < len(lines) else ""
        if not beside and not (below.startswith(" " * 8) and below.strip()):
            bare.append(line.strip())
    return bare


@pytest.mark.parametrize("cmd", ["demo", "explain", "audit", "patterns", "bench"])
def test_every_option_shows_help_on_its_help_page(cmd, capsys, monkeypatch):
    out = _help([cmd, "--help"], capsys, monkeypatch)
    assert _options_without_help(out) == [], out
    # the options whose values are a fixed set list it
    for action in _subparsers(cli.build_parser())[cmd]._actions:
        if action.choices:
            assert "{" + ",".join(action.choices) + "}" in out, action.dest


def test_bench_help_lists_the_valid_values(capsys, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_listed", cli.SUITE)
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    out = " ".join(_help(["bench", "--help"], capsys, monkeypatch).split())  # lines joined: names wrap
    assert "any of: patterns,lm_head,steps,curves,decode" in out
    assert "any of: " + ",".join(suite.SHAPES) in out
    assert "any of: " + ",".join(suite.MODES) in out
    assert "timed training steps per shape and mode after two warm-up steps, 1 or more" in out
    assert "directory the results are written to (suite.json, suite.md)" in out


# --- every error: one line on stderr, exit 2 ------------------------------------------------------


def _one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv, error",
    [
        ([], "kernelgraft: error: the following arguments are required: COMMAND; see kernelgraft --help"),
        (["frob"], "kernelgraft: error: argument COMMAND: invalid choice: 'frob'"),
        (["audit", "--device", "tpu"],
         "kernelgraft audit: error: argument --device: 'tpu' is not a device: give cpu, cuda or cuda:N; "
         "see kernelgraft audit --help"),
        (["demo", "--device", "tpu"], "kernelgraft demo: error: argument --device: invalid choice: 'tpu'"),
        (["audit", "--dtype", "half"], "kernelgraft audit: error: argument --dtype: invalid choice: 'half'"),
        (["explain", "--bogus"],
         "kernelgraft explain: error: unrecognized arguments: --bogus; see kernelgraft explain --help"),
        (["explain", "--layers", "x"], "kernelgraft explain: error: argument --layers: invalid int value: 'x'"),
        (["explain", "--layers", "0"], "kernelgraft explain: error: --layers must be at least 1"),
        (["audit", "--batch", "0"], "kernelgraft audit: error: --batch must be at least 1"),
        (["audit", "--seq", "1"], "kernelgraft audit: error: --seq must be at least 2"),
    ],
)  # fmt: skip
def test_every_error_is_one_line_and_exit_2(argv, error, capsys):
    assert _one_line_error(argv, capsys).startswith(error)


def test_cuda_that_is_not_there_is_one_line(capsys):
    import torch

    err = _one_line_error(["audit", "--device", "cuda:99"], capsys)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tail = (
        f"{visible} CUDA GPU(s) visible, numbered from 0"
        if visible
        else "no CUDA GPU is visible; use --device cpu"
    )
    assert err == f"kernelgraft audit: error: --device cuda:99: {tail}\n"


def test_a_model_that_fails_without_kernelgraft_is_said_so(monkeypatch, capsys):
    from transformers import LlamaForCausalLM

    def broken(self, *args, **kwargs):
        raise RuntimeError("the stock forward fails\nat some line")

    monkeypatch.setattr(LlamaForCausalLM, "forward", broken)
    err = _one_line_error(["explain", "--arch", "llama"], capsys)
    assert err == (
        "kernelgraft explain: error: --arch llama: the stock model fails on a tiny batch without kernelgraft "
        "(RuntimeError: the stock forward fails)\n"
    )


def test_kernelgraft_failing_on_a_model_that_runs_is_said_so(monkeypatch, capsys):
    def broken(model, **batch):
        raise ValueError("explain fails")

    monkeypatch.setattr(kernelgraft, "explain", broken)
    err = _one_line_error(["explain", "--arch", "llama"], capsys)
    assert err == (
        "kernelgraft explain: error: --arch llama: kernelgraft fails on a tiny batch that the stock model runs "
        "(ValueError: explain fails); please report it\n"
    )


LLAMA_SITES = {"gated_mlp": 2, "lm_head_ce": 1, "rms_norm": 5, "rope": 4}


def pattern_sites(out: str) -> dict:
    """The site counts of explain's first line, but the attention rewrites' (sdpa, gqa): whether
    they happen depends on the installed transformers (tests/models/test_coverage.py's kernel_sites)."""
    m = re.match(r"kernelgraft: \d+ site\(s\) would be replaced in \d+ graph\(s\) \((.*)\)\n", out)
    assert m, out[:500]
    counts = {k: int(v) for k, v in (kv.split(": ") for kv in m[1].split(", "))}
    return {k: v for k, v in counts.items() if k not in ("sdpa", "gqa")}


def test_the_repaired_config_is_built_where_the_tiny_one_does_not_build(monkeypatch, capsys):
    def unbuilt(*args, **kwargs):
        raise ValueError("not this one")

    monkeypatch.setattr(kernelgraft.tiny.runs, "tiny_model", unbuilt)
    assert cli.main(["explain", "--arch", "llama"]) == 0
    out, err = capsys.readouterr()
    assert pattern_sites(out) == LLAMA_SITES, out
    assert err == (
        "kernelgraft explain: note: --arch llama: built from the repaired tiny config: transformers cannot "
        "build a model of the tiny config (ValueError: not this one)\n"
    )


def test_a_tiny_config_whose_model_is_not_tiny_is_repaired(monkeypatch, capsys):
    from tiny import tiny_model

    n = sum(p.numel() for p in tiny_model("llama").parameters())
    monkeypatch.setattr(kernelgraft.tiny.runs, "MAX_PARAMETERS", n - 1)
    assert cli.main(["explain", "--arch", "llama"]) == 0
    out, err = capsys.readouterr()
    assert pattern_sites(out) == LLAMA_SITES, out
    assert err == (
        "kernelgraft explain: note: --arch llama: built from the repaired tiny config: the model of the tiny "
        f"config is not tiny ({n:,} parameters, a sub-config of full size among them)\n"
    )


def test_layers_makes_the_repaired_config_that_deep():
    cfg = kernelgraft.tiny.repaired_config("qwen3_next", 3)
    assert cfg.num_hidden_layers == 3 and cfg.layer_types == ["linear_attention"] * 2 + ["full_attention"]
    assert kernelgraft.tiny.repaired_config("qwen3_next").layer_types == [
        "linear_attention",
        "full_attention",
    ]


# --- every architecture the README's coverage table serves in full --------------------------------

README = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
COLUMNS = ("norm", "rope", "gated_mlp", "lm_head_ce")  # the table's site columns, in its order


def fully_served() -> list[tuple[str, bool, dict]]:
    """(architecture, built from the repaired config, {column: sites served}) of each row of the
    README's coverage table whose status is full."""
    table = README.read_text().split("<!-- decoders:start -->")[1].split("<!-- decoders:end -->")[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")] if line.startswith("| ") else []
        if len(cells) == 8 and cells[1] == "full":
            served = {k: int(c.split("/")[0]) for k, c in zip(COLUMNS, cells[2:6]) if c != "-"}
            rows.append(
                (cells[0].removesuffix(" (repaired config)"), cells[0].endswith("(repaired config)"), served)
            )
    return rows


@pytest.mark.slow  # every fully served architecture built and explained: about 5 minutes on a 2-core CPU
def test_explain_every_fully_served_architecture(capfd):
    """`kernelgraft explain --arch A` for each row of the coverage table marked full: its counts (the
    table's, where it is built from the same config as the table's row), or one line saying the
    installed transformers does not build or run it; never a traceback, never kernelgraft's failure."""
    import torch

    from kernelgraft.kernels import fallback

    rows = fully_served()
    assert len(rows) >= 150
    differ, compared = [], 0
    for arch, repaired, served in rows:
        try:
            rc = cli.main(["explain", "--arch", arch])
        except SystemExit as e:
            rc = e.code
        out, err = capfd.readouterr()
        torch._dynamo.reset()  # each architecture as in a process of its own
        fallback.forget_failures()
        lines = err.splitlines()
        assert len(lines) <= 1 and all(ln.startswith("kernelgraft explain: ") for ln in lines), (
            arch,
            err[-3000:],
        )
        if rc == 2:
            assert lines[0].startswith(f"kernelgraft explain: error: --arch {arch}: "), (arch, err)
            assert "kernelgraft fails" not in lines[0], lines[0]
            continue
        assert rc == 0, (arch, rc, err)
        counts = pattern_sites(out)
        got = dict(
            norm=counts.get("rms_norm", 0) + counts.get("layer_norm", 0),
            rope=counts.get("rope", 0),
            gated_mlp=counts.get("gated_mlp", 0),
            lm_head_ce=counts.get("lm_head_ce", 0),
        )
        # the installed transformers may build the tiny config where the table's did not: compared
        # where both built the model from the same config
        noted = bool(lines) and "built from the repaired tiny config" in lines[0]
        if noted == repaired:
            compared += 1
            if any(got[k] != n for k, n in served.items()):
                differ.append((arch, served, got))
    assert not differ, differ
    # most rows are built as the table's were: a choice of config that differs from the table's
    # everywhere (or errors everywhere) would leave nothing compared
    assert compared >= 0.9 * len(rows), compared


def test_patterns_lists_every_name_a_report_gives(capsys):
    from tiny import batch, tiny_model

    from kernelgraft.rewriter import attention, projections

    model = kernelgraft.optimize(tiny_model("llama"), backend="eager")
    model(**batch()).loss.backward()
    rep = model.kernelgraft_report
    # the patterns' records, and those of the graph rewrites (attention's masks and heads, fused projections)
    named = set(rep.counts()) | {s.pattern for s in rep.projections}
    named |= {attention.PATTERN, attention.GQA_PATTERN, projections.PATTERN}
    assert cli.main(["patterns"]) == 0
    out = capsys.readouterr().out
    listed = {ln[:-1] for ln in out.splitlines() if ln.endswith(":") and not ln.startswith(" ")}
    rewrites = out.partition("graph rewrites, which reports also name")[2].splitlines()[1:]
    listed |= {ln.split(".")[0].strip() for ln in rewrites}
    assert named <= listed, named - listed
    assert [ln.split(":")[0].strip() for ln in rewrites] == list(kernelgraft.rewriter.REWRITES)
