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
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.report import did_less
from amp_fx.errors import AmpFxError
from amp_fx.fp8 import Fp8Config, Fp8Like, Fp8Recipe
from amp_fx.inspect._flow import Flow, compute_flops
from amp_fx.inspect._fp8_eager import Fp8Call, Fp8Eager, module_stack
from amp_fx.inspect._probe import module_hooks as _hooks
from amp_fx.inspect._probe import tensors_of
from amp_fx.inspect._runner import SEED, Call, private_copy, run_eager_checked
from amp_fx.inspect.nonfinite import policy_code
from amp_fx.kernels.fp8_matmul import E4M3, RECIPES, rowwise_scales_missing
from amp_fx.policy import Policy, resolve_dtype

__all__ = ["advise", "Advice", "ModuleStats", "KeptModule", "Cost", "TrainingComparison", "Fp8Matmul",
           "DEFAULT_TARGETS", "FP8_ERROR_HAZARD"]

DEFAULT_TARGETS = {torch.bfloat16: 32 * 2.0 ** -7, torch.float16: 32 * 2.0 ** -10}
"""The largest end-to-end error (loss, gradients, outputs; normwise relative to float64) a policy
may leave: 32 units of rounding (eps) of the dtype, 0.25 for bf16 and 0.031 for fp16. Eager
autocast's own error on GPT-2, Llama and BERT (random init, 2 layers x 64) is about 0.75 eps
(tests/test_advise.py::test_real_model_no_false_alarm), 40 times below, while a hazard (inf/NaN,
a signal lost to cancellation) costs order 1, hundreds of eps."""

FP8_ERROR_HAZARD = 4 * 2.0 ** -4
"""With ``fp8=``: a matmul whose fp8 forward GEMM is off its high-precision result by more than this
(normwise relative, 4 units of e4m3's rounding, 2**-4) is a hazard (finding ``fp8 error``). A healthy
fp8 GEMM, both operands in e4m3, is off by about 0.6 of a unit: 0.035-0.045 on GPT-2 and on an MLP
(random init, tensorwise and rowwise); an outlier that flushes the rest of its tensor to zero, or
an input whose signal sits below e4m3's 3 mantissa bits, costs order 1."""

_LOW = (torch.float16, torch.bfloat16)
_MAX_RUNS = 8
"""End-to-end runs the search may make after the baseline (each one low-precision forward and
backward): the planted hazards need at most 3."""
_MAX_PRODUCERS = 4
"""A value computed from more modules' low-precision ops than this (a residual stream) is attributed
only to those whose outputs carry most of the error (at least a quarter of the largest absolute
error), and not at all when they are still more: keeping all of them is no small fix, and the
search would pay one run each to find which matter."""
_MAX_BACKOFFS = 24
"""Halvings of the loss scale tried when the scaled gradients overflow (GradScaler backs off the
same way, one halving per skipped step): from 2**16 down to 2**-8."""


def _initial_scale(dtype: torch.dtype) -> float:
    # GradScaler's init_scale; bf16 has fp32's exponent range and is trained without scaling
    return 2.0 ** 16 if dtype == torch.float16 else 1.0


# --- measuring -----------------------------------------------------------------------------


def _floats(value: Any) -> list[torch.Tensor]:
    return [t.detach() for t in _float_tensors(value)]


def _float_tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors themselves, not detached: :class:`Flow` knows them by identity."""
    return [t for t in tensors_of(value) if t.is_floating_point()]


def _finite(ts: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _rel_error(low: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], floor: float) -> float:
    """Normwise relative error ``||low - ref|| / max(||ref||, floor * sqrt(n))`` over the tensors
    together: an entry that is zero in exact arithmetic divides nothing, and an all-zero reference
    compares against ``floor`` (the dtype's smallest normal number) per entry. inf when ``low``
    is not finite where ``ref`` is."""
    parts = _error_parts(low, ref)
    return math.nan if parts is None else _combine(parts, floor)


_Part = tuple[float, float, int] | None
"""One tensor's ``(||low - ref||^2, ||ref||^2, entries)``; the first inf when ``low`` is not finite
where ``ref`` is; None when ``ref`` itself is not finite (nothing to measure)."""


def _error_parts(low: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> list[_Part] | None:
    """Per tensor, what :func:`_combine` sums; None when the lists do not match."""
    if not low or len(low) != len(ref) or any(a.shape != b.shape for a, b in zip(low, ref)):
        return None
    parts: list[_Part] = []
    for a, b in zip(low, ref):
        a, b = a.double(), b.double()
        d = a - b
        if not bool(torch.isfinite(d).all()):
            parts.append(None if not bool(torch.isfinite(b).all()) else (math.inf, 0.0, 0))
            continue
        parts.append((float(d.pow(2).sum()), float(b.pow(2).sum()), b.numel()))
    return parts


def _combine(parts: Sequence[_Part], floor: float) -> float:
    num = den = 0.0
    n = 0
    for p in parts:
        if p is None:
            continue
        if math.isinf(p[0]):
            return math.inf
        num, den, n = num + p[0], den + p[1], n + p[2]
    return math.sqrt(num) / max(math.sqrt(den), floor * math.sqrt(max(n, 1)))


def _max_abs(ts: Sequence[torch.Tensor]) -> float:
    best = 0.0
    for t in ts:
        if t.numel():
            best = max(best, float(t.abs().masked_fill(~torch.isfinite(t), 0).max()))
    return best


def _underflow(ref: Sequence[torch.Tensor], dtype: torch.dtype, scale: float = 1.0) -> float:
    """Fraction of the non-zero reference values that ``dtype`` holds only as subnormal or zero."""
    tiny = torch.finfo(dtype).tiny
    nonzero = under = 0
    for t in ref:
        a = t.abs() * scale
        nz = a != 0
        nonzero += int(nz.sum())
        under += int((nz & (a < tiny)).sum())
    return under / nonzero if nonzero else 0.0


@dataclass
class _CallStats:
    in_error: float = 0.0
    in_finite: bool = True
    out_error: float = 0.0
    out_finite: bool = True
    out_low: bool = False
    out_max: float = 0.0
    """max |value| of the float64 reference's output."""
    underflow: float = 0.0


@dataclass(frozen=True)
class ModuleStats:
    """One module's measurements in one run (the worst over its calls)."""

    name: str
    type: str
    calls: int
    output_error: float
    """Normwise relative error of its output against float64 (see :func:`_rel_error`)."""
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


@dataclass(frozen=True)
class KeptModule:
    """A module the advice keeps in fp32 and what that moves to fp32: the low-precision ops it (or a
    descendant) ran under the default policy."""

    name: str
    type: str
    ops: tuple[tuple[str, int], ...]
    """(op, calls per forward), in the order first run, e.g. ``(("aten.addmm", 1),)``."""
    flop_share: float
    """Their share of the model's matmul/conv/attention FLOPs in one forward."""
    to: str = "fp32"
    """Where the keep moves them: ``fp32``, or with ``fp8=`` the autocast dtype (out of fp8)."""

    def __str__(self) -> str:
        ops = ", ".join(f"{op} x{n}" for op, n in self.ops)
        return f"{self.name} ({self.type}) moves {ops} to {self.to}: {self.flop_share:.1%} of the FLOPs"


def _kept_modules(keep: Sequence[str], base: _RunResult, total_flops: float, to: str = "fp32"
                  ) -> tuple[KeptModule, ...]:
    out = []
    for name in keep:
        ops: dict[str, int] = {}
        flops = 0.0
        for owner, run_ops in base.low_ops.items():
            if _inside(owner, name):
                for op, f in run_ops:
                    ops[op] = ops.get(op, 0) + 1
                    flops += f
        stats = base.modules.get(name)
        out.append(KeptModule(name, stats.type if stats else "?", tuple(ops.items()),
                              flops / total_flops if total_flops else 0.0, to))
    return tuple(out)


@dataclass(frozen=True)
class _RunResult:
    keep: tuple[str, ...]
    finite: bool
    error: float
    loss_error: float | None
    grad_error: float | None
    output_error: float
    scale: float
    modules: dict[str, ModuleStats]
    order: tuple[str, ...]
    """Module names in the order their first call finished."""
    low_ops: dict[str, tuple[tuple[str, float], ...]] = field(default_factory=dict)
    """Innermost module -> the low-precision ops it ran itself (op, FLOPs), in order."""
    amplified: dict[tuple[str, ...], float] = field(default_factory=dict)
    """Producers (modules) -> the largest growth of their rounding measured downstream of them."""
    fed_by: dict[str, frozenset[str]] = field(default_factory=dict)
    """Module -> the producers of its inputs (over all its calls)."""
    fp8_calls: tuple[Fp8Call, ...] = ()
    """With ``fp8=``: the matmuls that ran in fp8, in order."""


@dataclass
class _Reference:
    inputs: dict[tuple[str, int], list[torch.Tensor]]
    outputs: dict[tuple[str, int], list[torch.Tensor]]
    out: list[torch.Tensor]
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]


