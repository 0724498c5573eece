"""Unscale + check for gradients of any dtype, with torch's kernel as the fallback.

``unscale_check_any_dtype_`` is what ``amp_fx.GradScaler`` calls per device: amp_fx's fused
kernel (``amp_fx.kernels.unscale.unscale_check_``, bitwise the semantics of
``torch._amp_foreach_non_finite_check_and_unscale_``) for the dtypes it takes, and torch's own
kernel for the rest (float64, which torch's scaler accepts) and for everything whenever the
amp_fx kernels cannot be imported.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import cast

import torch

from amp_fx.kernels.cpu_unscale import torch_unscale_check_per_tensor_

__all__ = ["unscale_check_any_dtype_", "torch_unscale_check_"]

logger = logging.getLogger(__name__)

_UnscaleFn = Callable[..., None]
_FUSED_UNSCALE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def torch_unscale_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """torch's fused kernel, once per dtype (it takes one dtype per call)."""
    per_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        per_dtype[g.dtype].append(g)
    for group in per_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)


@functools.cache
def _fused_unscale_kernel() -> _UnscaleFn | None:
    try:
        from amp_fx.kernels.unscale import unscale_check_
    except ImportError as e:
        from amp_fx._common.report import did_less

        did_less(
            "kernels.unscale import",
            f"amp_fx: amp_fx.kernels.unscale could not be imported ({e}); "
            "GradScaler uses torch's unscale kernel (same results, no fused norm). Install a triton "
            "that matches torch to use amp_fx's kernel.",
        )
        return None
    return cast(_UnscaleFn, unscale_check_)


def unscale_check_any_dtype_(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    flags: torch.Tensor | None = None,
) -> None:
    """Check and unscale gradients of one device in place, any floating dtype. ``flags`` (fp32,
    one per gradient): raised to 1.0 where that gradient held an inf/NaN."""
    fused = _fused_unscale_kernel()
    if fused is None:
        if flags is None:
            torch_unscale_check_(grads, found_inf, inv_scale)
        else:
            torch_unscale_check_per_tensor_(grads, found_inf, inv_scale, flags)
        return
    ours = [i for i, g in enumerate(grads) if g.dtype in _FUSED_UNSCALE_DTYPES]
    rest = [i for i, g in enumerate(grads) if g.dtype not in _FUSED_UNSCALE_DTYPES]
    if not rest:
        fused(grads, found_inf, inv_scale, flags=flags)
        return
    if ours:
        own = None if flags is None else flags.new_zeros(len(ours))
        fused([grads[i] for i in ours], found_inf, inv_scale, flags=own)
        if flags is not None and own is not None:
            _scatter_max_(flags, ours, own)
    if flags is None:
        torch_unscale_check_([grads[i] for i in rest], found_inf, inv_scale)
    else:
        own = flags.new_zeros(len(rest))
        torch_unscale_check_per_tensor_([grads[i] for i in rest], found_inf, inv_scale, own)
        _scatter_max_(flags, rest, own)


def _scatter_max_(flags: torch.Tensor, indices: list[int], values: torch.Tensor) -> None:
    where = torch.tensor(indices, dtype=torch.int64, device=flags.device)
    flags.index_copy_(0, where, torch.maximum(flags.index_select(0, where), values))
