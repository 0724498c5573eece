"""torch.compile(model, backend="amp_fx"): the entry points, parity with amp_fx.compile and eager
autocast (bit for bit on aot_eager), module names, the policy and the warnings through that path."""

from __future__ import annotations

import copy
import importlib.metadata
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import amp_fx
import amp_fx.integrations.dynamo_backend as db
from amp_fx import AmpFxError, AmpFxWarning, Policy
from amp_fx.testing import assert_bitwise, zoo

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

GROUP = "torch_dynamo_backends"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
EAGER = {"backend": "aot_eager"}  # the backend on which amp_fx is bitwise with eager autocast


def _declared() -> dict[str, str]:
    return tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"][GROUP]


@pytest.fixture(autouse=True)
def _registered():
    """Make the declared entry points known to Dynamo as pip install would (an editable install of
    another checkout may declare none): Dynamo loads each EntryPoint object by its value string."""
    from torch._dynamo.backends import registry

    registry._lazy_import()
    for name, value in _declared().items():
        if registry._BACKENDS.get(name) is None and name not in registry._COMPILER_FNS:
            registry._BACKENDS[name] = importlib.metadata.EntryPoint(name=name, value=value, group=GROUP)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_entry_points_name_the_named_backends():
    declared = _declared()
    assert set(declared) == {"amp_fx", "amp_fx_bf16", "amp_fx_fp16"}
    loaded = {n: importlib.metadata.EntryPoint(name=n, value=v, group=GROUP).load() for n, v in declared.items()}
    assert {n: b.__name__ for n, b in loaded.items()} == {n: n for n in declared}
    assert loaded["amp_fx"].config.dtype is None  # the ambient autocast's, else bf16
    assert loaded["amp_fx_bf16"].config.dtype is torch.bfloat16
    assert loaded["amp_fx_fp16"].config.dtype is torch.float16
    for name in declared:
        assert torch._dynamo.lookup_backend(name) is loaded[name], name


def _installed_here() -> bool:
    eps = {e.name: e for e in importlib.metadata.entry_points(group=GROUP)}
    return "amp_fx" in eps and eps["amp_fx"].value == _declared()["amp_fx"]


def test_installed_distribution_declares_the_entry_points():
    if not _installed_here():
        pytest.skip(
            "the installed amp_fx distribution is another checkout's (no torch_dynamo_backends entry "
            "points); `pip install -e .` of this one declares them"
        )
    eps = {e.name: e.value for e in importlib.metadata.entry_points(group=GROUP) if e.name.startswith("amp_fx")}
    assert eps == _declared()


def _steps(build, compiled_by, *, dtype=torch.bfloat16, ambient=False):
    """(amp_fx path, eager autocast reference) after one forward+backward each, on copies."""
    model, inputs, loss = build()
    ours, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    ref = zoo.eager_autocast_step(ref_model, inputs, loss, dtype)
    run = compiled_by(ours)
    if ambient:
        with torch.autocast("cpu", dtype=dtype):
            out = run(*inputs)
            value = loss(out)
        value.backward()
        got = zoo._collect(ours, out, value)
    else:
        got = zoo.step(run, ours, inputs, loss)
    return got, ref


CASES = {
    "mlp": zoo.ZOO["mlp"].build,
    "tied_embedding": zoo.ZOO["tied_embedding"].build,
    "rmsnorm": zoo.ZOO["rmsnorm"].build,
    "cnn_bn": zoo.ZOO["cnn_bn"].build,
    "transformer_lm": zoo.transformer_lm,
}


@pytest.mark.slow_cases
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    ("name", "options", "dtype"),
    [
        ("amp_fx", EAGER, torch.bfloat16),
        ("amp_fx", {**EAGER, "dtype": "fp16"}, torch.float16),
        ("amp_fx_fp16", EAGER, torch.float16),
    ],
)
def test_bitwise_with_eager_autocast_and_amp_fx_compile(case, name, options, dtype):
    got, ref = _steps(CASES[case], lambda m: torch.compile(m, backend=name, options=dict(options)), dtype=dtype)
    assert_bitwise(got, ref, f"{name} {case}")
    torch._dynamo.reset()
    via_compile, _ = _steps(CASES[case], lambda m: amp_fx.compile(m, dtype=dtype, backend="aot_eager"), dtype=dtype)
    assert_bitwise(got, via_compile, f"{name} {case} vs amp_fx.compile")


def test_dtype_follows_the_ambient_autocast():
    got, ref = _steps(
        CASES["mlp"],
        lambda m: torch.compile(m, backend="amp_fx", options=dict(EAGER)),
        dtype=torch.float16,
        ambient=True,
    )
    assert got.out.dtype is torch.float16
    assert_bitwise(got, ref)


def test_in_place_module_compile():
    def in_place(m):
        m.compile(backend="amp_fx", options=dict(EAGER))
        return m

    got, ref = _steps(CASES["transformer_lm"], in_place)
    assert_bitwise(got, ref)


