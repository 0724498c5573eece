"""What one eager autocast forward did, op by op, for :func:`amp_fx.advise`: which module ran each
low-precision op, and which of those ops each value was computed from.

A *low-precision op* is one autocast runs in fp16/bf16 by choice: an op of its lower-precision list
(matmuls, convolutions, attention, ``prelu``: ``CastClass.LOWER_PRECISION_FP``) whose output came
out in the low dtype. Keeping a module in fp32 moves exactly the low-precision ops inside it to
fp32; every other op (views, adds, activations, dropout, norms autocast runs in fp32) follows its
inputs' dtype. A module that runs no low-precision op only passes values along: keeping it would
merely upcast them, which keeping the module that produced them does too.

The *producers* of a value are the modules whose low-precision ops it was last computed from,
through any number of other ops (``proj(x) - offset`` is produced by ``proj``; a residual sum by
every block that added to it). They say which keep can change the rounding a value carries.

    >>> flow = Flow([], torch.bfloat16, "cpu")                                   # doctest: +SKIP
    >>> with torch.autocast("cpu", dtype=torch.bfloat16), flow: y = model(x)      # doctest: +SKIP
    >>> flow.producers(y), flow.ops                                               # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from amp_fx._common.compat import local_tensor
from amp_fx._common.op_names import op_label
from amp_fx.policy import CastClass, default_class

__all__: list[str] = []

_EXTRA_LOW = frozenset({"_prelu_kernel"})
"""Kernels autocast's ``prelu`` (CPU and CUDA tables) reaches below the dispatcher's composite
decomposition, where the table's own name is no longer seen."""


def compute_flops(func: Any, args: Any, kwargs: Any, out: Any) -> float | None:
    """FLOPs of a matmul, convolution or attention kernel (``torch.utils.flop_counter``'s formulas;
    CPU's fused attention, which it lacks, as its two matmuls); None for any other op. A DTensor
    operand counts as its local shard: the FLOPs this rank runs."""
    packet = func._overloadpacket
    attention = packet.__name__.startswith("_scaled_dot_product") and not packet.__name__.endswith("backward")
    if packet not in flop_registry and not attention:
        return None
    args, kwargs, out = tree_map(local_tensor, (args, kwargs, out))
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    q, k, v = args[:3]  # attention: (..., L, E), (..., S, E), (..., S, Ev): q k^T then p v
    return 2.0 * q.shape[:-1].numel() * k.shape[-2] * (q.shape[-1] + v.shape[-1])


class Flow(TorchDispatchMode):
    """A dispatch mode for one autocast forward (the loss included): records, per module (the
    innermost running, read from ``stack``, which the caller's module hooks keep), the
    low-precision ops it ran with their FLOPs (``ops``), and for every floating value its
    producers (:meth:`producers`). Values are not changed."""

    def __init__(
        self, stack: list[str], dtype: torch.dtype, device_type: str, only: frozenset[str] | None = None
    ) -> None:
        super().__init__()
        self.stack = stack
        self.dtype = dtype
        self.device_type = device_type
        self.only = only
        """With it, the low-precision ops are exactly the ops of these names (``{"_scaled_mm"}``:
        the fp8 GEMMs of an ``fp8=`` run), whatever dtype they return."""
        self.ops: dict[str, list[tuple[str, float]]] = {}
        """Innermost module (``""`` for the root's own code) -> its low-precision ops, in order."""
        self._sources: dict[int, tuple[weakref.ref[torch.Tensor], frozenset[str]]] = {}
        self._listed: dict[Any, bool] = {}

    def producers(self, value: Any) -> frozenset[str]:
        """The modules whose low-precision ops the tensors in ``value`` were computed from."""
        found: set[str] = set()
        for t in _tensors(value):
            seen = self._sources.get(id(t))
            if seen is not None and seen[0]() is t:  # not a dead tensor's reused id
                found |= seen[1]
        return frozenset(found)

    def _low_precision(self, func: Any, args: Any, kwargs: Any, out: Any, outs: list[torch.Tensor]) -> float | None:
        """The op's FLOPs if autocast ran it in the low dtype by its lower-precision list."""
        if self.only is not None:
            if func._overloadpacket.__name__ not in self.only:
                return None
            return compute_flops(func, args, kwargs, out) or 0.0
        if not any(t.dtype == self.dtype for t in outs):
            return None
        flops = compute_flops(func, args, kwargs, out)
        if flops is not None:
            return flops
        listed = self._listed.get(func)
        if listed is None:
            name = func._overloadpacket.__name__
            listed = self._listed[func] = (
                name in _EXTRA_LOW or default_class(f"aten::{name}", self.device_type) is CastClass.LOWER_PRECISION_FP
            )
        return 0.0 if listed else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in _tensors(out) if t.is_floating_point()]
        if not outs:
            return out
        flops = self._low_precision(func, args, kwargs, out, outs)
        if flops is not None:
            owner = self.stack[-1] if self.stack else ""
            self.ops.setdefault(owner, []).append((op_label(func, packet=True), flops))
            sources = frozenset((owner,))
        else:
            sources = self.producers((args, kwargs))
        if sources:
            for t in outs:
                self._sources[id(t)] = (weakref.ref(t), sources)
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result: tensors, and tuples, lists and dicts of them
    (:func:`tensors_of` without pytree's cost, which every op would pay)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