def _keep_in_fp32(model: torch.nn.Module, keep: Sequence[str], device_type: str) -> None:
    """Make each kept module run every op in fp32, as ``Policy(keep_fp32=keep)`` does in amp_fx:
    its floating inputs are cast to fp32 and autocast is off inside it."""
    def upcast(v: Any) -> Any:
        return v.float() if isinstance(v, torch.Tensor) and v.dtype in _LOW else v

    for name in keep:
        module = model.get_submodule(name)
        inner = module.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            args, kwargs = tree_map(upcast, (args, kwargs))
            with torch.autocast(device_type, enabled=False):
                return _inner(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]  # an instance attribute on a copy


class _CostCounter(TorchDispatchMode):
    """Matmul/conv/attention FLOPs by the dtype they ran in, and bytes the dtype casts moved
    (forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fp32 = 0.0
        self.fp8 = 0.0
        self.total = 0.0
        self.cast_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = compute_flops(func, args, kwargs, out)
        if flops is not None:
            first = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            self.total += flops
            if func is torch.ops.aten._scaled_mm.default:
                self.fp8 += flops
            elif first is not None and first.dtype not in _LOW:
                self.fp32 += flops
        elif func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            src, dst = args[0], out
            if src.is_floating_point() and dst.is_floating_point() and src.dtype != dst.dtype:
                self.cast_bytes += dst.numel() * (src.element_size() + dst.element_size())
        return out


def _cost(model: Any, call: Call, *, dtype: torch.dtype, device_type: str, keep: tuple[str, ...],
          fp8: Fp8Config | None = None) -> _CostCounter:
    """One forward under the policy, no grad, counting FLOPs by dtype and cast bytes (with
    ``fp8``, ``keep`` is kept out of fp8 instead of in fp32)."""
    m = private_copy(model)
    stack: list[str] = []
    if fp8 is None:
        _keep_in_fp32(m, keep, device_type)
    counter = _CostCounter()
    with torch.random.fork_rng(devices=[]), torch.no_grad(), module_stack(m, stack):
        torch.manual_seed(SEED)
        with torch.autocast(device_type, dtype=dtype), counter, _fp8_mode(fp8, dtype, device_type, stack, keep,
                                                                         measure=False):
            call.copy()(m)
    return counter


def _fp8_mode(fp8: Fp8Config | None, dtype: torch.dtype, device_type: str, stack: list[str],
              keep: Sequence[str], *, measure: bool = True) -> Any:
    """The eager fp8 mode for a run with ``fp8`` (``keep``: out of fp8), or a no-op without."""
    from contextlib import nullcontext

    return nullcontext(None) if fp8 is None else Fp8Eager(fp8, dtype, device_type, stack, keep,
                                                            measure=measure)


def _loss_of(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor | None:
    if loss_fn is None:
        return None
    loss = loss_fn(out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"amp_fx.advise: loss_fn must return a scalar tensor, got "
                         f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else list(loss.shape)}")
    return loss


def _reference(model: Any, call: Call, loss_fn: Callable[[Any], torch.Tensor] | None) -> _Reference:
    m = private_copy(model).double()
    inputs: dict[tuple[str, int], list[torch.Tensor]] = {}
    outputs: dict[tuple[str, int], list[torch.Tensor]] = {}
    starts: dict[str, int] = {}  # inputs are keyed by the call's start, outputs by its end
    calls: dict[str, int] = {}

    def pre(name: str, args: Any, kwargs: Any) -> None:
        i = starts.get(name, 0)
        starts[name] = i + 1
        # copies: a later in-place op (ReLU(inplace=True) after a BatchNorm) must not change them
        inputs[(name, i)] = [t.clone() for t in _floats((args, kwargs))]

    def post(name: str, out: Any) -> None:
        i = calls.get(name, 0)
        calls[name] = i + 1
        outputs[(name, i)] = [t.clone() for t in _floats(out)]

    with torch.random.fork_rng(devices=[]), _hooks(m, pre, post):
        torch.manual_seed(SEED)
        out = call.copy(to=torch.float64)(m)
        loss = _loss_of(out, loss_fn)
    grads: dict[str, torch.Tensor] = {}
    if loss is not None and loss.requires_grad:
        loss.backward()
        grads = {n: p.grad.detach() for n, p in m.named_parameters() if p.grad is not None}
    return _Reference(inputs, outputs, _floats(out), None if loss is None else loss.detach(), grads)


def _policy_run(model: Any, call: Call, ref: _Reference, *, dtype: torch.dtype, device_type: str,
                keep: tuple[str, ...], loss_fn: Callable[[Any], torch.Tensor] | None,
                fp8: Fp8Config | None = None) -> _RunResult:
    """One forward (and backward with ``loss_fn``) under autocast with ``keep`` in fp32, measured
    against ``ref`` module by module and end to end; the forward's low-precision ops and the
    growth of their rounding after the module that ran them are recorded (:class:`Flow`).

    With ``fp8``: every matmul the fp8 pass converts runs in fp8 (:class:`Fp8Eager`) except inside
    ``keep``, which is kept out of fp8 (in ``dtype``); the low-precision ops are the fp8 GEMMs, and
    growth is judged against e4m3's rounding."""
    m = private_copy(model)
    if fp8 is None:
        _keep_in_fp32(m, keep, device_type)
    finfo = torch.finfo(dtype)
    grain = _grain(dtype, fp8)
    unit = torch.finfo(grain).eps / 2
    per_call: dict[str, list[_CallStats]] = {}
    pending: dict[str, list[_CallStats]] = {}
    starts: dict[str, int] = {}  # inputs are keyed by the call's start, outputs by its end
    calls: dict[str, int] = {}
    order: list[str] = []
    stack: list[str] = []
    flow = Flow(stack, dtype, device_type, None if fp8 is None else frozenset({"_scaled_mm"}))
    fp8_mode = _fp8_mode(fp8, dtype, device_type, stack, keep)
    # module -> its latest call's output: (relative error, absolute error ||low - ref||, finite)
    last_out: dict[str, tuple[float, float, bool]] = {}
    amplified: dict[tuple[str, ...], float] = {}
    fed_by: dict[str, set[str]] = {}

    def read(values: Sequence[torch.Tensor], parts: Sequence[_Part] | None) -> None:
        """Where a module, the output or the loss reads ``values`` (with their error ``parts``): has
        their error grown past what their producers' outputs carried (code in between amplified
        it: a cancellation in the parent's ``forward``)?"""
        for t, part in zip(values, parts or ()):
            producers = flow.producers(t)
            if part is None or not producers:
                continue
            carried = {p: last_out.get(p) for p in producers}
            if any(c is None or not c[2] for c in carried.values()):
                continue  # a producer still running (its parent's own op), or already non-finite
            if len(producers) > _MAX_PRODUCERS:  # a residual stream: those that carry most error
                most = max(c[1] for c in carried.values() if c is not None)
                producers = frozenset(p for p, c in carried.items() if c is not None and c[1] >= most / 4)
                if len(producers) > _MAX_PRODUCERS:
                    continue
            error = _combine([part], finfo.tiny)
            growth = error / max(max(c[0] for p, c in carried.items() if p in producers and c is not None), unit)
            if _grows(growth, error, grain):
                group = tuple(sorted(producers))
                amplified[group] = max(amplified.get(group, 0.0), growth)

    def pre(name: str, args: Any, kwargs: Any) -> None:
        with _disable_current_modes():
            s = _CallStats()
            raw = _float_tensors((args, kwargs))
            low_in = [t.detach() for t in raw]
            i = starts.get(name, 0)
            starts[name] = i + 1
            parts = _error_parts(low_in, ref.inputs.get((name, i), []))
            s.in_finite = _finite(low_in)
            s.in_error = (0.0 if not low_in else math.nan if parts is None
                          else _combine(parts, finfo.tiny))
            pending.setdefault(name, []).append(s)
            fed_by.setdefault(name, set()).update(flow.producers(raw))
            read(raw, parts)
        stack.append(name)

    def post(name: str, out: Any) -> None:
        if name in stack:  # the innermost call of this module ends
            del stack[len(stack) - 1 - stack[::-1].index(name)]
        with _disable_current_modes():
            s = pending[name].pop()
            i = calls.get(name, 0)
            calls[name] = i + 1
            low_out = _floats(out)
            ref_out = ref.outputs.get((name, i), [])
            s.out_finite = _finite(low_out)
            s.out_low = any(t.dtype in _LOW for t in low_out)
            out_parts = _error_parts(low_out, ref_out)
            s.out_error = math.nan if out_parts is None else _combine(out_parts, finfo.tiny)
            s.out_max = _max_abs(ref_out)
            s.underflow = _underflow(ref_out, dtype) if s.out_low else 0.0
            per_call.setdefault(name, []).append(s)
            if out_parts is not None:
                absolute = math.sqrt(sum(p[0] for p in out_parts if p is not None))
                last_out[name] = (s.out_error, absolute, s.out_finite)
            if name not in order:
                order.append(name)

    scale = _initial_scale(dtype)
    with torch.random.fork_rng(devices=[]), _hooks(m, pre, post):
        torch.manual_seed(SEED)
        with torch.autocast(device_type, dtype=dtype), flow, fp8_mode:
            out = call.copy()(m)
            loss = _loss_of(out, loss_fn)
    fp8_calls = tuple(fp8_mode.calls) if fp8 is not None else ()
    low_ops = {k: tuple(v) for k, v in flow.ops.items()}
    if fp8 is not None:  # the model's matmuls, as the fp8 pass names them
        low_ops = {}
        for c in fp8_calls:
            low_ops[c.module] = (*low_ops.get(c.module, ()), (c.op, float(c.flops)))
    outs = _floats(out)
    out_parts = _error_parts(outs, ref.out)
    read(_float_tensors(out), out_parts)
    if loss is not None and ref.loss is not None:
        read([loss], _error_parts([loss.detach()], [ref.loss]))
    output_error = math.nan if out_parts is None else _combine(out_parts, finfo.tiny)
    finite = _finite(outs)
    names = [n for n, p in m.named_parameters()]
    params = [p for p in m.parameters()]
    grads: dict[str, torch.Tensor] = {}
    loss_error = grad_error = None
    if loss is not None:
        loss_error = _rel_error([loss.detach()], [ref.loss], finfo.tiny)
        finite = finite and _finite([loss.detach()])
        if loss.requires_grad and finite:  # with a non-finite forward no scale helps
            wanted = [(n, p) for n, p in zip(names, params) if p.requires_grad]
            for _ in range(_MAX_BACKOFFS + 1):
                gs = torch.autograd.grad(loss * scale, [p for _, p in wanted], retain_graph=True,
                                         allow_unused=True)
                grads = {n: g.detach() / scale for (n, _), g in zip(wanted, gs) if g is not None}
                if _finite(list(grads.values())):
                    break
                scale /= 2  # GradScaler skips the step and backs off
            common = [n for n in grads if n in ref.grads]
            grad_error = _rel_error([grads[n] for n in common], [ref.grads[n] for n in common],
                                    finfo.tiny) if common else None
            finite = finite and _finite(list(grads.values()))
    errors = [e for e in (output_error, loss_error, grad_error) if e is not None and not math.isnan(e)]
    error = max(errors) if errors else 0.0
    if not finite:
        error = math.inf

    modules: dict[str, ModuleStats] = {}
    init_scale = _initial_scale(dtype)
    for name, module in m.named_modules():
        stats = per_call.get(name)
        if not stats:
            continue
        own = [p.detach() for p in module.parameters(recurse=False)]
        under = [n for n in names if n == name or n.startswith(name + ".")] if name else names
        g_low = [grads[n] for n in under if n in grads and n in ref.grads]
        g_ref = [ref.grads[n] for n in under if n in grads and n in ref.grads]
        out_error = max(s.out_error for s in stats)
        in_error = max(s.in_error for s in stats)
        finite_in = all(s.in_finite for s in stats)
        amp = out_error / max(in_error, unit) if math.isfinite(in_error) else math.nan
        modules[name] = ModuleStats(
            name=name, type=type(module).__name__, calls=len(stats), output_error=out_error,
            input_error=in_error, amplification=amp,
            headroom=max(s.out_max for s in stats) / finfo.max,
            underflow=max(s.underflow for s in stats),
            weight_headroom=_max_abs(own) / finfo.max,
            low_precision=any(s.out_low for s in stats),
            finite=all(s.out_finite for s in stats), inputs_finite=finite_in,
            grad_error=_rel_error(g_low, g_ref, finfo.tiny) if g_low else None,
            grad_headroom=_max_abs(g_ref) * init_scale / finfo.max if g_ref else None,
            grad_underflow=_underflow(g_ref, dtype, init_scale) if g_ref else None,
            low_precision_ops=sum(len(ops) for o, ops in low_ops.items() if _inside(o, name)),
            fp8_error=max((c.error for c in fp8_calls if c.module == name), default=None),
            amplified_after=max((g for group, g in amplified.items() if name in group), default=None))
    return _RunResult(keep, finite, error, loss_error, grad_error, output_error, scale,
                      _with_findings(modules, grain, finite), tuple(order), low_ops, amplified,
                      {k: frozenset(v) for k, v in fed_by.items()}, fp8_calls)


