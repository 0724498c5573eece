"""amp_fx: automatic mixed precision as a torch.compile graph pass.

model = amp_fx.compile(model, dtype="bf16")
"""

import logging

from amp_fx.api import compile, options_of, records, uncompile
from amp_fx.backend.wrapper import AmpCompiledModule
from amp_fx.errors import AmpFxError, AmpFxWarning, AmpRunError, EagerError, GraphvizNotFound
from amp_fx.fp8 import Fp8Config, Fp8Recipe, Nvfp4Options
from amp_fx.inspect import Advice, CompareReport, Explanation, NonfiniteReport, advise, compare, explain, find_nonfinite
from amp_fx.inspect.precision import PrecisionReport, precision_report
from amp_fx.low_precision import Blocks, LowPrecision
from amp_fx.monitor import Fp8Monitor, Fp8Stats, fp8_stats
from amp_fx.options import Numerics, Options
from amp_fx.overflow import FirstOp, OverflowReport, skip_aware
from amp_fx.policy import CastClass, Policy
from amp_fx.scaler import GradScaler, ScalerMode, StepMode
from amp_fx.step import CompiledStep, GradNorm, compile_step

__all__ = [
    "compile",
    "Fp8Recipe",
    "Fp8Config",
    "Nvfp4Options",
    "LowPrecision",
    "Blocks",
    "AmpCompiledModule",
    "records",
    "uncompile",
    "Options",
    "Numerics",
    "options_of",
    "Policy",
    "CastClass",
    "AmpFxError",
    "AmpFxWarning",
    "EagerError",
    "AmpRunError",
    "explain",
    "Explanation",
    "GraphvizNotFound",
    "compare",
    "CompareReport",
    "find_nonfinite",
    "NonfiniteReport",
    "advise",
    "Advice",
    "precision_report",
    "PrecisionReport",
    "compile_step",
    "CompiledStep",
    "GradNorm",
    "GradScaler",
    "ScalerMode",
    "StepMode",
    "OverflowReport",
    "FirstOp",
    "skip_aware",
    "Fp8Monitor",
    "Fp8Stats",
    "fp8_stats",
]
__version__ = "0.1.0"

# Every module logs to logging.getLogger(__name__), a child of this logger. A library adds only a
# NullHandler (Python's logging HOWTO): where to send records is the application's choice, and
# without one logging's last-resort handler no longer prints amp_fx's records to stderr.
logging.getLogger(__name__).addHandler(logging.NullHandler())
