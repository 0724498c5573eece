"""The backward watch (issue 30): a step skipped because the backward overflowed names the backward
op, its module and the forward op it differentiates, and says it was the backward; a report that
names no op says exactly what was and was not watched.

References: eager ``torch.autocast`` + ``torch.amp.GradScaler`` on the same model and batches for
which steps are skipped, whether the forward output was finite and which gradients were
non-finite; ``amp_fx.testing.backward_origin`` (eager autograd's backward under a dispatch mode
and module backward hooks) for the first backward op that made an inf and its module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.errors import AmpFxError, AmpFxWarning
from amp_fx.testing.backward_origin import BackwardOrigin, first_backward_origin
from tests.overflow._overflow_cases import batches, loss_fn, make_model

BACKENDS = ["aot_eager", "inductor"]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "overflow.md"
RUNNERS = ["grad_scaler", "compile_step"]
WIDTH, STEPS, PLANTED_STEP = 16, 4, 2
INIT_SCALE = 2.0**10
# mid's weight times GAIN at the planted step: its input is shrunk by 1e-3 first, so its forward
# output stays near 1 (finite in fp16), while the gradient of its input, g @ (W * GAIN) with g the
# scaled output gradient (about 2^10 * 0.1), exceeds 65504 (the eager reference checks both).
GAIN = 1e4


class Mid(nn.Linear):
    def __init__(self) -> None:
        super().__init__(WIDTH, WIDTH)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.gain, self.bias)


class GrowNet(nn.Module):
    """A layer (``mid``) whose gradient alone overflows at the planted step: the forward is finite."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.mid = Mid()
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.mid(self.inp(x) * 1e-3)))


def _make() -> GrowNet:
    torch.manual_seed(0)
    return GrowNet()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, WIDTH, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(STEPS)]


