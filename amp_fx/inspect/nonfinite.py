"""amp_fx.find_nonfinite: the first op whose output (or gradient) holds inf or NaN, and a fix.

How it works. The model (a deep copy) is compiled by amp_fx with a downstream backend that runs
each rewritten graph through an ``fx.Interpreter`` on the real tensors. The casts are explicit
nodes of that graph, so the forward is exactly amp_fx's, and autograd records it as it runs: the
backward is amp_fx's too. Graph breaks need nothing special: the model's own Python runs between
the graphs as usual, so ops are seen in execution order.

* forward: after each op, its output is checked. An op whose output holds inf/NaN while its
  inputs are finite is an origin; the first origin whose inf/NaN reaches the model's output or
  the loss (through a chain of non-finite values, across graph breaks) is reported with the range
  of its inputs. An origin whose value every consumer drops (``torch.where``, ``min``, clamp, an
  integer cast: T5's ``log`` of 0 in its relative position buckets) is listed in
  ``NonfiniteReport.discarded``, not reported. The reported op is then re-run with its inputs in
  float32; if that is finite, the report proposes keeping the op's module in fp32 (or, for an op
  at the top level, moving the op to fp32 in the policy), and by default checks the whole model
  again with that policy.
* backward: a hook on every op's output sees the gradient flowing into it; the first non-finite
  gradient in backward execution order is reported with the op whose output it belongs to.

    >>> report = amp_fx.find_nonfinite(model, x, dtype="fp16")   # doctest: +SKIP
    >>> print(report)                                            # doctest: +SKIP
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx
from tabulate import tabulate

from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.op_names import op_label
from amp_fx._common.report import did_less
from amp_fx.inspect._probe import (
    all_finite,
    format_range,
    tensor_range,
    tensors_of,
    value_dtype,
)
from amp_fx.inspect._runner import (
    AmpRun,
    Call,
    lent,
    run_amp,
    run_eager_checked,
    split_weight_note,
    weights_split_by_graph_breaks,
)
from amp_fx.passes.fx_edit import is_cast, is_inserted_cast
from amp_fx.passes.pipeline import GraphRecord
from amp_fx.policy import CastClass, OpLike, Policy, op_from_name, resolve_dtype

__all__ = ["find_nonfinite", "NonfiniteReport"]


@dataclass
class NonfiniteReport:
    """What :func:`find_nonfinite` found. ``found`` is False on a healthy model."""

    dtype: torch.dtype
    found: bool = False
    phase: str | None = None
    """``"forward"`` or ``"backward"``."""
    op: str | None = None
    """The ATen op, e.g. ``aten.linear``; ``input`` for an input that already holds inf/NaN."""
    node: str | None = None
    graph: int | None = None
    module_path: str | None = None
    module_type: str | None = None
    dtype_found: torch.dtype | None = None
    """The dtype of the non-finite value (the op's output, or the gradient)."""
    inputs: list[tuple[str, str]] = field(default_factory=list)
    """(input, its dtype and range) of the op, for the forward."""
    value_range: str = ""
    reason: str = ""
    """Why the value is non-finite, in words."""
    suggestion: str = ""
    suggested_policy: Policy | None = None
    suggestion_code: str = ""
    """The suggested policy change as code, e.g. ``Policy(keep_fp32=("fc2",))``."""
    fp32_finite: bool | None = None
    """Whether re-running the op with its inputs in float32 gives a finite output."""
    verified: bool | None = None
    """Whether no inf/NaN reaches the outputs, the loss or the gradients with ``suggested_policy``
    (None: not checked); discarded ones (:attr:`discarded`) may remain."""
    verification: str = ""
    notes: list[str] = field(default_factory=list)
    discarded: list[str] = field(default_factory=list)
    """Forward ops whose output held inf/NaN that no model output depends on (every consumer
    discarded it: a ``where``, ``min``, clamp or integer cast), in execution order, e.g. T5's
    ``log`` of 0 in its relative position buckets. Not hits: ``found`` ignores them."""

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype_found)

    def __str__(self) -> str:
        if not self.found:
            checked_backward = not any("backward skipped" in n for n in self.notes)
            grads = " and every gradient in the backward" if checked_backward else ""
            if self.discarded:
                lines = [
                    f"no inf/NaN found: the model's outputs{grads} are finite with amp_fx ({dtype_name(self.dtype)})"
                ]
            else:
                lines = [
                    f"no inf/NaN found: every op output in the forward{grads}"
                    f" is finite with amp_fx ({dtype_name(self.dtype)})"
                ]
            return "\n".join(lines + self._discarded_lines() + [f"note: {n}" for n in self.notes])
        where = f"module `{self.module_path}` ({self.module_type})" if self.module_path else "top level"
        lines = [
            f"first inf/NaN in the {self.phase}: graph {self.graph}, node {self.node} "
            f"({self.op}) in {where}, dtype {self.dtype_name}",
            f"  {self.reason}",
        ]
        if self.value_range:
            lines.append(f"  {'gradient' if self.phase == 'backward' else 'output'}: {self.value_range}")
        if self.inputs:
            lines.append(tabulate([[n, r] for n, r in self.inputs], headers=["input", "range"]))
        if self.suggestion:
            lines.append(f"fix: {self.suggestion}")
        if self.verification:
            lines.append(f"check: {self.verification}")
        lines += self._discarded_lines() + [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _discarded_lines(self) -> list[str]:
        if not self.discarded:
            return []
        return [
            "discarded: inf/NaN produced here reaches no output (every use of it was dropped, "
            "e.g. by torch.where or an integer cast), so it is not reported:"
        ] + [f"  {d}" for d in self.discarded]


def _deciding_node(node: torch.fx.Node) -> torch.fx.Node:
    """For a cast amp_fx inserted, the op it was inserted for; else the node itself."""
    if is_inserted_cast(node):
        for user in node.users:
            if user.op == "call_function" and not is_cast(user):
                return user
    return node


def _upcast(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16):
        return v.detach().float()
    if isinstance(v, torch.Tensor):
        return v.detach()
    return v


def _inside(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def _with_fp32(policy: Policy, modules: Sequence[str], ops: Sequence[torch._ops.OpOverload]) -> Policy:
    """The user's policy plus ``modules`` kept in fp32 (replacing kept names inside them) and
    ``ops`` moved to fp32: the fix is cumulative, it never drops what the user already kept."""
    keep = [k for k in policy.keep_fp32 if not (isinstance(k, str) and any(_inside(k, m) and k != m for m in modules))]
    keep += [m for m in modules if m not in keep]
    # overloads, not names: Policy reads the name "aten::exp" as every overload of aten.exp
    classes: dict[OpLike, CastClass] = {op_from_name(k): v for k, v in policy.op_classes.items()}
    return Policy(
        op_classes={**classes, **{op: CastClass.FP32 for op in ops}},
        keep_fp32=tuple(keep),
        cast_cache=policy.cast_cache,
        keep_out_of_fp8=policy.keep_out_of_fp8,
    )


def policy_code(policy: Policy) -> str:
    """The policy as the code that builds it: ``Policy(keep_fp32=("fc1", "fc2"))``."""

    def selector(k: object) -> str:
        if isinstance(k, str):
            return f'"{k}"'
        assert isinstance(k, type)
        return ("nn." if k.__module__.startswith("torch.nn") else f"{k.__module__}.") + k.__qualname__

    parts = []
    # "aten::exp" names the default overload here and, to Policy, every overload: list the
    # others only when their packet's name is not already listed
    op_names = cast(Mapping[str, CastClass], policy.op_classes)  # Policy keeps its keys as names
    ops = {
        k: v
        for k, v in op_names.items()
        if "." not in k.partition("::")[2] or k.partition(".")[0] not in policy.op_classes
    }
    if ops:
        parts.append("op_classes={" + ", ".join(f'"{k}": CastClass.{v.name}' for k, v in ops.items()) + "}")
    if policy.keep_fp32:
        names = [selector(k) for k in policy.keep_fp32]
        parts.append("keep_fp32=(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")")
    if not policy.cast_cache:
        parts.append("cast_cache=False")
    if policy.keep_out_of_fp8:
        names = [selector(k) for k in policy.keep_out_of_fp8]
        parts.append("keep_out_of_fp8=(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")")
    return f"Policy({', '.join(parts)})"


def _kept_text(modules: Sequence[str], ops: Sequence[torch._ops.OpOverload]) -> str:
    words = []
    if modules:
        words.append(("module " if len(modules) == 1 else "modules ") + ", ".join(f"`{m}`" for m in modules))
    if ops:
        words.append(("op " if len(ops) == 1 else "ops ") + ", ".join(op_label(op) for op in ops))
    return " and ".join(words)


def _common_module(a: str, b: str) -> str:
    """The innermost module enclosing both paths; empty for the root."""
    common = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


class _Probe:
    """Downstream backend: runs each rewritten graph through :class:`_ProbeInterpreter`.

    The forward's answer is settled once the model has returned (:meth:`settle`): every op whose
    output holds inf/NaN is marked, an *origin* is a marked op with no marked input (or a graph
    input holding inf/NaN that no earlier graph produced), and the forward hit is the first origin,
    in execution order, from which a chain of marked values reaches the model's output or the loss.
    A value crosses a graph break as the same tensor object, so a graph input is traced by identity
    to the graph that returned it; one that is not (the model's own eager code made it from a
    returned one) is taken to derive from every non-finite value returned so far, as are the
    output and the loss (the conservative answer: the earliest of them is named). Origins whose
    every chain ends (a ``where``, ``min``, clamp or integer cast discarded the value: T5's ``log``
    of 0 in its relative position buckets) are ``discarded``, not hits.

    A hit holds the graph module it was found in (``"graph"``); :func:`_probe_run` replaces it
    with the graph's record once the run is over."""

    def __init__(self, dtype: torch.dtype, backward: bool) -> None:
        self.dtype = dtype
        self.backward = backward
        self.forward_hit: dict[str, Any] | None = None
        self.backward_hit: dict[str, Any] | None = None
        self.origins: list[dict[str, Any]] = []
        """Every origin of the forward, in execution order."""
        self.discarded: list[dict[str, Any]] = []
        """The origins no model output depends on."""
        self._graph_outputs: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}
        """id -> (non-finite tensor a graph returned, its origins); the tensor is held so that
        its id is not reused."""
        # the graphs run op by op in eager (an interpreter that checks each op's output): what the
        # progress lines and reports name, not this class's name
        self.__name__ = "eager"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            return _ProbeInterpreter(gm, self).run(*args)

        return run

    def returned(self, value: Any, origins: frozenset[int]) -> None:
        """A graph returned ``value``, non-finite and derived from ``origins``."""
        for t in tensors_of(value):
            if not all_finite(t):
                self._graph_outputs[id(t)] = (t, origins)

    def origins_of(self, value: Any) -> frozenset[int]:
        """The origins of the non-finite tensors in ``value``: those of the graph that returned
        each, or, for one no graph returned (made from one by eager code between graphs), every
        origin a graph returned so far; none for a parameter (it did not come from a graph)."""
        found: set[int] = set()
        for t in tensors_of(value):
            if all_finite(t) or isinstance(t, torch.nn.Parameter):
                continue
            seen = self._graph_outputs.get(id(t))
            if seen is not None and seen[0] is t:
                found |= seen[1]
            else:
                found |= self._all_returned()
        return frozenset(found)

    def _all_returned(self) -> frozenset[int]:
        """Every origin a graph has returned a non-finite value of so far."""
        return frozenset().union(*(o for _, o in self._graph_outputs.values()))

    def settle(self, out: Any, loss: Any) -> bool:
        """Decide the forward hit from the model's output ``out`` and ``loss`` (None without a
        backward); True when either holds inf/NaN.

        Their non-finite tensors are traced back as graph inputs are (:meth:`origins_of`). An
        output that holds no tensor pytree can see (an object of the model's own class) and no loss
        hides nothing: every origin a graph returned is taken to reach it."""
        tensors = tensors_of((out, loss))
        bad = [t for t in tensors if not all_finite(t)]
        reached = self.origins_of(bad) if tensors else self._all_returned()
        self.forward_hit = self.origins[min(reached)] if reached else None
        self.discarded = [o for i, o in enumerate(self.origins) if i not in reached]
        for o in self.discarded:  # keep what the report shows, not the tensors (one per layer, say)
            o["shown"] = f"{dtype_name(value_dtype(o['out']))} {_range_text(o['out'])}"
            for key in ("out", "inputs", "fp32"):
                o.pop(key, None)
        self._graph_outputs.clear()
        return bool(bad)

    def hook(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> Callable[[torch.Tensor], None]:
        def on_grad(grad: torch.Tensor) -> None:
            if self.backward_hit is None and grad is not None and not all_finite(grad):
                self.backward_hit = {"graph": gm, "node": node, "grad": grad.detach().clone()}

        return on_grad


class _ProbeInterpreter(torch.fx.Interpreter):
    module: torch.fx.GraphModule  # what it runs: a captured graph

    def __init__(self, gm: torch.fx.GraphModule, probe: _Probe) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.probe = probe
        self.marked: dict[torch.fx.Node, frozenset[int]] = {}
        """Node -> the origins of its non-finite output."""

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        probe = self.probe
        if n.op in ("placeholder", "call_function") and not all_finite(out):
            self._mark(n, out)
        if n.op == "output":
            for a in n.all_input_nodes:
                if a in self.marked:
                    probe.returned(self.env[a], self.marked[a])
        if probe.backward and n.op == "call_function" and n.target is not operator.getitem and torch.is_grad_enabled():
            for t in tensors_of(out):
                if t.requires_grad and t.is_floating_point():
                    t.register_hook(probe.hook(self.module, n))
        return out

    def _mark(self, n: torch.fx.Node, out: Any) -> None:
        """Mark ``n`` with the origins of its marked inputs; with none, ``n`` is an origin."""
        probe = self.probe
        if n.op == "placeholder":
            origins = probe.origins_of(out)
        else:
            origins = frozenset().union(*(self.marked[a] for a in n.all_input_nodes if a in self.marked))
        if not origins:
            hit = {"graph": self.module, "node": n, "out": out, "inputs": [(a, self.env[a]) for a in n.all_input_nodes]}
            if n.op == "call_function":
                hit["fp32"] = self._fp32_output(n)
            origins = frozenset((len(probe.origins),))
            probe.origins.append(hit)
        self.marked[n] = origins
        # an in-place op returns its input, whose node now holds the non-finite value too
        for a in n.all_input_nodes:
            if self.env[a] is out:
                self.marked[a] = origins

    def _fp32_output(self, n: torch.fx.Node) -> Any:
        """The op re-run with its fp16/bf16 inputs in float32; a cast to lower precision
        is dropped instead (its input is what fp32 would use)."""
        if is_cast(n) and n.kwargs.get("dtype") in (torch.float16, torch.bfloat16):
            return _upcast(self.env[n.all_input_nodes[0]])  # args[0], the cast's one node input
        args = torch.fx.node.map_arg(n.args, lambda a: _upcast(self.env[a]))
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: _upcast(self.env[a]))
        try:
            with torch.no_grad():
                assert callable(n.target)  # a call_function node's
                return n.target(*args, **kwargs)
        except Exception:  # the op has no fp32 form with these arguments: no claim either way
            return None


def _dtype_kwarg(node: torch.fx.Node) -> torch.dtype | None:
    dtype = node.kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) else None


