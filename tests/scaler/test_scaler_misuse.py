"""Every misuse torch.amp.GradScaler names raises the same exception from amp_fx.GradScaler.

Each scenario runs against torch's scaler and ours in the same test: the same call must raise
the same exception type with the same message (``torch/amp/grad_scaler.py`` is the list).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
import torch

from amp_fx.scaler import GradScaler

ScalerFactory = Callable[..., torch.amp.GradScaler]


def _setup(
    make: ScalerFactory, *, fused: bool = False, dtype: torch.dtype = torch.float32, backward: bool = True
) -> tuple[torch.amp.GradScaler, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(dtype)
    opt = (
        torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    scaler = make("cpu")
    if backward:
        scaler.scale(model(torch.ones(3, 4, dtype=dtype)).float().sum()).backward()
    return scaler, model, opt


def unscale_twice(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make)
    scaler.unscale_(opt)
    scaler.unscale_(opt)


def unscale_after_step(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make)
    scaler.step(opt)
    scaler.unscale_(opt)


def step_twice(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make)
    scaler.step(opt)
    scaler.step(opt)


def step_twice_fused(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make, fused=True)
    scaler.step(opt)
    scaler.step(opt)


def step_with_closure(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make)
    scaler.step(opt, closure=lambda: None)


def step_before_scale(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make, backward=False)
    scaler.step(opt)


def unscale_before_scale(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make, backward=False)
    scaler.unscale_(opt)


def update_before_scale(make: ScalerFactory) -> None:
    scaler, _, _ = _setup(make, backward=False)
    scaler.update()


def update_without_step(make: ScalerFactory) -> None:
    scaler, _, _ = _setup(make)
    scaler.update()


def update_twice(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make)
    scaler.step(opt)
    scaler.update()
    scaler.update()


def step_without_grads(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make)
    opt.zero_grad()
    scaler.step(opt)


def fused_step_without_grads_then_update(make: ScalerFactory) -> None:
    # torch: step() passes found_inf=0 to the optimizer, and update() finds no inf checks.
    scaler, _, opt = _setup(make, fused=True)
    opt.zero_grad()
    scaler.step(opt)
    scaler.update()


def fused_unscale_without_grads_then_step_update(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make, fused=True)
    opt.zero_grad()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def unscale_fp16_grads(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make, dtype=torch.float16)
    scaler.unscale_(opt)


def scale_a_float(make: ScalerFactory) -> None:
    make("cpu").scale(2.0)


def scale_a_list_holding_a_float(make: ScalerFactory) -> None:
    make("cpu").scale([torch.ones(()), 2.0])


def update_new_scale_two_elements(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make)
    scaler.step(opt)
    scaler.update(torch.ones(2))


def update_new_scale_requiring_grad(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make)
    scaler.step(opt)
    scaler.update(torch.ones((), requires_grad=True))


def update_new_scale_an_int(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make)
    scaler.step(opt)
    scaler.update(1024)  # type: ignore[arg-type]


def load_empty_state_dict(make: ScalerFactory) -> None:
    make("cpu").load_state_dict({})


def load_state_dict_without_scale(make: ScalerFactory) -> None:
    make("cpu").load_state_dict({"growth_factor": 2.0})


def pickle_mid_iteration(make: ScalerFactory) -> None:
    scaler, _, opt = _setup(make)
    scaler.unscale_(opt)
    pickle.dumps(scaler)


def growth_factor_one(make: ScalerFactory) -> None:
    make("cpu", growth_factor=1.0)


def backoff_factor_one(make: ScalerFactory) -> None:
    make("cpu", backoff_factor=1.0)


MISUSES = [
    unscale_twice,
    unscale_after_step,
    step_twice,
    step_twice_fused,
    step_with_closure,
    step_before_scale,
    unscale_before_scale,
    update_before_scale,
    update_without_step,
    update_twice,
    step_without_grads,
    fused_step_without_grads_then_update,
    fused_unscale_without_grads_then_step_update,
    unscale_fp16_grads,
    scale_a_float,
    scale_a_list_holding_a_float,
    update_new_scale_two_elements,
    update_new_scale_requiring_grad,
    update_new_scale_an_int,
    load_empty_state_dict,
    load_state_dict_without_scale,
    pickle_mid_iteration,
    growth_factor_one,
    backoff_factor_one,
]


def _raised(misuse: Callable[[ScalerFactory], None], make: ScalerFactory) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        misuse(make)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("misuse", MISUSES, ids=lambda f: f.__name__)
def test_misuse_raises_torchs_exception(misuse: Callable[[ScalerFactory], None]) -> None:
    expected = _raised(misuse, torch.amp.GradScaler)
    assert _raised(misuse, GradScaler) == expected
