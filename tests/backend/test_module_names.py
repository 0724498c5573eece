"""Module names survive a decorated ``forward`` (issue 30).

transformers 5.24 wraps ``LlamaForCausalLM.forward`` in ``deprecate_kwarg``, a ``functools.wraps``
wrapper taking ``*args, **kwargs``: Dynamo then reaches the root module as ``L['args'][0]``, and a
name read off that source's shape came out as ``0.model.layers.1.mlp``. Every name must be the
module's path under the compiled root (``named_modules()``), found from the module object.

The reference for each decorated variant is the same model without the decorator (whose names
Dynamo writes ``L['self'].model.layers[1].mlp``): the same module name for every op of every graph,
in the records, in ``explain`` and in the overflow report; ``Policy(keep_fp32=...)`` by name keeps
the same ops in fp32 with the same outputs, bit for bit (aot_eager).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.passes.capture import module_stack
from amp_fx.testing import assert_bitwise

WIDTH = 8
KEEP = "model.layers.1.mlp"


def renames_kwarg(old: str, new: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """transformers 5.24's ``deprecate_kwarg`` shape: ``wraps(func)`` over ``wrapped(*args, **kwargs)``."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapped

    return decorate


def with_self(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    return wrapper


class GainLinear(nn.Linear):
    """A Linear whose fp32 weight is multiplied by a buffer first (1.0, or large to plant an overflow)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.gain, self.bias)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = GainLinear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.mlp(x))


class Inner(nn.Module):
    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if self.graph_break:
            torch._dynamo.graph_break()
        x = x * 0.5  # Inner's own op: named "model" (the frame's own module after the break)
        return self.layers[1](x)


class DecoratedInner(Inner):
    @renames_kwarg("hidden", "x")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class Net(nn.Module):
    def __init__(self, inner: Inner) -> None:
        super().__init__()
        self.model = inner
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.model(x))


class ArgsNet(Net):
    @renames_kwarg("inputs", "x")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class SelfNet(Net):
    @with_self
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class StackedNet(Net):
    @renames_kwarg("inputs", "x")
    @renames_kwarg("features", "inputs")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class ClosureNet(Net):
    """The submodule reached through a closure cell: ``L['self']._run.__closure__[0].cell_contents``."""

    def __init__(self, inner: Inner) -> None:
        super().__init__(inner)
        model = self.model

        def run(x: torch.Tensor) -> torch.Tensor:
            return model(x)

        self._run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self._run(x))


VARIANTS: dict[str, Callable[[bool], Net]] = {
    "plain": lambda brk: Net(Inner(brk)),
    "args": lambda brk: ArgsNet(Inner(brk)),
    "self": lambda brk: SelfNet(Inner(brk)),
    "stacked": lambda brk: StackedNet(Inner(brk)),
    "closure": lambda brk: ClosureNet(Inner(brk)),
    "args_submodule": lambda brk: ArgsNet(DecoratedInner(brk)),
}
DECORATED = [v for v in VARIANTS if v != "plain"]


def _make(variant: str, graph_break: bool) -> Net:
    torch.manual_seed(0)
    return VARIANTS[variant](graph_break)


def _x() -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))


def _op_modules(compiled: Any) -> list[tuple[str, str]]:
    """(op, innermost module) of every op node of every captured graph, in capture order."""
    out = []
    for record in amp_fx.records(compiled):
        for node in record.rewritten.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                stack = module_stack(node)
                out.append((node.target.name(), stack[-1][0] if stack else ""))
    return out


@pytest.mark.slow_cases
@pytest.mark.parametrize("graph_break", [False, True], ids=["one_graph", "graph_break"])
@pytest.mark.parametrize("variant", DECORATED)
def test_records_name_modules_as_named_modules_does(variant, graph_break):
    results = {}
    for v in ("plain", variant):
        torch._dynamo.reset()
        model = _make(v, graph_break)
        compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager")
        compiled(_x())
        results[v] = _op_modules(compiled)
        names = dict(model.named_modules())
        assert all(m in names for _, m in results[v]), results[v]
    assert results[variant] == results["plain"]
    assert (torch.ops.aten.linear.default.name(), KEEP) in results["plain"]
    if graph_break:
        assert ("aten::mul.Tensor", "model") in results["plain"], results["plain"]


@pytest.mark.slow_cases
@pytest.mark.parametrize("graph_break", [False, True], ids=["one_graph", "graph_break"])
@pytest.mark.parametrize("variant", DECORATED)
def test_keep_fp32_by_name_matches_through_a_decorator(variant, graph_break):
    """strict (the suite's mode): an entry that matched no op would raise; the kept Linear runs in
    fp32, and the outputs and gradients equal the undecorated model's bit for bit."""
    policy = amp_fx.Policy(keep_fp32=(KEEP,))
    out = {}
    for v in ("plain", variant):
        torch._dynamo.reset()
        model = _make(v, graph_break)
        compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", policy=policy)
        y = compiled(_x())
        y.float().sum().backward()
        out[v] = (y, [p.grad for p in model.parameters()])
        kept = [
            n
            for r in amp_fx.records(compiled)
            for n in r.rewritten.graph.nodes
            if n.target is torch.ops.aten.linear.default and module_stack(n)[-1][0] == KEEP
        ]
        assert kept and all(n.meta["val"].dtype is torch.float32 for n in kept), kept
    assert_bitwise(out[variant], out["plain"], "(output, grads)")


@pytest.mark.parametrize("graph_break", [False, True], ids=["one_graph", "graph_break"])
def test_compile_step_names_modules_and_keeps_fp32_as_compile_does(graph_break):
    """``compile_step`` compiles a frame that runs the model, not the model: its graphs are named
    under the model by the same rule as ``amp_fx.compile(model)``'s (issue 52; the op-by-op module
    names were ``model.``-prefixed, or under a graph break the resumed submodule's own, and
    ``Policy(keep_fp32=...)`` by name raised "is a function"). The kept Linear runs in fp32 and one
    SGD step gives the parameters ``amp_fx.compile`` + the same loss + ``SGD.step`` gives, bit for
    bit; the loss's own ops (mean, and its backward) are the root's."""
    policy = amp_fx.Policy(keep_fp32=(KEEP,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).mean()

    model = _make("plain", graph_break)
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn(compiled(_x())).backward()
    opt.step()
    torch._dynamo.reset()
    stepped = _make("plain", graph_break)
    step = amp_fx.compile_step(
        stepped,
        torch.optim.SGD(stepped.parameters(), lr=0.5),
        loss_fn,
        dtype="bf16",
        backend="aot_eager",
        policy=policy,
    )
    step(_x())
    names = {m for _, m in _op_modules(compiled)}
    step_names = {m for _, m in _op_modules(step._forward)}
    assert step_names == names | {""}, (step_names, names)  # "": the loss, in the step's frame
    kept = [
        n
        for r in amp_fx.records(step._forward)
        for n in r.rewritten.graph.nodes
        if n.target is torch.ops.aten.linear.default and module_stack(n)[-1][0] == KEEP
    ]
    assert kept and all(n.meta["val"].dtype is torch.float32 for n in kept), kept
    assert_bitwise(list(stepped.parameters()), list(model.parameters()), "parameters after one step")


# Not "closure": explain runs a deep copy of the model, and a copied function keeps its closure
# cell, which still holds the original's submodule (not one of the copy's).
@pytest.mark.parametrize("variant", [v for v in DECORATED if v != "closure"])
def test_explain_names_modules_as_named_modules_does(variant):
    shown = {}
    for v in ("plain", variant):
        torch._dynamo.reset()
        explanation = amp_fx.explain(_make(v, False), _x(), dtype="bf16")
        shown[v] = [(n.op, n.module) for n in explanation.nodes() if n.kind == "op"]
    assert shown[variant] == shown["plain"]
    assert ("aten.linear", KEEP) in shown["plain"], shown["plain"]


def _planted_report(variant: str, backend: str) -> Any:
    """The overflow report of a step whose ``model.layers.1.mlp`` weight is planted (times 1e6:
    its fp16 cast overflows), GradScaler + ``amp_fx.compile(watch_nonfinite=True)``."""
    model = _make(variant, False)
    compiled = amp_fx.compile(model, dtype="fp16", backend=backend, watch_nonfinite=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = amp_fx.GradScaler("cpu", init_scale=2.0**8, step_mode=amp_fx.StepMode.MASKED)
    scaler.watch(compiled)
    model.model.layers[1].mlp.gain.fill_(1e6)
    scaler.scale(compiled(_x()).float().pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.overflow_report()


@pytest.mark.slow_cases
@pytest.mark.parametrize("variant", DECORATED)
def test_overflow_report_names_the_module_through_a_decorator(variant):
    reports = {}
    for v in ("plain", variant):
        torch._dynamo.reset()
        reports[v] = _planted_report(v, "aot_eager")
    assert reports["plain"] is not None and reports["plain"].first_op is not None
    assert reports["plain"].first_op.module == KEEP, str(reports["plain"])
    assert str(reports[variant]) == str(reports["plain"])


class MaskedNet(nn.Module):
    """A buffer holding +inf (a "never attend here" row subtracted from the scores) is module
    state, not the caller's data: its inf explains the -inf it makes (the watch does not name it),
    whether or not ``forward`` is decorated (data is told from state by identity, not by the
    source ``L['self']``). The planted overflow is in ``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("block", torch.zeros(WIDTH).index_fill(0, torch.tensor([0]), float("inf")))
        self.out = GainLinear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) - self.block.to(torch.float16)
        return self.out(F.softmax(scores, dim=-1))


class DecoratedMaskedNet(MaskedNet):
    @renames_kwarg("inputs", "x")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@pytest.mark.slow_cases
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_buffer_is_module_state_through_a_decorator(backend):
    reports = {}
    for cls in (MaskedNet, DecoratedMaskedNet):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = cls()
        compiled = amp_fx.compile(model, dtype="fp16", backend=backend, watch_nonfinite=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = amp_fx.GradScaler("cpu", init_scale=2.0**8, step_mode=amp_fx.StepMode.MASKED)
        scaler.watch(compiled)
        model.out.gain.fill_(1e6)  # the fp32 weight's fp16 cast overflows
        scaler.scale(compiled(_x()).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        reports[cls] = scaler.overflow_report()
    first = reports[MaskedNet].first_op
    assert first is not None and first.module == "out" and not first.backward, str(reports[MaskedNet])
    assert str(reports[DecoratedMaskedNet]) == str(reports[MaskedNet])
