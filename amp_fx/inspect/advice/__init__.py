"""amp_fx.advise: which modules to keep in fp32 for fp16/bf16 training, measured and verified.

How it works. Every run is eager, on a private copy of the model, with a hook on every module:

1. the reference: the model and its floating inputs in float64, no autocast; each module's
   inputs and outputs and each parameter's gradient are kept;
2. the default policy: ``torch.autocast(device, dtype)`` (amp_fx reproduces it bit for bit), with
   the loss scaled as ``GradScaler`` starts (2**16 for fp16; bf16 needs no scaling: 1); each
   module's output is compared with the reference as it is produced (error, headroom, underflow)
   and dropped. A dispatch mode (:class:`~amp_fx.inspect._flow.Flow`) records which module ran
   each *low-precision op* (one autocast runs in the dtype by its lower-precision list: matmuls,
   convolutions, attention) and, for every value, the modules whose low-precision ops produced it;
   where a module, the output or the loss reads a value, its error is compared with the error its
   producers' outputs carried: growth there (a cancellation in the parent's ``forward``, after the
   module returned) is attributed to the producers (``amplified after``);
3. if that run is non-finite or its end-to-end error (loss, gradients, outputs against float64)
   exceeds the target, candidates are ranked from step 2's local measurements (first the innermost
   modules where inf/NaN first appears or whose values or weights do not fit the dtype, then the
   producers whose rounding grew after them, then the modules that amplify error most: output
   error over input error) and policies are tried in order, each one end-to-end run: the hazards;
   then the next onset of inf/NaN, or the next candidates by rank (1, 2, 4, ... at a time); then
   each kept module with something found inside it is tried as that smaller part (a leaf before
   its parent); finally each kept module is dropped again if the rest still meets the target. A
   policy keeps a module in fp32 the way ``Policy(keep_fp32=...)`` does in amp_fx: every op
   inside runs in fp32 (here: autocast disabled inside the module, its inputs cast to fp32).

Only modules that run a low-precision op are ever kept: keeping any other (a dropout, an
activation) moves no low-precision op to fp32, it only upcasts the values passing through, and
keeping the module that produced them does that too; a hazard found in one stands for the
producers of its inputs.

The number of runs grows with the number of hazards, not with the number of modules: a healthy
model costs one float64 and one low-precision forward+backward.

    >>> advice = amp_fx.advise(model, x, dtype="fp16", loss_fn=lambda out: out.float().pow(2).mean())  # doctest: +SKIP
    >>> print(advice)                                                                 # doctest: +SKIP

The files follow those phases, in the order a run goes through them:

    _advise.py      the entry point: checks the arguments, runs the phases, builds the Advice
    _errors.py      measuring: normwise relative error, headroom, underflow
    _reference.py   measuring, step 1: the float64 reference
    _measure.py     measuring, step 2: one policy run, module by module (hooks, Flow, fp8 mode)
    _findings.py    measuring, last: each module's record (ModuleStats) and its finding
    _verify.py      verifying: a run's end-to-end error (loss scale backoff) and the verdict
    _search.py      searching, step 3: grow, narrow and drop the keep-list
    _cost.py        the cost: FLOPs by dtype, cast bytes; what each kept module moves
    _fp8_sizing.py  with fp8=: each fp8 matmul and whether it is too small to gain
    _training.py    with steps=: the loss curves, fp32 against each policy
    _report.py      reporting: Advice, its text, table, JSON and HTML page
"""

# fp8_too_small and _keep_in_fp32 are reachable here as they were when advice was one module (the
# docstrings name the first, tests/inspect/test_advise.py imports the second), and stay out of __all__
from amp_fx.inspect.advice._advise import DEFAULT_TARGETS, advise
from amp_fx.inspect.advice._cost import Cost, KeptModule
from amp_fx.inspect.advice._findings import FP8_ERROR_HAZARD, ModuleStats
from amp_fx.inspect.advice._fp8_sizing import Fp8Matmul, fp8_too_small  # noqa: F401
from amp_fx.inspect.advice._measure import keep_in_fp32 as _keep_in_fp32  # noqa: F401
from amp_fx.inspect.advice._report import Advice
from amp_fx.inspect.advice._training import TrainingComparison

__all__ = [
    "advise",
    "Advice",
    "ModuleStats",
    "KeptModule",
    "Cost",
    "TrainingComparison",
    "Fp8Matmul",
    "DEFAULT_TARGETS",
    "FP8_ERROR_HAZARD",
]
