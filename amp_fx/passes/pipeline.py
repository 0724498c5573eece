"""The pipeline: every stage amp_fx runs on a graph Dynamo captured, declared and run in one place.

    Dynamo graph --capture--> pre-dispatch ATen graph --insert_casts--> [--fp8_matmuls-->]
        --fold_casts--> [--watch_nonfinite-->] [--monitor_fp8-->] [--lift_weight_casts-->] downstream backend

:data:`PIPELINE` lists the stages in order; :func:`run_pipeline` runs them on one graph through
one wrapper that times each stage (``GraphRecord.pass_seconds``), logs it on this module's logger
at DEBUG, checks its preconditions in strict mode or when that logger is at DEBUG, and turns an
unexpected exception into a :class:`StageFailure` naming the stage, the graph, the op being worked
on and the stages before it (the backend then compiles that graph as torch.compile would, see
``amp_fx/backend/compiler.py``). An ``AmpFxError`` a stage raises on purpose (an op eager autocast
refuses too, an option the device cannot honour) is not a failure: it propagates as it is.
A stage takes the compile's :class:`~amp_fx.options.Options` and the :class:`GraphWork` of one
graph; it never sees the backend object. ``amp_fx/passes/README.md`` is the table of stages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from tabulate import tabulate
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from amp_fx._common.dtype_names import dtype_name
from amp_fx.errors import AmpFxError
from amp_fx.options import Options
from amp_fx.passes import meta
from amp_fx.passes.capture import capture, data_inputs, is_cacheable_leaf, source_name, source_text
from amp_fx.passes.fold_casts import FoldRecord, fold_casts
from amp_fx.passes.fp8_matmuls import Fp8Record, fp8_matmuls
from amp_fx.passes.fx_edit import CAST_OP, copy_graph_module, counted_ops, is_cast, placeholders
from amp_fx.passes.insert_casts import InsertRecord, graph_device_type, insert_casts
from amp_fx.passes.lift_weight_casts import Lifted, lift_weight_casts
from amp_fx.passes.monitor_fp8 import MonitoredGraph, monitor_fp8
from amp_fx.passes.watch_nonfinite import WatchRecord, watch_nonfinite
from amp_fx.policy import Policy

__all__ = [
    "Fallback",
    "GraphRecord",
    "GraphWork",
    "PIPELINE",
    "Stage",
    "StageFailure",
    "run_pipeline",
    "stage",
    "summarize",
]

log = logging.getLogger(__name__)


class StageFailure(AmpFxError):
    """An unexpected exception in one stage of amp_fx's work on one graph (a bug of amp_fx's, not a
    refusal): the stage, the graph's index, the op being worked on where known, and the cause
    (chained as ``__cause__``)."""

    def __init__(self, stage: str, index: int, before: Sequence[str], cause: Exception) -> None:
        self.stage = stage
        self.index = index
        self.op = _failing_op(cause)
        self.cause = f"{type(cause).__name__}: {cause}"
        at = f" (op: {self.op})" if self.op is not None else ""
        super().__init__(
            f"amp_fx: {stage} failed on graph {index} (passes run before it: "
            f"{', '.join(before) or 'none'}): {self.cause}{at}"
        )


def _failing_op(error: BaseException) -> str | None:
    """The fx node being worked on where ``error`` was raised: the innermost frame of its
    traceback with a ``node`` local holding one (the passes and fx's interpreter, which runs
    Dynamo's graph during capture and the downstream trace, all call it so). None if no frame has one."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("node")
        if isinstance(node, torch.fx.Node):
            found = node
        tb = tb.tb_next
    return found.format_node() if found is not None else None


@dataclass(frozen=True)
class Fallback:
    """Why a graph was compiled as ``torch.compile`` under ``torch.autocast`` compiles it."""

    stage: str
    op: str | None
    """The node being worked on when it failed (``format_node()``), where known."""
    cause: str
    """The exception's type and message."""


@dataclass
class GraphRecord:
    """What the passes did to one captured graph.

    A graph amp_fx's own work failed on (``fallback`` is set) was handed to the downstream backend
    as Dynamo captured it, with autocast on: its ``captured`` and ``rewritten`` are Dynamo's graph,
    and nothing was inserted or folded."""

    index: int
    device_type: str
    dtype: torch.dtype
    dynamo_graph: torch.fx.GraphModule
    captured: torch.fx.GraphModule
    """The pre-dispatch ATen graph before the passes (a copy)."""
    rewritten: torch.fx.GraphModule
    """The graph handed to the downstream backend (before the weight cache lifts its weight casts)."""
    inserted: InsertRecord
    folded: FoldRecord
    pass_seconds: dict[str, float] = field(default_factory=dict)
    watched: WatchRecord | None = None
    """The ops ``watch_nonfinite`` watches (None when the watch is off)."""
    watched_backward: WatchRecord | None = None
    """The ops of this graph's backward that ``watch_backward`` watches (None until AOTAutograd
    compiled the backward with the watch on)."""
    fp8: Fp8Record | None = None
    """The matmuls ``fp8_matmuls`` considered (None when fp8 is off)."""
    monitored: MonitoredGraph | None = None
    """``monitor=``: the copy of ``rewritten`` that also computes the GEMMs' statistics (None when off)."""
    fallback: Fallback | None = None
    """Set when this graph fell back to what ``torch.compile`` under ``torch.autocast`` does."""

    @classmethod
    def fell_back(
        cls, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], dtype: torch.dtype, failure: StageFailure
    ) -> GraphRecord:
        """The record of Dynamo's graph ``gm``, compiled as torch.compile would after ``failure``."""
        return cls(
            index=failure.index,
            device_type=graph_device_type(example_inputs),
            dtype=dtype,
            dynamo_graph=gm,
            captured=gm,
            rewritten=gm,
            inserted=InsertRecord(),
            folded=FoldRecord(),
            fallback=Fallback(failure.stage, failure.op, failure.cause),
        )

    @property
    def fallback_text(self) -> str:
        """What the inspection tools say about a graph that fell back (empty when it did not)."""
        f = self.fallback
        if f is None:
            return ""
        at = f" at {f.op}" if f.op is not None else ""
        return (
            f"amp_fx's {f.stage} failed on it{at} ({f.cause}), so it was compiled as torch.compile "
            f"under torch.autocast compiles it (eager autocast's casts, not amp_fx's)"
        )

    @property
    def casts(self) -> int:
        """Casts in the rewritten graph (inserted ones that survived folding, and the user's)."""
        return sum(1 for n in self.rewritten.graph.nodes if is_cast(n))

    def summary_rows(self) -> list[list[object]]:
        ops = counted_ops(self.rewritten)
        return [
            [
                self.index,
                self.device_type,
                dtype_name(self.dtype),
                ops,
                self.inserted.casts_inserted,
                self.inserted.casts_shared,
                self.folded.total,
                ", ".join(f"{k}={v}" for k, v in sorted(self.folded.by_rule.items())) or "-",
                self.casts,
            ]
        ]

    def __str__(self) -> str:
        return summarize([self])


