"""The amp-fx command on the example file, and errors in a user's file reported as such."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from amp_fx.__main__ import main

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_mlp.py")


def test_explain(capsys, tmp_path):
    svg = tmp_path / "tiny.svg"
    assert main(["explain", f"{EXAMPLE}:build", "--svg", str(svg), "--table"]) == 0
    out = capsys.readouterr().out
    assert "cast bytes/call" in out and "graph 0 after the passes" in out
    assert "lower precision fp: aten.linear (default cpu table)" in out
    if shutil.which("dot"):
        assert "<svg" in svg.read_text() and f"wrote {svg}" in out
    else:
        assert "apt-get install graphviz" in out and svg.with_suffix(".dot").exists()


def test_compare(capsys):
    assert main(["compare", f"{EXAMPLE}:build", "--dtype", "fp16"]) == 0
    assert "OK: amp_fx agrees with eager torch.autocast (fp16)" in capsys.readouterr().out
    assert main(["compare", f"{EXAMPLE}:build", "--keep-fp32", "head"]) == 1
    assert "first divergence" in capsys.readouterr().out


def test_find_nonfinite(capsys):
    assert main(["find-nonfinite", f"{EXAMPLE}:build_overflowing"]) == 1
    out = capsys.readouterr().out
    assert "module `up`" in out and 'Policy(keep_fp32=("up",))' in out
    assert f"amp-fx find-nonfinite {EXAMPLE}:build_overflowing --dtype fp16 --keep-fp32 up" in out
    assert main(["find-nonfinite", f"{EXAMPLE}:build"]) == 0


@pytest.mark.parametrize(
    "source, func, expected",
    [
        ("def build(:\n    pass\n", "build", r"bad.py:1: SyntaxError"),
        (
            "import torch\n\ndef build():\n    raise RuntimeError('no data')\n",
            "build",
            r"bad.py:4: build\(\) raised RuntimeError: no data",
        ),
        ("def other():\n    pass\n", "build", r"has no function 'build' \(it defines: other\)"),
        ("def build():\n    return 3\n", "build", r"must return \(model, inputs\)"),
        (
            textwrap.dedent("""
        import torch
        class M(torch.nn.Module):
            def forward(self, x):
                return x @ torch.ones(5, 5)
        def build():
            return M(), (torch.ones(2, 3),)
        """),
            "build",
            r"error in your model at .*bad.py:5: .*inputs do not match the model",
        ),
    ],
)
def test_errors_in_user_file(tmp_path, capsys, source, func, expected):
    import re

    path = tmp_path / "bad.py"
    path.write_text(source)
    assert main(["explain", f"{path}:{func}"]) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err), err
    assert "Traceback" not in err


@pytest.mark.slow
def test_python_dash_m_and_console_script(tmp_path):
    cmd = [sys.executable, "-m", "amp_fx", "compare", f"{EXAMPLE}:build"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "OK: amp_fx agrees" in done.stdout
    exe = shutil.which("amp-fx")
    if exe is None:
        pytest.skip("the amp-fx console script is not installed (pip install -e .)")
    done = subprocess.run([exe, "explain", "missing.py:build"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "missing.py: no such file" in done.stderr


_KEYWORDS = textwrap.dedent("""
    import torch

    class WithLabels(torch.nn.Module):  # a Hugging Face model's call form: keywords, a loss from labels
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, input_ids, labels=None):
            out = self.fc(input_ids)
            if labels is None:
                raise ValueError("no labels: pass them as a keyword")
            return (out.float() - labels).square().mean()

    def build():
        x = torch.randn(4, 8)
        return WithLabels(), {"input_ids": x, "labels": torch.zeros(4, 8)}

    def both():
        return WithLabels(), (torch.randn(4, 8),), {"labels": torch.zeros(4, 8)}

    def clashing():
        return WithLabels(), {"input_ids": torch.randn(4, 8), "dtype": "bf16"}
    """)


def test_keyword_inputs_reach_the_model(tmp_path, capsys):
    """A dict of inputs is passed as keywords (a Hugging Face model gets its labels), so is the
    third item of (model, args, kwargs); a keyword named like one of the tool's options is refused."""
    path = tmp_path / "hf_like.py"
    path.write_text(_KEYWORDS)
    assert main(["compare", f"{path}:build"]) == 0, capsys.readouterr().err
    assert main(["explain", f"{path}:both"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["explain", f"{path}:clashing"]) == 2
    assert "keyword inputs ['dtype'] have the names of amp_fx.explain's own options" in capsys.readouterr().err


def test_help_shows_a_target_and_every_option_says_what_it_does(capsys):
    import argparse

    from amp_fx.cli import _parser

    for command in ([], ["explain"], ["compare"], ["find-nonfinite"], ["advise"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        out = capsys.readouterr().out
        assert "def build():" in out and "amp-fx explain my_model.py:build" in out, command
    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    bare = [(name, a.dest) for name, p in sub.choices.items() for a in p._actions if not a.help]
    assert bare == [], bare
