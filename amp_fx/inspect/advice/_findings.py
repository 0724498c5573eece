"""advise, measuring (its last step): what one run's measurements of a module show. The per-module
record (:class:`ModuleStats`) and its finding: an inf/NaN onset, a value or weight out of the dtype's
range, an fp8 GEMM off by more than :data:`FP8_ERROR_HAZARD`, a gradient overflow (hazards), or
error that grows in the module or after it (a precision cost)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from amp_fx.fp8 import Fp8Config
from amp_fx.kernels.fp8_recipes import E4M3

__all__: list[str] = []

FP8_ERROR_HAZARD = 4 * 2.0**-4
"""With ``fp8=``: a matmul whose fp8 forward GEMM is off its high-precision result by more than this
(normwise relative, 4 units of e4m3's rounding, 2**-4) is a hazard (finding ``fp8 error``). A healthy
fp8 GEMM, both operands in e4m3, is off by about 0.6 of a unit: 0.035-0.045 on GPT-2 and on an MLP
(random init, tensorwise and rowwise); an outlier that flushes the rest of its tensor to zero, or
an input whose signal sits below e4m3's 3 mantissa bits, costs order 1."""


@dataclass(frozen=True)
class ModuleStats:
    """One module's measurements in one run (the worst over its calls)."""

    name: str
    type: str
    calls: int
    output_error: float
    """Normwise relative error of its output against float64 (see
    :func:`~amp_fx.inspect.advice._errors.rel_error`)."""
    input_error: float
    """The same for its inputs: the error it was handed."""
    amplification: float
    """output_error / max(input_error, unit roundoff): how much error the module itself adds."""
    headroom: float
    """max |output| (float64 reference) / the dtype's largest finite value; >= 1 overflows."""
    underflow: float
    """Fraction of non-zero output values that the dtype holds as subnormal or zero."""
    weight_headroom: float
    """max |parameter| of the module itself / the dtype's largest finite value; >= 1: its cast
    overflows."""
    low_precision: bool
    """Its output is fp16/bf16 under the policy run."""
    finite: bool
    """Its output is finite under the policy run."""
    inputs_finite: bool
    grad_error: float | None = None
    """Normwise relative error of its parameters' gradients (all under it) against float64."""
    grad_headroom: float | None = None
    """max |gradient| * loss scale / the dtype's largest finite value."""
    grad_underflow: float | None = None
    """Fraction of non-zero gradient values that, times the loss scale, are subnormal or zero
    in the dtype."""
    low_precision_ops: int = 0
    """Low-precision ops run inside it (its descendants included): ops autocast ran in the dtype by
    its lower-precision list (matmuls, convolutions, attention). Keeping the module in fp32 moves
    exactly these; with 0 it would change no op's dtype, and advise never keeps it."""
    fp8_error: float | None = None
    """With ``fp8=``: the largest error fp8 added to the forward GEMM of a matmul the module itself
    ran in fp8 (normwise relative to the same GEMM in fp32 on the same inputs); None where it ran
    none."""
    amplified_after: float | None = None
    """How much the code after it amplified the rounding of its low-precision ops before the next
    module, the output or the loss read the value (their error there over this module's output
    error; a cancellation in the parent's ``forward``); None when no such growth was measured."""
    finding: str = ""
    """``non-finite``, ``overflow``, ``weight overflows``, ``fp8 error`` (with ``fp8=``: its fp8
    GEMM's error exceeds :data:`FP8_ERROR_HAZARD`), ``gradient overflow``, ``amplifies``
    (a precision cost), ``amplified after`` (a precision cost, in the code after it: see
    :attr:`amplified_after`), ``discarded inf/NaN`` (its output held inf/NaN but the run's outputs,
    loss and gradients are finite: a value the model masks, e.g. T5's log of 0; not a hazard) or
    empty."""


def grain(dtype: torch.dtype, fp8: Fp8Config | None) -> torch.dtype:
    """The dtype whose rounding judges error growth: e4m3's with fp8 on (an fp8 GEMM's error is
    e4m3's, 16 times bf16's), else the autocast dtype's."""
    return E4M3 if fp8 is not None else dtype


def inside(name: str, module: str) -> bool:
    return module == "" or name == module or name.startswith(module + ".")


def _onsets(modules: dict[str, ModuleStats]) -> list[str]:
    """The innermost modules whose output is not finite although their inputs are."""
    hits = [n for n, s in modules.items() if n and not s.finite and s.inputs_finite]
    return [n for n in hits if not any(o != n and inside(o, n) for o in hits)]


def grows(growth: float, error: float, dtype: torch.dtype) -> bool:
    # error multiplied by more than 16 roundings' worth, ending above 4 eps: well outside what one
    # rounding per op gives (amplification ~1-3 in healthy runs)
    return growth > 16 and error > 4 * torch.finfo(dtype).eps


def amplifies(s: ModuleStats, dtype: torch.dtype) -> bool:
    """The module multiplies the error it is handed (:func:`grows`)."""
    return math.isfinite(s.amplification) and grows(s.amplification, s.output_error, dtype)


DISCARDED = "discarded inf/NaN"
FP8_ERROR = "fp8 error"
AMPLIFIED_AFTER = "amplified after"
PRECISION = ("amplifies", AMPLIFIED_AFTER, DISCARDED)
"""Findings that are not hazards: a precision cost, or an inf/NaN the model discards."""


def with_findings(modules: dict[str, ModuleStats], dtype: torch.dtype, finite: bool) -> dict[str, ModuleStats]:
    """Each module's finding; with ``finite`` (the run's outputs, loss and gradients), an inf/NaN
    onset was discarded inside the model (a ``where``, ``min`` or integer cast), not a hazard."""
    onsets = set(_onsets(modules))
    out = {}
    for n, s in modules.items():
        finding = ""
        if n in onsets:
            finding = DISCARDED if finite else "non-finite"
        elif s.weight_headroom >= 1 and s.low_precision:
            finding = "weight overflows"
        elif s.headroom >= 1 and s.low_precision:
            finding = "overflow"
        elif s.fp8_error is not None and s.fp8_error > FP8_ERROR_HAZARD:
            finding = FP8_ERROR
        elif (
            s.grad_headroom is not None
            and s.grad_headroom >= 1
            and not any(c != n and inside(c, n) and (modules[c].grad_headroom or 0) >= 1 for c in modules)
        ):
            finding = "gradient overflow"
        elif n and amplifies(s, dtype):
            finding = "amplifies"
        elif s.amplified_after is not None:
            finding = AMPLIFIED_AFTER
        out[n] = ModuleStats(**{**asdict(s), "finding": finding})
    return out