_HEADERS = [
    "graph",
    "device",
    "dtype",
    "ops",
    "casts inserted",
    "leaf casts shared",
    "casts folded",
    "folded by rule",
    "casts left",
]


def summarize(records: Sequence[GraphRecord]) -> str:
    """A table of what the passes did, one row per captured graph (and, where a graph fell back
    to torch.compile under torch.autocast, a column saying at which stage)."""
    rows = [row for r in records for row in r.summary_rows()]
    if not any(r.fallback is not None for r in records):
        return tabulate(rows, headers=_HEADERS)
    fell = [r.fallback.stage if r.fallback is not None else "-" for r in records]
    return tabulate([[*row, f] for row, f in zip(rows, fell, strict=True)], headers=[*_HEADERS, "fell back at"])


@dataclass
class LiftedGraph:
    """``lift_weight_casts``' result: the graph the weight cache's inputs feed, and those inputs."""

    gm: torch.fx.GraphModule
    example_inputs: list[Any]
    lifted: list[Lifted]


@dataclass
class GraphWork:
    """What flows through the pipeline for one Dynamo graph; each stage fills in its part."""

    gm: torch.fx.GraphModule
    """Dynamo's graph; after capture the ATen graph, which the passes rewrite in place."""
    dynamo_graph: torch.fx.GraphModule
    example_inputs: list[Any]
    """What Dynamo handed the backend (real parameters, fake or real activations)."""
    fake_args: list[Any]
    fake_mode: FakeTensorMode
    device_type: str
    leaf_flags: list[bool]
    index: int = 0
    """The graph's index in the compiled model's records."""
    data_inputs: list[bool] = field(default_factory=list)
    """Per placeholder: data the caller handed in (see :func:`amp_fx.passes.capture.data_inputs`)."""
    parameter_names: list[str | None] = field(default_factory=list)
    """Per placeholder: the name of the ``nn.Parameter`` it is, None for other inputs
    (``meta.PARAMETER``, read by fp8_matmuls)."""
    captured: torch.fx.GraphModule | None = None
    """A copy of the ATen graph before the passes (for inspection)."""
    inserted: InsertRecord = field(default_factory=InsertRecord)
    folded: FoldRecord = field(default_factory=FoldRecord)
    watched: WatchRecord | None = None
    fp8: Fp8Record | None = None
    monitored: MonitoredGraph | None = None
    """With ``monitor=``: the copy of ``gm`` that computes the fp8 GEMMs' statistics."""
    lifted: LiftedGraph | None = None
    """With ``weight_cache=True``: the graph with its weight casts lifted into inputs."""
    lift_error: Exception | None = None
    """Why lifting failed (the backend then compiles ``gm``, casting its weights itself, and says so)."""
    seconds: dict[str, float] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    """The stages that ran on this graph, in order (named when a later one fails)."""

    def record(self, dtype: torch.dtype) -> GraphRecord:
        assert self.captured is not None, "the capture stage always runs"
        return GraphRecord(
            index=self.index,
            device_type=self.device_type,
            dtype=dtype,
            dynamo_graph=self.dynamo_graph,
            captured=self.captured,
            rewritten=self.gm,
            inserted=self.inserted,
            folded=self.folded,
            pass_seconds=self.seconds,
            watched=self.watched,
            fp8=self.fp8,
            monitored=self.monitored,
        )


