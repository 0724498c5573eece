"""Bad input gets a clear error that names the problem (the rest is in test_compile_api.py)."""

import pytest
import torch

import amp_fx
from amp_fx import Policy


def test_module_on_a_device_autocast_does_not_support():
    # "meta" is the one non-CPU device a CPU-only build can create; torch.autocast refuses it too.
    with pytest.raises(RuntimeError):
        torch.autocast("meta")
    model = torch.nn.Linear(4, 4).to("meta")
    with pytest.raises(ValueError, match=r"weight is on device meta.*'cpu' and 'cuda'"):
        amp_fx.compile(model)


def test_function_called_on_an_unsupported_device():
    fn = amp_fx.compile(lambda x: x @ x, backend="aot_eager")
    with pytest.raises(ValueError, match=r"\['meta'\].*'cpu' and 'cuda'"):
        fn(torch.empty(2, 2, device="meta"))


def test_keep_fp32_by_name_on_a_function():
    with pytest.raises(ValueError, match="is a function, not an nn.Module"):
        amp_fx.compile(lambda x: x, policy=Policy(keep_fp32=("fc",)))


def test_policy_of_the_wrong_type():
    with pytest.raises(TypeError, match="amp_fx.Policy"):
        amp_fx.compile(torch.nn.Linear(2, 2), policy={"keep_fp32": ("fc",)})


def test_inductor_mode_with_another_backend():
    with pytest.raises(ValueError, match="mode= and options= configure inductor"):
        amp_fx.compile(lambda x: x, backend="aot_eager", mode="max-autotune")


def test_a_failing_pass_is_named_with_the_passes_before_it(monkeypatch):
    from amp_fx.passes import fold_casts

    def broken(node):
        raise KeyError("planted")

    monkeypatch.setitem(fold_casts.RULES, "noop_cast", broken)
    model = amp_fx.compile(torch.nn.Linear(4, 4), backend="aot_eager")
    with pytest.raises(
        amp_fx.AmpFxError,
        match=r"fold_casts failed on graph 0 \(passes run before it: "
        r"capture, insert_casts\): KeyError: 'planted'",
    ):
        model(torch.randn(2, 4))


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda: amp_fx.compile(torch.nn.Linear), r"amp_fx.compile expects a model .* got the class Linear itself"),
        (lambda: amp_fx.compile(torch.nn.Linear, inplace=True), r"got the class Linear itself"),
        (lambda: amp_fx.compile_step(torch.nn.Linear, None, None), r"compile_step expects .* the class Linear"),
        (lambda: amp_fx.explain(torch.nn.Linear, torch.randn(2)), r"explain expects .* the class Linear"),
        (
            lambda: amp_fx.explain("model", torch.randn(2)),
            r"explain expects an nn.Module or a callable, got str \('model'\)",
        ),
        (lambda: amp_fx.compare(3, torch.randn(2)), r"compare expects an nn.Module or a callable, got int \(3\)"),
    ],
    ids=["compile-class", "inplace-class", "compile_step-class", "explain-class", "explain-str", "compare-int"],
)
def test_a_class_or_a_value_instead_of_a_model_is_named(call, says):
    """Not a model that "fails in eager mode" (explain's EagerError), nor accepted and called later."""
    with pytest.raises(TypeError, match=says):
        call()
