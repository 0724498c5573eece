"""Conformance of amp_fx.GradScaler with torch.amp.GradScaler, bit for bit.

Every test runs our scaler and torch's (device="cpu") on the same inputs in the same test and
compares: values with ``assert_bitwise`` (same dtype, shape and bit pattern), errors by type
and message. Overflows are injected by planting inf/NaN in a gradient after backward.
"""

from __future__ import annotations

import copy
import functools
import io
import itertools
import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import amp_fx
from amp_fx.scaler import GradScaler, ScalerMode, StepMode
from amp_fx.testing import assert_bitwise

# ----------------------------------------------------------------------------- helpers


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def make_data(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


OptFactory = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptFactory] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "sgd_momentum_for_loop": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, foreach=False),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True, amsgrad=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adagrad_fused": lambda p: torch.optim.Adagrad(p, lr=0.05, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
}

Poison = dict[int, float]  # step -> value planted in a gradient (inf, -inf or nan)


def train_step(
    scaler: torch.amp.GradScaler,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    poison: float | None = None,
    clip: float | None = None,
) -> Any:
    opt.zero_grad()
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if poison is not None:
        model[0].weight.grad[1, 2] = poison
    if clip is not None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    ret = scaler.step(opt)
    scaler.update()
    return ret


def run_script(
    scaler: torch.amp.GradScaler,
    opt_name: str,
    n_steps: int,
    poison: Poison,
    clip_every: int = 0,
) -> dict[str, Any]:
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    history: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, batch in enumerate(make_data(n_steps)):
        clip = 0.5 if clip_every and i % clip_every == 0 else None
        train_step(scaler, model, opt, batch, poison.get(i), clip)
        history.append((scaler._scale.clone(), scaler._growth_tracker.clone()))
    return {
        "history": history,
        "params": [p.detach().clone() for p in model.parameters()],
        "opt_state": [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
            for p in model.parameters()
        ],
    }


# Three overflows in a row, a NaN, a -inf; with growth_interval 3 the scale also grows (the
# test checks that both happen). Step 0 is clean here: see the first-step tests.
SCRIPT_POISON: Poison = {
    1: float("inf"),
    5: float("nan"),
    6: float("inf"),
    7: float("inf"),
    15: float("-inf"),
}
SCRIPT_STEPS = 20


def _assert_script_exercises_rule(history: list[tuple[torch.Tensor, torch.Tensor]], init: float) -> None:
    scales = [init] + [s.item() for s, _ in history]
    grew = any(b > a for a, b in itertools.pairwise(scales))
    backed_off_in_a_row = any(scales[i + 2] < scales[i + 1] < scales[i] for i in range(len(scales) - 2))
    assert grew and backed_off_in_a_row, scales


# ----------------------------------------------------------------------------- scripted runs
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("step_mode", list(StepMode))
def test_scripted_run_bitwise(opt_name: str, step_mode: StepMode) -> None:
    ref = run_script(torch.amp.GradScaler("cpu", growth_interval=3), opt_name, SCRIPT_STEPS, SCRIPT_POISON)
    ours = run_script(
        GradScaler("cpu", growth_interval=3, step_mode=step_mode),
        opt_name,
        SCRIPT_STEPS,
        SCRIPT_POISON,
    )
    _assert_script_exercises_rule(ref["history"], 2.0**16)
    assert_bitwise(ours, ref)


@pytest.mark.parametrize("opt_name", sorted(set(OPTIMIZERS) - {"sgd_fused"}))
@pytest.mark.parametrize("step_mode", list(StepMode))
def test_first_step_overflow_bitwise(opt_name: str, step_mode: StepMode) -> None:
    # The optimizer creates its state on its first step; skipping that step must leave no
    # trace. (torch's fused SGD does leave one: see test_fused_sgd_first_step_overflow.)
    poison = {0: float("inf"), 1: float("nan"), 4: float("inf")}
    ref = run_script(torch.amp.GradScaler("cpu", growth_interval=3), opt_name, 8, poison)
    ours = run_script(GradScaler("cpu", growth_interval=3, step_mode=step_mode), opt_name, 8, poison)
    assert_bitwise(ours, ref)


