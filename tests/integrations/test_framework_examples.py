"""examples/torch_compile_backend.py, hf_trainer.py and lightning_plugin.py as a user runs them:
each prints whether amp_fx matched its reference bit for bit, and must print True."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AMP_FX_STRICT": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _needs(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install amp_fx[{extra}])")


@pytest.mark.slow
def test_torch_compile_backend_example():
    eps = {e.name: e.value for e in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    if eps.get("amp_fx") != "amp_fx.integrations.dynamo_backend:amp_fx_backend":
        pytest.skip(
            "the installed amp_fx declares no torch_dynamo_backends entry points (another checkout's "
            "install); `pip install -e .` of this one does"
        )
    assert "bitwise equal to eager torch.autocast (output and gradients): True" in _run("torch_compile_backend.py")


@pytest.mark.slow
def test_hf_trainer_example():
    _needs("transformers", "hf")
    _needs("accelerate", "hf")  # Trainer's TrainingArguments raise ImportError without it
    assert "parameters bitwise equal after 5 steps: True" in _run("hf_trainer.py")


@pytest.mark.slow
def test_lightning_example():
    _needs("lightning", "lightning")
    assert "parameters bitwise equal after 5 steps: True" in _run("lightning_plugin.py")
