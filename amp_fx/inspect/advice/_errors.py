"""advise, measuring: the numbers every run is judged by. A run's values against the float64
reference's (normwise relative error, one tensor's parts of it), the largest magnitude, and the
share of values a dtype holds only as subnormal or zero."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from amp_fx.inspect._probe import tensors_of

__all__: list[str] = []

LOW = (torch.float16, torch.bfloat16)


def floats(value: Any) -> list[torch.Tensor]:
    return [t.detach() for t in float_tensors(value)]


def float_tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors themselves, not detached: :class:`~amp_fx.inspect._flow.Flow` knows them
    by identity."""
    return [t for t in tensors_of(value) if t.is_floating_point()]


def all_finite(ts: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def rel_error(low: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], floor: float) -> float:
    """Normwise relative error ``||low - ref|| / max(||ref||, floor * sqrt(n))`` over the tensors
    together: an entry that is zero in exact arithmetic divides nothing, and an all-zero reference
    compares against ``floor`` (the dtype's smallest normal number) per entry. inf when ``low``
    is not finite where ``ref`` is."""
    parts = error_parts(low, ref)
    return math.nan if parts is None else combine(parts, floor)


Part = tuple[float, float, int] | None
"""One tensor's ``(||low - ref||^2, ||ref||^2, entries)``; the first inf when ``low`` is not finite
where ``ref`` is; None when ``ref`` itself is not finite (nothing to measure)."""


def error_parts(low: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> list[Part] | None:
    """Per tensor, what :func:`combine` sums; None when the lists do not match."""
    if not low or len(low) != len(ref) or any(a.shape != b.shape for a, b in zip(low, ref)):
        return None
    parts: list[Part] = []
    for a, b in zip(low, ref):
        a, b = a.double(), b.double()
        d = a - b
        if not bool(torch.isfinite(d).all()):
            parts.append(None if not bool(torch.isfinite(b).all()) else (math.inf, 0.0, 0))
            continue
        parts.append((float(d.pow(2).sum()), float(b.pow(2).sum()), b.numel()))
    return parts


def combine(parts: Sequence[Part], floor: float) -> float:
    num = den = 0.0
    n = 0
    for p in parts:
        if p is None:
            continue
        if math.isinf(p[0]):
            return math.inf
        num, den, n = num + p[0], den + p[1], n + p[2]
    return math.sqrt(num) / max(math.sqrt(den), floor * math.sqrt(max(n, 1)))


def max_abs(ts: Sequence[torch.Tensor]) -> float:
    best = 0.0
    for t in ts:
        if t.numel():
            best = max(best, float(t.abs().masked_fill(~torch.isfinite(t), 0).max()))
    return best


def underflow(ref: Sequence[torch.Tensor], dtype: torch.dtype, scale: float = 1.0) -> float:
    """Fraction of the non-zero reference values that ``dtype`` holds only as subnormal or zero."""
    tiny = torch.finfo(dtype).tiny
    nonzero = under = 0
    for t in ref:
        a = t.abs() * scale
        nz = a != 0
        nonzero += int(nz.sum())
        under += int((nz & (a < tiny)).sum())
    return under / nonzero if nonzero else 0.0
