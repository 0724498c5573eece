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

from collections.abc import Sequence
from typing import Any

import torch

from amp_fx._common.compat import dtensor_type
from amp_fx._common.unwrap import layers

__all__ = [
    "ShardedGrads",
    "combine_first_op",
    "pack_overflow",
    "ranks_of",
    "rank_first_op",
    "running_ddp",
    "unpack_overflow",
    "unrank_first_op",
]

# The forward record across ranks (amp_fx/overflow): a rank's first non-finite op code (-1: none;
# the graphs, and so the codes, are the same on every rank) and its global rank, packed as one int64
# ``code * world_size + rank`` (none: _NO_CODE). Its minimum over the ranks is the earliest op in
# graph order, and of the ranks that saw it the lowest. Codes are below 2^40 (graph index times
# 2^24), so with any world size below 2^22 the packed value stays below _NO_CODE.
_NO_CODE = 1 << 62


def rank_first_op(code: torch.Tensor) -> torch.Tensor:
    """A forward record (int64, -1: none) packed with this rank for :func:`unrank_first_op`."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    return torch.where(code == -1, _NO_CODE, code * world + rank)


def unrank_first_op(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The record and the rank (both -1 when no rank had one) from a combined packed value."""
    import torch.distributed as dist

    world = dist.get_world_size()
    none = packed >= _NO_CODE
    return torch.where(none, -1, torch.div(packed, world, rounding_mode="floor")), torch.where(none, -1, packed % world)


