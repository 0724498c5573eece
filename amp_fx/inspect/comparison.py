"""amp_fx.compare: amp_fx against eager ``torch.autocast``, op by op, then outputs and gradients.

How ops are matched. amp_fx records every graph Dynamo hands it (one per graph break) as a
``GraphRecord`` holding the *captured* pre-dispatch ATen graph (before the passes) and the
*rewritten* one; insert_casts rewrites in place and only adds cast nodes, and fold_casts removes
only cast nodes, so every op of your program keeps its node name in both graphs. compare records
the real inputs each graph is called with (a recording downstream backend), then, per graph, on
copies of those inputs:

(a) runs the rewritten graph with an ``fx.Interpreter``, keeping every op's output (amp_fx);
(b) runs the captured graph with an ``fx.Interpreter`` under ``torch.autocast(device, dtype)``:
    each ATen op goes through the real Autocast dispatch key, exactly as in eager (eager autocast);
(c) runs the captured graph without autocast on float64 copies of the inputs (the reference;
    float32 if the graph cannot run in float64).

Op nodes are matched by name across (a), (b) and (c). Casts amp_fx inserted are not ops of your
program and are not compared; a cast of yours that a fold removed is listed as folded. A graph
break gives separate records, each compared on its own recorded inputs, so matching never crosses
a break. Then the real eager model under ``torch.autocast`` and the amp_fx-compiled model are run
end to end for outputs and each parameter's ``.grad``.

What "agree" means. Per op, (a) and (b) run the same ATen kernels on the same dtypes whatever the
downstream backend, so an op agrees when its output dtype is the same and its values are equal bit
for bit (NaN equal to NaN). End to end, backends "eager" and "aot_eager" must also be bitwise;
other backends (inductor) fuse ops and keep intermediates in fp32 (excess precision), so outputs
and gradients agree within ``rtol = atol_scale = 2 * eps(dtype)`` (two roundings of the lower
dtype), the absolute tolerance relative to the largest magnitude of the eager value.

With ``fp8=`` (a recipe, as :func:`amp_fx.compile` takes it) the eager side is eager autocast with
fp8 where amp_fx put it: in (b) each matmul the fp8 pass converted runs as the pass rewrote it
(``amp_fx.kernels.fp8_matmul``, torchao 0.18's float8 training numerics, bitwise with torchao's
``convert_to_float8_training``: tests/fp8/), matched to the node that replaced it in the
rewritten graph; end to end, the eager model runs with the same matmuls in fp8
(:class:`~amp_fx.inspect._fp8_eager.Fp8Eager`, honouring ``Policy(keep_out_of_fp8=...)``). The grouped
expert GEMMs of mixture-of-experts layers (``torch._grouped_mm``, transformers'
``grouped_mm_fallback``) the pass converted run in fp8 on the eager side too, in the modules where
the pass converted them (its decisions), with the pass's grouped kernels. The float64 reference
stays float64, so its columns show what fp8 costs.

All runs use deep copies of the model and inputs; your model's parameters, buffers and RNG state
are untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from tabulate import tabulate
from torch.utils._pytree import keystr, tree_flatten_with_path

from amp_fx._common.downstream import Backend, backend_name, resolve_backend
from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.op_names import op_label
from amp_fx._common.report import Reporter, did_less
from amp_fx.backend.eager_numerics import eager_numerics_backend
from amp_fx.fp8 import Fp8Config, Fp8Recipe
from amp_fx.inspect._compiled_ops import CompiledDivergence, first_compiled_divergence
from amp_fx.inspect._fp8_eager import Fp8Eager, fp8_aten, module_stack
from amp_fx.inspect._probe import (
    ValueInterpreter,
    clone_inputs,
    leaf_flags,
    tensors_of,
)
from amp_fx.inspect._runner import (
    NO_FLOAT64_LOAN,
    SEED,
    AmpRun,
    Call,
    float64_grouped_mm,
    is_lent,
    lent,
    private_copy,
    run_amp,
    run_eager_checked,
    split_weight_note,
    weights_split_by_graph_breaks,
)
from amp_fx.low_precision import LowPrecisionLike, one_option, recipes, with_blocks
from amp_fx.low_precision import of as low_precision_of
from amp_fx.options import Numerics
from amp_fx.passes import meta
from amp_fx.passes.fp8_matmuls import Fp8Decision
from amp_fx.passes.pipeline import GraphRecord
from amp_fx.policy import Policy, resolve_dtype

__all__ = ["compare", "CompareReport", "OpComparison", "ValueComparison"]

_EXACT_BACKENDS = ("eager", "aot_eager")


@dataclass(frozen=True)
class Error:
    """max |a - b| and that divided by max |b| (NaN at the same place counts as equal)."""

    abs: float
    rel: float

    def __str__(self) -> str:
        return f"{self.abs:.3g} ({self.rel:.2g})" if not math.isnan(self.abs) else "-"


def _error(a: Any, b: Any) -> Error:
    ta = [t for t in tensors_of(a)]
    tb = [t for t in tensors_of(b)]
    if not ta or len(ta) != len(tb):
        return Error(math.nan, math.nan)
    worst_abs, scale = 0.0, 0.0
    for x, y in zip(ta, tb):
        if x.shape != y.shape or x.is_complex() or y.is_complex():
            return Error(math.inf, math.inf)
        x, y = x.detach().double(), y.detach().double()
        both_nan = torch.isnan(x) & torch.isnan(y)
        same_inf = torch.isinf(x) & (x == y)
        d = (x - y).abs()
        d = torch.where(both_nan | same_inf, torch.zeros_like(d), d)
        d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
        if d.numel():
            worst_abs = max(worst_abs, float(d.max()))
            finite = y[torch.isfinite(y)]
            if finite.numel():
                scale = max(scale, float(finite.abs().max()))
    if scale > 0:
        return Error(worst_abs, worst_abs / scale)
    return Error(worst_abs, 0.0 if worst_abs == 0 else math.inf)


def _bitwise(a: Any, b: Any) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.is_floating_point():
            if not bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all()):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _dtypes(value: Any) -> str:
    ts = tensors_of(value)
    if not ts:
        return "-"
    names = [dtype_name(t.dtype) for t in ts]
    return names[0] if len(set(names)) == 1 else "(" + ", ".join(names) + ")"


@dataclass(frozen=True)
class OpComparison:
    """One op of your program: eager autocast's and amp_fx's dtype and values."""

    graph: int
    node: str
    op: str
    module: str
    eager_dtype: str
    amp_dtype: str
    agree: bool
    error_vs_eager: Error
    error_vs_reference: Error
    eager_error_vs_reference: Error
    rule: str
    status: str = ""
    """``folded`` for a cast of yours that fold_casts removed (not compared)."""

    @property
    def dtype_agrees(self) -> bool:
        return self.eager_dtype == self.amp_dtype

    def where(self) -> str:
        return f"{self.node} ({self.op}{', module ' + self.module if self.module else ''})"


@dataclass(frozen=True)
class ValueComparison:
    """A model output or a parameter gradient, end to end."""

    name: str
    eager_dtype: str
    amp_dtype: str
    agree: bool
    error_vs_eager: Error
    error_vs_reference: Error | None
    eager_error_vs_reference: Error | None
    amp_nonfinite: str = ""
    """What amp_fx's value holds that is not finite: ``inf``, ``NaN``, ``inf, NaN``, or empty."""
    eager_nonfinite: str = ""
    """The same for eager autocast's value."""

    def nonfinite_text(self, kind: str) -> str:
        """``output holds inf (amp_fx and eager)``, ``gradient of fc.weight holds NaN with eager``
        (``kind`` is ``output`` or ``gradient``); empty when both sides are finite."""
        if not (self.amp_nonfinite or self.eager_nonfinite):
            return ""
        what = self.name if kind == "output" else f"gradient of {self.name}"
        if self.amp_nonfinite == self.eager_nonfinite:
            return f"{what} holds {self.amp_nonfinite} (amp_fx and eager)"
        sides = [
            f"{self.amp_nonfinite} with amp_fx" if self.amp_nonfinite else "",
            f"{self.eager_nonfinite} with eager" if self.eager_nonfinite else "",
        ]
        return f"{what} holds " + ", ".join(x for x in sides if x)


