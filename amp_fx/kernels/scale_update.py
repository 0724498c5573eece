"""The loss-scale update rule as a device op: ``torch.ops.amp_fx.update_scale_``.

This is ``torch._amp_update_scale_`` (ATen's ``_amp_update_scale_cpu_kernel`` and its CUDA
twin) extended with an optional lower bound, upper bound and hysteresis. It is composed of
torch ops on 0-dim tensors, so it runs on any device without reading a value on the host,
and it is a ``torch.library`` custom op with a fake implementation, so ``torch.compile``
traces through it without a graph break.

The rule, for one call (``found`` means ``found_inf != 0``, NaN included, as in ATen)::

    if found:
        growth_tracker = 0
        hysteresis_tracker = max(hysteresis_tracker - 1, 0)
        if hysteresis_tracker == 0:
            scale = f32(max(f64(scale) * backoff_factor, min(f64(scale), min_scale)))
    else:
        successful = growth_tracker + 1
        if successful == growth_interval:
            grown = f32(min(f64(scale) * growth_factor, max(f64(scale), max_scale)))
            if isfinite(grown):            # never grow to inf
                scale = grown
            growth_tracker = 0
            hysteresis_tracker = hysteresis
        else:
            growth_tracker = successful
            if consecutive_hysteresis:
                hysteresis_tracker = hysteresis

``f64``/``f32`` are the casts ATen does (``float * double`` is computed in double and
stored to float), so with ``min_scale=0``, ``max_scale=inf``, ``hysteresis=1`` the result
is bitwise that of ``torch._amp_update_scale_``. The bounds never move the scale the wrong
way: a back-off never raises a scale that is already below ``min_scale``, a growth never
lowers one already above ``max_scale``.

Hysteresis follows Megatron-LM's ``DynamicGradScaler`` (and DeepSpeed's default
``consecutive_hysteresis=False``): the tracker is refilled only when the scale grows, so
after ``hysteresis`` overflows since the last growth *every* further overflow backs off.
With ``consecutive_hysteresis=True`` (DeepSpeed's option) any clean step refills it, so only
``hysteresis`` overflows in a row back off.

Example::

    >>> import torch
    >>> import amp_fx.kernels.scale_update  # registers the op
    >>> scale = torch.full((), 2.0**16)
    >>> tracker = torch.zeros((), dtype=torch.int32)
    >>> hyst = torch.ones((), dtype=torch.int32)
    >>> torch.ops.amp_fx.update_scale_(scale, tracker, hyst, torch.ones(()),
    ...     2.0, 0.5, 2000, 0.0, float("inf"), 1, False)
    >>> scale
    tensor(32768.)
"""

from __future__ import annotations

import math

import torch

__all__ = ["update_scale_"]


def _check_inputs(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    # The same checks (and messages) as ATen's kernel, plus the hysteresis tracker; all of
    # them read metadata only, never a value.
    if scale.numel() != 1:
        raise RuntimeError("current_scale must be a 1-element tensor.")
    if growth_tracker.numel() != 1:
        raise RuntimeError("growth_tracker must be a 1-element tensor.")
    if hysteresis_tracker.numel() != 1:
        raise RuntimeError("hysteresis_tracker must be a 1-element tensor.")
    if found_inf.numel() != 1:
        raise RuntimeError("found_inf must be a 1-element tensor.")
    if scale.dtype != torch.float32:
        raise RuntimeError("current_scale must be a float tensor.")
    if growth_tracker.dtype != torch.int32:
        raise RuntimeError("growth_tracker must be an int tensor.")
    if hysteresis_tracker.dtype != torch.int32:
        raise RuntimeError("hysteresis_tracker must be an int tensor.")
    if found_inf.dtype != torch.float32:
        raise RuntimeError("found_inf must be a float tensor.")
    devices = {t.device for t in (scale, growth_tracker, hysteresis_tracker, found_inf)}
    if len(devices) != 1:
        raise RuntimeError(f"update_scale_ expects all tensors on one device, got {sorted(map(str, devices))}.")


@torch.library.custom_op(
    "amp_fx::update_scale_",
    mutates_args=("scale", "growth_tracker", "hysteresis_tracker"),
)
def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float,
    max_scale: float,
    hysteresis: int,
    consecutive_hysteresis: bool,
) -> None:
    """Update ``scale``, ``growth_tracker`` and ``hysteresis_tracker`` in place (see module doc).

    Args:
        scale: 0-dim (or 1-element) float32 loss scale, updated in place.
        growth_tracker: 1-element int32, clean steps since the last growth or overflow.
        hysteresis_tracker: 1-element int32, overflows left before the next back-off.
        found_inf: 1-element float32 on the same device; non-zero (or NaN) means the step
            had a non-finite gradient.
        growth_factor, backoff_factor, growth_interval: as in ``torch._amp_update_scale_``.
        min_scale: lower bound applied on back-off; ``0.0`` for none.
        max_scale: upper bound applied on growth; ``inf`` for none.
        hysteresis: overflows needed before a back-off; ``1`` is torch's behaviour.
        consecutive_hysteresis: refill the hysteresis tracker on every clean step.
    """
    _check_inputs(scale, growth_tracker, hysteresis_tracker, found_inf)
    found = found_inf.reshape(()) != 0  # NaN != 0, so NaN counts as found, as in ATen.
    scale64 = scale.reshape(()).double()
    tracker = growth_tracker.reshape(())
    hyst = hysteresis_tracker.reshape(())

    # Back-off branch. Bounds are applied in float64 before the one rounding to float32 that
    # ATen does, and only when configured, so the default path is ATen's arithmetic exactly.
    backed64 = scale64 * backoff_factor
    if min_scale > 0.0:
        backed64 = torch.maximum(backed64, torch.clamp(scale64, max=min_scale))
    backed = backed64.float()
    hyst_left = torch.clamp(hyst - 1, min=0)
    back_off = found & (hyst_left == 0)

    # Growth branch.
    successful = tracker + 1
    grow = (~found) & (successful == growth_interval)
    grown64 = scale64 * growth_factor
    if not math.isinf(max_scale):
        grown64 = torch.minimum(grown64, torch.clamp(scale64, min=max_scale))
    grown = grown64.float()
    old = scale.reshape(())
    grown = torch.where(torch.isfinite(grown), grown, old)

    new_scale = torch.where(back_off, backed, torch.where(grow, grown, old))
    zero = torch.zeros_like(tracker)
    new_tracker = torch.where(found | grow, zero, successful)
    refill = grow | (~found) if consecutive_hysteresis else grow
    new_hyst = torch.where(found, hyst_left, torch.where(refill, torch.full_like(hyst, hysteresis), hyst))

    scale.copy_(new_scale.reshape(scale.shape))
    growth_tracker.copy_(new_tracker.reshape(growth_tracker.shape))
    hysteresis_tracker.copy_(new_hyst.reshape(hysteresis_tracker.shape))


@update_scale_.register_fake
def _update_scale_fake(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float,
    max_scale: float,
    hysteresis: int,
    consecutive_hysteresis: bool,
) -> None:
    # In-place on its inputs, no outputs: only the metadata checks are left to do.
    _check_inputs(scale, growth_tracker, hysteresis_tracker, found_inf)
