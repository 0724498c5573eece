"""examples/train_demo.py as a new user runs it (issue 8 item 20), with the cheapest backend.

The demo must learn (its loss ends below chance), say what it learns and what the numbers mean
(chance is ln 2 = 0.693), spell the dtype one way (bf16/fp16, as the dtype arguments and every
other table do), train fp16 with a GradScaler, agree with eager autocast bitwise under aot_eager,
and print no warning at all (stderr: its progress lines only).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_DEMO = Path(__file__).resolve().parents[2] / "examples" / "train_demo.py"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_demo_explains_itself_and_warns_nothing(dtype: str) -> None:
    env = dict(os.environ, PYTHONWARNINGS="default")  # show every warning, once
    done = subprocess.run(
        [sys.executable, str(_DEMO), "--dtype", dtype, "--backend", "aot_eager", "--steps", "10"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    # stderr holds amp_fx's progress lines (one per compiled graph: the first hour's "what is it
    # doing", amp_fx._common.progress) and nothing else: no warning
    # (the start line, each graph and its backward: issue 61)
    progress = re.compile(
        r"^amp_fx: (\w+|compile_step(\(\w+\))?): compil(ing|ed) (\(backend |graph \d|the ).*(s|\.\.\.|\)|the call)$"
    )
    lines = done.stderr.splitlines()
    assert any(progress.match(line) for line in lines), done.stderr
    others = [line for line in lines if not progress.match(line)]
    assert others == [], "the demo printed to stderr (a warning?):\n" + "\n".join(others)
    out = done.stdout
    assert f"ln 2 = {math.log(2):.3f}" in out and "accuracy 0.50" in out, out
    assert "max |grad - eager grad| = 0," in out, "aot_eager must be bitwise with eager autocast"
    assert "bfloat16" not in out and "float16" not in out.replace("bfloat16", ""), out
    assert re.search(rf"^\s+0\s+cpu\s+{dtype}\s", out, re.M), f"summary should say {dtype}:\n{out}"
    assert ("amp_fx.GradScaler" in out) == (dtype == "fp16"), out
    if dtype == "fp16":
        assert "loss scale" in out, out
    # It learns: after 10 steps the loss is below a 50/50 guess's (ln 2) by a margin no unlucky
    # batch of 16 reaches at chance (main's demo, whose model could not see the task, ended at 0.694).
    last = re.findall(r"^step \d+: loss ([0-9.]+)", out, re.M)[-1]
    assert float(last) < 0.8 * math.log(2), out
