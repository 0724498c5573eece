"""Weights whose uses a graph break splits: each graph casts such a weight itself, so its
gradient contributions add up in fp32 where eager autocast adds them in the low dtype
(docs/parity.md, Known differences). :class:`SplitTracker` follows the graphs that cast each
weight, per Dynamo frame and compile, and reports a split once per weight.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._guards import CompileContext

from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.report import Reporter
from amp_fx.backend.names import RootNames, source_name
from amp_fx.passes import meta
from amp_fx.passes.fx_edit import placeholders
from amp_fx.passes.pipeline import GraphRecord

__all__ = ["SplitTracker", "leaves_cast_with_shared_cast", "splits_noted_by_caller", "noted_by_caller"]

log = logging.getLogger(__name__)


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
    "amp_fx_splits_noted_by_caller", default=False
)


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


def noted_by_caller() -> bool:
    """Whether an inspection tool runs the compile (inside :func:`splits_noted_by_caller`): what it
    shows is not a shortfall of the user's compiled model (an fp8 request honoured nowhere, too)."""
    return _SPLITS_NOTED_BY_CALLER.get()


@dataclass
class _LeafGraphs:
    """The graphs that cast one leaf tensor with the shared leaf cast: per Dynamo frame id, per
    compile of that frame (``frame_compile_id``), how many graphs, in its latest trace. Graphs of
    two frames run in one forward; two compiles of one frame are alternatives (recompiles); two
    graphs of one trace of one compile are pieces of one captured graph (DDPOptimizer's split at
    DDP's bucket boundaries). A compile whose trace Dynamo restarted (``RestartAnalysis``, the
    trace's ``attempt`` + 1) hands the backend its graph again: the earlier trace's graphs are gone."""

    ref: weakref.ref[torch.Tensor]
    frames: dict[int, dict[int | None, tuple[int, int]]] = field(default_factory=dict)

    def add(self, frame: int, attempt: int | None, trace: int) -> None:
        compiles = self.frames.setdefault(frame, {})
        seen, count = compiles.get(attempt, (trace, 0))
        compiles[attempt] = (trace, count + 1 if seen == trace else 1)

    def split(self) -> bool:
        """Whether two graphs of one forward cast the tensor, each with a cast of its own."""
        return len(self.frames) > 1 or any(n > 1 for c in self.frames.values() for _, n in c.values())


class SplitTracker:
    """The graphs of one compiled entry point that cast each weight with the shared leaf cast.

    A backend's sibling (another entry point of the same model, whose graphs repeat the whole
    forward) has a tracker of its own: a weight in its graphs and in the first one's is not split.
    """

    def __init__(self, dtype: torch.dtype, reporter: Reporter) -> None:
        self.dtype = dtype
        self.reporter = reporter
        # id(leaf tensor) -> the graphs that cast it with the shared leaf cast
        self._cached_leaf_frames: dict[int, _LeafGraphs] = {}
        # (frame id, frame compile id) -> the CompileId of the compile that had them
        self._compiles: dict[tuple[int, int | None], object] = {}

    def report(
        self, record: GraphRecord, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], names: RootNames
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
        known by the real tensor its placeholder's Dynamo source reaches (:meth:`RootNames.real_tensor`).
        """
        compile_id = CompileContext.current_compile_id()
        trace_id = CompileContext.current_trace_id()
        trace = trace_id.attempt if trace_id is not None else 0
        if compile_id is not None and compile_id.frame_id is not None:
            frame, attempt = compile_id.frame_id, compile_id.frame_compile_id
            self._start_afresh_after_reset(frame, attempt, compile_id)
        else:  # the backend called directly (tests): each graph is a frame of its own
            frame, attempt = record.index, 0
        ours = placeholders(record.rewritten.graph)
        theirs = placeholders(gm.graph)
        position = {n: i for i, n in enumerate(ours)}
        for leaf in leaves_cast_with_shared_cast(record.rewritten):
            i = position[leaf]
            tensor = names.real_tensor(theirs[i], example_inputs[i])
            graphs = self._cached_leaf_frames.get(id(tensor))
            if graphs is None or graphs.ref() is not tensor:
                graphs = _LeafGraphs(weakref.ref(tensor))
                self._cached_leaf_frames[id(tensor)] = graphs
            was_split = graphs.split()
            graphs.add(frame, attempt, trace)
            if was_split or not graphs.split():
                continue
            name = names.tensor_name(tensor) or source_name(theirs[i])
            low = dtype_name(self.dtype)
            if len(graphs.frames) > 1:
                where = "is used on both sides of a graph break"
                fix = (
                    "Remove the graph break (TORCH_LOGS=graph_breaks says where it is), or pass "
                    "weight_cache=True (one cast shared by every graph of the forward),"
                )
            else:
                where = (
                    "is used in two of the graphs Dynamo's DDPOptimizer splits one captured "
                    "graph into at DDP's bucket boundaries"
                )
                fix = (
                    "Pass weight_cache=True (one cast shared by every graph of the forward), or "
                    "set torch._dynamo.config.optimize_ddp = False (one graph, no overlap of the "
                    "all-reduce with the backward),"
                )
            if _SPLITS_NOTED_BY_CALLER.get():
                log.debug("amp_fx: %s %s", name, where)
                continue
            self.reporter.did_less(
                ("used across a graph break", name),
                (
                    f"amp_fx: {name} {where}; each graph casts it to {low} itself, so its gradient "
                    f"contributions add up in fp32 where eager autocast adds them in {low} (more "
                    f"accurate, not bitwise). {fix} to match eager autocast bit for bit."
                ),
            )

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
