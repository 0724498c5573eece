"""advise with ``optimizer=`` and ``steps=``, the training comparison: ``steps`` training steps on the
example inputs from one initial state, in fp32, with the default policy and with the advised one
(fp16 with ``torch.amp.GradScaler``), and how far each loss curve strays from fp32's."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from amp_fx.fp8 import Fp8Config
from amp_fx.inspect._fp8_eager import module_stack
from amp_fx.inspect._runner import SEED, Call, private_copy
from amp_fx.inspect.advice._measure import fp8_mode, keep_in_fp32

__all__: list[str] = []


@dataclass(frozen=True)
class TrainingComparison:
    """Losses over ``steps`` training steps from one initial state, fp32 against each policy."""

    steps: int
    fp32: tuple[float, ...]
    default: tuple[float, ...]
    advised: tuple[float, ...]

    @staticmethod
    def _divergence(curve: Sequence[float], ref: Sequence[float]) -> float:
        worst = 0.0
        for a, b in zip(curve, ref):
            if not math.isfinite(a):
                return math.inf
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
        return worst

    @property
    def default_divergence(self) -> float:
        """max over steps of |loss - fp32 loss| / |fp32 loss| with the default policy."""
        return self._divergence(self.default, self.fp32)

    @property
    def advised_divergence(self) -> float:
        return self._divergence(self.advised, self.fp32)


def compare_training(
    model: Any,
    call: Call,
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: Any,
    steps: int,
    *,
    dtype: torch.dtype,
    device_type: str,
    keep: tuple[str, ...],
    fp8: Fp8Config | None,
) -> TrainingComparison:
    """The three loss curves: fp32, the default policy (``keep=()``) and the advised one."""
    curves = [
        _train(
            model,
            call,
            loss_fn,
            optimizer,
            steps,
            dtype=d,
            device_type=device_type,
            keep=k,
            fp8=fp8 if d is not None else None,
        )
        for d, k in ((None, ()), (dtype, ()), (dtype, keep))
    ]
    return TrainingComparison(steps, *curves)


def _make_optimizer(optimizer: Any, params: Any) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer)(params, **optimizer.defaults)
    if callable(optimizer):
        opt = optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"amp_fx.advise: optimizer(params) must return a torch.optim.Optimizer, got {type(opt).__name__}"
            )
        return opt
    raise TypeError(
        "amp_fx.advise: optimizer must be a torch.optim.Optimizer (rebuilt from its "
        f"class and defaults on each copy) or a callable params -> Optimizer, got {optimizer!r}"
    )


def _train(
    model: Any,
    call: Call,
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: Any,
    steps: int,
    *,
    dtype: torch.dtype | None,
    device_type: str,
    keep: tuple[str, ...],
    fp8: Fp8Config | None = None,
) -> tuple[float, ...]:
    m = private_copy(model)
    stack: list[str] = []
    if dtype is not None and fp8 is None:
        keep_in_fp32(m, keep, device_type)
    opt = _make_optimizer(optimizer, m.parameters())
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    losses = []
    with torch.random.fork_rng(devices=[]), module_stack(m, stack):
        torch.manual_seed(SEED)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with (
                torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None),
                fp8_mode(fp8, dtype or torch.bfloat16, device_type, stack, keep, measure=False),
            ):
                loss = loss_fn(call.copy()(m))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    return tuple(losses)