def _arg_label(a: torch.fx.Node, labels: dict[str, str]) -> str:
    if is_inserted_cast(a) and isinstance(a.args[0], torch.fx.Node):
        src = a.args[0]
        return f"{labels.get(src.name, src.name)} (cast to {dtype_name(_dtype_kwarg(a))} by amp_fx)"
    return labels.get(a.name, a.name)


def _range_text(value: Any) -> str:
    ts = [t for t in tensors_of(value) if t.is_floating_point()]
    return "; ".join(format_range(tensor_range(t)) for t in ts) or "-"


def _forward_reason(
    node: torch.fx.Node, out: Any, inputs: list[tuple[torch.fx.Node, Any]], dtype: torch.dtype | None
) -> str:
    in_ok = all(all_finite(v) for _, v in inputs)
    has_inf = any(bool(torch.isinf(t).any()) for t in tensors_of(out) if t.is_floating_point())
    if dtype in (torch.float16, torch.bfloat16) and in_ok and has_inf:
        fmax = torch.finfo(dtype).max
        if is_cast(node):
            src = max(
                (tensor_range(t)["max_abs"] or 0.0) for _, v in inputs for t in tensors_of(v) if t.is_floating_point()
            )
            return (
                f"casting to {dtype_name(dtype)} overflows: the input holds values up to "
                f"{src:.3g}, above {dtype_name(dtype)}'s max {fmax:.6g}"
            )
        return f"the op's output overflows {dtype_name(dtype)}'s max {fmax:.6g} (its inputs are finite)"
    if in_ok:
        return (
            "the op produces NaN/inf from finite inputs (e.g. log of 0, 0/0, sqrt of a "
            "negative, or an intermediate that overflows inside the op)"
        )
    return "its inputs already hold inf/NaN"


