"""The torch.compile backend: capture, run the passes, hand the graph to the downstream backend.

    Dynamo graph --capture--> pre-dispatch ATen graph --insert_casts--> --fold_casts-->
        [--watch_nonfinite-->] downstream

Every graph Dynamo captures (one per graph break) goes through the same pipeline, and each leaves
a :class:`GraphRecord` on the backend, in capture order, for inspection tools.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import logging
import re
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from tabulate import tabulate
from torch._guards import CompileContext, detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from amp_fx._backends import Backend, backend_name, resolve_backend
from amp_fx._dist.capture import FSDP1_ALTERNATIVE, is_fsdp1
from amp_fx._dtype_names import dtype_name
from amp_fx._report import Reporter
from amp_fx.capture import capture, data_inputs, is_cacheable_leaf, module_path, module_stack, source_text
from amp_fx.errors import AmpFxError
from amp_fx.fp8 import Fp8Config
from amp_fx.overflow import ForwardWatch
from amp_fx.passes import meta
from amp_fx.passes.fold_casts import FoldRecord, fold_casts
from amp_fx.passes.fp8_matmuls import Fp8Record, fp8_matmuls
from amp_fx.passes.insert_casts import InsertRecord, graph_device_type, insert_casts
from amp_fx.passes.lift_weight_casts import lift_weight_casts
from amp_fx.passes.watch_nonfinite import WatchRecord, watch_nonfinite
from amp_fx.policy import CastClass, Policy, _module_matches
from amp_fx.weight_cache import WeightCache

__all__ = ["AmpBackend", "GraphRecord", "PIPELINE", "Stage"]

log = logging.getLogger(__name__)

@dataclass
class GraphRecord:
    """What the passes did to one captured graph."""

    index: int
    device_type: str
    dtype: torch.dtype
    dynamo_graph: torch.fx.GraphModule
    captured: torch.fx.GraphModule
    """The pre-dispatch ATen graph before the passes (a copy)."""
    rewritten: torch.fx.GraphModule
    """The graph handed to the downstream backend."""
    inserted: InsertRecord
    folded: FoldRecord
    pass_seconds: dict[str, float] = field(default_factory=dict)
    watched: WatchRecord | None = None
    """The ops ``watch_nonfinite`` watches (None when the watch is off)."""
    fp8: Fp8Record | None = None
    """The matmuls ``fp8_matmuls`` considered (None when fp8 is off)."""

    @property
    def casts(self) -> int:
        """Casts in the rewritten graph (inserted ones that survived folding, and the user's)."""
        return sum(1 for n in self.rewritten.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default)

    def summary_rows(self) -> list[list[object]]:
        ops = sum(1 for n in self.rewritten.graph.nodes if n.op == "call_function")
        return [[self.index, self.device_type, dtype_name(self.dtype), ops,
                 self.inserted.casts_inserted, self.inserted.casts_shared, self.folded.total,
                 ", ".join(f"{k}={v}" for k, v in sorted(self.folded.by_rule.items())) or "-",
                 self.casts]]

    def __str__(self) -> str:
        return summarize([self])


_HEADERS = ["graph", "device", "dtype", "ops", "casts inserted", "leaf casts shared",
            "casts folded", "folded by rule", "casts left"]


def summarize(records: Sequence[GraphRecord]) -> str:
    """A table of what the passes did, one row per captured graph."""
    rows = [row for r in records for row in r.summary_rows()]
    return tabulate(rows, headers=_HEADERS)


def check_backend(backend: object) -> None:
    """Raise at ``compile()`` time for a backend torch.compile would only reject at the first call."""
    if callable(backend):
        return
    if not isinstance(backend, str):
        raise TypeError(f"amp_fx: backend must be a torch.compile backend name (a str such as "
                        f"'inductor', 'aot_eager', 'eager') or a callable, got {backend!r} "
                        f"({type(backend).__name__})")
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"amp_fx: unknown backend {backend!r}; torch.compile knows {sorted(known)}")


