"""The loss-scale rules, on tensors only: the one implementation that ``GradScaler`` and
``compile_step`` both call.

Everything here reads and writes 0-dim device tensors and never a value on the host, so the
same functions run eagerly (``GradScaler``) and inside a ``torch.compile(fullgraph=True)`` graph
(``compile_step``'s finish). Which scaler they belong to is carried by two records:

* :class:`ScaleRule`: the configuration (growth/back-off factors, interval, bounds, hysteresis,
  mode), plain Python numbers;
* :class:`ScaleState`: the device tensors (scale, growth tracker, hysteresis tracker, skip
  counter, last flag).

``GradScaler.loss_scale_state(device)`` hands out both.

:func:`combine_found_inf` is the one place where per-device (and, later, per-rank) found-inf
flags become the flag that decides a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import amp_fx.kernels.scale_update  # noqa: F401  (registers torch.ops.amp_fx.update_scale_)

__all__ = ["ScaleRule", "ScaleState", "combine_found_inf", "inv_scale_and_guard", "update_scale_", "record_step_"]


@dataclass(frozen=True)
class ScaleRule:
    """A scaler's update rule (``torch.ops.amp_fx.update_scale_``'s arguments) and mode.

    ``dynamic`` False is ``ScalerMode.CHECK_ONLY``: the scale is 1.0 and never updated.
    ``min_scale`` 0.0 and ``max_scale`` inf mean no bound.
    """

    dynamic: bool
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float
    max_scale: float
    hysteresis: int
    consecutive_hysteresis: bool


@dataclass(frozen=True)
class ScaleState:
    """A scaler's device state: 0-dim tensors on one device, updated in place."""

    scale: torch.Tensor  # float32
    growth_tracker: torch.Tensor  # int32
    hysteresis_tracker: torch.Tensor  # int32
    skipped_steps: torch.Tensor  # int64
    last_found_inf: torch.Tensor  # float32, 0.0 or 1.0


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A non_blocking device-to-host copy returns before the data lands, and the CPU op that
    # reads it next would race with it; only copies to an accelerator may be asynchronous.
    return t.to(device=device, non_blocking=device.type != "cpu", copy=True)


def combine_found_inf(flags: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The flag that decides a step, from the per-device flags, as a new tensor on ``device``.

    Combined with max, not sum: the result stays exactly 0.0 or 1.0. torch sums them; with
    grads on two devices that can give 2.0, which fused optimizer kernels (they skip only when
    found_inf == 1.0) would not treat as a skip. ``flags`` must not be empty.
    """
    combined = _to_device(flags[0], device)  # a copy: the per-device flags stay as they are
    for f in flags[1:]:
        combined = torch.maximum(combined, f if f.device == device else _to_device(f, device))
    return combined


def inv_scale_and_guard(scale: torch.Tensor, *, dynamic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``inv_scale`` as torch computes it, and a new found_inf set to "inv_scale is not finite".

    A collapsed scale (0, or a float32 denormal whose reciprocal overflows) then skips the step:
    torch's kernel checks the scaled gradient before multiplying, so ``0 * inf = NaN`` would pass.
    Check-only (``dynamic`` False): inv_scale 1.0 and a clear flag.
    """
    if not dynamic:
        one = torch.ones((), dtype=torch.float32, device=scale.device)
        return one, torch.zeros((), dtype=torch.float32, device=scale.device)
    # FP32 division can be imprecise for certain compile options, so torch carries out the
    # reciprocal in FP64 (not on MPS, which has no FP64).
    if scale.device.type != "mps":
        inv_scale = scale.double().reciprocal().float()
    else:
        inv_scale = scale.reciprocal()
    found_inf = (~torch.isfinite(inv_scale)).to(torch.float32)
    return inv_scale, found_inf


def update_scale_(state: ScaleState, rule: ScaleRule, found_inf: torch.Tensor) -> None:
    """Back off or grow the scale from this step's flag (no-op in check-only mode)."""
    if not rule.dynamic:
        return
    torch.ops.amp_fx.update_scale_(
        state.scale,
        state.growth_tracker,
        state.hysteresis_tracker,
        found_inf,
        rule.growth_factor,
        rule.backoff_factor,
        rule.growth_interval,
        rule.min_scale,
        rule.max_scale,
        rule.hysteresis,
        rule.consecutive_hysteresis,
    )


def record_step_(state: ScaleState, found_inf: torch.Tensor) -> None:
    """Record the step's outcome: ``last_step_skipped`` and the skip counter."""
    state.last_found_inf.copy_(found_inf)
    state.skipped_steps.add_((found_inf != 0).to(torch.int64))
