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

LINE = r"amp_fx: {model}: compiled graph {k} \(\d+ ops, {dtype}, backend eager\) in \d+\.\d s, \d+\.\d s since the call"
START = (
    r"amp_fx: {model}: compiling \(backend {backend}\): the forward now(, its backward at the first backward)?; "
    r"a first step takes seconds to minutes \(docs/compiled-step\.md#the-first-step\)"
)


@pytest.fixture
def progress(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    yield caplog


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER]


def test_each_compiled_graph_is_one_progress_line_and_a_level_silences_them(progress: pytest.LogCaptureFixture) -> None:
    """One line per graph (two graphs: a graph break), none for a call that compiles nothing;
    the logger's level is the switch."""
    model = amp_fx.compile(GraphBreakMLP(), dtype="bf16", backend="eager", strict=False)
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_fx.AmpFxWarning)  # the split weight: not this test's subject
        model(x)
    model(x)
    lines = _lines(progress)
    assert len(lines) == 3, lines
    assert re.fullmatch(START.format(model="GraphBreakMLP", backend="eager"), lines[0]), lines
    for k, line in enumerate(lines[1:]):
        assert re.fullmatch(LINE.format(model="GraphBreakMLP", k=k, dtype="bf16"), line), line
    progress.clear()
    progress.set_level(logging.WARNING, logger=PROGRESS_LOGGER)
    amp_fx.compile(MLP(), dtype="bf16", backend="eager")(x)
    assert _lines(progress) == []


def test_compile_step_says_when_its_forward_and_its_optimizer_step_compile(progress: pytest.LogCaptureFixture) -> None:
    model = MLP()
    step = amp_fx.compile_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda out: out.float().square().mean(),
        dtype="bf16",
        backend="eager",
    )
    for _ in range(2):
        step(torch.randn(4, 16))
    lines = _lines(progress)
    assert re.fullmatch(START.format(model=r"compile_step\(MLP\)", backend="eager"), lines[0]), lines
    assert re.fullmatch(LINE.format(model=r"compile_step\(MLP\)", k=0, dtype="bf16"), lines[1]), lines
    # the optimizer step's compile (step 1, after the eager warm-up) is announced as it starts
    assert lines[2] == "amp_fx: compile_step: compiling the optimizer step (SGD, graph 0, backend eager) ...", lines
    assert re.fullmatch(
        r"amp_fx: compile_step: compiled the optimizer step \(SGD, graph 0, backend eager\) "
        r"in \d+\.\d s, \d+\.\d s since the call",
        lines[3],
    ), lines
    assert len(lines) == 4, lines