def _probe_run(
    model_or_fn: Any,
    call: Call,
    lower: torch.dtype,
    policy: Policy,
    backward: bool,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    loss_scale: float,
) -> tuple[_Probe, list[str], AmpRun]:
    notes: list[str] = []
    probe = _Probe(lower, backward)

    def then(out: Any) -> None:
        loss = None
        if backward:
            if loss_fn is not None:
                loss = loss_fn(out)
            else:
                floats = [t for t in tensors_of(out) if t.is_floating_point() and t.requires_grad]
                total = sum(t.float().sum() for t in floats)
                loss = total if isinstance(total, torch.Tensor) else None  # 0: no floats
        if probe.settle(out, loss) and probe.forward_hit is None:
            notes.append(
                "the model's output (or the loss) holds inf/NaN, but no op in the "
                "captured graphs produced it: it comes from code that runs between graph "
                "breaks or in loss_fn"
            )
        if probe.forward_hit is None and backward:
            if loss is None or not getattr(loss, "requires_grad", False):
                notes.append("backward skipped: the output does not require grad")
                did_less(
                    ("find_nonfinite", "backward skipped"),
                    "amp_fx.find_nonfinite: backward=True, but the backward was not checked: "
                    "the output (or loss_fn's loss) does not require grad; pass a loss_fn "
                    "that depends on the parameters, or backward=False",
                )
            else:
                (loss * loss_scale).backward()

    run = run_amp(
        model_or_fn,
        call,
        tool="find_nonfinite",
        dtype=lower,
        policy=policy,
        downstream=probe,
        keep_inputs=False,
        then=then,
    )
    for hit in (*probe.origins, probe.backward_hit):
        if hit is not None:
            hit["record"] = next(r for r in run.records if r.rewritten is hit.pop("graph"))
            hit["run"] = run
    if not run.records:
        notes.append("no ops were captured, so there was nothing to check")
    return probe, notes, run


