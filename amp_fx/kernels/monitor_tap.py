"""The calls the fp8 monitor puts in a monitored graph (:mod:`amp_fx.passes.monitor_fp8`).

:func:`operand_stats` is :func:`amp_fx.kernels.quant_stats.quant_stats` with the recipe's NVFP4
switches as three booleans (FX writes constants of these types back as code). :func:`grad_tap`
passes a converted GEMM's output through unchanged and, in the backward, computes the statistics
of the gradient that arrives there (the GEMM's ``grad_output`` operand) and hands them out as the
gradient of ``sink``, a float64 ``[G, F]`` leaf: row ``row`` holds them, the other rows zeros. The
taps of one graph share the sink, so autograd adds their rows (``0 + x == x``, exact) and
AOTAutograd puts the computation in the backward graph: no host read, no side effect outside
autograd.

    >>> import torch
    >>> from amp_fx.fp8 import Fp8Recipe
    >>> sink = torch.zeros(2, len(STAT_NAMES), dtype=torch.float64, requires_grad=True)
    >>> out = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    >>> grad_tap(out, sink, 1, Fp8Recipe.TENSORWISE, False, False, False).float().sum().backward()
    >>> bool(sink.grad[0].eq(0).all()), int(sink.grad[1][STAT_NAMES.index("numel")])
    (True, 32)
"""

from __future__ import annotations

from typing import Any

import torch

from amp_fx.fp8 import Fp8Recipe, Nvfp4Options
from amp_fx.kernels import quant_stats as _qs

__all__ = ["operand_stats", "grad_tap", "STAT_NAMES"]

STAT_NAMES: tuple[str, ...] = _qs.FIGURES
"""The entries of each statistics row, in order (:mod:`amp_fx.kernels.quant_stats`)."""


def _nvfp4(recipe: Fp8Recipe, rht: bool, stochastic_rounding: bool, weight_2d: bool) -> Nvfp4Options | None:
    return Nvfp4Options(rht, stochastic_rounding, weight_2d) if recipe is Fp8Recipe.NVFP4 else None


@torch.no_grad()
def operand_stats(
    hp: torch.Tensor, recipe: Fp8Recipe, operand: str, rht: bool, stochastic_rounding: bool, weight_2d: bool
) -> torch.Tensor:
    """The float64 statistics row of ``hp`` as ``recipe`` quantizes it for ``operand``."""
    return _qs.quant_stats(hp.detach(), recipe, operand, nvfp4=_nvfp4(recipe, rht, stochastic_rounding, weight_2d))


class _GradTap(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        out: torch.Tensor,
        sink: torch.Tensor,
        row: int,
        recipe: Fp8Recipe,
        rht: bool,
        stochastic_rounding: bool,
        weight_2d: bool,
    ) -> torch.Tensor:
        ctx.row, ctx.recipe, ctx.flags, ctx.sink_shape = row, recipe, (rht, stochastic_rounding, weight_2d), sink.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        stats = operand_stats(grad, ctx.recipe, "grad_output", *ctx.flags)
        rows = torch.zeros(ctx.sink_shape, dtype=torch.float64, device=grad.device)
        return grad, torch.select_scatter(rows, stats, 0, ctx.row), None, None, None, None, None


def grad_tap(
    out: torch.Tensor,
    sink: torch.Tensor,
    row: int,
    recipe: Fp8Recipe,
    rht: bool,
    stochastic_rounding: bool,
    weight_2d: bool,
) -> torch.Tensor:
    """``out`` unchanged; its gradient's statistics go to row ``row`` of ``sink``'s gradient."""
    return _GradTap.apply(out, sink, row, recipe, rht, stochastic_rounding, weight_2d)
