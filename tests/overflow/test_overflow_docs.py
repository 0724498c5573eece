"""The report line the documentation shows is the planted test's own (issue 21 asks the README for
"a real report line from the planted test"): docs/overflow.md and README.md must print exactly what
``str(CompiledStep.overflow_report())`` gives on the planted run of ``tests/overflow/test_overflow.py``."""

from __future__ import annotations

from pathlib import Path

import torch

import amp_fx
from tests.overflow._overflow_cases import PLANTED_STEP, loss_fn, make_model, make_scaler, run_step

ROOT = Path(__file__).resolve().parents[2]


def _planted_line() -> str:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = amp_fx.compile_step(model, opt, loss_fn, backend="aot_eager", watch_nonfinite=True, scaler=make_scaler())
    report = run_step(step, model)[PLANTED_STEP]
    assert report is not None
    return str(report)


def test_documented_report_line_is_the_planted_runs() -> None:
    line = _planted_line()
    for page in ("docs/overflow.md", "README.md"):
        shown = [
            s.strip().lstrip("#").strip()
            for s in (ROOT / page).read_text().splitlines()
            if s.strip().lstrip("#").strip().startswith(f"step {PLANTED_STEP} skipped:")
        ]
        assert shown, f"{page} shows no report line"
        assert all(s == line for s in shown), (page, shown, line)