def find_nonfinite(
    model_or_fn: Any,
    *args: Any,
    dtype: str | torch.dtype = "fp16",
    backward: bool = True,
    policy: Policy | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    loss_scale: float = 1.0,
    verify: bool = True,
    **kwargs: Any,
) -> NonfiniteReport:
    """Run amp_fx's rewritten graphs (and their backward) and report the first inf/NaN.

    Reports the first op whose output holds inf or NaN from finite inputs and reaches the model's
    output or the loss (an inf/NaN the model discards, as T5's ``log`` of 0, is listed in
    ``discarded`` instead), with its module path, dtype and the range of its inputs, and which
    fp32-kept alternative avoids it (the op re-run with fp32 inputs); or, if the forward is finite
    and ``backward`` is set, the first gradient (in backward execution order) that holds inf/NaN
    and the op whose output it is the gradient of.

    Args:
        model_or_fn: an ``nn.Module`` or a function; never modified (runs on a deep copy; an FSDP2
            model, which refuses deep copies, is lent: its buffers, gradients and sharding put back).
        *args: example inputs, positional.
        dtype: "fp16" (the usual culprit: max 65504) or "bf16".
        backward: also check the gradients.
        policy: amp_fx's policy.
        loss_fn: maps the output to the scalar to differentiate (default: the sum of the floating
            outputs in fp32).
        loss_scale: multiplies the loss before backward, as a GradScaler would (2**16 is
            GradScaler's initial scale).
        verify: when a fix is proposed, run the whole check again with it.
        **kwargs: example inputs by keyword, as the model takes them
            (``find_nonfinite(model, input_ids=ids, labels=labels)``).

    Raises:
        ValueError: the model fails in plain eager mode on these inputs (error chained).
    """
    with lent(model_or_fn, tool="find_nonfinite"):  # an FSDP2 model: runs on it, put back after
        return _find_nonfinite(model_or_fn, Call(args, kwargs), dtype, backward, policy, loss_fn, loss_scale, verify)