@pytest.mark.parametrize("step_mode", list(StepMode))
def test_fused_sgd_first_step_overflow(step_mode: StepMode) -> None:
    """torch's fused SGD makes its momentum buffers with empty_like on the first step and
    skips writing them when found_inf is set, so a skipped first step leaves uninitialised
    memory in the buffer. Ours does not call the step: the run equals a torch run that
    starts one step later at the backed-off scale."""
    model = make_model()
    opt = OPTIMIZERS["sgd_fused"](model.parameters())
    ours = GradScaler("cpu", growth_interval=3, step_mode=step_mode)
    data = make_data(8)
    for i, batch in enumerate(data):
        train_step(ours, model, opt, batch, float("inf") if i == 0 else None)
        if i == 0:
            assert not opt.state[model[0].weight], "a skipped first step created state"

    ref_model = make_model()
    ref_opt = OPTIMIZERS["sgd_fused"](ref_model.parameters())
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**15, growth_interval=3)
    for batch in data[1:]:
        train_step(ref, ref_model, ref_opt, batch)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in ref_model.parameters()])
    assert_bitwise(ours._scale, ref._scale)

    # The torch bug itself, where the buffer's memory is not zero: it ends up in the state.
    torch_model = make_model()
    torch_opt = OPTIMIZERS["sgd_fused"](torch_model.parameters())
    train_step(torch.amp.GradScaler("cpu"), torch_model, torch_opt, data[0], float("inf"))
    assert torch_opt.state[torch_model[0].weight]["momentum_buffer"] is not None


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam", "adam_fused"])
@pytest.mark.parametrize("step_mode", list(StepMode))
def test_scripted_run_with_unscale_and_clip_bitwise(opt_name: str, step_mode: StepMode) -> None:
    # unscale_ + clip_grad_norm_ on every other step: the UNSCALED path of step(), including
    # the fused optimizers' "already unscaled" branch (grad_scale left unset).
    args: dict[str, Any] = {
        "n_steps": 12,
        "poison": {2: float("inf"), 3: float("nan")},
        "clip_every": 2,
    }
    ref = run_script(torch.amp.GradScaler("cpu", growth_interval=2), opt_name, **args)
    ours = run_script(GradScaler("cpu", growth_interval=2, step_mode=step_mode), opt_name, **args)
    assert_bitwise(ours, ref)


def test_inexact_inv_scale_matches_torch() -> None:
    # 1/3 is not a float: torch rounds the fp64 reciprocal to fp32; a fp32 division would
    # differ in the last bit for some gradients.
    grads = {}
    for cls in (torch.amp.GradScaler, GradScaler):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=3.0)
        x, y = make_data(1)[0]
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(opt)
        grads[cls] = [p.grad.clone() for p in model.parameters()]
    assert_bitwise(grads[GradScaler], grads[torch.amp.GradScaler])


def test_two_optimizers_one_overflowing_bitwise() -> None:
    results = []
    for scaler in (
        torch.amp.GradScaler("cpu", growth_interval=2),
        GradScaler("cpu", growth_interval=2),
    ):
        model = make_model()
        opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
        opt_b = torch.optim.Adam(model[2].parameters(), lr=0.01, fused=True)
        for i, (x, y) in enumerate(make_data(6)):
            opt_a.zero_grad()
            opt_b.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if i == 2:
                model[0].weight.grad[0, 0] = float("inf")  # only opt_a's gradients
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
        results.append(([p.detach().clone() for p in model.parameters()], scaler._scale.clone()))
    assert_bitwise(results[1], results[0])


# ----------------------------------------------------------------------------- lazy state
def test_lazy_state_before_and_after_first_scale() -> None:
    ref, ours = torch.amp.GradScaler("cpu", init_scale=1024.0), GradScaler("cpu", init_scale=1024.0)
    assert ours._scale is None and ref._scale is None
    assert ours._growth_tracker is None and ref._growth_tracker is None
    assert_bitwise(_torch_keys(ours.state_dict()), ref.state_dict())
    assert ours.get_scale() == ref.get_scale() == 1024.0
    out = torch.randn(3, dtype=torch.bfloat16)
    assert_bitwise(ours.scale(out), ref.scale(out))
    assert_bitwise(ours._scale, ref._scale)
    assert_bitwise(ours._growth_tracker, ref._growth_tracker)
    assert_bitwise(_torch_keys(ours.state_dict()), ref.state_dict())


def test_scale_of_nested_outputs_matches_torch() -> None:
    t = [torch.randn(2), (torch.randn(3), [torch.randn(1)])]
    ours, ref = GradScaler("cpu").scale(t), torch.amp.GradScaler("cpu").scale(t)
    assert_bitwise(ours, ref)
    gen_ours = GradScaler("cpu").scale(iter([torch.ones(2)]))
    gen_ref = torch.amp.GradScaler("cpu").scale(iter([torch.ones(2)]))
    assert_bitwise(list(gen_ours), list(gen_ref))
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        torch.amp.GradScaler("cpu").scale([1.0])
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        GradScaler("cpu").scale([1.0])


