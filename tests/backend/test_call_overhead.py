"""The per-call path of a compiled model (issue 19, per-call overhead): its shortcuts must not skip a check.

amp_fx's call reads the tensors of a call without ``tree_flatten`` when the arguments are plain
tensors and scalars, remembers where the model's first parameter lives instead of walking every
submodule, and guards each graph's backward against double backward once, not on every call. Each
test here fails if a shortcut answered from stale or partial information: a fallback to eager on a
later call must still be reported, a model moved after its first call must be seen where it is, a
create_graph backward through any output must still raise amp_fx's error. Timings are in
``bench/bench_call_overhead.py``, not here.
"""

from __future__ import annotations

import collections
import sys
import warnings

import pytest
import torch
import torch._dynamo
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

import amp_fx
from amp_fx import AmpFxError, AmpFxWarning
from amp_fx.testing.zoo import MLP

BACKEND = "aot_eager"
_compile_module = sys.modules["amp_fx.backend.call"]  # where a compiled model's call runs


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def _no_graph_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, AmpFxWarning) and "captured and ran no graph" in str(w.message)
    ]


# --- "this call ran no graph" is checked on every call, not only the first ones -----------------


@pytest.mark.parametrize("good_calls", [1, 5])
def test_fallback_to_eager_after_good_calls_is_reported(good_calls: int) -> None:
    """Calls that ran graphs, then one Dynamo runs in eager (its recompile limit is reached by a
    new input shape): that call ran no graph and must be reported, however many calls went well
    before it. Its values are eager autocast's, bit for bit."""
    model = _mlp()
    compiled = amp_fx.compile(model, backend=BACKEND, strict=False, dynamic=False)
    x, wider = torch.randn(2, 16), torch.randn(3, 16)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(good_calls):
            compiled(x)
        assert _no_graph_warnings(caught) == []
        out = compiled(wider)
    assert len(_no_graph_warnings(caught)) == 1, [str(w.message) for w in caught]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(wider)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_fallback_to_eager_after_good_calls_raises_in_strict_mode() -> None:
    compiled = amp_fx.compile(_mlp(), backend=BACKEND, strict=True, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(3):
            compiled(torch.randn(2, 16))
        with pytest.raises(AmpFxError, match="captured and ran no graph"):
            compiled(torch.randn(3, 16))


# --- the tensors of a call: read directly, or through tree_flatten -------------------------------

_Pair = collections.namedtuple("_Pair", ["a", "b"])


def _calls() -> dict[str, tuple[tuple[object, ...], dict[str, object]]]:
    t = [torch.randn(2) for _ in range(4)]
    leaf = nn.Parameter(torch.randn(2))
    return {
        "tensors": ((t[0], t[1]), {}),
        "scalars_and_none": ((t[0], 3, 0.5, None, "s", True), {"k": t[1], "m": None}),
        "kwargs_order": ((), {"z": t[2], "a": t[0], "m": t[1]}),
        "parameter": ((leaf, t[0]), {}),
        "nested": (([t[0], (t[1], 2)],), {"d": {"q": t[2], "p": t[3]}}),
        "namedtuple": ((_Pair(t[1], t[0]),), {"x": t[2]}),
        "empty": ((), {}),
    }


@pytest.mark.parametrize("case", sorted(_calls()))
def test_call_tensors_are_tree_flattens_tensors_in_its_order(case: str) -> None:
    """The leaf pattern (which compiled callable runs) is read from these tensors in this order:
    the shortcut must give exactly what ``tree_flatten`` gives."""
    args, kwargs = _calls()[case]
    expected = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, Tensor)]
    actual = _compile_module._call_tensors(args, kwargs)
    assert [id(t) for t in actual] == [id(t) for t in expected]


# --- the model's device: remembered, and seen again when the model moves --------------------------


def _move_in_place(model: nn.Module) -> None:
    model.to("meta")  # the same Parameter objects, now on a device amp_fx has no policy for


def _replace_first_parameter(model: nn.Module) -> None:
    model.fc1.weight = nn.Parameter(torch.empty_like(model.fc1.weight, device="meta"))


