"""Where amp_fx under inductor does not overflow where eager autocast does (issue 61, documented in
docs/overflow.md, "Where inductor does not overflow"): inductor computes a fused chain of fp16
pointwise ops in fp32 registers and rounds to fp16 only where it stores, so an fp16 intermediate
that eager rounds to inf never exists. aot_eager runs the ops one by one, as eager does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx

_ROOT = Path(__file__).resolve().parents[2]


class _Amplified(nn.Module):
    """fc1's fp16 output times 1e5 (past fp16's 65504 for |h| > 0.66), a relu, and back down:
    eager rounds the product to fp16 (inf), inductor fuses the three pointwise ops."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x) * 1e5) * 1e-5
        return self.fc2(h)


def _fused_check() -> None:
    torch.manual_seed(0)
    model, x = _Amplified(), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        eager = model(x)
    assert not torch.isfinite(eager).all()  # the reference overflows
    ladder = amp_fx.compile(model, dtype="fp16", backend="aot_eager")(x)
    torch.testing.assert_close(ladder, eager, atol=0, rtol=0, equal_nan=True)  # op by op, as eager
    fused = amp_fx.compile(model, dtype="fp16", backend="inductor")(x)
    assert torch.isfinite(fused).all(), fused  # the same graph, fused: no fp16 inf in between
    # and what it computes is the fp32 chain rounded once: within fp16's rounding of the reference
    with torch.autocast("cpu", dtype=torch.float16):
        h = model.fc1(x)
    wide = model.fc2(F.relu(h.float() * 1e5) * 1e-5)
    torch.testing.assert_close(fused.float(), wide, atol=2e-2, rtol=1e-2)  # two fp16 roundings (fc2's in and out)


@pytest.mark.slow
def test_inductor_keeps_a_fused_fp16_intermediate_that_eager_overflows() -> None:
    """Run in a fresh process: in CI's full run (one xdist worker, after many other tests) the
    inductor compile came out unfused (inf, as eager) while the test passes alone and after every
    inductor test of tests/overflow, tests/backend/test_numerics_eager.py and tests/inspect/test_compare.py:
    some earlier test leaves process state behind (cause not found yet; closing note of 2026-12-02)."""
    script = "import tests.overflow.test_fused_intermediates as t; t._fused_check()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], cwd=_ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
