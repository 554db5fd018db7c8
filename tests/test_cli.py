import io

from kernelgraft import cli


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
    import pytest

    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--steps", "0"])
    assert e.value.code == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