def _plant(model: GrowNet, step: int, planted: int | None) -> None:
    model.mid.gain.fill_(GAIN if step == planted else 1.0)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def _eager_reference(
    model: nn.Module,
    plant: Callable[[int], None],
    loss_fn: Callable[..., torch.Tensor],
    batches: list[Any],
    init_scale: float,
) -> dict[str, Any]:
    """Eager ``torch.autocast`` + ``torch.amp.GradScaler``: skipped steps, forward finite per step,
    per step the backward's first inf (``first_backward_origin``) and the non-finite gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    out: dict[str, Any] = {"skipped": [], "finite": [], "origins": [], "gradients": []}
    for i, (x, y) in enumerate(batches):
        plant(i)

        def scaled_loss(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.float16):
                result = model(x)
            out["finite"].append(
                all(bool(torch.isfinite(t).all()) for t in (result if isinstance(result, tuple) else (result,)))
            )
            return scaler.scale(loss_fn(result, y))

        out["origins"].append(first_backward_origin(model, scaled_loss, torch.float16))
        out["gradients"].append(
            [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        )
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.get_scale() < before:
            out["skipped"].append(i)
    return out


def _amp_fx_reports(
    runner: str,
    model: nn.Module,
    plant: Callable[[int], None],
    loss_fn: Callable[..., Any],
    batches: list[Any],
    init_scale: float,
    **options: Any,
) -> list[Any]:
    """The report after each step: ``amp_fx.compile`` + ``amp_fx.GradScaler``, or ``compile_step``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = amp_fx.GradScaler("cpu", init_scale=init_scale, step_mode=amp_fx.StepMode.MASKED)
    reports = []
    if runner == "compile_step":
        step = amp_fx.compile_step(model, opt, loss_fn, scaler=scaler, **options)
        for i, (x, y) in enumerate(batches):
            plant(i)
            step(x, y)
            reports.append(step.overflow_report())
        return reports
    compiled = amp_fx.compile(model, dtype="fp16", **options)
    scaler.watch(compiled)
    for i, (x, y) in enumerate(batches):
        plant(i)
        scaler.scale(loss_fn(compiled(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        reports.append(scaler.overflow_report())
    return reports


@pytest.fixture(scope="module")
def grow_reference() -> dict[str, Any]:
    model = _make()
    ref = _eager_reference(model, lambda i: _plant(model, i, PLANTED_STEP), _loss, _batches(), INIT_SCALE)
    # The premise: the planted step is the only skip, the forward is finite at every step, and the
    # eager backward's first inf is an op of mid's backward (made from finite inputs).
    assert ref["skipped"] == [PLANTED_STEP] and all(ref["finite"]), ref
    origin: BackwardOrigin = ref["origins"][PLANTED_STEP]
    assert origin.module == "mid" and origin.op is not None, origin
    return ref


@pytest.mark.slow_cases
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_whose_gradient_alone_overflows_is_named_in_the_backward(backend, runner, grow_reference):
    model = _make()
    reports = _amp_fx_reports(
        runner,
        model,
        lambda i: _plant(model, i, PLANTED_STEP),
        _loss,
        _batches(),
        INIT_SCALE,
        backend=backend,
        watch_nonfinite=True,
    )
    assert [i for i, r in enumerate(reports) if r is not None] == grow_reference["skipped"], reports
    report = reports[PLANTED_STEP]
    origin = grow_reference["origins"][PLANTED_STEP]
    first = report.first_op
    assert first is not None and first.backward and not first.incoming, str(report)
    assert (first.module, first.op, first.grad_of) == (origin.module, origin.op, "aten.linear"), (str(report), origin)
    assert list(report.gradients) == grow_reference["gradients"][PLANTED_STEP]
    assert str(report).startswith(
        f"step {PLANTED_STEP} skipped: first inf in the backward at mid ({origin.op}, fp16, backward of aten.linear); "
    )
    assert report.watched == ("forward", "backward")
    # docs/overflow.md shows this run's line
    shown = [
        line.strip()
        for line in DOCS.read_text().splitlines()
        if line.startswith(f"step {PLANTED_STEP} skipped: first inf in the backward")
    ]
    assert shown == [str(report)], (shown, str(report))


@pytest.mark.slow_cases
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_too_high_initial_scale_is_named_in_the_backward(backend, runner):
    """``tests/overflow/_overflow_cases.PlantedNet`` at torch's default scale 2^16, nothing planted: step 0's
    scaled fp16 gradients overflow in the backward (the scale then backs off and the run is clean).
    The first inf is where eager autograd's backward makes it."""
    init_scale = 2.0**16
    ref = _eager_reference(make_model(), lambda i: None, loss_fn, batches(3), init_scale)
    assert ref["skipped"] == [0] and all(ref["finite"]), ref
    origin = ref["origins"][0]
    assert origin.op is not None and origin.module, origin  # an op inside the model
    reports = _amp_fx_reports(
        runner, make_model(), lambda i: None, loss_fn, batches(3), init_scale, backend=backend, watch_nonfinite=True
    )
    assert [i for i, r in enumerate(reports) if r is not None] == [0], reports
    first = reports[0].first_op
    assert first is not None and first.backward, str(reports[0])
    assert (first.module, first.op) == (origin.module, origin.op), (str(reports[0]), origin)
    assert list(reports[0].gradients) == ref["gradients"][0]


# --- the line when no op is named ---------------------------------------------------------------


@pytest.mark.parametrize("runner", RUNNERS)
def test_unwatched_line_says_the_watch_is_off(runner, grow_reference):
    model = _make()
    reports = _amp_fx_reports(
        runner,
        model,
        lambda i: _plant(model, i, PLANTED_STEP),
        _loss,
        _batches(),
        INIT_SCALE,
        backend="aot_eager",
        watch_nonfinite=False,
    )
    report = reports[PLANTED_STEP]
    assert report is not None and report.first_op is None and report.watched == ()
    assert str(report).startswith(
        f"step {PLANTED_STEP} skipped: the forward was not watched, so whether a layer overflowed is not known"
    ), str(report)
    assert "; to name the layer: amp_fx.compile" in str(report), str(report)


@pytest.mark.parametrize("runner", RUNNERS)
def test_eager_backend_watches_the_forward_only_and_says_so(runner, grow_reference):
    """``backend="eager"`` has no AOTAutograd backward graph: amp_fx warns once when the model is
    compiled, and the report says the backward was not watched (and names no forward op: the
    forward was finite, as the reference shows)."""
    model = _make()
    with pytest.warns(AmpFxWarning, match="watches the forward only") as caught:
        reports = _amp_fx_reports(
            runner,
            model,
            lambda i: _plant(model, i, PLANTED_STEP),
            _loss,
            _batches(),
            INIT_SCALE,
            backend="eager",
            watch_nonfinite=True,
            strict=False,
        )
    assert sum("watches the forward only" in str(w.message) for w in caught) == 1
    assert [i for i, r in enumerate(reports) if r is not None] == grow_reference["skipped"], reports
    report = reports[PLANTED_STEP]
    assert report.first_op is None and report.watched == ("forward",), str(report)
    assert str(report).startswith(
        f"step {PLANTED_STEP} skipped: no op named: no forward op created an inf/NaN (a -inf mask or an in-place "
        "op is not named); the backward is not watched (backend 'eager' runs the graphs' ops through eager "
        "autograd: there is no backward graph); "
    ), str(report)


def test_eager_backend_with_the_watch_raises_in_strict_mode():
    with pytest.raises(AmpFxError, match="watches the forward only"):
        amp_fx.compile(_make(), dtype="fp16", backend="eager", watch_nonfinite=True, strict=True)


class _ScaledInput(nn.Linear):
    """``x * gain`` against ``weight / gain``: the output is the Linear's, while the weight's
    gradient, ``g^T (x * gain)`` in fp16, grows with the gain (past 65504 at 3e3, checked by the
    reference)."""

    def __init__(self) -> None:
        super().__init__(WIDTH, WIDTH)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x * self.gain, self.weight / self.gain, self.bias)


class _EagerFirst(nn.Module):
    """``pre`` runs outside the compiled graphs (``torch._dynamo.disable``, under eager autocast),
    and its weight gradient overflows in its own (eager) backward; the compiled rest stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = _ScaledInput()
        self.body = nn.Linear(WIDTH, 4)

    @torch._dynamo.disable
    def _pre(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(F.relu(self._pre(x)))


@pytest.mark.slow_cases
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_overflow_outside_the_compiled_graphs_is_not_named_and_the_line_says_why(backend, runner):
    """The first inf of the backward is made by ``pre``'s backward, which eager autograd runs
    (the eager reference names it): the compiled graphs' forward and backward saw no inf made, and
    the line says exactly that, where it used to say "forward finite or not watched"."""

    def make() -> _EagerFirst:
        torch.manual_seed(0)
        return _EagerFirst()

    def plant(model: _EagerFirst, i: int) -> None:
        model.pre.gain.fill_(3e3 if i == PLANTED_STEP else 1.0)

    model = make()
    ref = _eager_reference(model, lambda i: plant(model, i), _loss, _batches(), INIT_SCALE)
    assert ref["skipped"] == [PLANTED_STEP] and all(ref["finite"]), ref
    assert ref["origins"][PLANTED_STEP].module == "pre", ref["origins"][PLANTED_STEP]
    model = make()
    reports = _amp_fx_reports(
        runner, model, lambda i: plant(model, i), _loss, _batches(), INIT_SCALE, backend=backend, watch_nonfinite=True
    )
    assert [i for i, r in enumerate(reports) if r is not None] == [PLANTED_STEP], reports
    report = reports[PLANTED_STEP]
    assert report.first_op is None and report.watched == ("forward", "backward"), str(report)
    assert list(report.gradients) == ref["gradients"][PLANTED_STEP]
    assert str(report).startswith(
        f"step {PLANTED_STEP} skipped: no op named: no forward or backward op created an inf/NaN (a -inf mask, "
        "an in-place op or code outside the compiled graphs is not named); "
    ), str(report)


# --- placement: the module whose forward ran the op -----------------------------------------------

BODY_SCALE = 2.0**24  # the scaled gradient of the fp32 loss, S * 2 (l - y) / 32 ~ 5e5, past fp16's 65504


class _Head(nn.Module):
    """Its own ``forward`` casts its fp16 output back to fp32 for the loss after a graph break (as
    transformers' ``loss_function`` breaks on a ``warning_once``), and does not use ``self`` after
    it: the rest of the body is another graph, whose frame has no ``self``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, 4)

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.proj(h)
        torch._dynamo.graph_break()
        return F.mse_loss(logits.float(), y)


class _Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.head = _Head()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.inp(x)), y)