class _BreakInside(nn.Module):
    """A graph break inside a submodule: Dynamo compiles the submodule's frame on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        torch._dynamo.graph_break()
        return self.head(h).relu()


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = _BreakInside()
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.inner(x))


def _outer():
    return _Outer(), (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)),), zoo._sq_mean


@pytest.mark.parametrize("keep", ["inner.head", "out"])
def test_keep_fp32_names_are_under_the_compiled_module(keep):
    """A name in the submodule compiled after a graph break (inner.head) and one in the root's frame
    (out): kept in fp32 exactly as amp_fx.compile keeps them, and not what the default policy gives."""
    policy = Policy(keep_fp32=(keep,))
    with pytest.warns(AmpFxWarning, match="graph break"):  # outside autocast: said once
        got, _ = _steps(
            _outer, lambda m: torch.compile(m, backend="amp_fx", options={**EAGER, "policy": policy, "strict": False})
        )
    torch._dynamo.reset()
    via_compile, _ = _steps(_outer, lambda m: amp_fx.compile(m, policy=policy, backend="aot_eager"))
    torch._dynamo.reset()
    with pytest.warns(AmpFxWarning, match="graph break"):
        default, _ = _steps(_outer, lambda m: torch.compile(m, backend="amp_fx", options={**EAGER, "strict": False}))
    assert_bitwise(got, via_compile, keep)
    weight = f"{keep}.weight"
    assert not torch.equal(got.grads[weight], default.grads[weight]), "the policy changed nothing"
    if keep == "out":
        assert got.out.dtype is torch.float32 and default.out.dtype is torch.bfloat16


def test_records_and_split_warning_name_root_parameters():
    model, inputs, loss = zoo.ZOO["graph_break"].build()
    compiled = torch.compile(model, backend="amp_fx", options={**EAGER, "strict": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zoo.step(compiled, model, inputs, loss)
    messages = [str(w.message) for w in caught if issubclass(w.category, AmpFxWarning)]
    for name in zoo.ZOO["graph_break"].split_params:
        assert any(m.startswith(f"amp_fx: {name} is used on both sides of a graph break") for m in messages), messages
    assert any("outside torch.autocast" in m for m in messages), messages
    (backend,) = db.backend_of(compiled)
    assert len(backend.records) == 1 + zoo.ZOO["graph_break"].graph_breaks
    assert db.backend_of(model) == [backend]


def test_no_graph_break_warning_inside_autocast():
    model, inputs, _ = zoo.ZOO["graph_break_branch"].build()
    compiled = torch.compile(model, backend="amp_fx", options=dict(EAGER))  # strict: any report fails
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(*inputs)
    torch._dynamo.reset()
    with pytest.warns(AmpFxWarning, match="outside torch.autocast"):
        torch.compile(copy.deepcopy(model), backend="amp_fx", options={**EAGER, "strict": False})(*inputs)


def test_ambient_dtype_other_than_the_backends_is_reported():
    model, inputs, _ = zoo.ZOO["mlp"].build()
    compiled = torch.compile(model, backend="amp_fx_fp16", options={**EAGER, "strict": False})
    with pytest.warns(AmpFxWarning, match=r"torch.autocast\(dtype=bf16\) but the backend casts its graphs to fp16"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(*inputs)
    assert out.dtype is torch.float16


def test_unused_policy_entry_is_reported_once_and_strict_raises():
    model, inputs, _ = zoo.ZOO["mlp"].build()
    policy = Policy(op_classes={"aten::conv2d": amp_fx.CastClass.FP32})
    compiled = torch.compile(model, backend="amp_fx", options={**EAGER, "policy": policy, "strict": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(*inputs)
        compiled(*inputs)
    unused = [w for w in caught if "matched no op" in str(w.message)]
    assert len(unused) == 1 and "aten::conv2d" in str(unused[0].message)
    torch._dynamo.reset()
    strict = torch.compile(copy.deepcopy(model), backend="amp_fx", options={**EAGER, "policy": policy, "strict": True})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="matched no op") as info:
        strict(*inputs)
    assert isinstance(info.value.inner_exception, AmpFxError)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"dtyp": "fp16"}, r"unknown option\(s\) \['dtyp'\].*dtype:"),
        ({"dtype": "fp8"}, "unknown dtype 'fp8'"),
        ({"backend": "no_such_backend"}, "unknown backend 'no_such_backend'"),
        ({"policy": Policy(keep_fp32=("fc9",))}, "keep_fp32 names submodule 'fc9'"),
        ({"backend": "aot_eager", "inductor": {"max_autotune": True}}, "inductor options"),
    ],
)
def test_bad_options_raise_naming_the_problem(options, match):
    model, inputs, _ = zoo.ZOO["mlp"].build()
    with pytest.raises(Exception, match=match):
        torch.compile(model, backend="amp_fx", options=options)(*inputs)


def test_function_with_module_names_in_policy_raises():
    @torch.compile(backend="amp_fx", options={**EAGER, "policy": Policy(keep_fp32=("fc",))})
    def f(x, w):
        return x @ w

    with pytest.raises(Exception, match="no root module"):
        f(torch.randn(2, 2), torch.randn(2, 2))


def test_register_backend_gives_a_configuration_a_name():
    name = db.register_backend("amp_fx_test_fp16_aot", dtype="fp16", backend="aot_eager")
    got, ref = _steps(CASES["tied_embedding"], lambda m: torch.compile(m, backend=name), dtype=torch.float16)
    assert_bitwise(got, ref)
    with pytest.raises(ValueError, match="already exists"):
        db.register_backend(name, dtype="bf16")


def test_dynamo_reset_forgets_compiled_models():
    """torch._dynamo.reset() reaches the named backend (torch.compile's wrapper calls its reset()): the
    model compiled again gets fresh records and no stale split tracking."""
    model, inputs, _ = zoo.ZOO["mlp"].build()
    compiled = torch.compile(model, backend="amp_fx", options=dict(EAGER))
    compiled(*inputs)
    (first,) = db.backend_of(model)
    torch._dynamo.reset()
    assert db.backend_of(model) == []
    compiled(*inputs)
    (second,) = db.backend_of(model)
    assert second is not first and len(second.records) == len(first.records) == 1