def test_progress_prints_to_stderr_until_the_application_configures_logging(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
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


# --- the overflow report and skipped steps in a row ------------------------------------------------


def _scaler_run(
    steps: int, *, init_scale: float, watched: bool = True
) -> tuple[amp_fx.GradScaler, list[warnings.WarningMessage]]:
    """A tiny fp16 model stepped through a (HOST_SYNC, torch's default) scaler."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=watched)
    scaler = amp_fx.GradScaler("cpu", init_scale=init_scale)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            scaler.scale(compiled(torch.randn(4, 16)).float().square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return scaler, [w for w in caught if "steps in a row were skipped" in str(w.message)]


def test_a_skip_from_the_scale_says_so_with_the_scale_and_its_back_off() -> None:
    """init_scale=2**40: every gradient overflows at every step, the scale's doing, not a layer's
    (the watched forward is finite); the report gives the scale, what it backed off to and the
    run; the tenth skip in a row warns once, unasked, at the user's line. Its twins: nine skips
    warn nothing; the same run unwatched does not blame the scale (issue 61)."""
    scaler, said = _scaler_run(11, init_scale=2.0**40)
    report = scaler.overflow_report()
    assert report is not None and report.from_scale and report.every_gradient
    assert (report.step, report.scale, report.scale_after, report.in_a_row) == (10, 2.0**30, 2.0**29, 11)
    assert str(report).startswith("step 10 skipped: ") and (
        "every gradient non-finite and no forward op overflowed: the loss scale is too large" in str(report)
    ), str(report)
    assert str(report).endswith("; scale 2**30, backed off to 2**29; 11 steps skipped in a row"), str(report)
    assert [(w.category, w.filename) for w in said] == [(UserWarning, __file__)]
    assert "10 optimizer steps in a row were skipped" in str(said[0].message)
    assert _scaler_run(9, init_scale=2.0**40)[1] == []
    unwatched = _scaler_run(11, init_scale=2.0**40, watched=False)[0].overflow_report()
    assert unwatched is not None and unwatched.every_gradient and not unwatched.from_scale
    assert "the forward was not watched" in str(unwatched) and "no layer is at fault" not in str(unwatched)


def test_a_clean_run_reports_nothing_and_a_skip_from_a_layer_is_not_the_scales() -> None:
    """A report of one overflowing forward op is the layer's: no scale wording."""
    from amp_fx.overflow import FirstOp, OverflowReport

    layer = OverflowReport(
        step=3,
        gradients=("a.weight",),
        first_op=FirstOp("a", "aten.mm", "fp16", 0, "mm"),
        skipped=1,
        scale=2.0**16,
        scale_after=2.0**15,
        every_gradient=True,
    )
    assert not layer.from_scale
    assert str(layer) == (
        "step 3 skipped: first inf at a (aten.mm, fp16); 1 gradients non-finite (a.weight); "
        "scale 2**16, backed off to 2**15"
    )
    scaler, said = _scaler_run(3, init_scale=2.0**8)
    assert scaler.overflow_report() is None and said == []


def test_compile_step_warns_after_skipped_steps_in_a_row_during_its_warm_up() -> None:
    """compile_step stays in its eager warm-up while steps skip, reading each flag anyway: the
    run is counted there, with no read added."""
    torch.manual_seed(0)
    model = MLP()
    scaler = amp_fx.GradScaler("cpu", init_scale=2.0**40, step_mode=amp_fx.StepMode.MASKED)
    step = amp_fx.compile_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda out: out.float().square().mean(),
        dtype="fp16",
        backend="aot_eager",  # eager has no backward graph to watch: strict mode says so
        scaler=scaler,
        watch_nonfinite=True,  # the scale is blamed only where the forward was watched
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            step(torch.randn(4, 16))
    said = [w for w in caught if "steps in a row were skipped" in str(w.message)]
    assert [(w.category, w.filename) for w in said] == [(UserWarning, __file__)], [str(w.message) for w in caught]
    report = step.overflow_report()
    assert report is not None and report.from_scale and report.in_a_row == 10


# --- issue 61: a report says only what it knows ----------------------------------------------------

PLANT_STEP = 1


def _planted_run(kind: str, *, watched: bool) -> tuple[object, list[str]]:
    """The new user's case of issue 61: a small fp16 MLP whose ``fc2.weight`` is multiplied by 1e6
    for step ``PLANT_STEP`` only (|w| * 1e6 > 65504: its fp16 cast and output hold inf, and so every
    gradient), trained by ``compile_step`` or by ``amp_fx.compile`` + ``amp_fx.GradScaler("cpu")``
    (told nothing about the model). The report after the planted step, and the reference: the
    parameters whose gradients eager ``torch.autocast`` + ``torch.amp.GradScaler`` leave non-finite
    there."""
    reports, reference = [], []
    for eager in (False, True):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = amp_fx.GradScaler("cpu", init_scale=2.0**8)
        loss_fn = lambda out: out.float().square().mean()  # noqa: E731
        if eager:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        elif kind == "compile_step":
            step = amp_fx.compile_step(model, opt, loss_fn, backend="aot_eager", watch_nonfinite=watched, scaler=scaler)
        else:
            compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=watched)
        for i in range(PLANT_STEP + 1):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
            with torch.no_grad():
                model.fc2.weight.mul_(1e6 if i == PLANT_STEP else 1.0)
            if eager:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = loss_fn(model(x))
                scaler.scale(loss).backward()
                if i == PLANT_STEP:
                    reference = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
            elif kind == "compile_step":
                step(x)
                reports.append(step.overflow_report())
                continue
            else:
                scaler.scale(loss_fn(compiled(x))).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if not eager:
                reports.append(scaler.overflow_report())
    assert reports[:PLANT_STEP] == [None] * PLANT_STEP, reports  # the scale of 2**8 fits these gradients
    return reports[PLANT_STEP], reference


@pytest.mark.parametrize("kind", ["compile_step", "compile+GradScaler"])
def test_an_unwatched_report_names_the_unknown_and_the_call_that_finds_the_layer(kind: str) -> None:
    """Unwatched, every gradient non-finite: the report does not blame the loss scale (it cannot
    know that no forward op overflowed), says the forward was not watched and names the call that
    watches it; the gradients carry the model's parameter names (they read ``<parameter 0>, ...``
    under a GradScaler told nothing, and the line said "no layer is at fault"). Twin: watched, it
    names the planted layer."""
    unwatched, reference = _planted_run(kind, watched=False)
    names = [n for n, _ in MLP().named_parameters()]
    assert reference == names  # the test can fail: eager's every gradient is non-finite here
    assert unwatched is not None and unwatched.every_gradient and not unwatched.from_scale
    line = str(unwatched)
    assert list(unwatched.gradients) == reference, line
    assert "no layer is at fault" not in line and "no forward op overflowed" not in line, line
    call = "amp_fx.compile_step(..., watch_nonfinite=True)" if kind == "compile_step" else "scaler.watch(model)"
    assert line.startswith(f"step {PLANT_STEP} skipped: the forward was not watched, so whether a layer "), line
    assert call in line and "watch_nonfinite=True" in line, line
    watched, _ = _planted_run(kind, watched=True)
    assert watched is not None and watched.first_op is not None, watched
    assert watched.first_op.module == "fc2" and not watched.from_scale, str(watched)
    assert str(watched).startswith(f"step {PLANT_STEP} skipped: first inf at fc2 ("), str(watched)


