"""The gradient scaler's inf/NaN flag when gradients are sharded across ranks (FSDP2 DTensors).

With DDP every rank holds the same all-reduced gradients, so every rank computes the same flag
and needs no collective. With FSDP2 a rank holds only its shard of each gradient (a DTensor
with a ``Shard`` placement): an inf in rank 0's shard is invisible to rank 1, which would step
while rank 0 skips, and the replicas would drift apart. ``torch.distributed.fsdp.
ShardedGradScaler`` all-reduces the flag; so does :class:`ShardedGrads`, with two differences:

* ``MAX``, not ``SUM``: the flag stays exactly 0.0 or 1.0 (fused optimizers skip only on 1.0).
* One collective per ``unscale_`` (per optimizer per step), whatever the number of devices,
  and only when some gradient is sharded: replicated gradients (DDP, or DTensors whose
  placements are all ``Replicate``) cost no collective. The flag never leaves the device.

Used by ``amp_fx.GradScaler._unscale_grads_``::

    sharded = ShardedGrads()
    ...  to_unscale = sharded.local(param.grad)  # the rank's shard, unscaled in place
    sharded.combine_found_inf_(per_device_found_inf, scale)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ShardedGrads"]


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


class ShardedGrads:
    """Collects the meshes of sharded gradients met while unscaling, then combines the flag."""

    def __init__(self) -> None:
        self._dtensor = _dtensor_type()
        self._meshes: dict[int, Any] = {}

    def local(self, grad: torch.Tensor) -> torch.Tensor:
        """The tensor to check and unscale in place: a DTensor's local shard, else ``grad``.

        The local tensor shares storage with the DTensor, so unscaling it unscales the DTensor.
        """
        if self._dtensor is None or not isinstance(grad, self._dtensor):
            return grad
        if any(not p.is_replicate() for p in grad.placements):
            self._meshes.setdefault(id(grad.device_mesh), grad.device_mesh)
        return grad._local_tensor

    @property
    def is_sharded(self) -> bool:
        """Whether some gradient met so far is sharded (or partial) across ranks."""
        return bool(self._meshes)

    def combine_found_inf_(self, per_device: dict[torch.device, torch.Tensor],
                           scale: torch.Tensor, grad_flags: list[torch.Tensor] | None = None) -> None:
        """All-reduce (MAX) the flags across the ranks of the meshes, in one collective, in place.

        ``per_device`` maps each gradient device to its flag. A rank whose shards are all empty
        has no flag yet: one is added on ``scale``'s device, because every rank must join the
        collective. Nothing happens when no gradient was sharded. ``grad_flags``: per-gradient
        flags (amp_fx/overflow.py; same length on every rank) combined in the same collective.
        """
        if not self._meshes:
            return
        import torch.distributed as dist

        if not per_device:
            per_device[scale.device] = torch.zeros((), dtype=torch.float32, device=scale.device)
        flags = list(per_device.values())
        combined = flags[0] if len(flags) == 1 else torch.stack(
            [f.reshape(()).to(scale.device) for f in flags]).amax()
        extra = [g.to(scale.device) for g in grad_flags or []]
        packed = torch.cat([combined.reshape(1).to(scale.device), *extra]) if extra else combined
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self._group())
        if extra:
            combined.copy_(packed[0].to(combined.device).reshape(combined.shape))
            for g, part in zip(grad_flags or [], packed[1:].split([e.numel() for e in extra]), strict=True):
                g.copy_(part.to(g.device))
        for f in flags:
            if f is not combined:
                f.copy_(combined.to(f.device).reshape(f.shape))

    def _group(self) -> Any:
        """The process group spanning every rank that holds a shard: the mesh's own group for a
        1-D mesh, the default group when the mesh covers every rank (e.g. HSDP's 2-D mesh)."""
        import torch.distributed as dist

        meshes = list(self._meshes.values())
        if len(meshes) == 1 and meshes[0].ndim == 1:
            return meshes[0].get_group()
        world = dist.get_world_size()
        if all(m.size() == world for m in meshes):
            return None
        shapes = [tuple(m.mesh.shape) for m in meshes]
        raise NotImplementedError(
            f"amp_fx.GradScaler: gradients are sharded over device meshes of shapes {shapes} "
            f"that do not span all {world} ranks; combining the inf/NaN flag over such meshes "
            "is not supported (one 1-D mesh, or meshes over every rank, are)")
