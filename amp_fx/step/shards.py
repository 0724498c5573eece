"""FSDP2 wiring of a compiled step: the local shards its finish works on.

On an FSDP2 model the finish graph runs on each rank's local shards
(``amp_fx._dist.step.LocalShards``: the local tensors of the parameters, gradients and optimizer
state, and the cross-rank reductions). :class:`StepShards` builds that view once the warm-up has
created the optimizer's state, points it at each step's gradients before the finish and drops them
after, and rebuilds it when the optimizer's parameters change. A fused optimizer's kernel then
runs on the view with the flag combined across ranks (:func:`amp_flags` sets the flags the way
``torch.amp.GradScaler.step`` hands them to a fused optimizer, also used on one device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from amp_fx._dist.step import LocalShards, clip_sharded_, is_fsdp2, is_sharded, torch_clips

__all__ = ["StepShards", "amp_flags"]


@contextlib.contextmanager
def amp_flags(
    optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None, found_inf: torch.Tensor
) -> Iterator[None]:
    """``optimizer.grad_scale`` and ``optimizer.found_inf`` set for a fused optimizer's step inside
    (it divides by the one and skips on the device where the other is 1.0), deleted after."""
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]  # what fused optimizers read, as GradScaler sets it
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # what fused optimizers read, as GradScaler sets it
    try:
        yield
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]  # what fused optimizers read, as GradScaler sets it
        del optimizer.found_inf  # type: ignore[attr-defined]  # what fused optimizers read, as GradScaler sets it


class StepShards:
    """The local view of a compiled step's optimizer on a sharded model (FSDP2, DTensor parameters of
    tensor parallelism, or both: ``view``; None before the first compiled finish, after
    :meth:`reset`, and on other models)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.enabled = is_sharded(model)
        self._fsdp2 = is_fsdp2(model)
        self.view: LocalShards | None = None

    def clip_(self, params: Sequence[torch.Tensor], max_norm: float) -> None:
        """The eager steps' clipping (warm-up): ``clip_grad_norm_`` where it combines the norms
        (one device, FSDP2's default layout), the compiled finish's rule elsewhere."""
        if not self.enabled or torch_clips(params, fsdp2=self._fsdp2):
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            clip_sharded_(params, max_norm)

    def reset(self) -> None:
        """The optimizer's parameters changed: the next finish builds a new view."""
        self.view = None

    def before_finish(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> LocalShards | None:
        """FSDP2: the local view, pointed at this step's gradients and state; else None."""
        if not self.enabled:
            return None
        if self.view is None:
            self.view = LocalShards(optimizer, params, fsdp2=self._fsdp2)
        self.view.before_finish()
        return self.view

    def fused_step(
        self, raw_step: Callable[[torch.optim.Optimizer], Any], grad_scale: torch.Tensor | None, found_inf: torch.Tensor
    ) -> None:
        """A fused optimizer's kernel on the local shards, skipped on the device where found_inf
        (the flag already combined across ranks); its hooks run around it, on the user's optimizer."""
        assert self.view is not None
        with amp_flags(self.view.optimizer, grad_scale, found_inf):
            raw_step(self.view.optimizer)
