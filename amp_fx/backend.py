"""The torch.compile backend: capture, run the passes, hand the graph to the downstream backend.

    Dynamo graph --capture--> pre-dispatch ATen graph --insert_casts--> --fold_casts--> downstream

Every graph Dynamo captures (one per graph break) goes through the same pipeline, and each leaves
a :class:`GraphRecord` on the backend, in capture order, for inspection tools.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from tabulate import tabulate
from torch._guards import CompileContext, detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from amp_fx.capture import capture, is_cacheable_leaf, module_path
from amp_fx.errors import AmpFxError
from amp_fx.passes.fold_casts import FoldRecord, fold_casts
from amp_fx.passes.insert_casts import InsertRecord, graph_device_type, insert_casts
from amp_fx.policy import Policy

__all__ = ["AmpBackend", "GraphRecord"]

log = logging.getLogger(__name__)

Backend = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]


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

    @property
    def casts(self) -> int:
        """Casts in the rewritten graph (inserted ones that survived folding, and the user's)."""
        return sum(1 for n in self.rewritten.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default)

    def summary_rows(self) -> list[list[object]]:
        from amp_fx._probe import short_dtype  # _probe imports this module

        ops = sum(1 for n in self.rewritten.graph.nodes if n.op == "call_function")
        return [[self.index, self.device_type, short_dtype(self.dtype), ops,
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


def _downstream(backend: str | Backend, inductor_config: dict[str, Any]) -> Backend:
    if callable(backend):
        return backend
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return functools.partial(compile_fx, config_patches=dict(inductor_config))
    return torch._dynamo.lookup_backend(backend)


class AmpBackend:
    """A torch.compile backend that rewrites each graph for mixed precision, then delegates.

    Its identity (and so Dynamo's cache entries) is per (dtype, policy, downstream backend, fold).
    """

    def __init__(self, *, dtype: torch.dtype, policy: Policy, backend: str | Backend,
                 fold: bool = True, inductor_config: dict[str, Any] | None = None) -> None:
        self.dtype = dtype
        self.policy = policy
        self.fold = fold
        self.backend_name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
        self._downstream = _downstream(backend, inductor_config or {})
        self.records: list[GraphRecord] = []
        # id(leaf tensor) -> (weakref to it, Dynamo frame ids whose graphs cast it with the cache)
        self._cached_leaf_frames: dict[int, tuple[weakref.ref[torch.Tensor], set[int]]] = {}

    def sibling(self) -> AmpBackend:
        """A backend with the same configuration and the same records, but its own identity
        (Dynamo keeps separate cache entries per backend object)."""
        return copy.copy(self)

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
        leaf_flags = [is_cacheable_leaf(r) for r in example_inputs]
        device_type = graph_device_type(fake_args)
        timings: dict[str, float] = {}

        index = len(self.records)
        t0 = time.perf_counter()
        with fake_mode, _naming_failures("capture", index):
            captured = capture(gm, fake_args, policy=self.policy, device_type=device_type,
                               dtype=self.dtype, leaf_flags=leaf_flags)
        before = _copy_graph_module(captured)
        t1 = time.perf_counter()
        with _naming_failures("insert_casts", index):
            rewritten, inserted = insert_casts(captured, policy=self.policy, device_type=device_type,
                                               dtype=self.dtype, fake_mode=fake_mode)
        t2 = time.perf_counter()
        folded = FoldRecord()
        if self.fold:
            with _naming_failures("fold_casts", index):
                rewritten, folded = fold_casts(rewritten)
        t3 = time.perf_counter()
        timings.update(capture=t1 - t0, insert_casts=t2 - t1, fold_casts=t3 - t2)
        record = GraphRecord(index=index, device_type=device_type, dtype=self.dtype,
                             dynamo_graph=gm, captured=before, rewritten=rewritten,
                             inserted=inserted, folded=folded, pass_seconds=timings)
        log.debug("amp_fx graph %d:\n%s", record.index, record)
        return record

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        # amp_fx calls compiled code inside torch.autocast (see amp_fx.compile), so that code
        # Dynamo leaves to eager runs under eager autocast. Inside a captured graph the casts
        # are explicit, so autocast is off while we capture, while the downstream backend traces,
        # and while the compiled graph runs: nothing is cast twice.
        with torch._C._DisableAutocast():
            record = self.rewrite(gm, example_inputs)
            self.records.append(record)
            self._warn_on_leaf_casts_split_by_graph_breaks(record, gm, example_inputs)
            compiled = self._downstream(record.rewritten, example_inputs)

        def run_without_autocast(*args: Any) -> Any:
            with torch._C._DisableAutocast():
                return compiled(*args)

        run_without_autocast._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run_without_autocast


    def _warn_on_leaf_casts_split_by_graph_breaks(
        self, record: GraphRecord, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
    ) -> None:
        """Warn once per weight whose uses a graph break splits (see README, Known differences).

        Eager autocast casts such a weight once per forward and its uses' gradients add up in the
        low dtype; each graph here casts it itself, so they add up in fp32. Recompiles of one
        frame are not a split: graphs are told apart by Dynamo's frame id.
        """
        compile_id = CompileContext.current_compile_id()
        frame = compile_id.frame_id if compile_id is not None else record.index
        ours = [n for n in record.rewritten.graph.nodes if n.op == "placeholder"]
        theirs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        position = {n: i for i, n in enumerate(ours)}
        for node in record.rewritten.graph.nodes:
            if not node.meta.get("amp_fx_cached") or node.args[0] not in position:
                continue
            i = position[node.args[0]]
            tensor = example_inputs[i]
            ref, frames = self._cached_leaf_frames.get(id(tensor), (None, set()))
            if ref is None or ref() is not tensor:
                ref, frames = weakref.ref(tensor), set()
                self._cached_leaf_frames[id(tensor)] = (ref, frames)
            seen = len(frames)
            frames.add(frame)
            if seen == 1 and len(frames) == 2:
                source = getattr(theirs[i], "_dynamo_source", None)
                text = getattr(source, "name", None)
                text = text() if callable(text) else text
                name = ".".join(p for p in module_path(text).split(".")
                                if p not in ("_parameters", "_buffers")) if text else theirs[i].name
                log.warning(
                    "amp_fx: %s is used on both sides of a graph break; each graph casts it to %s "
                    "itself, so its gradient contributions add up in fp32 where eager autocast adds "
                    "them in %s (more accurate, not bitwise)", name,
                    str(self.dtype).replace("torch.", ""), str(self.dtype).replace("torch.", ""))


@contextlib.contextmanager
def _naming_failures(stage: str, index: int) -> Iterator[None]:
    """Name the stage (and the passes before it) when one fails with an unexpected error."""
    stages = ["capture", "insert_casts", "fold_casts"]
    try:
        yield
    except AmpFxError:
        raise
    except Exception as e:
        done = ", ".join(stages[: stages.index(stage)]) or "none"
        raise AmpFxError(f"amp_fx: {stage} failed on graph {index} (passes run before it: {done}): "
                         f"{type(e).__name__}: {e}") from e


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env = graph.graph_copy(gm.graph, {})
    graph.output(env)
    return torch.fx.GraphModule(gm, graph)