def _find_nonfinite(
    model_or_fn: Any,
    call: Call,
    dtype: str | torch.dtype,
    backward: bool,
    policy: Policy | None,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    loss_scale: float,
    verify: bool,
) -> NonfiniteReport:
    lower = resolve_dtype(dtype)
    policy = Policy() if policy is None else policy
    run_eager_checked(model_or_fn, call, tool="find_nonfinite")
    probe, notes, run = _probe_run(model_or_fn, call, lower, policy, backward, loss_fn, loss_scale)
    notes += [
        split_weight_note(name, where, lower) + "; the backward checked here is amp_fx's"
        for name, where in weights_split_by_graph_breaks(run).items()
    ]
    report = NonfiniteReport(dtype=lower, notes=notes, discarded=[_origin_text(run, o) for o in probe.discarded])
    hit = probe.forward_hit or probe.backward_hit
    if hit is None:
        return report
    record: GraphRecord = hit["record"]
    node: torch.fx.Node = hit["node"]
    labels = run.labels(record)
    path, mtype = run.module_of(record, node)
    report.found = True
    report.graph = record.index
    report.node = node.name
    report.module_path, report.module_type = path, mtype
    describe = _describe_forward if probe.forward_hit is not None else _describe_backward
    first = describe(report, hit, labels)
    if first is None:
        return report
    decider, tail = first
    modules, ops = _kept_in_fp32(hit, decider)
    report.suggested_policy = _with_fp32(policy, modules, ops)
    steps: list[str] = []
    last: list[_Probe] = []
    if verify:

        def check(candidate: Policy) -> _Probe:
            again, _, _ = _probe_run(model_or_fn, call, lower, candidate, backward, loss_fn, loss_scale)
            last.append(again)
            return again

        report.suggested_policy, modules, ops, report.verified, steps = _search_fix(policy, modules, ops, check)
    report.suggestion_code = policy_code(report.suggested_policy)
    via = "" if decider is node or steps else f" (the cast was inserted for {decider.name}, {op_label(decider.target)})"
    report.suggestion = f"keep {_kept_text(modules, ops)} in fp32{via}: {report.suggestion_code}; {tail}"
    if verify:
        kept = last[-1].discarded if last else []
        done = (
            f"with {report.suggestion_code} the whole model runs without inf/NaN"
            f"{' (forward and backward)' if backward else ''}"
            if not kept
            else f"with {report.suggestion_code} no inf/NaN reaches the outputs"
            f"{', the loss or the gradients' if backward else ''} ({len(kept)} discarded "
            "inside the model)"
        )
        report.verification = "; ".join(steps + ([done] if report.verified else []))
    return report