# --- issue 61: time announced from the user's call -------------------------------------------------


def _seconds(line: str, what: str) -> float:
    found = re.search(rf"(\d+\.\d) s{what}", line)
    assert found is not None, (what, line)
    return float(found.group(1))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_first_line_comes_before_compile_work_and_the_backward_compile_is_announced(
    progress: pytest.LogCaptureFixture, backend: str
) -> None:
    """The user's first call logs its start line before Dynamo traces: its timestamp is at or
    before the forward graph's compile start (the graph line's time minus its own duration, to the
    line's 0.1 s rounding), and the forward line's "since the call" covers its compile time. The
    backward graph, compiled by AOTAutograd at the first backward, is announced as it starts and
    timed from the same call: this test fails if the backward compile is silent. A second step
    compiles nothing and says nothing. The caches are off: a backward that AOTAutograd's cache
    serves (an earlier run in the machine's cache folder) is not compiled, so not announced."""
    model = amp_fx.compile(MLP(), dtype="fp16", backend=backend)
    no_cache = torch._functorch.config.patch(enable_autograd_cache=False)
    with no_cache, torch._inductor.config.patch(fx_graph_cache=False):
        for _ in range(2):
            model(torch.randn(4, 16)).float().square().mean().backward()
    records = [r for r in progress.records if r.name == PROGRESS_LOGGER]
    lines = [r.getMessage() for r in records]
    assert len(lines) == 4, lines
    start, forward, backward_start, backward = records
    assert re.fullmatch(START.format(model="MLP", backend=backend), lines[0]), lines
    assert "its backward at the first backward" in lines[0], lines  # a backend with a backward graph
    assert lines[1].startswith("amp_fx: MLP: compiled graph 0 (") and lines[1].endswith(" s since the call"), lines
    compile_s, since_s = _seconds(lines[1], ","), _seconds(lines[1], " since")
    assert since_s >= compile_s, lines[1]
    assert start.created <= forward.created - compile_s + 0.05, (start.created, forward.created, lines[1])
    assert lines[2] == "amp_fx: MLP: compiling the backward of graph 0 (its first backward) ...", lines
    assert re.fullmatch(
        rf"amp_fx: MLP: compiled the backward of graph 0 \(\d+ ops, backend {backend}\) in \d+\.\d s, "
        r"\d+\.\d s since the call",
        lines[3],
    ), lines
    assert forward.created <= backward_start.created <= backward.created
    assert _seconds(lines[3], " since") >= since_s - 0.05, lines


# --- issue 61: one meaning per word ----------------------------------------------------------------


def test_the_op_count_means_one_thing_in_the_compile_line_explain_and_the_summary(
    progress: pytest.LogCaptureFixture,
) -> None:
    """The compile line's "N ops", ``explain``'s "ops" column and ``amp_fx_summary()``'s (what the
    demo prints) are one count: the ATen ops of the rewritten graph, casts not counted, checked
    against the count made here from the graph itself (before, three counts: Dynamo's
    calls, ATen ops without casts, every call node). explain names the backend the user asked for,
    not amp_fx's internal wrapper (it printed ``recorder(eager)``)."""
    from amp_fx.passes.fx_edit import CAST_OP

    x = torch.randn(4, 16)
    compiled = amp_fx.compile(MLP(), dtype="fp16", backend="eager")
    compiled(x)
    rewritten = compiled.amp_fx_records[0].rewritten
    reference = sum(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target is not CAST_OP
        for n in rewritten.graph.nodes
    )
    casts = sum(n.target is CAST_OP for n in rewritten.graph.nodes)
    assert casts > 0  # the test can fail: counting casts would give another number
    line = next(m for m in _lines(progress) if "compiled graph 0" in m)
    assert f"compiled graph 0 ({reference} ops, fp16, backend eager)" in line, line
    summary = compiled.amp_fx_summary().splitlines()
    ops_column = summary[0].split().index("ops")
    assert summary[2].split()[ops_column] == str(reference), "\n".join(summary)
    progress.clear()
    explained = amp_fx.explain(MLP(), x, dtype="fp16")
    assert explained.summary_rows()[0]["ops"] == reference
    said = "\n".join([str(explained), *_lines(progress)])
    assert "recorder" not in said and "probe" not in said, said
