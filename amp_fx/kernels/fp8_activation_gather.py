"""Sequence parallelism's activation all-gather in fp8: cast each rank's shard, gather the bytes.

Under sequence parallelism a column-parallel linear's input arrives sharded on the sequence
(``Shard(1)``, the norm's output) and DTensor's ``redistribute`` all-gathers it to ``Replicate``
before the matmul: eager autocast gathers the fp32 norm output (4 bytes per element) and casts
after. With the tensorwise fp8 recipe the matmul casts its input to e4m3 with one scale,
``fp8_max / amax``, so each rank can cast its own shard first if the scale is the whole tensor's:
then one byte per element crosses the wire, as torchao's ``Float8ColwiseParallel`` gathers.

:func:`fp8_gather_input` takes the sharded input ``x`` (a DTensor, in the dtype the model gathers)
and returns ``(carrier, data, scale)``:

* ``data``, ``scale``: :func:`~amp_fx.kernels.fp8_matmul.input_cast` of ``x`` cast to the autocast
  dtype, made on the shards (the amax reduced across ranks: DTensor's all-reduce MAX of a sharded
  reduction), then the e4m3 bytes all-gathered (as ``uint8``: gloo has no float8) to the target
  placements. Each element's cast is the one of the gathered tensor (same value, same scale), so
  the fp8 matmuls that take it (:func:`~amp_fx.kernels.fp8_matmul.fp8_matmul`'s ``x_fp8``) compute
  bitwise what they compute from the gathered input, forward and weight gradient alike (the
  tensorwise weight-gradient GEMM takes the same cast of the same input).
* ``carrier``: a tensor of the gathered shape in ``x``'s dtype that holds no data (a zero
  broadcast: no memory), which the matmuls take as their ``x`` to receive the input's gradient.
  Each returns it in ``x``'s dtype, autograd sums them there, and the backward moves the sum to
  ``x``'s placements (``Partial`` to ``Shard``: a reduce-scatter in ``x``'s dtype): what the
  backward of ``redistribute`` followed by one cast per matmul computes, so the input gradient is
  bitwise too.

The fp8 pass (:mod:`amp_fx.passes.fp8_matmuls`) puts it where a gathering ``redistribute`` feeds
only tensorwise fp8 matmuls (through the casts ``insert_casts`` gave each).
"""

from __future__ import annotations

from typing import Any

import torch

from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels.fp8_matmul import input_cast

__all__ = ["fp8_gather_input"]


def _placed(local: torch.Tensor, like: Any, placements: tuple[Any, ...]) -> Any:
    """``local`` as the DTensor ``like`` would be with ``placements`` (same mesh, global shape)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, like.device_mesh, placements, run_check=False, shape=like.shape, stride=like.stride()
    )


class _Fp8GatherInput(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Any, placements: tuple[Any, ...], dtype: torch.dtype, recipe: Fp8Recipe
    ) -> tuple[Any, Any, Any]:
        ctx.mesh, ctx.placements = x.device_mesh, tuple(x.placements)
        data: Any
        data, scale = input_cast(x.to(dtype), recipe)
        local = data.to_local()
        shards = tuple(data.placements)
        gathered = _placed(local.view(torch.uint8), data, shards).redistribute(data.device_mesh, placements)
        data = _placed(gathered.to_local().view(local.dtype), data, placements)
        zero = torch.zeros((), dtype=x.dtype, device=local.device)
        carrier = _placed(zero.expand(data.to_local().shape), x, placements)
        ctx.mark_non_differentiable(data, scale)
        return carrier, data, scale

    @staticmethod
    def backward(ctx: Any, grad: Any, *_: Any) -> tuple[Any, ...]:
        return grad.redistribute(ctx.mesh, ctx.placements), None, None, None


def fp8_gather_input(
    x: torch.Tensor, placements: tuple[Any, ...], dtype: torch.dtype, recipe: Fp8Recipe
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(carrier, data, scale)`` for the fp8 matmuls reading ``x.redistribute(placements)`` cast
    to ``dtype`` (module docstring). ``x``: a DTensor; ``recipe``: tensorwise."""
    assert recipe is Fp8Recipe.TENSORWISE, recipe
    return _Fp8GatherInput.apply(x, tuple(placements), dtype, recipe)
