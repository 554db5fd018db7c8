import argparse
import ast
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
                "  --steps STEPS         training steps of each model (default: 20)",
                "                        where to train; auto: cuda if a GPU is visible, else cpu (default: auto)",
            ],
        ),
        (
            "explain",
            [
                "usage: kernelgraft explain [-h] [--arch ARCH | --model DIR] [--layers LAYERS]",
                "  --model DIR      a local Hugging Face checkpoint directory (config.json and weights; nothing is downloaded)",
                "  --layers LAYERS  layers of the tiny random model of --arch (default: 2)",
            ],
        ),
        (
            "audit",
            [
                "  --dtype {float32,bfloat16,float16}",
                "  --backend {inductor,eager}",
                "  --batch BATCH         sequences in the random batch (default: 2)",
                "  --seq SEQ             tokens per sequence; the first quarter is a prompt without labels (default: 16)",
                "  --seed SEED           seed of the random model and batch (default: 0)",
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
        "kernelgraft: 12 site(s) replaced in 1 graph(s) (gated_mlp: 2, lm_head_ce: 1, rms_norm: 5, rope: 4)\n"
    )
    assert "gated_mlp.silu      model.layers.0.mlp" in out and "gate[2, 16, 96], up[2, 16, 96]" in out


def test_explain_model_is_a_directory_and_excludes_arch(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", "--model", str(tmp_path / "nope")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kernelgraft explain")
    assert f"kernelgraft explain: error: --model {tmp_path / 'nope'}: not a directory" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", "--model", str(tmp_path), "--arch", "llama"])
    assert e.value.code == 2
    assert "argument --arch: not allowed with argument --model" in capsys.readouterr().err


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