def _grain(dtype: torch.dtype, fp8: Fp8Config | None) -> torch.dtype:
    """The dtype whose rounding judges error growth: e4m3's with fp8 on (an fp8 GEMM's error is
    e4m3's, 16 times bf16's), else the autocast dtype's."""
    return E4M3 if fp8 is not None else dtype


def _inside(name: str, module: str) -> bool:
    return module == "" or name == module or name.startswith(module + ".")


def _onsets(modules: dict[str, ModuleStats]) -> list[str]:
    """The innermost modules whose output is not finite although their inputs are."""
    hits = [n for n, s in modules.items() if n and not s.finite and s.inputs_finite]
    return [n for n in hits if not any(o != n and _inside(o, n) for o in hits)]


def _grows(growth: float, error: float, dtype: torch.dtype) -> bool:
    # error multiplied by more than 16 roundings' worth, ending above 4 eps: well outside what one
    # rounding per op gives (amplification ~1-3 in healthy runs)
    return growth > 16 and error > 4 * torch.finfo(dtype).eps


def _amplifies(s: ModuleStats, dtype: torch.dtype) -> bool:
    """The module multiplies the error it is handed (:func:`_grows`)."""
    return math.isfinite(s.amplification) and _grows(s.amplification, s.output_error, dtype)


