"""advise, reporting: the result (:class:`Advice`) and its forms: the text ``print(advice)`` gives
(verdict, errors by part, cost, kept modules, the module table, the fp8 matmuls, the search in words,
the policy as code), JSON (``to_dict``, ``to_json``) and a self-contained HTML page (``to_html``)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from amp_fx._common.dtype_names import dtype_name
from amp_fx.fp8 import Fp8Config, Fp8Recipe
from amp_fx.inspect.advice._cost import Cost, KeptModule
from amp_fx.inspect.advice._findings import PRECISION, ModuleStats, inside
from amp_fx.inspect.advice._fp8_sizing import Fp8Matmul
from amp_fx.inspect.advice._training import TrainingComparison
from amp_fx.inspect.advice._verify import initial_scale
from amp_fx.inspect.nonfinite import policy_code
from amp_fx.low_precision import LowPrecision
from amp_fx.low_precision import code as low_precision_code
from amp_fx.overflow.report import scale_text
from amp_fx.policy import Policy

__all__: list[str] = []


def _fmt(x: float | None, spec: str = ".2g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if math.isinf(x):
        return "inf"
    return format(x, spec)


@dataclass(frozen=True)
class Advice:
    """What :func:`advise` found. ``print(advice)`` ends with the policy as code."""

    dtype: torch.dtype
    policy: Policy
    target: float
    error: float
    """End-to-end error with the advised policy (max of loss, gradients and outputs, normwise
    relative to float64)."""
    baseline_error: float
    """The same with the default policy (eager autocast, which amp_fx matches bit for bit)."""
    verified: bool
    """The advised policy ran end to end with no inf/NaN and ``error <= target``."""
    modules: tuple[ModuleStats, ...]
    """Per module, measured with the default policy, in the order their first call finished."""
    cost: Cost
    loss_scale: float
    """The loss scale the advised policy's gradients were measured at: GradScaler's initial 2**16
    for fp16, halved while they overflowed (as GradScaler backs off); 1 for bf16. The per-module
    gradient headroom and underflow are at the initial scale."""
    runs: int
    """End-to-end policy runs made, the default policy's included (the float64 reference not)."""
    steps: tuple[str, ...] = ()
    """The search, in words."""
    training: TrainingComparison | None = None
    grads_measured: bool = False
    parts: tuple[tuple[str, float | None], ...] = ()
    """The advised policy's end-to-end error by part: (``output``, ``loss``, ``gradients``)."""
    baseline_parts: tuple[tuple[str, float | None], ...] = ()
    kept: tuple[KeptModule, ...] = ()
    """Per kept module, the ops the keep moves to fp32 and their share of the FLOPs."""
    fp8: Fp8Config | None = None
    """The fp8 recipe advised for (``advise(..., fp8=...)``); the policy then keeps modules out of
    fp8 (:attr:`keep_out_of_fp8`), not in fp32."""
    fp8_matmuls: tuple[Fp8Matmul, ...] = ()
    """With ``fp8``: each matmul that ran in fp8 with every eligible matmul in fp8, with its error
    and whether it is too small to gain."""
    _explain: Callable[[Policy], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def low_precision(self) -> LowPrecision | None:
        """With ``fp8``: the advice as a recipe per module, to pass back as
        ``amp_fx.compile(model, dtype=..., low_precision=advice.low_precision)``: the recipe for
        every matmul, None (``dtype``) for the modules kept out of it. The same matmuls run in
        low precision as with ``fp8=recipe, policy=advice.policy``; None without ``fp8``."""
        if self.fp8 is None:
            return None
        return LowPrecision(recipe=self.fp8.recipe, modules=dict.fromkeys(self.keep_out_of_fp8), nvfp4=self.fp8.nvfp4)

    @property
    def keep_fp32(self) -> tuple[str, ...]:
        return tuple(k for k in self.policy.keep_fp32 if isinstance(k, str))

    @property
    def keep_out_of_fp8(self) -> tuple[str, ...]:
        """With ``fp8``: the modules whose matmuls the advice keeps in the autocast dtype."""
        return tuple(k for k in self.policy.keep_out_of_fp8 if isinstance(k, str))

    @property
    def too_small_for_fp8(self) -> tuple[str, ...]:
        """With ``fp8``: modules whose every fp8 matmul is too small to gain (:func:`fp8_too_small`):
        candidates to keep out of fp8 for speed, not for error."""
        mods = dict.fromkeys(m.module for m in self.fp8_matmuls)
        return tuple(n for n in mods if all(m.too_small for m in self.fp8_matmuls if m.module == n))

    @property
    def hazards(self) -> tuple[ModuleStats, ...]:
        """Modules whose values or gradients do not fit the dtype (not a matter of precision)."""
        return tuple(s for s in self.modules if s.finding and s.finding not in PRECISION)

    def module(self, name: str) -> ModuleStats:
        for s in self.modules:
            if s.name == name:
                return s
        raise KeyError(f"amp_fx: no measured module {name!r}")

    def table(self, *, limit: int | None = 40) -> str:
        headers, rows, hidden = self._measurement_rows(limit=limit)
        text = tabulate(rows, headers=headers)
        return text + (f"\n... {hidden} more modules (advice.modules has them all)" if hidden > 0 else "")

    def _measurement_rows(self, *, limit: int | None = 40) -> tuple[list[str], list[list[str]], int]:
        """What :meth:`table` prints: its headers, its rows (findings first, then by output error)
        and how many modules the limit left out; the HTML page lays the same rows out as a table."""
        rows = []
        ranked = sorted(self.modules, key=lambda s: (not s.finding, -_sort_key(s.output_error)))
        shown = [s for s in ranked if s.name][:limit]
        for s in shown:
            row = [
                s.name,
                s.type,
                _fmt(s.output_error),
                _fmt(s.amplification, ".3g"),
                _fmt(s.headroom, ".2g"),
                _fmt(s.weight_headroom, ".2g"),
                _fmt(s.underflow, ".2g"),
            ]
            if self.grads_measured:
                row += [_fmt(s.grad_error), _fmt(s.grad_headroom), _fmt(s.grad_underflow)]
            if self.fp8 is not None:
                row += [_fmt(s.fp8_error)]
            kept = self.keep_out_of_fp8 if self.fp8 is not None else self.keep_fp32
            row += [("KEPT " if s.name in kept else "") + s.finding]
            rows.append(row)
        headers = ["module", "type", "out err", "amplif.", "headroom", "w headroom", "underflow"]
        if self.grads_measured:
            headers += ["grad err", f"grad headroom (x{initial_scale(self.dtype):g})", "grad underflow"]
        if self.fp8 is not None:
            headers += ["fp8 err"]
        headers += ["finding"]
        return headers, rows, len([s for s in self.modules if s.name]) - len(shown)

    def __str__(self) -> str:
        low = dtype_name(self.dtype)
        if self.fp8 is not None:
            low += f", fp8 {self.fp8.recipe.value}"
            verdict = (
                "every matmul in fp8 meets the target: nothing to keep out of fp8"
                if not self.keep_out_of_fp8 and self.verified
                else f"keep {', '.join(self.keep_out_of_fp8)} out of fp8"
                if self.keep_out_of_fp8
                else "no policy found that meets the target"
            )
            if not self.fp8_matmuls:
                verdict = "no matmul ran in fp8 (none the fp8 pass converts: see amp_fx.explain(..., fp8=...))"
        else:
            verdict = (
                "default policy meets the target: nothing to keep in fp32"
                if not self.keep_fp32 and self.verified
                else f"keep {', '.join(self.keep_fp32)} in fp32"
                if self.keep_fp32
                else "no policy found that meets the target"
            )
        cost = (
            f"cost: {self.cost.fp32_flop_share:.1%} of matmul/conv/attention FLOPs in fp32 "
            f"(default {self.cost.default_fp32_flop_share:.1%}); casts move "
            f"{self.cost.cast_bytes} B per forward (default {self.cost.default_cast_bytes} B)"
        )
        if self.fp8 is not None:
            cost = (
                f"cost: {_fmt(self.cost.fp8_flop_share, '.1%')} of matmul/conv/attention FLOPs in fp8 "
                f"(every eligible matmul: {_fmt(self.cost.default_fp8_flop_share, '.1%')})"
            )
        # fp16: the scale the verdict was measured at (bf16 trains unscaled)
        scaled = f", loss scale {scale_text(self.loss_scale)}" if self.dtype == torch.float16 else ""
        lines = [
            f"amp_fx.advise ({low}{scaled}): {verdict}",
            *self._hazards_beside_the_verdict(),
            f"end-to-end error vs float64: default {_fmt(self.baseline_error, '.3g')}, advised "
            f"{_fmt(self.error, '.3g')}, target {self.target:.3g} "
            f"({'verified' if self.verified else 'NOT verified'}; {self.runs} policy run(s))",
            "  by part, default / advised: "
            + "; ".join(
                f"{k} {_fmt(a, '.3g')} / {_fmt(b, '.3g')}"
                for (k, a), (_, b) in zip(self.baseline_parts, self.parts)
                if a is not None or b is not None
            ),
            cost,
        ]
        lines += [f"{'kept:' if i == 0 else '     '} {k}" for i, k in enumerate(self.kept)]
        if self.training is not None:
            t = self.training
            lines.append(
                f"training {t.steps} steps: loss strays from fp32's by at most "
                f"{_fmt(t.default_divergence, '.3g')} (default) and "
                f"{_fmt(t.advised_divergence, '.3g')} (advised), relative"
            )
        lines += ["", "modules (measured with the default policy; hazards first):", self.table()]
        if self.fp8 is not None and self.fp8_matmuls:
            lines += ["", "fp8 matmuls (every eligible matmul in fp8):", self.fp8_table()]
        if self.steps:
            lines += ["", "search:"] + [f"  {s}" for s in self.steps]
        lines += ["", "policy:", "  from amp_fx import Policy", f"  policy = {policy_code(self.policy)}"]
        if (lp := self.low_precision) is not None:
            lines += [
                "",
                "or, as a recipe per module (the same matmuls in low precision):",
                "  from amp_fx import LowPrecision" + (", Nvfp4Options" if lp.nvfp4 is not None else ""),
                f"  low_precision = {low_precision_code(lp)}",
                f'  amp_fx.compile(model, dtype="{dtype_name(self.dtype)}", low_precision=low_precision)',
            ]
        return "\n".join(lines)

    def _hazards_beside_the_verdict(self) -> list[str]:
        """Where the table marks hazards that the verdict keeps nothing for, why both hold: the
        table is measured at GradScaler's initial scale, the verdict at the scale the gradients
        settled at (a backed-off scale fits them: steps skipped at the start, not a layer to keep),
        or the default policy met the target end to end despite them. Nothing where the verdict
        keeps something or the table marks nothing."""
        kept = self.keep_out_of_fp8 if self.fp8 is not None else self.keep_fp32
        marked = [s for s in self.hazards if s.name and s.name not in kept]
        if not marked or not self.verified:
            return []
        lines = []
        grads = [s for s in marked if s.finding == "gradient overflow"]
        initial = initial_scale(self.dtype)
        if grads and self.loss_scale < initial:
            skips = round(math.log2(initial / self.loss_scale))  # torch's backoff_factor halves it per skip
            named = sum(1 for m in self.modules if m.name)
            lines.append(
                f"  the table marks {len(grads)} of {named} modules 'gradient overflow': at GradScaler's "
                f"initial scale {scale_text(initial)} their scaled gradients overflow {dtype_name(self.dtype)}; "
                f"the scale backs off while they do (as GradScaler does) and the verdict is at "
                f"{scale_text(self.loss_scale)}, where they fit: about {skips} skipped steps at the start of "
                f"training (a smaller init_scale skips fewer), nothing to keep"
            )
            marked = [s for s in marked if s not in grads]
        if marked:
            findings = ", ".join(sorted({s.finding for s in marked}))
            lines.append(
                f"  the table marks {len(marked)} module(s) not kept ({findings}): the advised policy still "
                f"met the target end to end at loss scale {scale_text(self.loss_scale)}"
            )
        return lines

    def fp8_table(self, *, limit: int | None = 40) -> str:
        """With ``fp8``: each matmul that ran in fp8, its shape, FLOPs per call, error and whether
        it is too small to gain (:func:`fp8_too_small`, whose thresholds the table's note states)."""
        assert self.fp8 is not None
        rows = [
            [
                m.module or "<root>",
                m.op,
                "x".join(map(str, m.shape)),
                m.calls,
                f"{m.flops:.3g}",
                _fmt(m.error),
                ("KEPT " if any(inside(m.module, k) for k in self.keep_out_of_fp8) else "")
                + ("too small" if m.too_small else ""),
            ]
            for m in self.fp8_matmuls[:limit]
        ]
        text = tabulate(rows, headers=["module", "op", "MxKxN", "calls", "FLOPs/call", "fp8 err", ""])
        hidden = len(self.fp8_matmuls) - len(rows)
        rule = (
            "K <= 4096 and N <= 1024"
            if self.fp8.recipe is Fp8Recipe.TENSORWISE
            else "N <= 2048, K <= 1024, or N <= 4096 and K <= 2048"
        )
        small = sum(m.too_small for m in self.fp8_matmuls)
        return (
            text
            + (f"\n... {hidden} more (advice.fp8_matmuls has them all)" if hidden > 0 else "")
            + f"\n{small} of {len(self.fp8_matmuls)} too small to gain on an H100 by torchao 0.18's "
            f"rule for {self.fp8.recipe.value} ({rule}; K in, N out features; from its H100 "
            f"benchmarks, _auto_filter_for_recipe)"
            + (
                "; mxfp8 has no such rule: rowwise's stands in, and without a Blackwell GPU "
                "every mxfp8 matmul runs emulated, slower than bf16"
                if self.fp8.recipe is Fp8Recipe.MXFP8
                else ""
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """The advice as JSON-ready data (what ``amp-fx advise --json`` prints)."""

        def clean(x: Any) -> Any:
            if isinstance(x, float) and not math.isfinite(x):
                return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
            return x

        return {
            "dtype": dtype_name(self.dtype),
            "keep_fp32": list(self.keep_fp32),
            "fp8": None if self.fp8 is None else self.fp8.recipe.value,
            "keep_out_of_fp8": list(self.keep_out_of_fp8),
            "fp8_matmuls": [{**asdict(m), "flops": m.flops} for m in self.fp8_matmuls],
            "policy": policy_code(self.policy),
            "low_precision": None if self.low_precision is None else low_precision_code(self.low_precision),
            "target": self.target,
            "error": clean(self.error),
            "baseline_error": clean(self.baseline_error),
            "verified": self.verified,
            "loss_scale": self.loss_scale,
            "runs": self.runs,
            "steps": list(self.steps),
            "parts": {k: clean(v) for k, v in self.parts},
            "baseline_parts": {k: clean(v) for k, v in self.baseline_parts},
            "cost": {k: clean(v) for k, v in asdict(self.cost).items()},
            "kept": [
                {"name": k.name, "type": k.type, "ops": dict(k.ops), "flop_share": k.flop_share} for k in self.kept
            ],
            "modules": [{k: clean(v) for k, v in asdict(s).items()} for s in self.modules],
            "training": None
            if self.training is None
            else {
                "steps": self.training.steps,
                "fp32": list(self.training.fp32),
                "default": [clean(x) for x in self.training.default],
                "advised": [clean(x) for x in self.training.advised],
                "default_divergence": clean(self.training.default_divergence),
                "advised_divergence": clean(self.training.advised_divergence),
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_html(self, path: str | Path, *, graph: Any = True) -> Path:
        """Write one self-contained page: per-module error and headroom as SVG bar charts, the
        policy, the table, and ``explain``'s summary and picture of the model under the advised
        policy (``graph=True``, one amp_fx compile; or an :class:`~amp_fx.Explanation` to show;
        ``False`` for none). The picture is inline SVG where Graphviz is installed, DOT text where
        it is not."""
        from amp_fx.inspect._advice_html import render

        note = ""
        if graph is True:
            graph = None
            if self._explain is not None:
                try:
                    graph = self._explain(self.policy)
                except Exception as e:  # the page is still worth writing without the picture
                    note = f"amp_fx.explain failed on this model ({type(e).__name__}: {e})"
        elif graph is False:
            graph = None
        out = Path(path)
        out.write_text(render(self, graph, note))
        return out


def _sort_key(x: float) -> float:
    return -1.0 if math.isnan(x) else (1e300 if math.isinf(x) else x)