class AmpBackend:
    """A torch.compile backend that rewrites each graph for mixed precision, then delegates.

    Its identity (and so Dynamo's cache entries) is per (dtype, policy, downstream backend, fold).
    """

    def __init__(self, *, dtype: torch.dtype, policy: Policy, backend: str | Backend,
                 fold: bool = True, inductor_config: dict[str, Any] | None = None,
                 root: torch.nn.Module | None = None, reporter: Reporter | None = None,
                 weight_cache: WeightCache | None = None, watch_nonfinite: bool = False,
                 fp8: Fp8Config | None = None) -> None:
        self.dtype = dtype
        self.fp8 = fp8
        """fp8 training (amp_fx/passes/fp8_matmuls.py), None when off."""
        self.watch: ForwardWatch | None = ForwardWatch() if watch_nonfinite else None
        """amp_fx/overflow.py (``watch_nonfinite=True``): the first non-finite forward op, on the device."""
        self.weight_cache = weight_cache
        """amp_fx/weight_cache.py (``weight_cache=True``): fills the graphs' lifted weight casts."""
        self.policy = policy
        self.fold = fold
        self.backend = backend
        self.inductor_config = dict(inductor_config or {})
        self.backend_name = backend_name(backend)
        self._downstream = resolve_backend(backend, inductor_config=self.inductor_config)
        self.root = root
        """The module the user compiled: every module path in the graphs is a name under it."""
        self.reporter = reporter if reporter is not None else Reporter()
        """Where this backend's shortfalls go (one per compiled model, shared by its siblings)."""
        self.records: list[GraphRecord] = []
        self.runs = _RunCount()
        """How many times a graph of this backend (or a sibling) has run."""
        # id(leaf tensor) -> the graphs that cast it with the shared leaf cast
        self._cached_leaf_frames: dict[int, _LeafGraphs] = {}
        # (frame id, frame compile id) -> the CompileId of the compile that had them
        self._compiles: dict[tuple[int, int | None], object] = {}

    def sibling(self) -> AmpBackend:
        """A backend with the same configuration and the same records, but its own identity
        (Dynamo keeps separate cache entries per backend object).

        A sibling compiles another entry point (another leaf pattern, hooks or not), whose graphs
        repeat the model's whole forward: a weight in its graphs and in the first backend's is
        not split by a graph break, so it tracks the frames that cast each weight on its own."""
        other = copy.copy(self)
        other._cached_leaf_frames = {}
        other._compiles = {}
        return other

    def rewrite(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> GraphRecord:
        """Run capture and the passes on one Dynamo graph; returns the record (not yet compiled)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # Fakify through the backend's fake mode (the one AOTAutograd will use), not Dynamo's
        # tracing one, so our fake values and the downstream trace agree (from_tensor memoizes).
        fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
        fake_args = []
        for node, real in zip(placeholders, example_inputs, strict=True):
            if isinstance(real, torch.Tensor):
                fake_args.append(real if isinstance(real, FakeTensor) else fake_mode.from_tensor(real))
            else:
                fake_args.append(node.meta.get("example_value", real))
        index = len(self.records)
        work = _GraphWork(gm=gm, fake_args=fake_args, fake_mode=fake_mode,
                          device_type=graph_device_type(fake_args),
                          leaf_flags=[is_cacheable_leaf(r) for r in example_inputs], index=index,
                          parameter_names=[_source_name(n) if isinstance(r, torch.nn.Parameter) else None
                                           for n, r in zip(placeholders, example_inputs, strict=True)],
                          data_inputs=data_inputs(gm, example_inputs))
        timings: dict[str, float] = {}
        done: list[str] = []
        for stage in PIPELINE:
            if not stage.enabled(self):
                timings[stage.name] = 0.0
                continue
            with _running(stage.name, index, done, timings):
                stage.run(self, work)
        record = GraphRecord(index=index, device_type=work.device_type, dtype=self.dtype,
                             dynamo_graph=gm, captured=work.captured, rewritten=work.gm,
                             inserted=work.inserted, folded=work.folded, pass_seconds=timings,
                             watched=work.watched, fp8=work.fp8)
        log.debug("amp_fx graph %d:\n%s", record.index, record)
        return record

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        # amp_fx calls compiled code inside torch.autocast (see amp_fx.compile), so that code
        # Dynamo leaves to eager runs under eager autocast. Inside a captured graph the casts
        # are explicit, so autocast is off while we capture, while the downstream backend traces,
        # and while the compiled graph runs: nothing is cast twice.
        _guard_module_hooks()
        names = _RootNames(self.root)
        names.rename_module_stacks(gm)
        with torch._C._DisableAutocast():
            record = self.rewrite(gm, example_inputs)
            self.records.append(record)
            if self.weight_cache is not None:
                compiled = self._compile_with_weight_cache(record, list(example_inputs))
            else:
                self._report_leaf_casts_split_by_graph_breaks(record, gm, example_inputs, names)
                compiled = self._downstream(record.rewritten, list(example_inputs))
        runs = self.runs
        guarded: set[type] = set()
        watch, index = self.watch, record.index
        if watch is not None:
            assert record.watched is not None
            watch.add_graph(index, record.watched.ops)

        def run_without_autocast(*args: Any) -> Any:
            runs.count += 1
            with torch._C._DisableAutocast():
                out = compiled(*args)
            if watch is not None:  # the watch's output (amp_fx/passes/watch_nonfinite.py) is the last
                watch.ran(index, out[-1])
                out = type(out)(out[:-1])
            if not guarded and torch.is_grad_enabled():  # this graph's backward class, once guarded, stays guarded
                _refuse_double_backward(out, guarded)
            return out

        run_without_autocast._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run_without_autocast


    def _compile_with_weight_cache(self, record: GraphRecord, inputs: list[Any]) -> Callable[..., Any]:
        """The weight cache (amp_fx/weight_cache.py): parameter casts become inputs it fills.

        Where the downstream backend cannot compile the lifted graph, this graph casts its
        weights itself, and the owner's reporter says so (an error in strict mode) instead of
        the failure surfacing from inside Dynamo."""
        assert self.weight_cache is not None
        try:
            graph, lifted_inputs, lifted = lift_weight_casts(record.rewritten, inputs)
            compiled = self._downstream(graph, lifted_inputs)
        except AmpFxError:
            raise
        except Exception as e:
            self.reporter.did_less(("weight_cache", type(e).__name__), (
                f"amp_fx: weight_cache=True: the {self.backend_name} backend failed on graph "
                f"{record.index} with its weight casts lifted into inputs ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}); that graph casts its weights itself "
                f"in every forward instead (no saving, and a weight it shares with another graph of "
                f"the forward is not bitwise with eager autocast). Pass weight_cache=False to compile "
                f"without the cache, or report this graph (TORCH_LOGS=graph_code prints it)."))
            return self._downstream(record.rewritten, inputs)
        return self.weight_cache.wrap(compiled, lifted)

    def _report_leaf_casts_split_by_graph_breaks(
        self, record: GraphRecord, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
        names: _RootNames,
    ) -> None:
        """Report once per weight whose uses a graph break splits (see docs/parity.md, Known differences):
        an ``AmpFxWarning`` through the owner's reporter (an error in strict mode), unless the
        caller notes splits itself (:func:`splits_noted_by_caller`).

        Eager autocast casts such a weight once per forward and its uses' gradients add up in the
        low dtype; each graph here casts it itself, so they add up in fp32. Recompiles of one
        frame are not a split: graphs are told apart by Dynamo's frame id. Under DDP, Dynamo's
        DDPOptimizer splits one compile of a frame at DDP's bucket boundaries and calls the backend
        once per piece, all with the frame's compile id: two pieces of one compile that cast a
        weight are a split too. DDPOptimizer hands fake tensors for the parameters, so a weight is
        known by the real tensor its placeholder's Dynamo source reaches (:meth:`_RootNames.real_tensor`).
        """
        compile_id = CompileContext.current_compile_id()
        if compile_id is not None and compile_id.frame_id is not None:
            frame, attempt = compile_id.frame_id, compile_id.frame_compile_id
            self._start_afresh_after_reset(frame, attempt, compile_id)
        else:  # the backend called directly (tests): each graph is a frame of its own
            frame, attempt = record.index, 0
        ours = [n for n in record.rewritten.graph.nodes if n.op == "placeholder"]
        theirs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        position = {n: i for i, n in enumerate(ours)}
        for leaf in leaves_cast_with_shared_cast(record.rewritten):
            i = position[leaf]
            tensor = names.real_tensor(theirs[i], example_inputs[i])
            graphs = self._cached_leaf_frames.get(id(tensor))
            if graphs is None or graphs.ref() is not tensor:
                graphs = _LeafGraphs(weakref.ref(tensor))
                self._cached_leaf_frames[id(tensor)] = graphs
            was_split = graphs.split()
            graphs.add(frame, attempt)
            if was_split or not graphs.split():
                continue
            name = names.tensor_name(tensor) or _source_name(theirs[i])
            low = dtype_name(self.dtype)
            if len(graphs.frames) > 1:
                where = "is used on both sides of a graph break"
                fix = ("Remove the graph break (TORCH_LOGS=graph_breaks says where it is), or pass "
                       "weight_cache=True (one cast shared by every graph of the forward),")
            else:
                where = ("is used in two of the graphs Dynamo's DDPOptimizer splits one captured "
                         "graph into at DDP's bucket boundaries")
                fix = ("Pass weight_cache=True (one cast shared by every graph of the forward), or "
                       "set torch._dynamo.config.optimize_ddp = False (one graph, no overlap of the "
                       "all-reduce with the backward),")
            if _SPLITS_NOTED_BY_CALLER.get():
                log.debug("amp_fx: %s %s", name, where)
                continue
            self.reporter.did_less(("used across a graph break", name), (
                f"amp_fx: {name} {where}; each graph casts it to {low} itself, so its gradient "
                f"contributions add up in fp32 where eager autocast adds them in {low} (more "
                f"accurate, not bitwise). {fix} to match eager autocast bit for bit."))

    def _start_afresh_after_reset(self, frame: int, attempt: int | None, compile_id: object) -> None:
        """Forget the graphs seen before a ``torch._dynamo.reset()``.

        Dynamo numbers frames and their compiles anew after a reset, so a new compile can carry
        the ids of one seen before it; its graphs would then look like pieces of that old
        compile (DDPOptimizer's split) or of another frame of the same forward. Pieces of one
        compile share one CompileId object; the same ids on another object mean the numbering
        restarted, and every graph compiled before is gone from Dynamo's caches.
        """
        seen = self._compiles.setdefault((frame, attempt), compile_id)
        if seen is not compile_id:
            self._cached_leaf_frames.clear()
            self._compiles = {(frame, attempt): compile_id}

    # --- what was asked against what was done ------------------------------------------------

    def report_unused_policy(self) -> None:
        """Report each policy entry that decided no op of the graphs captured so far.

        A ``keep_fp32`` entry matches an op inside a module it selects; an ``op_classes`` entry
        matches an op it names. Called after a compiled model's first call.
        """
        nodes = [n for r in self.records for n in r.captured.graph.nodes if n.op == "call_function"]
        stacks = {module_stack(n) for n in nodes}
        ops = {n.target.name() for n in nodes if isinstance(n.target, torch._ops.OpOverload)}
        for sel in self.policy.keep_fp32:
            if any(_module_matches(sel, path, mtype) for stack in stacks for path, mtype in stack):
                continue
            label = repr(sel) if isinstance(sel, str) else sel.__name__
            self.reporter.did_less(("keep_fp32", label), (
                f"amp_fx: Policy(keep_fp32=...) entry {label} matched no op in the graphs captured "
                f"on the first call: no op ran inside such a module, so nothing was kept in fp32 "
                f"for it. Name a module that runs ops (names are under the module passed to "
                f"amp_fx.compile, as in its named_modules()), or drop the entry."), stacklevel=5)
        self._report_fp8(stacks)
        for label, op_names, cls in self.policy.op_entries:
            if ops.intersection(op_names) or _unobservable(op_names, cls):
                continue
            self.reporter.did_less(("op_classes", label), (
                f"amp_fx: Policy(op_classes=...) entry {label!r} -> CastClass.{cls.name} matched no "
                f"op in the graphs captured on the first call (the model does not call "
                f"{', '.join(op_names)}), so it changed nothing. Check the op name and overload "
                f"(amp_fx.explain lists the ops of each graph), or drop the entry."), stacklevel=5)

    def _report_fp8(self, stacks: set[tuple[tuple[str, type], ...]]) -> None:
        """fp8 asked for and honoured nowhere in the graphs of the first call (each matmul's
        reason is in ``amp_fx.explain``); ``keep_out_of_fp8`` entries that matched no module, or
        that cannot matter because fp8 is off."""
        for sel in self.policy.keep_out_of_fp8:
            label = repr(sel) if isinstance(sel, str) else sel.__name__
            if self.fp8 is None:
                self.reporter.did_less(("keep_out_of_fp8", "fp8 off"), (
                    f"amp_fx: Policy(keep_out_of_fp8=...) entry {label} changes nothing: fp8 is off. "
                    f"Pass fp8='tensorwise' (or another recipe) to train in fp8, or drop the entry."),
                    stacklevel=6)
            elif not any(_module_matches(sel, path, mtype) for stack in stacks for path, mtype in stack):
                self.reporter.did_less(("keep_out_of_fp8", label), (
                    f"amp_fx: Policy(keep_out_of_fp8=...) entry {label} matched no op in the graphs "
                    f"captured on the first call, so no matmul was kept out of fp8 for it. Name a "
                    f"module that runs matmuls (names are under the module passed to amp_fx.compile, "
                    f"as in its named_modules()), or drop the entry."), stacklevel=6)
        if self.fp8 is None:
            return
        decisions = [d for r in self.records if r.fp8 is not None for d in r.fp8.decisions]
        if any(d.converted for d in decisions):
            return
        if not decisions:
            found = ("no graph of the first call has a matmul with a parameter operand "
                     "(nn.Linear, F.linear, Conv1D's addmm, x @ W)")
        else:
            reasons = Counter(d.reason.removeprefix("not fp8: ").split(";")[0] for d in decisions)
            found = (f"none of its {len(decisions)} matmuls with a parameter operand can run in fp8: "
                     + "; ".join(f"{n} x {why}" for why, n in reasons.most_common(3)))
        self.reporter.did_less(("fp8", "nothing converted"), (
            f"amp_fx: fp8={self.fp8.recipe.value!r} was asked, but {found}. Everything runs in "
            f"{dtype_name(self.dtype)}. amp_fx.explain(model, x, fp8=...) gives each matmul's reason."),
            stacklevel=6)

    def report_no_graph(self, target: object) -> None:
        """Report a call of a compiled model or function that captured and ran no graph."""
        what = type(target).__name__ if isinstance(target, torch.nn.Module) else \
            getattr(target, "__qualname__", repr(target))
        fix = _wrapper_fix(target) or (
            "Dynamo skipped or gave up on every frame of the call (TORCH_LOGS=graph_breaks,"
            "recompiles says why); compile the module that does the work, or run it under "
            "torch.autocast if it cannot be compiled.")
        self.reporter.did_less(("no_graph",), (
            f"amp_fx.compile({what}): this call captured and ran no graph, so it ran as eager "
            f"autocast (the same values, nothing compiled). {fix}"), stacklevel=4)


@dataclass
class _LeafGraphs:
    """The graphs that cast one leaf tensor with the shared leaf cast: per Dynamo frame id, per
    compile of that frame (``frame_compile_id``), how many graphs. Graphs of two frames run in one
    forward; two compiles of one frame are alternatives (recompiles); two graphs of one compile
    are pieces of one captured graph (DDPOptimizer's split at DDP's bucket boundaries)."""

    ref: weakref.ref[torch.Tensor]
    frames: dict[int, dict[int | None, int]] = field(default_factory=dict)

    def add(self, frame: int, attempt: int | None) -> None:
        compiles = self.frames.setdefault(frame, {})
        compiles[attempt] = compiles.get(attempt, 0) + 1

    def split(self) -> bool:
        """Whether two graphs of one forward cast the tensor, each with a cast of its own."""
        return len(self.frames) > 1 or any(n > 1 for c in self.frames.values() for n in c.values())


def _guard_module_hooks() -> None:
    """Make the compile under way guard on module hooks, so that a hook added or removed later
    recompiles (and runs, as in eager) instead of being silently ignored.

    Dynamo skips the guards on empty hook dicts by default (``skip_nnmodule_hook_guards``). It
    builds a frame's guards after its backend returned, so amp_fx turns the setting off here, for
    this compile only, and an end-of-compile callback of Dynamo's turns it back on (a per-call
    toggle would cost about 2.6 us per call). A user who set it to False keeps that.
    """
    config = torch._dynamo.config
    if not config.skip_nnmodule_hook_guards or CompileContext.try_get() is None:
        return  # already guarding (the user's setting, or ours), or not called by Dynamo (no guards)
    handler = torch._dynamo.callback_handler
    if _restore_hook_guard_skip not in handler.end_callbacks:  # reset() clears the callbacks
        handler.register_end_callback(_restore_hook_guard_skip)
    config.skip_nnmodule_hook_guards = False
    _HOOK_GUARDS_ON[0] = True


_HOOK_GUARDS_ON = [False]
"""Whether amp_fx turned Dynamo's hook guards on for the compile under way."""


def _restore_hook_guard_skip(args: object) -> None:
    if _HOOK_GUARDS_ON[0]:
        _HOOK_GUARDS_ON[0] = False
        torch._dynamo.config.skip_nnmodule_hook_guards = True


class _RunCount:
    """A counter shared by a backend and its siblings (a copy shares the object)."""

    def __init__(self) -> None:
        self.count = 0


def _wrapper_fix(target: object) -> str | None:
    """What to do instead when ``target`` is a distributed wrapper Dynamo does not compile through."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if isinstance(target, DistributedDataParallel):
        return ("Dynamo captures nothing through this DistributedDataParallel wrapper; compile "
                "the model inside it instead: DDP(amp_fx.compile(model)).")
    if isinstance(target, torch.nn.Module) and (is_fsdp1(target) or any(
            getattr(p, "_fsdp_flattened", False) for p in target.parameters())):
        # FSDP1 around the model, or the model inside FSDP1 (its parameters are views of
        # FSDP1's FlatParameter, marked _fsdp_flattened).
        return (f"{type(target).__name__} is sharded by FullyShardedDataParallel (FSDP1), whose flat "
                f"parameters and hooks Dynamo does not capture; it trains as eager FSDP1 under autocast. "
                f"To compile it, {FSDP1_ALTERNATIVE}.")
    fsdp_types: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        fsdp_types = [FSDPModule, FullyShardedDataParallel]
    except ImportError:  # pragma: no cover
        pass
    if fsdp_types and isinstance(target, tuple(fsdp_types)):
        return (f"Dynamo captures nothing through this FSDP-sharded {type(target).__name__}; it "
                "trains as eager FSDP under autocast. Compile the unsharded model's layers with "
                "amp_fx.compile before sharding them, or run the model under torch.autocast.")
    return None


def _unobservable(op_names: Sequence[str], cls: CastClass) -> bool:
    """An entry that moves composite ops to NONE lets them decompose: the op itself never appears."""
    registered = _composite_ops()
    return cls is CastClass.NONE and all(n in registered for n in op_names)


@functools.cache
def _composite_ops() -> frozenset[str]:
    return frozenset(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"))


_DOUBLE_BACKWARD = ("amp_fx: a backward with create_graph=True (double backward, as in a gradient "
                    "penalty) reached a graph compiled through AOTAutograd (backend='aot_eager' or "
                    "'inductor'), which cannot differentiate its own backward. Compile this model "
                    "with amp_fx.compile(..., backend='eager'): its casts stay explicit, it supports "
                    "double backward and is bitwise with eager autocast (GradScaler included).")


def _refuse_double_backward(out: Any, guarded: set[type]) -> None:
    """Make a create_graph backward through the AOTAutograd graph that returned ``out`` raise
    amp_fx's error at once, instead of torch's at the second backward.

    AOTAutograd makes one ``torch.autograd.Function`` class per compiled graph; its backward is
    wrapped once (:func:`_guard_backward`) and recorded in ``guarded``; the caller skips this once
    ``guarded`` is not empty (a graph's outputs always come from its one class). A hook on each
    call's node cost about 4 to 8 us per forward+backward of a small model
    (bench/bench_call_overhead.py); it remains the fallback where the class is not what this
    expects."""
    for t in out if isinstance(out, (list, tuple)) else (out,):
        node = t.grad_fn if isinstance(t, torch.Tensor) else None
        if node is None:
            continue
        if type(node) in guarded:
            return
        if "CompiledFunction" not in type(node).__name__:  # an output view: the graph is its parent
            node = next((f for f, _ in node.next_functions
                         if f is not None and "CompiledFunction" in type(f).__name__), None)
            if node is None:
                continue
            if type(node) in guarded:
                return
        if _guard_backward(getattr(type(node), "_forward_cls", None)):
            guarded.add(type(node))
            return
        node.register_prehook(_raise_if_creating_graph)
        return


def _guard_backward(function: object) -> bool:
    """Wrap the ``backward`` of AOTAutograd's Function class for one graph so that it raises
    amp_fx's error when run with grad mode on (create_graph=True): the autograd engine reads
    ``backward`` from the class at each backward. False where the class has no such static
    method (another torch version), and nothing is changed."""
    original = getattr(function, "__dict__", {}).get("backward")
    if not isinstance(original, staticmethod):
        return False
    backward = original.__func__

    def refuse_create_graph(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            raise AmpFxError(_DOUBLE_BACKWARD)
        return backward(ctx, *grads)

    function.backward = staticmethod(refuse_create_graph)  # type: ignore[attr-defined]
    return True


def _raise_if_creating_graph(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
    if torch.is_grad_enabled():
        raise AmpFxError(_DOUBLE_BACKWARD)


class _RootNames:
    """Names under the compiled root module for the objects a Dynamo frame reaches.

    Dynamo names modules and parameters by the expression that reaches them from the frame it
    compiles (``L['self'].head``). That frame is not always the root's: after a graph break inside
    a submodule, Dynamo compiles the submodule's forward as a frame of its own, whose ``self`` is
    the submodule. The expression is evaluated against the frame's real locals, and the object it
    reaches is named by identity, as the root's ``named_modules()``/``named_parameters()`` name it.
    """

    def __init__(self, root: torch.nn.Module | None) -> None:
        self.root = root
        self.scope: dict[str, Any] | None = None
        if root is None:
            return
        try:
            from torch._dynamo.symbolic_convert import InstructionTranslator

            tx = InstructionTranslator.current_tx()
            self.scope = {"__builtins__": {}, "L": tx.f_locals, "G": tx.f_globals,
                          "getattr": getattr}
            first = _frame_self_name(tx.f_code)
        except Exception:  # not called from Dynamo (a test calling the backend directly)
            self.scope, first = None, None
        self._modules = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        # The frame's own module (its first argument, ``self``) when it is a submodule of the
        # root: Dynamo records only the modules called inside the frame, so the ops the frame runs
        # itself would otherwise belong to no module (a graph break inside a submodule, or a
        # DDP/FSDP2 unit compiled on its own).
        own = self.scope["L"].get(first) if self.scope is not None and first else None
        own_name = self._modules.get(id(own)) if isinstance(own, torch.nn.Module) else None
        self.frame_module = (own_name, type(own)) if own_name else None
        self._tensors = {id(t): n for n, t in (*root.named_parameters(remove_duplicate=False),
                                              *root.named_buffers(remove_duplicate=False))}
        self._objects: dict[str, object] = {}

    def _object(self, source: str) -> object | None:
        """The object Dynamo's source expression reaches from the frame's locals (cached)."""
        if self.scope is None:
            return None
        if source not in self._objects:
            try:
                obj = eval(source, self.scope)  # noqa: S307 - Dynamo's own source expression
            except Exception:
                obj = self._walk(source)
            self._objects[source] = obj
        return self._objects[source]

    def _resolve(self, source: str, table: dict[int, str]) -> str | None:
        obj = self._object(source)
        return table.get(id(obj)) if obj is not None else None

    def _walk(self, source: str) -> object | None:
        """``L['module'].2``: Dynamo's module paths are not always Python (an nn.Sequential's
        child is written ``.2``); walk them attribute by attribute from the frame's local."""
        match = re.fullmatch(r"L\['(\w+)'\]((?:\.\w+)*)", source)
        if match is None or self.scope is None:
            return None
        obj = self.scope["L"].get(match.group(1))
        for part in filter(None, match.group(2).split(".")):
            obj = getattr(obj, part, None)
        return obj

    def rename_module_stacks(self, gm: torch.fx.GraphModule) -> None:
        """Rewrite each node's ``nn_module_stack`` sources to names under the root, where found."""
        if self.scope is None:
            return
        for node in gm.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if self.frame_module is not None and node.op in ("call_function", "call_method", "call_module"):
                stack = {"amp_fx_frame_module": self.frame_module, **(stack or {})}
            if not stack:
                continue
            renamed = {}
            for key, value in stack.items():
                name = self._resolve(value[0], self._modules) if isinstance(value[0], str) else None
                renamed[key] = (name, *value[1:]) if name is not None else value
            node.meta["nn_module_stack"] = renamed

    def tensor_name(self, tensor: object) -> str | None:
        return self._tensors.get(id(tensor)) if self.root is not None else None

    def real_tensor(self, node: torch.fx.Node, value: Any) -> Any:
        """The tensor a graph input stands for: ``value`` itself, unless it is a fake tensor.

        Dynamo hands the backend the real parameters, but its DDPOptimizer runs each piece of a
        split graph on fake tensors, and a fake tensor is made anew for each compile: the real one
        is what the placeholder's Dynamo source (``L['self']._modules['fc']._parameters['weight']``)
        reaches from the frame's locals. Without a source or a frame, ``value``.
        """
        if not isinstance(value, FakeTensor) or self.scope is None:
            return value
        source = source_text(node)
        if not source:
            return value
        obj = self._object(source)
        return obj if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) else value