def test_is_a_torch_grad_scaler() -> None:
    assert isinstance(GradScaler("cpu"), torch.amp.GradScaler)


# ----------------------------------------------------------------------------- call orders
def _outcome(fn: Callable[[], Any]) -> tuple[type, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the exception itself is what is compared
        return type(e), str(e)
    return None


def _prepared(cls: type, **kw: Any) -> tuple[torch.amp.GradScaler, torch.optim.Optimizer, torch.nn.Module]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cls("cpu", **kw)
    x, y = make_data(1)[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    return scaler, opt, model


def _unscale_twice(s, o, m):
    s.unscale_(o)
    s.unscale_(o)


def _unscale_after_step(s, o, m):
    s.step(o)
    s.unscale_(o)


def _step_twice(s, o, m):
    s.step(o)
    s.step(o)


def _update_without_step(s, o, m):
    s.update()


def _closure(s, o, m):
    s.step(o, closure=lambda: None)


def _fp16_grad(s, o, m):
    b = m[0].bias
    b.data, b.grad = b.data.half(), b.grad.half()
    s.unscale_(o)


def _no_grads(s, o, m):
    o.zero_grad(set_to_none=True)
    s.step(o)


def _new_scale_int(s, o, m):
    s.step(o)
    s.update(1024)


def _new_scale_two_elements(s, o, m):
    s.update(torch.ones(2))


def _new_scale_requires_grad(s, o, m):
    s.update(torch.ones((), requires_grad=True))


def _new_scale_other_device(s, o, m):
    s.update(torch.ones((), device="meta"))


def _new_scale_tensor_ok(s, o, m):
    s.step(o)
    s.update(torch.tensor(7.0))
    assert s.get_scale() == 7.0


def _step_update_step_update(s, o, m):
    s.step(o)
    s.update()
    s.step(o)  # gradients are still there; a new iteration may step again
    s.update()


def _load_empty(s, o, m):
    s.load_state_dict({})


def _load_partial(s, o, m):
    s.load_state_dict({"scale": 2.0})


CALL_ORDERS = [
    _unscale_twice,
    _unscale_after_step,
    _step_twice,
    _update_without_step,
    _closure,
    _fp16_grad,
    _no_grads,
    _new_scale_int,
    _new_scale_two_elements,
    _new_scale_requires_grad,
    _new_scale_other_device,
    _new_scale_tensor_ok,
    _step_update_step_update,
    _load_empty,
    _load_partial,
]


# What torch does, so that a scenario that fails for an unrelated reason (and so "matches")
# is caught: the exception type each scenario must raise, None for none.
EXPECTED_ERROR: dict[Callable, type | None] = {
    _unscale_twice: RuntimeError,
    _unscale_after_step: RuntimeError,
    _step_twice: RuntimeError,
    _update_without_step: AssertionError,
    _closure: RuntimeError,
    _fp16_grad: ValueError,
    _no_grads: AssertionError,
    _new_scale_int: AttributeError,
    _new_scale_two_elements: AssertionError,
    _new_scale_requires_grad: AssertionError,
    _new_scale_other_device: AssertionError,
    _new_scale_tensor_ok: None,
    _step_update_step_update: None,
    _load_empty: RuntimeError,
    _load_partial: KeyError,
}


@pytest.mark.parametrize("scenario", CALL_ORDERS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("step_mode", list(StepMode))
def test_call_orders_match_torch(scenario: Callable, step_mode: StepMode) -> None:
    expected = _outcome(lambda: scenario(*_prepared(torch.amp.GradScaler)))
    assert (expected and expected[0]) is EXPECTED_ERROR[scenario], expected
    actual = _outcome(lambda: scenario(*_prepared(GradScaler, step_mode=step_mode)))
    assert actual == expected


@pytest.mark.parametrize("method", ["unscale_", "step", "update"])
def test_before_scale_matches_torch(method: str) -> None:
    opt = torch.optim.SGD(make_model().parameters(), lr=0.1)
    args = () if method == "update" else (opt,)
    expected = _outcome(lambda: getattr(torch.amp.GradScaler("cpu"), method)(*args))
    assert expected is not None
    assert _outcome(lambda: getattr(GradScaler("cpu"), method)(*args)) == expected


@pytest.mark.parametrize("kwargs", [{"growth_factor": 1.0}, {"backoff_factor": 1.0}])
def test_constructor_errors_match_torch(kwargs: dict[str, float]) -> None:
    expected = _outcome(lambda: torch.amp.GradScaler("cpu", **kwargs))
    assert expected is not None
    assert _outcome(lambda: GradScaler("cpu", **kwargs)) == expected


def test_constructor_rejects_bad_options() -> None:
    with pytest.raises(TypeError, match="ScalerMode"):
        GradScaler("cpu", mode="check_only")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="StepMode"):
        GradScaler("cpu", step_mode="masked")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hysteresis"):
        GradScaler("cpu", hysteresis=0)
    with pytest.raises(ValueError, match="min_scale"):
        GradScaler("cpu", min_scale=-1.0)
    with pytest.raises(ValueError, match="max_scale"):
        GradScaler("cpu", max_scale=float("inf"))
    with pytest.raises(ValueError, match="init_scale"):
        GradScaler("cpu", init_scale=4.0, min_scale=8.0)
    with pytest.raises(TypeError):
        GradScaler("cpu", 2.0**16, 2.0, 0.5, 2000, True, StepMode.MASKED)  # type: ignore[misc]


# ----------------------------------------------------------------------------- bad inputs
def _grad_outcome(cls: type, setup: Callable[[torch.nn.Module], None], **kw: Any) -> Any:
    """Run one step with gradients rearranged by ``setup``; outcome and resulting params."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = cls("cpu", **kw)
    x, y = make_data(1)[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    setup(model)
    err = _outcome(lambda: (scaler.step(opt), scaler.update()))
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return err, [p.detach().clone() for p in model.parameters()], grads, scaler._scale.clone()


def _non_contiguous(model: torch.nn.Module) -> None:
    w = model[0].weight
    g = torch.empty(w.shape[::-1]).t()  # same shape, transposed strides
    g.copy_(w.grad)
    g[0, 1] = float("inf")
    w.grad = g
    assert not w.grad.is_contiguous()


def _non_contiguous_finite(model: torch.nn.Module) -> None:
    w = model[2].weight
    g = torch.empty(w.shape[::-1]).t()
    g.copy_(w.grad)
    w.grad = g


def _some_grads_none(model: torch.nn.Module) -> None:
    model[0].weight.grad = None
    model[2].bias.grad = None


def _bf16_grad(model: torch.nn.Module) -> None:
    b = model[0].bias
    b.data, b.grad = b.data.bfloat16(), b.grad.bfloat16()  # torch refuses only fp16


def _double_grad_with_nan(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.data = p.data.double()
        p.grad = p.grad.double()
    model[0].bias.grad[0] = float("nan")


BAD_GRADS = [
    _non_contiguous,
    _non_contiguous_finite,
    _some_grads_none,
    _bf16_grad,
    _double_grad_with_nan,
]


@pytest.mark.parametrize("setup", BAD_GRADS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("step_mode", list(StepMode))
def test_unusual_gradients_match_torch(setup: Callable, step_mode: StepMode) -> None:
    expected = _grad_outcome(torch.amp.GradScaler, setup)
    assert_bitwise(_grad_outcome(GradScaler, setup, step_mode=step_mode), expected)


@pytest.mark.parametrize("poison", [None, float("inf")])
@pytest.mark.parametrize("step_mode", list(StepMode))
def test_sparse_gradients_match_torch(poison: float | None, step_mode: StepMode) -> None:
    results = []
    for scaler in (torch.amp.GradScaler("cpu"), GradScaler("cpu", step_mode=step_mode)):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        loss = emb(torch.tensor([1, 4, 4, 7])).square().sum()
        scaler.scale(loss).backward()
        assert emb.weight.grad.is_sparse
        if poison is not None:
            emb.weight.grad = emb.weight.grad.coalesce()
            emb.weight.grad._values()[0, 0] = poison
        scaler.step(opt)
        scaler.update()
        results.append((emb.weight.detach().clone(), scaler._scale.clone()))
    assert_bitwise(results[1], results[0])


def test_mixed_devices_error_like_torch() -> None:
    # Gradients on two devices: the CPU machine has "meta" as a second device. torch unscales
    # per device and fails when it reads the meta flag; ours must fail too, never step.
    def run(scaler: torch.amp.GradScaler) -> tuple[Any, torch.Tensor]:
        a = torch.nn.Parameter(torch.ones(3))
        b = torch.nn.Parameter(torch.ones(3, device="meta"))
        a.grad, b.grad = torch.full((3,), 2.0), torch.ones(3, device="meta")
        opt = torch.optim.SGD([a, b], lr=0.1)
        scaler.scale(torch.ones(()))
        return _outcome(lambda: scaler.step(opt)), a.detach().clone()

    expected = run(torch.amp.GradScaler("cpu"))
    assert expected[0] is not None
    assert_bitwise(run(GradScaler("cpu")), expected)
    err, a = run(GradScaler("cpu", step_mode=StepMode.MASKED))
    assert err is not None and issubclass(err[0], (RuntimeError, NotImplementedError))
    assert_bitwise(a, expected[1])


def test_empty_param_group_list_matches_torch() -> None:
    # An optimizer over parameters that never get gradients: step() has nothing to check.
    p = torch.nn.Parameter(torch.ones(2))
    outcomes = []
    for scaler in (
        torch.amp.GradScaler("cpu"),
        GradScaler("cpu"),
        GradScaler("cpu", step_mode=StepMode.MASKED),
    ):
        scaler.scale(torch.ones(()))
        outcomes.append(_outcome(functools.partial(scaler.step, torch.optim.SGD([p], lr=0.1))))
    assert outcomes[0] is not None and outcomes[1] == outcomes[0] == outcomes[2]


# ----------------------------------------------------------------------------- update(new_scale)
@pytest.mark.parametrize(
    "new_scale",
    [512.0, torch.tensor(3.0), torch.tensor([5.0]), torch.tensor(6.0, dtype=torch.float64)],
)
def test_update_new_scale_matches_torch(new_scale: float | torch.Tensor) -> None:
    # torch.tensor([5.0]) passes torch's checks and then fails to copy into the 0-dim scale.
    out = []
    for scaler in (
        torch.amp.GradScaler("cpu", growth_interval=1),
        GradScaler("cpu", growth_interval=1),
    ):
        stepped = _prepared_pair_step(scaler)
        err = _outcome(functools.partial(scaler.update, new_scale))
        out.append((err, scaler._scale.clone(), scaler._growth_tracker.clone(), stepped))
    assert_bitwise(out[1], out[0])


def _prepared_pair_step(scaler: torch.amp.GradScaler) -> torch.Tensor:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data(1)[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    return model[0].weight.detach().clone()


# ----------------------------------------------------------------------------- state_dict
def _torch_keys(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sd.items() if k != "amp_fx"}


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dict_round_trip_mid_run(opt_name: str, direction: str) -> None:
    """Train 9 steps with one scaler, move scaler, model and optimizer state to the other
    kind of scaler, train 9 more: bitwise the same as 18 steps with torch's scaler alone."""
    poison = {1: float("inf"), 2: float("inf"), 10: float("nan"), 11: float("inf")}
    data = make_data(18)

    def run(first: torch.amp.GradScaler, second: torch.amp.GradScaler | None) -> Any:
        model = make_model()
        opt = OPTIMIZERS[opt_name](model.parameters())
        scaler = first
        for i, batch in enumerate(data):
            if i == 9 and second is not None:
                sd = scaler.state_dict()
                buf = io.BytesIO()
                torch.save(sd, buf)  # the dict must survive a weights_only checkpoint
                buf.seek(0)
                second.load_state_dict(torch.load(buf, weights_only=True))
                opt_sd = copy.deepcopy(opt.state_dict())
                opt = OPTIMIZERS[opt_name](model.parameters())
                opt.load_state_dict(opt_sd)
                scaler = second
            train_step(scaler, model, opt, batch, poison.get(i))
        return (
            [p.detach().clone() for p in model.parameters()],
            scaler._scale.clone(),
            scaler._growth_tracker.clone(),
        )

    ref = run(torch.amp.GradScaler("cpu", growth_interval=3), None)
    if direction == "ours_to_torch":
        got = run(GradScaler("cpu", growth_interval=3), torch.amp.GradScaler("cpu"))
    else:
        got = run(torch.amp.GradScaler("cpu", growth_interval=3), GradScaler("cpu"))
    assert_bitwise(got, ref)


def test_state_dict_keys_and_values_match_torch() -> None:
    ref, ours = torch.amp.GradScaler("cpu", 8.0, 3.0, 0.25, 7), GradScaler("cpu", 8.0, 3.0, 0.25, 7)
    for scaler in (ref, ours):
        _prepared_pair_step(scaler)
        scaler.update()
    sd = ours.state_dict()
    assert_bitwise(_torch_keys(sd), ref.state_dict())
    assert set(sd) == set(ref.state_dict()) | {"amp_fx"}
    assert sd["amp_fx"]["skipped_steps"] == 0


def test_state_dict_extras_round_trip() -> None:
    src = GradScaler("cpu", growth_interval=100, min_scale=2.0, max_scale=2.0**20, hysteresis=3)
    src.scale(torch.ones(()))
    src._skipped_steps.fill_(5)
    src._hysteresis_tracker.fill_(1)
    dst = GradScaler("cpu")
    dst.load_state_dict(src.state_dict())
    assert dst.state_dict() == src.state_dict()
    dst.scale(torch.ones(()))  # lazily created tensors take the loaded values
    assert int(dst.skipped_steps) == 5 and int(dst._hysteresis_tracker) == 1
    # A torch state_dict has no extras: counters start afresh, bounds stay ours.
    dst.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    assert int(dst.skipped_steps) == 0 and int(dst._hysteresis_tracker) == 3
    assert dst.state_dict()["amp_fx"]["min_scale"] == 2.0


def test_pickle_matches_torch() -> None:
    out = []
    for scaler in (
        torch.amp.GradScaler("cpu", growth_interval=1),
        GradScaler("cpu", growth_interval=1),
    ):
        _prepared_pair_step(scaler)
        with pytest.raises(AssertionError, match="may only be pickled"):
            pickle.dumps(scaler)
        scaler.update()
        clone = pickle.loads(pickle.dumps(scaler))
        assert clone._scale is None
        out.append(_torch_keys(clone.state_dict()))
    assert_bitwise(out[1], out[0])


# ----------------------------------------------------------------------------- disabled
def test_disabled_is_a_no_op_like_torch() -> None:
    for cls in (torch.amp.GradScaler, GradScaler):
        scaler = cls("cpu", enabled=False)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = make_data(1)[0]
        loss = torch.nn.functional.mse_loss(model(x), y)
        assert scaler.scale(loss) is loss
        loss.backward()
        before = model[0].weight.detach().clone()
        scaler.unscale_(opt)
        assert scaler.step(opt) is None
        assert not torch.equal(before, model[0].weight)  # it stepped
        scaler.update()
        assert scaler.state_dict() == {}
        scaler.load_state_dict({})
        assert scaler.get_scale() == 1.0 and not scaler.is_enabled()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for machines without CUDA")
def test_cuda_without_cuda_warns_naming_the_cpu_scaler_and_disables_like_torch() -> None:
    """torch's scaler says only "Disabling."; ours names GradScaler('cpu') at the caller's line, is
    an error in strict mode, and says nothing where the scaler is meant to be off."""
    ref = torch.amp.GradScaler()
    with warnings.catch_warnings(record=True) as our_w:
        warnings.simplefilter("always")
        ours = GradScaler(strict=False)
        GradScaler(enabled=False, strict=False)
    assert [(w.category, w.filename) for w in our_w] == [(amp_fx.AmpFxWarning, __file__)]
    assert "GradScaler('cpu')" in str(our_w[0].message)
    assert ours.is_enabled() is ref.is_enabled() is False
    with pytest.raises(amp_fx.AmpFxError, match=r"GradScaler\('cpu'\)"):
        GradScaler(strict=True)


def test_getters_and_setters_match_torch() -> None:
    ref, ours = torch.amp.GradScaler("cpu"), GradScaler("cpu")
    for scaler in (ref, ours):
        scaler.set_growth_factor(3.0)
        scaler.set_backoff_factor(0.125)
        scaler.set_growth_interval(11)
    for name in (
        "get_growth_factor",
        "get_backoff_factor",
        "get_growth_interval",
        "get_scale",
        "is_enabled",
    ):
        assert_bitwise(getattr(ours, name)(), getattr(ref, name)(), name)


def test_setters_take_effect_in_update_like_torch() -> None:
    out = []
    for scaler in (torch.amp.GradScaler("cpu"), GradScaler("cpu")):
        _prepared_pair_step(scaler)
        scaler.set_growth_interval(1)
        scaler.set_growth_factor(3.0)
        scaler.update()
        out.append(scaler._scale.clone())
    assert_bitwise(out[1], out[0])


@contextmanager
def _no_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_default_mode_enum_values() -> None:
    with _no_warnings():
        scaler = GradScaler("cpu")
    assert scaler.mode is ScalerMode.DYNAMIC and scaler.step_mode is StepMode.HOST_SYNC
