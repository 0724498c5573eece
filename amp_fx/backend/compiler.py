"""The torch.compile backend: run the pipeline on each graph, hand it to the downstream backend.

Every graph Dynamo captures (one per graph break) goes through :func:`amp_fx.passes.pipeline.run_pipeline`
and leaves a :class:`~amp_fx.passes.pipeline.GraphRecord` on the backend, in capture order, for the
inspection tools. What the backend keeps around the graphs lives beside it: names under the root
module (``names.py``), weights split by graph breaks (``splits.py``), guards (``guards.py``), the
audits of what was asked against what was done (``audit.py``), the weight cache (``weight_cache.py``).

Never worse than torch.compile: where amp_fx's own work on a graph fails unexpectedly (a
:class:`~amp_fx.passes.pipeline.StageFailure`: a pipeline stage, the module names, the traced-path
check, the split report, the downstream compile of the rewritten graph, the run wrapper), that
graph is compiled as ``torch.compile`` under ``torch.autocast`` compiles it: Dynamo's graph, as
captured, handed to the downstream backend with the caller's autocast on while it traces and
runs. The reporter says so once (an error in strict mode). An ``AmpFxError`` raised on purpose
(an op eager autocast refuses too, a strict-mode report, a double backward) is not a failure.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from amp_fx._common.downstream import (
    BACKWARD_BACKENDS,
    Backend,
    InductorCompile,
    resolve_backend,
    with_backward_compile,
)
from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.progress import CompileClock, timed
from amp_fx._common.report import Reporter
from amp_fx._common.running_unit import running_unit
from amp_fx.backend.dynamo_inputs import carry_dynamo_inputs
from amp_fx.backend.eager_numerics import eager_numerics_compile
from amp_fx.backend.guards import RunCount, guard_module_hooks, refuse_double_backward
from amp_fx.backend.names import RootNames
from amp_fx.backend.splits import SplitTracker
from amp_fx.backend.traced_paths import report_traced_paths
from amp_fx.backend.weight_cache import WeightCache, report_uncached_experts
from amp_fx.errors import AmpFxError
from amp_fx.monitor.state import GraphStats, MonitorState
from amp_fx.options import Numerics, Options
from amp_fx.overflow import ForwardWatch
from amp_fx.overflow.watch import register_compiled
from amp_fx.passes.fx_edit import counted_ops
from amp_fx.passes.pipeline import GraphRecord, GraphWork, StageFailure, run_pipeline, stage
from amp_fx.passes.watch_backward import WATCHABLE, stamp_forward_nodes, watching_downstream
from amp_fx.passes.watch_nonfinite import WatchRecord

__all__ = ["AmpBackend"]


class AmpBackend:
    """A torch.compile backend that rewrites each graph for mixed precision, then delegates.

    ``options`` says what to do; the rest is the compiled model's state: ``root`` (the module the
    user compiled: every module path in the graphs is a name under it), ``reporter`` (where its
    shortfalls go, shared by its siblings), the weight cache and the forward watch that its graphs
    feed (``weight_cache=True``, ``watch_nonfinite=True``), and the records of its graphs.
    """

    def __init__(
        self,
        options: Options,
        *,
        root: torch.nn.Module | None = None,
        reporter: Reporter | None = None,
        label: str | None = None,
    ) -> None:
        self.options = options
        self.label = label if label is not None else (type(root).__name__ if root is not None else "a function")
        """Names the model in the progress lines (amp_fx/_common/progress.py)."""
        self._root = None if root is None else weakref.ref(root)
        self.reporter = reporter if reporter is not None else Reporter(options.strict)
        self.weight_cache: WeightCache | None = WeightCache() if options.weight_cache else None
        """amp_fx/backend/weight_cache.py: fills the graphs' lifted weight casts."""
        if root is not None:
            register_compiled(root)  # amp_fx/overflow/record.py names gradients after it
        self.watch: ForwardWatch | None = ForwardWatch(root) if options.watch_nonfinite else None
        """amp_fx/overflow/watch.py: the first non-finite forward op, on the device (registered with
        the root, so that a GradScaler told nothing finds it by the optimizer's parameters)."""
        self.monitor: MonitorState | None = (
            MonitorState(options.monitor, options.fp8) if options.monitor is not None else None
        )
        """amp_fx/monitor/state.py: the fp8 monitor's step counter and buffers (``monitor=``)."""
        self._inductor: InductorCompile | None = None
        """numerics="eager": its inductor compile (amp_fx/backend/eager_numerics.py), which the
        backward-announcing downstream wraps; None: ``compile_fx`` with ``options.inductor``."""
        self._backend: str | Backend = options.backend
        """The backend the graphs go to: ``options.backend``, or ``"aot_eager"`` where numerics="eager"
        cannot run on this torch's inductor (said once)."""
        if options.numerics is Numerics.EAGER:
            self._inductor = eager_numerics_compile(options.inductor, self.reporter)
            self._backend = "inductor" if self._inductor is not None else "aot_eager"
        self._downstream = self._inductor or resolve_backend(self._backend, inductor_config=options.inductor)
        if self.watch is not None:
            self._report_unwatched_backward(self.watch)
        self.records: list[GraphRecord] = []
        self.runs = RunCount()
        """How many times a graph of this backend (or a sibling) has run."""
        self.clock = CompileClock()
        """The user's call that compiles (shared with siblings): progress lines time from it."""
        self._splits = SplitTracker(options.dtype, self.reporter)

    @property
    def root(self) -> torch.nn.Module | None:
        """The module that was compiled (held weakly: see :meth:`for_dynamo`)."""
        return None if self._root is None else self._root()

    @property
    def dtype(self) -> torch.dtype:
        return self.options.dtype

    def for_dynamo(self) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
        """What to hand ``torch.compile`` as the backend: this backend, held weakly.

        Dynamo keeps every backend object it is given for the rest of the process: in
        ``torch._dynamo.eval_frame.cached_backends`` until ``torch._dynamo.reset()``, and, when the
        backend raised (strict mode, an op eager autocast refuses), from C even after a reset
        (torch 2.11 to 2.13; ``CatchErrorsWrapper`` is the last referrer ``gc`` sees). A backend
        handed as it is would keep its records, its weight cache, its watch (which scalers then
        find) and, through ``root``, the model alive. The compiled callable's owner holds the
        backend instead (:func:`amp_fx.backend.call.amp_call`)."""
        return _HeldWeakly(self)

    def sibling(self) -> AmpBackend:
        """A backend with the same options, state and records, but its own identity (Dynamo keeps
        separate cache entries per backend object) and its own split tracking (a sibling compiles
        another entry point, whose graphs repeat the model's whole forward)."""
        other = copy.copy(self)
        other._splits = SplitTracker(self.options.dtype, self.reporter)
        return other

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        guard_module_hooks()
        index = len(self.records)
        with timed(
            lambda: (
                f"amp_fx: {self.label}: compiled graph {index} ({self._counted_ops(index, gm)} ops, "
                f"{dtype_name(self.dtype)}, backend {self.options.backend_name})"
            ),
            since=self.clock.compiling(index),
        ):
            try:
                return self._compile(gm, example_inputs, index)
            except StageFailure as failure:
                return self._fall_back(gm, example_inputs, failure)

    def _counted_ops(self, index: int, gm: torch.fx.GraphModule) -> int:
        """The ops of graph ``index`` as ``explain`` and ``amp_fx_summary()`` count them (its record's
        rewritten graph: ATen ops, casts not counted); Dynamo's graph's calls for a graph that fell back."""
        if index < len(self.records) and self.records[index].fallback is None:
            return counted_ops(self.records[index].rewritten)
        return _ops(gm)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any], index: int) -> Callable[..., Any]:
        # amp_fx calls compiled code inside torch.autocast (see amp_fx.compile), so that code
        # Dynamo leaves to eager runs under eager autocast. Inside a captured graph the casts
        # are explicit, so autocast is off while we capture, while the downstream backend traces,
        # and while the compiled graph runs: nothing is cast twice. Dynamo's graph itself is not
        # changed (capture traces it into a new graph; only node metadata is renamed), so a
        # failure at any stage leaves it as captured for the fallback.
        with stage("module_names", index, ()):
            names = RootNames(self.root)
            names.rename_module_stacks(gm)
        with stage("traced_paths", index, ()):
            report_traced_paths(gm, self.reporter)
        with torch._C._DisableAutocast():
            work = run_pipeline(
                self.options,
                gm,
                example_inputs,
                index=index,
                is_state=names.is_module_state,
                state_name=names.state_name,
            )
            record = work.record(self.options.dtype)
            carry_dynamo_inputs(gm, work.gm)  # record.rewritten: what the downstream backend gets
            if work.lifted is not None:  # or this, with the weight cache
                carry_dynamo_inputs(gm, work.lifted.gm)
            if self.weight_cache is not None:
                compiled = self._compile_with_weight_cache(work, record)
            else:
                with stage("splits", index, work.done):
                    self._splits.report(record, gm, example_inputs, names)
                with stage("downstream", index, work.done):
                    compiled = self._downstream_for(record)(record.rewritten, list(example_inputs))
                if self.monitor is not None:
                    with stage("monitor_downstream", index, work.done):
                        compiled = self._monitored(compiled, gm, record, example_inputs, self.monitor)
            with stage("run_wrapper", index, work.done):
                run = self._run_wrapper(compiled, record)
        self.records.append(record)
        return run

    def _monitored(
        self,
        plain: Callable[..., Any],
        dynamo_gm: torch.fx.GraphModule,
        record: GraphRecord,
        example_inputs: list[Any],
        monitor: MonitorState,
    ) -> Callable[..., Any]:
        """``monitor=``: graph ``record``'s monitored copy compiled too, and the callable that runs it
        on logging steps and ``plain`` on the others (amp_fx/monitor/state.py). A converted GEMM the
        copy computes no statistics for is reported once (strict mode: raised), naming it."""
        monitored = record.monitored
        if monitored is None:
            return plain
        for what in monitored.uncovered:
            if what not in monitor.uncovered:
                monitor.uncovered.append(what)
            self.reporter.did_less(
                ("monitor", what),
                f"amp_fx: monitor=: no statistics for the fp8 GEMM of {what}. Its figures are missing "
                f"from amp_fx.fp8_stats; keep that module out of low precision (LowPrecision(modules="
                f"{{...: None}})) or read it offline with amp_fx.compare(fp8=...).",
            )
        if not monitored.gemms:
            return plain
        assert monitored.device is not None
        graph = GraphStats.allocate(record.index, monitored.gemms, monitored.device)
        monitor.graphs[record.index] = graph
        carry_dynamo_inputs(dynamo_gm, monitored.gm)
        compiled = self._downstream_for(record)(monitored.gm, [*example_inputs, graph.fwd, graph.sink])
        return monitor.choose(plain, compiled, graph)

    def _fall_back(
        self, gm: torch.fx.GraphModule, example_inputs: list[Any], failure: StageFailure
    ) -> Callable[..., Any]:
        """Dynamo's graph ``gm`` compiled as torch.compile under torch.autocast compiles it: the
        downstream backend traces and runs it with the caller's autocast (amp_fx.compile's) on, so
        AOTAutograd records autocast's casts. Said once (raised in strict mode) naming the graph,
        the stage, the op and the cause."""
        message = (
            f"{failure}. Graph {failure.index} ({_origin(gm)}) is compiled as torch.compile under "
            f"torch.autocast compiles it instead: eager autocast's casts, without amp_fx's policy, "
            f"fp8, weight cache or non-finite watch (amp_fx_records[{failure.index}].fallback says "
            f"so). This is a bug of amp_fx's: please report it with this message and the graph "
            f"(TORCH_LOGS=graph_code prints it)."
        )
        self.reporter.did_less(("fallback", failure.stage, failure.cause), message, cause=failure.__cause__)
        compiled = self._downstream(gm, list(example_inputs))
        self.records.append(GraphRecord.fell_back(gm, example_inputs, self.options.dtype, failure))
        runs = self.runs

        def run(*args: Any) -> Any:
            runs.count += 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]  # AOT's boxed-calling flag, set on the function
        return run

    def _run_wrapper(self, compiled: Callable[..., Any], record: GraphRecord) -> Callable[..., Any]:
        """The compiled graph as Dynamo calls it: autocast off, the run counted, the watch's extra
        output taken off, a double backward refused with amp_fx's error.

        A graph compiled inside a unit (a repeated block's region, a DDP/FSDP2 unit) serves every
        unit of its group: the watch is told which unit runs it (its ops renamed for that unit's
        modules: ``amp_fx._common.running_unit``)."""
        runs = self.runs
        guarded: set[type] = set()
        watch, index = self.watch, record.index
        if watch is not None:
            assert record.watched is not None
            watch.add_graph(index, record.watched.ops, unit=running_unit())

        def run_without_autocast(*args: Any) -> Any:
            runs.count += 1
            with torch._C._DisableAutocast():
                out = compiled(*args)
            if watch is not None:  # the watch's output (amp_fx/passes/watch_nonfinite.py) is the last
                out = watch.ran_forward(index, out, running_unit())
            if not guarded and torch.is_grad_enabled():  # this graph's backward class, once guarded, stays guarded
                refuse_double_backward(out, guarded)
            return out

        run_without_autocast._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]  # AOT's boxed-calling flag, set on the function
        return run_without_autocast

    def _compile_with_weight_cache(self, work: GraphWork, record: GraphRecord) -> Callable[..., Any]:
        """The weight cache: the lifted graph, its parameter casts inputs the cache fills.

        Where lifting or the downstream backend fails on the lifted graph, this graph casts its
        weights itself, and the owner's reporter says so (an error in strict mode) instead of
        the failure surfacing from inside Dynamo; where the downstream backend fails on that
        graph too, the graph falls back (a StageFailure)."""
        assert self.weight_cache is not None
        error, lifted = work.lift_error, work.lifted
        with stage("downstream", work.index, work.done):
            downstream = self._downstream_for(record)
        if lifted is not None:
            if record.fp8 is not None:
                report_uncached_experts(record.fp8.decisions, self.reporter)
            stamp_forward_nodes(lifted.gm)  # the backward watch's names (a copy made before the stamp)
            try:
                return self.weight_cache.wrap(downstream(lifted.gm, lifted.example_inputs), lifted.lifted)
            except AmpFxError:
                raise
            except Exception as e:
                error = e
        assert error is not None
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        self.reporter.did_less(
            ("weight_cache", type(error).__name__),
            (
                f"amp_fx: weight_cache=True: the {self.options.backend_name} backend failed on graph "
                f"{work.index} with its weight casts lifted into inputs ({type(error).__name__}: "
                f"{first_line}); that graph casts its weights itself "
                f"in every forward instead (no saving, and a weight it shares with another graph of "
                f"the forward is not bitwise with eager autocast). Pass weight_cache=False to compile "
                f"without the cache, or report this graph (TORCH_LOGS=graph_code prints it)."
            ),
            cause=error,
        )
        with stage("downstream", work.index, work.done):
            return downstream(work.gm, list(work.example_inputs))

    # --- the backward watch (amp_fx/passes/watch_backward.py) ---------------------------------

    def _downstream_for(self, record: GraphRecord) -> Callable[..., Any]:
        """The downstream compile for ``record``'s graph: where the backend has a backward graph
        amp_fx can reach, one that announces its backward's compile (progress lines) and, with the
        watch, watches it."""
        watch, backend = self.watch, self._backend
        if not isinstance(backend, str) or backend not in BACKWARD_BACKENDS:
            return self._downstream
        around = self._announce_backward(record.index)
        if watch is None or watch.backward_unwatched:
            compile_backward = with_backward_compile(
                backend, inductor_config=self.options.inductor, around=around, inductor=self._inductor
            )
            return compile_backward if compile_backward is not None else self._downstream
        assert self._inductor is None  # the watch compiles its own backward: refused with numerics="eager" (Options)
        key = watch.backward_key(record.index)

        def on_backward(watched: WatchRecord) -> Callable[[torch.Tensor], None]:
            watch.add_graph(key, watched.ops)
            record.watched_backward = watched
            return functools.partial(watch.ran_backward, key)

        downstream = watching_downstream(
            backend,
            inductor_config=self.options.inductor,
            dtype=self.options.dtype,
            forward=record.rewritten,
            on_backward=on_backward,
            around=around,
        )
        return downstream if downstream is not None else self._downstream

    def _announce_backward(self, index: int) -> Callable[[torch.fx.GraphModule, Any, Backend], Callable[..., Any]]:
        """What compiles graph ``index``'s backward (at its first backward, seconds to a minute
        with inductor): announced as it starts, and timed, from the user's call too where that
        call compiled the forward graph (:class:`~amp_fx._common.progress.CompileClock`)."""
        label, clock, backend_label = self.label, self.clock, self.options.backend_name

        def around(gm: torch.fx.GraphModule, example_inputs: Any, compile_graph: Backend) -> Callable[..., Any]:
            with timed(
                f"amp_fx: {label}: compiled the backward of graph {index} ({counted_ops(gm)} ops, "
                f"backend {backend_label})",
                since=clock.since(index),
                starting=f"amp_fx: {label}: compiling the backward of graph {index} (its first backward) ...",
            ):
                return compile_graph(gm, example_inputs)

        return around

    def _report_unwatched_backward(self, watch: ForwardWatch) -> None:
        """``watch_nonfinite=True`` with a backend whose backward graph amp_fx cannot reach: the
        forward is watched, the backward is not; say so once (the report line says it too)."""
        backend = self.options.backend
        if isinstance(backend, str) and backend in WATCHABLE:
            return
        if backend == "eager":
            why = "backend 'eager' runs the graphs' ops through eager autograd: there is no backward graph"
        else:
            why = f"backend {self.options.backend_name!r} is not one whose backward graph amp_fx reaches"
        watch.backward_unwatched = why
        self.reporter.did_less(
            ("watch_nonfinite", "backward"),
            (
                f"amp_fx: watch_nonfinite=True watches the forward only: {why}. A step skipped because the "
                f"backward overflowed is reported without its op. Compile with backend='aot_eager' or "
                f"'inductor' to name the backward's first inf too."
            ),
        )


class _HeldWeakly:
    """:meth:`AmpBackend.for_dynamo`: calls the backend while it is alive."""

    def __init__(self, backend: AmpBackend) -> None:
        self._backend = weakref.ref(backend)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        backend = self._backend()
        if backend is None:  # its owner, which calls the compiled code, holds it while it runs
            raise AmpFxError("amp_fx: a graph was captured for a compiled model that no longer exists")
        return backend(gm, example_inputs)


def _ops(gm: torch.fx.GraphModule) -> int:
    return sum(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes)


def _origin(gm: torch.fx.GraphModule) -> str:
    """Where Dynamo's graph ``gm`` came from: its compile id (frame/attempt, as TORCH_LOGS names
    it) and the modules of its first and last ops, where the graph records them."""
    paths = [
        stack[-1][0]
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "call_module")
        and (stack := list((n.meta.get("nn_module_stack") or {}).values()))
    ]
    where = f"compile {gm.meta['dynamo_compile_id']}" if "dynamo_compile_id" in gm.meta else "Dynamo graph"
    if not paths:
        return where
    return f"{where}, ops of module {paths[0]!r}" + (f" to {paths[-1]!r}" if paths[-1] != paths[0] else "")