def combine_first_op(code: torch.Tensor | None, group: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's forward record combined (the earliest op, the lowest rank that saw it): one
    all-reduce (MIN) of one int64, functional (traceable into ``compile_step``'s finish), on the
    device, no host read. ``code`` None (the watch has not run): -1, and this rank still joins."""
    from torch.distributed import _functional_collectives as funcol

    if code is None:
        code = torch.full((), -1, dtype=torch.int64, device=device)
    return unrank_first_op(funcol.all_reduce(rank_first_op(code), "min", group))


def pack_overflow(
    found_inf: torch.Tensor, flags: Sequence[torch.Tensor], first_op: torch.Tensor | None
) -> torch.Tensor:
    """The found-inf flag with what amp_fx/overflow records, as one int64 vector for one all-reduce
    (MAX), on ``found_inf``'s device: ``[found_inf, *flags, -rank_first_op(first_op)]``. ``flags``:
    per-gradient 0/1 flags (the same gradients, in the same order, on every rank); ``first_op``:
    this rank's forward record (int64, -1: none), negated so that the maximum is the minimum. Every
    entry is an integer, so the flag comes back exactly 0.0 or 1.0. Undone by :func:`unpack_overflow`.
    """
    device = found_inf.device
    parts = [found_inf.reshape(1).to(device, torch.int64), *(f.reshape(-1).to(device, torch.int64) for f in flags)]
    if first_op is not None:
        parts.append(-rank_first_op(first_op.reshape(1).to(device)))
    return torch.cat(parts)


def unpack_overflow(
    reduced: torch.Tensor, flag_count: int, first_op: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """A :func:`pack_overflow` vector after the all-reduce: the flag (int64, 0-dim), the
    ``flag_count`` gradient flags (int64) and, if ``first_op`` was packed, (record, rank)."""
    first = unrank_first_op(-reduced[1 + flag_count].reshape(())) if first_op else None
    return reduced[0].reshape(()), reduced[1 : 1 + flag_count], first


def ranks_of(model: torch.nn.Module) -> Any:
    """The process group of the ranks that train ``model`` together: DDP's, or the group of the mesh
    its FSDP2 (DTensor) parameters are sharded over (the default group for a mesh of more than one
    dimension); None when the model is not distributed. Looks through ``torch.compile`` and
    ``amp_fx.compile`` wrappers."""
    dtensor = dtensor_type()
    if dtensor is None or not torch.distributed.is_initialized():
        return None
    for layer in layers(model):
        if isinstance(layer, torch.nn.parallel.DistributedDataParallel):
            return layer.process_group
        if isinstance(layer, torch.nn.Module):  # every layer of a module is one (compile wrappers)
            model = layer
    for p in model.parameters():
        if isinstance(p, dtensor) and any(not pl.is_replicate() for pl in p.placements):
            mesh = p.device_mesh
            return mesh.get_group() if mesh.ndim == 1 else torch.distributed.group.WORLD
    return None


def running_ddp() -> torch.nn.Module | None:
    """The ``DistributedDataParallel`` module whose forward is running now, else None.

    torch notes it around the wrapped module's call (``DistributedDataParallel._active_ddp_module``,
    for Dynamo's DDPOptimizer; not with DDP's Python reducer, where this gives None), so that code
    run inside the forward (a compiled model's graphs) can tell which ranks train that model."""
    if not torch.distributed.is_available():
        return None
    return getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)


class ShardedGrads:
    """Collects the meshes of sharded gradients met while unscaling, then combines the flag (over
    ``group`` when given: the scaler's ``process_group``, with or without sharded gradients)."""

    def __init__(self, group: Any = None) -> None:
        self._dtensor = dtensor_type()
        self._meshes: dict[int, Any] = {}
        self._given_group = group

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
        """Whether some gradient met so far is sharded (or partial) across ranks, or a group was
        given: whether the flag is combined across ranks."""
        return bool(self._meshes) or self._given_group is not None

    def combine_found_inf_(
        self,
        per_device: dict[torch.device, torch.Tensor],
        scale: torch.Tensor,
        grad_flags: list[torch.Tensor] | None = None,
        first_op: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All-reduce (MAX) the flags across the ranks of the meshes, in one collective, in place.

        ``per_device`` maps each gradient device to its flag. A rank whose shards are all empty
        has no flag yet: one is added on ``scale``'s device, because every rank must join the
        collective. Nothing happens (and None is returned) when no gradient was sharded.
        Folded into the same collective, as one int64 vector (every entry an integer, so the flag
        comes back exactly 0.0 or 1.0): ``grad_flags``, per-gradient 0/1 flags (amp_fx/overflow;
        same length on every rank), combined in place; and ``first_op``, this rank's forward record
        (int64, -1: none), whose combination over the ranks (:func:`combine_first_op`'s, as a MAX of
        the negated packed value) is returned as (record, rank).
        """
        if not self.is_sharded:
            return None
        import torch.distributed as dist

        if not per_device:
            per_device[scale.device] = torch.zeros((), dtype=torch.float32, device=scale.device)
        flags = list(per_device.values())
        combined = flags[0] if len(flags) == 1 else torch.stack([f.reshape(()).to(scale.device) for f in flags]).amax()
        grad_flags = grad_flags or []
        packed = pack_overflow(combined.to(scale.device), grad_flags, first_op)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self._group())
        flag, reduced_flags, first = unpack_overflow(packed, sum(g.numel() for g in grad_flags), first_op is not None)
        combined.copy_(flag.to(combined.device, combined.dtype).reshape(combined.shape))
        for g, part in zip(grad_flags, reduced_flags.split([g.numel() for g in grad_flags]), strict=True):
            g.copy_(part.to(g.device, g.dtype).reshape(g.shape))
        for f in flags:
            if f is not combined:
                f.copy_(combined.to(f.device).reshape(f.shape))
        return first

    def _group(self) -> Any:
        """The process group spanning every rank that holds a shard: the mesh's own group for a
        1-D mesh, the default group when the meshes together cover every rank (HSDP's 2-D mesh;
        FSDP2 x TP, whose norms are sharded over the data-parallel sub-mesh alone and the rest
        over the 2-D mesh)."""
        import torch.distributed as dist

        if self._given_group is not None:
            return self._given_group
        meshes = list(self._meshes.values())
        if len(meshes) == 1 and meshes[0].ndim == 1:
            return meshes[0].get_group()
        world = dist.get_world_size()
        ranks = {r for m in meshes for r in m.mesh.flatten().tolist()}
        if len(ranks) == world:
            return None
        shapes = [tuple(m.mesh.shape) for m in meshes]
        raise NotImplementedError(
            f"amp_fx.GradScaler: gradients are sharded over device meshes of shapes {shapes} "
            f"that do not span all {world} ranks; combining the inf/NaN flag over such meshes "
            "is not supported (one 1-D mesh, or meshes over every rank, are)"
        )
