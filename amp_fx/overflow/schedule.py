"""Skip-aware LR scheduling: an LR scheduler that stands still on the steps the scaler skipped.

:func:`skip_aware` wraps a scheduler whose lr is a closed form of the epoch (LambdaLR, StepLR,
MultiStepLR, ExponentialLR, ConstantLR, LinearLR, CosineAnnealingLR, OneCycleLR): its epoch is a
device counter that counts only the steps that were not skipped, and the optimizer's lr a 0-dim
device tensor set to ``where(skipped, current, next)``, so no step reads the device on the host.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["skip_aware"]

_SUPPORTED_SCHEDULERS = (
    "LambdaLR",
    "StepLR",
    "MultiStepLR",
    "CosineAnnealingLR",
    "LinearLR",
    "OneCycleLR",
    "ExponentialLR",
    "ConstantLR",
    "MultiplicativeLR",
)


class _SkipAwareScheduler:
    """An LR scheduler that stands still on skipped steps, with no host read.

    Each ``step()`` computes the scheduler's next lr for every param group as if it advanced
    (``get_lr`` at ``last_epoch + 1``) and its current lr, both as device tensors, then sets the
    group's lr, a 0-dim float32 device tensor, to ``where(skipped, current, next)``. The epoch
    counter advances only where the step was not skipped: it lives on the device too
    (:attr:`epoch`), and the scheduler's own ``last_epoch`` (a Python int) counts calls.
    """

    def __init__(self, scheduler: Any, skipped: Any) -> None:
        self.scheduler = scheduler
        self._skipped = skipped
        opt = scheduler.optimizer
        device = _param_device(opt)
        self._device = device
        # A closed form in the epoch for each supported scheduler, as a function of a device epoch.
        self._lr_at = _closed_form(scheduler)
        self.epoch = torch.full((), scheduler.last_epoch, dtype=torch.float64, device=device)
        for group in opt.param_groups:
            lr = group["lr"]
            group["lr"] = (
                lr.detach().to(device=device, dtype=torch.float32)
                if isinstance(lr, torch.Tensor)
                else torch.tensor(float(lr), dtype=torch.float32, device=device)
            )

    def step(self) -> None:
        skipped = self._skipped().reshape(()).to(self._device)
        self.epoch.copy_(torch.where(skipped, self.epoch, self.epoch + 1))
        for i, (group, base) in enumerate(
            zip(self.scheduler.optimizer.param_groups, self.scheduler.base_lrs, strict=True)
        ):
            group["lr"].copy_(self._lr_at(self.epoch, i, base).to(torch.float32))
        self.scheduler.last_epoch += 1

    def get_last_lr(self) -> list[torch.Tensor]:
        return [g["lr"] for g in self.scheduler.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "epoch": self.epoch.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.epoch.copy_(state["epoch"])


def _param_device(opt: torch.optim.Optimizer) -> torch.device:
    for group in opt.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def _closed_form(s: Any) -> Any:
    """lr(epoch, base_lr) in device ops, for the schedulers whose lr is a closed form of the epoch."""
    name = type(s).__name__
    lr_sched = torch.optim.lr_scheduler
    if isinstance(s, lr_sched.LambdaLR):
        # The user's lambda is called with the device epoch (a float64 0-dim tensor): arithmetic
        # lambdas (``lambda e: 0.95 ** e``, ``lambda e: torch.clamp(e / 100, max=1)``) work; one
        # that branches on the value in Python (``min(1, e / 100)``) would read it on the host.
        lambdas = s.lr_lambdas
        return lambda e, i, base: base * torch.as_tensor(lambdas[i](e), dtype=torch.float64, device=e.device)
    if isinstance(s, lr_sched.StepLR):
        return lambda e, i, base: base * s.gamma ** torch.div(e, s.step_size, rounding_mode="floor")
    if isinstance(s, lr_sched.ExponentialLR):
        return lambda e, i, base: base * s.gamma**e
    if isinstance(s, lr_sched.CosineAnnealingLR):
        return lambda e, i, base: s.eta_min + (base - s.eta_min) * (1 + torch.cos(math.pi * e / s.T_max)) / 2
    if isinstance(s, lr_sched.LinearLR):

        def linear(e: torch.Tensor, i: int, base: float) -> torch.Tensor:
            frac = torch.clamp(e, max=s.total_iters) / s.total_iters
            return base * (s.start_factor + (s.end_factor - s.start_factor) * frac)

        return linear
    if isinstance(s, lr_sched.ConstantLR):
        return lambda e, i, base: base * torch.where(e < s.total_iters, s.factor, 1.0)
    if isinstance(s, lr_sched.MultiStepLR):
        milestones = sorted(s.milestones.elements())

        def multistep(e: torch.Tensor, i: int, base: float) -> torch.Tensor:
            passed = sum(((e >= m).to(torch.float64) for m in milestones), e.new_zeros((), dtype=torch.float64))
            return base * s.gamma**passed

        return multistep
    if isinstance(s, lr_sched.OneCycleLR):
        if s.cycle_momentum:
            raise TypeError(
                "amp_fx.skip_aware: OneCycleLR with cycle_momentum=True also schedules momentum, "
                "which skip_aware does not hold back; pass cycle_momentum=False"
            )
        return _one_cycle(s)
    raise TypeError(
        f"amp_fx.skip_aware: {name} is not supported; supported: {', '.join(_SUPPORTED_SCHEDULERS)} "
        "(schedulers whose lr is a closed form of the epoch). For others, read "
        "scaler.last_step_skipped yourself (a host read) before scheduler.step()"
    )


def _one_cycle(s: Any) -> Any:
    phases = s._schedule_phases
    anneal = (
        s._anneal_func_type
        if hasattr(s, "_anneal_func_type")
        else ("cos" if s.anneal_func.__name__ == "_annealing_cos" else "linear")
    )

    def interp(start: torch.Tensor, end: torch.Tensor, pct: torch.Tensor) -> torch.Tensor:
        if anneal == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def lr(e: torch.Tensor, i: int, base: float) -> torch.Tensor:
        group = s.optimizer.param_groups[i]
        result = torch.zeros((), dtype=torch.float64, device=e.device)
        start_step = 0.0
        done = torch.zeros((), dtype=torch.bool, device=e.device)
        for i, phase in enumerate(phases):
            end_step = float(phase["end_step"])
            here = ~done & ((e <= end_step) | torch.tensor(i == len(phases) - 1, device=e.device))
            pct = (e - start_step) / (end_step - start_step)
            value = interp(
                torch.tensor(float(group[phase["start_lr"]]), dtype=torch.float64, device=e.device),
                torch.tensor(float(group[phase["end_lr"]]), dtype=torch.float64, device=e.device),
                pct,
            )
            result = torch.where(here, value, result)
            done = done | here
            start_step = end_step
        return result

    return lr


def skip_aware(scheduler: Any, scaler: Any) -> _SkipAwareScheduler:
    """Wrap an LR scheduler so that it does not advance on a step the scaler skipped (no host read).

    ``scaler`` is an ``amp_fx.GradScaler`` or a ``CompiledStep`` (anything with a
    ``last_step_skipped`` 0-dim bool tensor). Call the wrapper's ``step()`` where you called the
    scheduler's, after ``scaler.update()`` (or after the compiled step). The optimizer's lr becomes
    a 0-dim float32 device tensor (every ``torch.optim`` optimizer takes one), set each step to
    ``where(skipped, current lr, next lr)``; the schedule's epoch is a device counter that counts
    only steps that were not skipped (the wrapper's ``epoch``).

    Supported: LambdaLR (lambdas that accept a tensor epoch), StepLR, MultiStepLR, ExponentialLR,
    ConstantLR, LinearLR, CosineAnnealingLR, OneCycleLR: their lr is a closed form of the epoch.
    Others (ReduceLROnPlateau, CyclicLR, SequentialLR, chained) raise TypeError.
    Without the wrapper, schedulers keep torch's behaviour: they advance on skipped steps too.
    """
    if not hasattr(scaler, "last_step_skipped"):
        raise TypeError(
            f"amp_fx.skip_aware: scaler must be an amp_fx.GradScaler or CompiledStep, got {type(scaler).__name__}"
        )
    return _SkipAwareScheduler(scheduler, lambda: scaler.last_step_skipped)
