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

__all__ = ["unscale_check_any_dtype_", "torch_unscale_check_"]

logger = logging.getLogger(__name__)

_UnscaleFn = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor], None]
_FUSED_UNSCALE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def torch_unscale_check_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
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
        from amp_fx._report import did_less

        did_less("kernels.unscale import", f"amp_fx: amp_fx.kernels.unscale could not be imported ({e}); "
                 "GradScaler uses torch's unscale kernel (same results, no fused norm). Install a triton "
                 "that matches torch to use amp_fx's kernel.")
        return None
    return cast(_UnscaleFn, unscale_check_)


def unscale_check_any_dtype_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """Check and unscale gradients of one device in place, any floating dtype."""
    fused = _fused_unscale_kernel()
    if fused is None:
        torch_unscale_check_(grads, found_inf, inv_scale)
        return
    ours = [g for g in grads if g.dtype in _FUSED_UNSCALE_DTYPES]
    rest = [g for g in grads if g.dtype not in _FUSED_UNSCALE_DTYPES]
    if ours:
        fused(ours, found_inf, inv_scale)
    if rest:
        torch_unscale_check_(rest, found_inf, inv_scale)
