"""``amp_fx.fp8_stats``: the fp8 monitor's figures, read from the device when asked.

The one host read of the monitor: the buffers of each monitored graph (:mod:`amp_fx.monitor.state`)
are copied to the host, and each GEMM operand's row becomes a :class:`GemmStats`. Fractions are
computed here, in float64, from the exact counts the graph kept (an underflow fraction is
``underflows / nonzero`` of the same operand, bit for bit the division of the two float64 counts).
:class:`Fp8Stats` sorts them worst first and names the reason; :meth:`Fp8Stats.to_dict` gives
TensorBoard/W&B scalars under TransformerEngine's stat names where the figure is the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tabulate import tabulate

from amp_fx._common.unwrap import layers
from amp_fx.fp8 import Fp8Config
from amp_fx.low_precision import LowPrecision, RecipeLike, Selector

__all__ = ["fp8_stats", "Fp8Stats", "GemmStats"]


@dataclass(frozen=True)
class GemmStats:
    """One operand of one converted GEMM, at one logging step."""

    gemm: str
    """The GEMM as named in the report: its module (``lm_head``), else its weight."""
    module: str
    weight: str
    recipe: str
    operand: str
    """``input``, ``weight`` or ``grad_output``."""
    step: int
    """The step whose figures these are."""
    figures: Mapping[str, float]
    """The raw entries of :data:`amp_fx.kernels.monitor_tap.STAT_NAMES` (counts exact, float64)."""

    @property
    def nonzero(self) -> float:
        return self.figures["nonzero"]

    @property
    def underflow(self) -> float:
        """The fraction of nonzero values that quantize to zero (0 where all are zero)."""
        return self.figures["underflow"] / self.nonzero if self.nonzero else 0.0

    @property
    def saturation(self) -> float:
        """The fraction of nonzero values clipped at the format's largest value."""
        return self.figures["saturated"] / self.nonzero if self.nonzero else 0.0

    @property
    def mse(self) -> float:
        """The quantization's relative mean squared error against the high-precision operand."""
        f = self.figures
        return f["err_sq_sum"] / f["hp_sq_sum"] if f["hp_sq_sum"] else 0.0

    @property
    def severity(self) -> tuple[float, float]:
        """Worst first: the larger of the two lost fractions, then the relative error."""
        worst = max(self.underflow, self.saturation)
        return (worst if not math.isnan(worst) else math.inf, self.mse if not math.isnan(self.mse) else math.inf)

    @property
    def reason(self) -> str:
        """One line: what is worst about this operand."""
        where = f"{self.gemm} {self.operand.replace('_', ' ')}"
        if self.underflow >= self.saturation and self.underflow > 0:
            return f"{where}: {100 * self.underflow:.3g} % of values flushed to zero"
        if self.saturation > 0:
            return f"{where}: {100 * self.saturation:.3g} % of values saturated at the format's max"
        return f"{where}: relative error {self.mse:.3g}"

    def scalars(self) -> dict[str, float]:
        """This operand's figures for a dashboard: TransformerEngine's (its names, its definitions:
        per cent of all elements, absolute MSE; :func:`amp_fx.kernels.quant_stats.te_stats`), then
        amp_fx's own (fractions of the nonzero values, relative MSE, the median block scale)."""
        from amp_fx.kernels.quant_stats import te_stats

        own = {
            "underflows_of_nonzero%": 100 * self.underflow,
            "saturated_of_nonzero%": 100 * self.saturation,
            "rel_mse": self.mse,
            "scale_inv_median": self.figures["scale_inv_median"],
        }
        return {**te_stats(torch.tensor([self.figures[n] for n in self.figures], dtype=torch.float64)), **own}