def _frame_self_name(code: Any) -> str | None:
    """The name of the first argument (``self``) of the function a Dynamo frame belongs to.

    A frame resumed after a graph break runs a generated function whose arguments are Dynamo's
    own first; its original code is found through Dynamo's resume-function metadata (a private
    table; when a torch version lacks it, the frame's own module is simply not added).
    """
    try:
        from torch._dynamo.resume_execution import ContinueExecutionCache

        meta = ContinueExecutionCache.generated_code_metadata
        for _ in range(8):  # resumed frames of resumed frames, bounded
            if code not in meta:
                break
            code = meta[code].code
    except Exception:
        pass
    return code.co_varnames[0] if code.co_argcount else None


def _source_name(node: torch.fx.Node) -> str:
    text = source_text(node)
    if not text:
        return node.name
    return ".".join(p for p in module_path(text).split(".") if p not in ("_parameters", "_buffers"))


# --- the pipeline -------------------------------------------------------------------------------


@dataclass
class _GraphWork:
    """What flows through the pipeline for one Dynamo graph; each stage fills in its part."""

    gm: torch.fx.GraphModule
    """Dynamo's graph; after capture the ATen graph, which the passes rewrite in place."""
    fake_args: list[Any]
    fake_mode: FakeTensorMode
    device_type: str
    leaf_flags: list[bool]
    captured: torch.fx.GraphModule | None = None
    """A copy of the ATen graph before the passes (for inspection)."""
    inserted: InsertRecord = field(default_factory=InsertRecord)
    folded: FoldRecord = field(default_factory=FoldRecord)
    index: int = 0
    """The graph's index in the backend's records."""
    watched: WatchRecord | None = None
    data_inputs: list[bool] = field(default_factory=list)
    """Per placeholder: data the caller handed in (see :func:`amp_fx.capture.data_inputs`)."""
    parameter_names: list[str | None] = field(default_factory=list)
    """Per placeholder: the name of the ``nn.Parameter`` it is, None for other inputs
    (``meta.PARAMETER``, for fp8_matmuls)."""
    fp8: Fp8Record | None = None