class _Nested(nn.Module):
    """``mid.head`` (depth 2) computes the loss in its own body; with ``in_root``, the root does."""

    def __init__(self, in_root: bool) -> None:
        super().__init__()
        self.in_root = in_root
        self.mid = _Mid()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.in_root:
            return self.mid(x, y)
        logits = self.mid.head.proj(F.relu(self.mid.inp(x)))
        torch._dynamo.graph_break()
        return F.mse_loss(logits.float(), y)


def _first_op_after_one_step(
    runner: str, model: nn.Module, batch: tuple[Any, ...], init_scale: float, **model_kwargs: Any
) -> Any:
    """The overflow report after one step of ``model`` (its forward returns the loss), fp16,
    aot_eager, watched: ``amp_fx.compile`` + ``amp_fx.GradScaler`` or ``compile_step``."""
    scaler = amp_fx.GradScaler("cpu", init_scale=init_scale, step_mode=amp_fx.StepMode.MASKED)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if runner == "compile_step":
        step = amp_fx.compile_step(
            model, opt, lambda loss: loss, scaler=scaler, n_inputs=len(batch), backend="aot_eager", watch_nonfinite=True
        )
        step(*batch, **model_kwargs)
        return step.overflow_report()
    compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True)
    scaler.watch(compiled)
    scaler.scale(compiled(*batch, **model_kwargs)).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.overflow_report()