# --- the stages ---------------------------------------------------------------------------------


def _capture(options: Options, work: GraphWork) -> None:
    with work.fake_mode:
        work.gm = capture(
            work.gm,
            work.fake_args,
            policy=options.policy,
            device_type=work.device_type,
            dtype=options.dtype,
            leaf_flags=work.leaf_flags,
        )
    work.captured = copy_graph_module(work.gm)


def _insert_casts(options: Options, work: GraphWork) -> None:
    work.gm, work.inserted = insert_casts(
        work.gm,
        policy=_cast_policy(options),
        device_type=work.device_type,
        dtype=options.dtype,
        fake_mode=work.fake_mode,
    )


def _cast_policy(options: Options) -> Policy:
    """The policy insert_casts applies: with ``fp8=`` on and ``Policy(autocast_experts=...)`` unset,
    the grouped expert GEMMs are moved to the autocast dtype, where the fp8 pass takes them (fp8
    covers every matmul with a parameter operand; ``autocast_experts=False`` keeps them out)."""
    policy = options.policy
    if options.fp8 is not None and policy.autocast_experts is None:
        return dataclasses.replace(policy, autocast_experts=True)
    return policy


def _fp8_matmuls(options: Options, work: GraphWork) -> None:
    assert options.fp8 is not None
    for node, name in zip(placeholders(work.gm.graph), work.parameter_names, strict=True):
        node.meta[meta.PARAMETER] = name
    work.gm, work.fp8 = fp8_matmuls(
        work.gm, config=options.fp8, policy=options.policy, fake_mode=work.fake_mode, device_type=work.device_type
    )


def _fold_casts(options: Options, work: GraphWork) -> None:
    work.gm, work.folded = fold_casts(work.gm)


def _watch_nonfinite(options: Options, work: GraphWork) -> None:
    with work.fake_mode:
        work.gm, work.watched = watch_nonfinite(work.gm, dtype=options.dtype, data_inputs=work.data_inputs)


def _monitor_fp8(options: Options, work: GraphWork) -> None:
    assert options.fp8 is not None
    work.monitored = monitor_fp8(work.gm, config=options.fp8, fake_mode=work.fake_mode)


