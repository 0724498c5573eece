"""``compile_step`` on distributed models: DDP supported, FSDP2 refused with a clear error.

``compile_step`` normally compiles the forward and the loss as one full graph. DDP's forward
calls the wrapped module inside a ``_disable_dynamo`` function and FSDP2's hooks are
``_dynamo_disable``-d, so that capture fails with a Dynamo message pointing into torch.

**DDP.** The forward part becomes: DDP's ``__call__`` eagerly with the wrapped module's forward
compiled by ``amp_fx.compile`` (per-unit capture, ``capture.py``), the loss under the same
autocast as torch's AMP recipe, then the step's own ``_forward_loss`` arithmetic (the window
division and the scale multiply: one home for that rule). Every micro-batch of an accumulation
window but the last runs under ``ddp.no_sync()``, so DDP all-reduces the gradients once per
optimizer step, in its buckets, overlapping the backward as DDP does. The gradients are then
plain replicated tensors, every rank computes the same found-inf flag, and the finish graph
(unscale, check, clip, masked step, scale update) runs unchanged: no extra collective, no host
read.

**FSDP2.** The finish graph would have to take DTensor gradients and all-reduce the flag inside
the graph; not done yet. ``compile_step`` raises ``NotImplementedError`` naming what works:
``amp_fx.compile(model)`` with ``amp_fx.GradScaler(step_mode=StepMode.MASKED)``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

import torch

from amp_fx._dist.capture import distributed_units

__all__ = ["distributed_forward", "refuse_distributed_step"]


def _is_ddp(model: torch.nn.Module) -> bool:
    return torch.distributed.is_available() and isinstance(model, torch.nn.parallel.DistributedDataParallel)


def refuse_distributed_step(model: torch.nn.Module) -> None:
    """Raise NotImplementedError if ``model`` is sharded with FSDP2 (DDP is supported)."""
    if _is_ddp(model) or distributed_units(model) is None:
        return
    raise NotImplementedError(
        "amp_fx.compile_step: the model is sharded with fully_shard (FSDP2), which compile_step does "
        "not support yet. Use amp_fx.compile(model) with amp_fx.GradScaler(step_mode="
        "amp_fx.StepMode.MASKED): scaler.scale(loss).backward(); scaler.step(opt); scaler.update()")


def distributed_forward(step: Any, *, compile_model: Callable[[torch.nn.Module], Any]) -> Callable[..., Any] | None:
    """The forward part of a ``CompiledStep`` whose model is DDP, or None for other models.

    ``step``: the ``CompiledStep`` being built (its ``model``, ``loss_fn``, ``config``, ``scaler``
    and ``micro_step`` are read). ``compile_model``: ``amp_fx.compile`` with the step's dtype,
    policy and backend. The returned callable has ``_forward_loss``'s signature and an
    ``amp_fx_records`` attribute, as the compiled forward it replaces.
    """
    ddp = step.model
    if not _is_ddp(ddp):
        return None
    compiled = compile_model(ddp)
    # _forward_loss reads model, loss_fn, config and scaler from its first argument.
    view = types.SimpleNamespace(model=compiled, loss_fn=step.loss_fn, config=step.config, scaler=step.scaler)
    forward_loss = type(step)._forward_loss
    first = next(ddp.parameters(), None)
    device_type = "cuda" if first is not None and first.is_cuda else "cpu"

    def forward(scale: torch.Tensor, *batch: Any, **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        last_of_window = step.micro_step == step.config.accumulate - 1
        sync = contextlib.nullcontext() if last_of_window else ddp.no_sync()
        with sync, torch.autocast(device_type, dtype=step.config.dtype):
            return forward_loss(view, scale, *batch, **model_kwargs)

    forward.amp_fx_records = compiled.amp_fx_records  # type: ignore[attr-defined]
    forward.amp_fx_weight_cache = compiled.amp_fx_weight_cache  # type: ignore[attr-defined]
    return forward