@pytest.mark.parametrize("move", [_move_in_place, _replace_first_parameter])
def test_model_moved_after_its_first_call_is_seen_where_it_is(move: object) -> None:
    """With cpu inputs the autocast device comes from the model's first parameter. The shortcut
    remembers that tensor: moving it (same object) or replacing it (a new object) after the first
    call must be seen, here as the error for a device with no policy, the same error
    ``_module_device_type`` (the rule) gives."""
    model = _mlp()
    compiled = amp_fx.compile(model, backend=BACKEND)
    compiled(torch.randn(2, 16))
    move(model)  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"amp_fx: the model's tensors are on \['meta'\]"):
        _compile_module._module_device_type(model)
    with pytest.raises(ValueError, match=r"amp_fx: the model's tensors are on \['meta'\]"):
        compiled(torch.randn(2, 16))


def test_module_device_is_the_rules_answer() -> None:
    """The negative twin: an unmoved model, a model with only buffers, and one with neither."""
    for module in (_mlp(), nn.BatchNorm1d(4, affine=False), nn.ReLU()):
        device = _compile_module._ModuleDevice(module)
        for _ in range(2):  # the first call searches, the second reads what it remembered
            assert device() == _compile_module._module_device_type(module)


# --- double backward: one hook on the graph's node catches it through any output -----------------


class _TwoOutputs(nn.Module):
    """Two outputs of one graph, the second a view of an intermediate."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.fc(x)
        return torch.relu(h), h.t()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("through", [0, 1], ids=["first_output", "second_output_a_view"])
def test_double_backward_on_any_call_through_any_output_names_the_eager_backend(backend: str, through: int) -> None:
    """The guard is set up on the first call that needs a backward (the graph's Function class is
    wrapped once); later calls only look it up. A create_graph backward must raise amp_fx's error
    on the first call and on later ones, through either output; a plain backward must not."""
    torch.manual_seed(0)
    compiled = amp_fx.compile(_TwoOutputs(), backend=backend)
    for _ in range(2):
        loss = compiled(torch.randn(2, 8))[through].float().square().sum()
        with pytest.raises(AmpFxError, match="backend='eager'"):
            torch.autograd.grad(loss, list(compiled.parameters()), create_graph=True)
        compiled(torch.randn(2, 8))[through].float().square().sum().backward()


# --- the compiled module's own call skips nn.Module.__call__ only where that would only call forward


def _times_three_plus_one(out: Tensor) -> Tensor:
    return out * 3 + 1


@pytest.mark.parametrize("change", ["forward_hook", "forward_pre_hook", "instance_forward"])
def test_compiled_module_call_still_runs_what_nn_module_call_runs(change: str) -> None:
    """``AmpCompiledModule.__call__`` goes straight to amp_fx's call while nn.Module's call would
    only run ``forward``. A hook registered on the compiled module after its first call, or a
    ``forward`` set on the instance (accelerate wraps ``model.forward`` this way), must still run,
    as nn.Module runs them: bitwise the eager autocast output with the same change; removed, the
    plain output again."""
    model = _mlp()
    compiled = amp_fx.compile(model, backend=BACKEND)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(x)
        changed = model(_times_three_plus_one(x)) if change == "forward_pre_hook" else _times_three_plus_one(model(x))
    assert not torch.equal(plain, changed)
    torch.testing.assert_close(compiled(x), plain, atol=0, rtol=0)

    if change == "forward_hook":
        handle = compiled.register_forward_hook(lambda mod, args, out: _times_three_plus_one(out))
        undo = handle.remove
    elif change == "forward_pre_hook":
        handle = compiled.register_forward_pre_hook(lambda mod, args: (_times_three_plus_one(args[0]),))
        undo = handle.remove
    else:
        compiled_forward = compiled.forward
        compiled.forward = lambda inp: _times_three_plus_one(compiled_forward(inp))

        def undo() -> None:
            del compiled.forward

    torch.testing.assert_close(compiled(x), changed, atol=0, rtol=0)
    undo()
    torch.testing.assert_close(compiled(x), plain, atol=0, rtol=0)
