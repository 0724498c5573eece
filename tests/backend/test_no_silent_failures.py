"""Issue 8, compile side: amp_fx does what it was asked, or says so (AmpFxWarning, strict: AmpFxError).

Each class of compile-side shortfall, in strict and non-strict mode; module names resolved by
identity under the root the user passed; Dynamo cache entries owned per compiled model.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from torch import Tensor, nn

import amp_fx
from amp_fx import AmpFxError, AmpFxWarning, CastClass, Policy
from amp_fx.passes import meta
from amp_fx.testing.zoo import MLP

BACKEND = "aot_eager"


class _NoGraph(nn.Module):
    """A forward Dynamo is told to skip: every call runs eagerly, no graph is captured."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @torch._dynamo.disable
    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


class _WithSpare(nn.Module):
    """A submodule that the forward never calls (a head used only in another mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


class _Vmapped(nn.Module):
    """A linear, then a submodule whose matmul runs under ``torch.vmap``: a functorch transform
    region, which amp_fx keeps whole and eager autocast casts (amp_fx/passes/capture.py)."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4) / 2)

        def forward(self, x: Tensor) -> Tensor:
            return torch.vmap(lambda row: row @ self.w)(x)

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = _Vmapped.Inner()

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(self.fc(x))


def _vmapped() -> nn.Module:
    torch.manual_seed(0)
    return _Vmapped()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


# One entry per class of compile-side warning: (what to compile, its policy, the message's key words).
SHORTFALLS: dict[str, tuple[Callable[[], nn.Module], Policy, str]] = {
    "no_graph": (_NoGraph, Policy(), "captured and ran no graph"),
    "keep_fp32_name": (_WithSpare, Policy(keep_fp32=("spare",)), r"keep_fp32=.*'spare' matched no op"),
    "keep_fp32_type": (_mlp, Policy(keep_fp32=(nn.LayerNorm,)), "LayerNorm matched no op"),
    "op_classes": (
        _mlp,
        Policy(op_classes={"aten.conv2d": CastClass.FP32}),
        r"'aten.conv2d' -> CastClass.FP32 matched no op",
    ),
    # the vmap'd matmul runs in the low dtype, as eager autocast runs it: the entry is not honoured there
    "keep_fp32_in_transform": (
        _vmapped,
        Policy(keep_fp32=("inner",)),
        r"keep_fp32=.*'inner' selects ops inside a functorch transform .* not kept in fp32",
    ),
    "op_classes_in_transform": (
        _vmapped,
        Policy(op_classes={"aten.mm": CastClass.FP32}),
        r"'aten.mm' -> CastClass.FP32 matched no op .*outside a functorch transform",
    ),
}


def _inputs(model: nn.Module) -> Tensor:
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return torch.randn(2, first.in_features)


@pytest.mark.parametrize("case", sorted(SHORTFALLS))
def test_strict_turns_each_compile_warning_into_an_error(case: str) -> None:
    factory, policy, message = SHORTFALLS[case]
    model = factory()
    x = _inputs(model)
    strict = amp_fx.compile(model, policy=policy, backend=BACKEND, strict=True)
    with pytest.raises(AmpFxError, match=message):
        strict(x)
    torch._dynamo.reset()
    from_env = amp_fx.compile(factory(), policy=policy, backend=BACKEND)  # AMP_FX_STRICT=1 (conftest)
    with pytest.raises(AmpFxError, match=message):
        from_env(x)