@pytest.mark.parametrize("runner", ["compile", "compile_step"])
@pytest.mark.parametrize("where", ["mid.head", "<root>"])
def test_a_backward_op_is_placed_in_the_module_whose_own_forward_ran_its_forward_op(where, runner):
    """The first inf of the backward is the fp32-to-fp16 cast back of the loss's ``.float()``, an op
    of ``mid.head``'s own forward body (not of a child), in a graph resumed after a graph break:
    it is placed at ``mid.head``, as the eager reference's module backward hooks place it (it was
    placed at ``<root>``: the resumed frame has no ``self`` and Dynamo records no module for it;
    under ``compile_step`` until issue 52, whose frame named no root module). Twin: the same op in
    the root's own body stays at ``<root>``."""
    x, y = _batches()[0]

    def make() -> _Nested:
        torch.manual_seed(0)
        return _Nested(in_root=where == "<root>")

    model = make()

    def scaled_loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x, y)
        return loss * BODY_SCALE

    origin = first_backward_origin(model, scaled_loss, torch.float16)
    assert origin.op == "aten._to_copy" and origin.module == ("" if where == "<root>" else where), origin
    report = _first_op_after_one_step(runner, make(), (x, y), BODY_SCALE)
    assert report is not None and report.first_op is not None, report
    first = report.first_op
    assert (first.backward, first.op, first.grad_of) == (True, "aten._to_copy", "aten._to_copy"), str(report)
    assert str(report).startswith(
        f"step 0 skipped: first inf in the backward at {where} (aten._to_copy, fp16, backward of aten._to_copy); "
    ), str(report)


class _HfWrapper(nn.Module):
    """The issue-52 case: a wrapper whose ``inner`` is a Hugging Face GPT-2 (one layer: the layers
    play no part) that computes its own loss (``labels=``); the loss's ``logits.float()`` runs in
    ``GPT2LMHeadModel.forward``'s body, after a graph break (transformers' loss function)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers as tf

        config = tf.GPT2Config(
            vocab_size=128,
            n_embd=64,
            n_layer=1,
            n_head=4,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.inner = tf.GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, labels=ids, return_dict=False)[0]


def test_a_hugging_face_models_loss_overflow_is_placed_in_that_model_under_a_wrapper():
    """The scaled loss gradient (2^24) overflows in the backward of ``logits.float()``, an op of
    ``inner``'s own body: eager autograd's module hooks place it at ``inner``, and so does
    ``compile_step`` (it said ``<root>``: its frame is no module, so the graphs Dynamo captured
    inside ``inner`` were not named under the model; ``amp_fx.compile`` was right, and both now
    name through one rule, ``RootNames``, the test above pins both runners). ``return_dict=False``
    only so that the reference's backward hooks see ``inner``'s output (a ModelOutput hides it)."""
    pytest.importorskip("transformers")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def make() -> _HfWrapper:
        torch.manual_seed(0)
        return _HfWrapper()

    model = make()

    def scaled_loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(ids)
        return loss * 2.0**24

    origin = first_backward_origin(model, scaled_loss, torch.float16)
    assert (origin.module, origin.op) == ("inner", "aten._to_copy"), origin
    report = _first_op_after_one_step("compile_step", make(), (ids,), 2.0**24)
    assert report is not None and report.first_op is not None, report
    assert str(report.first_op) == "inner (aten._to_copy, fp16, backward of aten._to_copy)", str(report)


class _BreakingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        torch._dynamo.graph_break()
        return h.float() * 2.0


class _Stack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_BreakingLayer() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("layers", [1, 3])
def test_a_resumed_graph_that_serves_every_layer_is_placed_at_their_common_parent(layers):
    """The rest of each layer's ``forward`` after its graph break is one graph, captured in
    ``layers.0``'s call and run again for ``layers.1`` and ``layers.2`` (no new capture): its ops
    are placed at ``layers``, true of every run, not at ``layers.0``. Twin: with one layer, the
    graph serves only it and is placed at ``layers.0``."""
    from amp_fx.passes.capture import module_stack

    compiled = amp_fx.compile(_Stack(layers), dtype="fp16", backend="aot_eager")
    compiled(torch.randn(2, WIDTH))
    placed = [
        {module_stack(n)[-1][0] for n in r.rewritten.graph.nodes if n.op == "call_function" and module_stack(n)}
        for r in compiled.amp_fx_records
    ]
    body = [p for p in placed if not any(name.endswith(".lin") for name in p)]
    assert body == [{"layers" if layers > 1 else "layers.0"}], placed