def _capture(backend: AmpBackend, work: _GraphWork) -> None:
    with work.fake_mode:
        work.gm = capture(work.gm, work.fake_args, policy=backend.policy,
                          device_type=work.device_type, dtype=backend.dtype,
                          leaf_flags=work.leaf_flags)
    work.captured = _copy_graph_module(work.gm)


def _insert_casts(backend: AmpBackend, work: _GraphWork) -> None:
    work.gm, work.inserted = insert_casts(work.gm, policy=backend.policy,
                                          device_type=work.device_type, dtype=backend.dtype,
                                          fake_mode=work.fake_mode)


def _fp8_matmuls(backend: AmpBackend, work: _GraphWork) -> None:
    assert backend.fp8 is not None
    placeholders = [n for n in work.gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, work.parameter_names, strict=True):
        node.meta[meta.PARAMETER] = name
    work.gm, work.fp8 = fp8_matmuls(work.gm, config=backend.fp8, policy=backend.policy,
                                    fake_mode=work.fake_mode)


def _fold_casts(backend: AmpBackend, work: _GraphWork) -> None:
    work.gm, work.folded = fold_casts(work.gm)


def _watch_nonfinite(backend: AmpBackend, work: _GraphWork) -> None:
    with work.fake_mode:
        work.gm, work.watched = watch_nonfinite(work.gm, dtype=backend.dtype, data_inputs=work.data_inputs)


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline: its name (in timings, logs and errors) and what it runs."""

    name: str
    run: Callable[[AmpBackend, _GraphWork], None]
    enabled: Callable[[AmpBackend], bool] = lambda backend: True


PIPELINE: tuple[Stage, ...] = (
    Stage("capture", _capture),
    Stage("insert_casts", _insert_casts),
    Stage("fp8_matmuls", _fp8_matmuls, enabled=lambda backend: backend.fp8 is not None),
    Stage("fold_casts", _fold_casts, enabled=lambda backend: backend.fold),
    Stage("watch_nonfinite", _watch_nonfinite, enabled=lambda backend: backend.watch is not None),
)
"""What the backend runs on every Dynamo graph, in order (see amp_fx/passes/README.md)."""


def leaves_cast_with_shared_cast(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The inputs of ``gm`` that a shared leaf cast casts (``meta.CACHED``: one cast of a weight
    for all its uses, as eager autocast's cast cache), in graph order, each once.

    The one test of "this graph casts that weight": a weight returned for two graphs of one
    forward is split by a graph break (the backend reports it, the inspection tools name it)."""
    out: dict[torch.fx.Node, None] = {}
    for node in gm.graph.nodes:
        src = node.args[0] if node.meta.get(meta.CACHED) and node.args else None
        if isinstance(src, torch.fx.Node) and src.op == "placeholder":
            out.setdefault(src)
    return list(out)