_DISCARDED = "discarded inf/NaN"
_FP8_ERROR = "fp8 error"
_AMPLIFIED_AFTER = "amplified after"
_PRECISION = ("amplifies", _AMPLIFIED_AFTER, _DISCARDED)
"""Findings that are not hazards: a precision cost, or an inf/NaN the model discards."""


def _with_findings(modules: dict[str, ModuleStats], dtype: torch.dtype, finite: bool) -> dict[str, ModuleStats]:
    """Each module's finding; with ``finite`` (the run's outputs, loss and gradients), an inf/NaN
    onset was discarded inside the model (a ``where``, ``min`` or integer cast), not a hazard."""
    onsets = set(_onsets(modules))
    out = {}
    for n, s in modules.items():
        finding = ""
        if n in onsets:
            finding = _DISCARDED if finite else "non-finite"
        elif s.weight_headroom >= 1 and s.low_precision:
            finding = "weight overflows"
        elif s.headroom >= 1 and s.low_precision:
            finding = "overflow"
        elif s.fp8_error is not None and s.fp8_error > FP8_ERROR_HAZARD:
            finding = _FP8_ERROR
        elif s.grad_headroom is not None and s.grad_headroom >= 1 and not any(
                c != n and _inside(c, n) and (modules[c].grad_headroom or 0) >= 1 for c in modules):
            finding = "gradient overflow"
        elif n and _amplifies(s, dtype):
            finding = "amplifies"
        elif s.amplified_after is not None:
            finding = _AMPLIFIED_AFTER
        out[n] = ModuleStats(**{**asdict(s), "finding": finding})
    return out


def _keepable(base: _RunResult) -> frozenset[str]:
    """The modules whose fp32 keep moves at least one op to fp32: those that ran a low-precision
    op (themselves or in a descendant) under the default policy. Not the root: no policy keeps it."""
    return frozenset(n for n, s in base.modules.items() if n and s.low_precision_ops)


def _as_keepable(names: Sequence[str], run: _RunResult, keepable: frozenset[str]) -> list[str]:
    """``names``, each one that runs no low-precision op (a dropout passing an overflow along, an
    activation whose ``exp`` overflows) replaced by the producers of its inputs: keeping those
    upcasts the same values at their source."""
    out: list[str] = []
    for n in names:
        out += [n] if n in keepable else sorted(p for p in run.fed_by.get(n, ()) if p in keepable)
    return list(dict.fromkeys(out))


