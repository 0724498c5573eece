"""The GPU round's scripts, checked on the CPU so that a short GPU window does not find them broken:
``bench/bench_coverage.py`` (its tiny preset, one workload) and ``bench/gap_kernels.py``'s reading
of inductor's generated code. Their numbers are the GPU's (``.ci/gpu``), never asserted here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from gap_kernels import diff, generated_code, parse  # noqa: E402


def _row(table: str, variant: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(variant))
    return re.split(r"\s{2,}", line[len(variant) :].strip())


@pytest.mark.slow
def test_bench_coverage_tiny_moe_runs_and_amp_fx_covers_the_experts() -> None:
    """The MoE workload at its tiny preset under aot_eager: every variant gives a row, torchao's
    MoE row says why it does not run on a CPU, and amp_fx's shares are at least autocast's (the
    experts, fp32 under autocast, are bf16 or fp8 in amp_fx)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_coverage.py"),
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--backend",
            "aot_eager",
            "--workloads",
            "moe",
            "--steps",
            "3",
            "--warmup",
            "1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    table = done.stdout[done.stdout.index("\nmoe ") :]
    assert "failed" not in table, table
    autocast = float(_row(table, "torch.compile + autocast bf16")[0])
    bf16 = _row(table, "amp_fx bf16")
    fp8 = _row(table, "amp_fx fp8 rowwise")
    assert "not run: torchao's MoE fp8 runs its grouped GEMMs with CUDA kernels only" in table
    assert autocast < 1.0, "autocast ran the experts in bf16: the workload shows no coverage gap"
    assert float(bf16[0]) == 1.0 and float(bf16[1]) == 0.0, bf16
    assert float(fp8[1]) == 1.0, fp8


@pytest.mark.slow
def test_gap_kernels_reads_the_kernels_and_extern_calls_inductor_generated() -> None:
    """Per graph, the fused kernels and extern GEMMs of the code inductor generated: a linear
    layer and a ReLU under autocast give addmm's in the forward, mm's in the backward, and
    the casts and the ReLU fused; the same model compiled twice compares as the same."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    graphs = []
    for _ in range(2):
        torch._dynamo.reset()
        with generated_code() as codes:
            with torch.autocast("cpu", torch.bfloat16):
                out = torch.compile(model)(torch.randn(4, 32))
            out.float().sum().backward()
        graphs.append([parse(c) for c in codes])
    forward, backward = graphs[0]
    assert forward.externs == {"extern_kernels.addmm": 2}, forward
    # the input gradient of the second layer and both weight gradients (the first layer's input
    # needs none)
    assert backward.externs == {"extern_kernels.mm": 3}, backward
    assert sum(forward.kernels.values()) >= 1 and all(k.startswith("cpp_fused_") for k in forward.kernels)
    assert not any(re.search(r"_\d+$", k) for g in graphs[0] for k in g.kernels), "running index not dropped"
    for a, b in zip(*graphs):
        assert diff(a.kernels, b.kernels) == "same" and diff(a.externs, b.externs) == "same"
