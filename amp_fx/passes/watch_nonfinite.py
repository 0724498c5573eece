"""The ``watch_nonfinite`` pass: a device-side record of the first op whose low-precision output
holds an inf or NaN (``amp_fx.compile(..., watch_nonfinite=True)``, issue 21).

Assumes the rewritten pre-dispatch ATen graph of ``insert_casts``/``fold_casts``: every node's
``meta["val"]`` is true and ``nn_module_stack`` names modules under the compiled root.

For every node in graph order whose value is a tensor of the low-precision dtype (fp16/bf16) made
by a computing op (not a view: its values were checked where they were made; in-place ops are
watched, their value is the tensor they wrote), the pass adds ``any(~isfinite(x))`` right after
the node, so that it sees the value as that op left it (a later in-place op on the same tensor,
such as a residual ``x += shortcut``, would otherwise make an earlier, finite producer look like
the first non-finite op). It stacks those flags into one small bool tensor and appends to the
graph's outputs one int64 0-dim tensor: the position of the first flagged node in
:attr:`WatchRecord.ops`, or -1. The backend strips that output before the caller sees the result
(``amp_fx.overflow.ForwardWatch``). Each check is a full reduction of a value the producing op
has just written; inductor fuses it into the kernel that produces the value where that kernel is
its own (pointwise, reductions), and it reads an extern kernel's output (mm, conv) once more.

Guarantees: the values the graph computed are unchanged (the checks only read; no node is
replaced), no new aliasing (the new output is a fresh tensor), ``meta["val"]`` set on every new
node, and the graph lints.

Example (the backend runs the pass; its record names the watched ops)::

    >>> model = amp_fx.compile(torch.nn.Linear(4, 4), dtype="fp16", backend="aot_eager",
    ...                        watch_nonfinite=True)
    >>> _ = model(torch.randn(2, 4))
    >>> model.amp_fx_records[0].watched.ops[0].op
    'aten.linear'
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from amp_fx._dtype_names import dtype_name
from amp_fx.capture import module_stack

__all__ = ["WatchedOp", "WatchRecord", "watch_nonfinite", "NONE"]

aten = torch.ops.aten

NONE = -1
"""The recorded position when no watched output held an inf/NaN."""


@dataclass(frozen=True)
class WatchedOp:
    """One watched node: where it is and what it computes."""

    module: str
    """The innermost module under the compiled root ("" for the root's own code)."""
    op: str
    """The ATen op, e.g. ``aten.mm`` (a multi-output op's name for each of its outputs)."""
    dtype: str
    """The output dtype's short name (``fp16``, ``bf16``)."""
    node: str
    """The FX node's name in the rewritten graph."""


@dataclass
class WatchRecord:
    """What the pass did to one graph: the watched nodes, in graph order."""

    ops: list[WatchedOp] = field(default_factory=list)


def _op_name(target: object) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__.split('.')[0]}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def _computing_op(node: torch.fx.Node) -> object | None:
    """The op that computed ``node``'s value, or None if ``node`` only aliases its input (a view).
    An in-place op (``add_``) computes the values it writes into the tensor it returns."""
    target = node.target
    if target is operator.getitem:  # one output of a multi-output op
        parent = node.args[0]
        return _computing_op(parent) if isinstance(parent, torch.fx.Node) else None
    if not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    aliased = [r.alias_info for r in schema.returns if r.alias_info is not None]
    if target.is_view or any(not a.is_write for a in aliased):
        return None
    return target


def _watched(node: torch.fx.Node, dtype: torch.dtype) -> object | None:
    if node.op != "call_function":
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != dtype:
        return None
    return _computing_op(node)


def watch_nonfinite(gm: torch.fx.GraphModule, *, dtype: torch.dtype) -> tuple[torch.fx.GraphModule, WatchRecord]:
    """Append the first-non-finite record to ``gm``'s outputs (see the module docstring)."""
    record = WatchRecord()
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    watched: list[torch.fx.Node] = []
    for node in list(graph.nodes):
        op = _watched(node, dtype)
        if op is None:
            continue
        path = module_stack(node)
        record.ops.append(WatchedOp(module=path[-1][0] if path else "", op=_op_name(op),
                                    dtype=dtype_name(dtype), node=node.name))
        watched.append(node)
    flags = []
    for node in watched:
        with graph.inserting_after(node):  # the value as this op left it (see the module docstring)
            finite = _call(graph, aten.isfinite.default, (node,))
        with graph.inserting_after(finite):
            bad = _call(graph, aten.logical_not.default, (finite,))
        with graph.inserting_after(bad):
            flags.append(_call(graph, aten.any.default, (bad,)))
    with graph.inserting_before(output):
        if watched:
            stacked = _call(graph, aten.stack.default, (flags,))
            # argmax of the flags as int32 is the first flagged position (argmax returns the first
            # maximum); -1 where none is flagged.
            as_int = _call(graph, aten._to_copy.default, (stacked,), {"dtype": torch.int32})
            first = _call(graph, aten.argmax.default, (as_int,))
            anyflag = _call(graph, aten.any.default, (stacked,))
            code = _call(graph, aten.where.ScalarOther, (anyflag, first, NONE))
        else:
            code = _call(graph, aten.full.default, ([], NONE), {"dtype": torch.int64, "device": _device(gm)})
    outs = output.args[0]
    output.args = ((*outs, code) if isinstance(outs, (tuple, list)) else (outs, code),)
    graph.lint()
    gm.recompile()
    return gm, record


def _call(graph: torch.fx.Graph, target: object, args: tuple[object, ...],
          kwargs: dict[str, object] | None = None) -> torch.fx.Node:
    node = graph.call_function(target, args, kwargs or {})  # type: ignore[arg-type]
    vals = torch.fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    node.meta["val"] = target(*vals[0], **vals[1])  # type: ignore[operator]
    return node


def _device(gm: torch.fx.GraphModule) -> torch.device:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")
