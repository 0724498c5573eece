"""Never worse than torch.compile: a failure in amp_fx's own work on a graph falls back.

Each stage amp_fx runs on a captured graph (the pipeline's, amp_fx/passes/pipeline.py, and the
backend's around it, amp_fx/backend/compiler.py) gets a planted failure on the second graph of a
model with a graph break. That graph must then run as ``torch.compile`` under ``torch.autocast``
runs it: the forward output, the loss and every gradient bitwise with
``torch.compile(model, backend="aot_eager")`` called under ``torch.autocast``; the first graph stays
amp_fx's. amp_fx warns once, naming the graph, the stage, the op and the cause; strict mode raises
amp_fx's error chained from the cause. The weight cache's own narrower fallback (a graph whose
weight casts cannot be lifted keeps amp_fx's casts, uncached) is tested in test_weight_cache.py.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import amp_fx
from amp_fx import AmpFxError, AmpFxWarning, CastClass, Policy
from amp_fx.backend import compiler
from amp_fx.backend.compiler import AmpBackend
from amp_fx.backend.splits import SplitTracker
from amp_fx.overflow.watch import watched_models
from amp_fx.passes import pipeline
from amp_fx.passes.pipeline import GraphRecord
from amp_fx.testing import assert_bitwise


class _Broken(torch.nn.Module):
    """Two graphs: ``a`` before the break, ``b`` and the loss after it (sizes of 16: fp8's
    ``torch._scaled_mm`` takes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(y).sum()


def _model_and_input() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Broken(), torch.randn(16, 16)


def _run(model: Callable[..., Any], params: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """One forward (the loss) and backward under torch.autocast: the loss and every gradient."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x)
    loss.backward()
    return {"loss": loss, **{n: p.grad for n, p in params.named_parameters()}}


def _torch_compile_reference() -> dict[str, Any]:
    model, x = _model_and_input()
    return _run(torch.compile(model, backend="aot_eager"), model, x)


def _second_graph(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The op that marks the graph after the break (the loss's sum), in Dynamo's graph or amp_fx's."""
    return next(
        (n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and "sum" in str(n.target)), None
    )


def _graph_of(args: tuple[Any, ...]) -> torch.fx.GraphModule:
    for a in args:
        if isinstance(a, torch.fx.GraphModule):
            return a
        if isinstance(a, GraphRecord):
            return a.rewritten
    raise AssertionError(f"no graph among {args!r}")


def _planted(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, failing on the second graph at its sum (a frame with ``node`` local, as the
    passes have), running as before on the first."""

    def run(*args: Any, **kwargs: Any) -> Any:
        node = _second_graph(_graph_of(args))
        if node is not None:
            raise RuntimeError(f"planted at {node.name}")
        return original(*args, **kwargs)

    return run


def _planted_everywhere(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, failing on every graph at its first op."""

    def run(*args: Any, **kwargs: Any) -> Any:
        node = next(n for n in _graph_of(args).graph.nodes if n.op == "call_function")
        raise RuntimeError(f"planted at {node.op}")

    return run


def _failing_downstream(original: Callable[..., Any]) -> Callable[..., Any]:
    """``AmpBackend._downstream_for`` whose compile fails on the second graph (the fallback uses
    the backend's plain downstream, which still works)."""

    def downstream_for(self: AmpBackend, record: GraphRecord) -> Callable[..., Any]:
        return _planted(original(self, record))

    return downstream_for


# stage -> (object, attribute, wrapper of the original, compile options). fp8 fails on both graphs:
# with graph 0 in fp8, no torch.compile run is a reference for the model (test_fp8.py has fp8's).
_STAGES: dict[str, tuple[Any, str, Callable[..., Any], dict[str, Any]]] = {
    "prepare": (pipeline, "prepare", _planted, {}),
    "capture": (pipeline, "capture", _planted, {}),
    "insert_casts": (pipeline, "insert_casts", _planted, {}),
    "fp8_matmuls": (pipeline, "fp8_matmuls", _planted_everywhere, {"fp8": "tensorwise"}),
    "fold_casts": (pipeline, "fold_casts", _planted, {}),
    "watch_nonfinite": (pipeline, "watch_nonfinite", _planted, {"watch_nonfinite": True}),
    "module_names": (compiler.RootNames, "rename_module_stacks", _planted, {}),
    "traced_paths": (compiler, "report_traced_paths", _planted, {}),
    "splits": (SplitTracker, "report", _planted, {}),
    "downstream": (AmpBackend, "_downstream_for", _failing_downstream, {}),
    "downstream with the weight cache": (AmpBackend, "_downstream_for", _failing_downstream, {"weight_cache": True}),
    "run_wrapper": (AmpBackend, "_run_wrapper", _planted, {}),
}


def _plant(monkeypatch: pytest.MonkeyPatch, case: str) -> dict[str, Any]:
    owner, name, wrap, options = _STAGES[case]
    monkeypatch.setattr(owner, name, wrap(getattr(owner, name)))
    return options


@pytest.mark.slow_cases
@pytest.mark.parametrize("case", list(_STAGES))
def test_a_failing_stage_falls_back_to_torch_compile(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    expected = _torch_compile_reference()
    options = _plant(monkeypatch, case)
    stage = case.split(" ")[0]
    everywhere = _STAGES[case][2] is _planted_everywhere
    graph, cause, op = (
        (0, "RuntimeError: planted at call_function", "")
        if everywhere
        else (1, "RuntimeError: planted at sum_1", "%sum_1")
    )
    model, x = _model_and_input()
    compiled = amp_fx.compile(model, backend="aot_eager", strict=False, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = _run(compiled, model, x)
    assert_bitwise(actual, expected, f"amp_fx with {stage} failing on graph {graph}")

    stages = [r.fallback.stage if r.fallback is not None else None for r in compiled.amp_fx_records]
    assert stages == ([stage, stage] if everywhere else [None, stage])
    assert compiled.amp_fx_records[graph].fallback.cause == cause
    fell_back = [
        str(w.message)
        for w in caught
        if issubclass(w.category, AmpFxWarning) and "compiled as torch.compile under torch.autocast" in str(w.message)
    ]
    assert len(fell_back) == 1, fell_back
    message = fell_back[0]
    # module_names is what names modules under the root: failing, Dynamo's names are left
    module = "module 'a'" if everywhere else "module \"L['self'].b\"" if stage == "module_names" else "module 'b'"
    for part in (f"amp_fx: {stage} failed on graph {graph}", cause, f"(op: {op}", module):
        assert part in message, (part, message)
    others = [
        str(w.message) for w in caught if issubclass(w.category, AmpFxWarning) and str(w.message) not in fell_back
    ]
    # the weight cache says first that the lifted graph failed, then the graph falls back; fp8
    # that no matmul ran in fp8 (both graphs fell back)
    assert len(others) == (1 if options.get("weight_cache") or everywhere else 0), others

    strict = amp_fx.compile(_model_and_input()[0], backend="aot_eager", strict=True, **options)
    # with the weight cache, strict mode raises at its first shortfall: the lifted graph's failure
    first = (
        rf"the aot_eager backend failed on graph 1 with its weight casts lifted .*{cause}"
        if options.get("weight_cache")
        else rf"{stage} failed on graph {graph} .*{cause} \(op: {op}"
    )
    with pytest.raises(AmpFxError, match=rf"{first}.*\[strict mode") as raised:
        _run(strict, *_model_and_input())
    assert isinstance(raised.value.__cause__, RuntimeError) and str(raised.value.__cause__) == cause[14:]


def test_a_graph_that_falls_back_ignores_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``b`` kept in fp32 by the policy, amp_fx's values differ from torch.compile's; the
    graph of ``b`` falling back runs it as torch.compile does (bf16), graph 0 stays amp_fx's."""
    expected = _torch_compile_reference()
    model, x = _model_and_input()
    with_policy = _run(amp_fx.compile(model, backend="aot_eager", policy=Policy(keep_fp32=("b",))), model, x)
    with pytest.raises(AssertionError):  # the policy changes the values: the test below can fail
        assert_bitwise(with_policy, expected)

    _plant(monkeypatch, "fold_casts")
    model, x = _model_and_input()
    compiled = amp_fx.compile(model, backend="aot_eager", policy=Policy(keep_fp32=("b",)), strict=False)
    with pytest.warns(AmpFxWarning, match="fold_casts failed on graph 1"):
        actual = _run(compiled, model, x)
    assert_bitwise(actual, expected, "graph 1 fallen back")
    assert "fell back at" in compiled.amp_fx_summary()


def test_every_graph_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both graphs fail in capture: the whole model is torch.compile's, and the same failure is
    said once (the records say it per graph)."""
    expected = _torch_compile_reference()

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("planted")

    monkeypatch.setattr(pipeline, "capture", fails)
    model, x = _model_and_input()
    compiled = amp_fx.compile(model, backend="aot_eager", strict=False)
    with pytest.warns(AmpFxWarning) as caught:
        actual = _run(compiled, model, x)
    assert_bitwise(actual, expected, "both graphs fallen back")
    assert [r.fallback.stage for r in compiled.amp_fx_records] == ["capture", "capture"]
    assert len([w for w in caught if "failed on graph" in str(w.message)]) == 1


def test_the_dynamo_backend_falls_back_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile(backend="amp_fx")`` under torch.autocast: a graph amp_fx fails on runs as
    the downstream backend alone would run it."""
    expected = _torch_compile_reference()
    _plant(monkeypatch, "insert_casts")
    model, x = _model_and_input()
    compiled = torch.compile(model, backend="amp_fx", options={"backend": "aot_eager", "strict": False})
    with pytest.warns(AmpFxWarning, match="insert_casts failed on graph 1"):
        actual = _run(compiled, model, x)
    assert_bitwise(actual, expected, "amp_fx backend with a graph fallen back")


def test_inspection_tools_say_a_graph_fell_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """explain and compare run on a model whose second graph falls back, and say so for it."""
    monkeypatch.setenv("AMP_FX_STRICT", "0")  # the tools' private compile reads it
    _plant(monkeypatch, "fold_casts")
    model, x = _model_and_input()
    with pytest.warns(AmpFxWarning, match="fold_casts failed on graph 1"):
        explanation = amp_fx.explain(model, x)
    text = str(explanation)
    assert "graph 1: amp_fx's fold_casts failed on it at %sum_1" in text
    assert explanation.nodes(1) == [] and explanation.nodes(0)
    with pytest.warns(AmpFxWarning, match="fold_casts failed on graph 1"):
        report = amp_fx.compare(model, x)
    assert report.ok, str(report)
    assert any(n.startswith("graph 1 not compared op by op: amp_fx's fold_casts failed") for n in report.notes)


def test_a_refusal_by_design_does_not_fall_back() -> None:
    """An op the user's policy bans stays amp_fx's error (a refusal asked for, not a failure)."""
    policy = Policy(op_classes={"aten::matmul": CastClass.BANNED})
    compiled = amp_fx.compile(lambda x: x @ x, backend="aot_eager", policy=policy, strict=False)
    with pytest.raises(AmpFxError, match="aten.matmul is banned by your policy"):
        compiled(torch.randn(2, 2))


@pytest.mark.parametrize("case", ["plain", "fallback", "strict"])
def test_a_model_is_freed_after_a_fallback(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """A compiled model whose second graph fell back (or, strict, whose compile raised inside
    Dynamo) is freed once the caller drops it, as one without a fallback is (the twin, "plain"),
    with no ``torch._dynamo.reset()``: Dynamo keeps every backend it is handed for the process
    (and, where one raised, from C even after a reset), so amp_fx hands it a weak one. Its watch
    then leaves :func:`amp_fx.overflow.watched_models` (which GradScalers search)."""
    if case != "plain":
        _plant(monkeypatch, "fold_casts")

    def compile_and_run() -> weakref.ref[torch.nn.Module]:
        model, x = _model_and_input()
        compiled = amp_fx.compile(model, backend="aot_eager", strict=case == "strict", watch_nonfinite=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AmpFxWarning)
            if case == "strict":
                with pytest.raises(AmpFxError, match="fold_casts failed on graph 1"):
                    _run(compiled, model, x)
            else:
                _run(compiled, model, x)
        fell_back = {"plain": [False, False], "fallback": [False, True], "strict": [False]}[case]
        assert [r.fallback is not None for r in compiled.amp_fx_records] == fell_back
        assert any(m is model for m, _ in watched_models())
        return weakref.ref(model)

    model = compile_and_run()
    gc.collect()
    assert model() is None, f"the model ({case}) is alive after its last reference was dropped"
    assert watched_models() == []