def _nonfinite(value: Any) -> str:
    """``inf``, ``NaN`` or ``inf, NaN`` for what the value's floating tensors hold; empty if finite."""
    ts = [t.detach() for t in tensors_of(value) if t.is_floating_point() or t.is_complex()]
    kinds = [k for k, test in (("inf", torch.isinf), ("NaN", torch.isnan)) if any(bool(test(t).any()) for t in ts)]
    return ", ".join(kinds)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


@dataclass
class CompareReport:
    """The result of :func:`compare`. ``ok`` when every op, output and gradient agrees."""

    dtype: torch.dtype
    backend: str
    exact: bool
    ops: list[OpComparison] = field(default_factory=list)
    outputs: list[ValueComparison] = field(default_factory=list)
    grads: list[ValueComparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    reference_dtype: str = "fp64"
    fp8: str | None = None
    """The fp8 recipe both sides ran (``compare(..., fp8=...)``), or None."""
    compiled: list[CompiledDivergence] = field(default_factory=list)
    """Under ``backend="inductor"``: the first op where the ``numerics="eager"`` compile leaves the
    op-by-op run of amp_fx's graphs (ideally none), then the first where inductor's default compile
    does (:mod:`amp_fx.inspect._compiled_ops`)."""

    def _what(self) -> str:
        source = "TransformerEngine's" if self.fp8 == "nvfp4" else "torchao's"
        fp8 = f", matmuls in fp8 {self.fp8} with {source} numerics" if self.fp8 else ""
        return dtype_name(self.dtype) + fp8

    @property
    def ok(self) -> bool:
        return (
            all(o.agree for o in self.ops) and all(v.agree for v in self.outputs) and all(v.agree for v in self.grads)
        )

    @property
    def nonfinite(self) -> list[str]:
        """Outputs and gradients that hold inf or NaN, on either side, in words."""
        return [
            t
            for kind, vs in (("output", self.outputs), ("gradient", self.grads))
            for v in vs
            for t in [v.nonfinite_text(kind)]
            if t
        ]

    @property
    def first_divergence(self) -> OpComparison | None:
        """The first op (graph order, graphs in execution order) whose dtype or value differs."""
        return next((o for o in self.ops if not o.agree), None)

    @property
    def first_dtype_divergence(self) -> OpComparison | None:
        return next((o for o in self.ops if o.status != "folded" and not o.dtype_agrees), None)

    def op_table(self) -> str:
        rows = [
            [
                o.graph,
                o.node,
                o.op,
                o.module,
                o.eager_dtype,
                o.amp_dtype,
                "folded" if o.status == "folded" else ("yes" if o.agree else "NO"),
                o.error_vs_eager,
                o.error_vs_reference,
                o.eager_error_vs_reference,
            ]
            for o in self.ops
        ]
        return tabulate(
            rows,
            headers=[
                "graph",
                "node",
                "op",
                "module",
                "eager",
                "amp_fx",
                "agree",
                "|amp-eager| (rel)",
                f"|amp-{self.reference_dtype}| (rel)",
                f"|eager-{self.reference_dtype}| (rel)",
            ],
        )

    def value_table(self) -> str:
        rows = [
            [
                kind,
                v.name,
                v.eager_dtype,
                v.amp_dtype,
                "yes" if v.agree else "NO",
                v.error_vs_eager,
                v.error_vs_reference or "-",
                v.eager_error_vs_reference or "-",
            ]
            for kind, vs in (("output", self.outputs), ("grad", self.grads))
            for v in vs
        ]
        return tabulate(
            rows,
            headers=[
                "",
                "name",
                "eager",
                "amp_fx",
                "agree",
                "|amp-eager| (rel)",
                f"|amp-{self.reference_dtype}| (rel)",
                f"|eager-{self.reference_dtype}| (rel)",
            ],
        )

    def verdict(self) -> str:
        mode = "bitwise" if self.exact else f"within rtol={_tolerance(self.dtype):.3g} (backend {self.backend})"
        bad_values = self.nonfinite
        flag = ""
        if bad_values:
            shown = "; ".join(bad_values[:4]) + ("; ..." if len(bad_values) > 4 else "")
            flag = f"; NOT FINITE: {shown} (agreement is not health: amp_fx.find_nonfinite names the first op)"
        if self.ok:
            ops = sum(o.status != "folded" for o in self.ops)
            ok = (
                f"OK: amp_fx agrees with eager torch.autocast ({self._what()}) on "
                f"{_plural(ops, 'op')}, {_plural(len(self.outputs), 'output')} and "
                f"{_plural(len(self.grads), 'gradient')} ({mode}){flag}"
            )
            return "\n".join([ok, *(f"compiled: {c}" for c in self.compiled)])
        first = self.first_divergence
        lines = [f"DIFFERS from eager torch.autocast ({self._what()}, {mode}){flag}"]
        if first is not None:
            what = (
                "dtype " + first.eager_dtype + " (eager) vs " + first.amp_dtype + " (amp_fx)"
                if not first.dtype_agrees
                else f"values, max abs diff {first.error_vs_eager}"
            )
            lines.append(
                f"first divergence: graph {first.graph}, node {first.where()}: {what}; amp_fx decided: {first.rule}"
            )
        bad = [v.name for v in (*self.outputs, *self.grads) if not v.agree]
        if bad:
            lines.append("differing outputs/gradients: " + ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))
        lines += [f"compiled: {c}" for c in self.compiled]
        return "\n".join(lines)

    def __str__(self) -> str:
        parts = [self.verdict()]
        if self.ops:
            parts += ["", "ops (graph order):", self.op_table()]
        if self.outputs or self.grads:
            parts += ["", "end to end:", self.value_table()]
        parts += [f"note: {n}" for n in self.notes]
        return "\n".join(parts)

    def __bool__(self) -> bool:
        return self.ok


