"""A weight already cast to fp8: what FSDP2's fp8 all-gather hands the fp8 matmul
(:mod:`amp_fx._dist.fp8_gather`).

:class:`Fp8Weight` is fp32 to autograd and FSDP2 (its gradient is an fp32 tensor of its shape)
and holds the e4m3 ``data`` and fp32 ``scale`` of its tensorwise cast (``data = saturate(w *
scale)``). :func:`amp_fx.kernels.fp8_matmul.fp8_matmul` takes them as the weight's cast instead of
casting the weight again; views (the transpose the fp8 pass puts before the matmul) stay
``Fp8Weight``; any other op sees ``data / scale`` (torchao's ``Float8TrainingTensor`` raises
instead; amp_fx gathers in fp8 only the weights its fp8 pass converts).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["EagerReads", "Fp8Weight", "fp8_parts", "holds_fp8_weight"]

aten = torch.ops.aten

# views that keep an Fp8Weight an Fp8Weight (what the fp8 pass puts between a parameter and the
# fp8 matmul, and what FSDP2 applies to the gathered tensor)
_VIEWS = {
    aten.t.default,
    aten.view.default,
    aten.as_strided.default,
    aten.detach.default,
    aten.alias.default,
    aten.transpose.int,
}


class EagerReads:
    """The ops that read an :class:`Fp8Weight` as ``data / scale`` outside any trace (eager code: a
    frame Dynamo skipped, or code after a graph break), the first few, for the weights of one owner
    (one model's :class:`amp_fx._dist.fp8_gather.GatheredFp8Weights`, which reads and clears them
    in its ``check``): two fp8-gathered models in one process each see their own reads.

    Each weight holds its owner's ``id``, an int, not the record: views keep it, and it is the
    weight's flatten context beside its dtype, which Dynamo deep-copies and compares with ``==`` in
    its guards (an object compared by identity never equals its copy: checked, Dynamo 2.13 then
    fails the guard on the frame that created it; a list of reads would change as reads come in).
    The record is found by ``id`` in a weak dictionary: once its owner is gone, reads are recorded
    nowhere."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id = next(EagerReads._ids)
        self._ops: list[str] = []
        _OWNERS[self.id] = self

    def add(self, op: str) -> None:
        if len(self._ops) < 8:
            self._ops.append(op)

    def take(self) -> list[str]:
        """The ops read since the last ``take``, each once, in order; cleared."""
        ops = list(dict.fromkeys(self._ops))
        self._ops.clear()
        return ops


_OWNERS: weakref.WeakValueDictionary[int, EagerReads] = weakref.WeakValueDictionary()


class Fp8Weight(torch.Tensor):
    """A gathered weight, fp32 to autograd and FSDP2, held as e4m3 ``data`` and its fp32 ``scale``
    (``data = saturate(w * scale)``, tensorwise). The fp8 matmul reads ``data`` and ``scale``
    directly; any other op sees ``data / scale`` (torchao's ``Float8TrainingTensor`` raises
    instead: amp_fx gathers in fp8 only the weights whose every use is an fp8 matmul). ``reads``:
    the ``id`` of the :class:`EagerReads` that records its eager reads (0: none records them)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, reads: int = 0) -> Fp8Weight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=False,
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, reads: int = 0) -> None:
        self._data = data
        self._scale = scale
        self._reads = reads

    def __repr__(self) -> str:  # type: ignore[override]  # Tensor.__repr__ also takes tensor_contents=
        return f"Fp8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, data={self._data.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data", "_scale"], (self.dtype, self._reads)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: tuple[torch.dtype, int], outer_size: Any, outer_stride: Any
    ) -> Fp8Weight:
        return Fp8Weight(inner["_data"], inner["_scale"], *meta)

    def dequantized(self) -> torch.Tensor:
        return self._data.to(self.dtype) / self._scale

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]  # torch's stub types the disabled impl; subclasses define a classmethod
        kwargs = kwargs or {}
        if func in _VIEWS and isinstance(args[0], Fp8Weight):
            w = args[0]
            return Fp8Weight(func(w._data, *args[1:], **kwargs), w._scale, w.dtype, w._reads)
        return _dequantized_call(func, args, kwargs)


def holds_fp8_weight(t: object) -> bool:
    """``t`` is an :class:`Fp8Weight` or a DTensor over one (FSDP2 x TP gathers the TP shard: the
    unsharded parameter is a DTensor of the TP mesh over what the fp8 all-gather made)."""
    return isinstance(t, Fp8Weight) or isinstance(getattr(t, "_local_tensor", None), Fp8Weight)


def fp8_parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(data, scale)`` of an :class:`Fp8Weight`; of a DTensor over one, the DTensor of the same
    mesh and placements over the e4m3 data and the scale replicated (every rank's scale is the
    whole weight's: :func:`amp_fx._dist.fp8_gather.precompute_scales`), as the fp8 matmul's own
    cast of a DTensor weight makes them; None for any other tensor."""
    if isinstance(w, Fp8Weight):
        return w._data, w._scale
    local = getattr(w, "_local_tensor", None)
    if not isinstance(local, Fp8Weight):
        return None
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements = w.device_mesh, w.placements  # type: ignore[attr-defined]  # w is a DTensor
    data = DTensor.from_local(
        local._data,
        mesh,
        placements,
        run_check=False,
        shape=w.shape,
        stride=w.stride(),
    )
    scale = DTensor.from_local(local._scale, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return data, scale


@torch._dynamo.disable
def _dequantized_call(func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` on ``data / scale`` of each Fp8Weight argument. Outside Dynamo: an eager read (a
    frame Dynamo skipped or resumed after a graph break) still has Dynamo's frame callback set,
    which would compile the dequantization's Python frames as graphs of their own (checked: its
    result was then a FakeTensor)."""
    owners = {
        w._reads for w in pytree.tree_leaves((args, kwargs)) if type(w) is Fp8Weight and type(w._data) is torch.Tensor
    }  # real: not a fake or functional trace
    for owner in owners:
        if (reads := _OWNERS.get(owner)) is not None:
            reads.add(str(func))
    args, kwargs = pytree.tree_map_only(Fp8Weight, lambda w: w.dequantized(), (args, kwargs))
    return func(*args, **kwargs)