@dataclass(frozen=True)
class Fp8Stats:
    """The figures of every monitored GEMM operand, worst first (``str()``: the table)."""

    rows: tuple[GemmStats, ...]
    missing: tuple[str, ...] = ()
    """What has no figures: GEMMs the monitor does not cover, backward rows not computed yet."""
    low_precision: Fp8Config | None = None
    """The compile's ``low_precision=``."""

    def suggest(self, max_lost: float = 0.01) -> LowPrecision | None:
        """A per-module map to pass back as ``low_precision=``: the compile's, with each module
        whose GEMM flushes or saturates more than ``max_lost`` of some operand's nonzero values
        kept in ``dtype`` (None where no module does). A starting point: a finer recipe
        (``"mxfp8"``, ``"nvfp4"``'s 16-value blocks) may serve such a module too."""
        flagged: dict[Selector, RecipeLike] = {
            r.module: None for r in self.rows if r.module and max(r.underflow, r.saturation) > max_lost
        }
        if not flagged or self.low_precision is None:
            return None
        if isinstance(self.low_precision, LowPrecision):
            return LowPrecision(recipe=self.low_precision.recipe, modules={**self.low_precision.modules, **flagged})
        return LowPrecision(recipe=self.low_precision.recipe, modules=flagged, nvfp4=self.low_precision.nvfp4)

    @property
    def worst(self) -> GemmStats | None:
        return self.rows[0] if self.rows else None

    def find(self, gemm: str, operand: str) -> GemmStats:
        """The row of ``gemm``'s ``operand``; KeyError naming what there is."""
        for row in self.rows:
            if row.gemm == gemm and row.operand == operand:
                return row
        raise KeyError(
            f"amp_fx.fp8_stats: no row for {gemm!r} {operand!r}; rows: {[(r.gemm, r.operand) for r in self.rows]}"
        )

    def to_dict(self, prefix: str = "fp8") -> dict[str, float]:
        """``{"<prefix>/<gemm>/<operand>/<stat>": value}`` for ``SummaryWriter.add_scalar`` or
        ``wandb.log``; stats named as TransformerEngine's debug features name them."""
        return {
            f"{prefix}/{row.gemm}/{row.operand}/{name}": value
            for row in self.rows
            for name, value in row.scalars().items()
        }

    def __str__(self) -> str:
        if not self.rows:
            return "amp_fx.fp8_stats: no figures yet (no logging step has run)" + "".join(
                f"\n  {m}" for m in self.missing
            )
        table = tabulate(
            [
                [
                    r.gemm,
                    r.operand,
                    r.recipe,
                    r.step,
                    f"{100 * r.underflow:.4g}",
                    f"{100 * r.saturation:.4g}",
                    f"{r.figures.get('amax', math.nan):.4g}",
                    f"{r.figures.get('scale_inv_min', math.nan):.3g}..{r.figures.get('scale_inv_max', math.nan):.3g}",
                    f"{r.mse:.3g}",
                ]
                for r in self.rows
            ],
            headers=[
                "GEMM",
                "operand",
                "recipe",
                "step",
                "flushed % nonzero",
                "saturated % nonzero",
                "amax",
                "scale_inv min..max",
                "rel. mse",
            ],
        )
        lines = [f"worst: {self.rows[0].reason}", table, *(f"no figures: {m}" for m in self.missing)]
        return "\n".join(lines)


def _state(target: object) -> Any:
    from amp_fx.backend.inplace import inplace_call  # the backend imports this package

    inplace = inplace_call(target)
    if inplace is not None:  # compiled in place: its wrapper, built at the first call
        target = inplace.build()
    for layer in layers(target, any_module_attr=True):
        state = getattr(layer, "amp_fx_monitor", None)
        if state is not None:
            return state
    raise ValueError(
        f"amp_fx.fp8_stats: {type(target).__name__} was not compiled with monitor= (amp_fx.compile(model, "
        f"low_precision=..., monitor=amp_fx.Fp8Monitor(every=100)), or compile_step's monitor=)"
    )


def fp8_stats(model: object) -> Fp8Stats:
    """The monitor's figures for a model (or step) compiled with ``monitor=``: each converted
    GEMM's input, weight and output gradient at the last logging step, worst first.

    The only place the monitor reads the device (one copy per monitored graph).
    """
    from amp_fx.kernels.monitor_tap import STAT_NAMES

    state = _state(model)
    rows: list[GemmStats] = []
    missing = list(state.uncovered)
    for graph in state.graphs.values():
        if graph.logged_step is None:
            continue
        fwd = graph.fwd.detach().to("cpu", torch.float64)
        grad = graph.sink.grad
        back = None if grad is None else grad.detach().to("cpu", torch.float64)
        for gemm in graph.gemms:
            d = gemm.decision
            base = {
                "gemm": gemm.name,
                "module": d.module,
                "weight": d.weight,
                "recipe": d.recipe.value if d.recipe else "?",
                "step": graph.logged_step,
            }
            values = [("input", fwd[gemm.row, 0]), ("weight", fwd[gemm.row, 1])]
            if back is not None:
                values.append(("grad_output", back[gemm.row]))
            else:
                missing.append(f"{gemm.name} grad_output (no backward since step {graph.logged_step})")
            for operand, row in values:
                rows.append(
                    GemmStats(operand=operand, figures=dict(zip(STAT_NAMES, row.tolist(), strict=True)), **base)
                )
    rows.sort(key=lambda r: r.severity, reverse=True)
    return Fp8Stats(tuple(rows), tuple(missing), state.low_precision)
