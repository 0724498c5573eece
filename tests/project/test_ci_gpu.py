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

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("tests", "gpt2", "moe", "llama3", "gap", "unscale")
_LIMIT = re.compile(r"^#\s+(\w+)\s+(\d+)\s", re.M)


def _gpu(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ, PYTHON=sys.executable)
    began = time.perf_counter()
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu"), str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
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


def test_the_default_stages_hold_8_minutes_of_limits_and_every_stage_is_documented() -> None:
    """The default run must fit a short device window with room for one rerun: its limits add up
    to at most 480 s. The header's table of stages and limits is the script's own LIMIT table."""
    script = (ROOT / ".ci" / "gpu").read_text()
    table = re.search(r"declare -A LIMIT=\((.*?)\)\n", script, re.S)
    assert table, "no LIMIT table in .ci/gpu"
    limits = {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", table.group(1))}
    defaults = re.search(r"^ALL_STAGES=\(([^)]*)\)", script, re.M)
    assert defaults and tuple(defaults.group(1).split()) == STAGES
    assert sum(limits[s] for s in STAGES) <= 480, {s: limits[s] for s in STAGES}
    documented = {k: int(v) for k, v in _LIMIT.findall(script) if k in limits}
    assert documented == limits, "the header's stage table and LIMIT differ"


def test_stages_that_would_write_more_files_than_come_back_are_refused(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: .ci/gpu would run the stages")
    too_many = (*STAGES, "fp8")  # 7 .txt files, cuda.xml and summary.txt: 9
    done, _ = _gpu(tmp_path / "many", *too_many)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "would write 9 files" in done.stderr
    assert not (tmp_path / "many").exists()
    done, _ = _gpu(tmp_path / "six", *too_many[1:])  # without the tests: 7 .txt and summary.txt
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_blockwise_stage_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    """The blockwise stage (issue 60, only when named) skips with the reason and writes nothing
    but the summary; its script alone says why it cannot run and exits 0."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: .ci/gpu would run the stage")
    done, _ = _gpu(tmp_path / "bw", "blockwise")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (tmp_path / "bw" / "summary.txt").read_text()
    assert re.findall(r"^(\w+)\s+\d+\s+\d+\s+skipped: no CUDA device", summary, re.M) == ["blockwise"], summary
    assert sorted(p.name for p in (tmp_path / "bw").iterdir()) == ["summary.txt"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = str(ROOT / "bench" / "bench_blockwise.py")
    bench = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=120)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert "[bench_blockwise] skipped: needs CUDA" in bench.stdout
