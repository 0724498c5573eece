"""``compile_step`` and distributed models: not supported yet, said clearly.

``compile_step`` compiles the forward and the loss as one full graph. DDP's forward calls the
wrapped module inside a ``_disable_dynamo`` function and FSDP2's hooks are ``_dynamo_disable``-d,
so the capture fails with a Dynamo message pointing into torch (``Logger.set_runtime_stats_and_log``
for DDP, ``disable`` for FSDP2). Until the step supports them, it refuses them up front and
names what works: ``amp_fx.compile`` of the model (per-unit capture, see ``capture.py``) with
``amp_fx.GradScaler(step_mode=StepMode.MASKED)`` (no host read of the flag).
"""

from __future__ import annotations

import torch

from amp_fx._dist.capture import distributed_units

__all__ = ["refuse_distributed_step"]


def refuse_distributed_step(model: torch.nn.Module) -> None:
    """Raise NotImplementedError if ``model`` is wrapped in DDP or sharded with FSDP2."""
    if distributed_units(model) is None:
        return
    what = ("DistributedDataParallel" if isinstance(model, torch.nn.parallel.DistributedDataParallel)
            else "sharded with fully_shard (FSDP2)")
    raise NotImplementedError(
        f"amp_fx.compile_step: the model is {what}, which compile_step does not support yet. Use "
        "amp_fx.compile(model) with amp_fx.GradScaler(step_mode=amp_fx.StepMode.MASKED): "
        "scaler.scale(loss).backward(); scaler.step(opt); scaler.update()")
