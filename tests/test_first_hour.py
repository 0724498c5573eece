"""Issue 54: what a new user sees while amp_fx works (progress lines) and where its warnings point."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator

import pytest
import torch

import amp_fx
from amp_fx._common.progress import PROGRESS_LOGGER, progress_log
from amp_fx.testing.zoo import MLP, GraphBreakMLP

LINE = r"amp_fx: {model}: compiled graph {k} \(\d+ ops, {dtype}, backend eager\) in \d+\.\d s"


@pytest.fixture
def progress(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    yield caplog


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER]


def test_each_compiled_graph_is_one_progress_line_and_a_level_silences_them(
        progress: pytest.LogCaptureFixture) -> None:
    """One line per graph (two graphs: a graph break), none for a call that compiles nothing;
    the logger's level is the switch."""
    model = amp_fx.compile(GraphBreakMLP(), dtype="bf16", backend="eager", strict=False)
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_fx.AmpFxWarning)  # the split weight: not this test's subject
        model(x)
    model(x)
    lines = _lines(progress)
    assert len(lines) == 2, lines
    for k, line in enumerate(lines):
        assert re.fullmatch(LINE.format(model="GraphBreakMLP", k=k, dtype="bf16"), line), line
    progress.clear()
    progress.set_level(logging.WARNING, logger=PROGRESS_LOGGER)
    amp_fx.compile(MLP(), dtype="bf16", backend="eager")(x)
    assert _lines(progress) == []


def test_compile_step_says_when_its_forward_and_its_optimizer_step_compile(
        progress: pytest.LogCaptureFixture) -> None:
    model = MLP()
    step = amp_fx.compile_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda out: out.float().square().mean(), dtype="bf16", backend="eager")
    for _ in range(2):
        step(torch.randn(4, 16))
    lines = _lines(progress)
    assert re.fullmatch(LINE.format(model=r"compile_step\(MLP\)", k=0, dtype="bf16"), lines[0]), lines
    assert re.fullmatch(r"amp_fx: compile_step: compiled the optimizer step \(SGD, graph 0, backend eager\) "
                        r"in \d+\.\d s", lines[1]), lines
    assert len(lines) == 2, lines


def test_progress_prints_to_stderr_until_the_application_configures_logging(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Shown by default (no handler anywhere: amp_fx's own prints it), and printed once when the
    application has a root handler (that one prints it, amp_fx's stays quiet)."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    progress_log.info("amp_fx: shown")
    assert capsys.readouterr().err == "amp_fx: shown\n"
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    progress_log.info("amp_fx: not twice")
    assert capsys.readouterr().err == ""


def test_a_warning_points_at_the_users_line_not_amp_fxs() -> None:
    """The one stacklevel rule (the first frame outside amp_fx and torch): a warning raised while
    Dynamo compiles, deep inside amp_fx's backend, is attributed to the call in this file."""
    model = amp_fx.compile(GraphBreakMLP(), dtype="bf16", backend="eager", strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 16))
    ours = [w for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]
    assert ours, "the split weight's warning"
    assert {(w.filename, w.lineno) for w in ours} == {(__file__, model_call_line())}


def model_call_line() -> int:
    import inspect

    source, start = inspect.getsourcelines(test_a_warning_points_at_the_users_line_not_amp_fxs)
    return start + next(i for i, line in enumerate(source) if "model(torch.randn" in line)
