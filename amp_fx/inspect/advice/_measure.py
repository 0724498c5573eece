"""advise, measuring (step 2): one policy run, module by module. An eager forward (and backward with
a loss) under autocast on a private copy, the policy applied as amp_fx applies it (a kept module runs
in fp32; with ``fp8=``, every matmul the fp8 pass converts runs in fp8 outside the kept modules).
Each module's inputs and output are compared with the float64 reference as they are produced;
:class:`~amp_fx.inspect._flow.Flow` records which module ran each low-precision op and which
produced each value, so that error growing after a module returned (a cancellation in its parent's
``forward``) is attributed to it (``amplified after``). The end-to-end error is
:mod:`~amp_fx.inspect.advice._verify`'s, the findings :mod:`~amp_fx.inspect.advice._findings`'."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from amp_fx.fp8 import Fp8Config
from amp_fx.inspect._flow import Flow
from amp_fx.inspect._fp8_eager import Fp8Call, Fp8Eager
from amp_fx.inspect._probe import module_hooks
from amp_fx.inspect._runner import SEED, Call, private_copy
from amp_fx.inspect.advice._errors import (
    LOW,
    Part,
    all_finite,
    combine,
    error_parts,
    float_tensors,
    floats,
    max_abs,
    rel_error,
    underflow,
)
from amp_fx.inspect.advice._findings import ModuleStats, grain, grows, inside, with_findings
from amp_fx.inspect.advice._reference import Reference, loss_of
from amp_fx.inspect.advice._verify import EndToEnd, end_to_end, initial_scale

__all__: list[str] = []

MAX_PRODUCERS = 4
"""A value computed from more modules' low-precision ops than this (a residual stream) is attributed
only to those whose outputs carry most of the error (at least a quarter of the largest absolute
error), and not at all when they are still more: keeping all of them is no small fix, and the
search would pay one run each to find which matter."""


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
class RunResult:
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


def keep_in_fp32(model: torch.nn.Module, keep: Sequence[str], device_type: str) -> None:
    """Make each kept module run every op in fp32, as ``Policy(keep_fp32=keep)`` does in amp_fx:
    its floating inputs are cast to fp32 and autocast is off inside it."""

    def upcast(v: Any) -> Any:
        return v.float() if isinstance(v, torch.Tensor) and v.dtype in LOW else v

    for name in keep:
        module = model.get_submodule(name)
        inner = module.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            args, kwargs = tree_map(upcast, (args, kwargs))
            with torch.autocast(device_type, enabled=False):
                return _inner(*args, **kwargs)

        module.forward = forward  # an instance attribute on a copy


def fp8_mode(
    fp8: Fp8Config | None,
    dtype: torch.dtype,
    device_type: str,
    stack: list[str],
    keep: Sequence[str],
    *,
    measure: bool = True,
) -> Any:
    """The eager fp8 mode for a run with ``fp8`` (``keep``: out of fp8), or a no-op without."""
    return nullcontext(None) if fp8 is None else Fp8Eager(fp8, dtype, device_type, stack, keep, measure=measure)


class _Recorder:
    """The module hooks of one policy run: each call's input and output error against ``ref``
    (worst over a module's calls in :attr:`per_call`), and, where a module, the output or the loss
    reads a value, the growth of its error past what its producers' outputs carried."""

    def __init__(self, ref: Reference, flow: Flow, stack: list[str], dtype: torch.dtype, grain: torch.dtype) -> None:
        self.ref, self.flow, self.stack, self.dtype, self.grain = ref, flow, stack, dtype, grain
        self.tiny = torch.finfo(dtype).tiny
        self.unit = torch.finfo(grain).eps / 2
        self.per_call: dict[str, list[_CallStats]] = {}
        self.pending: dict[str, list[_CallStats]] = {}
        self.starts: dict[str, int] = {}  # inputs are keyed by the call's start, outputs by its end
        self.calls: dict[str, int] = {}
        self.order: list[str] = []
        # module -> its latest call's output: (relative error, absolute error ||low - ref||, finite)
        self.last_out: dict[str, tuple[float, float, bool]] = {}
        self.amplified: dict[tuple[str, ...], float] = {}
        self.fed_by: dict[str, set[str]] = {}

    def read(self, values: Sequence[torch.Tensor], parts: Sequence[Part] | None) -> None:
        """Where a module, the output or the loss reads ``values`` (with their error ``parts``): has
        their error grown past what their producers' outputs carried (code in between amplified
        it: a cancellation in the parent's ``forward``)?"""
        for t, part in zip(values, parts or ()):
            producers = self.flow.producers(t)
            if part is None or not producers:
                continue
            carried = {p: self.last_out.get(p) for p in producers}
            if any(c is None or not c[2] for c in carried.values()):
                continue  # a producer still running (its parent's own op), or already non-finite
            if len(producers) > MAX_PRODUCERS:  # a residual stream: those that carry most error
                most = max(c[1] for c in carried.values() if c is not None)
                producers = frozenset(p for p, c in carried.items() if c is not None and c[1] >= most / 4)
                if len(producers) > MAX_PRODUCERS:
                    continue
            error = combine([part], self.tiny)
            growth = error / max(max(c[0] for p, c in carried.items() if p in producers and c is not None), self.unit)
            if grows(growth, error, self.grain):
                group = tuple(sorted(producers))
                self.amplified[group] = max(self.amplified.get(group, 0.0), growth)

    def pre(self, name: str, args: Any, kwargs: Any) -> None:
        with _disable_current_modes():
            s = _CallStats()
            raw = float_tensors((args, kwargs))
            low_in = [t.detach() for t in raw]
            i = self.starts.get(name, 0)
            self.starts[name] = i + 1
            parts = error_parts(low_in, self.ref.inputs.get((name, i), []))
            s.in_finite = all_finite(low_in)
            s.in_error = 0.0 if not low_in else math.nan if parts is None else combine(parts, self.tiny)
            self.pending.setdefault(name, []).append(s)
            self.fed_by.setdefault(name, set()).update(self.flow.producers(raw))
            self.read(raw, parts)
        self.stack.append(name)

    def post(self, name: str, out: Any) -> None:
        stack = self.stack
        if name in stack:  # the innermost call of this module ends
            del stack[len(stack) - 1 - stack[::-1].index(name)]
        with _disable_current_modes():
            s = self.pending[name].pop()
            i = self.calls.get(name, 0)
            self.calls[name] = i + 1
            low_out = floats(out)
            ref_out = self.ref.outputs.get((name, i), [])
            s.out_finite = all_finite(low_out)
            s.out_low = any(t.dtype in LOW for t in low_out)
            out_parts = error_parts(low_out, ref_out)
            s.out_error = math.nan if out_parts is None else combine(out_parts, self.tiny)
            s.out_max = max_abs(ref_out)
            s.underflow = underflow(ref_out, self.dtype) if s.out_low else 0.0
            self.per_call.setdefault(name, []).append(s)
            if out_parts is not None:
                absolute = math.sqrt(sum(p[0] for p in out_parts if p is not None))
                self.last_out[name] = (s.out_error, absolute, s.out_finite)
            if name not in self.order:
                self.order.append(name)


def policy_run(
    model: Any,
    call: Call,
    ref: Reference,
    *,
    dtype: torch.dtype,
    device_type: str,
    keep: tuple[str, ...],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    fp8: Fp8Config | None = None,
) -> RunResult:
    """One forward (and backward with ``loss_fn``) under autocast with ``keep`` in fp32, measured
    against ``ref`` module by module and end to end; the forward's low-precision ops and the
    growth of their rounding after the module that ran them are recorded (:class:`Flow`).

    With ``fp8``: every matmul the fp8 pass converts runs in fp8 (:class:`Fp8Eager`) except inside
    ``keep``, which is kept out of fp8 (in ``dtype``); the low-precision ops are the fp8 GEMMs, and
    growth is judged against e4m3's rounding."""
    m = private_copy(model)
    if fp8 is None:
        keep_in_fp32(m, keep, device_type)
    stack: list[str] = []
    flow = Flow(stack, dtype, device_type, None if fp8 is None else frozenset({"_scaled_mm"}))
    mode = fp8_mode(fp8, dtype, device_type, stack, keep)
    rec = _Recorder(ref, flow, stack, dtype, grain(dtype, fp8))
    with torch.random.fork_rng(devices=[]), module_hooks(m, rec.pre, rec.post):
        torch.manual_seed(SEED)
        with torch.autocast(device_type, dtype=dtype), flow, mode:
            out = call.copy()(m)
            loss = loss_of(out, loss_fn)
    fp8_calls = tuple(mode.calls) if fp8 is not None else ()
    low_ops = _low_ops(flow, fp8_calls, fp8 is not None)
    outs = floats(out)
    out_parts = error_parts(outs, ref.out)
    rec.read(float_tensors(out), out_parts)
    if loss is not None and ref.loss is not None:
        rec.read([loss], error_parts([loss.detach()], [ref.loss]))
    e2e = end_to_end(m, outs, out_parts, loss, ref, dtype)
    modules = _module_stats(m, rec, e2e, ref, low_ops, fp8_calls)
    return RunResult(
        keep,
        e2e.finite,
        e2e.error,
        e2e.loss_error,
        e2e.grad_error,
        e2e.output_error,
        e2e.scale,
        with_findings(modules, rec.grain, e2e.finite),
        tuple(rec.order),
        low_ops,
        rec.amplified,
        {k: frozenset(v) for k, v in rec.fed_by.items()},
        fp8_calls,
    )


def _low_ops(flow: Flow, fp8_calls: Sequence[Fp8Call], fp8: bool) -> dict[str, tuple[tuple[str, float], ...]]:
    """Innermost module -> the low-precision ops it ran (op, FLOPs); with ``fp8``, the model's
    matmuls that ran in fp8, as the fp8 pass names them."""
    if not fp8:
        return {k: tuple(v) for k, v in flow.ops.items()}
    low_ops: dict[str, tuple[tuple[str, float], ...]] = {}
    for c in fp8_calls:
        low_ops[c.module] = (*low_ops.get(c.module, ()), (c.op, float(c.flops)))
    return low_ops


def _module_stats(
    m: torch.nn.Module,
    rec: _Recorder,
    e2e: EndToEnd,
    ref: Reference,
    low_ops: dict[str, tuple[tuple[str, float], ...]],
    fp8_calls: Sequence[Fp8Call],
) -> dict[str, ModuleStats]:
    """Each called module's measurements, the worst over its calls (findings not yet judged)."""
    finfo = torch.finfo(rec.dtype)
    init_scale = initial_scale(rec.dtype)
    names = [n for n, p in m.named_parameters()]
    grads = e2e.grads
    modules: dict[str, ModuleStats] = {}
    for name, module in m.named_modules():
        stats = rec.per_call.get(name)
        if not stats:
            continue
        own = [p.detach() for p in module.parameters(recurse=False)]
        under = [n for n in names if n == name or n.startswith(name + ".")] if name else names
        g_low = [grads[n] for n in under if n in grads and n in ref.grads]
        g_ref = [ref.grads[n] for n in under if n in grads and n in ref.grads]
        out_error = max(s.out_error for s in stats)
        in_error = max(s.in_error for s in stats)
        finite_in = all(s.in_finite for s in stats)
        amp = out_error / max(in_error, rec.unit) if math.isfinite(in_error) else math.nan
        modules[name] = ModuleStats(
            name=name,
            type=type(module).__name__,
            calls=len(stats),
            output_error=out_error,
            input_error=in_error,
            amplification=amp,
            headroom=max(s.out_max for s in stats) / finfo.max,
            underflow=max(s.underflow for s in stats),
            weight_headroom=max_abs(own) / finfo.max,
            low_precision=any(s.out_low for s in stats),
            finite=all(s.out_finite for s in stats),
            inputs_finite=finite_in,
            grad_error=rel_error(g_low, g_ref, finfo.tiny) if g_low else None,
            grad_headroom=max_abs(g_ref) * init_scale / finfo.max if g_ref else None,
            grad_underflow=underflow(g_ref, rec.dtype, init_scale) if g_ref else None,
            low_precision_ops=sum(len(ops) for o, ops in low_ops.items() if inside(o, name)),
            fp8_error=max((c.error for c in fp8_calls if c.module == name), default=None),
            amplified_after=max((g for group, g in rec.amplified.items() if name in group), default=None),
        )
    return modules
