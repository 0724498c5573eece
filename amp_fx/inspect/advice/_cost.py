"""advise, the cost of a policy: one eager forward under the default and the advised policy, no grad,
counting matmul/conv/attention FLOPs by the dtype they ran in (fp32, fp8) and the bytes the dtype
casts move (:class:`Cost`); and, per kept module, the low-precision ops the keep moves and their
share of the FLOPs (:class:`KeptModule`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from amp_fx._common.compat import local_tensor
from amp_fx.fp8 import Fp8Config
from amp_fx.inspect._flow import compute_flops
from amp_fx.inspect._fp8_eager import Fp8Eager, module_stack
from amp_fx.inspect._runner import SEED, Call, private_copy
from amp_fx.inspect.advice._errors import LOW
from amp_fx.inspect.advice._findings import inside
from amp_fx.inspect.advice._measure import RunResult, fp8_mode, keep_in_fp32

__all__: list[str] = []


@dataclass(frozen=True)
class Cost:
    """What the advised policy costs, forward pass (counted on the eager run)."""

    fp32_flop_share: float
    """Share of the matmul/conv/attention FLOPs that run in fp32 (0 with the default policy, up to 1)."""
    default_fp32_flop_share: float
    cast_bytes: int
    """Bytes the dtype casts read and write per call with the advised policy (of a DTensor, its
    local shard's: what this rank moves)."""
    default_cast_bytes: int
    matmul_flops: float
    """The matmul/conv/attention FLOPs of one forward (under tensor parallelism, this rank's)."""
    fp8_flop_share: float | None = None
    """With ``fp8=``: share of the FLOPs that run in fp8 with the advised policy."""
    default_fp8_flop_share: float | None = None
    """The same with every matmul the fp8 pass converts in fp8."""


@dataclass(frozen=True)
class KeptModule:
    """A module the advice keeps in fp32 and what that moves to fp32: the low-precision ops it (or a
    descendant) ran under the default policy."""

    name: str
    type: str
    ops: tuple[tuple[str, int], ...]
    """(op, calls per forward), in the order first run, e.g. ``(("aten.addmm", 1),)``."""
    flop_share: float
    """Their share of the model's matmul/conv/attention FLOPs in one forward."""
    to: str = "fp32"
    """Where the keep moves them: ``fp32``, or with ``fp8=`` the autocast dtype (out of fp8)."""

    def __str__(self) -> str:
        ops = ", ".join(f"{op} x{n}" for op, n in self.ops)
        return f"{self.name} ({self.type}) moves {ops} to {self.to}: {self.flop_share:.1%} of the FLOPs"


def kept_modules(keep: Sequence[str], base: RunResult, total_flops: float, to: str = "fp32") -> tuple[KeptModule, ...]:
    out = []
    for name in keep:
        ops: dict[str, int] = {}
        flops = 0.0
        for owner, run_ops in base.low_ops.items():
            if inside(owner, name):
                for op, f in run_ops:
                    ops[op] = ops.get(op, 0) + 1
                    flops += f
        stats = base.modules.get(name)
        out.append(
            KeptModule(
                name, stats.type if stats else "?", tuple(ops.items()), flops / total_flops if total_flops else 0.0, to
            )
        )
    return tuple(out)


class _CostCounter(TorchDispatchMode):
    """Matmul/conv/attention FLOPs by the dtype they ran in, and bytes the dtype casts moved
    (forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fp32 = 0.0
        self.fp8 = 0.0
        self.total = 0.0
        self.cast_bytes = 0
        self.low: Fp8Eager | None = None
        """The eager low-precision mode of the run: every matmul inside its GEMM kernels is low
        precision (the emulated recipes multiply dequantized operands with ``torch.mm``)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = compute_flops(func, args, kwargs, out)
        if flops is not None:
            first = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            self.total += flops
            if func is torch.ops.aten._scaled_mm.default or (self.low is not None and self.low.in_gemm):
                self.fp8 += flops
            elif first is not None and first.dtype not in LOW:
                self.fp32 += flops
        elif func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            src, dst = local_tensor(args[0]), local_tensor(out)  # a DTensor: what this rank casts
            if src.is_floating_point() and dst.is_floating_point() and src.dtype != dst.dtype:
                self.cast_bytes += dst.numel() * (src.element_size() + dst.element_size())
        return out


def _count(
    model: Any, call: Call, *, dtype: torch.dtype, device_type: str, keep: tuple[str, ...], fp8: Fp8Config | None = None
) -> _CostCounter:
    """One forward under the policy, no grad, counting FLOPs by dtype and cast bytes (with
    ``fp8``, ``keep`` is kept out of fp8 instead of in fp32)."""
    m = private_copy(model)
    stack: list[str] = []
    if fp8 is None:
        keep_in_fp32(m, keep, device_type)
    counter = _CostCounter()
    low = fp8_mode(fp8, dtype, device_type, stack, keep, measure=False)
    counter.low = low if isinstance(low, Fp8Eager) else None
    with torch.random.fork_rng(devices=[]), torch.no_grad(), module_stack(m, stack):
        torch.manual_seed(SEED)
        with torch.autocast(device_type, dtype=dtype), counter, low:
            call.copy()(m)
    return counter


def cost(
    model: Any, call: Call, *, dtype: torch.dtype, device_type: str, keep: tuple[str, ...], fp8: Fp8Config | None
) -> Cost:
    """The advised policy's cost (``keep``) against the default policy's."""
    c0 = _count(model, call, dtype=dtype, device_type=device_type, keep=(), fp8=fp8)
    c1 = _count(model, call, dtype=dtype, device_type=device_type, keep=keep, fp8=fp8) if keep else c0
    return Cost(
        fp32_flop_share=c1.fp32 / c1.total if c1.total else 0.0,
        default_fp32_flop_share=c0.fp32 / c0.total if c0.total else 0.0,
        cast_bytes=c1.cast_bytes,
        default_cast_bytes=c0.cast_bytes,
        matmul_flops=c0.total,
        fp8_flop_share=None if fp8 is None else c1.fp8 / c1.total if c1.total else 0.0,
        default_fp8_flop_share=None if fp8 is None else c0.fp8 / c0.total if c0.total else 0.0,
    )
