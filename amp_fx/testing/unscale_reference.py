"""torch baselines for the unscale kernels, shared by the tests and ``bench/bench_unscale.py``.

These are what amp_fx's kernels are measured against, so they call only torch: the unscale is
``amp_fx.kernels.fallback.torch_unscale_check_``, torch's kernel once per dtype (the library's own
fallback, itself nothing but torch's kernel), named here as the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from amp_fx.kernels.fallback import torch_unscale_check_

__all__ = [
    "reference_sum_of_squares_fp64",
    "reference_unscale_check_",
    "torch_unscale_then_clip_",
]


reference_unscale_check_ = torch_unscale_check_
"""``torch._amp_foreach_non_finite_check_and_unscale_`` per dtype, as GradScaler calls it."""


def reference_sum_of_squares_fp64(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``grads`` as stored, via ``torch.linalg.vector_norm`` in float64.

    The fp64 result of squaring and adding values that have at most 24 significant bits is
    exact up to fp64 rounding (relative 1e-16 per term), far below the fp32 errors under test.
    """
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        total = total + torch.linalg.vector_norm(g.detach().to(torch.float64).cpu()).square()
    return total


def torch_unscale_then_clip_(
    params: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    max_norm: float,
) -> torch.Tensor:
    """What ``GradScaler.unscale_(opt)`` + ``clip_grad_norm_(params, max_norm)`` do to grads.

    ``GradScaler.unscale_`` groups grads by device and dtype and calls torch's fused unscale;
    ``clip_grad_norm_`` then reads them again for the norm and multiplies them by the clip
    coefficient (always, clamped to 1.0, to avoid a host sync). Returns the total norm.
    """
    reference_unscale_check_([p.grad for p in params if p.grad is not None], found_inf, inv_scale)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
