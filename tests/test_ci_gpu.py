"""`.ci/gpu` (the GPU tier in one run) on a machine without CUDA: every stage skips with its
reason, within a minute, and the output folder stays within what the device tool brings back.

Where CUDA is available the script runs the whole tier (about 8 minutes): this test skips there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tests", "unscale", "step", "fp8", "memory")


def _gpu(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ, PYTHON=sys.executable)
    began = time.perf_counter()
    done = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    return done, time.perf_counter() - began


def test_every_stage_skips_with_its_reason_without_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: .ci/gpu would run the whole GPU tier (about 8 minutes)")
    out = tmp_path / "gpu"
    done, seconds = _gpu(out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert seconds < 60, f".ci/gpu took {seconds:.0f} s without CUDA"
    summary = (out / "summary.txt").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^(\w+)\s+\d+\s+\d+\s+(.*)$", summary, re.M)}
    assert list(rows) == list(STAGES), summary
    for stage, result in rows.items():
        assert result.startswith("skipped: no CUDA device"), f"{stage}: {result}"
        assert "torch.cuda.is_available() is False" in result, f"{stage}: {result}"
    assert f"torch {torch.__version__}" in summary
    assert re.search(r"started \d{4}-\d\d-\d\dT", summary), summary
    assert sorted(p.name for p in out.iterdir()) == ["summary.txt"]  # no stage ran, nothing else written


def test_a_named_stage_runs_alone_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: .ci/gpu would run the stage")
    done, _ = _gpu(tmp_path / "one", "unscale")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (tmp_path / "one" / "summary.txt").read_text()
    assert re.findall(r"^(\w+)\s+\d+\s+\d+\s+skipped", summary, re.M) == ["unscale"], summary
    bad, _ = _gpu(tmp_path / "bad", "unscale", "nonsense")
    assert bad.returncode == 2
    assert "unknown stage 'nonsense'" in bad.stderr
    assert not (tmp_path / "bad").exists()