def _hazards(run: _RunResult, keepable: frozenset[str]) -> list[str]:
    """Modules whose values do not fit the dtype, innermost: one with another hazard inside it (a
    block whose output is its Linear's overflowing output) is left out, since keeping the inner one
    may be enough; when it is not, the next run finds the outer one on its own (see
    :func:`_as_keepable` for the modules that run no low-precision op)."""
    found = [n for n, s in run.modules.items()
             if n and s.finding in ("non-finite", "weight overflows", "overflow", _FP8_ERROR)]
    inner = [n for n in found if not any(o != n and _inside(o, n) for o in found)]
    return _as_keepable(inner, run, keepable)


def _ranked(run: _RunResult, dtype: torch.dtype, keepable: frozenset[str]) -> list[tuple[str, ...]]:
    """Candidate groups by how much error they let grow: first the producers whose rounding the
    code after them amplified (``amplified after``), largest growth first, then the modules that
    amplify the error they are handed, largest amplification first."""
    after = sorted(((g, x) for g, x in run.amplified.items() if all(n in keepable for n in g)),
                   key=lambda gx: (-gx[1], gx[0]))
    groups = [g for g, _ in after]
    inside = sorted((s for n, s in run.modules.items() if n and _amplifies(s, dtype)),
                    key=lambda s: (-s.amplification, s.name))
    groups += [g for g in (tuple(_as_keepable([s.name], run, keepable)) for s in inside) if g]
    return list(dict.fromkeys(groups))


def _moved(keep: Sequence[str], base: _RunResult) -> int:
    """Low-precision ops the keep-list moves to fp32 (counted in the default policy's run)."""
    return sum(len(ops) for o, ops in base.low_ops.items() if any(_inside(o, k) for k in keep))


def _inner_evidence(name: str, runs: Sequence[_RunResult], dtype: torch.dtype,
                    keepable: frozenset[str]) -> tuple[str, ...]:
    """What the runs found strictly inside module ``name``: its hazards and candidate groups."""
    found: list[str] = []
    for r in runs:
        groups = [(h,) for h in _hazards(r, keepable)] + _ranked(r, dtype, keepable)
        found += [n for g in groups if all(n != name and _inside(n, name) for n in g) for n in g]
    return _add((), found)


def _add(keep: Sequence[str], new: Sequence[str]) -> tuple[str, ...]:
    out = list(keep)
    for n in new:
        if any(_inside(n, k) for k in out):
            continue
        out = [k for k in out if not _inside(k, n)] + [n]
    return tuple(out)


# --- training ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingComparison:
    """Losses over ``steps`` training steps from one initial state, fp32 against each policy."""

    steps: int
    fp32: tuple[float, ...]
    default: tuple[float, ...]
    advised: tuple[float, ...]

    @staticmethod
    def _divergence(curve: Sequence[float], ref: Sequence[float]) -> float:
        worst = 0.0
        for a, b in zip(curve, ref):
            if not math.isfinite(a):
                return math.inf
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
        return worst

    @property
    def default_divergence(self) -> float:
        """max over steps of |loss - fp32 loss| / |fp32 loss| with the default policy."""
        return self._divergence(self.default, self.fp32)

    @property
    def advised_divergence(self) -> float:
        return self._divergence(self.advised, self.fp32)


def _make_optimizer(optimizer: Any, params: Any) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer)(params, **optimizer.defaults)
    if callable(optimizer):
        opt = optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"amp_fx.advise: optimizer(params) must return a torch.optim.Optimizer, "
                            f"got {type(opt).__name__}")
        return opt
    raise TypeError("amp_fx.advise: optimizer must be a torch.optim.Optimizer (rebuilt from its "
                    f"class and defaults on each copy) or a callable params -> Optimizer, got {optimizer!r}")


def _train(model: Any, call: Call, loss_fn: Callable[[Any], torch.Tensor], optimizer: Any, steps: int,
           *, dtype: torch.dtype | None, device_type: str, keep: tuple[str, ...],
           fp8: Fp8Config | None = None) -> tuple[float, ...]:
    m = private_copy(model)
    stack: list[str] = []
    if dtype is not None and fp8 is None:
        _keep_in_fp32(m, keep, device_type)
    opt = _make_optimizer(optimizer, m.parameters())
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    losses = []
    with torch.random.fork_rng(devices=[]), module_stack(m, stack):
        torch.manual_seed(SEED)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None), \
                    _fp8_mode(fp8, dtype or torch.bfloat16, device_type, stack, keep, measure=False):
                loss = loss_fn(call.copy()(m))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    return tuple(losses)


# --- the result ----------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".2g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if math.isinf(x):
        return "inf"
    return format(x, spec)


@dataclass(frozen=True)
class Cost:
    """What the advised policy costs, forward pass (counted on the eager run)."""

    fp32_flop_share: float
    """Share of the matmul/conv/attention FLOPs that run in fp32 (0 with the default policy, up to 1)."""
    default_fp32_flop_share: float
    cast_bytes: int
    """Bytes the dtype casts read and write per call with the advised policy."""
    default_cast_bytes: int
    matmul_flops: float
    fp8_flop_share: float | None = None
    """With ``fp8=``: share of the FLOPs that run in fp8 with the advised policy."""
    default_fp8_flop_share: float | None = None
    """The same with every matmul the fp8 pass converts in fp8."""


def fp8_too_small(recipe: Fp8Recipe, k: int, n: int) -> bool:
    """Whether a ``[M, K] x [K, N]`` matmul is too small for fp8 to gain on an H100, by torchao
    0.18's rule (``torchao.float8.float8_linear_utils._auto_filter_for_recipe``, thresholds from
    its H100 benchmarks, https://github.com/pytorch/ao/tree/main/torchao/float8#performance):
    tensorwise gains unless ``K <= 4096 and N <= 1024``; rowwise (torchao has no rule for
    rowwise_with_gw_hp: rowwise's is used) unless ``N <= 2048``, ``K <= 1024``, or
    ``N <= 4096 and K <= 2048``. ``K``: in features, ``N``: out features; the rule ignores ``M``
    (tokens per call), so a layer it passes can still be too small at a small batch."""
    if recipe is Fp8Recipe.TENSORWISE:
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


