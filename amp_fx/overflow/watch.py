"""The forward watch: the first non-finite op of a compiled model's forward, kept on the device.

With ``watch_nonfinite=True`` each rewritten graph returns the position of its first op whose
low-precision output held an inf/NaN (``amp_fx.passes.watch_nonfinite``); the model's
:class:`ForwardWatch` keeps the first such op since it was last taken, across graphs and
micro-batches. A watch made for a compiled module registers itself (weakly) with that module, so
that a ``GradScaler`` that was not told which model it trains can find it by the parameters its
optimizer holds (:func:`watched_models`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from amp_fx._common.running_unit import renamed
from amp_fx._common.unwrap import layers
from amp_fx._dist.found_inf import running_ddp
from amp_fx.overflow.report import FirstOp
from amp_fx.passes.watch_nonfinite import NONE, WatchedOp

__all__ = ["ForwardWatch", "GRAPH_STRIDE", "compiled_models", "forward_watch", "register_compiled", "watched_models"]

GRAPH_STRIDE = 1 << 24
"""A record is graph key * GRAPH_STRIDE + position in that graph's watched ops. A forward graph's
key is its index; its backward graph's (amp_fx/passes/watch_backward.py) is BACKWARD + index, so a
record combined across ranks (MIN) prefers a forward op to a backward one, and records stay below
2^41 (amp_fx/_dist/found_inf.py packs them with the rank)."""
BACKWARD = 1 << 16
_ALIAS = 1 << 15
"""Keys from here (forward) and from BACKWARD + here (backward) are aliases: a graph shared by the
units of one group (a repeated block's region) as run by a unit other than the one it was compiled
in, its ops renamed for that unit (``amp_fx._common.running_unit``)."""

# The watches of compiled modules alive, oldest first (weak: a watch lives as long as its model).
_WATCHED: list[weakref.ref[ForwardWatch]] = []
# Every module amp_fx.compile compiled, watched or not (weak): a GradScaler told nothing names the
# gradients after the one that holds its optimizer's parameters.
_COMPILED: list[weakref.ref[torch.nn.Module]] = []


class ForwardWatch:
    """The record shared by a compiled model's graphs (its backend and siblings): the first op, in
    the order the graphs ran, of the forward graphs and of their backward graphs
    (``amp_fx.passes.watch_backward``), whose low-precision output created an inf/NaN.

    ``root``: the module that was compiled (None for a function): the watch registers itself with
    it for :func:`watched_models`.
    """

    def __init__(self, root: torch.nn.Module | None = None) -> None:
        self.ops: dict[int, list[WatchedOp]] = {}
        self.first: torch.Tensor | None = None
        """int64 0-dim: the first non-finite op since the last :meth:`take`, or -1."""
        self._root = None if root is None else weakref.ref(root)
        self._ddp: weakref.ref[torch.nn.Module] | None = None
        self.backward_unwatched = ""
        """Why the backward graphs are not watched ("" where they are: aot_eager, inductor)."""
        self._units: dict[int, str] = {}  # forward graph index -> the unit it was compiled in
        self._aliases: dict[tuple[int, str], int] = {}  # (key, running unit) -> alias key
        self._aliased: dict[int, tuple[int, str, str]] = {}  # alias key -> (key, compiled in, running)
        self._backward_unit: dict[int, str] = {}  # forward graph index -> the unit whose backward runs
        if root is not None:
            _WATCHED.append(weakref.ref(self))

    @staticmethod
    def backward_key(index: int) -> int:
        """The key of forward graph ``index``'s backward graph in :attr:`ops` and in :meth:`ran`."""
        return BACKWARD + index

    @property
    def watched(self) -> tuple[str, ...]:
        return ("forward",) if self.backward_unwatched else ("forward", "backward")

    @property
    def root(self) -> torch.nn.Module | None:
        """The compiled module (None for a function, or once the module is gone)."""
        return None if self._root is None else self._root()

    @property
    def ddp(self) -> torch.nn.Module | None:
        """The ``DistributedDataParallel`` module whose forward ran this watch's graphs, if any: the
        module whose ranks train it together (``DDP(amp_fx.compile(model))``)."""
        return None if self._ddp is None else self._ddp()

    def add_graph(self, index: int, ops: Sequence[WatchedOp], *, unit: str | None = None) -> None:
        """Graph ``index``'s watched ops; ``unit``: the compiled unit (a region's block) whose call
        compiled it, and whose module names its ops carry."""
        if len(ops) >= GRAPH_STRIDE:
            raise ValueError(f"amp_fx: graph {index} has {len(ops)} watched ops, more than {GRAPH_STRIDE}")
        self.ops[index] = list(ops)
        if unit is not None:
            self._units[index] = unit

    def ran_forward(self, index: int, out: Any, unit: str | None) -> Any:
        """Forward graph ``index`` ran in ``unit``: its record (the last output) is kept, under an
        alias key where ``unit`` is not the unit it was compiled in, and the other outputs are
        returned. The backward of that run is then recorded for ``unit`` too (a pre-hook on its
        autograd node says which unit's backward runs)."""
        key = self._key(index, index, unit)
        self.ran(key, out[-1])
        out = type(out)(out[:-1])
        if key != index and unit is not None:
            node = _compiled_node(out)
            if node is not None:
                node.register_prehook(functools.partial(self._backward_of, index, unit))
        elif index in self._units:
            self._backward_unit.pop(index, None)
        return out

    def _backward_of(self, index: int, unit: str, grad_outputs: Any) -> None:
        self._backward_unit[index] = unit

    def ran_backward(self, key: int, position: torch.Tensor) -> None:
        """The backward of forward graph ``key - BACKWARD`` ran; named for the unit whose forward
        run it differentiates."""
        index = key - BACKWARD
        self.ran(self._key(key, index, self._backward_unit.pop(index, None)), position)

    def _key(self, key: int, index: int, unit: str | None) -> int:
        """``key`` (graph ``index``'s forward or backward key) as run by ``unit``: itself where the
        graph was not compiled in a unit or ``unit`` compiled it, else an alias."""
        compiled_in = self._units.get(index)
        if compiled_in is None or unit is None or unit == compiled_in:
            return key
        alias = self._aliases.get((key, unit))
        if alias is None:
            same_side = sum(1 for k in self._aliased if (k >= BACKWARD) == (key >= BACKWARD))
            alias = (BACKWARD if key >= BACKWARD else 0) + _ALIAS + same_side
            self._aliases[(key, unit)] = alias
            self._aliased[alias] = (key, compiled_in, unit)
        return alias

    def ran(self, index: int, position: torch.Tensor) -> None:
        """A graph ran; ``position`` is its in-graph record (-1 when its outputs were finite)."""
        if self._ddp is None and self._root is not None and (ddp := running_ddp()) is not None:
            self._ddp = weakref.ref(ddp)
        code = torch.where(position == NONE, NONE, position + index * GRAPH_STRIDE)
        if self.first is None:
            self.first = code.clone()
            return
        self.first.copy_(torch.where(self.first == NONE, code, self.first))

    def peek(self, device: torch.device) -> torch.Tensor:
        """The record so far (a copy; -1 before any run), without a fresh start."""
        if self.first is None:
            return torch.full((), NONE, dtype=torch.int64, device=device)
        return self.first.clone()

    def take(self) -> torch.Tensor | None:
        """The record since the last take (a copy), and a fresh start; None before any run."""
        if self.first is None:
            return None
        taken = self.first.clone()
        self.first.fill_(NONE)
        return taken

    def describe(self, code: int, rank: int | None = None) -> FirstOp | None:
        """The op a record names; ``rank``: the rank whose forward it was (a record combined across
        ranks names an op of that rank's graphs, the same as this rank's unless one recompiled)."""
        if code == NONE:
            return None
        key, position = divmod(code, GRAPH_STRIDE)
        ops = self.ops.get(key, [])
        aliased = self._aliased.get(key)
        if aliased is not None:  # a shared graph run by another unit: its names for that unit
            key, compiled_in, unit = aliased
            ops = [replace(op, module=renamed(op.module, compiled_in, unit)) for op in self.ops.get(key, [])]
        backward = key >= BACKWARD
        graph = key - BACKWARD if backward else key
        if position >= len(ops):
            which = "the backward of graph" if backward else "graph"
            return FirstOp(
                module="<unknown>",
                op=f"<op {position} of {which} {graph}, not compiled on this rank>",
                dtype="?",
                graph=graph,
                node="",
                rank=rank,
                backward=backward,
            )
        op = ops[position]
        return FirstOp(
            module=op.module,
            op=op.op,
            dtype=op.dtype,
            graph=graph,
            node=op.node,
            rank=rank,
            backward=backward,
            grad_of=op.grad_of or "",
            incoming=op.incoming,
        )


def forward_watch(model: object) -> ForwardWatch | None:
    """The :class:`ForwardWatch` of a model compiled with ``watch_nonfinite=True`` (under DDP and
    ``torch.compile`` wrappers too), else None."""
    for layer in layers(model, any_module_attr=True):
        watch = getattr(layer, "amp_fx_watch", None)
        if isinstance(watch, ForwardWatch):
            return watch
    return None


def watched_models() -> list[tuple[torch.nn.Module, ForwardWatch]]:
    """The modules compiled with ``watch_nonfinite=True`` that are alive, with their watches, in
    the order they were compiled."""
    live = []
    for ref in list(_WATCHED):
        watch = ref()
        root = None if watch is None else watch.root
        if watch is None or root is None:
            _WATCHED.remove(ref)
        else:
            live.append((root, watch))
    return live


def register_compiled(root: torch.nn.Module) -> None:
    """Note (weakly) that ``amp_fx.compile`` compiled ``root``, for :func:`compiled_models`."""
    if not any(ref() is root for ref in _COMPILED):
        _COMPILED.append(weakref.ref(root))


def compiled_models() -> list[torch.nn.Module]:
    """The modules compiled by ``amp_fx.compile`` that are alive, in the order they were compiled."""
    live = []
    for ref in list(_COMPILED):
        root = ref()
        if root is None:
            _COMPILED.remove(ref)
        else:
            live.append(root)
    return live


def _compiled_node(out: Any) -> Any:
    """The autograd node of a compiled graph's run (AOTAutograd's ``CompiledFunctionBackward``)
    among its outputs' ``grad_fn`` and their inputs (an output that is a view of another is
    regenerated outside the node); None where no output requires grad."""
    for t in out:
        fn = getattr(t, "grad_fn", None)
        for node in (fn, *(n for n, _ in getattr(fn, "next_functions", ()))):
            if node is not None and type(node).__name__.startswith("CompiledFunction"):
                return node
    return None