def _origin_text(run: AmpRun, hit: dict[str, Any]) -> str:
    """One line for an origin: where it is and the range of its value."""
    node: torch.fx.Node = hit["node"]
    path = run.module_of(hit["record"], node)[0]
    what = "input" if node.op == "placeholder" else op_label(node.target)
    return (
        f"graph {hit['record'].index}, node {node.name} ({what})"
        f"{f' in module `{path}`' if path else ''}: {hit['shown']}"
    )


_MAX_ROUNDS = 4
"""Policies tried before giving up: each round adds one module (or widens to the enclosing one)."""


def _module_of(hit: dict[str, Any], node: torch.fx.Node) -> str:
    """The path under the root module of ``node``, a node of the graph ``hit`` was found in."""
    return hit["run"].module_of(hit["record"], node)[0]


def _kept_in_fp32(hit: dict[str, Any], node: torch.fx.Node) -> tuple[list[str], list[torch._ops.OpOverload]]:
    """What keeps ``node`` in fp32: its innermost module, or for a top-level op the op itself."""
    path = _module_of(hit, node)
    return ([path], []) if path else ([], [node.target])  # type: ignore[list-item]  # an ATen graph's op


def _where(hit: dict[str, Any], phase: str) -> str:
    n = hit["node"]
    p = _module_of(hit, n)
    return f"{phase} at {n.name} ({op_label(n.target)}{', module `' + p + '`' if p else ''})"