_SPLITS_NOTED_BY_CALLER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "amp_fx_splits_noted_by_caller", default=False)


@contextlib.contextmanager
def splits_noted_by_caller() -> Iterator[None]:
    """Inside: a weight used on both sides of a graph break is not reported by the backend.

    For the inspection tools, which compile a private copy to show how amp_fx differs from
    eager autocast: the difference is what they report (``compare`` names such weights in its
    notes), not a shortfall of the user's compiled model, so strict mode must not fail them.
    """
    token = _SPLITS_NOTED_BY_CALLER.set(True)
    try:
        yield
    finally:
        _SPLITS_NOTED_BY_CALLER.reset(token)


@contextlib.contextmanager
def _running(stage: str, index: int, done: list[str], timings: dict[str, float]) -> Iterator[None]:
    """Time and log one stage; name it (and the stages run before it) when it fails unexpectedly."""
    t0 = time.perf_counter()
    try:
        yield
    except AmpFxError:
        raise
    except Exception as e:
        before = ", ".join(done) or "none"
        raise AmpFxError(f"amp_fx: {stage} failed on graph {index} (passes run before it: {before}): "
                         f"{type(e).__name__}: {e}") from e
    timings[stage] = time.perf_counter() - t0
    done.append(stage)
    log.debug("amp_fx graph %d: %s took %.1f ms", index, stage, 1e3 * timings[stage])


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env = graph.graph_copy(gm.graph, {})
    graph.output(env)
    return torch.fx.GraphModule(gm, graph)