def _lift_weight_casts(options: Options, work: GraphWork) -> None:
    # On a copy: work.gm stays the graph the inspection tools see and the fallback compiles. A
    # failure is the weight cache's shortfall, not the compile's: the backend falls back and reports.
    try:
        work.lifted = LiftedGraph(*lift_weight_casts(work.gm, work.example_inputs))
    except AmpFxError:
        raise
    except Exception as e:
        work.lift_error = e


# --- preconditions (checked in strict mode, or with this module's logger at DEBUG) ---------------


def _aten_graph(work: GraphWork) -> str | None:
    """Every op is an ATen op or a Python callable (``operator.getitem``, the autocast region
    markers insert_casts puts around an op with its own autocast kernel), and every placeholder and
    every ATen op whose value is used has ``val``."""
    for node in work.gm.graph.nodes:
        if node.op in ("call_module", "call_method"):
            return f"{node.format_node()} is not an ATen op (capture has not run?)"
        # an op whose value is used (not a runtime assertion such as aten._assert_scalar)
        aten = node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.users
        if (aten or node.op == "placeholder") and "val" not in node.meta:
            return f"{node.format_node()} has no meta['val']"
    return None


def _leaves_marked(work: GraphWork) -> str | None:
    """Placeholders carry ``meta[LEAF]`` (capture writes it; insert_casts reads it)."""
    missing = [n.name for n in placeholders(work.gm.graph) if meta.LEAF not in n.meta]
    return f"placeholders {missing} have no meta[{meta.LEAF!r}]" if missing else None


def _decided(work: GraphWork) -> str | None:
    """Every ATen op carries insert_casts' decision (what fold_casts, the watch and lifting read)."""
    for node in work.gm.graph.nodes:
        if (
            node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)
            and meta.DECISION not in node.meta
            and meta.CAST not in node.meta
            and node.target is not CAST_OP
        ):
            return f"{node.format_node()} has no meta[{meta.DECISION!r}] (insert_casts has not run?)"
    return None


def _cast_decisions_recorded(work: GraphWork) -> str | None:
    """insert_casts ran: its decisions are on the graph's ops (later passes add ops of their own,
    such as the watch's checks, which carry none)."""
    ops = [n for n in work.gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    if ops and not any(meta.DECISION in n.meta for n in ops):
        return f"no op carries meta[{meta.DECISION!r}] (insert_casts has not run?)"
    return None


def _example_per_placeholder(work: GraphWork) -> str | None:
    """One example input per placeholder, in order (lifting appends to both)."""
    n = len(placeholders(work.gm.graph))
    return None if n == len(work.example_inputs) else f"{n} placeholders but {len(work.example_inputs)} inputs"


Precondition = Callable[[GraphWork], "str | None"]


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline: its name (in timings, logs and errors), what it runs, when it is
    on, and what it assumes of the graph (predicates returning ``None`` or what is wrong)."""

    name: str
    run: Callable[[Options, GraphWork], None]
    enabled: Callable[[Options], bool] = lambda options: True
    requires: tuple[Precondition, ...] = ()


PIPELINE: tuple[Stage, ...] = (
    Stage("capture", _capture),
    Stage("insert_casts", _insert_casts, requires=(_aten_graph, _leaves_marked)),
    Stage(
        "fp8_matmuls",
        _fp8_matmuls,
        enabled=lambda o: o.fp8 is not None,
        requires=(_aten_graph, _decided, _example_per_placeholder),
    ),
    Stage("fold_casts", _fold_casts, enabled=lambda o: o.fold, requires=(_aten_graph, _decided)),
    Stage("watch_nonfinite", _watch_nonfinite, enabled=lambda o: o.watch_nonfinite, requires=(_aten_graph, _decided)),
    Stage("monitor_fp8", _monitor_fp8, enabled=lambda o: o.monitor is not None and o.fp8 is not None),
    Stage(
        "lift_weight_casts",
        _lift_weight_casts,
        enabled=lambda o: o.weight_cache,
        requires=(_cast_decisions_recorded, _example_per_placeholder),
    ),
)
"""What runs on every Dynamo graph, in order (see amp_fx/passes/README.md)."""


def prepare(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    index: int,
    is_state: Callable[[torch.fx.Node, Any], bool] | None = None,
    state_name: Callable[[torch.fx.Node, Any], str | None] | None = None,
) -> GraphWork:
    """The work for one Dynamo graph: its inputs fakified through the backend's fake mode (the one
    AOTAutograd will use, not Dynamo's tracing one), so that the passes' fake values and the
    downstream trace agree (``from_tensor`` memoizes). ``is_state``: tells the root's parameters and
    buffers from the caller's data, by identity (:func:`amp_fx.passes.capture.data_inputs`);
    ``state_name``: a parameter's name under the root, by identity (else its Dynamo source's)."""
    inputs = placeholders(gm.graph)
    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    fake_args = []
    for node, real in zip(inputs, example_inputs, strict=True):
        if isinstance(real, torch.Tensor):
            fake_args.append(real if isinstance(real, FakeTensor) else fake_mode.from_tensor(real))
        else:
            fake_args.append(node.meta.get("example_value", real))
    return GraphWork(
        gm=gm,
        dynamo_graph=gm,
        example_inputs=list(example_inputs),
        fake_args=fake_args,
        fake_mode=fake_mode,
        device_type=graph_device_type(fake_args),
        leaf_flags=[is_cacheable_leaf(r) for r in example_inputs],
        index=index,
        data_inputs=data_inputs(gm, example_inputs, is_state),
        parameter_names=[
            ((state_name(n, r) if state_name is not None else None) or source_name(n)) if _is_parameter(n, r) else None
            for n, r in zip(inputs, example_inputs, strict=True)
        ],
    )


def _is_parameter(node: torch.fx.Node, value: Any) -> bool:
    """An ``nn.Parameter``, or a fake stand-in for one (Dynamo's DDPOptimizer compiles its pieces on
    fake tensors): its Dynamo source names a module's ``_parameters``."""
    return isinstance(value, torch.nn.Parameter) or "_parameters" in source_text(node)