def _why_not_fixable(hit: dict[str, Any], phase: str, policy: Policy) -> str | None:
    """Why keeping more in fp32 cannot remove this hit; None when it can."""
    node = hit["node"]
    if node.op == "placeholder":
        return "a graph input already holds inf/NaN"
    if phase == "forward" and is_cast(node) and not is_inserted_cast(node):
        return "a cast in your code overflows"
    if phase == "forward" and hit.get("fp32") is not None and not all_finite(hit["fp32"]):
        return "the op gives inf/NaN in fp32 too"
    if phase == "backward" and hit["grad"].dtype not in (torch.float16, torch.bfloat16):
        return "the gradient is not finite in fp32 either"
    decider = _deciding_node(node)
    path = _module_of(hit, decider)
    if path and any(isinstance(k, str) and _inside(path, k) for k in policy.keep_fp32):
        low = (
            hit["grad"].dtype
            if phase == "backward"
            else next((t.dtype for t in tensors_of(hit["out"]) if t.is_floating_point()), None)
        )
        if low in (torch.float16, torch.bfloat16):
            return (
                f"module `{path}` is kept in fp32 by the policy, yet this op ran in "
                f"{dtype_name(low)}: amp_fx did not apply the policy here (a bug: please "
                "report it with this model)"
            )
        return f"module `{path}` is already kept in fp32"
    if not path and not isinstance(decider.target, torch._ops.OpOverload):
        return "the op is not an ATen op a policy can name"
    return None


def _search_fix(
    policy: Policy, modules: list[str], ops: list[torch._ops.OpOverload], check: Callable[[Policy], _Probe]
) -> tuple[Policy, list[str], list[torch._ops.OpOverload], bool, list[str]]:
    """Add to ``modules``/``ops`` until the whole model runs finite, at most :data:`_MAX_ROUNDS`
    policies. When the next inf/NaN is in another module, the innermost module enclosing it and
    the last one kept is preferred (one fp32 region instead of several); at the root, the module
    is added. Returns the policy, what it adds, whether it is verified, and the steps, in words."""
    steps: list[str] = []
    for _ in range(_MAX_ROUNDS):
        candidate = _with_fp32(policy, modules, ops)
        again = check(candidate)
        hit = again.forward_hit or again.backward_hit
        if hit is None:
            return candidate, modules, ops, True, steps
        phase = "forward" if again.forward_hit is not None else "backward"
        kept = _kept_text(modules, ops)
        why = _why_not_fixable(hit, phase, candidate)
        if why is not None:
            steps.append(
                f"with {policy_code(candidate)} the next inf/NaN is in the "
                f"{_where(hit, phase)}: {why}, so keeping more in fp32 does not help; "
                "run find_nonfinite with that policy"
            )
            return candidate, modules, ops, False, steps
        steps.append(f"keeping {kept} alone is not enough (next inf/NaN in the {_where(hit, phase)})")
        new_modules, new_ops = _kept_in_fp32(hit, _deciding_node(hit["node"]))
        if new_modules and modules:
            enclosing = _common_module(modules[-1], new_modules[0])
            if enclosing:
                new_modules = [enclosing]
                modules = [m for m in modules if not _inside(m, enclosing)]
        modules, ops = modules + new_modules, ops + new_ops
    candidate = _with_fp32(policy, modules, ops)
    steps.append(f"gave up after {_MAX_ROUNDS} policies; run find_nonfinite with {policy_code(candidate)} to go on")
    return candidate, modules, ops, False, steps