@pytest.mark.parametrize("case", sorted(SHORTFALLS))
def test_non_strict_warns_exactly_once(case: str) -> None:
    factory, policy, message = SHORTFALLS[case]
    model = factory()
    x = _inputs(model)
    compiled = amp_fx.compile(model, policy=policy, backend=BACKEND, strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            compiled(x)
    ours = [w for w in caught if issubclass(w.category, AmpFxWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert re.search(message, str(ours[0].message)), ours[0].message
    # The model still ran: the output is eager autocast's (no graph) or amp_fx's (policy no-op).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    torch.testing.assert_close(compiled(x), expected, atol=0, rtol=0)


def test_satisfied_policy_reports_nothing() -> None:
    """The negative twin: entries that match ops are not reported (strict mode would raise)."""
    model = _mlp()
    policy = Policy(keep_fp32=("fc2",), op_classes={"aten.linear": CastClass.LOWER_PRECISION_FP})
    compiled = amp_fx.compile(model, policy=policy, backend=BACKEND, strict=True)
    compiled(_inputs(model))
    assert compiled.amp_fx_records


def test_keep_fp32_outside_a_transform_region_reports_nothing() -> None:
    """The twin of keep_fp32_in_transform: an entry selecting the linear beside the vmap'd
    submodule is honoured (strict mode would raise), and keeps that linear in fp32."""
    model = _vmapped()
    compiled = amp_fx.compile(model, policy=Policy(keep_fp32=("fc",)), backend=BACKEND, strict=True)
    compiled(_inputs(model))
    linears = [
        n for r in compiled.amp_fx_records for n in r.rewritten.graph.nodes if n.target is torch.ops.aten.linear.default
    ]
    assert [n.meta["val"].dtype for n in linears] == [torch.float32]


def test_strict_must_be_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match="strict must be True, False or None"):
        amp_fx.compile(_mlp(), backend=BACKEND, strict="yes")  # type: ignore[arg-type]


# --- item 1: keep_fp32 names are names under the root, whatever frame Dynamo compiles ----------


class _Inner(nn.Module):
    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.graph_break = graph_break

    def forward(self, x: Tensor) -> Tensor:
        h = self.head(torch.relu(self.a(x)))
        if self.graph_break:
            torch._dynamo.graph_break()
        return h


class _Wrapper(nn.Module):
    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.model = _Inner(graph_break)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


def _eager_reference(model: _Wrapper, x: Tensor, dtype: torch.dtype) -> Tensor:
    """Eager autocast with model.head in fp32 (what keep_fp32=("model.head",) asks for)."""
    with torch.autocast("cpu", dtype=dtype):
        h = torch.relu(model.model.a(x))
        with torch.autocast("cpu", enabled=False):
            return model.model.head(h.float())


_WRAPPINGS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "graph_break_in_submodule": lambda m: m,
    "torch_compile": lambda m: torch.compile(m, backend="eager"),
    "amp_fx_compile": lambda m: amp_fx.compile(m, backend=BACKEND),
}


@pytest.mark.parametrize("wrapping", sorted(_WRAPPINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_keep_fp32_name_is_a_name_under_the_root(wrapping: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = _Wrapper(graph_break=wrapping == "graph_break_in_submodule")
    x = torch.randn(2, 8, requires_grad=True)
    expected = _eager_reference(model, x, dtype)
    policy = Policy(keep_fp32=("model.head",))
    compiled = amp_fx.compile(_WRAPPINGS[wrapping](model), dtype=dtype, policy=policy, backend=BACKEND, strict=True)
    out = compiled(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    # Every module path recorded is a name under the root (model.head, not head).
    kept = {
        n.meta[meta.DECISION].kept_module
        for r in compiled.amp_fx_records
        for n in r.rewritten.graph.nodes
        if meta.DECISION in n.meta
    }
    assert kept == {None, "model.head"}


class _ResumedInner(nn.Module):
    """An op (the matmul) that the submodule's own frame runs after its graph break, outside any
    child module: Dynamo records no module for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 4))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return h @ self.w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_keep_fp32_covers_ops_of_a_submodules_own_resumed_frame(dtype: torch.dtype) -> None:
    """keep_fp32=("model",) keeps the matmul the submodule runs itself after its graph break
    (its frame's ``self`` is the submodule): bitwise with eager autocast disabled in it."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("model", _ResumedInner())
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=dtype), torch.autocast("cpu", enabled=False):
        expected = model(x)
    compiled = amp_fx.compile(model, dtype=dtype, policy=Policy(keep_fp32=("model",)), backend=BACKEND, strict=True)
    out = compiled(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    # negative twin: without the entry the matmul runs in low precision
    plain = amp_fx.compile(model, dtype=dtype, backend=BACKEND, strict=True)
    assert plain(x).dtype == dtype


def test_frame_relative_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="'head'.*did you mean 'model.head'"):
        amp_fx.compile(_Wrapper(graph_break=True), backend=BACKEND, policy=Policy(keep_fp32=("head",)))


# --- item 2: each compiled model owns its Dynamo cache entries --------------------------------


def test_tenth_compiled_model_still_compiles() -> None:
    """Dynamo keeps 8 entries per code object: models compiled through one shared function ran
    uncompiled from the 9th on. Each model (and each function) now has its own."""
    x = torch.randn(2, 8)
    for i in range(10):
        model = _mlp()
        compiled = amp_fx.compile(model, backend="eager", strict=True)
        compiled(_inputs(model))
        assert len(compiled.amp_fx_records) == 1, f"model {i} captured no graph"

    def fn(x: Tensor) -> Tensor:
        return torch.mm(x, x.t())

    for i in range(10):
        compiled_fn = amp_fx.compile(fn, backend="eager", strict=True)
        assert compiled_fn(x).dtype == torch.bfloat16
        assert len(compiled_fn.amp_fx_records) == 1, f"function {i} captured no graph"


# --- item 3: a call that ran no graph names the way that works --------------------------------


def test_no_graph_message_names_the_working_form_for_ddp_and_fsdp() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from amp_fx.backend.audit import wrapper_fix as _wrapper_fix
    from amp_fx.testing.distributed import one_rank

    if not dist.is_available():
        pytest.skip("torch built without torch.distributed")
    with one_rank():
        ddp = DistributedDataParallel(_mlp())
        assert "DDP(amp_fx.compile(model))" in _wrapper_fix(ddp)
        from torch.distributed.fsdp import fully_shard

        sharded = fully_shard(_mlp())
        fix = _wrapper_fix(sharded)  # the FSDP2 pattern docs/distributed.md gives, not compile-then-shard
        assert "FSDP2-sharded" in fix and "fully_shard each block, then the root, then amp_fx.compile" in fix
        assert "before sharding" not in fix
        assert _wrapper_fix(_mlp()) is None


def test_hooks_still_run_and_hooked_models_own_their_entries_too() -> None:
    """Without hooks a model is compiled from a copy of its forward; with hooks, through a copy
    of ``self(*args)``: hooks run, as in eager, added before or after the first call."""
    x = torch.randn(2, 16)
    for i in range(10):
        model = _mlp()
        compiled = amp_fx.compile(model, backend="eager", strict=True)
        compiled(x)
        handle = model.register_forward_hook(lambda mod, args, out: out * 2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x)
        torch.testing.assert_close(compiled(x), expected, atol=0, rtol=0)
        assert len(compiled.amp_fx_records) == 2, f"hooked model {i} captured no graph"
        handle.remove()