@dataclass(frozen=True)
class Fp8Matmul:
    """With ``fp8=``: one matmul (module, op, shape) that ran in fp8 with every eligible matmul in
    fp8, as measured."""

    module: str
    op: str
    shape: tuple[int, int, int]
    """(M, K, N) of the forward GEMM: rows of the input, in features, out features."""
    calls: int
    error: float
    """The largest error fp8 added to its forward GEMM (see :data:`FP8_ERROR_HAZARD`)."""
    too_small: bool
    """Too small for fp8 to gain on an H100 (:func:`fp8_too_small`)."""

    @property
    def flops(self) -> int:
        """FLOPs of one forward GEMM (2 M K N); the backward adds twice that."""
        m, k, n = self.shape
        return 2 * m * k * n


def _fp8_matmuls(calls: Sequence[Fp8Call], recipe: Fp8Recipe) -> tuple[Fp8Matmul, ...]:
    seen: dict[tuple[str, str, tuple[int, int, int]], list[float]] = {}
    for c in calls:
        seen.setdefault((c.module, c.op, c.shape), []).append(c.error)
    return tuple(Fp8Matmul(mod, op, shape, len(errs), max(errs), fp8_too_small(recipe, shape[1], shape[2]))
                 for (mod, op, shape), errs in seen.items())


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
        return tuple(s for s in self.modules if s.finding and s.finding not in _PRECISION)

    def module(self, name: str) -> ModuleStats:
        for s in self.modules:
            if s.name == name:
                return s
        raise KeyError(f"amp_fx: no measured module {name!r}")

    def table(self, *, limit: int | None = 40) -> str:
        rows = []
        ranked = sorted(self.modules, key=lambda s: (not s.finding, -_sort_key(s.output_error)))
        shown = [s for s in ranked if s.name][:limit]
        for s in shown:
            row = [s.name, s.type, _fmt(s.output_error), _fmt(s.amplification, ".3g"), _fmt(s.headroom, ".2g"),
                   _fmt(s.weight_headroom, ".2g"), _fmt(s.underflow, ".2g")]
            if self.grads_measured:
                row += [_fmt(s.grad_error), _fmt(s.grad_headroom), _fmt(s.grad_underflow)]
            if self.fp8 is not None:
                row += [_fmt(s.fp8_error)]
            kept = self.keep_out_of_fp8 if self.fp8 is not None else self.keep_fp32
            row += [("KEPT " if s.name in kept else "") + s.finding]
            rows.append(row)
        headers = ["module", "type", "out err", "amplif.", "headroom", "w headroom", "underflow"]
        if self.grads_measured:
            headers += ["grad err", f"grad headroom (x{_initial_scale(self.dtype):g})", "grad underflow"]
        if self.fp8 is not None:
            headers += ["fp8 err"]
        headers += ["finding"]
        text = tabulate(rows, headers=headers)
        hidden = len([s for s in self.modules if s.name]) - len(shown)
        return text + (f"\n... {hidden} more modules (advice.modules has them all)" if hidden > 0 else "")

    def __str__(self) -> str:
        low = dtype_name(self.dtype)
        if self.fp8 is not None:
            low += f", fp8 {self.fp8.recipe.value}"
            verdict = ("every matmul in fp8 meets the target: nothing to keep out of fp8"
                       if not self.keep_out_of_fp8 and self.verified else
                       f"keep {', '.join(self.keep_out_of_fp8)} out of fp8" if self.keep_out_of_fp8 else
                       "no policy found that meets the target")
            if not self.fp8_matmuls:
                verdict = "no matmul ran in fp8 (none the fp8 pass converts: see amp_fx.explain(..., fp8=...))"
        else:
            verdict = ("default policy meets the target: nothing to keep in fp32" if not self.keep_fp32
                       and self.verified else
                       f"keep {', '.join(self.keep_fp32)} in fp32" if self.keep_fp32 else
                       "no policy found that meets the target")
        cost = (f"cost: {self.cost.fp32_flop_share:.1%} of matmul/conv/attention FLOPs in fp32 "
                f"(default {self.cost.default_fp32_flop_share:.1%}); casts move "
                f"{self.cost.cast_bytes} B per forward (default {self.cost.default_cast_bytes} B)")
        if self.fp8 is not None:
            cost = (f"cost: {_fmt(self.cost.fp8_flop_share, '.1%')} of matmul/conv/attention FLOPs in fp8 "
                    f"(every eligible matmul: {_fmt(self.cost.default_fp8_flop_share, '.1%')})")
        lines = [f"amp_fx.advise ({low}): {verdict}",
                 f"end-to-end error vs float64: default {_fmt(self.baseline_error, '.3g')}, advised "
                 f"{_fmt(self.error, '.3g')}, target {self.target:.3g} "
                 f"({'verified' if self.verified else 'NOT verified'}; {self.runs} policy run(s))",
                 "  by part, default / advised: " + "; ".join(
                     f"{k} {_fmt(a, '.3g')} / {_fmt(b, '.3g')}"
                     for (k, a), (_, b) in zip(self.baseline_parts, self.parts) if a is not None or b is not None),
                 cost]
        lines += [f"{'kept:' if i == 0 else '     '} {k}" for i, k in enumerate(self.kept)]
        if self.training is not None:
            t = self.training
            lines.append(f"training {t.steps} steps: loss strays from fp32's by at most "
                         f"{_fmt(t.default_divergence, '.3g')} (default) and "
                         f"{_fmt(t.advised_divergence, '.3g')} (advised), relative")
        lines += ["", "modules (measured with the default policy; hazards first):", self.table()]
        if self.fp8 is not None and self.fp8_matmuls:
            lines += ["", "fp8 matmuls (every eligible matmul in fp8):", self.fp8_table()]
        if self.steps:
            lines += ["", "search:"] + [f"  {s}" for s in self.steps]
        lines += ["", "policy:", "  from amp_fx import Policy", f"  policy = {policy_code(self.policy)}"]
        return "\n".join(lines)

    def fp8_table(self, *, limit: int | None = 40) -> str:
        """With ``fp8``: each matmul that ran in fp8, its shape, FLOPs per call, error and whether
        it is too small to gain (:func:`fp8_too_small`, whose thresholds the table's note states)."""
        assert self.fp8 is not None
        rows = [[m.module or "<root>", m.op, "x".join(map(str, m.shape)), m.calls, f"{m.flops:.3g}",
                 _fmt(m.error), ("KEPT " if any(_inside(m.module, k) for k in self.keep_out_of_fp8) else "")
                 + ("too small" if m.too_small else "")]
                for m in self.fp8_matmuls[:limit]]
        text = tabulate(rows, headers=["module", "op", "MxKxN", "calls", "FLOPs/call", "fp8 err", ""])
        hidden = len(self.fp8_matmuls) - len(rows)
        rule = ("K <= 4096 and N <= 1024" if self.fp8.recipe is Fp8Recipe.TENSORWISE else
                "N <= 2048, K <= 1024, or N <= 4096 and K <= 2048")
        small = sum(m.too_small for m in self.fp8_matmuls)
        return (text + (f"\n... {hidden} more (advice.fp8_matmuls has them all)" if hidden > 0 else "")
                + f"\n{small} of {len(self.fp8_matmuls)} too small to gain on an H100 by torchao 0.18's "
                  f"rule for {self.fp8.recipe.value} ({rule}; K in, N out features; from its H100 "
                  f"benchmarks, _auto_filter_for_recipe)")

    def to_dict(self) -> dict[str, Any]:
        """The advice as JSON-ready data (what ``amp-fx advise --json`` prints)."""
        def clean(x: Any) -> Any:
            if isinstance(x, float) and not math.isfinite(x):
                return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
            return x
        return {
            "dtype": dtype_name(self.dtype), "keep_fp32": list(self.keep_fp32),
            "fp8": None if self.fp8 is None else self.fp8.recipe.value,
            "keep_out_of_fp8": list(self.keep_out_of_fp8),
            "fp8_matmuls": [{**asdict(m), "flops": m.flops} for m in self.fp8_matmuls],
            "policy": policy_code(self.policy), "target": self.target, "error": clean(self.error),
            "baseline_error": clean(self.baseline_error), "verified": self.verified,
            "loss_scale": self.loss_scale, "runs": self.runs, "steps": list(self.steps),
            "parts": {k: clean(v) for k, v in self.parts},
            "baseline_parts": {k: clean(v) for k, v in self.baseline_parts},
            "cost": {k: clean(v) for k, v in asdict(self.cost).items()},
            "kept": [{"name": k.name, "type": k.type, "ops": dict(k.ops), "flop_share": k.flop_share}
                     for k in self.kept],
            "modules": [{k: clean(v) for k, v in asdict(s).items()} for s in self.modules],
            "training": None if self.training is None else {
                "steps": self.training.steps, "fp32": list(self.training.fp32),
                "default": [clean(x) for x in self.training.default],
                "advised": [clean(x) for x in self.training.advised],
                "default_divergence": clean(self.training.default_divergence),
                "advised_divergence": clean(self.training.advised_divergence)},
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


# --- the entry point -----------------------------------------------------------------------


def advise(
    model: torch.nn.Module,
    *args: Any,
    dtype: str | torch.dtype = "fp16",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    target: float | None = None,
    optimizer: Any = None,
    steps: int = 0,
    max_runs: int = _MAX_RUNS,
    fp8: Fp8Like = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> Advice:
    """Advise which modules of ``model`` to keep in fp32 for ``dtype`` training, measured against
    float64 and verified end to end.

    Args:
        model: an ``nn.Module``; never modified (every run uses a deep copy).
        *args: example inputs, positional; ``**kwargs`` go to the model by keyword.
        dtype: "fp16" or "bf16" (and their aliases).
        loss_fn: maps the output to a scalar loss; with it gradients are measured and verified
            too (at GradScaler's initial scale for fp16). Without it, outputs only.
        target: the largest end-to-end error (normwise relative to float64) the advised policy
            may leave; default :data:`DEFAULT_TARGETS` (64 eps of the dtype).
        optimizer: with ``steps``: a ``torch.optim.Optimizer`` (rebuilt from its class and
            defaults on each copy) or a callable ``params -> Optimizer``; trains ``steps`` steps
            on these inputs from the same initial state in fp32, with the default policy and with
            the advised one (fp16 with ``torch.amp.GradScaler``), and reports the loss curves.
        steps: how many training steps (needs ``optimizer`` and ``loss_fn``).
        max_runs: end-to-end policy runs the search may make after the default policy's.
        fp8: a recipe (as :func:`amp_fx.compile` takes it): advise which matmuls to keep *out of
            fp8* instead. The default run has every matmul the fp8 pass converts in fp8 (eager,
            bitwise with ``amp_fx.compile(..., fp8=..., backend="aot_eager")``), the rest in
            ``dtype``; the search keeps modules' matmuls in ``dtype`` (``Policy(keep_out_of_fp8=...)``)
            until the target is met, starting from the matmuls whose fp8 GEMM error exceeds
            :data:`FP8_ERROR_HAZARD`. The advice also lists each fp8 matmul and whether it is too
            small to gain (:func:`fp8_too_small`).
        strict: raise instead of warning where advise does less than asked (``fp8`` set but no
            matmul runs in fp8); None: the ``AMP_FX_STRICT`` environment variable decides.

    Raises:
        EagerError: the model fails in plain fp32 eager mode on these inputs.
        ValueError: bad ``target``/``steps``, or ``loss_fn`` does not return a scalar.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"amp_fx.advise: model must be an nn.Module (policies name its submodules), "
                        f"got {type(model).__name__}")
    low = resolve_dtype(dtype)
    target = DEFAULT_TARGETS[low] if target is None else float(target)
    if not target > 0:
        raise ValueError(f"amp_fx.advise: target must be a positive error bound, got {target!r}")
    if steps < 0 or (steps and (optimizer is None or loss_fn is None)):
        raise ValueError("amp_fx.advise: steps=N needs optimizer=... and loss_fn=... (and N >= 0)")
    config = Fp8Config.of(fp8)
    call = Call(args, kwargs)
    run_eager_checked(model, call, tool="advise")
    device_type = call.device_type(model)
    if config is not None and RECIPES[config.recipe].rowwise:
        missing = rowwise_scales_missing(device_type)
        if missing is not None:
            raise AmpFxError(f"amp_fx.advise: fp8={config.recipe.value!r} needs rowwise scales in "
                             f"torch._scaled_mm, but {missing}. Use fp8='tensorwise' here, or torch 2.13 "
                             f"or newer (or a GPU) for the rowwise recipes.")
    ref = _reference(model, call, loss_fn)

    def run(keep: tuple[str, ...]) -> _RunResult:
        return _policy_run(model, call, ref, dtype=low, device_type=device_type, keep=keep,
                           loss_fn=loss_fn, fp8=config)

    base = run(())
    if config is not None and not base.fp8_calls:
        did_less(("advise fp8", type(model)), (
            f"amp_fx.advise: fp8={config.recipe.value!r} but no matmul of {type(model).__name__} ran in "
            f"fp8 (none has a parameter as its right operand with sizes torch._scaled_mm takes: "
            f"K, N{' and M' if RECIPES[config.recipe].input_for_grad_weight.dtype is not None else ''} "
            f"multiples of 16); the advice is for {dtype_name(low)} alone. amp_fx.explain(model, ..., "
            f"fp8=...) says why for each matmul."), strict=strict)
    ok = base.finite and base.error <= target
    best, runs, words = base, 1, []
    if not ok:
        best, runs, words = _search(base, run, target, _grain(low, config), max_runs)
    verified = best.finite and best.error <= target
    policy = Policy(keep_out_of_fp8=best.keep) if config is not None else Policy(keep_fp32=best.keep)
    training = None
    if steps:
        assert loss_fn is not None
        curves = [_train(model, call, loss_fn, optimizer, steps, dtype=d, device_type=device_type, keep=k,
                         fp8=config if d is not None else None)
                  for d, k in ((None, ()), (low, ()), (low, best.keep))]
        training = TrainingComparison(steps, *curves)
    c0 = _cost(model, call, dtype=low, device_type=device_type, keep=(), fp8=config)
    c1 = _cost(model, call, dtype=low, device_type=device_type, keep=best.keep, fp8=config) if best.keep else c0
    cost = Cost(fp32_flop_share=c1.fp32 / c1.total if c1.total else 0.0,
                default_fp32_flop_share=c0.fp32 / c0.total if c0.total else 0.0,
                cast_bytes=c1.cast_bytes, default_cast_bytes=c0.cast_bytes, matmul_flops=c0.total,
                fp8_flop_share=None if config is None else c1.fp8 / c1.total if c1.total else 0.0,
                default_fp8_flop_share=None if config is None else c0.fp8 / c0.total if c0.total else 0.0)
    ordered = tuple(base.modules[n] for n in base.order if n in base.modules)
    return Advice(dtype=low, policy=policy, target=target, error=best.error,
                  baseline_error=base.error, verified=verified, modules=ordered, cost=cost,
                  loss_scale=best.scale, runs=runs, steps=tuple(words), training=training,
                  grads_measured=loss_fn is not None, parts=_parts(best), baseline_parts=_parts(base),
                  kept=_kept_modules(best.keep, base, c0.total, "fp32" if config is None else dtype_name(low)),
                  fp8=config, fp8_matmuls=() if config is None else _fp8_matmuls(base.fp8_calls, config.recipe),
                  _explain=lambda policy: _explain_model(model, call, low, policy, config))


def _explain_model(model: Any, call: Call, dtype: torch.dtype, policy: Policy, fp8: Fp8Config | None = None
                   ) -> Any:
    from amp_fx.inspect.explanation import explain

    return explain(model, *call.args, dtype=dtype, policy=policy, fp8=fp8, **call.kwargs)


def _parts(r: _RunResult) -> tuple[tuple[str, float | None], ...]:
    return (("output", r.output_error), ("loss", r.loss_error), ("gradients", r.grad_error))


def _describe(r: _RunResult) -> str:
    what = "inf/NaN" if not r.finite else f"error {r.error:.3g}"
    return f"keep ({', '.join(r.keep) or 'nothing'}): {what}"


def _search(base: _RunResult, run: Callable[[tuple[str, ...]], _RunResult], target: float,
            dtype: torch.dtype, max_runs: int) -> tuple[_RunResult, int, list[str]]:
    """Grow a keep-list from the hazards, the next inf/NaN onset, then the ranked candidates; then
    narrow each kept module to what was found inside it, and drop what is not needed. Only modules
    that run a low-precision op are ever kept. Returns the best run, the runs made (the baseline
    included) and the steps in words."""
    words = [f"default policy: {'inf/NaN' if not base.finite else f'error {base.error:.3g}'} "
             f"(target {target:.3g})"]
    keepable = _keepable(base)

    def meets(r: _RunResult) -> bool:
        return r.finite and r.error <= target

    ranked = _ranked(base, dtype, keepable)
    keep = _add((), _hazards(base, keepable))
    if not keep and ranked:
        keep = _add((), ranked[0])
    runs, batch = 1, 1
    best: _RunResult | None = None
    last = base
    seen = [base]
    tried: set[tuple[str, ...]] = set()
    while keep and runs <= max_runs and keep not in tried:
        tried.add(keep)
        last = run(keep)
        seen.append(last)
        runs += 1
        words.append(_describe(last))
        if meets(last):
            best = last
            break
        new = _hazards(last, keepable) if not last.finite else []
        new = [n for n in new if not any(_inside(n, k) for k in keep)]
        if not new:
            groups = [g for g in dict.fromkeys(_ranked(last, dtype, keepable) + ranked)
                      if not all(any(_inside(n, k) for k in keep) for n in g)]
            new, batch = [n for g in groups[:batch] for n in g], batch * 2
        if not new:
            break
        keep = _add(keep, new)
    if best is None:
        if not base.finite and last.finite:
            words.append("no policy met the target within max_runs; advised: the last one tried, the "
                         "first without inf/NaN")
            return last, runs, words
        words.append("no policy met the target: no module stands out (no value out of range, no "
                     "low-precision op whose error grows in its module or after it), so the error "
                     "is spread over the model; advised: the default policy (raise target= to accept "
                     "it)" if not tried else
                     "no policy met the target within max_runs; advised: the default policy")
        return base, runs, words
    # narrow: a kept module with something found inside it is tried as that smaller part
    for name in best.keep:
        inner = _inner_evidence(name, seen, dtype, keepable) if name in best.keep else ()
        if runs > max_runs or not inner or _moved(inner, base) >= _moved((name,), base):
            continue
        r = run(_add(tuple(k for k in best.keep if k != name), inner))
        seen.append(r)
        runs += 1
        words.append(_describe(r) + (f" (instead of {name})" if meets(r) else ""))
        if meets(r):
            best = r
    # drop what the target does not need, latest-added first
    for name in reversed(best.keep):
        if len(best.keep) == 1 or runs > max_runs:
            break
        trial = tuple(k for k in best.keep if k != name)
        r = run(trial)
        runs += 1
        words.append(_describe(r) + (" (dropped " + name + ")" if meets(r) else ""))
        if meets(r):
            best = r
    return best, runs, words