def _describe_forward(
    report: NonfiniteReport, hit: dict[str, Any], labels: dict[str, str]
) -> tuple[torch.fx.Node, str] | None:
    """Fill in the forward hit; return the node to keep in fp32 and what was checked, or None
    when keeping something in fp32 is not the fix."""
    node: torch.fx.Node = hit["node"]
    out = hit["out"]
    report.phase = "forward"
    report.dtype_found = next((t.dtype for t in tensors_of(out) if t.is_floating_point()), None)
    report.value_range = _range_text(out)
    if node.op == "placeholder":
        name = labels.get(node.name, node.name)
        report.op = "input"
        report.reason = (
            f"the graph input `{name}` already holds inf/NaN before any op runs "
            "(a bad input batch, or parameters broken by an earlier step)"
        )
        return None
    report.op = op_label(node.target)
    report.inputs = [
        (_arg_label(a, labels), f"{dtype_name(next((t.dtype for t in tensors_of(v)), None))} {_range_text(v)}")
        for a, v in hit["inputs"]
    ]
    report.reason = _forward_reason(node, out, hit["inputs"], report.dtype_found)
    fp32 = hit.get("fp32")
    report.fp32_finite = None if fp32 is None else all_finite(fp32)
    if not is_inserted_cast(node) and is_cast(node):
        report.suggestion = (
            "this cast is in your code (e.g. `.half()` / `.to(torch.float16)`): "
            "its input does not fit the target dtype; drop it or clamp first"
        )
        return None
    decider = _deciding_node(node)
    if report.fp32_finite is False:
        report.suggestion = (
            "computing this op in fp32 gives inf/NaN too, so it is not a "
            "mixed-precision problem: the fp32 model fails here as well "
            "(check the inputs, the initialisation, the learning rate)"
        )
        return None
    checked = (
        "with its inputs in fp32 the op gives a finite output"
        if report.fp32_finite
        else "the op could not be re-run in fp32 to check"
    )
    return decider, checked


def _describe_backward(
    report: NonfiniteReport, hit: dict[str, Any], _labels: dict[str, str]
) -> tuple[torch.fx.Node, str] | None:
    """Fill in the backward hit; as :func:`_describe_forward`."""
    node: torch.fx.Node = hit["node"]
    grad: torch.Tensor = hit["grad"]
    report.phase = "backward"
    report.op = op_label(node.target)
    report.dtype_found = grad.dtype
    report.value_range = format_range(tensor_range(grad))
    users = [u.name + f" ({op_label(u.target)})" for u in node.users if u.op == "call_function"]
    fmax = torch.finfo(grad.dtype).max if grad.is_floating_point() else None
    low = grad.dtype in (torch.float16, torch.bfloat16)
    report.reason = (
        f"the gradient flowing into this op's output holds inf/NaN; it was computed "
        f"by the backward of {', '.join(users) or 'the loss'}"
        + (f"; in {dtype_name(grad.dtype)} it overflows the max {fmax:.6g}" if low else "")
    )
    decider = _deciding_node(node)
    if not low:
        report.suggestion = (
            "the gradient is non-finite in fp32 too: not a precision problem of "
            "this op (check the loss and the loss scale)"
        )
        return None
    return decider, (
        "then this gradient is computed in fp32; or lower the loss scale (with a "
        "GradScaler an occasional inf gradient is expected: the step is skipped and "
        "the scale backs off; worry only when it recurs)"
    )