def _tolerance(dtype: torch.dtype) -> float:
    # two roundings to the lower dtype: inductor may skip one per fused op (excess precision)
    return 2 * torch.finfo(dtype).eps


def _close(a: Any, b: Any, exact: bool, dtype: torch.dtype) -> bool:
    if exact:
        return _bitwise(a, b)
    ta, tb = tensors_of(a), tensors_of(b)
    if len(ta) != len(tb) or any(x.dtype != y.dtype or x.shape != y.shape for x, y in zip(ta, tb)):
        return False
    err = _error(a, b)
    return err.rel <= _tolerance(dtype)


def _rule_of(node: torch.fx.Node | None) -> str:
    if node is None:
        return ""
    d = node.meta.get(meta.DECISION)
    return d.reason if d is not None else ""


class _GraphRunError(Exception):
    """A recorded graph failed when re-run op by op; names the node."""

    def __init__(self, node: torch.fx.Node | None, error: BaseException) -> None:
        self.node, self.error = node, error
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        at = f" at {node.name} ({op_label(node.target)})" if node is not None else ""
        super().__init__(f"{type(error).__name__}{at}: {first}")


def _run(
    gm: torch.fx.GraphModule,
    inputs: list[Any],
    *,
    autocast: tuple[str, torch.dtype] | None,
    fp8: Mapping[str, Fp8Config] | None = None,
) -> dict[str, Any]:
    """Every node's value; with ``fp8`` (and ``autocast``), the nodes it names (matmuls the fp8 pass
    converted, each with its recipe) computed as the pass rewrote them."""
    interp = ValueInterpreter(gm)
    current: list[torch.fx.Node] = []
    run_node = interp.run_node

    def tracked(n: torch.fx.Node) -> Any:
        current[:] = [n]
        if fp8 is not None and autocast is not None and n.name in fp8:
            args, kwargs = interp.fetch_args_kwargs_from_env(n)
            return fp8_aten(n.target, args, kwargs, fp8[n.name], autocast[1], autocast[0])
        return run_node(n)

    interp.run_node = tracked  # type: ignore[method-assign]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(SEED)
        try:
            if autocast is not None:
                with torch.autocast(autocast[0], dtype=autocast[1]):
                    interp.run(*inputs)
            else:
                interp.run(*inputs)
        except Exception as e:
            raise _GraphRunError(current[0] if current else None, e) from e
    return {n.name: v for n, v in interp.env.items()}