def run_pipeline(
    options: Options,
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    index: int = 0,
    stages: Sequence[Stage] = PIPELINE,
    is_state: Callable[[torch.fx.Node, Any], bool] | None = None,
    state_name: Callable[[torch.fx.Node, Any], str | None] | None = None,
) -> GraphWork:
    """Run ``stages`` on one Dynamo graph; returns the work (``work.record(dtype)`` is its record).

    Raises :class:`StageFailure` where a stage (``prepare`` included) fails unexpectedly; an
    ``AmpFxError`` a stage raises on purpose propagates as it is."""
    with stage("prepare", index, ()):
        work = prepare(gm, example_inputs, index, is_state, state_name)
    check = options.strict or log.isEnabledFor(logging.DEBUG)
    for step in stages:
        if not step.enabled(options):
            work.seconds[step.name] = 0.0
            continue
        t0 = time.perf_counter()
        with stage(step.name, index, work.done):
            if check:
                _check_preconditions(step, work)
            step.run(options, work)
        work.seconds[step.name] = time.perf_counter() - t0
        work.done.append(step.name)
        log.debug("amp_fx graph %d: %s took %.1f ms", index, step.name, 1e3 * work.seconds[step.name])
    if log.isEnabledFor(logging.DEBUG) and work.captured is not None:
        log.debug("amp_fx graph %d:\n%s", index, work.record(options.dtype))
    return work


def _check_preconditions(step: Stage, work: GraphWork) -> None:
    for precondition in step.requires:
        problem = precondition(work)
        if problem is not None:  # a bug of the stages before: a StageFailure, as any other
            raise AssertionError(f"precondition {precondition.__name__.lstrip('_')} does not hold ({problem})")


@contextlib.contextmanager
def stage(name: str, index: int, before: Sequence[str]) -> Iterator[None]:
    """Run one stage of amp_fx's work on graph ``index``: an unexpected exception becomes a
    :class:`StageFailure` naming it, the graph and the stages ``before`` it (read when it fails);
    an ``AmpFxError`` (a refusal by design, or a failure already named) propagates as it is, and
    so does Dynamo's ``RestartAnalysis``: no failure, but Dynamo's signal to trace the frame again
    (AOTAutograd's ``tensorify_python_scalars`` raises it to specialize a float it cannot keep
    symbolic, e.g. GPT-2's attention scale under ``dynamic=True``), which Dynamo catches and
    handles by calling the backend again on the new graph."""
    try:
        yield
    except (AmpFxError, torch._dynamo.exc.RestartAnalysis):
        raise
    except Exception as e:
        raise StageFailure(name, index, list(before), e) from e