def _reference(record: GraphRecord, inputs: list[Any], flags: list[bool], report: CompareReport) -> dict[str, Any]:
    """The captured graph without autocast, in float64, else float32; empty when it cannot run
    without autocast at all (noted)."""
    try:
        return _run(record.captured, clone_inputs(inputs, flags, to=torch.float64), autocast=None)
    except _GraphRunError as e64:
        try:
            ref = _run(record.captured, clone_inputs(inputs, flags), autocast=None)
        except _GraphRunError as e32:
            report.notes.append(
                f"graph {record.index} has no op-by-op reference: without autocast it fails "
                f"({e32}). A dtype your code read while autocast was on is fixed in the captured "
                "graph (e.g. a mask made with dtype=q.dtype, q an autocast output), so it no "
                "longer matches when the graph runs in fp32; amp_fx and eager autocast are still "
                "compared op by op, and the end-to-end reference runs your model itself"
            )
            return {}
        report.reference_dtype = "fp32"
        report.notes.append(f"graph {record.index} cannot run in float64 ({e64}); its reference is float32")
        return ref


def _fp8_decision(new: torch.fx.Node) -> Fp8Decision | None:
    """The fp8 pass's decision on the node that replaced a converted matmul (the fp8 call, or the
    bias add after it)."""
    call = new if meta.FP8 in new.meta else new.args[0]
    return call.meta.get(meta.FP8) if isinstance(call, torch.fx.Node) else None


def _compare_graph(
    record: GraphRecord,
    inputs: list[Any],
    exact: bool,
    report: CompareReport,
    run: AmpRun,
    fp8: Fp8Config | None = None,
) -> None:
    flags = leaf_flags(record)
    # captured matmul -> the node that replaced it in the rewritten graph (fp8 call or bias add)
    replaced = {n.meta[meta.FP8_OF]: n for n in record.rewritten.graph.nodes if meta.FP8_OF in n.meta}
    switches = fp8.nvfp4 if fp8 is not None else None  # NVFP4's switches, for its matmuls only
    recipes = {
        name: Fp8Config(d.recipe, nvfp4=switches if d.recipe is Fp8Recipe.NVFP4 else None)
        for name, n in replaced.items()
        if (d := _fp8_decision(n)) and d.recipe
    }
    try:
        amp = _run(record.rewritten, clone_inputs(inputs, flags), autocast=None)
        eager = _run(
            record.captured,
            clone_inputs(inputs, flags),
            autocast=(record.device_type, record.dtype),
            fp8=recipes if fp8 is not None and recipes else None,
        )
    except _GraphRunError as e:
        report.notes.append(
            f"graph {record.index} not compared op by op: re-running it on its "
            f"recorded inputs fails ({e}); the end-to-end comparison still runs"
        )
        return
    ref = _reference(record, inputs, flags, report)
    rewritten = {n.name: n for n in record.rewritten.graph.nodes}
    for node in record.captured.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        path, _ = run.module_of(record, node)
        new = rewritten.get(node.name)
        rule = None
        if new is None and node.name in replaced:  # converted to fp8: compared with eager's fp8
            new = replaced[node.name]
            decision = _fp8_decision(new)
            rule = decision.reason if decision is not None else "fp8"
        e_val = eager[node.name]
        if new is None:
            report.ops.append(
                OpComparison(
                    record.index,
                    node.name,
                    op_label(node.target),
                    path,
                    _dtypes(e_val),
                    "-",
                    True,
                    Error(math.nan, math.nan),
                    Error(math.nan, math.nan),
                    Error(math.nan, math.nan),
                    "cast removed by fold_casts (value-preserving)",
                    status="folded",
                )
            )
            continue
        a_val, r_val = amp[new.name], ref.get(node.name)
        agree = _dtypes(a_val) == _dtypes(e_val) and _bitwise(a_val, e_val)
        report.ops.append(
            OpComparison(
                record.index,
                node.name,
                op_label(node.target),
                path,
                _dtypes(e_val),
                _dtypes(a_val),
                agree,
                _error(a_val, e_val),
                _error(a_val, r_val),
                _error(e_val, r_val),
                rule if rule is not None else _rule_of(new),
            )
        )


def _cotangents(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + 1)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device) for o in outputs]


def _loss(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor | None:
    if loss_fn is not None:
        return loss_fn(out)
    floats = [t for t in tensors_of(out) if t.is_floating_point() and t.requires_grad]
    if not floats:
        return None
    # a fixed random cotangent (a plain sum would give e.g. softmax outputs zero gradients);
    # .float(), mul and sum are not in autocast's tables, so both sides compute it alike
    total = sum((o.float() * g).sum() for o, g in zip(floats, _cotangents(floats)))
    assert isinstance(total, torch.Tensor)  # floats is not empty
    return total


def _named_outputs(out: Any) -> list[tuple[str, torch.Tensor]]:
    """``output`` for a lone tensor, else ``output`` with the path: ``output[0]``,
    ``output['logits']``."""
    leaves = [(keystr(path), t) for path, t in tree_flatten_with_path(out)[0] if isinstance(t, torch.Tensor)]
    if len(leaves) == 1:
        return [("output", leaves[0][1])]
    return [(f"output{path}", t) for path, t in leaves]


def _loss_and_backward(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None, grads: bool) -> Any:
    """amp_fx's run: the loss and backward after the compiled model's forward; returns ``out``."""
    loss = _loss(out, loss_fn)
    if grads and loss is not None and loss.requires_grad:
        loss.backward()
    return out


def _grads_of(model: Any) -> dict[str, torch.Tensor]:
    if not isinstance(model, torch.nn.Module):
        return {}
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _run_end_to_end(
    model: Any,
    call: Call,
    *,
    autocast: tuple[str, torch.dtype] | None,
    grads: bool,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    to: torch.dtype | None = None,
    fp8: Fp8Config | None = None,
    keep_out_of_fp8: Sequence[Any] = (),
    grouped: frozenset[str] = frozenset(),
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Eager autocast's run (``autocast`` given) or the reference's: the loss ``loss_fn`` gives is
    computed inside the autocast region, the default projection outside it. With ``fp8`` (and
    ``autocast``), the matmuls the fp8 pass converts run in fp8 outside ``keep_out_of_fp8``, and
    the grouped expert GEMMs of the modules in ``grouped``."""
    inputs = call.copy(to=to)
    stack: list[str] = []
    root = model if isinstance(model, torch.nn.Module) else None
    fp8_mode: Any = contextlib.nullcontext()
    if fp8 is not None and autocast is not None:
        fp8_mode = Fp8Eager(
            fp8, autocast[1], autocast[0], stack, keep_out_of_fp8, measure=False, root=root, grouped=grouped
        )
    hooks: Any = module_stack(root, stack) if root is not None and fp8 is not None else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), hooks:
        torch.manual_seed(SEED)
        if autocast is not None:
            with torch.autocast(autocast[0], dtype=autocast[1]), fp8_mode:
                out = inputs(model)
                loss = _loss(out, loss_fn) if loss_fn is not None else None
        else:
            out = inputs(model)
            loss = _loss(out, loss_fn) if loss_fn is not None else None
        if loss is None:
            loss = _loss(out, None)
        if grads and loss is not None and loss.requires_grad:
            loss.backward()
    return out, _grads_of(model)


def compare(
    model_or_fn: Any,
    *args: Any,
    dtype: str | torch.dtype = "bf16",
    policy: Policy | None = None,
    backend: str | Backend = "aot_eager",
    grads: bool = True,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    low_precision: LowPrecisionLike = None,
    fp8: LowPrecisionLike = None,
    numerics: str | Numerics = "default",
    **kwargs: Any,
) -> CompareReport:
    """Compare amp_fx with eager ``torch.autocast`` on the same inputs and parameters.

    Lists, op by op, the dtype eager autocast used and the dtype amp_fx used, whether they agree,
    and the op's error against eager autocast and against a float64 reference; then the same for
    the outputs and, with ``grads=True``, each parameter's gradient. ``report.first_divergence``
    names the first op (with its module path) where dtype or value differs. How ops are matched
    across graph breaks and folded casts, and what "agree" means per backend: see the module doc.

    Args:
        model_or_fn: an ``nn.Module`` or a function; never modified (runs use deep copies; an
            FSDP2 model, which refuses them, runs itself and is put back as it was, without the
            float64 end-to-end reference and without ``fp8``).
        *args: example inputs, positional.
        dtype: "bf16" or "fp16" (and their aliases).
        policy: amp_fx's policy (differences it makes on purpose are reported as differences).
        backend: the downstream backend amp_fx hands its graphs to.
        grads: also compare the parameters' gradients.
        loss_fn: maps the output to the scalar to differentiate; by default a fixed random
            projection of every floating output. Eager computes it inside the autocast region.
        low_precision: a recipe, or a recipe per module (as :func:`amp_fx.compile` takes it):
            amp_fx runs with it, and the eager side runs the same matmuls in the same recipes with
            torchao's numerics (see the module doc).
        fp8: the older spelling of ``low_precision``; passing both is a TypeError.
        numerics: ``"eager"`` with ``backend="inductor"``: amp_fx's graphs compiled as
            ``amp_fx.compile(numerics="eager")`` compiles them, and the end-to-end comparison is
            bitwise. A difference left there is the policy's (or amp_fx's); one that only the
            default-numerics run shows is inductor's fusion (docs "Eager numerics under inductor").
            With ``backend="inductor"`` (either numerics) ``report.compiled`` names, for this mode's
            compile and for inductor's default one, the first forward op whose compiled value
            leaves the op-by-op run (:mod:`amp_fx.inspect._compiled_ops`).
        **kwargs: example inputs by keyword, as the model takes them
            (``compare(model, input_ids=ids, labels=labels)``).

    Raises:
        ValueError: the model fails in plain eager mode on these inputs (error chained).
        TypeError: ``fp8`` on an FSDP2 model, or one accumulating without gradient sync.
    """
    lower = resolve_dtype(dtype)
    exact = isinstance(backend, str) and backend in _EXACT_BACKENDS
    report = CompareReport(dtype=lower, backend=backend_name(backend), exact=exact)
    inductor = backend == "inductor"
    reporter = Reporter()
    if Numerics.of(numerics) is Numerics.EAGER:
        if not inductor:
            raise ValueError(f"amp_fx.compare: numerics='eager' configures inductor, but backend={backend!r}")
        backend = eager_numerics_backend({}, reporter)
        report.exact, report.backend = True, "inductor (numerics='eager')"
    call = Call(args, kwargs)
    with lent(model_or_fn, tool="compare"):  # an FSDP2 model: runs on it, put back after
        run_eager_checked(model_or_fn, call, tool="compare")
        device_type = call.device_type(model_or_fn)

        config = with_blocks(low_precision_of(one_option(fp8, low_precision, "amp_fx.compare")), model_or_fn)
        report.fp8 = None if config is None else " + ".join(r.value for r in recipes(config))
        run = run_amp(
            model_or_fn,
            call,
            tool="compare",
            dtype=lower,
            policy=policy,
            downstream=backend,
            then=lambda out: _loss_and_backward(out, loss_fn, grads),
            fp8=config,
        )
        amp_out, amp_grads = run.result, _grads_of(run.compiled)
        _compare_graphs(report, run, report.exact, config)
        if inductor:
            _compare_compiled(report, run, reporter)
        eager_out, eager_grads = _run_end_to_end(
            private_copy(model_or_fn),
            call,
            autocast=(device_type, lower),
            grads=grads,
            loss_fn=loss_fn,
            fp8=config,
            keep_out_of_fp8=(policy or Policy()).keep_out_of_fp8,
            grouped=_fp8_grouped_modules(run.records),
        )
        ref_out, ref_grads = _float64_reference(model_or_fn, call, report, grads=grads, loss_fn=loss_fn)
        _compare_outputs(report, eager_out, amp_out, ref_out, report.exact, lower)
        if grads:
            _compare_grads(report, eager_grads, amp_grads, ref_grads, report.exact, lower, model_or_fn)
        _explain_cross_graph_grads(report, run)
        return report


def _compare_graphs(report: CompareReport, run: AmpRun, exact: bool, config: Fp8Config | None) -> None:
    """The op-by-op part: every graph amp_fx compiled and ran, against eager autocast."""
    recs, recorder = run.records, run.recorder
    if not recs or not any(n.op == "call_function" for r in recs for n in r.captured.graph.nodes):
        report.notes.append(
            "no ops were captured: the function does nothing torch.compile puts "
            "in a graph, so there is nothing to compare op by op"
        )
    for r in recs:
        inputs = recorder.inputs_for(r)
        if r.fallback is not None:
            report.notes.append(
                f"graph {r.index} not compared op by op: {r.fallback_text}; the end-to-end comparison still runs"
            )
            continue
        if inputs is None:
            report.notes.append(f"graph {r.index} was compiled but not called; not compared")
            continue
        _compare_graph(r, inputs, exact, report, run, config)
    if recs and not any(o.eager_dtype in ("bf16", "fp16", "fp32", "fp64") or "(" in o.eager_dtype for o in report.ops):
        report.notes.append("no floating-point ops: nothing for autocast or amp_fx to cast")


def _compare_compiled(report: CompareReport, run: AmpRun, reporter: Reporter) -> None:
    """Under inductor: where the ``numerics="eager"`` compile and inductor's default compile of
    amp_fx's graphs first leave the same graphs run op by op (:mod:`amp_fx.inspect._compiled_ops`):
    a difference only the default run shows is fusion's, not the policy's."""
    runs = {
        "inductor, numerics='eager'": eager_numerics_backend({}, reporter),
        "inductor, default numerics": resolve_backend("inductor"),
    }
    for label, backend in runs.items():
        found, failed = CompiledDivergence(label), []
        for r in run.records:
            inputs = run.recorder.inputs_for(r)
            if r.fallback is not None or inputs is None:
                continue
            flags = leaf_flags(r)
            try:
                op_by_op = _run(r.rewritten, clone_inputs(inputs, flags), autocast=None)
                hit = first_compiled_divergence(
                    r.rewritten, clone_inputs(inputs, flags), op_by_op, backend, same=_bitwise
                )
            except Exception as e:  # the op-by-op run's failure is noted by _compare_graph already
                failed.append(r.index)
                if not isinstance(e, _GraphRunError):
                    line = (str(e).strip().splitlines() or [repr(e)])[0]
                    report.notes.append(f"{label}: graph {r.index} not compiled op by op ({type(e).__name__}: {line})")
                continue
            if hit is not None:
                node, value = hit
                found = CompiledDivergence(
                    label,
                    r.index,
                    node.name,
                    op_label(node.target),
                    run.module_of(r, node)[0],
                    str(_error(value, op_by_op[node.name])),
                )
                break
        report.compiled.append(dataclasses.replace(found, not_compiled=tuple(failed)))


def _float64_reference(
    model_or_fn: Any, call: Call, report: CompareReport, *, grads: bool, loss_fn: Callable[[Any], torch.Tensor] | None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The outputs and gradients of a float64 copy, without autocast; (None, {}) and a note where
    the model fails in float64, or is an FSDP2 model lent to compare (no float64 copy of it)."""
    if is_lent(model_or_fn):
        report.notes.append(f"no float64 end-to-end reference: {NO_FLOAT64_LOAN}")
        return None, {}
    try:
        ref_model = private_copy(model_or_fn, float64=True)
        with float64_grouped_mm():  # grouped expert GEMMs have no float64 kernel
            return _run_end_to_end(ref_model, call, autocast=None, grads=grads, loss_fn=loss_fn, to=torch.float64)
    except Exception as e:
        report.notes.append(f"no float64 end-to-end reference: the model fails in float64 ({type(e).__name__}: {e})")
        return None, {}


def _value(name: str, e: Any, a: Any, r: Any, exact: bool, lower: torch.dtype) -> ValueComparison:
    """One output or gradient: amp_fx's (``a``) against eager autocast's (``e``) and float64's (``r``)."""
    return ValueComparison(
        name,
        _dtypes(e),
        _dtypes(a),
        _close(a, e, exact, lower),
        _error(a, e),
        _error(a, r) if r is not None else None,
        _error(e, r) if r is not None else None,
        _nonfinite(a),
        _nonfinite(e),
    )


def _compare_outputs(
    report: CompareReport, eager_out: Any, amp_out: Any, ref_out: Any, exact: bool, lower: torch.dtype
) -> None:
    e_outs, a_outs = _named_outputs(eager_out), _named_outputs(amp_out)
    r_outs = dict(_named_outputs(ref_out)) if ref_out is not None else {}
    for (name, e), (_, a) in zip(e_outs, a_outs):
        report.outputs.append(_value(name, e, a, r_outs.get(name), exact, lower))
    if len(e_outs) != len(a_outs):
        report.notes.append(f"eager gives {len(e_outs)} output tensors, amp_fx {len(a_outs)}")
        report.outputs.append(
            ValueComparison("outputs", str(len(e_outs)), str(len(a_outs)), False, Error(math.inf, math.inf), None, None)
        )


def _compare_grads(
    report: CompareReport,
    eager_grads: dict[str, torch.Tensor],
    amp_grads: dict[str, torch.Tensor],
    ref_grads: dict[str, torch.Tensor],
    exact: bool,
    lower: torch.dtype,
    model_or_fn: Any,
) -> None:
    for name in [*eager_grads, *(n for n in amp_grads if n not in eager_grads)]:
        e, a = eager_grads.get(name), amp_grads.get(name)
        if e is None or a is None:
            report.grads.append(
                ValueComparison(
                    name,
                    "-" if e is None else _dtypes(e),
                    "-" if a is None else _dtypes(a),
                    False,
                    Error(math.inf, math.inf),
                    None,
                    None,
                    _nonfinite(a),
                    _nonfinite(e),
                )
            )
            continue
        report.grads.append(_value(name, e, a, ref_grads.get(name), exact, lower))
    if not report.grads:
        why = (
            "it is a function: compare reads the gradients of an nn.Module's parameters"
            if not isinstance(model_or_fn, torch.nn.Module)
            else "no parameter got a gradient (no floating output requires grad, or loss_fn "
            "does not depend on the parameters)"
        )
        message = (
            f"amp_fx.compare: grads=True, but no gradient was compared: {why}; pass grads=False to compare outputs only"
        )
        report.notes.append(message.removeprefix("amp_fx.compare: "))
        did_less(("compare", "no grads", why), message)


def _fp8_grouped_modules(records: Sequence[GraphRecord]) -> frozenset[str]:
    """The modules whose grouped expert GEMMs the fp8 pass converted."""
    return frozenset(
        d.module
        for r in records
        if r.fp8 is not None
        for d in r.fp8.decisions
        if d.converted and d.op == "aten._grouped_mm"
    )


def _explain_cross_graph_grads(report: CompareReport, run: AmpRun) -> None:
    """Name the known cause of a gradient difference when every op agrees: a weight used in
    several graphs (on both sides of a graph break)."""
    if not all(o.agree for o in report.ops):
        return
    split = weights_split_by_graph_breaks(run)
    for g in report.grads:
        if not g.agree and g.name in split:
            report.notes.append(
                split_weight_note(g.name, split[g.name], report.dtype) + "; compare the reference columns"
            )
